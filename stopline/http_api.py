"""The HTTP API under /v1: generations by request id (SSE, GET, DELETE) and an OpenAI-compatible face.

Every generation started here runs through the same protocol state machine,
scheduler and native loop as one started on the WebSocket: each is a
:class:`session.ClientSession` whose transport is an :class:`HttpReply`
(server-sent events, or OpenAI's chunks and bodies) instead of a WebSocket,
so outcomes, logs and metrics are identical.

A closed connection cancels the generation with reason client_disconnected.
aiohttp cancels a request's handler the moment its connection is lost
(``handler_cancellation``), streaming or not; the handler's cleanup then asks
for the stop, which the native loop sees before its next step.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from typing import TYPE_CHECKING

from aiohttp import web

from .api.anthropic_messages import ERROR_TYPE, MessagesRequest, count_tokens_request, messages_request, tool_input
from .api.openai_fields import OpenAIRequest, ServedModels, openai_request
from .auth import WWW_AUTHENTICATE, ApiKey, bearer, refusal_message
from .edge import Edge, peer_name
from .observability import log_end
from .protocol.connection import ending_before_start
from .protocol.errors import (
    DuplicateId,
    InsufficientMemory,
    InvalidCancelToken,
    InvalidField,
    ProtocolError,
    RequestLookupError,
    StoreUnavailable,
    UnknownRequest,
)
from .protocol.frames import (
    Accepted,
    ErrorFrame,
    Frame,
    GenerateFrame,
    Terminal,
    Token,
    as_error,
    encode_frame,
    encode_json,
    ends_request,
)
from .protocol.requests import Ending, Request
from .protocol.validation import (
    client_cancel_token,
    client_request_id,
    generate_frame,
    model_limits,
    parse_json_object,
)
from .protocol.vocabulary import ChatFormat, ErrorCode, Outcome, Reason, Refusal, Status
from .registry import Entry
from .residency import Catalog
from .services import Services
from .session import SHORT_PROMPT_BYTES, ClientSession
from .settings import Settings
from .structured.tool_calls import CallReader, CallStarted, Event, Prose, ToolChoice

if TYPE_CHECKING:
    from .cluster import Cluster
    from .residency import LazyModel

# The API key a request was admitted with (when the server asks for keys).
API_KEY = web.RequestKey("api_key", ApiKey)

_HTTP_STATUS = {
    ErrorCode.UNAUTHORIZED: HTTPStatus.UNAUTHORIZED,
    # HTTP only: the X-Request-Id of a generation still running.
    ErrorCode.DUPLICATE_ID: HTTPStatus.CONFLICT,
    ErrorCode.QUOTA_EXCEEDED: HTTPStatus.TOO_MANY_REQUESTS,
    ErrorCode.BUSY: HTTPStatus.SERVICE_UNAVAILABLE,
    ErrorCode.INSUFFICIENT_MEMORY: HTTPStatus.SERVICE_UNAVAILABLE,
    ErrorCode.TOO_MANY_REQUESTS: HTTPStatus.TOO_MANY_REQUESTS,
    ErrorCode.RATE_LIMITED: HTTPStatus.TOO_MANY_REQUESTS,
    ErrorCode.INTERNAL_ERROR: HTTPStatus.INTERNAL_SERVER_ERROR,
    ErrorCode.NOT_FOUND: HTTPStatus.NOT_FOUND,
    ErrorCode.MODEL_NOT_FOUND: HTTPStatus.NOT_FOUND,
}
# OpenAI's error ``type`` for each HTTP status it uses.
_OPENAI_ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    504: "server_error",
}
_NO_STORE = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}
_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "X-Accel-Buffering": "no", **_NO_STORE}


def finish_reason(ending: Ending) -> str:
    """How a generation's end reads as OpenAI's finish_reason, always one of OpenAI's values;
    Stopline's own outcome and reason travel in the ``stopline`` field beside it."""
    if ending.outcome is Outcome.DONE and ending.reason is Reason.MAX_TOKENS:
        return "length"
    # A cancel or a timeout reads as "stop": the answer ended where it ended, and every OpenAI
    # client takes "stop" as a plain end, where "length" invites it to continue the text and
    # "content_filter" tells it the model refused; what stopped it is in the stopline field.
    return "stop"


def http_status(code: ErrorCode) -> int:
    return _HTTP_STATUS.get(code, HTTPStatus.BAD_REQUEST)


def error_response(
    code: ErrorCode | Refusal,
    message: str,
    *,
    openai: bool,
    status: int | None = None,
    frame: ErrorFrame | None = None,
    param: str | None = None,
) -> web.Response:
    """An error in Stopline's frame shape, or in OpenAI's shape for the OpenAI endpoints
    (``param``: the request field it is about). A refusal (before any request is read)
    names its own ``status``; ``frame`` is the error frame, if any."""
    if status is None:
        assert isinstance(code, ErrorCode)
        status = http_status(code)
    headers = dict(_NO_STORE)
    if status == HTTPStatus.UNAUTHORIZED:
        headers["WWW-Authenticate"] = WWW_AUTHENTICATE
    if code == ErrorCode.QUOTA_EXCEEDED and frame is not None:
        if frame.retry_after_s is not None:
            headers["Retry-After"] = str(math.ceil(frame.retry_after_s))
        else:
            # Waiting will not help (a prompt over the key's limit): SDKs that honour this do not retry.
            headers["X-Should-Retry"] = "false"
    if openai:
        body = {
            "error": {
                "message": message,
                "type": _OPENAI_ERROR_TYPE.get(status, "invalid_request_error"),
                "param": param,
                "code": str(code),
            }
        }
    else:
        body = (frame if frame is not None else ErrorFrame(code, message)).json()
    return web.json_response(body, status=status, headers=headers)


