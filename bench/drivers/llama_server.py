"""llama.cpp's llama-server as the benchmark drives it, and the binary it builds for that.

The benchmark starts the binary (``--llama-server PATH``, or the one
:func:`ensure_llama_server` builds, unedited, from the pinned llama.cpp tree) on
the same GGUF file as the other engines, with the same context per slot, slots
and sampling, as many compute threads in all, on the same cores. Requests are
``POST /completion`` with the prompt as token ids, so that every engine
evaluates the same tokens, each pinned to the lane's slot (``id_slot``).

* llama-server has no cancel request: a stop is the client closing the
  connection (FIN), and a vanished client resets it (RST).
* "Stopped" is the moment its slot goes idle, read from the server's own log
  line for the slot's release (``slot release: id N | task T | stop processing``),
  stamped when it arrives on the pipe from its stderr, then confirmed on
  ``GET /slots``. ``/slots`` is not polled in a loop to find the moment: every
  answer restarts the one-second wait after which a request handler checks
  whether its client is still there, so the probe would keep the server from
  ever noticing a disconnect that produces no output.

The HTTP client is a few lines over asyncio streams, so that a request can be
dropped exactly and every event stamped on arrival.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from stopline.engine.llama_build import (
    BUILD_KEY,
    CPU,
    SOURCE_LABEL,
    LlamaBuildError,
    build_root,
    build_unedited,
    selected_backend,
)
from stopline.protocol.requests import DEFAULT_SAMPLING
from stopline.protocol.vocabulary import Outcome, Reason

from ..launch import confine_to
from .base import ANY_SLOT, NONSTREAM, Driver, End, Lane, Request, Stream

ENGINE = "llama-server"
# How a finished request says why it ended, in Stopline's words.
STOP_TYPES = {"eos": Reason.EOS, "word": Reason.STOP_SEQUENCE, "limit": Reason.MAX_TOKENS}
STREAM_CLOSED = "stream_closed"

_LISTENING = re.compile(r"listening on http://[^:]+:(\d+)")
_RELEASE = re.compile(r"slot\s+release: id\s+(\d+) \| task (-?\d+) \| stop processing: n_tokens = (\d+)")
_LAUNCH = re.compile(r"launch_slot_: id\s+\d+ \| task (\d+)")
_CANCEL = re.compile(r"cancel task, id_task = (\d+)")


def llama_server_binary(backend: str = CPU) -> Path:
    """Where the llama-server the benchmark builds for ``backend`` is kept, built or not."""
    return build_root() / "bin" / f"llama-server-{BUILD_KEY}{'' if backend == CPU else '-' + backend}"


def ensure_llama_server(progress: bool = True, jobs: int | None = None, backend: str | None = None) -> Path:
    """The cached llama-server binary, built on first use from the pinned llama.cpp tree,
    unedited and with the engine's build options, for ``backend`` (default: the engine's, as
    STOPLINE_GPU or the machine chooses it)."""
    backend = backend or selected_backend().name
    binary = llama_server_binary(backend)
    if binary.is_file() and os.access(binary, os.X_OK):
        return binary
    built = build_unedited("llama-server", progress, jobs, backend) / "bin" / "llama-server"
    if not built.is_file():
        raise LlamaBuildError(f"the build produced no {built}")
    binary.parent.mkdir(parents=True, exist_ok=True)
    # A temporary name of this process's own: two benchmarks may build at once.
    temp = binary.with_name(f".{binary.name}.{os.getpid()}.part")
    shutil.copy2(built, temp)
    os.replace(temp, binary)
    return binary


@dataclass
class Release:
    slot: int  # -1: a request cancelled while it waited for its slot, which is then not released
    n_tokens: int  # prompt + generated tokens in the slot's context when it stopped
    seen_ns: int  # when the log line arrived


# A small HTTP/1.1 client ----------------------------------------------------------------


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (h.partition(":") for h in head[1:] if h)}
    return int(head[0].split(" ", 2)[1]), headers


async def _chunks(reader: asyncio.StreamReader, headers: dict[str, str]):
    """The body's pieces as they come: chunked, or raw until the connection ends."""
    if headers.get("transfer-encoding", "").lower() != "chunked":
        while data := await reader.read(65536):
            yield data
        return
    while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
        yield await reader.readexactly(size)
        await reader.readexactly(2)
    await reader.readuntil(b"\r\n")


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    return b"".join([chunk async for chunk in _chunks(reader, headers)])


