"""Stopline as the benchmark drives it: over its WebSocket, and over its HTTP API (``/v1``)
where a scenario measures that. A cancel is a cancel frame (WebSocket) or a ``DELETE``
from another client (SSE); a closed or dropped connection is seen to stop when
``/metrics`` shows its generation gone. Servers the benchmark starts are
``python -m bench serve`` processes (``bench/servers/serve.py``), each with its event-loop probe."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import aiohttp
from websockets.asyncio.client import connect

from stopline.protocol.vocabulary import TERMINAL_TYPES, Outcome, Reason

from ..launch import ServerProcess
from .base import DEADLINES, DELETE, OPENAI, QUEUE, Driver, End, Lane, Request, Stream

if TYPE_CHECKING:
    import openai

_ids = itertools.count()


def new_id() -> str:
    # Unique for the whole run, so that a request can be found in the server's log.
    return f"bench-{next(_ids)}-{time.monotonic_ns() % 10**9}"


def fields(request: Request) -> dict:
    """A generate frame's fields, or an HTTP body's."""
    body = {k: getattr(request, k) for k in ("messages", "max_tokens", "temperature", "seed")}
    return body | {k: getattr(request, k) for k in ("timeout_s", "ttft_timeout_s") if getattr(request, k) is not None}


def end_of(terminal: dict, now_ns: int) -> End:
    """A terminal message, read."""
    n, ttft, duration = terminal.get("tokens_generated") or 0, terminal.get("ttft_ms"), terminal.get("duration_ms")
    decoding = duration - ttft if ttft is not None and duration is not None and n > 1 and duration > ttft else None
    prompt, reused = terminal.get("prompt_tokens"), terminal.get("prompt_tokens_reused", 0)
    return End(
        outcome=terminal["type"],
        reason=terminal.get("reason"),
        stop_ns=now_ns,
        tokens_generated=terminal.get("tokens_generated"),
        tokens_after_cancel=terminal.get("tokens_after_cancel"),
        server_ms=terminal.get("cancel_latency_ms"),
        prompt_tokens=prompt,
        prompt_tokens_reused=reused,
        ttft_server_ms=ttft,
        duration_ms=duration,
        step_ms=decoding / (n - 1) if decoding else None,
        decode_tokens_per_s_server=(n - 1) / (decoding / 1e3) if decoding else None,
        prompt_tokens_per_s_server=(prompt - reused) / (ttft / 1e3) if ttft and prompt else None,
    )


class StoplineStream(Stream):
    def __init__(self, driver: StoplineDriver, request: Request):
        super().__init__(request)
        self.driver = driver
        self.gone_ns = 0  # when the client closed or dropped its connection
        # Figures of the stop that only the client side saw, for its End's extra.
        self.notes: dict = {}

    def _frame(self, now_ns: int, frame: dict) -> None:
        kind = frame.get("type")
        if kind == "token":
            self._token(now_ns, frame["text"])
        elif kind == "accepted":
            self.accepted, self.accepted_ns = frame, now_ns
            self.id = frame.get("request_id") if self.id is None else self.id
            self._changed.set()
        elif kind in TERMINAL_TYPES:
            self._finish(end_of(frame, now_ns))

    async def stopped(self, others: int = 0) -> End:
        if self.gone_ns:
            # No answer comes on a closed connection: /metrics shows the generation gone.
            end = await self.driver.until_idle(self.gone_ns, others)
        else:
            end = await self.wait_end() or End(Outcome.ERROR, None, time.monotonic_ns())
        end.extra.update(self.notes)
        return end

    def _gone(self) -> int:
        self.gone_ns = time.monotonic_ns()
        return self.gone_ns


class WebSocketStream(StoplineStream):
    lane: WebSocketLane

    async def cancel(self) -> int:
        message = json.dumps({"type": "cancel", "id": self.id})
        sent_ns = time.monotonic_ns()
        await self.lane.ws.send(message)
        return sent_ns

    def drop(self) -> int:
        dropped_ns = self._gone()
        self.lane.ws.transport.abort()
        return dropped_ns


class WebSocketLane(Lane):
    """One WebSocket connection; frames go to their stream by id."""

    def __init__(self, driver: StoplineDriver, ws):
        self.driver, self.ws = driver, ws
        self.streams: dict[str, WebSocketStream] = {}
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, driver: StoplineDriver) -> WebSocketLane:
        # No compression: the frames are tiny, and it would only add CPU on both sides.
        ws = await connect(
            driver.ws_url, compression=None, max_size=1 << 20, open_timeout=30, additional_headers=driver.headers
        )
        await ws.recv()  # hello
        return cls(driver, ws)

    async def _read(self) -> None:
        try:
            async for message in self.ws:
                now = time.monotonic_ns()
                frame = json.loads(message)
                if (stream := self.streams.get(frame.get("id"))) is not None:
                    stream._frame(now, frame)
                    if stream.end is not None:
                        del self.streams[stream.id]
        except Exception:
            pass
        finally:
            for stream in self.streams.values():
                stream.closed = True
                stream._changed.set()

    async def generate(self, request: Request) -> Stream:
        stream = WebSocketStream(self.driver, request)
        stream.lane, stream.id = self, new_id()
        self.streams[stream.id] = stream
        message = json.dumps({"type": "generate", "id": stream.id, **fields(request)})
        stream.sent_ns = time.monotonic_ns()
        await self.ws.send(message)
        return stream

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.ws.close(), 5)
        except Exception:
            self.ws.transport.abort()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


async def delete_generation(http: aiohttp.ClientSession, api: str, accepted: dict) -> tuple[str, str | None]:
    """``DELETE /v1/generations/{id}`` with the generation's cancel token: the status it answers,
    and the replica that answered."""
    url = f"{api}/generations/{accepted['request_id']}"
    async with http.delete(url, headers={"Authorization": f"Bearer {accepted['cancel_token']}"}) as response:
        return (await response.json()).get("status"), response.headers.get("X-Stopline-Replica")


class SseStream(StoplineStream):
    lane: SseLane
    response: aiohttp.ClientResponse
    reader: asyncio.Task

    async def cancel(self) -> int:
        """A DELETE from another client, as a second tab or a gateway sends it."""
        await self.wait_accepted()
        assert self.accepted is not None
        sent_ns = time.monotonic_ns()
        await delete_generation(self.lane.other, self.driver.api_url, self.accepted)
        self.notes["delete_answer_ms"] = (time.monotonic_ns() - sent_ns) / 1e6
        return sent_ns

    def drop(self) -> int:
        dropped_ns = self._gone()
        self.response.close()
        return dropped_ns

    async def _read(self) -> None:
        event = None
        try:
            async for raw in self.response.content:
                now, line = time.monotonic_ns(), raw.decode().rstrip("\r\n")
                if line.startswith("event: "):
                    event = line[len("event: ") :]
                elif line.startswith("data: ") and event is not None:
                    self._frame(now, json.loads(line[len("data: ") :]))
        except Exception:
            pass
        finally:
            self._close()


class SseLane(Lane):
    """Generations over Server-Sent Events (``POST /v1/generations``), and another client for DELETE."""

    def __init__(self, driver: StoplineDriver):
        self.driver = driver
        self.owner, self.other = aiohttp.ClientSession(), aiohttp.ClientSession()
        self.streams: list[SseStream] = []

    async def generate(self, request: Request) -> Stream:
        stream = SseStream(self.driver, request)
        stream.lane, stream.sent_ns = self, time.monotonic_ns()
        stream.response = await self.owner.post(f"{self.driver.api_url}/generations", json=fields(request))
        stream.reader = asyncio.create_task(stream._read())
        self.streams.append(stream)
        return stream

    async def close(self) -> None:
        for stream in self.streams:
            stream.reader.cancel()
            stream.response.close()
        await asyncio.gather(*(stream.reader for stream in self.streams), return_exceptions=True)
        await self.owner.close()
        await self.other.close()


class OpenAIStream(StoplineStream):
    """A chat completion streamed by the ``openai`` package; closing the stream is its stop."""

    chunks: openai.AsyncStream
    reader: asyncio.Task

    async def cancel(self) -> int:
        closed_ns = self._gone()
        self.reader.cancel()
        await asyncio.gather(self.reader, return_exceptions=True)
        await self.chunks.close()
        return closed_ns

    def drop(self) -> int:
        raise NotImplementedError("the openai package closes its streams; it does not drop them")

    async def _read(self) -> None:
        try:
            async for chunk in self.chunks:
                now = time.monotonic_ns()
                self.id = chunk.id
                choice = chunk.choices[0] if chunk.choices else None
                if choice and choice.delta.content:
                    self._token(now, choice.delta.content)
                if choice and choice.finish_reason:
                    # finish_reason is OpenAI's word for any end; the stopline field says how it ended.
                    terminal = (chunk.model_extra or {}).get("stopline")
                    self._finish(end_of(terminal, now) if terminal else End(Outcome.DONE, choice.finish_reason, now))
        finally:
            self._close()


class OpenAILane(Lane):
    def __init__(self, driver: StoplineDriver):
        # Imported here: only the HTTP scenarios need it, and a machine without it runs the others.
        import openai

        self.driver = driver
        self.client = openai.AsyncOpenAI(base_url=driver.api_url, api_key="unused", max_retries=0)

    async def generate(self, request: Request) -> Stream:
        stream = OpenAIStream(self.driver, request)
        body = {k: v for k, v in fields(request).items() if not k.endswith("timeout_s")}
        stream.sent_ns = time.monotonic_ns()
        stream.chunks = await self.client.chat.completions.create(model=self.driver.name, stream=True, **body)
        stream.reader = asyncio.create_task(stream._read())
        return stream

    async def close(self) -> None:
        await self.client.close()


async def http_get(base_url: str, path: str, timeout: float = 10.0) -> bytes:
    """GET ``path`` from the WebSocket server's own port, which answers /metrics and /healthz."""
    parts = urlsplit(base_url)
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        try:
            writer.write(f"GET {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nConnection: close\r\n\r\n".encode())
            head = (await reader.readuntil(b"\r\n\r\n")).split(b"\r\n")
            length = next((int(h.split(b":", 1)[1]) for h in head if h.lower().startswith(b"content-length:")), None)
            body = await (reader.readexactly(length) if length is not None else reader.read())
        finally:
            writer.close()
    if int(head[0].split(b" ", 2)[1]) != 200:
        raise RuntimeError(f"GET {path}: {head[0].decode()}")
    return body


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {sample name without labels: sum over label sets}."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            name = key.partition("{")[0]
            totals[name] = totals.get(name, 0.0) + float(value)
    return totals


class StoplineDriver(Driver):
    """A Stopline server that is already running, at ``ws_url``."""

    capabilities = frozenset({QUEUE, DEADLINES, OPENAI, DELETE})

    def __init__(self, name: str, slots: int = 2, ws_url: str = "", api_url: str = "", key: str | None = None):
        super().__init__(name, slots)
        self.ws_url, self.api_url = ws_url, api_url
        self.headers = {"Authorization": f"Bearer {key}"} if key else None

    @property
    def http_url(self) -> str:
        return self.ws_url.replace("ws", "http", 1).removesuffix("/ws")

    @classmethod
    async def attach(cls, url: str) -> StoplineDriver:
        parts = urlsplit(url if "://" in url else f"ws://{url}")
        secure = "s" if parts.scheme in ("wss", "https") else ""
        driver = cls("server", ws_url=f"ws{secure}://{parts.netloc}/ws")
        health = await driver.healthz()
        driver.slots, driver.api_url = int(health["slots"]), health["http_api"]
        return driver

    async def healthz(self) -> dict:
        return json.loads(await http_get(self.http_url, "/healthz"))

    async def metrics(self) -> dict[str, float]:
        return parse_metrics((await http_get(self.http_url, "/metrics")).decode())

    async def lane(self, index: int = 0, transport: str = "") -> Lane:
        if transport == OPENAI:
            return OpenAILane(self)
        return SseLane(self) if transport == DELETE else await WebSocketLane.open(self)

    async def wait_idle(self, timeout: float = 120.0) -> None:
        async with asyncio.timeout(timeout):
            while True:
                m = await self.metrics()
                if m.get("stopline_active_generations", 0.0) == 0 and m.get("stopline_queue_depth", 0.0) == 0:
                    return
                await asyncio.sleep(0.01)

    async def until_idle(self, since_ns: int, others: int = 0) -> End:
        """Poll /metrics until only ``others`` generations are active: the end of one whose client left."""
        polls = 0
        while True:
            sent_ns = time.monotonic_ns()
            active = (await self.metrics()).get("stopline_active_generations", 0.0)
            seen_ns = time.monotonic_ns()
            polls += 1
            if active <= others:
                break
            # A short pause keeps the polling itself from loading the server it measures.
            await asyncio.sleep(0.001)
        # It stopped between this poll's request and its answer: the answer is an upper bound.
        extra = {"lower_bound_ms": (sent_ns - since_ns) / 1e6, "polls": polls}
        return End(Outcome.CANCELLED, Reason.CLIENT_DISCONNECTED, seen_ns, extra=extra)


class ServedStopline(StoplineDriver):
    """A ``python -m bench serve`` process: Stopline on one of the bench's engines (``bench/servers/serve.py``)."""

    def __init__(
        self,
        engine: str,
        out_dir: Path,
        workers: int,
        threads: int,
        name: str | None = None,
        extra_args: tuple[str, ...] = (),
        model: Path | None = None,
        cpus: frozenset[int] | None = None,
    ):
        super().__init__(name or engine, workers)
        self.engine, self.cpus = engine, cpus
        self.log_path = out_dir / f"server-{self.name}.log"
        self.lag_path = out_dir / f"lag-{self.name}.json"
        self.stderr_path = out_dir / f"server-{self.name}.stderr"
        self.args = ("serve", "--engine", engine, "--workers", str(workers), "--threads", str(threads))
        self.args += ("--lag-out", str(self.lag_path), "--log-file", str(self.log_path))
        self.args += (("--model", str(model)) if model is not None else ()) + extra_args
        self.process: ServerProcess | None = None

    async def start(self) -> ServedStopline:
        for path in (self.log_path, self.lag_path):
            path.unlink(missing_ok=True)
        self.process = ServerProcess(
            *self.args, module="bench", stderr_path=self.stderr_path, cpus=self.cpus, keep_stdin=True
        )
        await self.process.started()
        self.pid, self.info = self.process.pid, self.process.start_record
        self.ws_url, self.api_url = self.process.ws_url, self.process.api_url
        return self

    async def stop(self, sig: int | None = None) -> None:
        """Shut the server down: its stdin closed, or ``sig`` sent, as an operator's stop would."""
        if self.process is None or self.process.returncode is not None:
            return
        self.process.pause(False)  # a paused process cannot act on its stdin's end, or on a signal
        if sig is None:
            self.process.close_stdin()  # the server's signal to shut down
        else:
            self.process.send_signal(sig)
        try:
            await self.process.ended(60)
        except subprocess.TimeoutExpired:
            self.process.kill()

    def pause(self, paused: bool) -> None:
        if self.process is not None:
            self.process.pause(paused)

    def lag_samples(self) -> list[tuple[int, int]]:
        if not self.lag_path.is_file():
            return []
        return [tuple(s) for s in json.loads(self.lag_path.read_text())["samples"]]

    def request_log(self) -> dict[str, dict]:
        ends = {}
        for line in self.log_path.read_text().splitlines() if self.log_path.is_file() else ():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            event = record.get("event", "")
            if event.startswith("generation_") and event != "generation_accepted" and "request_id" in record:
                # The id the client chose (for HTTP requests, the server-global request id).
                ends[record.get("id", record["request_id"])] = record
        return ends
