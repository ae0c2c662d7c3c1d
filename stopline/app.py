"""The asyncio service: WebSocket at /ws, the web client at /, /healthz and /metrics.
The HTTP API (/v1) is served from the same event loop by :mod:`stopline.http_api`.

This module only moves bytes and frames. What a client sends, and what the
scheduler reports about its requests, goes into :class:`protocol.Connection`,
which decides what it means; the actions it returns are carried out here: send
a frame, tokenize a prompt, submit a request to the scheduler, cancel one,
record one that ended (registry, metrics, log).
"""

from __future__ import annotations

import asyncio
import json
import mimetypes
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request as HTTPRequest, Response

from .engine import Engine, GenerationResult
from .observability import Metrics, log, log_accepted, log_end
from .origin import OriginPolicy, check_request
from .protocol import (Action, AddressQuota, Cancel, Connection, Draft, Ended, Limits, Request, Send, Submit,
                       Tokenize, encode_frame)
from .registry import Registry
from .scheduler import Busy, Scheduler
from .vocabulary import Outcome, Reason, Refusal

if TYPE_CHECKING:
    from .cluster import Cluster

WEB_ROOT = Path(__file__).resolve().parent / "web"
# Prompts up to this size take the short tokenizing lane (a few milliseconds of work each).
SHORT_PROMPT_BYTES = 16 * 1024


@dataclass
class ServerConfig:
    """The server's settings; ``python -m stopline`` takes its flag defaults from here.
    The settings the protocol enforces default to :class:`protocol.Limits`, their one source."""

    host: str = "127.0.0.1"
    port: int = 8765
    # The HTTP API's port; None: the WebSocket port + 1 (or a free port when that one is 0).
    http_port: int | None = None
    workers: int = 2
    max_queue: int = 16
    # Extra allowed Origin values (scheme://host[:port], or "*"); same-origin pages are always allowed.
    allowed_origins: tuple[str, ...] = ()
    # Extra Host names the server answers to; its own address and, on loopback, localhost always are.
    allowed_hosts: tuple[str, ...] = ()
    requests_per_connection: int = Limits.requests_per_connection
    # Live requests of all connections from one client address.
    requests_per_address: int = Limits.requests_per_address
    # Open WebSocket connections, all clients together.
    max_connections: int = 256
    # Bytes a client may send before its handshake request is complete, and how long it may take.
    max_header_bytes: int = 16 * 1024
    handshake_timeout_s: float = 10.0
    default_timeout_s: float = Limits.default_timeout_s
    max_timeout_s: float = Limits.max_timeout_s
    default_ttft_timeout_s: float = Limits.default_ttft_timeout_s
    max_ttft_timeout_s: float = Limits.max_ttft_timeout_s
    # How long a send may wait for a client that stopped reading before its request is cancelled.
    slow_consumer_grace_s: float = 10.0
    # How far (in tokens) a generation may run ahead of what was written to its socket.
    window: int = 64
    # The largest frame, which is also the burst of bytes a connection may send.
    max_frame_bytes: int = Limits.byte_burst
    frames_per_second: float = Limits.frames_per_second
    frame_burst: int = Limits.frame_burst
    # Bytes of frames each connection may send a second, in bursts of one largest frame:
    # this bounds the parsing and tokenizing one client can ask for.
    bytes_per_second: float = Limits.bytes_per_second
    # Small transport and kernel send buffers: a stalled client's backlog stays
    # bounded, and backpressure reaches the token loop instead of piling up here.
    write_limit: int = 16 * 1024
    socket_send_buffer: int = 16 * 1024
    # The shared store of a scale-out deployment (docs/deploy.md); None: this process alone.
    redis_url: str | None = None
    status_ttl_s: int = 86_400
    # This replica's name in the store; None: "<hostname>-<port>".
    replica_id: str | None = None


