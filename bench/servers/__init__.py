"""The servers the benchmark runs besides those it measures: redis-server for the scale-out
scenario and tests; ``serve.py`` is the process that serves Stopline for the benchmark, on
one of its engines (``baseline.py`` among them)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from pathlib import Path


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
