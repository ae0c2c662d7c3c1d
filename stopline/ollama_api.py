"""Ollama's API under /api: chat and generate, streamed as NDJSON (Ollama's default) or one body,
and the model listings its clients read (tags, show, ps, version).

Each generation runs through the same session, scheduler and native loop as every other API's
(:meth:`HttpApi._generate`), so a closed connection cancels it with reason client_disconnected.
The request's translation is :mod:`.api.ollama`.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from http import HTTPStatus
from typing import TYPE_CHECKING

from aiohttp import web

from . import __version__
from .api.ollama import (
    OLLAMA_VERSION,
    OllamaRequest,
    counts,
    done_reason,
    ollama_embed_request,
    ollama_request,
)
from .embeddings_api import EmbeddingModelUnavailable, checked_texts
from .engine.embeddings import DIMENSIONS
from .http_api import _NO_STORE, HttpReply, _request_headers, http_status
from .protocol.errors import InsufficientMemory, InvalidField, ProtocolError
from .protocol.frames import Accepted, Frame, Terminal, Token, as_error, encode_json
from .protocol.validation import parse_json_object
from .protocol.vocabulary import ErrorCode, Refusal
from .settings import keep_alive

if TYPE_CHECKING:
    from .embeddings_api import EmbeddingsApi
    from .http_api import HttpApi
    from .residency import LazyModel

_NDJSON_HEADERS = {"Content-Type": "application/x-ndjson", "X-Accel-Buffering": "no", **_NO_STORE}
# When a model that is never unloaded expires, as Ollama writes it: the first model, and any other
# whose keep_alive is negative.
_NEVER = "2999-01-01T00:00:00Z"


def _keep_alive(value: object) -> float:
    try:
        return keep_alive(value)
    except ValueError as exc:
        raise InvalidField(str(exc), param="keep_alive") from None


def _expires_at(lazy: LazyModel | None) -> str:
    """When a loaded model unloads unless asked for again: its keep_alive from the end of its last
    request (from now, while a request holds it)."""
    if lazy is None or lazy.keep_alive_s < 0:
        return _NEVER
    at = lazy.expires_at if lazy.expires_at is not None else time.time() + lazy.keep_alive_s
    return datetime.fromtimestamp(at, UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def ollama_error(code: ErrorCode | Refusal, message: str) -> web.Response:
    """An error in Ollama's shape, ``{"error": message, "code": code}``, with the status Stopline gives its code."""
    status = http_status(code) if isinstance(code, ErrorCode) else HTTPStatus.BAD_REQUEST
    # The code is Stopline's stable name for the error, as on every API; Ollama's clients read "error".
    return web.json_response({"error": message, "code": str(code)}, status=status, headers=dict(_NO_STORE))


class OllamaReply(HttpReply):
    """POST /api/chat and /api/generate: one JSON object a line, or one body at the end."""

    def __init__(self, http_request: web.Request, asked: OllamaRequest):
        super().__init__(http_request)
        self.asked = asked
        self._headers: dict = {}
        self._texts: list[str] = []

    async def emit(self, frame: Frame) -> None:
        error = as_error(frame)
        if error is not None:
            if self.asked.stream and self.response is not None:
                # The stream had started: Ollama's in-stream error line ends it.
                await self._line({"error": error.message, "code": str(error.code)})
            else:
                self.response = ollama_error(error.code, error.message)
                self.response.headers.update(self._headers)
        elif isinstance(frame, Accepted):
            self._headers = _request_headers(frame)
            if self.asked.stream:
                self.response = web.StreamResponse(headers={**_NDJSON_HEADERS, **self._headers})
                await self.response.prepare(self.http_request)
        elif isinstance(frame, Token):
            if self.asked.stream:
                await self._line({**self._text(frame.text), "done": False})
            else:
                self._texts.append(frame.text)
        elif isinstance(frame, Terminal):
            ending = frame.ending
            text = "" if self.asked.stream else "".join(self._texts)
            # The final object also carries Stopline's terminal frame: how it ended and what stopping cost.
            final = {
                **self._text(text),
                "done": True,
                "done_reason": done_reason(ending),
                **counts(ending),
                "stopline": frame.json(),
            }
            if self.asked.stream:
                await self._line(final)
            else:
                self.response = web.json_response(final, headers={**_NO_STORE, **self._headers})

    def _text(self, text: str) -> dict:
        """An object's model, time and text: chat's assistant message, or generate's response."""
        shown = {"message": {"role": "assistant", "content": text}} if self.asked.chat else {"response": text}
        return {"model": self.asked.model, "created_at": _now(), **shown}

    async def _line(self, body: dict) -> None:
        assert self.response is not None  # a stream's response is prepared before its first line
        await self.response.write(encode_json(body).encode() + b"\n")


