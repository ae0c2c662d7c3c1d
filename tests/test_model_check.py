"""Model files the bundled loader cannot run are refused before any of them reaches C.

Every file in the matrix is real: GGUF files written with the ``gguf`` package's
writer (one with its tensor type set to a number no GGML type has), a truncated
copy of the embedded model, a text file. ``python -m stopline
--model FILE`` must answer each with exit code 2 and one line on stderr that
says why and what would work.
"""

from __future__ import annotations

import contextlib
import json
import resource
import struct
import subprocess
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from bench.launch import run_stopline
from hub_stand_in import split_gguf
from stopline.engine import conversion, model
from stopline.engine.errors import ModelLoadError
from stopline.engine.loop import Engine
from stopline.engine.model_check import (
    GGML_MODEL_TYPES,
    GGUF_ARCHITECTURES,
    MetadataField,
    ModelFileError,
    check_model_file,
    read_gguf_metadata,
)
from stopline.engine.tokenizer import TokenizerError, load_chat_template
from stopline.protocol.requests import SamplingParams, exit_outcome
from stopline.protocol.vocabulary import EngineName
from support import UNIT


def write_gguf(
    path: Path,
    arch: str,
    *,
    tokenizer: bool = True,
    tensor_type=None,
    tensors: bool = True,
    rope_freqs: bool = False,
    vocab_size: int = 4,
) -> Path:
    """A small, well-formed GGUF v3 file: metadata, an optional vocab and one tensor
    (none with ``tensors=False``; and Llama 3.1's rope_freqs with ``rope_freqs``)."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(128)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(["<s>", "</s>"] + [f"t{i}" for i in range(vocab_size - 2)])
        writer.add_token_types([gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.NORMAL] * (vocab_size - 2))
    if rope_freqs:
        writer.add_tensor("rope_freqs.weight", np.ones(4, dtype=np.float32))
    if tensors and tensor_type is None:
        writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    elif tensors:
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


def with_unknown_tensor_type(path: Path, type_id: int = 250) -> Path:
    """``path`` (written by :func:`write_gguf`) with its tensor's type set to ``type_id``,
    which no GGML type has: a file from a format newer than anything that reads it."""
    data = bytearray(path.read_bytes())
    # The tensor's type follows its name, its dimension count and two dimensions.
    at = data.index(b"token_embd.weight") + len(b"token_embd.weight") + 4 + 2 * 8
    assert struct.unpack_from("<I", data, at)[0] == int(gguf.GGMLQuantizationType.F32)
    struct.pack_into("<I", data, at, type_id)
    path.write_bytes(bytes(data))
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
        "Llama 3.1 rope_freqs": (
            write_gguf(folder / "llama31.gguf", "llama", rope_freqs=True),
            "rope_freqs.weight tensor: Llama 3.1-style frequency-dependent RoPE scaling",
        ),
        "GGUF without tensors": (
            write_gguf(folder / "ggml-vocab-llama-bpe.gguf", "llama", tensors=False),
            "has no tensors",
        ),
        "truncated GGUF": (truncated, "truncated"),
        "text file": (text, "not a GGUF file"),
        "GGUF without a tokenizer": (
            write_gguf(folder / "no-vocab.gguf", "llama", tokenizer=False),
            "has no tokenizer",
        ),
        "unknown quantization type": (
            with_unknown_tensor_type(write_gguf(folder / "future.gguf", "llama")),
            "tensor type 250 is an unknown quantization type",
        ),
        "IQ4_NL tensor": (
            write_gguf(folder / "iq4_nl.gguf", "llama", tensor_type=gguf.GGMLQuantizationType.IQ4_NL),
            "tensor type IQ4_NL is newer than the bundled loader",
        ),
    }


# The refusals that llama.cpp can run instead: the line names that engine.
LLAMA_CPP_RUNS = ("non-llama GGUF v3", "Llama 3.1 rope_freqs", "IQ4_NL tensor")


@pytest.mark.parametrize(
    "case",
    [
        "non-llama GGUF v3",
        "Llama 3.1 rope_freqs",
        "GGUF without tensors",
        pytest.param("truncated GGUF", marks=pytest.mark.slow),
        "text file",
        "GGUF without a tokenizer",
        "unknown quantization type",
        "IQ4_NL tensor",
    ],
)
def test_the_server_refuses_an_unsupported_model_in_one_line_with_exit_code_2(bad_files, case):
    path, why = bad_files[case]
    result = run_stopline("--engine", "ctransformers", "--port", "0", "--model", str(path), timeout=60 * UNIT)
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
    # Where the other engine can run the file, the line names it.
    assert ("--engine llama.cpp can run this file" in line) == (case in LLAMA_CPP_RUNS)
    # Nothing was converted for a file that was refused.
    assert not (
        conversion.converted_dir() / f"{path.stem}.{path.stat().st_size}.ct-v{conversion.CONVERTER_VERSION}.gguf"
    ).exists()


def test_the_llama_cpp_engine_accepts_what_ctransformers_refuses_for_it(bad_files):
    # The verdict depends on the engine: rope_freqs, newer tensor types and other
    # architectures are llama.cpp's to run.
    for case in LLAMA_CPP_RUNS:
        assert check_model_file(bad_files[case][0], None, engine="llama.cpp") is not None
    # A file with no tensors holds no model for any engine, nor one of an unknown type.
    with pytest.raises(ModelFileError, match="has no tensors"):
        check_model_file(bad_files["GGUF without tensors"][0], None, engine="llama.cpp")
    with pytest.raises(ModelFileError, match="tensor type 250 is an unknown quantization type"):
        check_model_file(bad_files["unknown quantization type"][0], None, engine="llama.cpp")


def verdict_seconds(path: Path) -> float:
    """The CPU time of this thread that ``check_model_file`` takes to pass or refuse ``path``.
    CPU time, not the wall clock: on a loaded machine the wall clock also counts the others."""
    start = time.thread_time()
    with contextlib.suppress(ModelFileError):
        check_model_file(path, None)
    return time.thread_time() - start


def test_the_verdict_reads_no_vocabulary(tmp_path, monkeypatch):
    # A 262,144-token vocabulary (Gemma 3's size) is skipped over, never decoded, for a
    # refusal and for a pass alike: the verdict depends on the metadata and tensor list only.
    gemma = write_gguf(tmp_path / "gemma3.gguf", "gemma3", vocab_size=262_144)
    llama = write_gguf(tmp_path / "llama.gguf", "llama", vocab_size=262_144)
    # Under a second, as a user waits for it: skipping the vocabulary takes tens of
    # milliseconds, reading it (as gguf's reader does) took 12 to 20 seconds.
    assert verdict_seconds(gemma) < 0.5 * UNIT
    assert verdict_seconds(llama) < 0.5 * UNIT
    decoded = []
    real_contents = MetadataField.contents

    def contents(self):
        if self.name.startswith("tokenizer.ggml.tokens"):
            decoded.append(self.name)
        return real_contents(self)

    monkeypatch.setattr(MetadataField, "contents", contents)
    with pytest.raises(ModelFileError, match="architecture 'gemma3' is not supported"):
        check_model_file(gemma, None)
    fields = check_model_file(llama, None)
    assert decoded == []
    # Decoded on demand, it is the vocabulary the file holds.
    tokens = fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == 262_144 and tokens[:3] == ["<s>", "</s>", "t0"]


def test_the_metadata_reader_agrees_with_gguf(llama_engine):
    # Every field and tensor of the embedded model (fetched by the time an engine has loaded it),
    # as the gguf package reads them.
    path = model.original_gguf_path(progress=False)
    reference = gguf.GGUFReader(str(path))
    metadata = read_gguf_metadata(path)
    assert set(metadata.fields) == {name for name in reference.fields if not name.startswith("GGUF.")}
    for name, field in metadata.fields.items():
        types = reference.fields[name].types
        assert field.contents() == reference.fields[name].contents(), name
        assert (field.value_type, field.item_type) == (types[0], types[-1] if len(types) > 1 else None), name
    assert [(t.name, t.type_id, metadata.data_offset + t.offset, t.n_bytes) for t in metadata.tensors] == [
        (t.name, int(t.tensor_type), t.data_offset, t.n_bytes) for t in reference.tensors
    ]


def test_an_unknown_quantization_type_is_refused(tmp_path):
    path = with_unknown_tensor_type(write_gguf(tmp_path / "future.gguf", "llama"))
    with pytest.raises(ModelFileError, match="tensor type 250 is an unknown quantization type"):
        check_model_file(path, None)


@pytest.mark.slow
def test_a_supported_gguf_passes_the_check(ctransformers_engine):
    fields = check_model_file(model.original_gguf_path(progress=False), None)
    assert fields["general.architecture"].contents() == "llama"
    # The file the ctransformers engine converted into the cache (GGUF v2) passes too.
    assert check_model_file(ctransformers_engine.model_path, None)["general.architecture"].contents() == "llama"


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
        Engine.load(path, progress=False, engine=EngineName.CTRANSFORMERS)
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
    loaded = Engine.load(path, "gpt2", context_length=64, threads=1, progress=False, engine=EngineName.CTRANSFORMERS)
    assert (loaded.context_length, loaded.vocab_size) == (64, 96)
    assert type(loaded.tokenizer).__name__ == "NativeTokenizer"
    ids = loaded.encode(prompt="HELLO")
    assert ids == [ord(c) - 32 for c in "HELLO"]
    slot = loaded.open_slot()
    try:
        stream = loaded.start(slot, ids, SamplingParams(max_tokens=10, temperature=0))
        text = "".join(stream)
        assert exit_outcome(stream.result.exit) == ("done", "max_tokens")
        assert stream.result.tokens_generated == 10 and text
    finally:
        slot.close()


# --- converted copies, and a SentencePiece model that really runs ---------------------------


def write_spm_llama(path: Path, chat_template: str | None = None, n_vocab: int = 300) -> Path:
    """A tiny llama GGUF v3 with a SentencePiece vocabulary (Llama 2, Mistral and TinyLlama's
    kind: byte tokens and scores) and random f32 weights, which ctransformers loads and runs."""
    n_embd, n_ff, n_head = 32, 64, 2
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(1)
    writer.add_feed_forward_length(n_ff)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    words = ["▁", "▁the", "▁cat", "a", "c", "e", "h", "t", "s", "o", "n"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + words
    tokens += [f"w{i}" for i in range(n_vocab - len(tokens))]
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(n_vocab - 259)])
    writer.add_token_types(
        [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
        + [gguf.TokenType.BYTE] * 256
        + [gguf.TokenType.NORMAL] * (n_vocab - 259)
    )
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    rng = np.random.default_rng(0)

    def weights(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    weights("token_embd.weight", n_vocab, n_embd)
    writer.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    weights("output.weight", n_vocab, n_embd)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(n_embd, np.float32))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        weights(f"blk.0.{name}.weight", n_embd, n_embd)
    writer.add_tensor("blk.0.ffn_norm.weight", np.ones(n_embd, np.float32))
    weights("blk.0.ffn_gate.weight", n_ff, n_embd)
    weights("blk.0.ffn_up.weight", n_ff, n_embd)
    weights("blk.0.ffn_down.weight", n_embd, n_ff)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


BRACKETS = "{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}{% endfor %}<<assistant>>"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the cat"}]


def test_a_sentencepiece_gguf_uses_its_own_chat_template(tmp_path, monkeypatch):
    monkeypatch.setenv("STOPLINE_CACHE_DIR", str(tmp_path / "cache"))
    loaded = Engine.load(
        write_spm_llama(tmp_path / "spm.gguf", BRACKETS),
        context_length=256,
        threads=1,
        progress=False,
        engine=EngineName.CTRANSFORMERS,
    )
    assert type(loaded.tokenizer).__name__ == "NativeTokenizer"
    assert loaded.tokenizer.render_chat(CHAT) == "<<system>>Be brief.<<user>>the cat<<assistant>>"
    assert loaded.encode(messages=CHAT) == loaded.encode(prompt="<<system>>Be brief.<<user>>the cat<<assistant>>")
    # A named template overrides the file's, with the file's BOS and EOS tokens.
    llama2 = loaded.tokenizer.with_chat_template(load_chat_template("llama2"))
    assert llama2.render_chat(CHAT) == "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nthe cat [/INST]"
    # And it runs: the template's prompt reaches the native loop.
    slot = loaded.open_slot()
    try:
        stream = loaded.start(slot, loaded.encode(messages=CHAT), SamplingParams(max_tokens=4, temperature=0))
        list(stream)
        assert stream.result.tokens_generated == 4
        assert stream.result.prompt_tokens == len(loaded.encode(messages=CHAT))
    finally:
        slot.close()
    # Without a template in the file, the chat's plain text.
    plain = Engine.load(
        write_spm_llama(tmp_path / "plain.gguf"),
        context_length=256,
        threads=1,
        progress=False,
        engine=EngineName.CTRANSFORMERS,
    )
    plain.open_slot().close()
    assert plain.tokenizer.render_chat(CHAT) == "Be brief.\n\nthe cat"


def test_chat_template_names_and_files(tmp_path):
    assert load_chat_template("chatml").startswith("{% for message in messages %}")
    custom = tmp_path / "t.jinja"
    custom.write_text(BRACKETS)
    assert load_chat_template(str(custom)) == BRACKETS
    with pytest.raises(FileNotFoundError, match="neither a template file nor one of chatml, llama2, zephyr"):
        load_chat_template("alpaca")
    custom.write_text("{% for %}")
    with pytest.raises(TokenizerError, match="not a Jinja template"):
        load_chat_template(str(custom))


def test_a_converted_copy_the_loader_refuses_is_deleted(tmp_path, monkeypatch):
    # A llama file with a vocabulary and one tensor passes the check and converts, but holds no model.
    monkeypatch.setenv("STOPLINE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ModelLoadError, match="could not create a 'llama' model"):
        Engine.load(
            write_gguf(tmp_path / "hollow.gguf", "llama"),
            context_length=64,
            threads=1,
            progress=False,
            engine=EngineName.CTRANSFORMERS,
        )
    assert list(conversion.converted_dir().iterdir()) == []


@contextlib.contextmanager
def file_size_limit(size: int):
    """Writes past ``size`` bytes of any file fail with EFBIG, as on a full disk (Python
    ignores SIGXFSZ, so the write raises OSError instead of killing the process)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_conversion_that_fails_midway_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("STOPLINE_CACHE_DIR", str(tmp_path / "cache"))
    source = write_spm_llama(tmp_path / "spm.gguf")
    limit = source.stat().st_size // 2
    with file_size_limit(limit), pytest.raises(OSError):
        Engine.load(source, context_length=256, threads=1, progress=False, engine=EngineName.CTRANSFORMERS)
    # Neither the half-written copy nor its temporary file is left.
    assert list(conversion.converted_dir().iterdir()) == []
    # The next start converts the file afresh, and the copy loads.
    loaded = Engine.load(source, context_length=256, threads=1, progress=False, engine=EngineName.CTRANSFORMERS)
    loaded.open_slot().close()
    assert conversion.converted_files() == [loaded.model_path]
    # The failed write had got past the copy's header and metadata into its tensor data.
    assert read_gguf_metadata(loaded.model_path).data_offset < limit < loaded.model_path.stat().st_size


