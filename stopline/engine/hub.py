"""Models by name from the Hugging Face Hub, through the hub's own client (``huggingface_hub``).

    --model hf:OWNER/REPO[:QUANT]      the repository's GGUF whose file name carries QUANT
    --model hf:OWNER/REPO/FILE.gguf    that file

:func:`resolve` turns such a name into a file in the hub's own cache
(``HF_HOME``, ``HF_HUB_CACHE``), downloading what is missing, so that other
tools that use the hub share the files, and the loader gets a path as it
always does. ``HF_TOKEN``, ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` work as they
do for those tools: the hub client reads them. What Stopline adds:

- a quant tag picks a GGUF by its file name, case-insensitively, as
  llama-server's ``-hf`` does; a tag that matches no model, or several, is one
  line that lists what the repository has;
- a split GGUF (``NAME-00001-of-00003.gguf``) downloads every part into one
  folder, where llama.cpp finds the others beside the first;
- every file downloaded is checked against the SHA-256 the hub lists for it
  (the hub client checks sizes, not contents), and its first bytes must be a
  GGUF's; a file that fails either is removed from the cache again;
- every failure is a :class:`HubError`, one line for the user (exit 2).

``python -m stopline models`` lists the GGUF models in the hub's cache and
``models rm`` deletes one, through the hub's cache API.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..protocol.errors import UsageError
from .model_check import SPLIT_PART

if TYPE_CHECKING:
    from huggingface_hub import HFCacheInfo

# What a --model value starts with to name a model on the hub.
HUB_PREFIX = "hf:"
# llama-server's tag when none is given: the quantization most repositories offer.
DEFAULT_QUANT = "Q4_K_M"
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_QUANT = re.compile(r"[A-Za-z0-9_.-]+")


class HubError(UsageError):
    """A model named on the hub cannot be had: one line that says why and what would work."""


def is_hub_model(value: str | None) -> bool:
    return value is not None and value.startswith(HUB_PREFIX)


@dataclass(frozen=True)
class HubModelName:
    """What a user named: a repository, and a quant tag or a file in it (or neither)."""

    repo_id: str
    quant: str | None = None
    filename: str | None = None

    @classmethod
    def parse(cls, text: str) -> HubModelName:
        """``[hf:]OWNER/REPO``, ``…:QUANT`` or ``…/FILE.gguf``; raises HubError."""
        name = text.removeprefix(HUB_PREFIX)
        usage = (
            f"{text!r} is not a model on the hub: give hf:OWNER/REPO, hf:OWNER/REPO:QUANT or hf:OWNER/REPO/FILE.gguf"
        )
        owner, _, rest = name.partition("/")
        repo, slash, filename = rest.partition("/")
        repo, colon, quant = repo.partition(":")
        repo_id = f"{owner}/{repo}"
        if not _REPO_ID.fullmatch(repo_id) or (slash and colon):
            raise HubError(usage)
        if colon:
            if not _QUANT.fullmatch(quant):
                raise HubError(usage)
            return cls(repo_id, quant=quant)
        if slash:
            if not filename.lower().endswith(".gguf") or ".." in filename.split("/"):
                raise HubError(f"{text!r}: a file named on the hub must be a .gguf file in the repository")
            return cls(repo_id, filename=filename)
        return cls(repo_id)

    @property
    def served_name(self) -> str:
        """The model's name in answers and /v1/models: the repository, and the quant or file asked for."""
        if self.quant is not None:
            return f"{self.repo_id}:{self.quant}"
        if self.filename is not None:
            return f"{self.repo_id}/{self.filename}"
        return self.repo_id


@dataclass(frozen=True)
class RemoteFile:
    """A file of a repository as the hub lists it: its size, and the hash its contents must have."""

    path: str
    size: int | None
    # The SHA-256 of an LFS file (every large file), else the git blob id of a small one.
    sha256: str | None = None
    git_sha1: str | None = None