class StoplineServer:
    def __init__(self, engine: Engine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.metrics = Metrics()
        self.scheduler = Scheduler(engine, config.workers, config.max_queue, window=config.window,
                                   metrics=self.metrics)
        self.metrics.slots.set(config.workers)
        self.metrics.set_abort_mode(engine.abort_mode)
        self.origin_policy = OriginPolicy.build(config.host, config.allowed_origins, config.allowed_hosts)
        self.limits = Limits(
            context_length=engine.context_length, vocab_size=engine.vocab_size,
            requests_per_connection=config.requests_per_connection,
            requests_per_address=config.requests_per_address,
            max_prompt_bytes=_max_prompt_bytes(engine, config.max_frame_bytes),
            bytes_per_second=config.bytes_per_second, byte_burst=config.max_frame_bytes,
            default_timeout_s=config.default_timeout_s, max_timeout_s=config.max_timeout_s,
            default_ttft_timeout_s=config.default_ttft_timeout_s, max_ttft_timeout_s=config.max_ttft_timeout_s,
            frames_per_second=config.frames_per_second, frame_burst=config.frame_burst)
        self._server: Server | None = None
        self._sessions: set[ClientSession] = set()
        self.address_quota = AddressQuota(config.requests_per_address)
        # WebSocket connections admitted by the handshake and not yet closed.
        self.websocket_connections = 0
        # Prompts are tokenized in worker threads, which release the GIL while they
        # work. Short prompts (milliseconds each) have a lane of their own, so they
        # never wait behind long ones; the long lane runs at a lower priority than
        # the token loops.
        self.tokenizer_lanes = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="stopline-tokenize-short"),
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="stopline-tokenize-long",
                               initializer=_background_priority))
        self.registry = Registry()
        self.cluster: Cluster | None = None
        if config.redis_url:
            from .cluster import Cluster
            self.cluster = Cluster(config.redis_url, self.registry, self.metrics, status_ttl_s=config.status_ttl_s)
            self.registry.listener = self.cluster
        from .http_api import HttpApi  # imported here: its sessions build on ClientSession below
        self.http = HttpApi(self)

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    async def start(self, sock: socket.socket | None = None) -> None:
        """Listen on ``config.host``/``config.port``, or on ``sock`` if the caller has bound one already."""
        where = {"sock": sock} if sock is not None else {"host": self.config.host, "port": self.config.port}
        self._server = await serve(
            self._handle, **where,
            process_request=self._process_request, max_size=self.config.max_frame_bytes,
            write_limit=self.config.write_limit, server_header="Stopline",
            create_connection=self._create_connection,
            # The handshake deadline is enforced (and counted) by GuardedConnection; this is the backstop.
            open_timeout=self.config.handshake_timeout_s + 5)
        http_port = self.config.http_port
        if http_port is None:
            http_port = self.config.port + 1 if self.config.port else 0
        await self.http.start(self.config.host, http_port)
        if self.cluster is not None:
            await self.cluster.start(self.config.replica_id or f"{socket.gethostname()}-{self.port}")
        log.info("server_started", url=f"http://{self.config.host}:{self.port}/", model=self.engine.name,
                 workers=self.config.workers, threads=self.engine.threads, context_length=self.engine.context_length,
                 prefill_chunk=self.engine.prefill_chunk, abort_mode=str(self.engine.abort_mode),
                 http_api=self.http.base_url)

    async def shutdown(self) -> None:
        """Cancel every request with reason ``shutdown``, then close connections with 1001."""
        log.info("server_stopping", active=self.scheduler.active, queued=self.scheduler.queue_depth)
        # Stop accepting connections, end every request (its terminal message goes
        # out on its still-open connection), then close connections with 1001.
        self._server.server.close()
        self.scheduler.close()
        now = time.monotonic_ns()
        for session in list(self._sessions):
            await session.perform(session.protocol.stop_all(Reason.SHUTDOWN, now))
        await self.scheduler.shutdown()
        if self.cluster is not None:
            await self.cluster.close()
        self._server.close(close_connections=True)
        await self._server.wait_closed()
        await self.http.close()
        for lane in self.tokenizer_lanes:
            await asyncio.get_running_loop().run_in_executor(None, lane.shutdown)
        log.info("server_stopped")

    # HTTP ----------------------------------------------------------------------

    def _create_connection(self, *args, **kwargs) -> "GuardedConnection":
        return GuardedConnection(self, *args, **kwargs)

    def refuse(self, connection: ServerConnection, code: Refusal, **details) -> None:
        """Count and log a connection refused before it became a WebSocket."""
        self.metrics.refused.labels(str(code)).inc()
        log.warning("connection_refused", code=str(code), peer=_peer(connection), **details)

    def _process_request(self, connection: ServerConnection, request: HTTPRequest) -> Response | None:
        path = urlsplit(request.path).path
        refused = check_request(request.headers.get_all("Host"),
                                request.headers.get_all("Origin") if path == "/ws" else None, self.origin_policy)
        if refused is not None:
            # Header values are the client's; log them shortened.
            self.refuse(connection, refused.code, host=request.headers.get_all("Host")[:2],
                        origin=request.headers.get_all("Origin")[:2] if path == "/ws" else None)
            return _response(refused.status, f"{refused.code}: {refused.message}\n".encode(), "text/plain")
        if path == "/ws":
            if self.websocket_connections >= self.config.max_connections:
                self.refuse(connection, Refusal.TOO_MANY_CONNECTIONS)
                return _response(HTTPStatus.SERVICE_UNAVAILABLE,
                                 f"{Refusal.TOO_MANY_CONNECTIONS}: the server has its maximum of "
                                 f"{self.config.max_connections} connections\n".encode(), "text/plain")
            self.websocket_connections += 1
            connection.admitted = True
            return None
        if path == "/healthz":
            body = json.dumps({"status": "ok", "model": self.engine.name, "slots": self.scheduler.workers,
                               "active": self.scheduler.active, "queued": self.scheduler.queue_depth,
                               "abort_mode": str(self.engine.abort_mode), "http_api": self.http.base_url,
                               "store": self.cluster.health() if self.cluster is not None else {"type": "memory"}})
            return _response(HTTPStatus.OK, body.encode(), "application/json")
        if path == "/metrics":
            return _response(HTTPStatus.OK, self.metrics.render(), CONTENT_TYPE_LATEST)
        return _static(path)

    # WebSocket -------------------------------------------------------------------

    async def _handle(self, websocket: ServerConnection) -> None:
        sock = websocket.transport.get_extra_info("socket")
        if sock is not None and self.config.socket_send_buffer:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.config.socket_send_buffer)
        session = ClientSession(self, websocket)
        self._sessions.add(session)
        self.metrics.connections.inc()
        try:
            await session.run()
        finally:
            self._sessions.discard(session)
            self.metrics.connections.dec()