def _request_headers(frame: Accepted) -> dict:
    return {"X-Request-Id": frame.request_id, "X-Cancel-Token": frame.cancel_token}


class HttpReply:
    """The transport of one HTTP request's generations: their frames become the HTTP answer,
    which is complete once the last frame it waits for (``answered``) has been written."""

    def __init__(self, http_request: web.Request):
        self.http_request = http_request
        self.peer = _peer(http_request)
        self.response: web.StreamResponse | None = None
        self.answered = asyncio.Event()

    async def send(self, frame: Frame) -> None:
        if self.answered.is_set():
            return  # a cancel_ack after the terminal frame: DELETE answers that on its own connection
        try:
            await self.emit(frame)
        finally:
            if self.completes(frame):
                self.answered.set()

    def completes(self, frame: Frame) -> bool:
        """Whether ``frame``, once written, completes the answer."""
        return ends_request(frame)

    async def emit(self, frame: Frame) -> None:
        raise NotImplementedError


class SseReply(HttpReply):
    """POST /v1/generations: each frame as a server-sent event named by its type."""

    async def emit(self, frame: Frame) -> None:
        if self.response is None:
            if (error := as_error(frame)) is not None:  # refused before it started: a plain HTTP error
                self.response = error_response(error.code, error.message, openai=False, frame=error)
                return
            assert isinstance(frame, Accepted)  # the first frame of a request that was not refused
            self.response = web.StreamResponse(headers={**_SSE_HEADERS, **_request_headers(frame)})
            await self.response.prepare(self.http_request)
        await self.response.write(f"event: {frame.type}\ndata: {encode_frame(frame)}\n\n".encode())


@dataclass
class _Choice:
    """One choice of an OpenAI answer: one generation, and what its frames brought so far."""

    index: int
    # When the answer may hold function calls: what reads them out of the text, the calls
    # read so far (OpenAI's tool_calls entries), and the log probabilities not yet streamed.
    reader: CallReader | None
    # Log probabilities, when asked for (the generate frame's logprobs); None: not asked for.
    logprobs: list[dict] | None
    texts: list[str] = field(default_factory=list)
    streamed_chars: int = 0
    calls: list[dict] = field(default_factory=list)
    unsent_logprobs: list[dict] = field(default_factory=list)
    ending: Terminal | None = None
    finish_reason: str | None = None


