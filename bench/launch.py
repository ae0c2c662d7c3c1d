"""The one way the tests and the benchmark start Stopline, or the benchmark's own server
(``python -m bench serve``), as a process of its own: from the checkout, with its output read
as it comes, so that a full pipe never blocks it and a test can wait on what it logged."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STARTED = "server_started"


def module_command(module: str, *args: str) -> list[str]:
    """``python -m module *args`` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def environment(env: dict | None, inherit: bool) -> dict:
    """The child's environment: ``env`` over this process's, or ``env`` alone."""
    return {**(os.environ if inherit else {}), **(env or {})}


def run_stopline(
    *args: str, env: dict | None = None, inherit_env: bool = True, timeout: float = 120, module: str = "stopline"
) -> subprocess.CompletedProcess:
    """A command of Stopline's that runs to its end (``keys``, ``cache``, a refused start): its
    status, stdout and stderr."""
    return subprocess.run(
        module_command(module, *args),
        cwd=ROOT,
        env=environment(env, inherit_env),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def confine_to(cpus: frozenset[int] | None) -> Callable[[], None] | None:
    """A preexec_fn that pins the child to ``cpus``, so that every server measured runs on the same cores."""
    if cpus is None:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


class ServerProcess:
    """``python -m MODULE *args``, its stdout (and stderr, unless it goes to ``stderr_path``) read
    line by line on threads of its own: ``lines`` holds what it wrote, ``records`` the JSON lines."""

    def __init__(
        self,
        *args: str,
        module: str = "stopline",
        env: dict | None = None,
        inherit_env: bool = True,
        stderr_path: Path | None = None,
        cpus: frozenset[int] | None = None,
        keep_stdin: bool = False,
    ):
        self.lines: list[str] = []
        self.records: list[dict] = []
        # The server_started record, and the URLs it gives, once wait_started has seen it.
        self.start_record: dict = {}
        self.ws_url = ""
        self.api_url = ""
        self.stderr_path = stderr_path
        self._stderr_lines: list[str] = []
        self._changed = threading.Condition()
        self._stdout_ended = False
        stderr_file = open(stderr_path, "wb") if stderr_path is not None else None  # noqa: SIM115
        try:
            self.process = subprocess.Popen(
                module_command(module, *args),
                cwd=ROOT,
                env=environment(env, inherit_env),
                stdin=subprocess.PIPE if keep_stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=stderr_file or subprocess.PIPE,
                preexec_fn=confine_to(cpus),
            )
        finally:
            if stderr_file is not None:
                stderr_file.close()
        self.pid = self.process.pid
        self._readers = [threading.Thread(target=self._read_stdout, daemon=True)]
        if stderr_file is None:
            self._readers.append(threading.Thread(target=self._read_stderr, daemon=True))
        for reader in self._readers:
            reader.start()

    def _read_stdout(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            line = raw.decode("utf-8", "replace")
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            with self._changed:
                self.lines.append(line)
                if isinstance(record, dict):
                    self.records.append(record)
                self._changed.notify_all()
        with self._changed:
            self._stdout_ended = True
            self._changed.notify_all()

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for raw in self.process.stderr:
            self._stderr_lines.append(raw.decode("utf-8", "replace"))

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    @property
    def stdout(self) -> str:
        return "".join(self.lines)

    @property
    def stderr(self) -> str:
        if self.stderr_path is not None:
            return self.stderr_path.read_text(errors="replace") if self.stderr_path.is_file() else ""
        return "".join(self._stderr_lines)

    def wait_record(self, predicate: Callable[[dict], bool], timeout: float) -> dict:
        """The first JSON line that ``predicate`` accepts, written already or within ``timeout``
        seconds; RuntimeError, with the end of stderr, if the process ends or the time runs out first."""
        with self._changed:
            found: list[dict] = []

            def seen() -> bool:
                found[:] = [r for r in self.records if predicate(r)][:1]
                return bool(found) or self._stdout_ended

            self._changed.wait_for(seen, timeout)
        if found:
            return found[0]
        state = "ended" if self._stdout_ended else f"wrote nothing wanted in {timeout} s"
        raise RuntimeError(f"{self.process.args[2]} (pid {self.pid}) {state}; stderr ends:\n{self.stderr[-2000:]}")

    def wait_event(self, event: str, timeout: float) -> dict:
        return self.wait_record(lambda record: record.get("event") == event, timeout)

    def wait_started(self, timeout: float = 300) -> ServerProcess:
        """Return once it serves: its URLs are then ``ws_url`` and ``api_url``."""
        self.start_record = record = self.wait_event(STARTED, timeout)
        self.ws_url = record["url"].replace("http", "ws", 1) + "ws"
        self.api_url = record.get("http_api") or ""
        return self

    async def started(self, timeout: float = 300) -> ServerProcess:
        return await asyncio.to_thread(self.wait_started, timeout)

    def wait(self, timeout: float | None = None) -> int:
        """Its exit status, once it has exited and everything it wrote has been read."""
        code = self.process.wait(timeout)
        for reader in self._readers:
            reader.join(10)
        return code

    async def ended(self, timeout: float | None = None) -> int:
        return await asyncio.to_thread(self.wait, timeout)

    def send_signal(self, sig: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)

    def close_stdin(self) -> None:
        """The benchmark's server shuts down when its stdin closes."""
        if self.process.stdin is not None:
            self.process.stdin.close()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """Ask it to stop with ``sig``; kill it if it has not within ``timeout`` seconds."""
        self.send_signal(sig)
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            return self.kill()

    async def stopped(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        return await asyncio.to_thread(self.stop, sig, timeout)

    def kill(self) -> int:
        self.send_signal(signal.SIGKILL)
        return self.wait()

    def pause(self, paused: bool) -> None:
        """Stop (SIGSTOP) or continue (SIGCONT) it while another server is measured."""
        self.send_signal(signal.SIGSTOP if paused else signal.SIGCONT)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc_info) -> None:
        if self.returncode is None:
            self.kill()
