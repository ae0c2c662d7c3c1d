"""Helpers the tests share: prompts, native generations, real servers on port 0 and real
WebSocket clients, log capture, metrics and polling. Plain functions and classes; the
fixtures are in conftest.py.

Every wait in the tests is a multiple of ``UNIT`` seconds; set
STOPLINE_TEST_TIME_SCALE to stretch them all on a slow machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence

import aiohttp
import openai
from websockets.asyncio.client import connect

from stopline._core import Generation, GenerationState
from stopline.app import StoplineServer
from stopline.engine.loop import Engine
from stopline.protocol.requests import SamplingParams
from stopline.protocol.vocabulary import TERMINAL_TYPES
from stopline.settings import Settings

UNIT = float(os.environ.get("STOPLINE_TEST_TIME_SCALE", "1"))

# Greedy and unpenalized (the defaults), the embedded model answers "Paris" to this question; asked
# only "What is the capital of France?", it wanders off in French.
CHAT_FRANCE = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
# A prompt that keeps the model talking for hundreds of tokens.
LONG_ANSWER = [{"role": "user", "content": "Write a very long story about a dragon who learns to bake bread."}]


# Generation's arguments that are not sampling parameters.
LOOP_OPTIONS = (
    "prefill_chunk",
    "threads",
    "window",
    "deadline_ns",
    "first_token_deadline_ns",
    "step_abort",
    "trim_output",
    "urgent",
)


def make_generation(slot, prompt: list[int], **kwargs) -> Generation:
    """A native Generation whose sampling arguments come from ``SamplingParams``
    (``kwargs`` that name its fields; seed 0 unless given), the loop options as given."""
    options = {name: kwargs.pop(name) for name in LOOP_OPTIONS if name in kwargs}
    return Generation(slot, prompt, SamplingParams(**{"seed": 0, **kwargs}), **options)


def started_running(generation: Generation, timeout_s: float = 60) -> None:
    """Wait until ``generation``'s loop runs on its thread, so that a wait measured
    from here is a wait into the loop's own work, whenever the thread got a core."""
    deadline = time.monotonic() + timeout_s * UNIT
    while generation.state is not GenerationState.RUNNING:
        assert not generation.finished, "the loop ended before it was seen running"
        assert time.monotonic() < deadline, "the loop never started"
        time.sleep(0.001)


class LogCapture(io.TextIOBase):
    """Collects the JSON log lines the service writes."""

    def __init__(self):
        self.lines: list[str] = []
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self.lines.extend(line for line in text.splitlines() if line.strip())
        return len(text)

    def records(self, event: str | None = None, **match) -> list[dict]:
        with self._lock:
            records = [json.loads(line) for line in self.lines]
        return [
            r
            for r in records
            if (event is None or r["event"] == event) and all(r.get(k) == v for k, v in match.items())
        ]

    def clear(self) -> None:
        with self._lock:
            self.lines.clear()


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@contextlib.asynccontextmanager
async def running_server(engine: Engine, *, others: Sequence[Engine] = (), **config):
    """A real Stopline server on 127.0.0.1, port 0, torn down and checked for leaks; ``others``:
    the models it serves after ``engine``'s (several --model)."""
    threads_before = {t.ident for t in threading.enumerate()}
    # Each server's prompt cache keeps its disk tier apart, unless a test shares one.
    own_dir = None if "prompt_cache_dir" in config else tempfile.mkdtemp(prefix="stopline-prompt-cache-")
    if own_dir is not None:
        config["prompt_cache_dir"] = own_dir
    server = StoplineServer(engine, Settings.build(**{"host": "127.0.0.1", "port": 0, **config}), others=others)
    await server.start()
    server.ws_url = f"ws://127.0.0.1:{server.port}/ws"
    server.http_url = f"http://127.0.0.1:{server.port}"
    try:
        yield server
    finally:
        await server.shutdown()
        assert server.active == 0 and server.queued == 0
        # Slot worker threads end with the server.
        leftover = [t for t in threading.enumerate() if t.ident not in threads_before and t.is_alive()]
        assert not [t.name for t in leftover if t.name.startswith("stopline")], leftover
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)


