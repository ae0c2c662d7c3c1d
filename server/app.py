"""The asyncio service: WebSocket at /ws, the web client at /, /healthz and /metrics.
The HTTP API (/v1) is served from the same event loop by :mod:`server.http_api`.

This module only moves bytes. Frames go into :class:`protocol.Connection`,
which decides what they mean; the actions it returns are carried out here
(send a frame, submit a request to the scheduler, cancel one).
"""

from __future__ import annotations

import asyncio
import json
import mimetypes
import socket
import time
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request as HTTPRequest, Response

from .engine import Engine
from .observability import Metrics, log, log_accepted, log_end
from .protocol import Cancel, Connection, Ending, Limits, Request, Send, Submit, encode_frame
from .registry import Registry
from .scheduler import Busy, Scheduler
from .vocabulary import ErrorCode, Outcome, Reason

WEB_ROOT = Path(__file__).resolve().parent.parent / "web"
LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1"}


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8765
    # The HTTP API's port; None: the WebSocket port + 1 (or a free port when that one is 0).
    http_port: int | None = None
    workers: int = 2
    max_queue: int = 16
    # Extra allowed Origin values; same-origin and localhost pages are always allowed.
    allowed_origins: tuple[str, ...] = ()
    requests_per_connection: int = 8
    default_timeout_s: float = 300.0
    max_timeout_s: float = 600.0
    default_ttft_timeout_s: float = 120.0
    max_ttft_timeout_s: float = 600.0
    # How long a send may wait for a client that stopped reading before its request is cancelled.
    slow_consumer_grace_s: float = 10.0
    # How far (in tokens) a generation may run ahead of what was written to its socket.
    window: int = 64
    max_frame_bytes: int = 1 << 20
    frames_per_second: float = 50.0
    frame_burst: int = 100
    # Small transport and kernel send buffers: a stalled client's backlog stays
    # bounded, and backpressure reaches the token loop instead of piling up here.
    write_limit: int = 16 * 1024
    socket_send_buffer: int = 16 * 1024