class OpenAIReply(HttpReply):
    """POST /v1/chat/completions and /v1/completions: OpenAI's chunks, or one body at the end.
    Each of the request's choices is a generation of its own; their frames are told apart by
    their ids, the choices' indices (:meth:`OpenAIRequest.frames`)."""

    def __init__(
        self,
        http_request: web.Request,
        asked: OpenAIRequest,
        *,
        chat: bool,
        stream: bool,
        include_usage: bool,
    ):
        super().__init__(http_request)
        self.model = asked.model
        self.chat = chat
        self.stream = stream
        self.include_usage = include_usage
        self.created = int(time.time())
        self._id = ""
        self._headers: dict = {}
        calls, logprobs = asked.calls, asked.frame.params.logprobs is not None
        self._choices = {
            frame.id: _Choice(
                index,
                reader=None if calls is None else CallReader(prose=calls is ToolChoice.AUTO),
                logprobs=[] if logprobs else None,
            )
            for index, frame in enumerate(asked.frames)
        }
        # An error ends the whole answer; the choices still running then stop with the request.
        self._failed = False

    def completes(self, frame: Frame) -> bool:
        return self._failed or all(c.ending is not None for c in self._choices.values())

    async def emit(self, frame: Frame) -> None:
        error = as_error(frame)
        choice = self._choice_of(frame)
        if error is not None:
            self._failed = True
            if self.stream and self.response is not None:
                # The stream had started: OpenAI's in-stream error, then the end marker.
                await self._event(
                    {
                        "error": {
                            "message": error.message,
                            "type": "server_error",
                            "param": None,
                            "code": str(error.code),
                        }
                    }
                )
                await self._write(b"data: [DONE]\n\n")
            else:
                self.response = error_response(error.code, error.message, openai=True, frame=error)
                self.response.headers.update(self._headers)
        elif choice is None:
            return
        elif isinstance(frame, Accepted):
            if not self._id:
                # The id of every chunk is the first choice's request id, so a DELETE can name it.
                self._id, self._headers = frame.request_id, _request_headers(frame)
                if self.stream:
                    self.response = web.StreamResponse(headers={**_SSE_HEADERS, **self._headers})
                    await self.response.prepare(self.http_request)
            if self.stream and self.chat:
                await self._chunk(self._delta(choice, {"role": "assistant", "content": ""}, None))
        elif isinstance(frame, Token):
            await self._token(choice, frame)
        elif isinstance(frame, Terminal):
            await self._end(choice, frame)

    def _choice_of(self, frame: Frame) -> _Choice | None:
        """The choice a request's frame belongs to (one choice's frames bear the server's id)."""
        if not isinstance(frame, (Accepted, Token, Terminal)):
            return None
        if len(self._choices) == 1:
            return next(iter(self._choices.values()))
        return self._choices.get(frame.id)

    async def _token(self, choice: _Choice, frame: Token) -> None:
        entries = frame.logprobs
        if choice.reader is not None:
            if entries is not None and choice.logprobs is not None:
                choice.logprobs += entries
                choice.unsent_logprobs += entries
            await self._read_calls(choice, choice.reader.feed(frame.text))
        elif self.stream:
            delta = self._delta(choice, {"content": frame.text} if self.chat else frame.text, None)
            if entries is not None:
                delta["logprobs"] = self._logprobs_field(entries, choice.streamed_chars)
                choice.streamed_chars += sum(len(e["token"]) for e in entries)
            await self._chunk(delta)
        else:
            choice.texts.append(frame.text)
            if entries is not None and choice.logprobs is not None:
                choice.logprobs += entries

    async def _read_calls(self, choice: _Choice, events: list[Event]) -> None:
        """Keep what the reader found, and stream it as OpenAI does: prose as content, a call's
        first delta with its id and name, then pieces of its arguments."""
        for event in events:
            if isinstance(event, Prose):
                choice.texts.append(event.text)
                delta: dict = {"content": event.text}
            elif isinstance(event, CallStarted):
                call = {"id": self._call_id(choice, event.index), "type": "function"}
                choice.calls.append({**call, "function": {"name": event.name, "arguments": ""}})
                delta = {
                    "tool_calls": [{"index": event.index, **call, "function": {"name": event.name, "arguments": ""}}]
                }
            else:
                choice.calls[event.index]["function"]["arguments"] += event.text
                delta = {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
            if self.stream:
                await self._chunk(self._with_unsent_logprobs(choice, self._delta(choice, delta, None)))

    def _with_unsent_logprobs(self, choice: _Choice, delta: dict) -> dict:
        if choice.unsent_logprobs:
            delta["logprobs"] = self._logprobs_field(choice.unsent_logprobs, 0)
            choice.unsent_logprobs = []
        return delta

    def _call_id(self, choice: _Choice, index: int) -> str:
        suffix = f"{choice.index}_{index}" if len(self._choices) > 1 else str(index)
        return f"call_{self._id.replace('-', '')[:24]}_{suffix}"

    async def _end(self, choice: _Choice, frame: Terminal) -> None:
        ending = frame.ending
        finished = finish_reason(ending)
        if choice.reader is not None:
            await self._read_calls(choice, choice.reader.finish())
            # Every call written whole: the answer is its calls, whatever ended the text after them.
            if ending.outcome is Outcome.DONE and choice.reader.complete:
                finished = "tool_calls"
        choice.ending, choice.finish_reason = frame, finished
        if self.stream:
            # A choice's final chunk also carries Stopline's terminal frame: how it ended and what stopping cost.
            final = self._delta(choice, {} if self.chat else "", finished)
            await self._chunk(self._with_unsent_logprobs(choice, final), stopline=frame.json())
        if not self.completes(frame):
            return
        choices = sorted(self._choices.values(), key=lambda c: c.index)
        terminals = [c.ending for c in choices if c.ending is not None]
        assert len(terminals) == len(choices)  # completes() said every choice has ended
        endings = [t.ending for t in terminals]
        # The prompt is counted once, as OpenAI counts it for several choices.
        prompt_tokens = endings[0].prompt_tokens
        completion_tokens = sum(e.tokens_generated for e in endings)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            # Prompt tokens taken from a KV cache (the slot's, or the prompt cache's), as llama-server counts them.
            "prompt_tokens_details": {"cached_tokens": endings[0].prompt_tokens_reused},
        }
        if self.stream:
            if self.include_usage:
                await self._chunk(None, usage=usage)
            await self._write(b"data: [DONE]\n\n")
            return
        body = {
            "id": self._id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [self._whole(c) for c in choices],
            "usage": usage,
            # The first choice's terminal frame (each choice carries its own).
            "stopline": terminals[0].json(),
        }
        self.response = web.json_response(body, headers={**_NO_STORE, **self._headers})

    def _whole(self, choice: _Choice) -> dict:
        """A choice of the answer that is not streamed."""
        assert choice.ending is not None
        text = "".join(choice.texts)
        logprobs = None if choice.logprobs is None else self._logprobs_field(choice.logprobs, 0)
        whole: dict = {"index": choice.index}
        if self.chat:
            message: dict = {"role": "assistant", "content": text}
            if choice.calls:
                # Prose before the calls, if any, stays the content.
                message = {"role": "assistant", "content": text or None, "tool_calls": choice.calls}
            whole["message"] = message
        else:
            whole["text"] = text
        return {**whole, "logprobs": logprobs, "finish_reason": choice.finish_reason, "stopline": choice.ending.json()}

    def _logprobs_field(self, entries: list[dict], offset: int) -> dict:
        """A choice's ``logprobs``: chat's ``content`` list, or the completions API's older
        columns, whose ``text_offset`` counts from ``offset`` characters into the text."""
        if self.chat:
            return {"content": entries, "refusal": None}
        offsets = []
        for entry in entries:
            offsets.append(offset)
            offset += len(entry["token"])
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets,
        }

    def _delta(self, choice: _Choice, delta, finish_reason) -> dict:
        """A streamed chunk's choice."""
        if self.chat:
            return {"index": choice.index, "delta": delta, "finish_reason": finish_reason}
        return {"index": choice.index, "text": delta, "logprobs": None, "finish_reason": finish_reason}

    async def _chunk(self, choice: dict | None, **extra) -> None:
        await self._event(
            {
                "id": self._id,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [] if choice is None else [choice],
                **extra,
            }
        )

    async def _event(self, body: dict) -> None:
        await self._write(f"data: {encode_json(body)}\n\n".encode())

    async def _write(self, data: bytes) -> None:
        assert self.response is not None  # a stream's response is prepared before its first chunk
        await self.response.write(data)


