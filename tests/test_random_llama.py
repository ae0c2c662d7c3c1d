"""The Llama-3.2-1B-shaped model with random weights (bench/inprocess/random_llama.py), written with
2 layers and the full vocabulary: its file, llama.cpp running it through Stopline's engine,
its vocabulary tokenizing as Llama 3's, and a write that never leaves half a file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import bench.run as bench_main
from bench.inprocess import random_llama
from bench.inprocess.random_llama import LlamaShape, random_llama_path
from stopline import _core
from stopline.engine.llama_build import llama_source_dir
from stopline.engine.loop import Engine
from stopline.engine.model_check import read_gguf_metadata
from stopline.protocol.vocabulary import AbortMode, EngineName
from support import make_generation

LAYERS = 2
# llama.cpp's own tokenizer test for this vocabulary: texts, and the ids Llama 3's tokenizer gives them.
SEPARATOR = "\n__ggml_vocab_test__\n"


@pytest.fixture(scope="module")
def path() -> Path:
    return random_llama_path(LAYERS)


@pytest.fixture(scope="module")
def engine(path) -> Engine:
    return Engine.load(path, engine=EngineName.LLAMA_CPP, threads=1, progress=False)


@pytest.fixture(scope="module")
def vocabulary() -> Path:
    return llama_source_dir() / random_llama.VOCABULARY_FILE


def test_the_file_has_llama_3_2_1b_shapes_and_the_whole_tokenizer(path, vocabulary):
    metadata = read_gguf_metadata(path)
    fields = {name: field.contents() for name, field in metadata.fields.items()}
    assert fields["general.architecture"] == "llama" and "random" in fields["general.name"]
    assert fields["llama.block_count"] == LAYERS and fields["llama.embedding_length"] == 2048
    assert fields["llama.attention.head_count"] == 32 and fields["llama.attention.head_count_kv"] == 8
    assert fields["llama.feed_forward_length"] == 8192 and fields["llama.rope.freq_base"] == 500000
    tensors = {t.name: t for t in metadata.tensors}
    # Tied: the logits come from the token embedding.
    assert "output.weight" not in tensors and len(tensors) == 2 + 9 * LAYERS
    assert tensors["token_embd.weight"].shape == (2048, 128256)
    # ggml's order: columns first. 8 key-value heads of 64.
    assert tensors["blk.1.attn_k.weight"].shape == (2048, 512)
    assert tensors["blk.1.ffn_down.weight"].shape == (8192, 2048)
    assert {t.type_name for name, t in tensors.items() if name.endswith("norm.weight")} == {"F32"}
    assert {t.type_name for name, t in tensors.items() if not name.endswith("norm.weight")} == {"Q4_0"}
    # Every tokenizer key as llama.cpp ships it, with its type.
    for name, field in read_gguf_metadata(vocabulary).fields.items():
        if name.startswith("tokenizer."):
            copy = metadata.fields[name]
            assert (copy.value_type, copy.item_type, copy.contents()) == (
                field.value_type,
                field.item_type,
                field.contents(),
            ), name
    assert len(fields["tokenizer.ggml.tokens"]) == 128256 and "tokenizer.chat_template" in fields


def test_llama_cpp_runs_it_through_the_engine(engine):
    assert engine.kind is EngineName.LLAMA_CPP and engine.abort_mode is AbortMode.IN_STEP
    assert engine.vocab_size == 128256
    slot = engine.open_slot()
    try:
        prompt = engine.encode(messages=[{"role": "user", "content": "What is the capital of France?"}])
        generation = make_generation(slot, prompt, max_tokens=8, prefill_chunk=engine.prefill_chunk, temperature=0)
        result = generation.run()
        assert result.exit is _core.ExitKind.MAX_TOKENS and len(generation.take()) == result.tokens_generated == 8
        # Random weights, sane numbers: logits near unit scale, not NaN and not all alike.
        logits = np.frombuffer(slot.last_logits(), np.float32)
        assert np.isfinite(logits).all() and 0.5 < logits.std() < 2
    finally:
        slot.close()


def test_it_tokenizes_as_llama_3(engine, vocabulary):
    tokens = read_gguf_metadata(vocabulary).fields["tokenizer.ggml.tokens"].contents()
    assert engine.encode(prompt="Hello world") == [tokens.index(t) for t in ("<|begin_of_text|>", "Hello", "Ġworld")]
    assert engine.encode(prompt="Hello world") == [128000, 9906, 1917]
    texts = Path(f"{vocabulary}.inp").read_bytes().decode("utf-8").split(SEPARATOR)[:-1]
    expected = [[int(t) for t in line.split()] for line in Path(f"{vocabulary}.out").read_text().splitlines()]
    assert len(texts) == len(expected) > 40
    assert [engine.model.tokenize(text) for text in texts] == expected
    # The chat template is Llama 3's, its markers single tokens.
    chat = engine.encode(messages=[{"role": "user", "content": "Hi"}])
    header = ["<|start_header_id|>", "user", "<|end_header_id|>", "ĊĊ"]
    assert chat[:5] == [tokens.index(t) for t in ["<|begin_of_text|>", *header]]
    assert chat[-4:] == [tokens.index(t) for t in ["<|start_header_id|>", "assistant", "<|end_header_id|>", "ĊĊ"]]


def test_a_second_call_reuses_the_file(path, monkeypatch):
    written = path.stat()

    def write_again(*args, **kwargs):
        raise AssertionError("the cached file was written again")

    monkeypatch.setattr(random_llama, "write_random_llama", write_again)
    assert random_llama_path(LAYERS) == path
    again = path.stat()
    assert (again.st_ino, again.st_mtime_ns) == (written.st_ino, written.st_mtime_ns)


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, OSError])
def test_an_interrupted_write_leaves_nothing(tmp_path, monkeypatch, interruption):
    monkeypatch.setattr(random_llama, "cache_dir", lambda: tmp_path)
    real_random_q4_0 = random_llama.random_q4_0
    matrices = []
    partial: list[Path] = []

    def interrupted(rng, rows, columns):
        matrices.append(rows)
        if len(matrices) == 4:
            # The vocabulary and three matrices, the embedding among them, are in the file so far.
            partial.extend(tmp_path.iterdir())
            raise interruption("stopped halfway")
        return real_random_q4_0(rng, rows, columns)

    monkeypatch.setattr(random_llama, "random_q4_0", interrupted)
    with pytest.raises(interruption):
        random_llama_path(1)
    assert len(partial) == 1 and partial[0].name.endswith(".part")
    assert list(tmp_path.iterdir()) == []


def test_the_bench_runs_it_on_the_llama_cpp_engines(tmp_path, monkeypatch):
    args = bench_main.parse_args(["--model", "llama-1b-shaped", "--engines", "ours,ours_llama,ours_llama_shared"])
    assert args.engines == "ours_llama,ours_llama_shared" and args.skipped == ["ours"]
    # Resolved, the name is the 16-layer file, written on first use.
    written: list[tuple[Path, LlamaShape]] = []
    monkeypatch.setattr(random_llama, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(random_llama, "write_random_llama", lambda target, shape, *_: written.append((target, shape)))
    path = bench_main.MODELS[args.model].gguf()
    assert written == [(path, random_llama.LLAMA_3_2_1B)] and path.parent == tmp_path
    assert random_llama.LLAMA_3_2_1B.layers == 16 and "L16" in path.name
