"""Models by name (--model hf:OWNER/REPO[:QUANT]) against a local stand-in for the Hugging Face
Hub (tests/hub_stand_in.py, at HF_ENDPOINT), serving the embedded model's real GGUF, the same
split in two, and files that must be refused. Each start is a real ``python -m stopline``
process with HF_HOME in a temporary folder; the engine is llama.cpp, which loads GGUFs as they are.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
from pathlib import Path

import aiohttp
import gguf
import pytest
import pytest_asyncio

from bench.launch import ServerProcess, run_stopline
from hub_stand_in import COMMIT, HubFile, HubStandIn, Repo, split_gguf
from stopline.engine import hub
from stopline.engine.hub import GGUFModel, HubError, HubModelName, RemoteFile, choose, gguf_models
from stopline.engine.model import original_gguf_path
from support import UNIT

ROOT = Path(__file__).resolve().parent.parent
SMOL_FILE = "SmolLM2-135M-Instruct-Q4_1.gguf"
TOKEN = "hf_stand_in_secret"


@pytest.fixture(scope="module")
def smol() -> bytes:
    return original_gguf_path(progress=False).read_bytes()


@pytest.fixture(scope="module")
def smol_parts(tmp_path_factory, smol) -> dict[str, bytes]:
    folder = tmp_path_factory.mktemp("split")
    return {p.name: p.read_bytes() for p in split_gguf(original_gguf_path(progress=False), folder / "smol.gguf")}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> bytes:
    """A small, valid GGUF (a vocabulary, no tensors): what a tampered download claims to be."""
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_token_list([f"t{i}" for i in range(64)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path.read_bytes()


@pytest_asyncio.fixture
async def stand_in(smol, smol_parts, tiny_gguf):
    tampered = bytearray(tiny_gguf)
    tampered[-1] ^= 0xFF
    server = HubStandIn(
        {
            "test/smol": Repo(
                {SMOL_FILE: HubFile(smol), "notes.gguf": HubFile(b"<html>not a model</html>\n")},
                # Listed, never downloaded: two models that one tag matches.
                listed_only={"SmolLM2-135M-Instruct-Q4_K_M.gguf": 105_000_000, "UD/SmolLM2-UD-Q4_K_M.gguf": 1},
            ),
            "test/private-split": Repo({name: HubFile(data) for name, data in smol_parts.items()}, token=TOKEN),
            "test/tampered": Repo({"tiny.gguf": HubFile(tiny_gguf, served=bytes(tampered))}),
        }
    )
    await server.start()
    yield server
    await server.close()


def hub_env(stand_in: HubStandIn, home: Path, **extra: str) -> dict:
    """The environment of a process that uses the stand-in and a hub cache of its own."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    return {**inherited, "HF_HOME": str(home), "HF_ENDPOINT": stand_in.url, **extra}


async def serve(stand_in, home: Path, model: str, **extra: str) -> ServerProcess:
    env = hub_env(stand_in, home, **extra)
    return ServerProcess("--model", model, "--engine", "llama.cpp", "--port", "0", env=env, inherit_env=False)


def stopline(env: dict, *args: str) -> subprocess.CompletedProcess:
    return run_stopline(*args, env=env, inherit_env=False, timeout=120 * UNIT)


def files_in(home: Path) -> list[str]:
    """The files of the hub's cache, but its lock files and its folder tag."""
    return sorted(
        str(p.relative_to(home))
        for p in home.rglob("*")
        if (p.is_file() or p.is_symlink()) and ".locks" not in p.parts and p.name != "CACHEDIR.TAG"
    )