class ClientSession:
    """One WebSocket connection: reads frames, hands them and what the scheduler
    reports about its requests (it is their Sink) to the protocol, and performs
    the actions the protocol returns."""

    def __init__(self, server: StoplineServer, websocket: ServerConnection | None, peer: str | None = None,
                 address: str | None = None):
        self.server = server
        self.websocket = websocket
        self.peer = peer or _peer(websocket)
        if address is None:
            address = websocket.remote_address[0] if websocket.remote_address else "unknown"
        self.protocol = Connection(server.limits, self._encode, time.monotonic_ns(), address=address,
                                   quota=server.address_quota)
        # Prompts wait here to be tokenized, one at a time: reading goes on meanwhile
        # (cancels, pings), and one connection never has more than one prompt in the works.
        self._drafts: asyncio.Queue[Draft] = asyncio.Queue()
        self._preparer: asyncio.Task | None = None

    def _encode(self, prompt, messages):
        return self.server.engine.encode(prompt=prompt, messages=messages)

    async def run(self) -> None:
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
                if action.frame["type"] == Outcome.ERROR:
                    self.server.metrics.rejected.labels(action.frame["code"]).inc()
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
                self.server.registry.end(action.request, action.ending)
                self.server.metrics.record_end(action.ending)
                log_end(action.request, action.ending, self.peer)

    async def _prepare(self) -> None:
        """Tokenize this connection's prompts in arrival order, off the event loop."""
        loop = asyncio.get_running_loop()
        while True:
            draft = await self._drafts.get()
            try:
                lane = self.server.tokenizer_lanes[draft.size > SHORT_PROMPT_BYTES]
                actions = self.protocol.tokenized(
                    draft, await loop.run_in_executor(lane, self.protocol.tokenize, draft))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # A bug preparing one request ends that request, not the connection.
                log.exception("request_failed", request_id=draft.id, peer=self.peer)
                actions = self.protocol.preparation_failed(
                    draft, f"the server failed to read this prompt: {type(exc).__name__}")
            await self.perform(actions)

    async def _submit(self, request: Request) -> None:
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
        # Logged first: an HTTP client that leaves now cancels this task at the send.
        log_accepted(request, self.peer, position)
        # A token needs the executor and another pass of the event loop to arrive,
        # so this frame is written before any token frame.
        await self.perform(self.protocol.accepted(request, position))

    # Sink: what the scheduler reports, handed to the protocol ------------------------

    def started(self, request: Request) -> None:
        # Called synchronously as the request takes its slot. All the protocol can
        # answer is a Cancel (a stop asked for before there was a slot to stop),
        # and cancelling is synchronous too.
        for action in self.protocol.started(request, time.monotonic_ns()):
            if isinstance(action, Cancel):
                self.server.scheduler.cancel(action.request)

    async def deliver(self, request: Request, texts: list[str]) -> None:
        for text in texts:
            await self.perform(self.protocol.token(request, text, time.monotonic_ns()))

    async def finished(self, request: Request, result: GenerationResult) -> None:
        await self.perform(self.protocol.finished(request, result))

    async def failed(self, request: Request, message: str) -> None:
        await self.perform(self.protocol.failed(request, message))

    async def cancelled_in_queue(self, request: Request, now_ns: int) -> None:
        await self.perform(self.protocol.cancelled_in_queue(request, now_ns))

    async def expired_in_queue(self, request: Request, now_ns: int) -> None:
        await self.perform(self.protocol.expired_in_queue(request, now_ns))

    async def _send(self, frame: dict, request: Request | None = None) -> None:
        """Send one frame. A client that stops reading makes this wait; past the
        grace period its request is cancelled with reason slow_consumer."""
        try:
            await asyncio.wait_for(self._write(frame), self.server.config.slow_consumer_grace_s)
        except (ConnectionClosed, ConnectionError):
            pass
        except TimeoutError:
            # The frame stays in the transport buffer; only the wait was cut short.
            await self.perform(self.protocol.stalled(request, time.monotonic_ns()))

    async def _write(self, frame: dict) -> None:
        await self.websocket.send(encode_frame(frame))