@dataclass(frozen=True)
class GGUFModel:
    """One model of a repository: a GGUF file, or every part of a split one, first part first."""

    files: tuple[RemoteFile, ...]

    @property
    def first(self) -> RemoteFile:
        return self.files[0]

    @property
    def label(self) -> str:
        """What names it in a listing: its file, or its first part and how many there are."""
        if len(self.files) == 1:
            return self.first.path
        return f"{self.first.path} (+{len(self.files) - 1} parts)"

    @property
    def size(self) -> int | None:
        sizes = [f.size for f in self.files]
        return None if None in sizes else sum(s for s in sizes if s is not None)

    def matches(self, quant: str) -> bool:
        """Whether the tag names this model: it is in the file name, case-insensitively, as a
        whole field (between the start, a folder, '-', '_' or '.', and '-', '.' or the end):
        Q4_K_M matches model-Q4_K_M.gguf, not model-IQ4_K_M.gguf; Q4_K matches Q4_K_M and Q4_K_S."""
        name = SPLIT_PART.sub(r"\g<stem>.gguf", self.first.path)
        field = rf"(?:^|[/._-]){re.escape(quant)}(?:[._-]|$)"
        return re.search(field, name.removesuffix(".gguf"), re.IGNORECASE) is not None


def gguf_models(files: Iterable[RemoteFile]) -> list[GGUFModel]:
    """The models among a repository's files: each GGUF, its split parts together. A vision
    projector (``mmproj``) is not a model; a split model with a part missing is left out."""
    singles: list[GGUFModel] = []
    splits: dict[tuple[str, int], dict[int, RemoteFile]] = {}
    for file in files:
        name = file.path.rsplit("/", 1)[-1].lower()
        if not name.endswith(".gguf") or "mmproj" in name:
            continue
        part = SPLIT_PART.match(file.path)
        if part is None:
            singles.append(GGUFModel((file,)))
        else:
            splits.setdefault((part["stem"], int(part["parts"])), {})[int(part["part"])] = file
    for (_, count), parts in splits.items():
        if sorted(parts) == list(range(1, count + 1)):
            singles.append(GGUFModel(tuple(parts[n] for n in range(1, count + 1))))
    return sorted(singles, key=lambda m: m.first.path)


def choose(models: list[GGUFModel], name: HubModelName, where: str) -> GGUFModel:
    """The model ``name`` asks for among a repository's ``models``; raises HubError listing them."""
    if name.filename is not None:
        for model in models:
            if model.first.path == name.filename or any(f.path == name.filename for f in model.files[1:]):
                return model
        raise HubError(f"hf:{name.repo_id} has no file {name.filename!r}{where}; {_listed(models, name)}")
    if not models:
        raise HubError(f"hf:{name.repo_id} has no GGUF model{where}")
    if name.quant is None:
        if len(models) == 1:
            return models[0]
        # llama-server's default tag, when it names exactly one.
        default = [m for m in models if m.matches(DEFAULT_QUANT)]
        if len(default) == 1:
            return default[0]
        raise HubError(
            f"hf:{name.repo_id} has {len(models)} GGUF models{where}, and a tag or a file must name one; "
            f"{_listed(models, name)}"
        )
    matched = [m for m in models if m.matches(name.quant)]
    if len(matched) == 1:
        return matched[0]
    if matched:
        raise HubError(
            f"the tag {name.quant!r} matches {len(matched)} models in hf:{name.repo_id}{where}: "
            f"{_listed(matched, name)}"
        )
    raise HubError(f"no GGUF in hf:{name.repo_id} matches the tag {name.quant!r}{where}; {_listed(models, name)}")


def _listed(models: list[GGUFModel], name: HubModelName) -> str:
    shown = ", ".join(f"{m.label} ({_size(m.size)})" for m in models)
    return (
        f"it has {shown}. Give a tag from a file name (hf:{name.repo_id}:TAG) or the file (hf:{name.repo_id}/FILE.gguf)"
        if models
        else "it has no GGUF model"
    )


