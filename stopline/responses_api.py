"""OpenAI's Responses API: ``POST /v1/responses``, ``GET /v1/responses/{id}`` and
``POST /v1/responses/{id}/cancel``.

A response is one generation, run like every other HTTP generation (:meth:`HttpApi._generate`);
its id is ``resp_`` and the generation's request id, so its cancel goes the way of
``DELETE /v1/generations/{request_id}``, under the same credentials. A response asked for with
``background: true`` is answered at once, queued or in progress, and runs on without its
connection; GET and cancel find it by id.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

from .api.responses import Earlier, ResponsesRequest, incomplete_reason, response_status, responses_request
from .http_api import _NO_STORE, _SSE_HEADERS, API_KEY, HttpReply, _request_headers, error_response
from .protocol.errors import InvalidField, ProtocolError, ResponseNotFound, UnknownRequest
from .protocol.frames import Accepted, Frame, Terminal, Token, as_error, encode_json
from .protocol.validation import parse_json_object
from .registry import Entry
from .structured.tool_calls import CallReader, CallStarted, Event, Prose, ToolChoice

if TYPE_CHECKING:
    from .http_api import HttpApi

PREFIX = "resp_"
# How many responses GET can still answer for once they have ended (store: true).
REMEMBERED = 1024
# The final event of a stream, by the Response's status.
_FINAL_EVENT = {"completed": "response.completed", "failed": "response.failed"}


@dataclass
class StreamedCall:
    """A function call as its events go out: its arguments so far, and whether its item is done."""

    name: str
    output_index: int
    arguments: str = ""
    done: bool = False


class ResponsesReply(HttpReply):
    """One response: Responses' stream of events, or one Response object at the end (or at
    once, in the background). :meth:`body` is the Response as it stands, for GET and cancel."""

    def __init__(self, http_request: web.Request, asked: ResponsesRequest, keep: Callable[[ResponsesReply], None]):
        super().__init__(http_request)
        self.asked = asked
        # Called once the response has its id: from then on GET and cancel find it.
        self.keep = keep
        self.created_at = int(time.time())
        self.id = ""
        # The API key that started it (None: the server has no keys): only that key may continue it.
        self.key_id: str | None = None
        self.headers: dict = {}
        self.queued = False
        self.texts: list[str] = []
        self.ending: Terminal | None = None
        self.error: dict | None = None
        self.sequence_number = 0
        # A stream with tools reads the answer as it comes (chat completions' reader), so that its
        # prose streams as a message item and each call as a function_call item.
        self.reader: CallReader | None = None
        # The output items streamed so far; the message item's index while it is open, and its text.
        self.outputs = 0
        self.message_at: int | None = None
        self.message_texts: list[str] = []
        self.streamed_calls: list[StreamedCall] = []
        # Set once the request was accepted or refused: a background response is answered then.
        self.started = asyncio.Event()

    @property
    def item_id(self) -> str:
        return "msg_" + self.id.removeprefix(PREFIX)

    @property
    def status(self) -> str:
        if self.error is not None:
            return "failed"
        if self.ending is not None:
            return response_status(self.ending.ending)
        return "queued" if self.queued else "in_progress"

    def body(self) -> dict:
        """The Response object as it stands."""
        ending = self.ending.ending if self.ending is not None else None
        reason = None if ending is None else incomplete_reason(ending)
        output = []
        if self.id and (self.texts or ending is not None):
            status = "in_progress" if ending is None else self._item_status()
            prose, calls = self.answer()
            if prose or not calls:
                output.append(self._item(status, text=prose))
            output += [self._call(index, name, arguments, status) for index, (name, arguments) in enumerate(calls)]
        usage = None
        if ending is not None:
            usage = {
                "input_tokens": ending.prompt_tokens,
                "input_tokens_details": {"cached_tokens": ending.prompt_tokens_reused},
                "output_tokens": ending.tokens_generated,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": ending.prompt_tokens + ending.tokens_generated,
            }
        params = self.asked.frame.params
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "background": self.asked.background,
            "error": self.error,
            "incomplete_details": None if reason is None else {"reason": reason},
            "instructions": self.asked.instructions,
            "max_output_tokens": params.max_tokens,
            "metadata": self.asked.metadata,
            "model": self.asked.model,
            "output": output,
            "parallel_tool_calls": self.asked.parallel_tool_calls,
            "previous_response_id": self.asked.previous_response_id,
            "store": self.asked.store,
            "temperature": params.temperature,
            "text": {"format": self.asked.text_format},
            "tool_choice": self.asked.tool_choice,
            "tools": self.asked.tools,
            "top_p": params.top_p,
            "usage": usage,
            # Once it has ended, Stopline's terminal frame: how it ended (status and incomplete_details
            # keep to OpenAI's words) and what stopping cost.
            **({} if self.ending is None else {"stopline": self.ending.json()}),
        }

    def _item_status(self) -> str:
        return "completed" if self.status == "completed" else "incomplete"

    def answer(self) -> tuple[str, list[tuple[str, str]]]:
        """The answer so far: its text, and the function calls it holds (name, arguments), read
        as chat completions reads them (what is not yet a whole call is held back as text)."""
        text = "".join(self.texts)
        if self.asked.calls is None:
            return text, []
        reader = CallReader(prose=self.asked.calls is ToolChoice.AUTO)
        prose: list[str] = []
        calls: list[list[str]] = []
        for event in [*reader.feed(text), *reader.finish()]:
            if isinstance(event, Prose):
                prose.append(event.text)
            elif isinstance(event, CallStarted):
                calls.append([event.name, ""])
            else:
                calls[event.index][1] += event.text
        return "".join(prose), [(name, arguments) for name, arguments in calls]

    def call_id(self, index: int) -> str:
        return f"call_{self.id.removeprefix(PREFIX)}_{index}"

    def _call_item_id(self, index: int) -> str:
        return f"fc_{self.id.removeprefix(PREFIX)}_{index}"

    def _call(self, index: int, name: str, arguments: str, status: str) -> dict:
        return {
            "id": self._call_item_id(index),
            "type": "function_call",
            "call_id": self.call_id(index),
            "name": name,
            "arguments": arguments,
            "status": status,
        }

    def _item(self, status: str, content: bool = True, text: str | None = None) -> dict:
        parts = [self._part("".join(self.texts) if text is None else text)] if content else []
        return {"id": self.item_id, "type": "message", "role": "assistant", "status": status, "content": parts}

    @staticmethod
    def _part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    async def emit(self, frame: Frame) -> None:
        error = as_error(frame)
        if error is not None:
            self.error = {"code": str(error.code), "message": error.message}
            if self.asked.stream and self.response is not None:
                # The stream had started: Responses' failed event ends it.
                await self._event("response.failed", {"response": self.body()})
            else:
                # Refused before it started, or a body's end (a background response's, unread).
                self.response = error_response(error.code, error.message, openai=True, frame=error)
                self.response.headers.update(self.headers)
            self.started.set()
        elif isinstance(frame, Accepted):
            self.id, self.headers = PREFIX + frame.request_id, _request_headers(frame)
            self.queued = frame.queue_position > 0
            self.keep(self)
            if self.asked.stream:
                self.response = web.StreamResponse(headers={**_SSE_HEADERS, **self.headers})
                await self.response.prepare(self.http_request)
                await self._event("response.created", {"response": self.body()})
                self.queued = False
                await self._event("response.in_progress", {"response": self.body()})
                if self.asked.calls is None:
                    await self._open_message()
                else:
                    # Whether the answer opens with prose or a call is known only once the model writes it.
                    self.reader = CallReader(prose=self.asked.calls is ToolChoice.AUTO)
            self.started.set()
        elif isinstance(frame, Token):
            self.queued = False
            self.texts.append(frame.text)
            if not self.asked.stream:
                return
            if self.reader is None:
                await self._text_delta(frame.text)
            else:
                await self._stream_calls(self.reader.feed(frame.text))
        elif isinstance(frame, Terminal):
            await self._end(frame)

    def _at(self) -> dict:
        return {"item_id": self.item_id, "output_index": self.message_at, "content_index": 0}

    async def _open_message(self) -> None:
        self.message_at = self.outputs
        self.outputs += 1
        await self._event(
            "response.output_item.added", {"output_index": self.message_at, "item": self._item("in_progress", False)}
        )
        await self._event("response.content_part.added", {**self._at(), "part": self._part("")})

    async def _text_delta(self, text: str) -> None:
        if self.message_at is None:
            await self._open_message()
        self.message_texts.append(text)
        await self._event("response.output_text.delta", {**self._at(), "delta": text, "logprobs": []})

    async def _close_message(self, status: str) -> None:
        text = "".join(self.message_texts)
        await self._event("response.output_text.done", {**self._at(), "text": text, "logprobs": []})
        await self._event("response.content_part.done", {**self._at(), "part": self._part(text)})
        item = self._item(status, text=text)
        await self._event("response.output_item.done", {"output_index": self.message_at, "item": item})
        self.message_at = None

    async def _stream_calls(self, events: list[Event]) -> None:
        """Stream what the reader found as OpenAI does: prose as the message item's text, each call
        as a function_call item whose arguments arrive in pieces; a call's item is done once its
        closing marker is read."""
        assert self.reader is not None
        for event in events:
            if isinstance(event, Prose):
                await self._text_delta(event.text)
            elif isinstance(event, CallStarted):
                if self.message_at is not None:
                    # The prose before a call is whole once the call starts.
                    await self._close_message("completed")
                self.streamed_calls.append(StreamedCall(event.name, self.outputs))
                item = self._call(event.index, event.name, "", "in_progress")
                await self._event("response.output_item.added", {"output_index": self.outputs, "item": item})
                self.outputs += 1
            else:
                call = self.streamed_calls[event.index]
                call.arguments += event.text
                await self._event(
                    "response.function_call_arguments.delta",
                    {
                        "item_id": self._call_item_id(event.index),
                        "output_index": call.output_index,
                        "delta": event.text,
                    },
                )
        for index in range(self.reader.closed):
            if not self.streamed_calls[index].done:
                await self._close_call(index, "completed")

    async def _close_call(self, index: int, status: str) -> None:
        call = self.streamed_calls[index]
        call.done = True
        await self._event(
            "response.function_call_arguments.done",
            {
                "item_id": self._call_item_id(index),
                "output_index": call.output_index,
                "name": call.name,
                "arguments": call.arguments,
            },
        )
        item = self._call(index, call.name, call.arguments, status)
        await self._event("response.output_item.done", {"output_index": call.output_index, "item": item})

    async def _end(self, frame: Terminal) -> None:
        self.ending = frame
        body = self.body()
        if not self.asked.stream:
            self.response = web.json_response(body, headers={**_NO_STORE, **self.headers})
            return
        status = self._item_status()
        if self.reader is not None:
            await self._stream_calls(self.reader.finish())
            if self.outputs == 0:
                # Neither prose nor a call: one empty message, as the Response's output has.
                await self._open_message()
            for index, call in enumerate(self.streamed_calls):
                if not call.done:
                    await self._close_call(index, status)
        if self.message_at is not None:
            await self._close_message(status)
        # The last event also carries Stopline's terminal frame: how it ended and what stopping cost.
        # A cancelled response ends as incomplete, its status cancelled (Responses has no cancelled event).
        final = _FINAL_EVENT.get(self.status, "response.incomplete")
        await self._event(final, {"response": body, "stopline": frame.json()})

    async def _event(self, name: str, body: dict) -> None:
        assert self.response is not None  # a stream's response is prepared before its first event
        event = {"type": name, "sequence_number": self.sequence_number, **body}
        self.sequence_number += 1
        await self.response.write(f"event: {name}\ndata: {encode_json(event)}\n\n".encode())


class ResponsesApi:
    """The routes of the Responses API, and the responses GET and cancel can name."""

    def __init__(self, api: HttpApi):
        self.api = api
        # Responses by id: every one still running, and the last REMEMBERED ended ones stored.
        self.replies: OrderedDict[str, ResponsesReply] = OrderedDict()
        # Background responses still running: held so that they run on, and awaited at shutdown.
        self.background: set[asyncio.Task] = set()
        api.app.on_cleanup.append(self._close)

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/responses", self._create),
            web.get("/v1/responses/{request_id}", self._retrieve),
            web.post("/v1/responses/{request_id}/cancel", self._cancel),
        ]

    async def _create(self, request: web.Request) -> web.StreamResponse:
        api = self.api
        try:
            body = parse_json_object(await request.text(), "body")
            key = request.get(API_KEY)
            # The API key the request came with (None: the server has no keys).
            key_id = key.key_id if key is not None else None
            asked = responses_request(
                body,
                models=api.models,
                limits=api.services_for(body.get("model")).limits,
                earlier=lambda response_id: self.conversation(response_id, key_id),
            )
        except ProtocolError as exc:
            return error_response(exc.code, exc.message, openai=True, param=exc.param)
        reply = ResponsesReply(request, asked, self.keep)
        reply.key_id = key_id
        if not asked.background:
            # In this handler, so that a lost connection cancels it and with it the generation.
            return await self._run(request, reply)
        run = asyncio.get_running_loop().create_task(self._run(request, reply))
        self.background.add(run)
        run.add_done_callback(self.background.discard)
        started = asyncio.get_running_loop().create_task(reply.started.wait())
        await asyncio.wait([run, started], return_when=asyncio.FIRST_COMPLETED)
        started.cancel()
        if reply.error is not None or not reply.id:
            assert reply.response is not None  # refused before it started: answered with the error
            return reply.response
        return web.json_response(reply.body(), headers={**_NO_STORE, **reply.headers})

    async def _run(self, request: web.Request, reply: ResponsesReply) -> web.StreamResponse:
        try:
            return await self.api._generate(
                request,
                [reply.asked.frame],
                reply,
                self.api.services_for(reply.asked.model),
                self.api.lazy_for(reply.asked.model),
            )
        finally:
            if not reply.asked.store and reply.id:
                self.replies.pop(reply.id, None)

    def keep(self, reply: ResponsesReply) -> None:
        self.replies[reply.id] = reply
        ended = [key for key, kept in self.replies.items() if kept.answered.is_set()]
        for key in ended[: max(0, len(ended) - REMEMBERED)]:
            del self.replies[key]

    def conversation(self, response_id: str, key_id: str | None) -> Earlier:
        """The turns a response continuing ``response_id`` comes after: that response's own
        conversation, then its answer (what it had generated when it ended). Only the API key
        that started it may continue it; to any other it is not found, as if it were not here."""
        kept = self.replies.get(response_id)
        if kept is None or not kept.asked.store or kept.key_id != key_id:
            # Never here, store: false, or forgotten (the last REMEMBERED ended ones are kept).
            raise ResponseNotFound(
                f"no response with id {response_id!r} is kept here (responses with store: false, or older than "
                f"the last {REMEMBERED}, are not)",
                param="previous_response_id",
            )
        if not kept.answered.is_set():
            raise InvalidField(
                f"response {response_id!r} is still {kept.status}: continue it once it has ended",
                param="previous_response_id",
            )
        # The answer as the model wrote it, its calls in the format it calls in.
        answer = ({"role": "assistant", "content": "".join(kept.texts)},) if kept.texts else ()
        names = {kept.call_id(index): name for index, (name, _) in enumerate(kept.answer()[1])}
        return (*kept.asked.conversation, *answer), {**kept.asked.call_names, **names}

    def _reply(self, entry: Entry) -> ResponsesReply:
        reply = self.replies.get(PREFIX + entry.request_id)
        if reply is None:
            # A generation, but not a response this server keeps (another API's, or store: false).
            raise UnknownRequest(PREFIX + entry.request_id)
        return reply

    async def _retrieve(self, request: web.Request) -> web.Response:
        async def here(entry: Entry) -> dict:
            return self._reply(entry).body()

        return await self.api._by_id(request, here, None)

    async def _cancel(self, request: web.Request) -> web.Response:
        # The cancel's arrival time, as for a cancel frame.
        now = time.monotonic_ns()

        async def here(entry: Entry) -> dict:
            reply = self._reply(entry)
            await entry.cancel(now)
            # The Response once its terminal frame is in: cancelled, or how it had ended before.
            await reply.answered.wait()
            return reply.body()

        return await self.api._by_id(request, here, None)

    async def _close(self, app: web.Application) -> None:
        # The server has stopped every request: the background responses end with their terminal frames.
        if self.background:
            await asyncio.gather(*self.background, return_exceptions=True)