class GuardedConnection(ServerConnection):
    """A connection whose handshake has a byte budget and a deadline.

    websockets reads up to 128 header lines of 8 KiB each, and keeps what it
    has read for as long as the handshake lasts; both are cut short here.
    """

    def __init__(self, stopline: StoplineServer, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stopline = stopline
        self.admitted = False
        self._refused = False
        self._handshake_bytes = 0
        self._handshake_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._handshake_timer = self.loop.call_later(self.stopline.config.handshake_timeout_s,
                                                     self._handshake_expired)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # read and dropped, so that closing does not reset the connection before the answer is read
        if self.request is None:
            self._handshake_bytes += len(data)
            if self._handshake_bytes > self.stopline.config.max_header_bytes:
                self._refuse(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, Refusal.HEADERS_TOO_LARGE,
                             f"the handshake may carry at most {self.stopline.config.max_header_bytes} bytes")
                return
        super().data_received(data)
        if self.request is not None and self._handshake_timer is not None:
            self._handshake_timer.cancel()
            self._handshake_timer = None

    def connection_lost(self, exc) -> None:
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
        if self.admitted:
            self.admitted = False
            self.stopline.websocket_connections -= 1
        super().connection_lost(exc)

    def _handshake_expired(self) -> None:
        self._handshake_timer = None
        if self.request is None and not self.transport.is_closing():
            self._refuse(HTTPStatus.REQUEST_TIMEOUT, Refusal.HANDSHAKE_TIMEOUT,
                         f"the handshake did not complete within {self.stopline.config.handshake_timeout_s:g} s")

    def _refuse(self, status: HTTPStatus, code: Refusal, message: str) -> None:
        self.stopline.refuse(self, code)
        body = f"{code}: {message}\n".encode()
        self._refused = True
        self.transport.write(f"HTTP/1.1 {status.value} {status.phrase}\r\nContent-Type: text/plain\r\n"
                             f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        # Half-close, and keep reading for a moment: closing a socket with unread
        # data resets it, and the client would never see the answer.
        self.transport.write_eof()
        self.loop.call_later(1.0, self.transport.close)


def _max_prompt_bytes(engine: Engine, max_frame_bytes: int) -> int:
    """No prompt longer than this can fit the context: every token stands for at most the longest token's bytes."""
    longest = getattr(engine.tokenizer, "max_token_bytes", None)
    bound = engine.context_length * longest if longest else max_frame_bytes
    return min(bound, max_frame_bytes)


def _background_priority() -> None:
    # Linux applies a nice value to the calling thread alone: ten steps below the
    # token loops gives it about a tenth of their share of a contended core.
    try:
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + 10))
    except (AttributeError, OSError):
        pass


def _peer(connection: ServerConnection) -> str:
    address = connection.remote_address
    return f"{address[0]}:{address[1]}" if address else "unknown"


def _response(status: HTTPStatus, body: bytes, content_type: str, extra_headers=()) -> Response:
    headers = Headers([("Content-Type", content_type), ("Content-Length", str(len(body))),
                       ("Cache-Control", "no-store"), ("X-Content-Type-Options", "nosniff"), *extra_headers])
    return Response(status.value, status.phrase, headers, body)


# The page renders model output: nothing inline, nothing from elsewhere may run or load.
PAGE_SECURITY_POLICY = ("default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
                        "form-action 'none'; frame-ancestors 'none'")


def _static(path: str) -> Response:
    name = "index.html" if path == "/" else path.lstrip("/")
    # Serve only files that sit directly in web/ or web/vendor/: no traversal, no other directories.
    target = WEB_ROOT / name
    folder, _, leaf = name.rpartition("/")
    if folder not in ("", "vendor") or not leaf or leaf.startswith(".") or not target.is_file():
        return _response(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")
    content_type = mimetypes.guess_type(name)[0] or "application/octet-stream"
    if content_type.startswith("text/") or content_type.endswith("javascript"):
        content_type += "; charset=utf-8"
    extra = [("Content-Security-Policy", PAGE_SECURITY_POLICY)] if name.endswith(".html") else []
    return _response(HTTPStatus.OK, target.read_bytes(), content_type, extra)