def _size(size: int | None) -> str:
    if size is None:
        return "size unknown"
    if size >= 1e9:
        return f"{size / 1e9:.1f} GB"
    return f"{size / 1e6:.0f} MB" if size >= 1e6 else f"{size / 1e3:.0f} kB"


@dataclass(frozen=True)
class Resolved:
    """A model named on the hub, as the loader takes it: its first file, and its served name."""

    path: Path
    name: str


@dataclass(frozen=True)
class _Listing:
    commit: str
    files: tuple[RemoteFile, ...]
    # Listed from the cache (offline, or the hub could not be reached): nothing to download.
    cached: bool
    # Why the cache was listed although the hub was not switched off (HF_HUB_OFFLINE); None: it was not.
    fallback: str | None = None


def resolve(text: str, progress: bool = True) -> Resolved:
    """The local path of the model ``text`` names (``hf:…``), downloaded into the hub's cache if
    it is not there; raises HubError with one line. A download interrupted by the process's end
    (Ctrl-C) leaves nothing behind: the hub client writes to a temporary file it removes."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, HTTPError

    name = HubModelName.parse(text)
    listing = _listing(name)
    if listing.fallback and progress:
        print(f"stopline: {listing.fallback}; using the hub's cache", file=sys.stderr, flush=True)
    where = " in the hub's cache" if listing.cached else ""
    model = choose(gguf_models(listing.files), name, where)
    cached = {f.path: _cached_path(name.repo_id, f.path, listing.commit) for f in model.files}
    missing = [f for f in model.files if cached[f.path] is None]
    if missing and listing.cached:
        raise HubError(f"hf:{name.repo_id}: the hub's cache has only part of {model.label}; connect to finish it")
    if missing:
        _check_room(sum(f.size or 0 for f in missing), Path(constants.HF_HUB_CACHE), model)
        if progress:
            print(
                f"Downloading {name.served_name} ({model.label}, {_size(model.size)}) into {constants.HF_HUB_CACHE}",
                file=sys.stderr,
                flush=True,
            )
    paths = []
    for file in model.files:
        try:
            # By branch, not commit: the hub client then records main's commit in the cache, where
            # an offline start finds it.
            path = Path(hf_hub_download(name.repo_id, file.path, revision="main"))
        except HfHubHTTPError as exc:
            raise HubError(_http_problem(name, exc)) from None
        except (HTTPError, OSError) as exc:
            # The hub client has removed what it wrote of this file; parts already complete stay.
            raise HubError(f"hf:{name.repo_id}: downloading {file.path} failed: {_one_line(exc)}") from None
        if cached[file.path] is None:
            _verify_download(name, file, path)
        paths.append(path)
    return Resolved(paths[0], name.served_name)


def _listing(name: HubModelName) -> _Listing:
    """The repository's files: from the hub, or from the cache when offline or when the hub
    cannot be reached (as the hub client itself falls back to the cache)."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError, HTTPError

    if constants.is_offline_mode():
        return _cached_listing(name, "HF_HUB_OFFLINE is set", offline=True)
    try:
        info = HfApi().model_info(name.repo_id, files_metadata=True)
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status is not None and status < 500:
            raise HubError(_http_problem(name, exc)) from None
        return _cached_listing(name, f"the hub at {constants.ENDPOINT} answered {status}")
    except (HTTPError, OSError) as exc:
        return _cached_listing(name, f"cannot reach the hub at {constants.ENDPOINT} ({_one_line(exc)})")
    if not info.sha:
        raise HubError(f"hf:{name.repo_id}: the hub at {constants.ENDPOINT} named no commit for it")
    files = tuple(
        RemoteFile(
            s.rfilename,
            s.size,
            sha256=s.lfs.sha256 if s.lfs is not None else None,
            git_sha1=s.blob_id,
        )
        for s in info.siblings or ()
    )
    return _Listing(info.sha, files, cached=False)


