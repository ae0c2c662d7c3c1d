"""Model files the bundled loader cannot run are refused before any of them reaches C.

Every file in the matrix is real: GGUF files written with the ``gguf`` package's
writer, a truncated copy of the embedded model, a text file. ``python -m stopline
--model FILE`` must answer each with exit code 2 and one line on stderr that
says why and what would work.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import UNIT
from stopline import model
from stopline.engine import Engine, ModelLoadError, SamplingParams
from stopline.model_check import GGML_MODEL_TYPES, GGUF_ARCHITECTURES, ModelFileError, check_model_file

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
        writer.add_token_types(
            [gguf.TokenType.CONTROL, gguf.TokenType.CONTROL, gguf.TokenType.NORMAL, gguf.TokenType.NORMAL]
        )
    if tensor_type is None:
        writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    else:
        # Raw bytes of a quantized tensor: 256 weights in one block of the type.
        block, size = gguf.GGML_QUANT_SIZES[tensor_type]
        writer.add_tensor(
            "token_embd.weight", np.zeros((1, 256 // block * size), dtype=np.uint8), raw_dtype=tensor_type
        )
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
        "GGUF without a tokenizer": (
            write_gguf(folder / "no-vocab.gguf", "llama", tokenizer=False),
            "has no tokenizer",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "non-llama GGUF v3",
        pytest.param("truncated GGUF", marks=pytest.mark.slow),
        "text file",
        "GGUF without a tokenizer",
    ],
)
def test_the_server_refuses_an_unsupported_model_in_one_line_with_exit_code_2(bad_files, case):
    path, why = bad_files[case]
    result = subprocess.run(
        [sys.executable, "-m", "stopline", "--port", "0", "--model", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60 * UNIT,
    )
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


@pytest.mark.slow
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


def write_ggml_gpt2(path: Path, n_vocab=96, n_ctx=64, n_embd=32, n_head=2, n_layer=1) -> Path:
    """A tiny GPT-2 in the GGML format ctransformers' gpt2 loader reads (random f32 weights)."""
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        f.write(struct.pack("<I", 0x67676D6C))
        f.write(struct.pack("<6i", n_vocab, n_ctx, n_embd, n_head, n_layer, 0))  # ftype 0: f32
        f.write(struct.pack("<i", n_vocab))
        for word in [bytes([c]) for c in range(32, 32 + n_vocab - 1)] + [b"<|endoftext|>"]:
            f.write(struct.pack("<I", len(word)) + word)

        def tensor(name: str, shape: tuple):
            name_bytes = name.encode()
            f.write(struct.pack("<3i", len(shape), len(name_bytes), 0))
            f.write(struct.pack(f"<{len(shape)}i", *reversed(shape)) + name_bytes)  # GGML lists the fastest dim first
            f.write((rng.standard_normal(shape) * 0.02).astype(np.float32).tobytes())

        for name in ("ln_f/g", "ln_f/b"):
            tensor(f"model/{name}", (n_embd,))
        tensor("model/wte", (n_vocab, n_embd))
        tensor("model/wpe", (n_ctx, n_embd))
        tensor("model/lm_head", (n_vocab, n_embd))
        for i in range(n_layer):
            for name in ("ln_1/g", "ln_1/b", "ln_2/g", "ln_2/b", "attn/c_proj/b", "mlp/c_proj/b"):
                tensor(f"model/h{i}/{name}", (n_embd,))
            tensor(f"model/h{i}/attn/c_attn/w", (3 * n_embd, n_embd))
            tensor(f"model/h{i}/attn/c_attn/b", (3 * n_embd,))
            tensor(f"model/h{i}/attn/c_proj/w", (n_embd, n_embd))
            tensor(f"model/h{i}/mlp/c_fc/w", (4 * n_embd, n_embd))
            tensor(f"model/h{i}/mlp/c_fc/b", (4 * n_embd,))
            tensor(f"model/h{i}/mlp/c_proj/w", (n_embd, 4 * n_embd))
    return path


def test_a_ggml_gpt2_file_loads_streams_and_stops(tmp_path):
    # The GGML path end to end: the check lets it through, ctransformers loads it,
    # its own tokenizer encodes, and the native loop streams and stops.
    path = write_ggml_gpt2(tmp_path / "gpt2.bin")
    assert check_model_file(path, "gpt2") is None
    loaded = Engine.load(path, "gpt2", context_length=64, threads=1, progress=False)
    assert (loaded.context_length, loaded.vocab_size) == (64, 96)
    assert type(loaded.tokenizer).__name__ == "NativeTokenizer"
    ids = loaded.encode(prompt="HELLO")
    assert ids == [ord(c) - 32 for c in "HELLO"]
    slot = loaded.open_slot()
    try:
        stream = loaded.start(slot, ids, SamplingParams(max_tokens=10, temperature=0))
        text = "".join(stream)
        assert stream.result.outcome == "done" and stream.result.reason == "max_tokens"
        assert stream.result.tokens_generated == 10 and text
    finally:
        slot.close()