class OllamaApi:
    """The /api routes, answered with the HTTP API's models, limits and generations, and the
    embedding model's embeddings (``embeddings`` None: the server embeds nothing)."""

    def __init__(self, api: HttpApi, embeddings: EmbeddingsApi | None = None):
        self.api = api
        self.embeddings = embeddings

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/api/chat", self._chat),
            web.post("/api/generate", self._generate),
            web.get("/api/tags", self._tags),
            web.post("/api/show", self._show),
            web.get("/api/ps", self._ps),
            web.get("/api/version", self._version),
            web.post("/api/embed", self._embed),
            web.post("/api/embeddings", self._embeddings_legacy),
        ]

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._run(request, chat=True)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        return await self._run(request, chat=False)

    async def _run(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        api = self.api
        try:
            body = parse_json_object(await request.text(), "body")
            asked = ollama_request(
                body, chat=chat, models=api.models, limits=api.services_for(body.get("model")).limits
            )
            kept = None if body.get("keep_alive") is None else _keep_alive(body["keep_alive"])
        except ProtocolError as exc:
            return ollama_error(exc.code, exc.message)
        lazy = api.lazy_for(asked.model)
        if lazy is not None and kept is not None:
            # As Ollama does: this request's keep_alive is the model's from now on. The first model
            # is always loaded, so for it the field is accepted and changes nothing.
            lazy.keep_alive_s = kept
        if asked.frame is None:
            # No messages or no prompt: Ollama's way to load a model (or, with keep_alive 0, to unload it).
            reason = "load"
            if lazy is not None and kept == 0:
                reason = "unload"
                if lazy.loaded and lazy.holders == 0:
                    await lazy.unload("keep_alive")
            elif lazy is not None:
                lazy.hold()
                try:
                    await lazy.ready()
                except InsufficientMemory as exc:
                    return ollama_error(exc.code, exc.message)
                finally:
                    lazy.release()
            shown = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
            body = {"model": asked.model, "created_at": _now(), **shown, "done": True, "done_reason": reason}
            return web.json_response(body, headers=_NO_STORE)
        return await api._generate(
            request,
            [asked.frame],
            OllamaReply(request, asked),
            api.services_for(asked.model),
            api.lazy_for(asked.model),
        )

    def _modified_at(self) -> str:
        return datetime.fromtimestamp(self.api.created, UTC).isoformat().replace("+00:00", "Z")

    def _details(self) -> dict:
        return {"parent_model": "", "format": "gguf", "family": "", "families": None}

    def _entry(self, name: str) -> dict:
        # Stopline serves one loaded model under each of its names; size and digest are not tracked.
        return {"name": name, "model": name, "modified_at": self._modified_at(), "size": 0, "digest": ""}

    async def _tags(self, request: web.Request) -> web.Response:
        models = [{**self._entry(n), "details": self._details()} for n in self.api.models.names]
        return web.json_response({"models": models}, headers=_NO_STORE)

    async def _ps(self, request: web.Request) -> web.Response:
        # The loaded models only: the first always, the others while loaded (stopline/residency.py).
        models = []
        for name in self.api.models.names:
            lazy = self.api.lazy.get(name)
            if lazy is not None and not lazy.loaded:
                continue
            models.append(
                {
                    **self._entry(name),
                    "details": self._details(),
                    "expires_at": _expires_at(lazy),
                    "size_vram": 0,
                    "context_length": (
                        lazy.limits if lazy is not None and lazy.limits else self.api.services.limits
                    ).context_length,
                }
            )
        return web.json_response({"models": models}, headers=_NO_STORE)

    async def _show(self, request: web.Request) -> web.Response:
        try:
            body = parse_json_object(await request.text(), "body")
        except ProtocolError as exc:
            return ollama_error(exc.code, exc.message)
        # Older clients name the model "name".
        name = body.get("model", body.get("name"))
        if name not in self.api.models.names:
            served = ", ".join(repr(n) for n in self.api.models.names)
            return ollama_error(ErrorCode.MODEL_NOT_FOUND, f"model {name!r} not found; this server serves {served}")
        show = {
            "modelfile": "",
            "parameters": "",
            "template": "",
            "details": self._details(),
            # Clients read the context length from here.
            "model_info": {"general.architecture": "stopline", "stopline.context_length": self._context_length()},
            "capabilities": ["completion"],
            "modified_at": self._modified_at(),
            "chat_format": str(self.api.models.chat_format),
        }
        return web.json_response(show, headers=_NO_STORE)

    def _context_length(self) -> int:
        return self.api.services.limits.context_length

    async def _embed(self, request: web.Request) -> web.Response:
        return await self._embedding(request, legacy=False)

    async def _embeddings_legacy(self, request: web.Request) -> web.Response:
        return await self._embedding(request, legacy=True)

    async def _embedding(self, request: web.Request, *, legacy: bool) -> web.Response:
        """POST /api/embed: ``embeddings``, one unit vector an input, with Ollama's counts; the
        older /api/embeddings: one ``embedding``. Both are the vectors /v1/embeddings answers."""
        started = time.monotonic_ns()
        if self.embeddings is None:
            message = "this server serves no embedding model (it was started with --embedding-model none)"
            return ollama_error(ErrorCode.NOT_FOUND, message)
        try:
            body = parse_json_object(await request.text(), "body")
            asked = ollama_embed_request(body, served=self.embeddings.model_name, dimensions=DIMENSIONS, legacy=legacy)
            texts = None if asked.input in (None, []) else checked_texts(asked.input)
        except ProtocolError as exc:
            return ollama_error(exc.code, exc.message)
        try:
            load_ns = await self.embeddings.load()
            embedded = None if texts is None else await self.embeddings.embed(texts)
        except EmbeddingModelUnavailable as exc:
            return ollama_error(ErrorCode.INTERNAL_ERROR, str(exc))
        vectors = [] if embedded is None else [v.tolist() for v in embedded.vectors]
        if legacy:
            return web.json_response({"embedding": vectors[0] if vectors else []}, headers=_NO_STORE)
        answer = {
            "model": asked.model,
            "embeddings": vectors,
            "total_duration": time.monotonic_ns() - started,
            "load_duration": load_ns,
            "prompt_eval_count": 0 if embedded is None else sum(embedded.token_counts),
        }
        return web.json_response(answer, headers=_NO_STORE)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": OLLAMA_VERSION, "stopline": __version__}, headers=_NO_STORE)
