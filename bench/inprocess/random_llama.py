"""A GGUF shaped like Llama 3.2 1B, with random weights and Llama 3's real vocabulary.

A stop waits for the graph node under way, so what a stop costs depends on how long
a model's nodes take, and SmolLM2-135M's take far less than a 1B model's. PyPI
carries no 1B model, so this module writes one: Llama 3.2 1B's shapes (16 layers,
width 2048, 32 query and 8 key-value heads, FFN 8192, the output tied to the token
embedding), every matrix in Q4_0 with random values, and the tokenizer of the Llama 3
vocabulary file llama.cpp ships in its source (``models/ggml-vocab-llama-bpe.gguf``).
Its text is noise; its tokenizer, its tensors and so its compute are a 1B model's
(all but Llama 3.2's long-context RoPE scaling, ``rope_freqs.weight``, which changes
what is computed, not how much).

The file is written once into Stopline's cache (about 700 MB for 16 layers), under a
name that carries its shape and :data:`WRITER_VERSION`, and reused from then on. The
weights come from a seeded generator, so every writer writes the same bytes.

    python -m bench random-llama [--layers N]   # write it (first use only), print its path
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from tqdm import tqdm

from stopline.engine.llama_build import llama_source_dir
from stopline.engine.model_check import read_gguf_metadata
from stopline.settings import cache_dir

# Bump when what is written changes (a shape, the weights, the metadata), so that a new file is written.
WRITER_VERSION = 1
TITLE = "Llama-3.2-1B-shaped, random weights"
VOCABULARY_FILE = "models/ggml-vocab-llama-bpe.gguf"
SEED = 0
# Llama 3 Instruct's chat template; llama.cpp's vocabulary file carries none.
LLAMA3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

Q4_0 = gguf.GGMLQuantizationType.Q4_0
BLOCK_VALUES, BLOCK_BYTES = gguf.GGML_QUANT_SIZES[Q4_0]
# A Q4_0 block (ggml's block_q4_0) is an fp16 scale d, then 16 bytes of two 4-bit values
# q each; a value is (q - 8) * d.
SCALE_BYTES = 2
# The root mean square of q - 8 over uniform random nibbles: sqrt(mean of (-8..7) squared).
NIBBLE_RMS = math.sqrt(sum((q - 8) ** 2 for q in range(16)) / 16)


@dataclass(frozen=True)
class LlamaShape:
    """The hyperparameters of a llama-architecture model, as llama.cpp reads them; by default Llama 3.2 1B's."""

    layers: int = 16
    width: int = 2048
    heads: int = 32
    kv_heads: int = 8
    ffn: int = 8192
    vocab: int = 128256
    context: int = 131072
    rope_freq_base: float = 500000.0
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def label(self) -> str:
        return f"L{self.layers}-E{self.width}-H{self.heads}-KV{self.kv_heads}-F{self.ffn}-V{self.vocab}-C{self.context}"

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every tensor's name and shape (rows, columns for a matrix), in file order. No
        ``output.weight``: llama.cpp then computes the logits with ``token_embd.weight``."""
        kv_width = self.kv_heads * self.head_dim
        tensors = [("token_embd.weight", (self.vocab, self.width)), ("output_norm.weight", (self.width,))]
        for n in range(self.layers):
            tensors += [
                (f"blk.{n}.attn_norm.weight", (self.width,)),
                (f"blk.{n}.attn_q.weight", (self.width, self.width)),
                (f"blk.{n}.attn_k.weight", (kv_width, self.width)),
                (f"blk.{n}.attn_v.weight", (kv_width, self.width)),
                (f"blk.{n}.attn_output.weight", (self.width, self.width)),
                (f"blk.{n}.ffn_norm.weight", (self.width,)),
                (f"blk.{n}.ffn_gate.weight", (self.ffn, self.width)),
                (f"blk.{n}.ffn_up.weight", (self.ffn, self.width)),
                (f"blk.{n}.ffn_down.weight", (self.width, self.ffn)),
            ]
        return tensors


LLAMA_3_2_1B = LlamaShape()
# Llama 3.1 8B's shapes (its own output matrix aside: the logits come from the tied embedding here).
LLAMA_3_1_8B = LlamaShape(layers=32, width=4096, heads=32, kv_heads=8, ffn=14336)
TITLE_8B = "Llama-3.1-8B-shaped, random weights"


def random_llama_path(layers: int = LLAMA_3_2_1B.layers, progress: bool = False) -> Path:
    """The Llama-3.2-1B-shaped GGUF with ``layers`` layers, written into the cache on first use."""
    shape = LlamaShape(layers=layers)
    return _written(shape, f"llama-3.2-1b-shaped-random.{shape.label}", TITLE, progress)


def random_llama_8b_path(progress: bool = False) -> Path:
    """The Llama-3.1-8B-shaped GGUF (about 4.5 GB), written into the cache on first use."""
    return _written(LLAMA_3_1_8B, f"llama-3.1-8b-shaped-random.{LLAMA_3_1_8B.label}", TITLE_8B, progress)


def _written(shape: LlamaShape, stem: str, title: str, progress: bool) -> Path:
    target = cache_dir() / f"{stem}.Q4_0.w{WRITER_VERSION}.gguf"
    if not target.is_file():
        if progress:
            print(f"Writing {title} ({shape.layers} layers, first use only) into {target.parent}", file=sys.stderr)
        write_random_llama(target, shape, llama_source_dir() / VOCABULARY_FILE, progress, title)
    return target


def write_random_llama(
    target: Path, shape: LlamaShape, vocabulary: Path, progress: bool = False, title: str = TITLE
) -> None:
    """Write ``shape`` with random Q4_0 weights and ``vocabulary``'s tokenizer into ``target``:
    all of it, through a temporary file beside it, or nothing."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    os.close(fd)
    try:
        _write(Path(temp), shape, vocabulary, progress, title)
        os.replace(temp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)