class Client:
    """A thin test client over a real WebSocket connection."""

    def __init__(self, websocket):
        self.ws = websocket
        self.hello: dict | None = None
        self.frames: list[dict] = []

    async def send(self, frame) -> None:
        await self.ws.send(frame if isinstance(frame, (str, bytes)) else json.dumps(frame))

    async def recv(self, timeout: float = 30.0) -> dict:
        frame = json.loads(await asyncio.wait_for(self.ws.recv(), timeout * UNIT))
        self.frames.append(frame)
        return frame

    async def recv_until(self, predicate, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout * UNIT
        while True:
            frame = await self.recv(max(0.01, deadline - time.monotonic()))
            if predicate(frame):
                return frame

    async def terminal(self, request_id: str, timeout: float = 60.0) -> dict:
        return await self.recv_until(lambda f: f["type"] in TERMINAL_TYPES and f.get("id") == request_id, timeout)

    async def generate(self, request_id: str, **fields) -> dict:
        """Send a generate frame and return its accepted (or error) answer."""
        await self.send({"type": "generate", "id": request_id, **fields})
        return await self.recv_until(lambda f: f.get("id") == request_id and f["type"] in ("accepted", "error"))

    def tokens(self, request_id: str) -> list[dict]:
        return [f for f in self.frames if f["type"] == "token" and f["id"] == request_id]


@contextlib.asynccontextmanager
async def client_for(server, **kwargs):
    async with connect(server.ws_url, **kwargs) as websocket:
        client = Client(websocket)
        client.hello = json.loads(await websocket.recv())
        yield client


def metric_value(text: str, name: str, **labels) -> float:
    """Read one sample from Prometheus text exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        key, _, value = line.rpartition(" ")
        if "{" in key:
            metric, _, label_text = key.partition("{")
            found = dict(part.split("=", 1) for part in label_text.rstrip("}").split(",") if part)
            found = {k: v.strip('"') for k, v in found.items()}
        else:
            metric, found = key, {}
        if metric == name and all(found.get(k) == v for k, v in labels.items()):
            total += float(value)
    return total


async def http_get(server, path: str, headers: dict | None = None) -> tuple[int, str]:
    """A plain HTTP/1.1 GET against the server's port."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n{extra}Connection: close\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    await writer.wait_closed()
    head, _, body = data.decode("utf-8", "replace").partition("\r\n\r\n")
    return int(head.split()[1]), body


async def fetch_metrics(server) -> str:
    status, body = await http_get(server, "/metrics")
    assert status == 200
    return body


def decode_step_ms(record: dict) -> float:
    """A request's mean decode step, from its end-of-request log record: the unit for
    bounds on how late something may happen, which grows with the machine's load."""
    assert record["tokens_generated"] >= 2, record
    return (record["duration_ms"] - record["ttft_ms"]) / (record["tokens_generated"] - 1)


async def wait_for(predicate, timeout: float = 10.0, interval: float = 0.01):
    """Poll ``predicate`` (sync or async) until it returns something truthy."""
    deadline = time.monotonic() + timeout * UNIT
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {predicate}")
        await asyncio.sleep(interval)


def openai_client(server, timeout: float = 120) -> openai.AsyncOpenAI:
    """The real ``openai`` package's client for the server's OpenAI-compatible API (``timeout`` seconds, times UNIT)."""
    return openai.AsyncOpenAI(base_url=server.http.base_url, api_key="unused", max_retries=0, timeout=timeout * UNIT)


async def sse_events(response: aiohttp.ClientResponse):
    """(event, data) pairs of a text/event-stream response."""
    event, data = None, []
    async for raw in response.content:
        line = raw.decode().rstrip("\r\n")
        if not line:
            if event is not None:
                yield event, json.loads("\n".join(data))
            event, data = None, []
        elif line.startswith("event: "):
            event = line[len("event: ") :]
        elif line.startswith("data: "):
            data.append(line[len("data: ") :])


async def delete(http, server, request_id: str, token: str | None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with http.delete(f"{server.http.base_url}/generations/{request_id}", headers=headers) as response:
        return response.status, await response.json()


async def cancelled_records(logs, request_id: str) -> list[dict]:
    """The generation_cancelled records of ``request_id``, once there are any."""
    for _ in range(int(200 * UNIT)):
        records = logs.records("generation_cancelled", request_id=request_id)
        if records:
            return records
        await asyncio.sleep(0.05)
    raise AssertionError(f"{request_id} did not end")
