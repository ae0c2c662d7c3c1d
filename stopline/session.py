"""One client's session: the glue between its transport, the protocol and the scheduler.

A :class:`ClientSession` owns one :class:`protocol.Connection`. It hands it
what its client sends (through the session's transport) and what the
scheduler reports about its requests (it is their :class:`scheduler.Sink`),
and carries out the actions that come back, each path flat: feed the
protocol, take its actions, perform them; an action that needs the protocol
again adds its answer to the same list, and nothing re-enters.

The session talks to its client through a :class:`Transport`: a WebSocket
connection (:class:`WebSocketTransport`, one session per connection), or the
reply to one HTTP request (:mod:`stopline.http_api`, one session per request).
It sees the rest of the server only through :class:`Services`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from .auth import ApiKey
from .edge import peer_name
from .observability import log, log_accepted, log_end
from .protocol.connection import (
    Action,
    Cancel,
    Connection,
    Draft,
    Ended,
    Send,
    StopDraft,
    Submit,
    Tokenize,
)
from .protocol.errors import Busy, InsufficientMemory
from .protocol.frames import Frame, GenerateFrame, as_error, encode_frame
from .protocol.requests import GenerationResult, Request
from .protocol.vocabulary import Reason
from .services import Services
from .tasks import stop_tasks

if TYPE_CHECKING:
    from .residency import Catalog, LazyModel

# Prompts up to this size take the short tokenizing lane (a few milliseconds of work each).
SHORT_PROMPT_BYTES = 16 * 1024


class Transport(Protocol):
    """How a session reaches its client: one WebSocket connection, or one HTTP request's reply."""

    @property
    def peer(self) -> str: ...

    async def send(self, frame: Frame) -> None:
        """Write ``frame``; waits while the client does not read. Raises ConnectionError
        (or websockets' ConnectionClosed) when the client has gone."""


@dataclass(eq=False)
class Route:
    """The model a request runs on: its services, and the lazily loaded model it holds, if it is one
    (held from before its load to the request's end, so that it is not unloaded under it)."""

    draft: Draft
    services: Services
    lazy: LazyModel | None = None


