"""The first minutes of a new user: ports, host names, the console, Ctrl-C, the loading thread.

Each startup case runs ``python -m stopline`` as a real process; the console
cases run it in a pseudo-terminal, as a person at a terminal sees it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from urllib.parse import urlsplit

import aiohttp
import pexpect
import pytest

from bench.launch import ROOT, ServerProcess, module_command, run_stopline
from stopline import settings
from stopline.__main__ import _in_daemon_thread
from stopline.engine import cores, model
from stopline.engine.tokenizer import load_chat_template
from stopline.protocol.origin import WILDCARD_HOSTS
from support import CHAT_FRANCE, LONG_ANSWER, UNIT, client_for, running_server


def stopline(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return run_stopline(*args, timeout=timeout * UNIT)


def in_terminal(*args: str, env: dict | None = None) -> pexpect.spawn:
    command = module_command("stopline", *args)
    return pexpect.spawn(
        command[0],
        command[1:],
        cwd=str(ROOT),
        env={**os.environ, "TERM": "xterm", "COLUMNS": "120", **(env or {})},
        encoding="utf-8",
        timeout=120 * UNIT,
        dimensions=(40, 120),
    )


# --- ports: both taken before loading, one line when one cannot be ------------------------


@pytest.fixture
def taken_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_port_before(taken: int) -> int:
    """A free port P whose P + 1 is ``taken``, or skip."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", taken - 1))
        except OSError:
            pytest.skip(f"port {taken - 1} is in use")
    return taken - 1


@pytest.mark.parametrize("case", ["--port taken", "--http-port taken", "same port twice", "default http port taken"])
def test_a_port_that_cannot_be_taken_is_one_line_and_exit_2_before_loading(case, taken_port):
    port = free_port()
    args = {
        "--port taken": ["--port", str(taken_port)],
        "--http-port taken": ["--port", "0", "--http-port", str(taken_port)],
        "same port twice": ["--port", str(port), "--http-port", str(port)],
        "default http port taken": ["--port", str(free_port_before(taken_port))] if case.startswith("default") else [],
    }[case]
    flag = "--port" if case == "--port taken" else "--http-port"
    result = stopline(*args, "--model", "/nonexistent/model.gguf")
    assert result.returncode == 2, result
    # One line that names the flag; no usage dump, and the model (here a missing file,
    # which would be refused with another line) was never looked at.
    [line] = result.stderr.splitlines()
    assert line.startswith(f"stopline: {flag}") and "cannot listen on 127.0.0.1:" in line, line
    assert "usage:" not in result.stderr and "not found" not in result.stderr


# --- host names with --host 0.0.0.0 ----------------------------------------------------------