def _cached_listing(name: HubModelName, why: str, offline: bool = False) -> _Listing:
    """The files the hub's cache holds of the repository, at the commit its main ref names."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    folder = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=name.repo_id, repo_type="model")
    ref = folder / "refs" / "main"
    snapshot = folder / "snapshots" / (ref.read_text().strip() if ref.is_file() else "")
    if not ref.is_file() or not snapshot.is_dir():
        raise HubError(f"{why}, and the hub's cache ({constants.HF_HUB_CACHE}) has no hf:{name.repo_id}")
    files = tuple(
        RemoteFile(p.relative_to(snapshot).as_posix(), p.stat().st_size)
        for p in sorted(snapshot.rglob("*"))
        if p.is_file()
    )
    return _Listing(snapshot.name, files, cached=True, fallback=None if offline else why)


def _cached_path(repo_id: str, path: str, commit: str) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, path, revision=commit)
    return Path(found) if isinstance(found, str) else None


def _check_room(needed: int, cache: Path, model: GGUFModel) -> None:
    """Refuse at once a download the disk has no room for, rather than fill it part-way."""
    folder = cache
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise HubError(
            f"{model.label} needs {_size(needed)} and the disk of the hub's cache ({cache}) has {_size(free)} free"
        )


def _verify_download(name: HubModelName, file: RemoteFile, path: Path) -> None:
    """A file just downloaded must hash to what the hub lists, and be a GGUF; else it goes."""
    from huggingface_hub.utils.sha import git_hash, sha_fileobj

    with open(path, "rb") as f:
        if file.sha256 is not None:
            expected, actual = file.sha256, sha_fileobj(f).hex()
        elif file.git_sha1 is not None:
            expected, actual = file.git_sha1, git_hash(f.read())
        else:
            expected = actual = ""
    if actual != expected:
        _forget([file.path], name.repo_id)
        raise HubError(
            f"hf:{name.repo_id}: {file.path} does not match the hub's SHA-256 (expected {expected[:16]}…, "
            f"got {actual[:16]}…): the download was damaged or tampered with, and was removed"
        )
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        _forget([file.path], name.repo_id)
        raise HubError(f"hf:{name.repo_id}: {file.path} is not a GGUF file (it starts with {magic!r}), and was removed")


def _scan_cache() -> HFCacheInfo | None:
    """The hub's cache, through its cache API; None when there is no cache yet."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        return scan_cache_dir()
    except CacheNotFound:
        return None


def _forget(paths: list[str], repo_id: str) -> None:
    """Remove these files of the repository from the hub's cache, and the repository's entry
    once nothing is left of it, through the cache API."""
    cache = _scan_cache()
    if cache is None:
        return
    for repo in cache.repos:
        if repo.repo_id != repo_id or repo.repo_type != "model":
            continue
        doomed = [f for r in repo.revisions for f in r.files if _repo_path(f.file_path, r.snapshot_path) in paths]
        if len(doomed) == repo.nb_files:
            cache.delete_revisions(*(r.commit_hash for r in repo.revisions)).execute()
        elif doomed:
            cache.delete_files(*doomed).execute()


def _repo_path(file_path: Path, snapshot: Path) -> str:
    return file_path.relative_to(snapshot).as_posix()


def _http_problem(name: HubModelName, exc: Exception) -> str:
    """One line for a refusal by the hub, by its status: what is wrong and what would work."""
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError

    response = getattr(exc, "response", None)
    status = response.status_code if response is not None else None
    where = f"hf:{name.repo_id}"
    if isinstance(exc, GatedRepoError):
        return f"{where} is gated: accept its terms on its page on the hub, and set HF_TOKEN (HTTP {status})"
    if status == 401:
        return (
            f"{where}: the hub refused access (HTTP 401): a private or gated repository needs a token with "
            "access to it in HF_TOKEN (or from 'hf auth login'), or the repository does not exist"
        )
    if status == 403:
        return f"{where}: the hub refused access (HTTP 403): the token in HF_TOKEN has no access to it"
    if status == 404:
        return f"{where}: no such repository or file on the hub at {constants.ENDPOINT} (HTTP 404)"
    return f"{where}: the hub at {constants.ENDPOINT} answered HTTP {status}: {_one_line(exc)}"


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]