async def test_a_model_by_name_resumes_verifies_serves_and_is_there_offline(stand_in, smol, tmp_path):
    home = tmp_path / "hf"
    assert stopline(hub_env(stand_in, home), "models").stdout.startswith("0 GGUF models")
    # The connection breaks off half-way through the file: the hub client resumes it.
    stand_in.repos["test/smol"].files[SMOL_FILE].cut_at = 0.5
    # The hub client draws its progress bar on a terminal; TQDM_POSITION=-1 is its switch for a pipe.
    server = await serve(stand_in, home, "hf:test/smol:q4_1", TQDM_POSITION="-1")
    try:
        record = (await server.started(240 * UNIT)).start_record
        assert record["model"] == "test/smol:q4_1"
        async with aiohttp.ClientSession() as http, http.get(record["http_api"] + "/models") as response:
            assert [m["id"] for m in (await response.json())["data"]] == ["test/smol:q4_1"]
    finally:
        assert await server.stopped(signal.SIGINT, 30 * UNIT) == 0
    ranges = [(path, ranged) for method, path, ranged in stand_in.requests if ranged]
    [(path, ranged)] = ranges
    assert path.endswith(SMOL_FILE) and 0.4 * len(smol) <= int(ranged.removeprefix("bytes=").rstrip("-"))
    # In the hub's own cache, whole and verified, with a progress bar on the way.
    cached = home / "hub" / "models--test--smol" / "snapshots" / COMMIT / SMOL_FILE
    assert hashlib.sha256(cached.read_bytes()).hexdigest() == hashlib.sha256(smol).hexdigest()
    shown = server.stderr
    assert "Downloading test/smol:q4_1" in shown and "100%|" in shown and "Trying to resume download" in shown
    assert not [f for f in files_in(home) if f.endswith(".incomplete")]

    # HF_HUB_OFFLINE: from the cache, and not one request.
    stand_in.requests.clear()
    server = await serve(stand_in, home, "hf:test/smol:Q4_1", HF_HUB_OFFLINE="1")
    try:
        assert (await server.started(240 * UNIT)).start_record["model"] == "test/smol:Q4_1"
    finally:
        assert await server.stopped(signal.SIGINT, 30 * UNIT) == 0
    assert stand_in.requests == []

    # Listed with its size, and deleted by name through the cache API.
    env = hub_env(stand_in, home)
    listed = stopline(env, "models")
    assert listed.returncode == 0 and f"hf:test/smol/{SMOL_FILE}" in listed.stdout and " MB  " in listed.stdout
    removed = stopline(env, "models", "rm", "test/smol:q4_1")
    assert removed.returncode == 0 and "freed" in removed.stdout, removed
    assert stopline(env, "models").stdout.startswith("0 GGUF models") and files_in(home) == []
    gone = stopline(env, "models", "rm", "test/smol")
    assert gone.returncode == 2 and gone.stderr.strip() == "stopline: the hub's cache has no hf:test/smol"


async def test_a_split_model_downloads_every_part_and_a_private_one_takes_hf_token(stand_in, tmp_path):
    home = tmp_path / "hf"
    # Without the token, one line that says what would work.
    refused = await serve(stand_in, home, "hf:test/private-split")
    assert await refused.ended(120 * UNIT) == 2
    [line] = refused.stderr.splitlines()
    assert line.startswith("stopline: hf:test/private-split: the hub refused access (HTTP 401)") and "HF_TOKEN" in line
    assert files_in(home) == []
    # With it, every part lands beside the first, and llama.cpp loads the model from the first.
    server = await serve(stand_in, home, "hf:test/private-split", HF_TOKEN=TOKEN)
    try:
        record = (await server.started(240 * UNIT)).start_record
        body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        async with aiohttp.ClientSession() as http, http.post(record["http_api"] + "/completions", json=body) as answer:
            assert answer.status == 200 and (await answer.json())["usage"]["completion_tokens"] >= 1
    finally:
        assert await server.stopped(signal.SIGINT, 30 * UNIT) == 0
    snapshot = home / "hub" / "models--test--private-split" / "snapshots" / COMMIT
    assert sorted(p.name for p in snapshot.iterdir()) == ["smol-00001-of-00002.gguf", "smol-00002-of-00002.gguf"]