class AnthropicReply(HttpReply):
    """POST /v1/messages: Anthropic's stream of events, or one message at the end. When the
    answer may call tools, a reader turns its text into content blocks: text, and a tool_use
    block for each call, whose input streams as pieces of JSON."""

    def __init__(self, http_request: web.Request, asked: MessagesRequest, *, stream: bool):
        super().__init__(http_request)
        self.asked = asked
        self.stream = stream
        self._id = ""
        self._headers: dict = {}
        self._prompt_tokens = 0
        self._reader = None if asked.calls is None else CallReader(prose=asked.calls is ToolChoice.AUTO)
        # The content blocks so far. Unstreamed, they gather the answer: a text block its text,
        # a tool_use block its arguments' text until the end.
        self._blocks: list[dict] = []

    async def emit(self, frame: Frame) -> None:
        error = as_error(frame)
        if error is not None:
            if self.stream and self.response is not None:
                # The stream had started: Anthropic's error event ends it.
                await self._event("error", {"type": "error", "error": {"type": "api_error", "message": error.message}})
            else:
                self.response = anthropic_error(error.code, error.message)
                self.response.headers.update(self._headers)
        elif isinstance(frame, Accepted):
            self._id, self._headers = f"msg_{frame.request_id}", _request_headers(frame)
            self._prompt_tokens = frame.prompt_tokens
            if self.stream:
                self.response = web.StreamResponse(headers={**_SSE_HEADERS, **self._headers})
                await self.response.prepare(self.http_request)
                await self._event("message_start", {"type": "message_start", "message": self._message([], None, 0)})
            if self._reader is None:
                await self._start_block({"type": "text", "text": ""})
        elif isinstance(frame, Token):
            if self._reader is None:
                await self._text(frame.text)
            else:
                await self._read(self._reader.feed(frame.text))
        elif isinstance(frame, Terminal):
            await self._end(frame)

    async def _start_block(self, block: dict) -> None:
        if self.stream:
            if self._blocks:
                await self._event("content_block_stop", {"type": "content_block_stop", "index": len(self._blocks) - 1})
            start = {"type": "content_block_start", "index": len(self._blocks), "content_block": block}
            await self._event("content_block_start", start)
        self._blocks.append(dict(block))

    async def _delta(self, delta: dict) -> None:
        event = {"type": "content_block_delta", "index": len(self._blocks) - 1, "delta": delta}
        await self._event("content_block_delta", event)

    async def _text(self, text: str) -> None:
        if not self._blocks or self._blocks[-1]["type"] != "text":
            await self._start_block({"type": "text", "text": ""})
        if self.stream:
            await self._delta({"type": "text_delta", "text": text})
        else:
            self._blocks[-1]["text"] += text

    async def _read(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, Prose):
                await self._text(event.text)
            elif isinstance(event, CallStarted):
                call_id = f"toolu_{self._id.removeprefix('msg_').replace('-', '')[:24]}_{event.index}"
                await self._start_block({"type": "tool_use", "id": call_id, "name": event.name, "input": {}})
                self._blocks[-1]["input"] = ""
            elif self.stream:
                await self._delta({"type": "input_json_delta", "partial_json": event.text})
            else:
                self._blocks[-1]["input"] += event.text

    def _message(
        self, content: list[dict], ending: Ending | None, output_tokens: int, stop_reason: str | None = None
    ) -> dict:
        return {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self.asked.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": None if ending is None else self.asked.stop_sequence(ending),
            "usage": self._usage(ending, output_tokens),
        }

    def _usage(self, ending: Ending | None, output_tokens: int) -> dict:
        """Anthropic's usage: ``input_tokens`` are those evaluated, ``cache_read_input_tokens``
        those served from the KV cache or the prompt cache, and the two add up to the prompt.
        How many were cached is known once the generation has ended; until then the whole
        prompt counts as input."""
        cached = 0 if ending is None else ending.prompt_tokens_reused
        return {
            "input_tokens": self._prompt_tokens - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": output_tokens,
        }

    async def _end(self, frame: Terminal) -> None:
        ending = frame.ending
        stop_reason = self.asked.stop_reason(ending)
        if self._reader is not None:
            await self._read(self._reader.finish())
            # Every call written whole: the answer is its calls, whatever ended the text after them.
            if ending.outcome is Outcome.DONE and self._reader.complete:
                stop_reason = "tool_use"
        if not self.stream:
            content = [
                {**b, "input": tool_input(b["input"])} if b["type"] == "tool_use" else b for b in self._blocks
            ] or [{"type": "text", "text": ""}]
            body = {**self._message(content, ending, ending.tokens_generated, stop_reason), "stopline": frame.json()}
            self.response = web.json_response(body, headers={**_NO_STORE, **self._headers})
            return
        if self._blocks:
            await self._event("content_block_stop", {"type": "content_block_stop", "index": len(self._blocks) - 1})
        # The last delta also carries Stopline's terminal frame: how it ended and what stopping cost.
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": self.asked.stop_sequence(ending)},
            # Cumulative, as Anthropic's is: the input's split into evaluated and cached is known now.
            "usage": self._usage(ending, ending.tokens_generated),
            "stopline": frame.json(),
        }
        await self._event("message_delta", delta)
        await self._event("message_stop", {"type": "message_stop"})

    async def _event(self, name: str, body: dict) -> None:
        assert self.response is not None  # a stream's response is prepared before its first event
        await self.response.write(f"event: {name}\ndata: {encode_json(body)}\n\n".encode())