class ClientSession:
    """One client: a WebSocket connection, or one HTTP request. It feeds the protocol what
    its transport reads and what the scheduler reports about its requests (it is their Sink),
    and performs the actions the protocol returns.

    Each request runs on the model it names, found in ``catalog`` (a WebSocket's generate frames
    may name any served model, loaded on first use); without a catalog, on ``services``' model
    (an HTTP request, whose model the API has found and loaded already)."""

    def __init__(
        self,
        services: Services,
        transport: Transport,
        address: str,
        key: ApiKey | None = None,
        catalog: Catalog | None = None,
    ):
        self.services = services
        self.catalog = catalog
        self.transport = transport
        self.peer = transport.peer
        # The API key the client presented (None when the server asks for none).
        self.key = key
        self.protocol = Connection(
            services.limits,
            services.encode,
            time.monotonic_ns(),
            address=address,
            quota=services.address_quota,
            user_id=key.user if key is not None else None,
            key_id=key.key_id if key is not None else None,
            priority=key.priority if key is not None else 0,
            models=catalog,
        )
        # Prompts wait here to be tokenized, one at a time: reading goes on meanwhile
        # (cancels, pings), and one connection never has more than one prompt in the works.
        self._drafts: asyncio.Queue[Draft] = asyncio.Queue()
        self._preparer: asyncio.Task | None = None
        # Each live or pending request's model, by its id.
        self._routes: dict[str, Route] = {}
        # Drafts waiting for their model to load, by id, and why each wait was stopped, if it was.
        self._loads: dict[str, asyncio.Task] = {}
        self._stopped_loads: dict[str, Reason] = {}

    # What the client did --------------------------------------------------------

    async def open(self) -> None:
        """The connection opened: greet the client."""
        models = self.catalog.names if self.catalog is not None else ()
        await self.perform(self.protocol.hello(self.services.model, models))

    async def receive_text(self, text: str, now_ns: int) -> None:
        await self._feed(lambda: self.protocol.receive_text(text, now_ns))

    async def generate(self, frame: GenerateFrame, now_ns: int) -> None:
        """A generate frame checked at the edge: an HTTP request's body."""
        await self._feed(lambda: self.protocol.generate(frame, now_ns))

    async def receive_binary(self, size: int, now_ns: int) -> None:
        await self._feed(lambda: self.protocol.receive_binary(now_ns, size))

    async def _feed(self, receive: Callable[[], list[Action]]) -> None:
        try:
            actions = receive()
        except Exception:
            # A bug handling one frame answers that frame, not the connection.
            log.exception("frame_failed", peer=self.peer)
            actions = self.protocol.frame_failed()
        await self.perform(actions)

    async def cancel(self, request: Request, reason: Reason, now_ns: int) -> None:
        """Stop ``request`` for ``reason`` (a DELETE, a cancel relayed from another replica)."""
        await self.perform(self.protocol.request_cancel(request, reason, now_ns))

    async def stop_all(self, reason: Reason, now_ns: int) -> None:
        """Stop every live request of this client: it left, or the server is shutting down. A
        request waiting for its model to load ends first, while the protocol still has it."""
        loads = list(self._loads.values())
        for draft_id in list(self._loads):
            self._stop_load(draft_id, reason)
        await asyncio.gather(*loads, return_exceptions=True)
        await self.perform(self.protocol.stop_all(reason, now_ns))

    async def client_gone(self) -> None:
        """The client went away: stop everything it started."""
        if self.protocol.live or self.protocol.pending:
            log.info("client_disconnected", peer=self.peer, live_requests=len(self.protocol.live))
        await self.stop_all(Reason.CLIENT_DISCONNECTED, time.monotonic_ns())
        if self._preparer is not None:
            # Waited for, so that no task of this connection outlives it.
            await stop_tasks([self._preparer])
        # Drafts dropped unprepared give back the models they held.
        for route in list(self._routes.values()):
            self._settle(route.draft)

    # Carrying out what the protocol decided -----------------------------------------

    async def perform(self, actions: Iterable[Action]) -> None:
        """Carry out what the protocol decided, in order. An action whose outcome the
        protocol must hear of (a send that stalled, a submit) puts its answer at the front."""
        pending = [*actions]
        while pending:
            action = pending.pop(0)
            if isinstance(action, Send):
                more = await self._send(action.frame, action.request)
            elif isinstance(action, Tokenize):
                more = self._tokenize(action.draft)
            elif isinstance(action, Submit):
                more = await self._submit(action.request)
            elif isinstance(action, Cancel):
                more = self._cancel(action.request)
            elif isinstance(action, StopDraft):
                more = self._stop_load(action.draft.id, Reason.USER_CANCELLED)
            else:
                more = self._record(action)
            pending[:0] = more

    async def _send(self, frame: Frame, request: Request | None) -> list[Action]:
        """Send one frame. A client that stops reading makes this wait; past the
        grace period its request is cancelled with reason slow_consumer."""
        if (error := as_error(frame)) is not None:
            self.services.metrics.rejected.labels(str(error.code)).inc()
        try:
            # In this task (wait_for would start another): a frame goes out in this turn of the loop.
            async with asyncio.timeout(self.services.slow_consumer_grace_s):
                await self.transport.send(frame)
        except (ConnectionClosed, ConnectionError):
            pass
        except TimeoutError:
            # The frame stays in the transport buffer; only the wait was cut short.
            return self.protocol.stalled(request, time.monotonic_ns())
        return []

    def _tokenize(self, draft: Draft) -> list[Action]:
        """Find the model ``draft`` names, then tokenize its prompt: at once on a loaded model;
        on a lazily loaded one, once it has loaded (stopped by a cancel, as a queued request is)."""
        catalog, asked = self.catalog, draft.frame.model
        lazy = catalog.lazy_for(asked) if catalog is not None else None
        if lazy is None:
            services = catalog.services_for(asked) if catalog is not None else self.services
            self._routes[draft.id] = Route(draft, services)
            draft.model = services.model
            self._prepare_later(draft)
            return []
        lazy.hold()
        self._routes[draft.id] = Route(draft, self.services, lazy)
        draft.model = lazy.name
        if lazy.running is not None:
            self._routes[draft.id].services = lazy.running.services
            self._prepare_later(draft)
        else:
            self._loads[draft.id] = asyncio.get_running_loop().create_task(self._load(draft, lazy))
        return []

    def _prepare_later(self, draft: Draft) -> None:
        self._drafts.put_nowait(draft)
        if self._preparer is None:
            self._preparer = asyncio.get_running_loop().create_task(self._prepare())

    async def _load(self, draft: Draft, lazy: LazyModel) -> None:
        """Wait for ``draft``'s model to load (other frames, and other models' requests, go on
        meanwhile), then tokenize its prompt. A stop ends the wait at once; the load goes on."""
        try:
            try:
                services = await lazy.ready()
            finally:
                del self._loads[draft.id]
        except asyncio.CancelledError:
            reason = self._stopped_loads.pop(draft.id, None)
            if reason is None:
                raise
            task = asyncio.current_task()
            assert task is not None
            task.uncancel()
            actions = self.protocol.stopped_in_load(draft, reason, time.monotonic_ns())
        except InsufficientMemory as exc:
            actions = self.protocol.tokenized(draft, exc)
        except Exception as exc:
            actions = self.protocol.preparation_failed(
                draft, f"the model {lazy.name!r} failed to load: {type(exc).__name__}"
            )
        else:
            self._routes[draft.id].services = services
            self._prepare_later(draft)
            return
        await self.perform(actions)
        self._settle(draft)

    def _stop_load(self, draft_id: str, reason: Reason) -> list[Action]:
        """End the wait of ``draft_id`` for its model to load, if it waits; its task answers for it."""
        task = self._loads.get(draft_id)
        if task is not None and draft_id not in self._stopped_loads:
            self._stopped_loads[draft_id] = reason
            task.cancel()
        return []

    def _settle(self, draft: Draft) -> None:
        """``draft`` did not become a live request (refused, or its client left): give back its model."""
        route = self._routes.get(draft.id)
        if route is not None and route.draft is draft and draft.id not in self.protocol.live:
            self._unroute(draft.id)

    def _unroute(self, request_id: str) -> None:
        route = self._routes.pop(request_id, None)
        if route is not None and route.lazy is not None:
            route.lazy.release()

    def _services_of(self, request: Request) -> Services:
        route = self._routes.get(request.id)
        return route.services if route is not None else self.services

    def _cancel(self, request: Request) -> list[Action]:
        self._services_of(request).scheduler.cancel(request)
        return []

    def _record(self, ended: Ended) -> list[Action]:
        services = self._services_of(ended.request)
        services.quotas.release(ended.request.request_id, ended.ending.tokens_generated)
        services.registry.end(ended.request, ended.ending)
        self._unroute(ended.request.id)
        # The metrics and the end line, the slow part of the record, follow once the terminal
        # frame is out: before this loop reads anything more, such as a client's next request.
        loop = asyncio.get_running_loop()
        loop.call_soon(services.metrics.record_end, ended.ending, ended.request.key_id, services.model)
        loop.call_soon(log_end, ended.request, ended.ending, self.peer, services.model)
        return []

    async def _prepare(self) -> None:
        """Tokenize this connection's prompts in arrival order, off the event loop."""
        loop = asyncio.get_running_loop()
        while True:
            draft = await self._drafts.get()
            try:
                services = self._routes[draft.id].services
                lane = services.tokenizer_lanes[draft.frame.size > SHORT_PROMPT_BYTES]
                tokens = await loop.run_in_executor(
                    lane, self.protocol.tokenize, draft, services.encode, services.limits
                )
                actions = self.protocol.tokenized(draft, tokens)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # A bug preparing one request ends that request, not the connection.
                log.exception("request_failed", request_id=draft.id, peer=self.peer)
                actions = self.protocol.preparation_failed(
                    draft, f"the server failed to read this prompt: {type(exc).__name__}"
                )
            await self.perform(actions)
            self._settle(draft)

    async def _submit(self, request: Request) -> list[Action]:
        if self.key is not None:
            refused = await self._refused(request)
            if refused is not None:
                return refused
        services = self._services_of(request)
        services.registry.add(request, self)
        try:
            position = services.scheduler.submit(request, self)
        except Busy as exc:
            return self.protocol.busy(request, str(exc))
        except Exception as exc:
            log.exception("submit_failed", request_id=request.request_id, id=request.id)
            return self.protocol.failed(request, str(exc))
        if request.cancel_reason is not None:
            # A stop asked for while the quota was being checked found nothing to stop then.
            services.scheduler.cancel(request)
        # Logged first: an HTTP client that leaves now cancels this task at the send.
        log_accepted(request, self.peer, position)
        # A token needs the executor and another pass of the event loop to arrive,
        # so this frame is written before any token frame.
        return self.protocol.accepted(request, position)

    async def _refused(self, request: Request) -> list[Action] | None:
        """None if the key is still in force and its quota admits ``request``; else how it ends."""
        assert self.key is not None
        # A reload since the handshake may have revoked the key, or changed its limits.
        key = self.services.keyring.current(self.key)
        if key is None:
            return self.protocol.unauthorized(request, "this connection's API key has been revoked")
        try:
            refused = await self.services.quotas.admit(key, request.request_id, len(request.prompt_tokens))
        except asyncio.CancelledError:
            # An HTTP client left while Redis was asked: the request ends here, having never run,
            # and only the record of its end is kept (there is no one left to send frames to).
            now = time.monotonic_ns()
            self.protocol.request_cancel(request, Reason.CLIENT_DISCONNECTED, now)
            for action in self.protocol.cancelled_in_queue(request, now):
                if isinstance(action, Ended):
                    self._record(action)
            raise
        if refused is not None:
            return self.protocol.over_quota(request, refused.limit, refused.retry_after_s, refused.message)
        return None

    # Sink: what the scheduler reports, handed to the protocol ------------------------

    def started(self, request: Request) -> None:
        # Called synchronously as the request takes its slot. All the protocol can
        # answer is a Cancel (a stop asked for before there was a slot to stop),
        # and cancelling is synchronous too.
        for action in self.protocol.started(request, time.monotonic_ns()):
            if isinstance(action, Cancel):
                self._cancel(action.request)

    async def deliver(self, request: Request, texts: list[str], logprobs: list[dict] | None = None) -> None:
        for i, text in enumerate(texts):
            # A batch's log probabilities go with its first token frame.
            await self.perform(self.protocol.token(request, text, time.monotonic_ns(), logprobs if i == 0 else None))

    async def finished(self, request: Request, result: GenerationResult) -> None:
        await self.perform(self.protocol.finished(request, result))

    async def preempted(self, request: Request) -> None:
        await self.perform(self.protocol.preempted(request))

    async def resumed(self, request: Request) -> None:
        await self.perform(self.protocol.resumed(request))

    async def failed(self, request: Request, message: str) -> None:
        await self.perform(self.protocol.failed(request, message))

    async def cancelled_in_queue(self, request: Request, now_ns: int) -> None:
        await self.perform(self.protocol.cancelled_in_queue(request, now_ns))

    async def expired_in_queue(self, request: Request, now_ns: int) -> None:
        await self.perform(self.protocol.expired_in_queue(request, now_ns))


class WebSocketTransport:
    """A WebSocket connection: frames as JSON text messages, one session for the connection."""

    def __init__(self, websocket: ServerConnection):
        self.websocket = websocket
        address = websocket.remote_address
        self.peer = peer_name(address)
        self.address = address[0] if address else "unknown"

    async def send(self, frame: Frame) -> None:
        await self.websocket.send(encode_frame(frame))

    async def run(self, session: ClientSession) -> None:
        """Greet, then feed ``session`` every message until the client goes away."""
        await session.open()
        try:
            async for message in self.websocket:
                # The cancel's arrival time is taken here, as the frame is read.
                now = time.monotonic_ns()
                if isinstance(message, str):
                    await session.receive_text(message, now)
                else:
                    await session.receive_binary(len(message), now)
        except ConnectionClosed:
            pass
        finally:
            await session.client_gone()