async def get_as(port: int, host: str, path: str = "/", address: str = "127.0.0.1") -> tuple[int, str]:
    """A GET to ``port`` over loopback (``address``), naming ``host`` in its Host header."""
    reader, writer = await asyncio.open_connection(address, port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    await writer.wait_closed()
    head, _, body = data.decode("utf-8", "replace").partition("\r\n\r\n")
    return int(head.split()[1]), body


async def test_listening_everywhere_answers_to_the_machines_own_names(engine):
    async with running_server(engine, host="0.0.0.0") as server:
        own = socket.gethostname()
        status, _ = await get_as(server.port, own)
        assert status == 200
        status, body = await get_as(server.port, own, "/healthz")
        assert status == 200
        # The API is advertised where the page is, not at 0.0.0.0.
        assert f'"http_api": "http://{server.public_host}:' in body and "0.0.0.0" not in body
        # Another name is still refused, and the refusal says how to allow it.
        status, body = await get_as(server.port, "rebound.example")
        assert status == 403
        assert "host_not_allowed" in body and "--allowed-hosts rebound.example" in body


async def test_a_loopback_server_refuses_the_machines_name_and_names_the_flag(engine):
    async with running_server(engine) as server:
        own = socket.gethostname()
        status, body = await get_as(server.port, own)
        assert status == 403 and f"--allowed-hosts {own.lower()}" in body


async def open_advertised(page: str, api: str) -> None:
    """Open the page, /healthz and the API's model list at the URLs a server advertised,
    as a client does: resolving the host in them."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30 * UNIT)) as http:
        async with http.get(page) as response:
            assert response.status == 200 and "<title>" in await response.text()
        async with http.get(page + "healthz") as response:
            assert response.status == 200 and (await response.json())["http_api"] == api
        async with http.get(api + "/models") as response:
            assert response.status == 200
            assert [m["id"] for m in (await response.json())["data"]] == [model.EMBEDDED_MODEL_NAME]


@pytest.mark.parametrize("own_name", ["localhost", "stopline-unnamed.invalid"])
async def test_a_server_on_every_interface_advertises_a_url_that_opens(engine, monkeypatch, own_name):
    # A machine's name may resolve to one of its addresses, or nowhere (no entry in
    # /etc/hosts, no DNS): then an address of the machine stands in for it.
    monkeypatch.setattr(socket, "gethostname", lambda: own_name)
    async with running_server(engine, host="0.0.0.0") as server:
        advertised = urlsplit(server.url).hostname
        if own_name == "localhost":
            assert advertised == own_name
        else:
            assert ipaddress.ip_address(advertised).version == 4 and advertised != "0.0.0.0"
        assert server.url == f"http://{advertised}:{server.port}/"
        await open_advertised(server.url, server.http.base_url)


async def started(process: ServerProcess) -> ServerProcess:
    """``process`` once it serves; a skip where the machine has no IPv6 to listen on."""
    try:
        return await process.started(120 * UNIT)
    except RuntimeError:
        if "cannot listen on [::]" in process.stderr:
            pytest.skip(f"no IPv6 here: {process.stderr.strip()}")
        raise


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "127.0.0.1"])
async def test_the_advertised_urls_open_and_a_refused_name_is_told_the_flag(host):
    with ServerProcess("--host", host, "--port", "0") as process:
        record = (await started(process)).wait_event("server_started", 0)
        page, api = record["url"], record["http_api"]
        assert urlsplit(page).hostname not in WILDCARD_HOSTS and urlsplit(api).hostname not in WILDCARD_HOSTS
        await open_advertised(page, api)
        port, own = urlsplit(page).port, socket.gethostname()
        loopback = "::1" if host == "::" else "127.0.0.1"
        if host in WILDCARD_HOSTS:
            assert (await get_as(port, own, address=loopback))[0] == 200
            refused = "rebound.example"
        else:
            refused = own.lower()
        status, body = await get_as(port, refused, address=loopback)
        assert status == 403 and f"--allowed-hosts {refused}" in body
        assert process.stop(signal.SIGINT, 30 * UNIT) == 0


# --- --chat-template ------------------------------------------------------------------------------


async def test_the_served_prompt_is_rendered_with_the_chat_template_flag(engine):
    # The model's own template (SmolLM2's ChatML, with its default system prompt) and
    # zephyr's give prompts of different lengths: the served count says which one ran.
    zephyr = engine.tokenizer.with_chat_template(load_chat_template("zephyr"))
    with_zephyr = len(zephyr.encode(zephyr.render_chat(CHAT_FRANCE)))
    assert with_zephyr != len(engine.encode(messages=CHAT_FRANCE))
    with ServerProcess("--port", "0", "--chat-template", "zephyr") as process:
        api = (await started(process)).api_url
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60 * UNIT)) as http:
            body = {"model": model.EMBEDDED_MODEL_NAME, "messages": CHAT_FRANCE, "max_tokens": 1}
            async with http.post(api + "/chat/completions", json=body) as response:
                assert response.status == 200, await response.text()
                answer = await response.json()
        assert answer["usage"]["prompt_tokens"] == with_zephyr
        assert process.stop(signal.SIGINT, 30 * UNIT) == 0


@pytest.mark.parametrize(
    "template, problem",
    [
        ("alpaca", "'alpaca' is neither a template file nor one of chatml, llama2, zephyr"),
        ("missing.jinja", "'{folder}/missing.jinja' is neither a template file"),
        ("broken.jinja", "{folder}/broken.jinja: not a Jinja template"),
    ],
)
def test_a_chat_template_that_cannot_work_is_one_line_and_exit_2(tmp_path, template, problem):
    (tmp_path / "broken.jinja").write_text("{% for %}")
    if template.endswith(".jinja"):
        template = str(tmp_path / template)
    result = stopline("--port", "0", "--chat-template", template)
    assert result.returncode == 2, result
    # One line that names the flag and says why; nothing was loaded or logged.
    [line] = result.stderr.splitlines()
    assert line.startswith("python -m stopline: error: argument --chat-template: ")
    assert problem.format(folder=tmp_path) in line, line
    assert result.stdout == ""


# --- the console -------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_terminal_gets_plain_lines_and_a_serving_at_line():
    child = in_terminal("--port", "0")
    try:
        child.expect(
            r"Stopline is serving SmolLM2-135M-Instruct at http://127\.0\.0\.1:(\d+)/ \(API: http://127\.0\.0\.1:\d+/v1\)"
        )
        # Nothing before it was JSON.
        assert "{" not in child.before
        child.sendintr()
        child.expect("stopped")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


@pytest.mark.slow
def test_json_logs_on_a_terminal_when_asked():
    child = in_terminal("--port", "0", "--log-format", "json")
    try:
        child.expect(
            r'\{"url": "http://127\.0\.0\.1:\d+/", "model": "SmolLM2-135M-Instruct"[^\n]*"event": "server_started"'
        )
        child.sendintr()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_help_shows_defaults_and_which_model_files_work():
    result = stopline("--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "--port PORT port to listen on (0: any free port) (default: 8765)" in text
    assert (
        "--workers WORKERS generation slots: users served at once (default: llama.cpp: 4, as llama-server, or up"
        in text
    )
    assert "Model files: The ctransformers engine runs GGUF v2-v3 files of architecture llama" in text
    client = run_stopline("--help", module="stopline.client", timeout=60 * UNIT)
    help_text = " ".join(client.stdout.split())
    assert re.search(r"--max-tokens MAX_TOKENS \w+", help_text) and re.search(
        r"--temperature TEMPERATURE \w+", help_text
    )
    assert "(default: " in help_text


# --- Ctrl-C during the first start --------------------------------------------------------------


@pytest.mark.slow
def test_ctrl_c_during_the_first_start_leaves_no_partial_file_and_exits_130(tmp_path):
    wheel = settings.cache_dir() / "wheels" / model.WHEEL_FILENAME
    if not wheel.is_file():
        pytest.skip("the downloaded wheel is not in the cache")
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    shutil.copyfile(wheel, cache / "wheels" / model.WHEEL_FILENAME)
    child = in_terminal("--port", "0", "--engine", "ctransformers", env={"STOPLINE_CACHE_DIR": str(cache)})
    try:
        # Mid-way: the extraction, or the conversion that follows it.
        child.expect(r"(Extracting|Converting) SmolLM2-135M-Instruct\.Q4_1\.gguf:\s+\d+%")
        assert list(cache.rglob("*.part")), "interrupted too late: nothing was being written"
        child.sendintr()
        child.expect(r"startup interrupted: signal=SIGINT")
        after = child.read()  # up to the end
    finally:
        child.close()
    assert child.signalstatus is None and child.exitstatus == 130
    assert list(cache.rglob("*.part")) == []
    # The progress bar stopped with the interrupt.
    assert "%|" not in after, after


def test_without_a_compiler_the_first_start_says_which_and_names_the_engine_that_needs_none(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    gguf = model.original_gguf_path(progress=False)
    (cache / gguf.name).symlink_to(gguf)
    result = run_stopline(
        "--port",
        "0",
        "--http-port",
        "0",
        env={"STOPLINE_CACHE_DIR": str(cache), "CXX": "no-compiler-here"},
        timeout=60 * UNIT,
    )
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert "no no-compiler-here" in line and "install g++" in line and "--engine ctransformers" in line
    # Nothing was fetched for a build that could not run.
    assert sorted(p.name for p in cache.iterdir()) == [gguf.name]


# --- the loading thread --------------------------------------------------------------------------


async def test_every_failure_on_the_loading_thread_reaches_the_caller():
    loop = asyncio.get_running_loop()

    def raises(error: BaseException):
        def work():
            raise error

        return work

    # StopIteration cannot be set on a Future: it arrives as a RuntimeError instead of hanging.
    with pytest.raises(RuntimeError, match="StopIteration"):
        await asyncio.wait_for(_in_daemon_thread(loop, raises(StopIteration())), 10 * UNIT)
    with pytest.raises(KeyError):
        await asyncio.wait_for(_in_daemon_thread(loop, raises(KeyError("x"))), 10 * UNIT)
    assert await asyncio.wait_for(_in_daemon_thread(loop, lambda: 42), 10 * UNIT) == 42


# --- the default threads ---------------------------------------------------------------------------


async def test_a_generation_alone_gets_every_core_and_users_together_share_them(engine, monkeypatch):
    # The engine's threads are the machine's cores here (the session engine has one).
    monkeypatch.setattr(engine, "threads", 2)
    started = []
    real_start = type(engine).start

    def start(self, *args, **kwargs):
        started.append(kwargs["threads"])
        return real_start(self, *args, **kwargs)

    async def ask(client, request_id: str) -> None:
        await client.generate(request_id, messages=CHAT_FRANCE, max_tokens=4, temperature=0)
        await client.terminal(request_id)

    def running_threads(server) -> list[int]:
        return [stream.generation.threads for stream in server.scheduler._running.values()]

    monkeypatch.setattr(type(engine), "start", start)
    # An otherwise idle machine; how busy this one is depends on who else uses it.
    monkeypatch.setattr(cores.MachineLoad, "others", lambda self: 0.0)
    # Generations on contexts of their own share the cores; shared steps give every step all of them.
    async with running_server(engine, workers=2, batching="per_slot") as server, client_for(server) as client:
        await ask(client, "alone")
        await client.generate("first", messages=LONG_ANSWER, max_tokens=400, temperature=0)
        await client.recv_until(lambda f: f["type"] == "token" and f["id"] == "first")
        assert running_threads(server) == [2]
        # A second user: both run on one core each from their next step...
        await client.generate("second", messages=LONG_ANSWER, max_tokens=400, temperature=0)
        await client.recv_until(lambda f: f["type"] == "token" and f["id"] == "second")
        assert running_threads(server) == [1, 1]
        await client.send({"type": "cancel", "id": "second"})
        await client.terminal("second")
        # ...and the first takes every core back once it is alone again.
        assert running_threads(server) == [2]
        await client.send({"type": "cancel", "id": "first"})
        await client.terminal("first")
        await ask(client, "later")
    assert started == [2, 2, 1, 2]
    # A core kept busy by another process is left to it: more threads than free cores spin.
    started.clear()
    monkeypatch.setattr(cores.MachineLoad, "others", lambda self: 1.0)
    async with running_server(engine, workers=2) as server, client_for(server) as client:
        await ask(client, "beside another process")
    assert started == [1]
    # With --threads, every generation gets that many.
    started.clear()
    async with running_server(engine, workers=2, threads=1) as server, client_for(server) as client:
        await ask(client, "fixed")
    assert started == [1]


def test_the_load_of_other_processes_leaves_out_this_ones_own(monkeypatch):
    # (wall clock, CPU seconds of every process, CPU seconds of this one)
    samples = iter(
        [
            (1000.0, 0.0, 0.0),
            # Half a second of this process on one core and another on the other.
            (1000.5, 1.0, 0.5),
            # Too soon to measure anything: the last figure stands.
            (1000.6, 1.1, 0.6),
            # This process on both cores, and nothing else.
            (1001.0, 2.0, 1.5),
            # After a long gap (the process was stopped): no figure from it...
            (1030.0, 60.0, 1.5),
            # ...and the next look measures from its end.
            (1030.5, 60.1, 1.6),
        ]
    )
    monkeypatch.setattr(cores, "_cpu_sample", lambda: next(samples))
    machine = cores.MachineLoad()
    assert [machine.others() for _ in range(5)] == pytest.approx([1.0, 1.0, 0.0, 0.0, 0.0])


def test_work_at_a_lowered_priority_is_busy_only_for_a_niced_server():
    # cpu  user nice system idle iowait irq softirq steal, in clock ticks
    line = b"cpu  100 300 50 9000 7 2 3 11 0 0\n"
    ticks = cores._CLOCK_TICKS
    assert cores.busy_seconds(line, niced=False) == pytest.approx(155 / ticks)
    assert cores.busy_seconds(line, niced=True) == pytest.approx(455 / ticks)


def test_the_machine_busy_time_counts_other_processes():
    first = cores._cpu_sample()
    subprocess.run([sys.executable, "-c", "import time\nend = time.time() + 1\nwhile time.time() < end: pass"])
    second = cores._cpu_sample()
    machine, own = second[1] - first[1], second[2] - first[2]
    assert machine - own >= 0.5 and own < 0.2