@pytest.mark.parametrize(
    "model, extra, says",
    [
        ("hf:test/nothing", {}, "stopline: hf:test/nothing: no such repository or file on the hub at"),
        ("hf:test/smol/notes.gguf", {}, "stopline: hf:test/smol: notes.gguf is not a GGUF file"),
        ("hf:test/tampered", {}, "stopline: hf:test/tampered: tiny.gguf does not match the hub's SHA-256"),
        ("hf:test/smol:Q4_K_M", {}, "stopline: the tag 'Q4_K_M' matches 2 models in hf:test/smol: it has "),
        ("hf:test/smol:Q5_0", {}, f"stopline: no GGUF in hf:test/smol matches the tag 'Q5_0'; it has {SMOL_FILE}"),
        ("hf:test/smol", {"HF_HUB_OFFLINE": "1"}, "stopline: HF_HUB_OFFLINE is set, and the hub's cache ("),
        ("hf:test/smol", {"HF_ENDPOINT": "http://127.0.0.1:1"}, "stopline: cannot reach the hub at http://127.0.0.1:1"),
    ],
)
async def test_a_failure_is_one_line_exit_2_and_leaves_no_file(stand_in, tmp_path, model, extra, says):
    home = tmp_path / "hf"
    process = await serve(stand_in, home, model, **extra)
    assert await process.ended(120 * UNIT) == 2
    shown = process.stderr
    # A download that was refused had its progress bar; every other failure is that one line alone.
    [line] = [line for line in shown.splitlines() if line.startswith("stopline:")]
    assert line.startswith(says), line
    assert "Traceback" not in shown
    if "Downloading" not in shown:
        assert shown == line + "\n"
    assert files_in(home) == []


def test_names_on_the_hub():
    assert HubModelName.parse("hf:bartowski/SmolLM2-GGUF:Q4_K_M") == HubModelName("bartowski/SmolLM2-GGUF", "Q4_K_M")
    assert HubModelName.parse("hf:o/r/sub/m.gguf") == HubModelName("o/r", filename="sub/m.gguf")
    assert HubModelName.parse("hf:o/r").served_name == "o/r"
    for bad in ("hf:o", "hf:o/r/notes.txt", "hf:/r", "hf:o/r:Q4/x.gguf", "hf:o/r/../x.gguf"):
        with pytest.raises(HubError):
            HubModelName.parse(bad)


def test_a_tag_picks_by_file_name_and_split_parts_are_one_model():
    files = [
        RemoteFile(name, 1)
        for name in (
            "m-Q4_K_M.gguf",
            "m-IQ4_XS.gguf",
            "m-Q8_0-00001-of-00002.gguf",
            "m-Q8_0-00002-of-00002.gguf",
            "m-F16-00001-of-00002.gguf",  # its second part is missing
            "mmproj-m-f16.gguf",
            "README.md",
        )
    ]
    models = gguf_models(files)
    assert [m.label for m in models] == ["m-IQ4_XS.gguf", "m-Q4_K_M.gguf", "m-Q8_0-00001-of-00002.gguf (+1 parts)"]

    def chosen(text: str) -> GGUFModel:
        return choose(models, HubModelName.parse(text), "")

    assert chosen("hf:o/r:q8_0").size == 2 and chosen("hf:o/r:Q4_K_M").first.path == "m-Q4_K_M.gguf"
    # No tag: llama-server's default, Q4_K_M, when the repository has several.
    assert chosen("hf:o/r").first.path == "m-Q4_K_M.gguf"
    # A whole field of the name: XS is in IQ4_XS, Q4_XS is not.
    assert chosen("hf:o/r:xs").first.path == "m-IQ4_XS.gguf"
    with pytest.raises(HubError, match="no GGUF in hf:o/r matches the tag 'Q4_XS'; it has m-IQ4_XS.gguf"):
        chosen("hf:o/r:Q4_XS")
    assert chosen("hf:o/r/m-Q8_0-00001-of-00002.gguf").size == 2


def test_a_download_the_disk_has_no_room_for_is_refused_before_it_starts(monkeypatch, tmp_path):
    monkeypatch.setattr(hub.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 50_000_000})())
    model = GGUFModel((RemoteFile("m-Q4_K_M.gguf", 4_000_000_000),))
    with pytest.raises(HubError, match=r"m-Q4_K_M.gguf needs 4.0 GB and the disk of the hub's cache .* has 50 MB free"):
        hub._check_room(4_000_000_000, tmp_path / "hub", model)
    hub._check_room(40_000_000, tmp_path / "hub", model)
