"""Check a model file before any of it reaches C, from its metadata alone.

The bundled loader (ctransformers 0.2.27, with a llama.cpp from 2023) does not
survive every file: a GGUF of an architecture it does not know, one without a
vocabulary or without tensors, or one that needs Llama 3's frequency-dependent
RoPE scaling, ends in a crash, a hang or a wrong model. :func:`check_model_file`
reads the header, the metadata and the tensor list (skipping over the
vocabulary, which it decodes only when asked) and raises :class:`ModelFileError`
with one line that says what is wrong and what would work. The verdict takes
milliseconds even for a 128k-token vocabulary.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from ..protocol.vocabulary import EngineName
from .errors import ModelLoadError

# The engines a verdict can name; the default is the one this module's limits describe.
CTRANSFORMERS = EngineName.CTRANSFORMERS
LLAMA_CPP = EngineName.LLAMA_CPP

# What the ctransformers engine can run, as measured (docs/models.md).
GGUF_ARCHITECTURES = ("llama",)
GGUF_VERSIONS = (2, 3)
# The vocabularies the bundled loader can build: SentencePiece-style and byte-level BPE.
GGUF_TOKENIZERS = ("llama", "gpt2")
# The model types the C library registers for GGML files (it ignores "-" and "_").
GGML_MODEL_TYPES = (
    "gpt2",
    "gptj",
    "gpt_neox",
    "dolly-v2",
    "falcon",
    "llama",
    "mpt",
    "replit",
    "starcoder",
    "gpt_bigcode",
)
# GGML's file magics ('ggml', 'ggmf', 'ggjt'), as the little-endian uint32 is laid out on disk.
GGML_MAGICS = (b"lmgg", b"fmgg", b"tjgg")
# Tensor types the 2023 loader implements; later ones (IQ*, BF16, ...) it cannot compute.
LOADER_TENSOR_TYPES = (
    "F32",
    "F16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q8_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "Q8_K",
)
# Llama 3.1/3.2's frequency-dependent RoPE scaling is stored as this tensor; the 2023
# loader ignores it and would compute a different model.
ROPE_FREQS_TENSOR = "rope_freqs.weight"
# The architectures the llama.cpp engine knows: the gguf package is llama.cpp's own
# description of the format (clip is a vision projector, not a model).
LLAMA_CPP_ARCHITECTURES = frozenset(gguf.MODEL_ARCH_NAMES.values()) - {"clip"}

WHAT_WORKS = (
    f"The ctransformers engine runs GGUF v{GGUF_VERSIONS[0]}-v{GGUF_VERSIONS[-1]} files of architecture "
    f"{', '.join(GGUF_ARCHITECTURES)} that carry their tokenizer, and GGML files of the "
    f"ctransformers types {', '.join(GGML_MODEL_TYPES)} (pass --model-type)"
)
OTHER_ENGINE = f"--engine {LLAMA_CPP} can run this file. "


LLAMA_WHAT_WORKS = (
    f"The llama.cpp engine runs GGUF v{GGUF_VERSIONS[0]}-v{GGUF_VERSIONS[-1]} files of any architecture "
    "its llama.cpp knows (llama, qwen2, qwen3, gemma3, phi3, smollm3 and more), recurrent ones (Mamba, RWKV) aside"
)


class ModelFileError(ModelLoadError):
    """The model file cannot work with this build; the message says why and what would."""

    def __init__(self, path: Path, problem: str, alternative: str = "", engine: str = CTRANSFORMERS):
        what_works = LLAMA_WHAT_WORKS if engine == LLAMA_CPP else WHAT_WORKS
        super().__init__(f"{path}: {problem}. {alternative}{what_works}")


def _normalized(model_type: str) -> str:
    return model_type.lower().replace("-", "").replace("_", "")


# GGUF value types: struct format of the fixed-size ones.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_QUANT_SIZES = {int(kind): size for kind, size in gguf.GGML_QUANT_SIZES.items()}


class MetadataField:
    """One metadata value; a string array (a vocabulary, its merges) is decoded only
    when :meth:`contents` is called, raising UnicodeDecodeError for bytes that are not
    UTF-8. Shaped like ``gguf.ReaderField.contents()``."""

    def __init__(self, name: str, value_type: int, value=None, lazy: tuple | None = None, item_type: int | None = None):
        self.name = name
        self.value_type = value_type
        # An array's element type, so that a copy keeps it.
        self.item_type = item_type
        self._value = value
        # (mapping, offset, count) of a string array not decoded yet.
        self._lazy = lazy

    def contents(self):
        if self._lazy is not None:
            data, offset, count = self._lazy
            items = []
            for _ in range(count):
                (length,) = struct.unpack_from("<Q", data, offset)
                # Strict, as gguf's own reader: a vocabulary of raw bytes is not text.
                items.append(bytes(data[offset + 8 : offset + 8 + length]).decode("utf-8"))
                offset += 8 + length
            self._value, self._lazy = items, None
        return self._value


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_id: int
    shape: tuple[int, ...]
    offset: int

    @property
    def type_name(self) -> str:
        try:
            return gguf.GGMLQuantizationType(self.type_id).name
        except ValueError:
            return f"unknown ({self.type_id})"

    @property
    def n_bytes(self) -> int | None:
        if self.type_id not in _QUANT_SIZES:
            return None
        block, size = _QUANT_SIZES[self.type_id]
        elements = 1
        for n in self.shape:
            elements *= n
        return elements // block * size


@dataclass(frozen=True)
class GGUFMetadata:
    version: int
    fields: dict[str, MetadataField]
    tensors: list[TensorInfo]
    # Where the tensor data begins (aligned after the tensor list).
    data_offset: int


def read_gguf_metadata(path: Path) -> GGUFMetadata:
    """Parse a GGUF v2/v3 header, metadata and tensor list, skipping over string arrays.
    Raises ValueError (or struct.error) on a damaged file."""
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    offset = 4
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", data, offset)
    offset += 20

    def string(at: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", data, at)
        if at + 8 + length > len(data):
            raise ValueError("the file ends inside its metadata")
        return bytes(data[at + 8 : at + 8 + length]).decode("utf-8", "replace"), at + 8 + length

    def value(kind: int, at: int):
        if kind in _SCALARS:
            fmt = "<" + _SCALARS[kind]
            return struct.unpack_from(fmt, data, at)[0], at + struct.calcsize(fmt)
        if kind == _STRING:
            return string(at)
        raise ValueError(f"unknown metadata value type {kind}")

    fields: dict[str, MetadataField] = {}
    for _ in range(kv_count):
        name, offset = string(offset)
        (kind,) = struct.unpack_from("<I", data, offset)
        offset += 4
        if kind != _ARRAY:
            item, offset = value(kind, offset)
            fields[name] = MetadataField(name, kind, item)
            continue
        item_kind, count = struct.unpack_from("<IQ", data, offset)
        offset += 12
        if item_kind in _SCALARS:
            width = struct.calcsize(_SCALARS[item_kind])
            if offset + width * count > len(data):
                raise ValueError("the file ends inside its metadata")
            items = np.frombuffer(data, dtype=np.dtype("<" + _SCALARS[item_kind]), count=count, offset=offset)
            fields[name] = MetadataField(name, _ARRAY, items.tolist(), item_type=item_kind)
            offset += width * count
        elif item_kind == _STRING:
            start = offset
            for _ in range(count):
                (length,) = struct.unpack_from("<Q", data, offset)
                offset += 8 + length
            if offset > len(data):
                raise ValueError("the file ends inside its metadata")
            fields[name] = MetadataField(name, _ARRAY, lazy=(data, start, count), item_type=item_kind)
        else:
            raise ValueError(f"unsupported metadata array of type {item_kind} in {name}")
    tensors = []
    for _ in range(tensor_count):
        name, offset = string(offset)
        (n_dims,) = struct.unpack_from("<I", data, offset)
        shape = struct.unpack_from(f"<{n_dims}Q", data, offset + 4)
        offset += 4 + 8 * n_dims
        type_id, tensor_offset = struct.unpack_from("<IQ", data, offset)
        offset += 12
        tensors.append(TensorInfo(name, type_id, tuple(shape), tensor_offset))
    alignment_field = fields.get("general.alignment")
    alignment = int(alignment_field.contents()) if alignment_field is not None else 32
    data_offset = (offset + alignment - 1) // alignment * alignment
    return GGUFMetadata(version, fields, tensors, data_offset)


def check_model_file(path: Path, model_type: str | None, engine: str = CTRANSFORMERS) -> dict | None:
    """Return a GGUF file's metadata fields (``name -> field.contents()``-able), or None
    for a GGML file; raise ModelFileError for anything ``engine`` would refuse or crash on.

    The checks run cheapest first, and a string array (the vocabulary) is only
    skipped over, so a verdict never waits for a large vocabulary to be decoded."""
    if not path.exists():
        raise ModelFileError(path, "model file not found", engine=engine)
    if not path.is_file():
        raise ModelFileError(path, "model path is not a file", engine=engine)
    with open(path, "rb") as f:
        header = f.read(8)
    if header[:4] != b"GGUF":
        if engine == LLAMA_CPP:
            raise ModelFileError(path, "not a GGUF file", engine=engine)
        _check_ggml(path, header, model_type)
        return None
    version = int.from_bytes(header[4:8], "little")
    if version not in GGUF_VERSIONS:
        raise ModelFileError(path, f"GGUF version {version} is not supported", engine=engine)
    try:
        metadata = read_gguf_metadata(path)
    except Exception as exc:  # struct.error, ValueError, OverflowError on damaged files
        raise ModelFileError(
            path, f"not a readable GGUF file, perhaps truncated ({type(exc).__name__}: {_one_line(exc)})", engine=engine
        ) from None
    fields = metadata.fields
    parts = _split_count(fields)
    # A later part of a split file has tensors and no metadata: the first part is the model's file.
    part = _integer(fields, "split.no") or 0
    if parts > 1 and part:
        raise ModelFileError(
            path,
            f"the file is part {part + 1} of a GGUF split into {parts} parts, which is "
            f"loaded from its first part, NAME-00001-of-{parts:05d}.gguf",
            engine=engine,
        )
    architecture = _string(fields, "general.architecture")
    if architecture is None:
        raise ModelFileError(path, "the GGUF file names no architecture (general.architecture)", engine=engine)
    has_tokenizer = "tokenizer.ggml.tokens" in fields
    # llama.cpp can run any file it knows the architecture of, with tensors and a tokenizer.
    other_engine = OTHER_ENGINE if engine != LLAMA_CPP and architecture in LLAMA_CPP_ARCHITECTURES else ""
    if parts > 1:
        _check_split(path, parts, other_engine, engine)
    elif not metadata.tensors:
        raise ModelFileError(
            path, "the GGUF file has no tensors (a vocabulary-only file holds no model)", engine=engine
        )
    if not has_tokenizer:
        raise ModelFileError(path, "the GGUF file has no tokenizer (no tokenizer.ggml.tokens)", engine=engine)
    unknown = sorted({t.type_id for t in metadata.tensors} - set(_QUANT_SIZES))
    if unknown:
        raise ModelFileError(
            path, f"tensor type {', '.join(map(str, unknown))} is an unknown quantization type", engine=engine
        )
    size = path.stat().st_size
    end = metadata.data_offset + max((t.offset + (t.n_bytes or 0) for t in metadata.tensors), default=0)
    if end > size:
        raise ModelFileError(
            path, f"the file is truncated: tensor data ends at byte {end}, the file has {size}", engine=engine
        )
    if engine == LLAMA_CPP:
        if architecture not in LLAMA_CPP_ARCHITECTURES:
            raise ModelFileError(path, f"GGUF architecture {architecture!r} is not one llama.cpp knows", engine=engine)
        return fields
    if architecture not in GGUF_ARCHITECTURES:
        raise ModelFileError(path, f"GGUF architecture {architecture!r} is not supported", other_engine, engine=engine)
    tokenizer = _string(fields, "tokenizer.ggml.model")
    if tokenizer not in GGUF_TOKENIZERS:
        raise ModelFileError(
            path,
            f"tokenizer type {tokenizer!r} is not supported (supported: {', '.join(GGUF_TOKENIZERS)})",
            other_engine,
            engine=engine,
        )
    newer = sorted({t.type_name for t in metadata.tensors} - set(LOADER_TENSOR_TYPES))
    if newer:
        raise ModelFileError(
            path,
            f"tensor type {', '.join(newer)} is newer than the bundled loader "
            f"(it computes {', '.join(LOADER_TENSOR_TYPES)})",
            other_engine,
            engine=engine,
        )
    if any(t.name == ROPE_FREQS_TENSOR for t in metadata.tensors):
        raise ModelFileError(
            path,
            f"the file has a {ROPE_FREQS_TENSOR} tensor: Llama 3.1-style frequency-dependent RoPE scaling, "
            "which the bundled 2023 loader cannot apply",
            other_engine,
            engine=engine,
        )
    return fields


# The parts of a split GGUF, as llama.cpp's gguf-split names them; the first holds the metadata.
SPLIT_PART = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<parts>\d{5})\.gguf$", re.IGNORECASE)


def models_in_folder(folder: Path) -> list[Path]:
    """The models in a folder, by file name: each GGUF file, a split model by its first part.
    A vision projector (``mmproj``) is not a model; nor is anything in a folder within."""
    models = []
    for path in sorted(folder.iterdir()):
        name = path.name.lower()
        if not path.is_file() or not name.endswith(".gguf") or "mmproj" in name:
            continue
        part = SPLIT_PART.match(path.name)
        if part is None or int(part["part"]) == 1:
            models.append(path)
    return models


def _split_count(fields: dict) -> int:
    value = _integer(fields, "split.count")
    return value if value is not None else 1


def _check_split(path: Path, parts: int, other_engine: str, engine: str) -> None:
    """A split GGUF: only llama.cpp loads one, from its first part, with the others beside it."""
    if engine != LLAMA_CPP:
        raise ModelFileError(path, f"the file is the first of a GGUF split into {parts} parts", other_engine)
    named = SPLIT_PART.match(path.name)
    if named is None or int(named["part"]) != 1 or int(named["parts"]) != parts:
        raise ModelFileError(
            path,
            f"a GGUF split into {parts} parts is loaded from its first part, NAME-00001-of-{parts:05d}.gguf",
            engine=engine,
        )
    for number in range(2, parts + 1):
        part = path.with_name(f"{named['stem']}-{number:05d}-of-{parts:05d}.gguf")
        if not part.is_file():
            raise ModelFileError(path, f"part {number} of {parts}, {part.name}, is not beside it", engine=engine)


def _integer(fields: dict, key: str) -> int | None:
    if key not in fields:
        return None
    value = fields[key].contents()
    return value if isinstance(value, int) else None


def _check_ggml(path: Path, header: bytes, model_type: str | None) -> None:
    if model_type is None:
        if header[:4] in GGML_MAGICS:
            raise ModelFileError(path, "not a GGUF file but a GGML one; pass its --model-type")
        raise ModelFileError(path, "not a GGUF file, nor a GGML one")
    if _normalized(model_type) not in {_normalized(t) for t in GGML_MODEL_TYPES}:
        raise ModelFileError(path, f"unknown --model-type {model_type!r}")
    if header[:4] not in GGML_MAGICS:
        raise ModelFileError(path, "not a GGML file, nor a GGUF one")
    return None


def _string(fields: dict, key: str) -> str | None:
    if key not in fields:
        return None
    value = fields[key].contents()
    return value if isinstance(value, str) else None


def _one_line(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    return text[:200]