async def call(base_url: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
    """``GET path``, or ``POST path`` with a JSON body, answered whole: its status and body."""
    host, port = base_url.rsplit("/", 1)[-1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    payload = b"" if body is None else json.dumps(body).encode()
    head = f"{'GET' if body is None else 'POST'} {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n"
    try:
        writer.write(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        status, headers = await _read_head(reader)
        return status, await _read_body(reader, headers)
    finally:
        writer.close()


async def call_json(base_url: str, path: str, body: dict | None = None):
    status, answer = await call(base_url, path, body)
    if status != 200:
        raise RuntimeError(f"{path}: HTTP {status}: {answer[:200]!r}")
    return json.loads(answer)


def end_of(final: dict, now_ns: int, prompt: int) -> End:
    """A finished request's last event, or its whole answer, read."""
    if "error" in final:
        return End(Outcome.ERROR, None, now_ns, extra={"error": final["error"]})
    timings = final.get("timings", {})
    predicted, predicted_ms = timings.get("predicted_n", 0), timings.get("predicted_ms")
    return End(
        outcome=Outcome.DONE,
        reason=STOP_TYPES.get(final.get("stop_type"), final.get("stop_type")),
        stop_ns=now_ns,
        tokens_generated=final.get("tokens_predicted", 0),
        prompt_tokens=prompt,
        prompt_tokens_reused=prompt - timings.get("prompt_n", prompt),
        ttft_server_ms=timings.get("prompt_ms"),
        duration_ms=timings.get("prompt_ms", 0) + (predicted_ms or 0),
        step_ms=predicted_ms / predicted if predicted and predicted_ms else None,
        decode_tokens_per_s_server=timings.get("predicted_per_second"),
        prompt_tokens_per_s_server=timings.get("prompt_per_second"),
    )


class Completion(Stream):
    """One ``POST /completion`` on a connection of its own."""

    def __init__(self, driver: LlamaServerDriver, request: Request, slot: int, prompt: list[int]):
        super().__init__(request)
        self.driver, self.slot, self.prompt = driver, slot, prompt
        self.predicted = 0  # tokens generated, as the last streamed event counted them
        self.gone_ns, self.reason = 0, STREAM_CLOSED
        self._writer: asyncio.StreamWriter | None = None
        self._reader: asyncio.Task | None = None

    async def send(self, body: dict) -> None:
        host, port = self.driver.http_url.rsplit("/", 1)[-1].split(":")
        reader, self._writer = await asyncio.open_connection(host, int(port))
        payload = json.dumps(body).encode()
        self.sent_ns = time.monotonic_ns()
        self._writer.write(
            f"POST /completion HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        self._reader = asyncio.create_task(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            status, headers = await _read_head(reader)
            if not self.request.stream or status != 200:
                answer = json.loads(await _read_body(reader, headers))
                final = answer if status == 200 else {"error": answer}
                self._finish(end_of(final, time.monotonic_ns(), len(self.prompt)))
                return
            pending = b""
            async for data in _chunks(reader, headers):
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
            self._close()

    def _event(self, now_ns: int, event: dict) -> None:
        if event.get("tokens") or event.get("content"):
            self.predicted = event.get("tokens_predicted", len(self.tokens) + 1)
            self._token(now_ns, event.get("content", ""))
        if event.get("stop"):
            self._finish(end_of(event, now_ns, len(self.prompt)))

    async def cancel(self) -> int:
        self.gone_ns = time.monotonic_ns()
        assert self._writer is not None
        self._writer.close()
        return self.gone_ns

    def drop(self) -> int:
        self.gone_ns, self.reason = time.monotonic_ns(), Reason.CLIENT_DISCONNECTED
        assert self._writer is not None
        self._writer.transport.abort()
        return self.gone_ns

    async def stopped(self, others: int = 0) -> End:
        """The slot's release line, then a /slots answer showing the slot idle."""
        release = await self.driver.next_release(self.slot)
        # Not this request's: the previous one's release, logged after its answer was sent, or a
        # request cancelled before it had a slot, which this one is not once it has streamed.
        while release.seen_ns < self.sent_ns or (release.slot < 0 and self.tokens):
            release = await self.driver.next_release(self.slot)
        if release.slot < 0:
            return End(Outcome.CANCELLED, self.reason, release.seen_ns, tokens_generated=0, tokens_after_cancel=0)
        while any(s["id"] == self.slot and s["is_processing"] for s in await call_json(self.driver.http_url, "/slots")):
            await asyncio.sleep(0.001)
        confirmed_ns = time.monotonic_ns()
        # The slot's context holds the prompt and every sampled token but the last (each is
        # evaluated in the step after it is sampled), so a prompt stopped part-way generated none.
        prompt = len(self.prompt)
        generated = release.n_tokens - prompt + 1 if release.n_tokens >= prompt else 0
        ran_to_end = generated >= self.request.max_tokens
        evaluated = min(release.n_tokens, prompt)
        return End(
            Outcome.DONE if ran_to_end else Outcome.CANCELLED,
            self.reason,
            release.seen_ns,
            tokens_generated=generated,
            tokens_after_cancel=max(0, generated - self.predicted),
            extra={
                "slots_confirm_ms": (confirmed_ns - self.gone_ns) / 1e6,
                # It generated all it was asked for: the client's leaving was never noticed.
                "ran_to_end": ran_to_end,
                # The client is gone in every one of these, so all the work done for it was wasted.
                "tokens_wasted": evaluated + generated,
                "prompt_tokens_evaluated": evaluated,
                "log_tokens_generated": generated,
            },
        )

    async def dispose(self) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.close()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)


class SlotLane(Lane):
    """Requests pinned to one of the server's slots."""

    def __init__(self, driver: LlamaServerDriver, slot: int, pinned: bool = True):
        self.driver, self.slot, self.pinned = driver, slot, pinned
        self.completions: list[Completion] = []

    async def generate(self, request: Request) -> Stream:
        prompt = self.driver.tokenize(request.messages)
        sampling = DEFAULT_SAMPLING  # Stopline's defaults, and no llama.cpp-only sampler (min_p)
        body = {
            "prompt": prompt,
            "n_predict": request.max_tokens,
            "stream": request.stream,
            "seed": request.seed,
            "temperature": request.temperature,
            "top_k": sampling.top_k,
            "top_p": sampling.top_p,
            "min_p": 0.0,
            "repeat_penalty": sampling.repetition_penalty,
            "repeat_last_n": 64,
            "id_slot": self.slot if self.pinned else -1,
            # Every prompt is evaluated whole, as on the other engines, but in a chat: there the
            # slot's cache makes a follow-up turn cost only its new tokens, as Stopline's does.
            "cache_prompt": request.cache_prompt,
        }
        self.driver.forget_releases(self.slot)
        completion = Completion(self.driver, request, self.slot, prompt)
        await completion.send(body)
        self.completions.append(completion)
        return completion

    async def close(self) -> None:
        for completion in self.completions:
            await completion.dispose()


class LlamaServerDriver(Driver):
    """A llama-server process on 127.0.0.1 and a free port, its log watched line by line."""

    capabilities = frozenset({NONSTREAM})

    def __init__(
        self,
        binary: Path,
        model: Path,
        out_dir: Path,
        slots: int,
        threads: int,
        context_length: int,
        tokenize=None,
        cpus: frozenset[int] | None = None,
        cache_ram: bool = False,
        gpu_layers: str | None = None,
    ):
        """``threads``: compute threads of the whole process, shared by its slots; ``tokenize``:
        a chat's messages to the prompt's token ids, as the other engines would read it;
        ``cache_ram``: keep llama-server's own prompt cache across requests (its default), which
        every other measurement turns off so that each prompt is evaluated whole; ``gpu_layers``:
        its ``--n-gpu-layers`` (None: llama-server's default)."""
        super().__init__(ENGINE, slots)
        self.binary, self.model, self.threads, self.context_length = Path(binary), Path(model), threads, context_length
        self.tokenize, self.cpus, self.cache_ram = tokenize, cpus, cache_ram
        self.gpu_layers = gpu_layers
        self.log_path = out_dir / "server-llama-server.log"
        self.http_url = ""
        self._process: asyncio.subprocess.Process | None = None
        self._log_reader: asyncio.Task | None = None
        self._releases: dict[int, asyncio.Queue[Release]] = {}
        self._launched: set[int] = set()  # the tasks that got a slot

    def command(self) -> list[str]:
        threads = str(self.threads)
        return [
            *(str(self.binary), "--model", str(self.model), "--host", "127.0.0.1", "--port", "0"),
            *("--parallel", str(self.slots), "--ctx-size", str(self.context_length * self.slots)),
            "--no-kv-unified",  # each slot gets its own context of context_length tokens
            *("--threads", threads, "--threads-batch", threads, "--slots", "--metrics"),
            *(() if self.cache_ram else ("--cache-ram", "0")),
            *(() if self.gpu_layers is None else ("--n-gpu-layers", self.gpu_layers)),
            *("--fit", "off", "--log-colors", "off"),
        ]

    async def start(self) -> LlamaServerDriver:
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
        self._log_reader = asyncio.create_task(self._read_log(port))
        try:
            async with asyncio.timeout(300):
                await asyncio.wait([port, self._log_reader], return_when=asyncio.FIRST_COMPLETED)
                if not port.done():
                    tail = self.log_path.read_text()[-2000:]
                    raise RuntimeError(f"llama-server exited during start-up; see {self.log_path}:\n{tail}")
                self.http_url = f"http://127.0.0.1:{port.result()}"
                while not await self._healthy():  # 503 while the model loads
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
        return self

    async def _healthy(self) -> bool:
        try:
            return (await call(self.http_url, "/health"))[0] == 200
        except OSError:
            return False

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
        assert self._process is not None and self._process.stderr is not None
        with open(self.log_path, "w") as log:
            while line := await self._process.stderr.readline():
                now, text = time.monotonic_ns(), line.decode(errors="replace")
                log.write(text)
                if (m := _RELEASE.search(text)) and int(m.group(1)) in self._releases:
                    self._releases[int(m.group(1))].put_nowait(Release(int(m.group(1)), int(m.group(3)), now))
                elif m := _LAUNCH.search(text):
                    self._launched.add(int(m.group(1)))
                elif (m := _CANCEL.search(text)) and int(m.group(1)) not in self._launched:
                    for queue in self._releases.values():
                        queue.put_nowait(Release(-1, 0, now))
                elif not port.done() and (m := _LISTENING.search(text)):
                    port.set_result(int(m.group(1)))

    def forget_releases(self, slot: int) -> None:
        queue = self._releases[slot]
        while not queue.empty():
            queue.get_nowait()

    async def next_release(self, slot: int, timeout: float = 300.0) -> Release:
        async with asyncio.timeout(timeout):
            return await self._releases[slot].get()

    async def lane(self, index: int = 0, transport: str = "") -> Lane:
        return SlotLane(self, index % self.slots, pinned=transport != ANY_SLOT)

    async def wait_idle(self, timeout: float = 300.0) -> None:
        async with asyncio.timeout(timeout):
            while any(s["is_processing"] for s in await call_json(self.http_url, "/slots")):
                await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._process is not None and self._process.returncode is None:
            self._process.send_signal(signal.SIGCONT)  # a paused process cannot act on SIGTERM
            self._process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self._process.wait(), 30)
            except TimeoutError:
                self._process.kill()
                await self._process.wait()
        if self._log_reader is not None:
            await asyncio.gather(self._log_reader, return_exceptions=True)

    def pause(self, paused: bool) -> None:
        if self._process is not None and self._process.returncode is None:
            os.kill(self._process.pid, signal.SIGSTOP if paused else signal.SIGCONT)
