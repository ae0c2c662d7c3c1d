"""Helpers for the scale-out tests: replicas as ``python -m stopline`` processes and nginx in
front of them, configured by deploy/nginx.conf itself."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

from bench.launch import ServerProcess
from bench.servers import free_port
from stopline.cluster import StoreEvent
from support import UNIT

REPO = Path(__file__).resolve().parent.parent.parent
NGINX_CONF = REPO / "deploy" / "nginx.conf"
# The ports deploy/nginx.conf names: nginx, then each replica's WebSocket and HTTP API.
DEPLOY_LISTEN = 8080
DEPLOY_REPLICAS = ((8765, 8766), (8775, 8776), (8785, 8786))
REPLICA_IDS = ("a", "b", "c")


class Replica(ServerProcess):
    """``python -m stopline`` with --redis-url: one slot, ports chosen by the system, read from its log.

    It has started when it serves and has reached Redis: until then it counts quotas alone.
    """

    def __init__(self, replica_id: str, redis_url: str, directory: Path, extra_args: tuple[str, ...] = ()):
        self.replica_id = replica_id
        super().__init__(
            *("--port", "0", "--http-port", "0", "--workers", "1", "--threads", "1"),
            *("--redis-url", redis_url, "--replica-id", replica_id, *extra_args),
            stderr_path=directory / f"replica-{replica_id}.stderr",
        )

    def wait_started(self, timeout: float = 180 * UNIT) -> Replica:
        super().wait_started(timeout)
        self.wait_event(StoreEvent.UP, timeout)
        self.ws_port = urlsplit(self.start_record["url"]).port
        self.http_port = urlsplit(self.api_url).port
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30 * UNIT) -> int:
        return super().stop(sig, timeout)


def render_nginx_conf(listen: int, replicas: list[Replica]) -> str:
    """deploy/nginx.conf with its ports replaced by the test's: the same file, not a copy of it."""
    text = NGINX_CONF.read_text()
    swaps = [(f"listen 127.0.0.1:{DEPLOY_LISTEN};", f"listen 127.0.0.1:{listen};")]
    for (ws, api), replica in zip(DEPLOY_REPLICAS, replicas):
        swaps += [
            (f"server 127.0.0.1:{ws};", f"server 127.0.0.1:{replica.ws_port};"),
            (f"server 127.0.0.1:{api};", f"server 127.0.0.1:{replica.http_port};"),
        ]
    for old, new in swaps:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    return text


class Nginx:
    """nginx as in docs/deploy.md: its own prefix, pid file and temp files; no daemon."""

    def __init__(self, directory: Path, replicas: list[Replica]):
        self.port = free_port()
        (directory / "tmp").mkdir(parents=True, exist_ok=True)
        conf = directory / "nginx.conf"
        conf.write_text(render_nginx_conf(self.port, replicas))
        self.stderr_path = directory / "nginx.stderr"
        with open(self.stderr_path, "wb") as stderr:
            self.process = subprocess.Popen(
                ["nginx", "-p", str(directory), "-c", str(conf), "-e", "stderr", "-g", "daemon off;"],
                stdout=stderr,
                stderr=stderr,
            )
        deadline = time.monotonic() + 10 * UNIT
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                break
            assert self.process.poll() is None, self.stderr_path.read_text()
            assert time.monotonic() < deadline, "nginx did not start"
            time.sleep(0.02)
        self.http = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/ws"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
