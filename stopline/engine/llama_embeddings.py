"""The served sentence embeddings: all-MiniLM-L6-v2 run by llama.cpp from its GGUF file.

The file is written once from the pinned model.zip into the cache (:mod:`.minilm_gguf`), and
llama.cpp tokenizes, evaluates and mean-pools it, as llama-server's ``--embedding`` does with
the same file. Stopline's numpy encoder (:class:`.embeddings.SentenceEncoder`) on the
safetensors is the reference the tests hold it to.
"""

from __future__ import annotations

import os
import threading
import zipfile
from pathlib import Path

import numpy as np

from .. import _core
from ..settings import cache_dir
from .embeddings import MAX_TOKENS, MODEL_ZIP_SHA256, TOKENS_PER_BATCH, Embedded, model_zip_path
from .errors import EngineError
from .minilm_gguf import write_gguf

# Named by the model.zip it is written from: another pin writes a file of its own.
GGUF_NAME = f"all-MiniLM-L6-v2-{MODEL_ZIP_SHA256[:12]}-f32.gguf"
# Inputs one evaluation takes at most: a batch's inputs are sequences of one llama.cpp context.
INPUTS_PER_BATCH = 64


def gguf_path(progress: bool = False) -> Path:
    """The model's GGUF file in the cache, written from the model.zip on first use."""
    target = cache_dir() / "embeddings" / GGUF_NAME
    if not target.is_file():
        with zipfile.ZipFile(model_zip_path(progress)) as files:
            write_gguf(files, target)
    return target


class LlamaEncoder:
    """all-MiniLM-L6-v2 by llama.cpp: unit-length embeddings of texts cut at MAX_TOKENS tokens."""

    def __init__(self, path: Path, threads: int | None = None):
        from .llama_build import LlamaBuildError, engine_library

        try:
            _core.load_llama_library(str(engine_library(progress=False)))
        except LlamaBuildError as exc:
            raise EngineError(str(exc)) from None
        self._model = _core.LlamaModel(str(path))
        self._embedder = _core.LlamaEmbedder(
            self._model,
            max_tokens=TOKENS_PER_BATCH,
            max_inputs=INPUTS_PER_BATCH,
            threads=threads or len(os.sched_getaffinity(0)),
        )
        self.dimensions = self._embedder.dimensions
        # One evaluation at a time: a llama.cpp context is not thread-safe.
        self._lock = threading.Lock()

    @classmethod
    def load(cls, progress: bool = False) -> LlamaEncoder:
        return cls(gguf_path(progress))

    def tokens(self, text: str) -> list[int]:
        """``text``'s tokens as the model reads them, [CLS] … [SEP], cut at MAX_TOKENS as
        sentence-transformers cuts them: the end mark stays."""
        ids = self._model.tokenize(text, add_special=True)
        return ids if len(ids) <= MAX_TOKENS else ids[: MAX_TOKENS - 1] + ids[-1:]

    def embed(self, texts: list[str]) -> Embedded:
        """Each text's unit-length embedding. Texts of like length are evaluated together,
        at most TOKENS_PER_BATCH tokens and INPUTS_PER_BATCH texts at a time."""
        rows = [self.tokens(text) for text in texts]
        vectors = np.empty((len(texts), self.dimensions), dtype=np.float32)
        batch: list[int] = []
        taken = 0
        for row in sorted(range(len(rows)), key=lambda i: len(rows[i])):
            if batch and (taken + len(rows[row]) > TOKENS_PER_BATCH or len(batch) == INPUTS_PER_BATCH):
                vectors[batch] = self._pooled([rows[i] for i in batch])
                batch, taken = [], 0
            batch.append(row)
            taken += len(rows[row])
        vectors[batch] = self._pooled([rows[i] for i in batch])
        return Embedded(vectors, [len(ids) for ids in rows])

    def _pooled(self, inputs: list[list[int]]) -> np.ndarray:
        with self._lock:
            raw = self._embedder.embed(inputs)
        pooled = np.frombuffer(raw, dtype=np.float32).reshape(len(inputs), self.dimensions)
        return pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)

    def close(self) -> None:
        self._embedder.close()
        self._model.close()


class LazyEncoder:
    """The encoder, loaded on first use (a second; on the very first, a download and the
    file's writing) and kept."""

    def __init__(self, progress: bool = False):
        self._progress = progress
        self._lock = threading.Lock()
        self._encoder: LlamaEncoder | None = None

    @property
    def loaded(self) -> bool:
        return self._encoder is not None

    def get(self) -> LlamaEncoder:
        with self._lock:
            if self._encoder is None:
                self._encoder = LlamaEncoder.load(self._progress)
            return self._encoder