def _write(path: Path, shape: LlamaShape, vocabulary: Path, progress: bool, title: str) -> None:
    writer = gguf.GGUFWriter(path, arch="llama")
    try:
        writer.add_name(title)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
        writer.add_block_count(shape.layers)
        writer.add_context_length(shape.context)
        writer.add_embedding_length(shape.width)
        writer.add_feed_forward_length(shape.ffn)
        writer.add_head_count(shape.heads)
        writer.add_head_count_kv(shape.kv_heads)
        writer.add_rope_dimension_count(shape.head_dim)
        writer.add_rope_freq_base(shape.rope_freq_base)
        writer.add_layer_norm_rms_eps(shape.rms_eps)
        writer.add_vocab_size(shape.vocab)
        _copy_tokenizer(vocabulary, writer, shape.vocab)

        tensors = shape.tensors()
        for name, dims in tensors:
            if len(dims) == 1:
                writer.add_tensor_info(name, dims, np.dtype(np.float32), _bytes(dims))
            else:
                rows, _ = dims
                writer.add_tensor_info(name, (rows, _bytes(dims) // rows), np.dtype(np.uint8), _bytes(dims), Q4_0)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()

        rng = np.random.default_rng(SEED)
        total = sum(_bytes(dims) for _, dims in tensors)
        with tqdm(desc="Writing", total=total, unit="B", unit_scale=True, disable=not progress, file=sys.stderr) as bar:
            # One tensor at a time: the largest, the token embedding, is about 150 MB.
            for _, dims in tensors:
                # Norm weights are ones, as a freshly initialised model's are.
                data = np.ones(dims, np.float32) if len(dims) == 1 else random_q4_0(rng, *dims)
                writer.write_tensor_data(data)
                bar.update(data.nbytes)
    finally:
        writer.close()


def _bytes(dims: tuple[int, ...]) -> int:
    """A tensor's size in the file: F32 for a vector, Q4_0 for a matrix."""
    if len(dims) == 1:
        return dims[0] * 4
    rows, columns = dims
    return rows * columns // BLOCK_VALUES * BLOCK_BYTES


def _copy_tokenizer(vocabulary: Path, writer: gguf.GGUFWriter, vocab: int) -> None:
    """Every ``tokenizer.*`` key of ``vocabulary``, with a chat template if it has none."""
    # Stopline's own reader: gguf's takes seconds and half a gigabyte over a 128k-token vocabulary.
    fields = {name: f for name, f in read_gguf_metadata(vocabulary).fields.items() if name.startswith("tokenizer.")}
    tokens = len(fields["tokenizer.ggml.tokens"].contents())
    if tokens != vocab:
        raise ValueError(f"{vocabulary.name} has {tokens} tokens, not {vocab}")
    for field in fields.values():
        item_type = None if field.item_type is None else gguf.GGUFValueType(field.item_type)
        writer.add_key_value(field.name, field.contents(), gguf.GGUFValueType(field.value_type), sub_type=item_type)
    if gguf.Keys.Tokenizer.CHAT_TEMPLATE not in fields:
        writer.add_chat_template(LLAMA3_CHAT_TEMPLATE)


def random_q4_0(rng: np.random.Generator, rows: int, columns: int) -> np.ndarray:
    """A rows × columns matrix of random Q4_0 blocks, as bytes (rows × the bytes of a row).

    Each value's root mean square is 1/sqrt(columns), so that a product with a unit-scale
    input keeps unit scale, layer after layer (and the tied output's logits stay near
    unit scale); each block's scale has a random sign, which centres the values on zero
    (q - 8 alone runs from -8 to 7)."""
    blocks = rows * columns // BLOCK_VALUES
    data = np.empty((blocks, BLOCK_BYTES), np.uint8)
    # The generator's raw 64-bit words are the quickest random bytes numpy makes.
    quant_bytes = BLOCK_BYTES - SCALE_BYTES
    quants = rng.bit_generator.random_raw(blocks * quant_bytes // 8).view(np.uint8)
    data[:, SCALE_BYTES:] = quants.reshape(blocks, quant_bytes)
    scale = np.float16(1 / (NIBBLE_RMS * math.sqrt(columns)))
    scales = np.where(rng.integers(0, 2, blocks, dtype=bool), scale, -scale)
    data[:, :SCALE_BYTES] = scales.view(np.uint8).reshape(blocks, SCALE_BYTES)
    return data.reshape(rows, -1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench random-llama", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=LLAMA_3_2_1B.layers)
    args = parser.parse_args(argv)
    print(random_llama_path(args.layers, progress=True))
    return 0
