"""One client's session: the glue between its transport, the protocol and the scheduler.

A :class:`ClientSession` hands what its client sends, and what the scheduler
reports about its requests (it is their :class:`scheduler.Sink`), to its
:class:`protocol.Connection`, and carries out the actions that come back. The
WebSocket server runs one per connection; the HTTP API runs one per request,
with its own transport (:mod:`stopline.http_api`).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from .auth import ApiKey
from .engine import GenerationResult
from .observability import log, log_accepted, log_end
from .protocol import (
    Action,
    Cancel,
    Connection,
    Draft,
    Ended,
    Frame,
    Request,
    Send,
    Submit,
    Tokenize,
    as_error,
    encode_frame,
)
from .scheduler import Busy
from .vocabulary import Reason

if TYPE_CHECKING:
    from .app import StoplineServer

# Prompts up to this size take the short tokenizing lane (a few milliseconds of work each).
SHORT_PROMPT_BYTES = 16 * 1024


class ClientSession:
    """One WebSocket connection: reads frames, hands them and what the scheduler
    reports about its requests (it is their Sink) to the protocol, and performs
    the actions the protocol returns."""

    def __init__(
        self,
        server: StoplineServer,
        websocket: ServerConnection | None,
        peer: str | None = None,
        address: str | None = None,
        key: ApiKey | None = None,
    ):
        self.server = server
        self.websocket = websocket
        # The API key the client presented (None when the server asks for none).
        self.key = key
        # An HTTP session has no WebSocket and names its own peer and address.
        if websocket is not None:
            peer = peer or peer_name(websocket)
            address = address or (websocket.remote_address[0] if websocket.remote_address else "unknown")
        self.peer = peer or "unknown"
        address = address or "unknown"
        self.protocol = Connection(
            server.limits,
            self._encode,
            time.monotonic_ns(),
            address=address,
            quota=server.address_quota,
            user_id=key.user if key is not None else None,
            key_id=key.key_id if key is not None else None,
        )
        # Prompts wait here to be tokenized, one at a time: reading goes on meanwhile
        # (cancels, pings), and one connection never has more than one prompt in the works.
        self._drafts: asyncio.Queue[Draft] = asyncio.Queue()
        self._preparer: asyncio.Task | None = None

    def _encode(self, prompt, messages):
        return self.server.engine.encode(prompt=prompt, messages=messages)

    async def run(self) -> None:
        assert self.websocket is not None, "only a WebSocket session reads frames"
        await self.perform(self.protocol.hello(self.server.engine.name))
        try:
            async for message in self.websocket:
                # The cancel's arrival time is taken here, as the frame is read.
                now = time.monotonic_ns()
                try:
                    if isinstance(message, str):
                        actions = self.protocol.receive_text(message, now)
                    else:
                        actions = self.protocol.receive_binary(now, len(message))
                except Exception:
                    # A bug handling one frame answers that frame, not the connection.
                    log.exception("frame_failed", peer=self.peer)
                    actions = self.protocol.frame_failed()
                await self.perform(actions)
        except ConnectionClosed:
            pass
        finally:
            await self.client_gone()

    async def client_gone(self) -> None:
        """The client went away: stop everything it started."""
        if self.protocol.live or self.protocol.pending:
            log.info("client_disconnected", peer=self.peer, live_requests=len(self.protocol.live))
        await self.perform(self.protocol.stop_all(Reason.CLIENT_DISCONNECTED, time.monotonic_ns()))
        if self._preparer is not None:
            self._preparer.cancel()

    async def perform(self, actions: list[Action]) -> None:
        """Carry out what the protocol decided, in order."""
        for action in actions:
            if isinstance(action, Send):
                if (error := as_error(action.frame)) is not None:
                    self.server.metrics.rejected.labels(str(error.code)).inc()
                await self._send(action.frame, action.request)
            elif isinstance(action, Tokenize):
                self._drafts.put_nowait(action.draft)
                if self._preparer is None:
                    self._preparer = asyncio.get_running_loop().create_task(self._prepare())
            elif isinstance(action, Submit):
                await self._submit(action.request)
            elif isinstance(action, Cancel):
                self.server.scheduler.cancel(action.request)
            elif isinstance(action, Ended):
                self.server.quotas.release(action.request.request_id, action.ending.tokens_generated)
                self.server.registry.end(action.request, action.ending)
                self.server.metrics.record_end(action.ending, action.request.key_id)
                log_end(action.request, action.ending, self.peer)

    async def _prepare(self) -> None:
        """Tokenize this connection's prompts in arrival order, off the event loop."""
        loop = asyncio.get_running_loop()
        while True:
            draft = await self._drafts.get()
            try:
                lane = self.server.tokenizer_lanes[draft.size > SHORT_PROMPT_BYTES]
                actions = self.protocol.tokenized(
                    draft, await loop.run_in_executor(lane, self.protocol.tokenize, draft)
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # A bug preparing one request ends that request, not the connection.
                log.exception("request_failed", request_id=draft.id, peer=self.peer)
                actions = self.protocol.preparation_failed(
                    draft, f"the server failed to read this prompt: {type(exc).__name__}"
                )
            await self.perform(actions)

    async def _submit(self, request: Request) -> None:
        if self.key is not None and not await self._admitted(request):
            return
        self.server.registry.add(request, self)
        try:
            position = self.server.scheduler.submit(request, self)
        except Busy as exc:
            await self.perform(self.protocol.busy(request, str(exc)))
            return
        except Exception as exc:
            log.exception("submit_failed", request_id=request.request_id, id=request.id)
            await self.perform(self.protocol.failed(request, str(exc)))
            return
        if request.cancel_reason is not None:
            # A stop asked for while the quota was being checked found nothing to stop then.
            self.server.scheduler.cancel(request)
        # Logged first: an HTTP client that leaves now cancels this task at the send.
        log_accepted(request, self.peer, position)
        # A token needs the executor and another pass of the event loop to arrive,
        # so this frame is written before any token frame.
        await self.perform(self.protocol.accepted(request, position))

    async def _admitted(self, request: Request) -> bool:
        """Whether the key is still in force and its quota admits ``request``; if not, the request has ended."""
        assert self.key is not None
        # A reload since the handshake may have revoked the key, or changed its limits.
        key = self.server.keyring.current(self.key)
        if key is None:
            await self.perform(self.protocol.unauthorized(request, "this connection's API key has been revoked"))
            return False
        try:
            refused = await self.server.quotas.admit(key, request.request_id, len(request.prompt_tokens))
        except asyncio.CancelledError:
            # An HTTP client left while Redis was asked: the request ends here, having never run,
            # and only the record of its end is kept (there is no one left to send frames to).
            now = time.monotonic_ns()
            self.protocol.request_cancel(request, Reason.CLIENT_DISCONNECTED, now)
            await self.perform([a for a in self.protocol.cancelled_in_queue(request, now) if isinstance(a, Ended)])
            raise
        if refused is not None:
            await self.perform(self.protocol.over_quota(request, refused.limit, refused.retry_after_s, refused.message))
            return False
        return True

    # Sink: what the scheduler reports, handed to the protocol ------------------------

    def started(self, request: Request) -> None:
        # Called synchronously as the request takes its slot. All the protocol can
        # answer is a Cancel (a stop asked for before there was a slot to stop),
        # and cancelling is synchronous too.
        for action in self.protocol.started(request, time.monotonic_ns()):
            if isinstance(action, Cancel):
                self.server.scheduler.cancel(action.request)

    async def deliver(self, request: Request, texts: list[str], logprobs: list[dict] | None = None) -> None:
        for i, text in enumerate(texts):
            # A batch's log probabilities go with its first token frame.
            await self.perform(self.protocol.token(request, text, time.monotonic_ns(), logprobs if i == 0 else None))

    async def finished(self, request: Request, result: GenerationResult) -> None:
        await self.perform(self.protocol.finished(request, result))

    async def failed(self, request: Request, message: str) -> None:
        await self.perform(self.protocol.failed(request, message))

    async def cancelled_in_queue(self, request: Request, now_ns: int) -> None:
        await self.perform(self.protocol.cancelled_in_queue(request, now_ns))

    async def expired_in_queue(self, request: Request, now_ns: int) -> None:
        await self.perform(self.protocol.expired_in_queue(request, now_ns))

    async def _send(self, frame: Frame, request: Request | None = None) -> None:
        """Send one frame. A client that stops reading makes this wait; past the
        grace period its request is cancelled with reason slow_consumer."""
        try:
            await asyncio.wait_for(self._write(frame), self.server.settings.slow_consumer_grace_s)
        except (ConnectionClosed, ConnectionError):
            pass
        except TimeoutError:
            # The frame stays in the transport buffer; only the wait was cut short.
            await self.perform(self.protocol.stalled(request, time.monotonic_ns()))

    async def _write(self, frame: Frame) -> None:
        # An HTTP session overrides this with its own transport.
        assert self.websocket is not None
        await self.websocket.send(encode_frame(frame))


def peer_name(connection: ServerConnection) -> str:
    address = connection.remote_address
    return f"{address[0]}:{address[1]}" if address else "unknown"
