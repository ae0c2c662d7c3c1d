"""The servers under test: ones this benchmark starts (``python -m bench.serve``
subprocesses), or one that is already running (``--url``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from . import client

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Target:
    """A server being measured, and what the benchmark learns about it on the way."""

    name: str
    ws_url: str
    http_url: str
    slots: int = 2
    managed: ManagedServer | None = None
    # Calibration: prefill time (ms) by prompt length in tokens, and the decode step (ms).
    prefill_ms: dict[int, float] = field(default_factory=dict)
    step_ms: float = 15.0
    # The HTTP API's base URL (…/v1), read from /healthz when a scenario first needs it.
    api_url: str | None = None
    # (scenario, start ns, end ns): when each scenario ran against this target.
    windows: list[tuple[str, int, int]] = field(default_factory=list)

    @classmethod
    async def from_url(cls, url: str) -> Target:
        parts = urlsplit(url if "://" in url else f"ws://{url}")
        secure = parts.scheme in ("wss", "https")
        host = parts.netloc
        target = cls("server", f"{'wss' if secure else 'ws'}://{host}/ws", f"{'https' if secure else 'http'}://{host}")
        target.slots = int((await client.healthz(target.http_url))["slots"])
        return target


class ManagedServer:
    """One ``python -m bench.serve`` process: a server on the native engine or on the baseline."""

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
        self.engine = engine
        self.model = model
        self.cpus = cpus
        # The target's name, and its files': the engine's unless several servers run the same engine.
        self.name = name or engine
        self.workers = workers
        self.threads = threads
        self.extra_args = extra_args
        self.log_path = out_dir / f"server-{self.name}.log"
        self.stderr_path = out_dir / f"server-{self.name}.stderr"
        self.lag_path = out_dir / f"lag-{self.name}.json"
        self.info: dict = {}
        self.pid: int | None = None
        self._process: asyncio.subprocess.Process | None = None

    async def start(self) -> Target:
        for path in (self.log_path, self.lag_path):
            path.unlink(missing_ok=True)
        with open(self.stderr_path, "wb") as stderr:
            self._process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "bench.serve",
                "--engine",
                self.engine,
                "--workers",
                str(self.workers),
                "--threads",
                str(self.threads),
                "--lag-out",
                str(self.lag_path),
                "--log-file",
                str(self.log_path),
                *(("--model", str(self.model)) if self.model is not None else ()),
                *self.extra_args,
                cwd=ROOT,
                preexec_fn=confine_to(self.cpus),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr,
            )
        self.pid = self._process.pid
        line = await asyncio.wait_for(self._process.stdout.readline(), 300)
        if not line:
            await self._process.wait()
            raise RuntimeError(
                f"the {self.name} server did not start; see {self.stderr_path}:\n"
                + self.stderr_path.read_text()[-2000:]
            )
        self.info = json.loads(line)
        host = f"127.0.0.1:{self.info['port']}"
        return Target(self.name, f"ws://{host}/ws", f"http://{host}", slots=self.workers, managed=self)

    async def stop(self) -> None:
        if self._process is None or self._process.returncode is not None:
            return
        self._process.stdin.close()  # the server's signal to shut down
        try:
            await asyncio.wait_for(self._process.wait(), 60)
        except TimeoutError:
            self._process.kill()
            await self._process.wait()

    def pause(self, paused: bool) -> None:
        """Stop (SIGSTOP) or continue (SIGCONT) the server while another engine is measured."""
        if self._process is not None and self._process.returncode is None:
            os.kill(self._process.pid, signal.SIGSTOP if paused else signal.SIGCONT)

    def lag_samples(self) -> list[tuple[int, int]]:
        """(start ns, overshoot ns) of every 10 ms probe sleep on the server's event loop."""
        if not self.lag_path.is_file():
            return []
        return [tuple(s) for s in json.loads(self.lag_path.read_text())["samples"]]

    def request_log(self) -> dict[str, dict]:
        """The end-of-request log line of every request, by request id."""
        ends = {}
        if self.log_path.is_file():
            for line in self.log_path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if record.get("event", "").startswith("generation_") and "request_id" in record:
                    if record["event"] != "generation_accepted":
                        # The id the client chose (for HTTP requests, the server-global request id).
                        ends[record.get("id", record["request_id"])] = record
        return ends


async def start_stopline(*flags: str) -> tuple[asyncio.subprocess.Process, str, str]:
    """``python -m stopline`` on free ports with ``flags``: the process, its WebSocket URL and its
    ``/v1`` base URL, once it has started. Its log is drained from then on, so a full pipe never
    blocks it."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "stopline",
        "--port",
        "0",
        "--http-port",
        "0",
        *flags,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert process.stdout is not None
    while True:
        line = await asyncio.wait_for(process.stdout.readline(), 300)
        if not line:
            raise RuntimeError("the server ended before it started")
        record = json.loads(line)
        if record.get("event") == "server_started":
            ws_url = record["url"].replace("http://", "ws://") + "ws"
            asyncio.get_running_loop().create_task(_drain(process.stdout))
            return process, ws_url, record["http_api"]


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass


def confine_to(cpus: frozenset[int] | None):
    """A preexec_fn that pins the child to ``cpus``, so that every engine runs on the same cores."""
    if cpus is None:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def load_average() -> tuple[float, float, float]:
    """The machine's 1, 5 and 15 minute load averages: how busy the shared machine was."""
    one, five, fifteen = os.getloadavg()
    return (one, five, fifteen)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """A redis-server (Debian's ``redis-server``) on 127.0.0.1 and a free port, in its own directory,
    without persistence: for the scale-out scenario, and for the scale-out tests."""

    def __init__(self, directory: Path, port: int | None = None):
        self.directory = directory
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start it (again, on the same port) and return once it answers PING."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / "redis.log", "ab") as log:
            self.process = subprocess.Popen(
                [
                    "redis-server",
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(self.directory),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return self
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server did not start; see {self.directory / 'redis.log'}")
            time.sleep(0.02)

    def kill(self) -> None:
        """Stop it at once, as a crash would (SIGKILL)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


class CpuMeter:
    """CPU time used on the whole machine, and by the benchmark's own processes (client and
    servers): the difference is what other work took from the cores while a scenario ran."""

    def __init__(self, pids: list[int]):
        self.pids = pids
        self.tick = os.sysconf("SC_CLK_TCK")

    def read(self) -> tuple[float, float, float]:
        """(wall s, machine busy s, our processes' s)."""
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        # user nice system idle iowait irq softirq steal ...: everything but idle and iowait is busy.
        busy = sum(fields) - fields[3] - fields[4]
        ours = 0
        for pid in self.pids:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            # Fields after the parenthesised command name; utime and stime are the 12th and 13th.
            rest = stat.rsplit(")", 1)[1].split()
            ours += int(rest[11]) + int(rest[12])
        return time.monotonic(), busy / self.tick, ours / self.tick

    def usage_since(self, before: tuple[float, float, float]) -> dict:
        """Average cores busy since ``before``: in total, by our processes, by everything else."""
        wall, busy, ours = (now - then for now, then in zip(self.read(), before))
        wall = max(wall, 1e-9)
        return {
            "wall_s": wall,
            "machine_cores": busy / wall,
            "bench_cores": ours / wall,
            "other_cores": max(0.0, busy - ours) / wall,
        }
