"""all-MiniLM-L6-v2 as a BERT GGUF file, written from the pinned model.zip with no torch.

The tensors keep their float32 values and take the names gguf's tensor-name map gives BERT
(:func:`.embeddings.gguf_named`); the metadata is what llama.cpp's BERT loader reads: the
shapes, a non-causal attention, mean pooling, and the WordPiece vocabulary as tokenizer model
"bert". llama-server serves the file with ``--embedding``; :func:`read_gguf` reads it back into
Stopline's own numpy encoder.

    python -m stopline.engine.minilm_gguf OUT.gguf
"""

from __future__ import annotations

import argparse
import json
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from .embeddings import SentenceEncoder, gguf_named, model_zip_path, sentence_tokenizer
from .model import atomic_path

ARCH = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.BERT]
MODEL_NAME = "all-MiniLM-L6-v2"
# llama.cpp's WordPiece tokenizer marks a word's start with this, where the vocabulary marks
# a word's continuation with "##".
WORD_START = "\u2581"
CONTINUATION = "##"


@dataclass(frozen=True)
class Vocab:
    """The WordPiece vocabulary in id order, as llama.cpp's "bert" tokenizer model reads it."""

    tokens: list[str]
    token_types: list[int]
    special_ids: dict[str, int]


def wordpiece_vocab(tokenizer_json: dict) -> Vocab:
    model = tokenizer_json["model"]
    if model["type"] != "WordPiece" or model.get("continuing_subword_prefix", CONTINUATION) != CONTINUATION:
        raise ValueError(f"not a WordPiece vocabulary with {CONTINUATION!r} continuations: {model['type']}")
    by_id = {token_id: token for token, token_id in model["vocab"].items()}
    if sorted(by_id) != list(range(len(by_id))):
        raise ValueError("the vocabulary's ids are not 0 to n - 1")
    special = {added["content"] for added in tokenizer_json.get("added_tokens", []) if added.get("special")}
    tokens, types = [], []
    for token_id in range(len(by_id)):
        token = by_id[token_id]
        if token in special:
            tokens.append(token)
            types.append(gguf.TokenType.CONTROL)
        else:
            tokens.append(token[len(CONTINUATION) :] if token.startswith(CONTINUATION) else WORD_START + token)
            types.append(gguf.TokenType.NORMAL)
    ids = model["vocab"]
    # llama.cpp's BERT input is [CLS] text [SEP]: its "bos" is the [CLS] token.
    special_ids = {
        "bos": ids["[CLS]"],
        "sep": ids["[SEP]"],
        "unk": ids[model["unk_token"]],
        "pad": ids["[PAD]"],
        "mask": ids["[MASK]"],
    }
    return Vocab(tokens, [int(t) for t in types], special_ids)


def write_gguf(files: zipfile.ZipFile, target: Path) -> None:
    """Write the model.zip's BERT as a GGUF file at ``target`` (whole, or not at all)."""
    from safetensors.numpy import load

    config = json.loads(files.read("config.json"))
    if config.get("model_type") != "bert" or config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"not a BERT with absolute positions: {config.get('model_type')}")
    pooling = json.loads(files.read("1_Pooling/config.json"))
    if not pooling.get("pooling_mode_mean_tokens"):
        raise ValueError("the model does not mean-pool its token states")
    blocks = int(config["num_hidden_layers"])
    tensors = gguf_named(load(files.read("model.safetensors")), blocks)
    vocab = wordpiece_vocab(json.loads(files.read("tokenizer.json")))
    if len(vocab.tokens) != tensors["token_embd.weight"].shape[0]:
        raise ValueError(f"{len(vocab.tokens)} tokens for {tensors['token_embd.weight'].shape[0]} embeddings")

    with atomic_path(target) as temp:
        writer = gguf.GGUFWriter(temp, ARCH)
        writer.add_name(MODEL_NAME)
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        writer.add_context_length(int(config["max_position_embeddings"]))
        writer.add_embedding_length(int(config["hidden_size"]))
        writer.add_feed_forward_length(int(config["intermediate_size"]))
        writer.add_block_count(blocks)
        writer.add_head_count(int(config["num_attention_heads"]))
        writer.add_layer_norm_eps(float(config["layer_norm_eps"]))
        writer.add_causal_attention(False)
        writer.add_pooling_type(gguf.PoolingType.MEAN)
        writer.add_tokenizer_model("bert")
        # Not read for a WordPiece vocabulary; written so the file names its pre-tokenizer.
        writer.add_tokenizer_pre("default")
        writer.add_token_list(vocab.tokens)
        writer.add_token_types(vocab.token_types)
        writer.add_token_type_count(int(config["type_vocab_size"]))
        writer.add_bos_token_id(vocab.special_ids["bos"])
        writer.add_sep_token_id(vocab.special_ids["sep"])
        writer.add_unk_token_id(vocab.special_ids["unk"])
        writer.add_pad_token_id(vocab.special_ids["pad"])
        writer.add_mask_token_id(vocab.special_ids["mask"])
        writer.add_add_bos_token(True)
        writer.add_add_sep_token(True)
        writer.add_add_eos_token(False)
        for name, value in tensors.items():
            writer.add_tensor(name, np.ascontiguousarray(value))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()


def field_value(reader: gguf.GGUFReader, key: str):
    """A metadata field's value: a number, a string, or a list of them."""
    field = reader.get_field(key)
    if field is None:
        raise KeyError(key)
    return field.contents()


def read_gguf(path: Path, tokenizer_json: str) -> SentenceEncoder:
    """Stopline's numpy encoder on the GGUF file's tensors and shapes (the tokenizer is the
    model.zip's: the file's vocabulary is the same, in llama.cpp's spelling)."""
    reader = gguf.GGUFReader(path)
    if field_value(reader, gguf.Keys.General.ARCHITECTURE) != ARCH:
        raise ValueError(f"{path}: not a {ARCH} file")
    for tensor in reader.tensors:
        if tensor.tensor_type != gguf.GGMLQuantizationType.F32:
            raise ValueError(f"{path}: {tensor.name} is {tensor.tensor_type.name}, not F32")
    tensors = {tensor.name: np.array(tensor.data) for tensor in reader.tensors}
    heads = int(field_value(reader, gguf.Keys.Attention.HEAD_COUNT.format(arch=ARCH)))
    eps = float(field_value(reader, gguf.Keys.Attention.LAYERNORM_EPS.format(arch=ARCH)))
    return SentenceEncoder(sentence_tokenizer(tokenizer_json), tensors, heads, eps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stopline.engine.minilm_gguf", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the GGUF file to write")
    args = parser.parse_args(argv)
    with zipfile.ZipFile(model_zip_path(progress=True)) as files:
        write_gguf(files, args.out)
    print(f"written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