def anthropic_error(code: ErrorCode | Refusal, message: str) -> web.Response:
    """An error in Anthropic's shape, with the status Stopline gives its code."""
    status = http_status(code) if isinstance(code, ErrorCode) else HTTPStatus.BAD_REQUEST
    body = {"type": "error", "error": {"type": ERROR_TYPE.get(status, "invalid_request_error"), "message": message}}
    return web.json_response(body, status=status, headers=dict(_NO_STORE))


@dataclass
class LoadWait:
    """A request waiting for its model to load, which a DELETE by its id may end."""

    task: asyncio.Task
    cancel_token: str | None
    key: ApiKey | None
    # When a DELETE asked for the stop; None: none did.
    cancel_ns: int | None = None


class HttpApi:
    def __init__(
        self,
        services: Services,
        settings: Settings,
        edge: Edge,
        cluster: Cluster | None,
        models: ServedModels,
        by_name: Mapping[str, Services] | None = None,
        chat_formats: Mapping[str, ChatFormat] | None = None,
        lazy: Mapping[str, LazyModel] | None = None,
    ):
        # The first model's services; the catalog, every model's by the names it is served under.
        self.services = services
        self.models = models
        self.catalog = Catalog(services, models, by_name, lazy)
        self.chat_formats = dict(chat_formats or {})
        # The models loaded when first asked for, by name (stopline/residency.py).
        self.lazy = self.catalog.lazy
        # Requests waiting for their model to load, by the request id the client chose (X-Request-Id):
        # a DELETE of one ends it there (LoadWait).
        self.loading: dict[str, LoadWait] = {}
        # When the models were first served: /v1/models' "created".
        self.created = int(time.time())
        self.settings = settings
        self.edge = edge
        self.cluster = cluster
        self.app = web.Application(middlewares=[self._guard], client_max_size=settings.max_frame_bytes)
        self.app.add_routes(
            [
                web.post("/v1/generations", self._post_generation),
                web.get("/v1/generations/{request_id}", self._get_generation),
                web.delete("/v1/generations/{request_id}", self._delete_generation),
                web.post("/v1/chat/completions", self._chat_completions),
                web.post("/v1/completions", self._completions),
                web.post("/v1/messages", self._messages),
                web.post("/v1/messages/count_tokens", self._count_tokens),
                web.get("/v1/models", self._models),
                # A served name may hold slashes (OWNER/REPO:QUANT).
                web.get("/v1/models/{model:.+}", self._model),
            ]
        )
        self.app.on_response_prepare.append(self._cors_headers)
        if cluster is not None:
            self.app.on_response_prepare.append(self._replica_header)
        self._runner: web.AppRunner | None = None
        self.base_url = ""
        # Where the WebSocket is (the server sets it once it listens): a client that asks this
        # port for /ws is told.
        self.websocket_url = ""

    async def start(self, host: str, port: int, sock=None, public_host: str | None = None) -> None:
        """Listen on ``host``/``port``, or on ``sock`` if the caller has bound it already;
        ``public_host`` is the host clients are told to use (default: ``host``)."""
        # handler_cancellation: a lost connection cancels its handler at once, which is how
        # a client that goes away stops its generation.
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.SockSite(self._runner, sock) if sock is not None else web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[0][1]
        shown = public_host or (f"[{host}]" if ":" in host else host)
        self.base_url = f"http://{shown}:{bound}/v1"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # Cross-cutting ---------------------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler):
        origin = request.headers.get("Origin")
        # The same rules as /ws: the Host must be one this server answers to (no
        # DNS rebinding), and a browser page from elsewhere may not drive the model.
        refused = self.edge.check(
            request.headers.getall("Host", None), request.headers.getall("Origin", None), _peer(request)
        )
        if refused is not None:
            return error_response(refused.code, refused.message, openai=True, status=refused.status)
        if request.method == "OPTIONS" and origin is not None:
            return web.Response(
                status=HTTPStatus.NO_CONTENT,
                headers={
                    "Access-Control-Allow-Methods": "GET, POST, DELETE",
                    "Access-Control-Allow-Headers": (
                        "Authorization, Content-Type, x-api-key, anthropic-version, X-Request-Id, X-Cancel-Token"
                    ),
                    "Access-Control-Max-Age": "600",
                },
            )
        keyring = self.services.keyring
        # GET and DELETE of a generation by id take its cancel token or its key, checked there.
        by_id = request.method in ("GET", "DELETE") and request.path.startswith("/v1/generations/")
        if keyring.required and not by_id:
            authorization = request.headers.get("Authorization")
            # Anthropic's clients send their key as x-api-key.
            key = keyring.lookup(bearer(authorization) or request.headers.get("x-api-key"))
            if key is None:
                await self.edge.refuse_key(_peer(request), request.path)
                message = refusal_message(authorization, bearer(authorization), "send 'Authorization: Bearer <key>'")
                return error_response(ErrorCode.UNAUTHORIZED, message, openai=True)
            request[API_KEY] = key
        try:
            return await handler(request)
        except web.HTTPNotFound:
            message = f"no such endpoint: {request.path}"
            if request.path.rstrip("/") == "/ws" and self.websocket_url:
                message += f"; this port serves the HTTP API (/v1), and the WebSocket is at {self.websocket_url}"
            return error_response(ErrorCode.NOT_FOUND, message, openai=True)
        except web.HTTPMethodNotAllowed as exc:
            return error_response(
                ErrorCode.NOT_FOUND,
                f"{request.method} is not allowed on {request.path}; allowed: {', '.join(sorted(exc.allowed_methods))}",
                openai=True,
            )

    async def _cors_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is not None:  # the guard has let it through, so it is allowed
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = "X-Request-Id, X-Cancel-Token"
            response.headers["Vary"] = "Origin"

    async def _replica_header(self, request: web.Request, response: web.StreamResponse) -> None:
        # Which replica answered: behind a load balancer, the one place that says so.
        if self.cluster is not None:
            response.headers["X-Stopline-Replica"] = self.cluster.replica_id

    # Generations -------------------------------------------------------------

    def services_for(self, requested: object) -> Services:
        """The services of the model a request names (:meth:`Catalog.services_for`)."""
        return self.catalog.services_for(requested)

    def lazy_for(self, requested: object) -> LazyModel | None:
        """The model loaded when first asked for that ``requested`` names, if it names one."""
        return self.catalog.lazy_for(requested)

    async def _wait_for_load(
        self, request: web.Request, model: LazyModel, frames: Sequence[GenerateFrame], reply: HttpReply
    ) -> Services | None:
        """``model``'s services once it has loaded, or None if the request ended meanwhile: a DELETE
        by its X-Request-Id (user_cancelled, answered now); a client that goes away ends it with
        client_disconnected (and the handler's cancellation goes on)."""
        received_ns = time.monotonic_ns()
        asked_id = request.headers.get("X-Request-Id")
        task = asyncio.current_task()
        assert task is not None
        wait = LoadWait(task, request.headers.get("X-Cancel-Token"), request.get(API_KEY))
        if asked_id is not None and asked_id not in self.loading:
            self.loading[asked_id] = wait
        try:
            return await model.ready()
        except asyncio.CancelledError:
            if wait.cancel_ns is None:
                self._ended_in_load(
                    request, model, frames, Reason.CLIENT_DISCONNECTED, received_ns, time.monotonic_ns()
                )
                raise
            # A DELETE cancelled this wait, not the client's going away: answer it.
            task.uncancel()
            for ended in self._ended_in_load(
                request, model, frames, Reason.USER_CANCELLED, received_ns, wait.cancel_ns
            ):
                await reply.send(ended)
            return None
        finally:
            if asked_id is not None and self.loading.get(asked_id) is wait:
                del self.loading[asked_id]

    def _ended_in_load(
        self,
        request: web.Request,
        model: LazyModel,
        frames: Sequence[GenerateFrame],
        reason: Reason,
        received_ns: int,
        cancel_ns: int,
    ) -> list[Frame]:
        """The endings of requests stopped while their model loaded: cancelled, having never run,
        recorded as any request's end is."""
        ending = ending_before_start(Outcome.CANCELLED, reason, 0, received_ns, cancel_ns, time.monotonic_ns())
        key = request.get(API_KEY)
        token = request.headers.get("X-Cancel-Token")
        terminals: list[Frame] = []
        for frame in frames:
            request_id = frame.request_id or request.headers.get("X-Request-Id") or frame.id or str(uuid.uuid4())
            ended = Request(request_id, [], frame.params, received_ns=received_ns, user=frame.user)
            ended.request_id = request_id
            if token is not None:
                ended.cancel_token = token
            self.services.metrics.record_end(ending, key.key_id if key is not None else None, model.name)
            log_end(ended, ending, request.remote or "unknown", model.name)
            # A reply opens with its request's acceptance: the stop ends a request that had one.
            terminals += [
                Accepted(ended.id, 0, request_id, ended.cancel_token, 0, model.name),
                Terminal(ended.id, ending, model.name),
            ]
        return terminals

    async def _post_generation(self, request: web.Request) -> web.StreamResponse:
        try:
            body = parse_json_object(await request.text(), "body")
            # The model it names, as a WebSocket generate frame's; none: the first.
            frame = generate_frame(body, model_limits(body, self.services.limits, self.catalog))
        except ProtocolError as exc:
            return error_response(exc.code, exc.message, openai=False, frame=ErrorFrame.refusing(exc))
        return await self._generate(
            request, [frame], SseReply(request), self.services_for(frame.model), self.lazy_for(frame.model)
        )

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=False)

    async def _openai(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body = parse_json_object(await request.text(), "body")
            services = self.services_for(body.get("model"))
            asked = openai_request(body, chat=chat, models=self.models, limits=services.limits)
        except ProtocolError as exc:
            return error_response(exc.code, exc.message, openai=True, param=exc.param)
        stream = body.get("stream") is True
        options = body.get("stream_options")
        include_usage = stream and isinstance(options, dict) and options.get("include_usage") is True
        reply = OpenAIReply(request, asked, chat=chat, stream=stream, include_usage=include_usage)
        return await self._generate(request, asked.frames, reply, services, self.lazy_for(body.get("model")))

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        try:
            body = parse_json_object(await request.text(), "body")
            services = self.services_for(body.get("model"))
            asked = messages_request(body, models=self.models, limits=services.limits)
        except ProtocolError as exc:
            return anthropic_error(exc.code, exc.message)
        return await self._generate(
            request,
            [asked.frame],
            AnthropicReply(request, asked, stream=body.get("stream") is True),
            services,
            self.lazy_for(body.get("model")),
        )

    async def _count_tokens(self, request: web.Request) -> web.Response:
        """POST /v1/messages/count_tokens: the tokens a message's prompt would take, through the
        model's own chat template; a model not yet loaded loads first."""
        try:
            body = parse_json_object(await request.text(), "body")
            services = self.services_for(body.get("model"))
            asked = count_tokens_request(body, models=self.models, limits=services.limits)
        except ProtocolError as exc:
            return anthropic_error(exc.code, exc.message)
        lazy = self.lazy_for(body.get("model"))
        if lazy is not None:
            lazy.hold()
        try:
            if lazy is not None:
                services = await lazy.ready()
            lane = services.tokenizer_lanes[asked.frame.size > SHORT_PROMPT_BYTES]
            tokens = await asyncio.get_running_loop().run_in_executor(lane, services.encode, None, asked.frame.messages)
        except InsufficientMemory as exc:
            return anthropic_error(exc.code, exc.message)
        finally:
            if lazy is not None:
                lazy.release()
        return web.json_response({"input_tokens": len(tokens)}, headers=dict(_NO_STORE))

    async def _generate(
        self,
        request: web.Request,
        frames: Sequence[GenerateFrame],
        reply: HttpReply,
        services: Services | None = None,
        model: LazyModel | None = None,
    ) -> web.StreamResponse:
        """Run this HTTP request's generations on the model whose ``services`` are given (the first
        model's when none are), or on ``model``, loaded first if need be; a lost connection cancels them."""
        self.edge.accepted(request.transport.get_extra_info("socket") if request.transport else None)
        lazy = model
        if lazy is None:
            return await self._generate_on(request, frames, reply, services)
        # Held from before its load to the end of the answer: the model is not unloaded under it.
        lazy.hold()
        try:
            try:
                loaded = await self._wait_for_load(request, lazy, frames, reply)
            except InsufficientMemory as exc:
                await reply.send(ErrorFrame.refusing(exc))
                loaded = None
            if loaded is None:
                assert reply.response is not None  # answered: cancelled during the load, or refused
                return reply.response
            return await self._generate_on(request, frames, reply, loaded)
        finally:
            lazy.release()

    async def _generate_on(
        self,
        request: web.Request,
        frames: Sequence[GenerateFrame],
        reply: HttpReply,
        services: Services | None,
    ) -> web.StreamResponse:
        try:
            frames, claimed = self._client_ids(request, frames)
        except ProtocolError as exc:
            await reply.send(ErrorFrame.refusing(exc))
            assert reply.response is not None  # an error is answered at once
            return reply.response
        session = ClientSession(services or self.services, reply, request.remote or "unknown", request.get(API_KEY))
        self.services.sessions.add(session)
        try:
            for frame in frames:
                await session.generate(frame, time.monotonic_ns())
            await reply.answered.wait()
        finally:
            # Reached with the request still live only when the client went away.
            await session.client_gone()
            self.services.sessions.discard(session)
            if claimed is not None:
                self.services.registry.unclaim(claimed)
        assert reply.response is not None  # the request's last frame has been answered
        return reply.response

    def _client_ids(
        self, request: web.Request, frames: Sequence[GenerateFrame]
    ) -> tuple[Sequence[GenerateFrame], str | None]:
        """The frames with the request id and cancel token the client chose (``X-Request-Id``,
        ``X-Cancel-Token``), so that it can GET or DELETE its generation while a body that comes
        whole at the end is still to come; and the id, claimed until the request is answered."""
        asked_id, asked_token = request.headers.get("X-Request-Id"), request.headers.get("X-Cancel-Token")
        if asked_id is None and asked_token is None:
            return frames, None
        request_id = None if asked_id is None else client_request_id(asked_id)
        token = None if asked_token is None else client_cancel_token(asked_token)
        if len(frames) > 1:
            raise InvalidField(
                "X-Request-Id and X-Cancel-Token name one generation; they cannot be given with n above 1"
            )
        if request_id is not None and not self.services.registry.claim(request_id):
            raise DuplicateId(f"a generation with the request id {request_id!r} is running (X-Request-Id)")
        return [replace(frames[0], request_id=request_id, cancel_token=token)], request_id

    async def _get_generation(self, request: web.Request) -> web.Response:
        async def here(entry: Entry) -> dict:
            return entry.describe()

        cluster = self.cluster
        return await self._by_id(request, here, cluster.describe if cluster is not None else None)

    async def _delete_generation(self, request: web.Request) -> web.Response:
        # The cancel's arrival time, as for a cancel frame.
        now = time.monotonic_ns()
        waiting = self._load_wait(request)
        if waiting is not None:
            if waiting.cancel_ns is None:
                waiting.cancel_ns = now
                waiting.task.cancel()
            # It ends as soon as its task runs, before this answer goes out.
            return web.json_response(
                {"request_id": request.match_info["request_id"], "status": str(Status.CANCELLED)}, headers=_NO_STORE
            )

        async def here(entry: Entry) -> dict:
            return {"request_id": entry.request_id, "status": str(await entry.cancel(now))}

        cluster = self.cluster

        async def elsewhere(request_id: str, token: str | None, key_id: str | None) -> dict:
            assert cluster is not None  # passed on only when there is one
            return {"request_id": request_id, "status": await cluster.cancel(request_id, token, key_id)}

        return await self._by_id(request, here, elsewhere if cluster is not None else None)

    def _load_wait(self, request: web.Request) -> LoadWait | None:
        """The request named in the path, if it waits for its model to load and the caller may stop it:
        by the cancel token it chose (X-Cancel-Token), or the API key that sent it."""
        waiting = self.loading.get(request.match_info["request_id"])
        if waiting is None:
            return None
        token = bearer(request.headers.get("Authorization"))
        if waiting.cancel_token is not None and token is not None and hmac.compare_digest(token, waiting.cancel_token):
            return waiting
        key = self.services.keyring.lookup(token) if self.services.keyring.required else None
        if key is not None and waiting.key is not None and key.key_id == waiting.key.key_id:
            return waiting
        return None

    async def _by_id(self, request: web.Request, here, elsewhere) -> web.Response:
        """Answer for the generation named in the path: from this replica's registry if it holds it,
        else (``--redis-url``) from the shared store, under the same authorization."""
        # A response's id is its generation's, prefixed with resp_.
        request_id = request.match_info["request_id"].removeprefix("resp_")
        token = bearer(request.headers.get("Authorization"))
        # The credential is the generation's cancel token, or the API key that started it.
        key = self.services.keyring.lookup(token) if self.services.keyring.required else None
        key_id = key.key_id if key is not None else None
        try:
            try:
                body = await here(self.services.registry.authorize(request_id, token, key_id))
            except UnknownRequest:
                if elsewhere is None:
                    raise
                body = await elsewhere(request_id, token, key_id)
        except RequestLookupError as exc:
            if isinstance(exc, InvalidCancelToken):
                message = (
                    "send the generation's cancel token"
                    + (", or the API key that started it," if self.services.keyring.required else "")
                    + " as 'Authorization: Bearer <token>'"
                )
            elif isinstance(exc, StoreUnavailable):
                message = (
                    "this generation is not on this replica, and the "
                    "shared store that would find it cannot be reached; try again"
                )
            else:
                message = str(exc)
            return error_response(exc.code, message, openai=False, status=exc.status)
        return web.json_response(body, headers=_NO_STORE)

    def _model_object(self, name: str) -> dict:
        # The fields the openai package and Open WebUI read, and how a chat becomes the prompt: known
        # of a model loaded when first asked for once it has loaded, and left out until then.
        lazy = self.lazy.get(name)
        chat_format = self.chat_formats.get(name, self.models.chat_format) if lazy is None else lazy.chat_format
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "stopline",
            **({"chat_format": str(chat_format)} if chat_format is not None else {}),
        }

    async def _models(self, request: web.Request) -> web.Response:
        data = [self._model_object(name) for name in self.models.names]
        return web.json_response({"object": "list", "data": data}, headers=_NO_STORE)

    async def _model(self, request: web.Request) -> web.Response:
        # The served names only, as listed: answering any name is about requests, not the list.
        name = request.match_info["model"]
        if name not in self.models.names:
            return error_response(
                ErrorCode.MODEL_NOT_FOUND,
                f"the model {name!r} is not served here; this server serves "
                f"{', '.join(repr(n) for n in self.models.names)}",
                openai=True,
                param="model",
            )
        return web.json_response(self._model_object(name), headers=_NO_STORE)


def _peer(request: web.Request) -> str:
    return peer_name(request.transport.get_extra_info("peername") if request.transport else None)