# --- stopline models ---------------------------------------------------------------------


@dataclass(frozen=True)
class CachedModel:
    """A GGUF model in the hub's cache: its repository, files and size."""

    repo_id: str
    model: GGUFModel
    size: int

    @property
    def name(self) -> str:
        """The --model value that loads it: its exact file."""
        return f"{HUB_PREFIX}{self.repo_id}/{self.model.first.path}"


def cached_models() -> list[CachedModel]:
    """Every GGUF model in the hub's cache, through the cache API."""
    cache = _scan_cache()
    if cache is None:
        return []
    found = []
    for repo in sorted(cache.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for revision in repo.revisions:
            files = {_repo_path(f.file_path, revision.snapshot_path): f for f in revision.files}
            for model in gguf_models(RemoteFile(path, f.size_on_disk) for path, f in files.items()):
                size = sum(files[f.path].size_on_disk for f in model.files)
                found.append(CachedModel(repo.repo_id, model, size))
    return found


def models_command(argv: list[str]) -> int:
    """``stopline models [rm OWNER/REPO[:QUANT or /FILE]]``: the GGUF models in the hub's cache."""
    from huggingface_hub import constants

    p = argparse.ArgumentParser(
        prog="python -m stopline models",
        description=(
            f"The GGUF models in the Hugging Face hub's cache ({constants.HF_HUB_CACHE}; HF_HOME or HF_HUB_CACHE "
            "move it), which --model hf:OWNER/REPO[:QUANT] downloads into and other tools share."
        ),
    )
    actions = p.add_subparsers(dest="action")
    remove = actions.add_parser("rm", help="delete a model from the cache: a repository's, or one quant or file")
    remove.add_argument("model", metavar="OWNER/REPO[:QUANT or /FILE]")
    args = p.parse_args(argv)
    if args.action == "rm":
        try:
            freed = remove_model(args.model)
        except HubError as exc:
            print(f"stopline: {exc}", file=sys.stderr)
            return 2
        print(f"deleted {args.model.removeprefix(HUB_PREFIX)} from {constants.HF_HUB_CACHE}: {_size(freed)} freed")
        return 0
    models = cached_models()
    for cached in models:
        print(f"{_size(cached.size):>10}  {cached.name}")
    total = sum(m.size for m in models)
    print(f"{len(models)} GGUF models, {_size(total)} in {constants.HF_HUB_CACHE}")
    return 0


def remove_model(text: str) -> int:
    """Delete from the hub's cache what ``text`` names (a whole repository, or one of its models),
    through the cache API; return the bytes freed. Raises HubError."""
    name = HubModelName.parse(text)
    cache = _scan_cache()
    repos = [r for r in cache.repos if r.repo_id == name.repo_id and r.repo_type == "model"] if cache else []
    if cache is None or not repos:
        raise HubError(f"the hub's cache has no hf:{name.repo_id}")
    [repo] = repos
    if name.quant is None and name.filename is None:
        strategy = cache.delete_revisions(*(r.commit_hash for r in repo.revisions))
    else:
        files = {_repo_path(f.file_path, r.snapshot_path): f for r in repo.revisions for f in r.files}
        model = choose(
            gguf_models(RemoteFile(path, f.size_on_disk) for path, f in files.items()), name, " in the cache"
        )
        doomed = [files[f.path] for f in model.files]
        if len(doomed) == repo.nb_files:
            strategy = cache.delete_revisions(*(r.commit_hash for r in repo.revisions))
        else:
            strategy = cache.delete_files(*doomed)
    strategy.execute()
    return strategy.expected_freed_size
