"""Check a model file before any of it reaches C.

The bundled loader (ctransformers 0.2.27, with a llama.cpp from 2023) does not
survive every file: a GGUF of an architecture it does not know, or one without
a vocabulary, ends in a crash or a long traceback. :func:`check_model_file`
reads only the header and metadata and raises :class:`ModelFileError` with one
line that says what is wrong and what would work.
"""

from __future__ import annotations

from pathlib import Path

from stopline._core import ModelLoadError

# What this build can run, as measured (README, "Models").
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

WHAT_WORKS = (
    f"Stopline runs GGUF v{GGUF_VERSIONS[0]}-v{GGUF_VERSIONS[-1]} files of architecture "
    f"{', '.join(GGUF_ARCHITECTURES)} that carry their tokenizer, and GGML files of the "
    f"ctransformers types {', '.join(GGML_MODEL_TYPES)} (pass --model-type)"
)


LLAMA_WHAT_WORKS = (
    f"The llama.cpp engine runs GGUF v{GGUF_VERSIONS[0]}-v{GGUF_VERSIONS[-1]} files of any architecture "
    "its llama.cpp knows (llama, qwen2, qwen3, gemma3, phi3, smollm3 and more)"
)


class ModelFileError(ModelLoadError):
    """The model file cannot work with this build; the message says why and what would."""

    def __init__(self, path: Path, problem: str, what_works: str = WHAT_WORKS):
        super().__init__(f"{path}: {problem}. {what_works}")


def _normalized(model_type: str) -> str:
    return model_type.lower().replace("-", "").replace("_", "")


def check_model_file(path: Path, model_type: str | None) -> dict | None:
    """Return a GGUF file's metadata fields, or None for a GGML file; raise ModelFileError
    for anything the loader would refuse or crash on."""
    if not path.exists():
        raise ModelFileError(path, "model file not found")
    if not path.is_file():
        raise ModelFileError(path, "model path is not a file")
    with open(path, "rb") as f:
        header = f.read(8)
    if header[:4] != b"GGUF":
        _check_ggml(path, header, model_type)
        return None
    version = int.from_bytes(header[4:8], "little")
    if version not in GGUF_VERSIONS:
        raise ModelFileError(path, f"GGUF version {version} is not supported")
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    except Exception as exc:  # the reader raises many kinds on damaged files
        raise ModelFileError(
            path, f"not a readable GGUF file, perhaps truncated ({type(exc).__name__}: {_one_line(exc)})"
        ) from None
    size = path.stat().st_size
    if end > size:
        raise ModelFileError(path, f"the file is truncated: tensor data ends at byte {end}, the file has {size}")
    fields = reader.fields
    architecture = _string(fields, "general.architecture")
    if architecture is None:
        raise ModelFileError(path, "the GGUF file names no architecture (general.architecture)")
    if architecture not in GGUF_ARCHITECTURES:
        raise ModelFileError(path, f"GGUF architecture {architecture!r} is not supported")
    if "tokenizer.ggml.tokens" not in fields:
        raise ModelFileError(path, "the GGUF file has no tokenizer (no tokenizer.ggml.tokens)")
    tokenizer = _string(fields, "tokenizer.ggml.model")
    if tokenizer not in GGUF_TOKENIZERS:
        raise ModelFileError(
            path, f"tokenizer type {tokenizer!r} is not supported (supported: {', '.join(GGUF_TOKENIZERS)})"
        )
    newer = sorted({t.tensor_type.name for t in reader.tensors} - set(LOADER_TENSOR_TYPES))
    if newer:
        raise ModelFileError(
            path,
            f"tensor type {', '.join(newer)} is newer than the bundled loader "
            f"(it computes {', '.join(LOADER_TENSOR_TYPES)})",
        )
    return fields


def check_llama_model_file(path: Path) -> None:
    """Raise ModelFileError, in the llama.cpp engine's terms, for a path that is not a
    GGUF file of a version it reads. Everything inside the file (architecture,
    tensors, vocabulary, bounds) llama.cpp's loader checks itself, and it refuses a
    damaged file with an error rather than an assert."""
    if not path.exists():
        raise ModelFileError(path, "model file not found", LLAMA_WHAT_WORKS)
    if not path.is_file():
        raise ModelFileError(path, "model path is not a file", LLAMA_WHAT_WORKS)
    with open(path, "rb") as f:
        header = f.read(8)
    if header[:4] != b"GGUF":
        raise ModelFileError(path, "not a GGUF file", LLAMA_WHAT_WORKS)
    version = int.from_bytes(header[4:8], "little")
    if version not in GGUF_VERSIONS:
        raise ModelFileError(path, f"GGUF version {version} is not supported", LLAMA_WHAT_WORKS)


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
    try:
        value = fields[key].contents()
    except Exception:  # a field of the wrong type
        return None
    return value if isinstance(value, str) else None


def _one_line(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    return text[:200]