def stopline_cache(*args: str, cache: Path, **env: str) -> subprocess.CompletedProcess:
    return run_stopline("cache", *args, env={"STOPLINE_CACHE_DIR": str(cache), **env}, timeout=60 * UNIT)


def test_the_conversion_cache_keeps_the_most_recently_used_copies(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("STOPLINE_CACHE_DIR", str(cache))
    monkeypatch.setenv("STOPLINE_CONVERTED_KEEP", "2")
    files = [write_spm_llama(tmp_path / f"m{i}.gguf") for i in range(3)]

    def load(path: Path) -> Path:
        loaded = Engine.load(path, context_length=256, threads=1, progress=False, engine=EngineName.CTRANSFORMERS)
        loaded.open_slot().close()
        return loaded.model_path

    copies = [load(path) for path in files]
    # The third conversion evicted the least recently used copy, the first.
    assert [p.name for p in conversion.converted_files()] == [copies[2].name, copies[1].name]
    # Using a copy makes it the most recent: loading the second again, then a new one, evicts the third.
    load(files[1])
    load(files[0])
    assert [p.name for p in conversion.converted_files()] == [copies[0].name, copies[1].name]
    # A partial file left by a killed process is pruned too.
    (conversion.converted_dir() / f".{copies[2].name}.abc.part").write_bytes(b"half")

    listed = stopline_cache("list", cache=cache)
    assert listed.returncode == 0, listed.stderr
    assert [line.split()[-1] for line in listed.stdout.splitlines()[:-1]] == [str(copies[0]), str(copies[1])]
    assert listed.stdout.splitlines()[-1].startswith("2 converted copies")
    pruned = stopline_cache("prune", "--keep", "1", cache=cache)
    assert pruned.returncode == 0, pruned.stderr
    assert sorted(pruned.stdout.splitlines()) == sorted(
        [f"deleted {copies[1]}", f"deleted {conversion.converted_dir() / f'.{copies[2].name}.abc.part'}"]
    )
    assert list(conversion.converted_dir().iterdir()) == [copies[0]]


def test_a_split_gguf_is_for_llama_cpp_from_its_first_part_with_the_others_beside_it(tmp_path):
    first, second = split_gguf(model.original_gguf_path(progress=False), tmp_path / "smol.gguf")
    with pytest.raises(ModelFileError, match="the first of a GGUF split into 2 parts. --engine llama.cpp can run"):
        check_model_file(first, None)
    assert check_model_file(first, None, engine=EngineName.LLAMA_CPP) is not None
    with pytest.raises(ModelFileError, match="loaded from its first part"):
        check_model_file(second, None, engine=EngineName.LLAMA_CPP)
    second.unlink()
    with pytest.raises(ModelFileError, match="part 2 of 2, smol-00002-of-00002.gguf, is not beside it"):
        check_model_file(first, None, engine=EngineName.LLAMA_CPP)
