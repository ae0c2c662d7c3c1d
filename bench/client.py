"""A benchmark client for the Stopline protocol: real WebSockets, every frame time-stamped.

Each received frame is stamped with ``time.monotonic_ns()`` the moment the
reader task gets it, before any parsing by the caller, so client-observed
latencies are taken as close to the socket as asyncio allows.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from urllib.parse import urlsplit

from websockets.asyncio.client import ClientConnection, connect

from stopline.protocol.vocabulary import TERMINAL_TYPES

_ids = itertools.count()


def new_id(prefix: str) -> str:
    # Unique for the whole run, so a request can be found in the server's log.
    return f"{prefix}-{next(_ids)}-{time.monotonic_ns() % 10**9}"


class Call:
    """One request on a connection: its frames as they arrive, each with its arrival time."""

    def __init__(self, request_id: str):
        self.id = request_id
        self.sent_ns = 0
        self.accepted: dict | None = None
        self.accepted_ns = 0
        self.tokens: list[tuple[int, dict]] = []
        self.terminal: dict | None = None
        self.terminal_ns = 0
        self._changed = asyncio.Event()

    def _add(self, now_ns: int, frame: dict) -> None:
        kind = frame["type"]
        if kind == "token":
            self.tokens.append((now_ns, frame))
        elif kind == "accepted":
            self.accepted, self.accepted_ns = frame, now_ns
        elif kind in TERMINAL_TYPES:
            self.terminal, self.terminal_ns = frame, now_ns
        self._changed.set()

    @property
    def ended(self) -> bool:
        return self.terminal is not None

    async def wait_for(self, predicate, timeout: float = 120.0) -> None:
        """Wait until ``predicate(self)`` holds or the request has ended."""
        async with asyncio.timeout(timeout):
            while not (predicate(self) or self.ended):
                self._changed.clear()
                await self._changed.wait()

    async def wait_accepted(self, timeout: float = 60.0) -> None:
        await self.wait_for(lambda c: c.accepted is not None, timeout)

    async def wait_tokens(self, count: int, timeout: float = 120.0) -> None:
        await self.wait_for(lambda c: len(c.tokens) >= count, timeout)

    async def wait_end(self, timeout: float = 300.0) -> dict:
        await self.wait_for(lambda c: c.ended, timeout)
        return self.terminal


class Session:
    """One WebSocket connection; frames are routed to their :class:`Call` by id."""

    def __init__(self, websocket: ClientConnection):
        self.ws = websocket
        self.hello: dict | None = None
        self.calls: dict[str, Call] = {}
        self.errors: list[dict] = []
        self._reader: asyncio.Task | None = None

    @classmethod
    async def open(cls, url: str) -> Session:
        # No compression: the server's frames are tiny, and it would only add CPU on both sides.
        websocket = await connect(url, compression=None, max_size=1 << 20, open_timeout=30)
        session = cls(websocket)
        session.hello = json.loads(await websocket.recv())
        session._reader = asyncio.create_task(session._read())
        return session

    async def _read(self) -> None:
        try:
            async for message in self.ws:
                now = time.monotonic_ns()
                frame = json.loads(message)
                call = self.calls.get(frame.get("id"))
                if call is not None:
                    call._add(now, frame)
                else:
                    self.errors.append(frame)
        except Exception:
            pass
        finally:
            for call in self.calls.values():
                call._changed.set()

    async def generate(self, prefix: str, **fields) -> Call:
        call = Call(new_id(prefix))
        self.calls[call.id] = call
        message = json.dumps({"type": "generate", "id": call.id, **fields})
        call.sent_ns = time.monotonic_ns()
        await self.ws.send(message)
        return call

    async def cancel(self, call: Call) -> int:
        """Send a cancel for ``call``; returns when it was sent (monotonic ns)."""
        message = json.dumps({"type": "cancel", "id": call.id})
        sent = time.monotonic_ns()
        await self.ws.send(message)
        return sent

    def forget(self, call: Call) -> None:
        self.calls.pop(call.id, None)

    def drop(self) -> int:
        """Drop the TCP connection without a closing handshake, as a crashed or vanished client does."""
        now = time.monotonic_ns()
        self.ws.transport.abort()
        return now

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.ws.close(), 5)
        except Exception:
            self.ws.transport.abort()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)


async def http_get(base_url: str, path: str, timeout: float = 10.0) -> bytes:
    """GET ``path`` from the server's own port (it answers /metrics and /healthz over plain HTTP)."""
    parts = urlsplit(base_url)
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        try:
            writer.write(f"GET {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nConnection: close\r\n\r\n".encode())
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = next(
                (
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                ),
                None,
            )
            body = await (reader.readexactly(length) if length is not None else reader.read())
        finally:
            writer.close()
    if status != 200:
        raise RuntimeError(f"GET {path}: HTTP {status}")
    return body


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {sample name without labels: sum over label sets}."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        name = key.partition("{")[0]
        totals[name] = totals.get(name, 0.0) + float(value)
    return totals


async def metrics(base_url: str) -> dict[str, float]:
    return parse_metrics((await http_get(base_url, "/metrics")).decode())


async def healthz(base_url: str) -> dict:
    return json.loads(await http_get(base_url, "/healthz"))