class StoplineServer:
    def __init__(self, engine: Engine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.metrics = Metrics()
        self.scheduler = Scheduler(engine, config.workers, config.max_queue, window=config.window,
                                   metrics=self.metrics)
        self.metrics.slots.set(config.workers)
        self.metrics.set_abort_mode(engine.abort_mode)
        self.limits = Limits(
            context_length=engine.context_length, vocab_size=engine.vocab_size,
            requests_per_connection=config.requests_per_connection,
            default_timeout_s=config.default_timeout_s, max_timeout_s=config.max_timeout_s,
            default_ttft_timeout_s=config.default_ttft_timeout_s, max_ttft_timeout_s=config.max_ttft_timeout_s,
            frames_per_second=config.frames_per_second, frame_burst=config.frame_burst)
        self._server: Server | None = None
        self._sessions: set[ClientSession] = set()
        self.registry = Registry()
        from .http_api import HttpApi  # imported here: its sessions build on ClientSession below
        self.http = HttpApi(self)

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    async def start(self) -> None:
        self._server = await serve(
            self._handle, self.config.host, self.config.port,
            process_request=self._process_request, max_size=self.config.max_frame_bytes,
            write_limit=self.config.write_limit, server_header="Stopline")
        http_port = self.config.http_port
        if http_port is None:
            http_port = self.config.port + 1 if self.config.port else 0
        await self.http.start(self.config.host, http_port)
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
        self._server.close(close_connections=True)
        await self._server.wait_closed()
        await self.http.close()
        log.info("server_stopped")

    # HTTP ----------------------------------------------------------------------

    def _process_request(self, connection: ServerConnection, request: HTTPRequest) -> Response | None:
        path = urlsplit(request.path).path
        if path == "/ws":
            origin = request.headers.get("Origin")
            if origin is not None and not self._origin_allowed(origin, request.headers.get("Host", "")):
                log.warning("origin_rejected", origin=origin, peer=_peer(connection))
                return _response(HTTPStatus.FORBIDDEN, b"origin not allowed\n", "text/plain")
            return None
        if path == "/healthz":
            body = json.dumps({"status": "ok", "model": self.engine.name, "slots": self.scheduler.workers,
                               "active": self.scheduler.active, "queued": self.scheduler.queue_depth,
                               "abort_mode": str(self.engine.abort_mode), "http_api": self.http.base_url})
            return _response(HTTPStatus.OK, body.encode(), "application/json")
        if path == "/metrics":
            return _response(HTTPStatus.OK, self.metrics.render(), CONTENT_TYPE_LATEST)
        return _static(path)

    def _origin_allowed(self, origin: str, host: str) -> bool:
        if origin in self.config.allowed_origins or "*" in self.config.allowed_origins:
            return True
        parts = urlsplit(origin)
        if parts.netloc == host:
            return True  # same origin
        return parts.scheme in ("http", "https") and parts.hostname in LOCAL_HOSTS

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
    """One WebSocket connection: reads frames, performs the protocol's actions,
    and receives its requests' output from the scheduler (it is their Sink)."""

    def __init__(self, server: StoplineServer, websocket: ServerConnection | None, peer: str | None = None):
        self.server = server
        self.websocket = websocket
        self.peer = peer or _peer(websocket)
        self.protocol = Connection(server.limits, self._tokenize, time.monotonic_ns())

    def _tokenize(self, prompt, messages):
        return self.server.engine.encode(prompt=prompt, messages=messages)

    async def run(self) -> None:
        await self._send(self.protocol.hello(self.server.engine.name))
        try:
            async for message in self.websocket:
                # The cancel's arrival time is taken here, as the frame is read.
                now = time.monotonic_ns()
                if isinstance(message, str):
                    actions = self.protocol.receive_text(message, now)
                else:
                    actions = self.protocol.receive_binary(now)
                await self.perform(actions)
        except ConnectionClosed:
            pass
        finally:
            if self.protocol.live:
                log.info("client_disconnected", peer=self.peer, live_requests=len(self.protocol.live))
            await self.perform(self.protocol.stop_all(Reason.CLIENT_DISCONNECTED, time.monotonic_ns()))

    async def perform(self, actions) -> None:
        """Carry out what the protocol decided."""
        for action in actions:
            if isinstance(action, Send):
                if action.frame["type"] == "error":
                    self.server.metrics.rejected.labels(action.frame["code"]).inc()
                await self._send(action.frame)
            elif isinstance(action, Submit):
                await self._submit(action.request)
            elif isinstance(action, Cancel):
                self.server.scheduler.cancel(action.request, action.reason)

    async def _submit(self, request: Request) -> None:
        self.server.registry.add(request, self)
        try:
            position = self.server.scheduler.submit(request, self)
        except Busy as exc:
            await self.finish(request, Ending(Outcome.ERROR, str(ErrorCode.BUSY), message=str(exc)))
            return
        except Exception as exc:
            log.exception("submit_failed", request_id=request.request_id, id=request.id)
            await self.finish(request, Ending(Outcome.ERROR, str(ErrorCode.INTERNAL_ERROR), message=str(exc)))
            return
        # Logged first: an HTTP client that leaves now cancels this task at the send.
        log_accepted(request, self.peer, position)
        # A token needs the executor and another pass of the event loop to arrive,
        # so this frame is written before any token frame.
        await self._send({"type": "accepted", "id": request.id, "queue_position": position,
                          "request_id": request.request_id, "cancel_token": request.cancel_token})

    # Sink ------------------------------------------------------------------------

    def started(self, request: Request) -> None:
        self.protocol.started(request, time.monotonic_ns())

    async def deliver(self, request: Request, texts: list[str]) -> None:
        for text in texts:
            frame = self.protocol.token(request, text, time.monotonic_ns())
            # A stalled client gets no more tokens; everyone else gets every token generated.
            if frame is not None and request.cancel_reason is not Reason.SLOW_CONSUMER:
                await self._send(frame, request)

    async def finish(self, request: Request, ending: Ending) -> None:
        frames = self.protocol.end(request, ending)
        if not frames:
            return
        self.server.registry.end(request, ending)
        self.server.metrics.record_end(ending)
        log_end(request, ending, self.peer)
        for frame in frames:
            await self._send(frame)

    async def _send(self, frame: dict, request: Request | None = None) -> None:
        """Send one frame. A client that stops reading makes this wait; past the
        grace period its request is cancelled with reason slow_consumer."""
        try:
            await asyncio.wait_for(self._write(frame), self.server.config.slow_consumer_grace_s)
        except (ConnectionClosed, ConnectionError):
            pass
        except TimeoutError:
            # The frame stays in the transport buffer; only the wait was cut short.
            targets = [request] if request is not None else list(self.protocol.live.values())
            for target in targets:
                await self.perform(self.protocol.request_cancel(target, Reason.SLOW_CONSUMER, time.monotonic_ns()))

    async def _write(self, frame: dict) -> None:
        await self.websocket.send(encode_frame(frame))


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
