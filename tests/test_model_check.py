"""Model files the bundled loader cannot run are refused before any of them reaches C.

Every file in the matrix is real: GGUF files written with the ``gguf`` package's
writer, a truncated copy of the embedded model, a text file. ``python -m server
--model FILE`` must answer each with exit code 2 and one line on stderr that
says why and what would work.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import UNIT
from server import model
from server.engine import Engine, ModelLoadError
from server.model_check import GGML_MODEL_TYPES, GGUF_ARCHITECTURES, ModelFileError, check_model_file

ROOT = Path(__file__).resolve().parent.parent


def write_gguf(path: Path, arch: str, *, tokenizer: bool = True, tensor_type=None) -> Path:
    """A small, well-formed GGUF v3 file: metadata, an optional vocab and one tensor."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(128)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(["<s>", "</s>", "a", "b"])
        writer.add_token_types([gguf.TokenType.CONTROL, gguf.TokenType.CONTROL, gguf.TokenType.NORMAL,
                                gguf.TokenType.NORMAL])
    if tensor_type is None:
        writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    else:
        # Raw bytes of a quantized tensor: 256 weights in one block of the type.
        block, size = gguf.GGML_QUANT_SIZES[tensor_type]
        writer.add_tensor("token_embd.weight", np.zeros((1, 256 // block * size), dtype=np.uint8),
                          raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    truncated = folder / "truncated.gguf"
    with open(model.original_gguf_path(progress=False), "rb") as f:
        truncated.write_bytes(f.read(3 << 20))
    text = folder / "notes.txt"
    text.write_text("These are my notes, not a model.\n" * 100)
    return {
        "non-llama GGUF v3": (write_gguf(folder / "qwen2.gguf", "qwen2"), "architecture 'qwen2' is not supported"),
        "truncated GGUF": (truncated, "truncated"),
        "text file": (text, "not a GGUF file"),
        "GGUF without a tokenizer": (write_gguf(folder / "no-vocab.gguf", "llama", tokenizer=False),
                                     "has no tokenizer"),
    }


@pytest.mark.parametrize("case", ["non-llama GGUF v3", "truncated GGUF", "text file", "GGUF without a tokenizer"])
def test_the_server_refuses_an_unsupported_model_in_one_line_with_exit_code_2(bad_files, case):
    path, why = bad_files[case]
    result = subprocess.run([sys.executable, "-m", "server", "--port", "0", "--model", str(path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60 * UNIT)
    assert result.returncode == 2, result
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    [line] = lines
    assert line.startswith(f"stopline: {path}: ") and why in line, line
    # It says what would work: the GGUF architectures and the GGML model types.
    for name in GGUF_ARCHITECTURES + GGML_MODEL_TYPES:
        assert name in line, name
    assert "Traceback" not in result.stdout + result.stderr
    [failure] = [json.loads(x) for x in result.stdout.splitlines() if '"startup_failed"' in x]
    assert failure["error"] == line.removeprefix("stopline: ")


def test_a_supported_gguf_passes_the_check(engine):
    fields = check_model_file(model.original_gguf_path(progress=False), None)
    assert fields["general.architecture"].contents() == "llama"
    # The converted cache file (GGUF v2) passes too.
    assert check_model_file(engine.model_path, None)["general.architecture"].contents() == "llama"


def test_a_tensor_type_newer_than_the_loader_is_refused(tmp_path):
    path = write_gguf(tmp_path / "iq.gguf", "llama", tensor_type=gguf.GGMLQuantizationType.IQ4_NL)
    with pytest.raises(ModelFileError, match="tensor type IQ4_NL is newer than the bundled loader"):
        check_model_file(path, None)
    # A type the loader computes passes.
    ok = write_gguf(tmp_path / "q8.gguf", "llama", tensor_type=gguf.GGMLQuantizationType.Q8_0)
    assert check_model_file(ok, None) is not None


def test_ggml_files_need_a_known_model_type(tmp_path):
    ggml = tmp_path / "model.bin"
    ggml.write_bytes(b"lmgg" + bytes(64))  # GGML's magic 'ggml' as a little-endian uint32
    with pytest.raises(ModelFileError, match="not a GGUF file but a GGML one; pass its --model-type"):
        check_model_file(ggml, None)
    with pytest.raises(ModelFileError, match="unknown --model-type 'gpt5'"):
        check_model_file(ggml, "gpt5")
    # Spelled either way, as the C library ignores '-' and '_'.
    assert check_model_file(ggml, "gpt_neox") is None and check_model_file(ggml, "gptneox") is None
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    with pytest.raises(ModelFileError, match="not a GGML file, nor a GGUF one"):
        check_model_file(text, "llama")


def test_the_engine_refuses_before_loading_anything(tmp_path):
    path = write_gguf(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(ModelLoadError, match="GGUF architecture 'gpt2' is not supported") as info:
        Engine.load(path, progress=False)
    assert isinstance(info.value, ModelFileError)
    # Nothing was converted into the cache for it.
    assert "\n" not in str(info.value)
