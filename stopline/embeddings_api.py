"""OpenAI's embeddings endpoint, POST /v1/embeddings, answered by all-MiniLM-L6-v2 from its
GGUF file by llama.cpp (:mod:`.engine.llama_embeddings`).

The model loads on the first request, and every batch runs on a thread of its own, so the
event loop goes on streaming generations while llama.cpp works. A request is checked whole (its
fields, the number of its inputs, their size) before any work starts.
"""

from __future__ import annotations

import asyncio
import base64
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

from .engine.embeddings import DIMENSIONS, Embedded
from .engine.errors import EngineError
from .engine.llama_embeddings import LazyEncoder
from .engine.model import ModelFetchError
from .http_api import _NO_STORE, error_response
from .observability import log
from .protocol.errors import (
    InvalidField,
    ModelNotFound,
    PromptTooLong,
    ProtocolError,
    StoplineError,
    UnsupportedParameter,
)
from .protocol.validation import parse_json_object
from .protocol.vocabulary import ErrorCode

if TYPE_CHECKING:
    from .http_api import HttpApi


class TooManyInputs(ProtocolError):
    """POST /v1/embeddings: more inputs than one request may embed."""

    code = ErrorCode.TOO_MANY_INPUTS


# What one request may embed: this many inputs, this many characters in all (inputs are cut
# at 256 tokens each, about 1,000 characters of English, so more text would only cost
# tokenizing). A body is also bounded by the largest frame, 1 MiB.
MAX_INPUTS = 256
MAX_TOTAL_CHARS = 256 * 2048
ENCODING_FORMATS = ("float", "base64")
# Fields a request may send that change nothing here (user: OpenAI's end-user id).
_IGNORED = frozenset({"user"})
_KNOWN = frozenset({"input", "model", "encoding_format", "dimensions"}) | _IGNORED


class EmbeddingModelUnavailable(StoplineError):
    """The embedding model could not be fetched or read: answered as internal_error."""


@dataclass(frozen=True)
class EmbeddingsRequest:
    texts: list[str]
    model: str
    encoding_format: str


def checked_texts(texts: object) -> list[str]:
    """An embedding request's ``input`` (OpenAI's, or Ollama's), checked: one text or a list of
    them, within this server's bounds; a ProtocolError naming ``input`` refuses it."""
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not texts:
        raise InvalidField("input must be a string or a non-empty list of strings", param="input")
    if not all(isinstance(t, str) for t in texts):
        if all(isinstance(t, int) or isinstance(t, list) for t in texts):
            raise UnsupportedParameter("input as token ids is not supported: send the texts themselves", param="input")
        raise InvalidField("input must be a string or a list of strings", param="input")
    if len(texts) > MAX_INPUTS:
        raise TooManyInputs(
            f"input holds {len(texts)} texts; one request may embed at most {MAX_INPUTS}", param="input"
        )
    if any(not t for t in texts):
        raise InvalidField("input must not hold an empty string", param="input")
    total = sum(len(t) for t in texts)
    if total > MAX_TOTAL_CHARS:
        raise PromptTooLong(
            f"input holds {total} characters; one request may embed at most {MAX_TOTAL_CHARS}", param="input"
        )
    return texts


def embeddings_request(body: dict, served: str) -> EmbeddingsRequest:
    """A request body, checked; a ProtocolError (with the field it is about) refuses it."""
    for name in body:
        if name not in _KNOWN:
            raise UnsupportedParameter(f"{name} is not supported by /v1/embeddings", param=name)
    model = body.get("model")
    if not isinstance(model, str):
        raise InvalidField("model must be a string: the embedding model's name", param="model")
    if model != served:
        raise ModelNotFound(
            f"the model {model!r} does not serve embeddings here; this server embeds with {served!r}", param="model"
        )
    texts = checked_texts(body.get("input"))
    encoding_format = body.get("encoding_format", "float")
    if encoding_format not in ENCODING_FORMATS:
        raise InvalidField(f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}", param="encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None and (isinstance(dimensions, bool) or dimensions != DIMENSIONS):
        raise UnsupportedParameter(f"dimensions must be {DIMENSIONS}, this model's size, if given", param="dimensions")
    return EmbeddingsRequest(texts, model, encoding_format)


class EmbeddingsApi:
    """POST /v1/embeddings, with one model that loads on first use."""

    def __init__(self, api: HttpApi, model_name: str):
        self.api = api
        self.model_name = model_name
        self.encoder = LazyEncoder()
        # One batch at a time: an evaluation uses every core already.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stopline-embed")
        api.app.on_cleanup.append(self._close)

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/embeddings", self._embeddings)]

    async def _close(self, app: web.Application) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def load(self) -> int:
        """Load the model unless it is loaded; the nanoseconds that took (0: it was loaded)."""
        if self.encoder.loaded:
            return 0
        started = time.monotonic_ns()
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, self.encoder.get)
        except (ModelFetchError, EngineError, OSError, zipfile.BadZipFile) as exc:
            log.error("embedding_model_unavailable", model=self.model_name, detail=str(exc))
            raise EmbeddingModelUnavailable(f"the embedding model could not be loaded: {exc}") from exc
        return time.monotonic_ns() - started

    async def embed(self, texts: list[str]) -> Embedded:
        """Each text's unit-length embedding, worked out off the event loop (every API's
        embeddings come through here); EmbeddingModelUnavailable if the model cannot be loaded."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, lambda: self.encoder.get().embed(texts))
        except (ModelFetchError, EngineError, OSError, zipfile.BadZipFile) as exc:
            log.error("embedding_model_unavailable", model=self.model_name, detail=str(exc))
            raise EmbeddingModelUnavailable(f"the embedding model could not be loaded: {exc}") from exc

    async def _embeddings(self, request: web.Request) -> web.Response:
        try:
            asked = embeddings_request(parse_json_object(await request.text(), "body"), self.model_name)
        except ProtocolError as exc:
            return error_response(exc.code, exc.message, openai=True, param=exc.param)
        try:
            embedded = await self.embed(asked.texts)
        except EmbeddingModelUnavailable as exc:
            return error_response(ErrorCode.INTERNAL_ERROR, str(exc), openai=True)
        data = []
        for index, vector in enumerate(embedded.vectors):
            if asked.encoding_format == "base64":
                # OpenAI's base64: the little-endian float32 bytes.
                shown: list[float] | str = base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
            else:
                shown = vector.tolist()
            data.append({"object": "embedding", "index": index, "embedding": shown})
        tokens = sum(embedded.token_counts)
        body = {
            "object": "list",
            "data": data,
            "model": self.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        return web.json_response(body, headers=_NO_STORE)
