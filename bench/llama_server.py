"""llama.cpp's llama-server as a peer engine ("llama-server") in the benchmark.

The benchmark starts the binary (``--llama-server PATH``, or one built by
``--build-llama-server``: :func:`ensure_llama_server`, below) on the same GGUF file
the other engines load, with the same context per slot, slots and sampling, as
many compute threads in all as ours has (slots × threads per slot), on the same
cores, and maps the scenarios onto its HTTP API (``POST /completion`` with
the prompt as token ids, so every engine evaluates exactly the same tokens):

* llama-server has no cancel request: a stop is the client closing the
  connection, during the prompt, during decode, or while waiting for a
  non-streaming answer.
* "Stopped" is the moment its slot goes idle. That is read from the server's
  own log line for the slot's release (``slot release: id N | task T | stop
  processing``), stamped when it arrives on the pipe from its stderr, and then
  confirmed on ``GET /slots``. The slot is pinned per request (``id_slot``), so
  the line is known to be this request's. Polling ``/slots`` in a loop is not
  used to find the moment: every ``/slots`` answer is a result on the server's
  shared result queue, and each one restarts the one-second wait after which a
  request handler checks whether its client is still there, so the probe would
  keep the server from ever noticing a disconnect that produces no output.

The HTTP client here is a few lines over asyncio streams, so that a request can
be dropped exactly (FIN for a closed stream, RST for a vanished client) and
every event can be stamped on arrival.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from stopline.engine.llama_build import BUILD_KEY, SOURCE_LABEL, LlamaBuildError, build_root, build_unedited
from stopline.protocol.requests import DEFAULT_SAMPLING
from stopline.protocol.vocabulary import Outcome, Reason

from .scenarios import (
    CONCURRENT_OTHER_TOKENS,
    CONCURRENT_STREAMS,
    DECODE_CONCURRENT,
    LONG_GENERATION,
    LONG_SCENARIOS,
    MAX_FRAMES_BEFORE_STOP,
    TURN_TOKENS,
    TURNS,
    Bench,
    share,
    share_range,
    sleep_until,
)
from .servers import Target, confine_to, load_average

ENGINE = "llama-server"
# Scenarios that only this engine runs: a non-streaming request whose client goes away.
NONSTREAM = "nonstream"
# A client goes away while another client streams (ours: a dropped WebSocket; llama-server: a
# non-streaming request, the case where its handler waits without writing anything).
DISCONNECT_BUSY = "disconnect_busy"
SUPPORTED = (
    "prefill_short",
    "prefill_long",
    "decode",
    "decode_after_token",
    DECODE_CONCURRENT,
    "throughput",
    "prefill_speed",
    "multi_turn",
    "disconnect",
    NONSTREAM,
    DISCONNECT_BUSY,
)
# How a finished llama-server request says it ended on its own (end of sequence, a stop word).
_ENDED_ON_ITS_OWN = ("eos", "word")
# Bounds each sample in which llama-server never notices the client left: it runs to n_predict.
BUSY_MAX_TOKENS = 256

_LISTENING = re.compile(r"listening on http://[^:]+:(\d+)")
_RELEASE = re.compile(r"slot\s+release: id\s+(\d+) \| task (-?\d+) \| stop processing: n_tokens = (\d+)")


# The server process -------------------------------------------------------------------


@dataclass
class Release:
    slot: int
    task: int
    n_tokens: int  # prompt + generated tokens in the slot's context when it stopped
    seen_ns: int  # when the log line arrived


class LlamaServer:
    """A llama-server process on 127.0.0.1 and a free port, its log watched line by line."""

    engine = ENGINE

    def __init__(
        self,
        binary: Path,
        model: Path,
        out_dir: Path,
        slots: int,
        threads: int,
        context_length: int,
        cpus: frozenset[int] | None = None,
    ):
        """``threads``: compute threads of the whole process, shared by its slots."""
        self.binary = Path(binary)
        self.cpus = cpus
        self.model = Path(model)
        self.slots = slots
        self.threads = threads
        self.context_length = context_length
        self.log_path = out_dir / "server-llama-server.log"
        self.info: dict = {}
        self.pid: int | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task | None = None
        self._releases: dict[int, asyncio.Queue[Release]] = {}

    def command(self) -> list[str]:
        return [
            str(self.binary),
            "--model",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--parallel",
            str(self.slots),
            "--ctx-size",
            str(self.context_length * self.slots),
            "--no-kv-unified",  # each slot gets its own context of context_length tokens
            "--threads",
            str(self.threads),
            "--threads-batch",
            str(self.threads),
            "--slots",
            "--metrics",
            "--cache-ram",
            "0",
            "--fit",
            "off",
            "--log-colors",
            "off",
        ]

    async def start(self) -> Target:
        self._releases = {slot: asyncio.Queue() for slot in range(self.slots)}
        self._process = await asyncio.create_subprocess_exec(
            *self.command(),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            preexec_fn=confine_to(self.cpus),
        )
        self.pid = self._process.pid
        port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._reader = asyncio.create_task(self._read_log(port))
        try:
            async with asyncio.timeout(300):
                done, _ = await asyncio.wait([port, self._reader], return_when=asyncio.FIRST_COMPLETED)
                if not port.done():
                    raise RuntimeError(
                        f"llama-server exited during start-up; see {self.log_path}:\n"
                        + self.log_path.read_text()[-2000:]
                    )
                url = f"http://127.0.0.1:{port.result()}"
                while (await _get(url, "/health", check=False))[0] != 200:  # 503 while the model loads
                    await asyncio.sleep(0.05)
        except BaseException:
            await self.stop()
            raise
        self.info = {
            "port": port.result(),
            "engine": ENGINE,
            "threads": self.threads,
            "workers": self.slots,
            "prefill_chunk": "512 (ubatch)",
            "source": await self._source(),
            # As a reader would type it: the model by its file name.
            "command": ["llama-server"] + [self.model.name if a == str(self.model) else a for a in self.command()[1:]],
        }
        return Target(ENGINE, "", url, slots=self.slots, managed=self)

    async def _source(self) -> str:
        """Which llama.cpp this is: its --version line, and where the benchmark built it from."""
        process = await asyncio.create_subprocess_exec(
            str(self.binary), "--version", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        try:
            output = (await asyncio.wait_for(process.communicate(), 60))[0].decode(errors="replace")
        except TimeoutError:
            process.kill()
            await process.wait()
            output = ""
        version = next((line.strip() for line in output.splitlines() if line.startswith("version")), "version unknown")
        built_here = self.binary.resolve() == llama_server_binary().resolve()
        return f"{SOURCE_LABEL}, {version}" if built_here else version

    async def _read_log(self, port: asyncio.Future) -> None:
        with open(self.log_path, "w") as log:
            while line := await self._process.stderr.readline():
                now = time.monotonic_ns()
                text = line.decode(errors="replace")
                log.write(text)
                if m := _RELEASE.search(text):
                    slot = int(m.group(1))
                    if slot in self._releases:
                        self._releases[slot].put_nowait(Release(slot, int(m.group(2)), int(m.group(3)), now))
                elif not port.done() and (m := _LISTENING.search(text)):
                    port.set_result(int(m.group(1)))

    def forget_releases(self, slot: int) -> None:
        queue = self._releases[slot]
        while not queue.empty():
            queue.get_nowait()

    async def next_release(self, slot: int, timeout: float = 300.0) -> Release:
        async with asyncio.timeout(timeout):
            return await self._releases[slot].get()

    async def stop(self) -> None:
        if self._process is not None and self._process.returncode is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self._process.wait(), 30)
            except TimeoutError:
                self._process.kill()
                await self._process.wait()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    def pause(self, paused: bool) -> None:
        """Stop (SIGSTOP) or continue (SIGCONT) the process while another engine is measured."""
        if self._process is not None and self._process.returncode is None:
            os.kill(self._process.pid, signal.SIGSTOP if paused else signal.SIGCONT)

    # What bench/__main__.py asks of a started server; llama-server has no Python event loop to probe.
    def request_log(self) -> dict[str, dict]:
        return {}

    def lag_samples(self) -> list[tuple[int, int]]:
        return []


# A small HTTP/1.1 client --------------------------------------------------------------------


async def _get(base_url: str, path: str, check: bool = True) -> tuple[int, bytes]:
    host, port = base_url.rsplit("/", 1)[-1].split(":")
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
    except OSError:
        if check:
            raise
        return 0, b""
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
        status, headers = await _read_head(reader)
        body = await _read_body(reader, headers)
    finally:
        writer.close()
    if check and status != 200:
        raise RuntimeError(f"GET {path}: HTTP {status}: {body[:200]!r}")
    return status, body


async def get_json(base_url: str, path: str):
    return json.loads((await _get(base_url, path))[1])


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = {}
    for line in head[1:]:
        if ":" in line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return int(head[0].split(" ", 2)[1]), headers


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding", "").lower() == "chunked":
        return b"".join([chunk async for chunk in _chunks(reader)])
    return await reader.read()


async def _chunks(reader: asyncio.StreamReader):
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return
        data = await reader.readexactly(size)
        await reader.readexactly(2)
        yield data


class Completion:
    """One ``POST /completion`` on its own connection; streamed events are stamped on arrival."""

    def __init__(self):
        self.sent_ns = 0
        self.prompt: list[int] = []
        self.events: list[tuple[int, dict]] = []  # (arrival ns, event) of every streamed event
        self.tokens: list[tuple[int, dict]] = []  # the events that carried generated tokens
        self.final: dict | None = None  # the event (or non-streamed answer) with "stop": true
        self.final_ns = 0
        self.closed = False
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._changed = asyncio.Event()

    @classmethod
    async def start(cls, base_url: str, body: dict) -> Completion:
        host, port = base_url.rsplit("/", 1)[-1].split(":")
        call = cls()
        call.prompt = body.get("prompt", [])
        reader, call._writer = await asyncio.open_connection(host, int(port))
        payload = json.dumps(body).encode()
        call.sent_ns = time.monotonic_ns()
        call._writer.write(
            f"POST /completion HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        call._reader_task = asyncio.create_task(call._read(reader, bool(body.get("stream"))))
        return call

    async def _read(self, reader: asyncio.StreamReader, stream: bool) -> None:
        try:
            status, headers = await _read_head(reader)
            if not stream or status != 200:
                answer = json.loads(await _read_body(reader, headers))
                self._end(answer if status == 200 else {"stop": True, "error": answer})
                return
            pending = b""
            chunks = _chunks(reader) if headers.get("transfer-encoding", "").lower() == "chunked" else _raw(reader)
            async for data in chunks:
                now = time.monotonic_ns()
                pending += data
                # Server-sent events: "data: {...}" lines, each event ended by a blank line.
                while b"\n\n" in pending:
                    block, pending = pending.split(b"\n\n", 1)
                    for line in block.split(b"\n"):
                        if line.startswith(b"data: "):
                            self._event(now, json.loads(line[6:]))
        except (OSError, EOFError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            self.closed = True
            self._changed.set()

    def _event(self, now_ns: int, event: dict) -> None:
        self.events.append((now_ns, event))
        if event.get("tokens") or event.get("content"):
            self.tokens.append((now_ns, event))
        if event.get("stop"):
            self.final, self.final_ns = event, now_ns
        self._changed.set()

    def _end(self, answer: dict) -> None:
        self.final, self.final_ns = answer, time.monotonic_ns()
        self._changed.set()

    @property
    def ended(self) -> bool:
        return self.final is not None or self.closed

    async def wait_for(self, predicate, timeout: float = 300.0) -> None:
        async with asyncio.timeout(timeout):
            while not (predicate(self) or self.ended):
                self._changed.clear()
                await self._changed.wait()

    async def wait_tokens(self, count: int) -> None:
        await self.wait_for(lambda c: len(c.tokens) >= count)

    async def wait_end(self) -> dict | None:
        await self.wait_for(lambda c: False)
        return self.final

    def close(self) -> int:
        """Close the connection (FIN), as a client that stops reading does; returns when (monotonic ns)."""
        now = time.monotonic_ns()
        self._writer.close()
        return now

    def drop(self) -> int:
        """Reset the connection (RST), as a vanished client does."""
        now = time.monotonic_ns()
        self._writer.transport.abort()
        return now

    async def dispose(self) -> None:
        if not self._writer.is_closing():
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
            await asyncio.gather(self._reader_task, return_exceptions=True)


async def _raw(reader: asyncio.StreamReader):
    while data := await reader.read(65536):
        yield data


# The scenarios ----------------------------------------------------------------------------


@dataclass
class _Stopped:
    """What became of a request after its client went away."""

    client_ms: float  # close -> its slot released (log line arrived)
    confirm_ms: float  # close -> a /slots answer showing the slot idle
    tokens_after_close: int  # tokens generated after the client closed
    generated: int  # tokens generated in all
    prompt_evaluated: int  # prompt tokens evaluated
    ran_to_end: bool = False  # it generated everything it was asked for: the close was never noticed
    extra: dict = field(default_factory=dict)


class LlamaBench(Bench):
    """The benchmark's scenarios against llama-server; samples in the same shape as :class:`Bench`'s."""

    def supports(self, scenario: str) -> bool:
        return scenario in SUPPORTED

    def _body(
        self,
        tokens: int,
        max_tokens: int,
        slot: int,
        stream: bool = True,
        messages: list[dict] | None = None,
        cache_prompt: bool = False,
    ) -> dict:
        fields = self._generate_fields(tokens, max_tokens)
        if messages is not None:
            fields["messages"] = messages
        prompt = self.prompts.tokenizer.encode(self.prompts.tokenizer.render_chat(fields["messages"]))
        # Ours' sampling (Stopline's defaults), and no llama.cpp-only sampler (min_p).
        ours = DEFAULT_SAMPLING
        return {
            "prompt": prompt,
            "n_predict": max_tokens,
            "stream": stream,
            "seed": fields["seed"],
            "temperature": fields["temperature"],
            "top_k": ours.top_k,
            "top_p": ours.top_p,
            "min_p": 0.0,
            "repeat_penalty": ours.repetition_penalty,
            "repeat_last_n": 64,
            "id_slot": slot,
            # Every prompt is evaluated whole, as on the other engines, but in a chat: there the
            # slot's cache makes a follow-up turn cost only its new tokens, as ours does.
            "cache_prompt": cache_prompt,
        }

    async def _complete(self, target: Target, tokens: int, max_tokens: int, slot: int, stream: bool = True, **body):
        return await Completion.start(target.http_url, self._body(tokens, max_tokens, slot, stream, **body))

    # Calibration ------------------------------------------------------------------

    async def calibrate(self, target: Target, long: bool = True) -> dict:
        plan = self.plan
        for _ in range(2):  # the first run warms up
            call = await self._complete(target, plan.short_tokens, 24, 0)
            short = await call.wait_end()
            await call.dispose()
        timings = short["timings"]
        target.prefill_ms[plan.short_tokens] = timings["prompt_ms"]
        if timings.get("predicted_n", 0) > 0:
            target.step_ms = timings["predicted_ms"] / timings["predicted_n"]
        if long:
            call = await self._complete(target, plan.long_tokens, 1, 0)
            end = await call.wait_end()
            await call.dispose()
            target.prefill_ms[plan.long_tokens] = end["timings"]["prompt_ms"]
        return {"prefill_ms": dict(target.prefill_ms), "step_ms": target.step_ms}

    # The sampling loop ---------------------------------------------------------------

    async def run(self, scenario: str, target: Target, part: int = 0, parts: int = 1) -> None:
        if not self.supports(scenario):
            return
        plan = self.plan
        wanted = share(plan.long_requests if scenario in LONG_SCENARIOS else plan.requests, part, parts)
        if scenario == "multi_turn":
            wanted *= TURNS  # a sample per turn, long_requests chats
        if wanted <= 0 or (scenario == DECODE_CONCURRENT and target.slots < CONCURRENT_STREAMS):
            return
        if self.progress is not None:
            self.progress.set_description(f"{scenario} [{target.name}]")
        start = time.monotonic_ns()
        run = {
            "scenario": scenario,
            "target": target.name,
            "requests": 0,
            "valid": 0,
            "discarded": 0,
            "cpu_before": self.cpu.read() if self.cpu else None,
            "load_average": load_average(),
        }
        await self._wait_idle(target)
        if scenario == "throughput":
            await self._throughput(target, run, share_range(plan.throughput_reps, part, parts))
        elif scenario == DISCONNECT_BUSY:
            await self._busy(target, run, wanted)
        else:
            sample = {
                "prefill_short": lambda t, slot: self._prefill_sample(t, slot, "prefill_short", plan.short_tokens),
                "prefill_long": lambda t, slot: self._prefill_sample(t, slot, "prefill_long", plan.long_tokens),
                "decode": self._decode_sample,
                "decode_after_token": lambda t, slot: self._decode_sample(t, slot, "decode_after_token"),
                DECODE_CONCURRENT: self._concurrent_sample,
                "prefill_speed": self._prefill_speed_sample,
                "multi_turn": self._multi_turn_sample,
                "disconnect": self._disconnect_sample,
                NONSTREAM: self._nonstream_sample,
            }[scenario]
            lanes = min(plan.parallel, target.slots) if scenario in ("prefill_short", "prefill_long", "decode") else 1
            started = time.monotonic()

            async def lane(slot: int):
                while self._more(run, wanted, started):
                    self._keep(scenario, run, await sample(target, slot))

            await asyncio.gather(*(lane(slot) for slot in range(lanes)))
        cpu_before = run.pop("cpu_before")
        if cpu_before is not None:
            run["cpu"] = self.cpu.usage_since(cpu_before)
        target.windows.append((scenario, start, time.monotonic_ns()))
        self.runs.append(run)

    async def _wait_idle(self, target: Target, timeout: float = 300.0) -> None:
        async with asyncio.timeout(timeout):
            while any(s["is_processing"] for s in await get_json(target.http_url, "/slots")):
                await asyncio.sleep(0.01)

    async def _stopped(self, target: Target, call: Completion, slot: int, closed_ns: int, max_tokens: int) -> _Stopped:
        """Wait for the slot's release line, then confirm on /slots that it is idle."""
        release = await target.managed.next_release(slot)
        while release.seen_ns < call.sent_ns:
            # The previous request's release line, logged after its answer was sent: not this one's.
            release = await target.managed.next_release(slot)
        while any(s["id"] == slot and s["is_processing"] for s in await get_json(target.http_url, "/slots")):
            await asyncio.sleep(0.001)
        confirmed_ns = time.monotonic_ns()
        # The slot's context holds the prompt and every sampled token but the last (each is
        # evaluated in the step after it is sampled), so a prompt stopped part-way generated none.
        prompt = len(call.prompt)
        generated = release.n_tokens - prompt + 1 if release.n_tokens >= prompt else 0
        before = call.tokens[-1][1].get("tokens_predicted", len(call.tokens)) if call.tokens else 0
        return _Stopped(
            client_ms=(release.seen_ns - closed_ns) / 1e6,
            confirm_ms=(confirmed_ns - closed_ns) / 1e6,
            tokens_after_close=max(0, generated - before),
            generated=generated,
            prompt_evaluated=min(release.n_tokens, prompt),
            ran_to_end=generated >= max_tokens,
        )

    def _record(
        self, scenario: str, target: Target, call: Completion, closed_ns: int, stopped: _Stopped, reason: str, **extra
    ) -> dict:
        return {
            "scenario": scenario,
            "target": target.name,
            "id": None,
            "outcome": Outcome.DONE if stopped.ran_to_end else Outcome.CANCELLED,
            "reason": reason,
            "client_ms": stopped.client_ms,
            "server_ms": None,
            "slots_confirm_ms": stopped.confirm_ms,
            "tokens_after_cancel": stopped.tokens_after_close,
            "frames_after_cancel": sum(1 for ns, _ in call.tokens if ns > closed_ns),
            "tokens_generated": stopped.generated,
            "token_frames": len(call.tokens),
            "ran_to_end": stopped.ran_to_end,
            # The client is gone in every one of these, so all the work done for it was wasted.
            "tokens_wasted": stopped.prompt_evaluated + stopped.generated,
            "prompt_tokens_evaluated": stopped.prompt_evaluated,
            "log_tokens_generated": stopped.generated,
            **extra,
        }

    async def _prefill_sample(self, target: Target, slot: int, scenario: str, tokens: int) -> list[dict]:
        estimate = target.prefill_ms[tokens]
        delay_ms = self.rng.uniform(0.0, 0.9 * estimate)
        target.managed.forget_releases(slot)
        call = await self._complete(target, tokens, 64, slot)
        try:
            await sleep_until(call.sent_ns + int(delay_ms * 1e6))
            if call.ended:
                return []
            closed_ns = call.close()
            stopped = await self._stopped(target, call, slot, closed_ns, 64)
        finally:
            await call.dispose()
        actual = scenario if not call.tokens else "decode"
        return [
            self._record(
                actual,
                target,
                call,
                closed_ns,
                stopped,
                "stream_closed",
                delay_ms=delay_ms,
                prefill_estimate_ms=estimate,
                prompt_tokens=tokens,
                measured_as=scenario,
            )
        ]

    async def _decode_sample(
        self, target: Target, slot: int, scenario: str = "decode", reason: str = "stream_closed"
    ) -> list[dict]:
        frames = self.rng.randint(1, MAX_FRAMES_BEFORE_STOP)
        # Right after a token: the moment its event arrives, when the next step has just begun.
        jitter_ms = self.rng.uniform(0.0, target.step_ms) if scenario != "decode_after_token" else 0.0
        target.managed.forget_releases(slot)
        call = await self._complete(target, self.plan.short_tokens, LONG_GENERATION, slot)
        try:
            await call.wait_tokens(frames)
            if call.ended:
                return []
            await sleep_until(call.tokens[frames - 1][0] + int(jitter_ms * 1e6))
            # A closed stream (FIN) for a stop; a reset (RST) for a client that vanished.
            closed_ns = call.close() if scenario != "disconnect" else call.drop()
            stopped = await self._stopped(target, call, slot, closed_ns, LONG_GENERATION)
        finally:
            await call.dispose()
        return [
            self._record(
                scenario,
                target,
                call,
                closed_ns,
                stopped,
                reason,
                cancel_after_frames=frames,
                jitter_ms=jitter_ms,
                prompt_tokens=self.plan.short_tokens,
                measured_as=scenario,
            )
        ]

    async def _concurrent_sample(self, target: Target, _slot: int) -> list[dict]:
        """Close one of CONCURRENT_STREAMS decoding streams (slot 0); the others run to their end."""
        await self._wait_idle(target)
        frames = self.rng.randint(1, MAX_FRAMES_BEFORE_STOP)
        jitter_ms = self.rng.uniform(0.0, target.step_ms)
        target.managed.forget_releases(0)
        calls = [
            await self._complete(
                target, self.plan.short_tokens, LONG_GENERATION if slot == 0 else CONCURRENT_OTHER_TOKENS, slot
            )
            for slot in range(CONCURRENT_STREAMS)
        ]
        cancelled, others = calls[0], calls[1:]
        try:
            await asyncio.gather(*(c.wait_tokens(1) for c in others), cancelled.wait_tokens(frames))
            if any(c.ended for c in calls):
                return []
            await sleep_until(cancelled.tokens[frames - 1][0] + int(jitter_ms * 1e6))
            closed_ns = cancelled.close()
            stopped = await self._stopped(target, cancelled, 0, closed_ns, LONG_GENERATION)
            ends = await asyncio.gather(*(c.wait_end() for c in others))
        finally:
            for c in calls:
                await c.dispose()
        lost = 0
        for end in ends:
            end = end or {}
            if end.get("stop_type") not in _ENDED_ON_ITS_OWN:
                lost += max(0, CONCURRENT_OTHER_TOKENS - int(end.get("tokens_predicted") or 0))
        return [
            self._record(
                DECODE_CONCURRENT,
                target,
                cancelled,
                closed_ns,
                stopped,
                "stream_closed",
                cancel_after_frames=frames,
                jitter_ms=jitter_ms,
                prompt_tokens=self.plan.short_tokens,
                measured_as=DECODE_CONCURRENT,
                streams=CONCURRENT_STREAMS,
                others_lost_tokens=lost,
                others_not_done=sum(1 for end in ends if not end or "tokens_predicted" not in end),
            )
        ]

    # Prompt speed and reuse --------------------------------------------------------------

    async def _prefill_speed_sample(self, target: Target, slot: int) -> list[dict]:
        call = await self._complete(target, self.plan.long_tokens, 1, slot, stream=False)
        try:
            final = await call.wait_end()
        finally:
            await call.dispose()
        timings = (final or {}).get("timings")
        if not timings or not timings.get("prompt_ms"):
            return []
        return [
            {
                "scenario": "prefill_speed",
                "target": target.name,
                "id": None,
                "outcome": Outcome.DONE,
                "prompt_tokens": len(call.prompt),
                "prompt_tokens_reused": len(call.prompt) - timings["prompt_n"],
                "ttft_server_ms": timings["prompt_ms"],
                "ttft_client_ms": (call.final_ns - call.sent_ns) / 1e6,
                "prompt_tokens_per_s": timings["prompt_per_second"],
            }
        ]

    async def _multi_turn_sample(self, target: Target, slot: int) -> list[dict]:
        """One chat of TURNS turns on one slot, its cache reused from turn to turn (``cache_prompt``)."""
        messages: list[dict] = []
        records = []
        for turn in range(1, TURNS + 1):
            messages.append(self.prompts.story(TURN_TOKENS + 25)[0])
            call = await self._complete(target, 0, 48, slot, stream=False, messages=messages, cache_prompt=True)
            try:
                final = await call.wait_end()
            finally:
                await call.dispose()
            if not final or "timings" not in final:
                return []
            messages.append({"role": "assistant", "content": final.get("content", "")})
            timings = final["timings"]
            records.append(
                {
                    "scenario": "multi_turn",
                    "target": target.name,
                    "id": None,
                    "turn": turn,
                    "outcome": Outcome.DONE,
                    "prompt_tokens": len(call.prompt),
                    "prompt_tokens_reused": len(call.prompt) - timings["prompt_n"],
                    "ttft_server_ms": timings["prompt_ms"],
                    "ttft_client_ms": None,
                }
            )
        return records

    async def _disconnect_sample(self, target: Target, slot: int) -> list[dict]:
        return await self._decode_sample(target, slot, "disconnect", Reason.CLIENT_DISCONNECTED)

    async def _nonstream_sample(
        self, target: Target, slot: int, scenario: str = NONSTREAM, max_tokens: int = BUSY_MAX_TOKENS
    ) -> list[dict]:
        """A non-streaming request whose client goes away during decode (placed by the calibrated times)."""
        frames = self.rng.randint(1, MAX_FRAMES_BEFORE_STOP)
        delay_ms = target.prefill_ms[self.plan.short_tokens] + (frames + self.rng.random()) * target.step_ms
        target.managed.forget_releases(slot)
        call = await self._complete(target, self.plan.short_tokens, max_tokens, slot, stream=False)
        try:
            await sleep_until(call.sent_ns + int(delay_ms * 1e6))
            if call.ended:
                return []
            closed_ns = call.drop()
            stopped = await self._stopped(target, call, slot, closed_ns, max_tokens)
        finally:
            await call.dispose()
        return [
            self._record(
                scenario,
                target,
                call,
                closed_ns,
                stopped,
                Reason.CLIENT_DISCONNECTED,
                delay_ms=delay_ms,
                max_tokens=max_tokens,
                prompt_tokens=self.plan.short_tokens,
                measured_as=scenario,
            )
        ]

    async def _busy(self, target: Target, run: dict, wanted: float) -> None:
        """Slot 0 streams without pause; on slot 1 a non-streaming request's client goes away."""
        if target.slots < 2:
            return
        started = time.monotonic()
        background: Completion | None = None
        try:
            while self._more(run, wanted, started):
                if background is None or background.ended:
                    if background is not None:
                        await background.dispose()
                    background = await self._complete(target, self.plan.short_tokens, LONG_GENERATION, 0)
                    await background.wait_tokens(1)
                records = await self._nonstream_sample(target, 1, DISCONNECT_BUSY)
                # Only samples during which the other client was streaming the whole time count.
                self._keep(DISCONNECT_BUSY, run, records if not background.ended else [])
        finally:
            if background is not None:
                background.close()
                await background.dispose()

    # Throughput ------------------------------------------------------------------------------

    async def _throughput(self, target: Target, run: dict, reps: range) -> None:
        for streams in self.plan.stream_counts(target.slots):
            for rep in reps:
                calls = [
                    await self._complete(target, self.plan.short_tokens, self.plan.decode_tokens, slot)
                    for slot in range(streams)
                ]
                try:
                    await asyncio.gather(*(c.wait_end() for c in calls))
                finally:
                    for c in calls:
                        await c.dispose()
                records = [self._throughput_record_of(target, call, streams, rep) for call in calls]
                self._keep_throughput(
                    run, records, streams, [(c.tokens[0][0], c.tokens[-1][0]) for c in calls if len(c.tokens) >= 2]
                )

    def _throughput_record_of(self, target: Target, call: Completion, streams: int, rep: int) -> dict:
        final = call.final or {}
        timings = final.get("timings", {})
        n = final.get("tokens_predicted", 0)
        rate_client = None
        if len(call.tokens) >= 2 and n >= 2:
            rate_client = (n - 1) / ((call.tokens[-1][0] - call.tokens[0][0]) / 1e9)
        return {
            "scenario": "throughput",
            "target": target.name,
            "id": None,
            "streams": streams,
            "rep": rep,
            "outcome": Outcome.DONE if call.final else Outcome.ERROR,
            "reason": final.get("stop_type"),
            "tokens": n,
            "ttft_client_ms": (call.tokens[0][0] - call.sent_ns) / 1e6 if call.tokens else None,
            "ttft_server_ms": timings.get("prompt_ms"),
            "tokens_per_s_client": rate_client,
            "tokens_per_s_server": timings.get("predicted_per_second"),
            "prompt_tokens_per_s_server": timings.get("prompt_per_second"),
        }


