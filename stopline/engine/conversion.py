"""The copies of GGUF files that the ctransformers engine loads, and their cache.

ctransformers 0.2.27 bundles a llama.cpp from 2023 that cannot load today's GGUF
files as they are, so :func:`convert_for_ctransformers` rewrites one once:

1. GGUF v3 is written as v2 (same layout for little-endian files).
2. ``tokenizer.ggml.scores`` is added; the old loader requires it even for BPE.
3. ``output.weight`` is added as a copy of ``token_embd.weight`` (tied
   embeddings); the old loader requires the tensor.
4. Byte-level BPE tokens and merges (``Ġ`` for space, ``Ċ`` for newline) are
   stored as the raw bytes they stand for; the old loader's tokenizer cannot
   map the raw newline byte otherwise and aborts while creating the context.
   Detokenizing then yields raw bytes, which is what the token loop wants.

The embedded model's copy sits beside its original in the cache; copies of files
given with ``--model`` sit in :func:`converted_dir`, of which the most recently
used are kept (``python -m stopline cache``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ..settings import cache_dir, converted_keep
from .model import (
    EMBEDDED_MODEL_NAME,
    ModelFetchError,
    atomic_path,
    being_written,
    check_abandoned,
    original_gguf_path,
    progress_bar,
)

# Bump when the conversion changes, so stale caches are rebuilt.
CONVERTER_VERSION = 1


def embedded_model_path(progress: bool = True) -> Path:
    """Return the converted embedded model, building and caching it on first use."""
    converted = cache_dir() / f"{EMBEDDED_MODEL_NAME}.Q4_1.ct-v{CONVERTER_VERSION}.gguf"
    if converted.is_file():
        return converted
    original = original_gguf_path(progress)
    convert_for_ctransformers(original, converted, progress=progress)
    return converted


def converted_copy(path: Path) -> Path:
    """Where the copy of the model file ``path`` goes, whether it exists yet or not."""
    return converted_dir() / f"{path.stem}.{path.stat().st_size}.ct-v{CONVERTER_VERSION}.gguf"


def converted_dir() -> Path:
    return cache_dir() / "converted"


def converted_files() -> list[Path]:
    """The converted copies in the cache, most recently used first."""
    folder = converted_dir()
    if not folder.is_dir():
        return []
    files = [p for p in folder.iterdir() if p.is_file() and p.suffix == ".gguf" and not p.name.startswith(".")]
    return sorted(files, key=lambda p: p.stat().st_atime_ns, reverse=True)


def mark_used(path: Path) -> None:
    """Record a use of a converted copy in its access time (its modification time stays
    the conversion's): the cache keeps the most recently used ones."""
    os.utime(path, ns=(time.time_ns(), path.stat().st_mtime_ns))


def prune_converted(keep: int | None = None, spare: Path | None = None) -> list[Path]:
    """Delete converted copies beyond the ``keep`` most recently used (and any partial
    file left by a killed process); never ``spare``. Returns what was deleted."""
    keep = converted_keep() if keep is None else keep
    removed = []
    for rank, path in enumerate(converted_files()):
        if rank >= keep and path != spare:
            path.unlink(missing_ok=True)
            removed.append(path)
    folder = converted_dir()
    if folder.is_dir():
        for partial in folder.glob(".*.part"):
            if being_written(partial):
                continue
            partial.unlink(missing_ok=True)
            removed.append(partial)
    return removed


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-character stand-ins for bytes, inverted."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def byte_level_to_bytes(token: str, decoder: dict[str, int] | None = None) -> bytes:
    decoder = decoder or _byte_decoder()
    if all(ch in decoder for ch in token):
        return bytes(decoder[ch] for ch in token)
    return token.encode("utf-8")


def convert_for_ctransformers(source: Path, target: Path, progress: bool = True) -> None:
    """Rewrite a byte-level-BPE llama GGUF (v3) into one ctransformers 0.2.27 loads.

    This is the one place that reads a GGUF with the gguf package's reader rather than
    :func:`~.model_check.read_gguf_metadata`: it copies the tensors too, through the
    same package's writer, which takes that reader's tensors as they are."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(source))
    fields = reader.fields
    if fields["general.architecture"].contents() != "llama":
        raise ModelFetchError("only llama-architecture GGUF files can be converted")
    if not reader.tensors:
        raise ModelFetchError(f"{source.name} has no tensors to convert")
    tokens = fields["tokenizer.ggml.tokens"].contents()
    replaced = {}
    if fields["tokenizer.ggml.model"].contents() == "gpt2":
        # Only byte-level BPE vocabs stand in printable characters for bytes.
        token_types = fields["tokenizer.ggml.token_type"].contents()
        decoder = _byte_decoder()
        normal = int(gguf.TokenType.NORMAL)
        replaced["tokenizer.ggml.tokens"] = [
            byte_level_to_bytes(t, decoder) if tt == normal else t.encode("utf-8") for t, tt in zip(tokens, token_types)
        ]
        raw_merges = []
        merges = fields["tokenizer.ggml.merges"].contents() if "tokenizer.ggml.merges" in fields else []
        for merge in merges:
            left, right = merge.split(" ", 1)
            raw_merges.append(byte_level_to_bytes(left, decoder) + b" " + byte_level_to_bytes(right, decoder))
        if raw_merges:
            replaced["tokenizer.ggml.merges"] = raw_merges

    with atomic_path(target) as temp:
        writer = gguf.GGUFWriter(path=str(temp), arch="llama")
        for field in fields.values():
            if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                continue
            value_type = field.types[0]
            sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            value = replaced.get(field.name, field.contents())
            writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
        if "tokenizer.ggml.scores" not in fields:
            writer.add_token_scores([0.0] * len(tokens))

        tensors = list(reader.tensors)
        names = {t.name for t in tensors}
        extra = []
        if "output.weight" not in names:
            embedding = [t for t in tensors if t.name == "token_embd.weight"]
            if not embedding:
                raise ModelFetchError(f"{source.name} has neither output.weight nor token_embd.weight")
            extra.append(("output.weight", embedding[0]))
        for tensor in tensors:
            writer.add_tensor_info(
                tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type
            )
        for name, tensor in extra:
            writer.add_tensor_info(name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type)

        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        total = sum(t.n_bytes for t in tensors) + sum(t.n_bytes for _, t in extra)
        with progress_bar(f"Converting {source.name}", total, progress) as bar:
            for tensor in tensors + [t for _, t in extra]:
                check_abandoned()
                writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
                bar.update(tensor.n_bytes)
        writer.close()
        # GGUF v3 and v2 share one layout for little-endian files; the old loader reads v2 only.
        with open(temp, "r+b") as out:
            out.seek(4)
            out.write(np.uint32(2).tobytes())