def peer_from_args(
    args, out_dir: Path, context_length: int, model: Path, slots: int, cpus: frozenset[int] | None = None
) -> LlamaServer:
    """The llama-server to start for ``--engines ...,llama-server``: ``slots`` slots, and as many
    compute threads in all as ours has over its slots (with ``--shared-threads``, as many as ours
    shares among its running generations)."""
    threads = args.threads if args.shared_threads else slots * args.threads
    if args.llama_server:
        binary = Path(args.llama_server)
        if not (binary.is_file() and os.access(binary, os.X_OK)):
            raise SystemExit(f"--llama-server {binary}: not an executable file")
    else:
        binary = ensure_llama_server()
    return LlamaServer(binary, model, out_dir, slots, threads, context_length, cpus)


def llama_server_binary() -> Path:
    """Where the llama-server the benchmark builds is kept, built or not."""
    return build_root() / "bin" / f"llama-server-{BUILD_KEY}"


def ensure_llama_server(progress: bool = True, jobs: int | None = None) -> Path:
    """The cached llama-server binary, built on first use from the pinned llama.cpp tree,
    unedited and with the engine's build options."""
    binary = llama_server_binary()
    if binary.is_file() and os.access(binary, os.X_OK):
        return binary
    built = build_unedited("llama-server", progress, jobs) / "bin" / "llama-server"
    if not built.is_file():
        raise LlamaBuildError(f"the build produced no {built}")
    binary.parent.mkdir(parents=True, exist_ok=True)
    # A temporary name of this process's own: two benchmarks may build at once.
    temp = binary.with_name(f".{binary.name}.{os.getpid()}.part")
    shutil.copy2(built, temp)
    os.replace(temp, binary)
    return binary
