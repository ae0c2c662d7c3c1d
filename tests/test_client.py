"""The terminal client against a real server: one-shot answers, the interactive chat in a
pseudo-terminal (pexpect), Ctrl-C, Ctrl-D, commands, URLs and one-line failures."""

from __future__ import annotations

import asyncio
import http.server
import os
import re
import signal
import subprocess
import threading

import pexpect
import pytest

from bench.launch import ROOT, module_command, run_stopline
from stopline.client import UsageError, summary, websocket_url
from stopline.protocol.frames import Terminal
from stopline.protocol.requests import Ending
from stopline.protocol.vocabulary import Outcome, Reason
from stopline.settings import client_url
from support import UNIT, fetch_metrics, metric_value, running_server

LONG_STORY = "Write a very long story about a dragon."
PROMPT = "\r\n> "


def env(**extra) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith("STOPLINE_")}
    return {**base, "PYTHONUNBUFFERED": "1", "TERM": "dumb", **extra}


async def in_thread(function, *args, **kwargs):
    # pexpect blocks; the server under test runs on this event loop and must keep running.
    return await asyncio.to_thread(function, *args, **kwargs)


def spawn(*args, **environ) -> pexpect.spawn:
    command = module_command("stopline.client", *args)
    child = pexpect.spawn(
        command[0],
        command[1:],
        cwd=str(ROOT),
        env=env(**environ),
        encoding="utf-8",
        timeout=60 * UNIT,
        dimensions=(40, 200),
        # As a terminal would: a test run started in the background of a
        # non-interactive shell ignores SIGINT, and a child inherits that.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    return child


async def expect(child, pattern, timeout=60):
    return await in_thread(child.expect, pattern, timeout=timeout * UNIT)


async def close(child) -> int:
    await in_thread(child.expect, pexpect.EOF, timeout=30 * UNIT)
    child.close()
    return child.exitstatus


# ---------- URLs ----------


@pytest.mark.parametrize(
    "given, expected",
    [
        ("ws://127.0.0.1:8765/ws", "ws://127.0.0.1:8765/ws"),
        ("ws://127.0.0.1:8765", "ws://127.0.0.1:8765/ws"),
        ("http://127.0.0.1:9000", "ws://127.0.0.1:9000/ws"),
        ("http://127.0.0.1:9000/", "ws://127.0.0.1:9000/ws"),
        ("https://chat.example.org/ws", "wss://chat.example.org/ws"),
        ("wss://chat.example.org/", "wss://chat.example.org/ws"),
        ("http://[::1]:9000", "ws://[::1]:9000/ws"),
    ],
)
def test_url_forms(given, expected):
    assert websocket_url(given) == expected


@pytest.mark.parametrize("given", ["ftp://host/", "127.0.0.1:8765", "http://", "http://host:99999", "http://host/api"])
def test_bad_urls_are_refused(given):
    with pytest.raises(UsageError):
        websocket_url(given)


def test_the_summary_reads_the_fields_the_protocol_sends():
    timeout = Terminal(
        "r1", Ending(Outcome.TIMEOUT, Reason.TOTAL_TIMEOUT, tokens_generated=5, duration_ms=1234.0)
    ).json()
    assert summary(timeout) == "[timeout: total_timeout after 1234 ms, 5 tokens]"
    done = Terminal("r2", Ending(Outcome.DONE, Reason.EOS, tokens_generated=3, ttft_ms=12.0, duration_ms=40.0)).json()
    assert summary(done) == "[done: eos, 3 tokens, first token 12 ms, total 40 ms]"


def test_host_and_port_come_from_the_environment():
    assert client_url({}) == "ws://127.0.0.1:8765/ws"
    assert client_url({"STOPLINE_HOST": "localhost", "STOPLINE_PORT": "9100"}) == "ws://localhost:9100/ws"
    assert client_url({"STOPLINE_HOST": "::1"}) == "ws://[::1]:8765/ws"


# ---------- one-line failures ----------


def run_client(*args, **environ) -> subprocess.CompletedProcess:
    return run_stopline(*args, module="stopline.client", env=env(**environ), inherit_env=False, timeout=60 * UNIT)


@pytest.mark.parametrize(
    "args, code, says",
    [
        ([""], 2, "the prompt is empty"),
        (["   "], 2, "the prompt is empty"),
        (["--url", "ftp://127.0.0.1/", "hi"], 2, "bad --url 'ftp://127.0.0.1/'"),
        (["--url", "http://127.0.0.1:1", "hi"], 1, "cannot connect to ws://127.0.0.1:1/ws: connection refused"),
        (["--url", "http://127.0.0.1:1"], 1, "cannot connect to ws://127.0.0.1:1/ws: connection refused"),
    ],
)
def test_failures_are_one_line(args, code, says):
    result = run_client(*args)
    assert result.returncode == code, result
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and says in result.stderr, result.stderr


async def test_the_http_apis_port_names_the_websocket(server):
    # A new user's mistake: --url at the HTTP API. Stopline's answer says where the WebSocket is.
    api_port = int(server.http.base_url.rsplit(":", 1)[1].split("/")[0])
    result = await in_thread(run_client, "--url", f"http://127.0.0.1:{api_port}", "hi")
    assert result.returncode == 1 and result.stdout == "" and result.stderr.count("\n") == 1, result
    websocket = f"ws://127.0.0.1:{server.port}/ws"
    assert f"cannot connect to ws://127.0.0.1:{api_port}/ws: HTTP 404 there, not a WebSocket" in result.stderr
    assert f"this port serves Stopline's HTTP API (/v1); its WebSocket is at {websocket}" in result.stderr


def test_another_servers_404_gets_the_default_layout():
    # A port that is not Stopline's says nothing of where the WebSocket is: the client says what
    # it got and what would work if it were Stopline's HTTP API on its default port.
    class NotFound(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        port = httpd.server_port
        result = run_client("--url", f"ws://127.0.0.1:{port}", "hi")
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result
    assert "HTTP 404 there, not a WebSocket. Stopline's WebSocket is on its --port (8765 by default)" in result.stderr
    assert f"if this is the HTTP API's port, try --url ws://127.0.0.1:{port - 1}/ws" in result.stderr


async def test_one_shot_answer_uses_stopline_port_and_host(server, logs):
    result = await in_thread(
        run_client,
        "What is the capital of France? Answer in one word.",
        "--temperature",
        "0",
        "--max-tokens",
        "32",
        STOPLINE_HOST="127.0.0.1",
        STOPLINE_PORT=str(server.port),
    )
    assert result.returncode == 0, result
    assert "Paris" in result.stdout
    [record] = logs.records("generation_done")
    # EOS ends the answer unless it used all 32 tokens.
    assert record["reason"] == ("max_tokens" if record["tokens_generated"] == 32 else "eos")
    assert result.stderr.startswith(f"[done: {record['reason']}, ") and result.stderr.count("\n") == 1, result.stderr


# ---------- the interactive chat ----------


@pytest.mark.slow
async def test_interactive_chat_keeps_history_and_ctrl_c_stops_the_answer(server, logs):
    child = spawn("--url", server.http_url, "--temperature", "0", "--max-tokens", "400")
    try:
        await expect(child, r"Chatting with SmolLM2-135M-Instruct at ws://127\.0\.0\.1:\d+/ws")
        await expect(child, PROMPT)

        # A first question, answered in full.
        child.sendline("What is the capital of France? Answer in one word.")
        await expect(child, r"\[done: (eos|max_tokens), \d+ tokens")
        await expect(child, PROMPT)
        [first] = logs.records("generation_accepted")

        # Ctrl-C mid-answer: the cancel summary, then the prompt again.
        child.sendline(LONG_STORY)
        await expect(child, re.escape(LONG_STORY) + "\r\n")  # the terminal's echo
        await expect(child, r"\w+ \w+ \w+ \w+ \w+")  # a few words of the story
        child.sendintr()
        await expect(child, r"\[cancelled: user_cancelled, \d+ tokens, [01] after the cancel, stopped in \d+\.\d ms\]")
        await expect(child, PROMPT)
        [cancelled] = logs.records("generation_cancelled")
        assert cancelled["reason"] == "user_cancelled" and cancelled["tokens_after_cancel"] <= 1
        assert 0 < cancelled["tokens_generated"] < 400

        # The conversation so far travels with the next question: both earlier turns are in its prompt.
        child.sendline("Thanks.")
        await expect(child, r"\[done: ")
        await expect(child, PROMPT)
        accepted = logs.records("generation_accepted")
        assert len(accepted) == 3
        second, third = accepted[1], accepted[2]
        assert third["prompt_tokens"] > second["prompt_tokens"] + cancelled["tokens_generated"] > first["prompt_tokens"]

        # /reset forgets it; /system adds a system prompt.
        child.sendline("/reset")
        await expect(child, r"\(conversation cleared\)")
        child.sendline("Thanks.")
        await expect(child, r"\[done: ")
        await expect(child, PROMPT)
        after_reset = logs.records("generation_accepted")[3]
        assert after_reset["prompt_tokens"] < third["prompt_tokens"]
        # (Longer than the template's default system prompt, which it replaces.)
        child.sendline("/system " + "You are a pirate and always answer like a pirate would. " * 6)
        await expect(child, r"\(system prompt set; conversation cleared\)")
        child.sendline("Thanks.")
        await expect(child, r"\[done: ")
        await expect(child, PROMPT)
        with_system = logs.records("generation_accepted")[4]
        assert with_system["prompt_tokens"] > after_reset["prompt_tokens"] + 40

        child.sendline("/help")
        await expect(child, r"/system TEXT.*\r\n.*/reset.*\r\n.*/help")
        child.sendline("/nonsense")
        await expect(child, "unknown command /nonsense; /help lists the commands")
        await expect(child, PROMPT)

        # An empty line sends nothing, and the prompt comes back.
        child.sendline("")
        await at_the_prompt(child)
        assert len(logs.records("generation_accepted")) == 5

        # Ctrl-D at the prompt leaves with 0.
        child.sendeof()
        assert await close(child) == 0
    finally:
        if child.isalive():
            child.kill(signal.SIGKILL)
    text = await fetch_metrics(server)
    assert metric_value(text, "stopline_requests_total", outcome="cancelled", reason="user_cancelled") == 1
    assert metric_value(text, "stopline_requests_total", outcome="done") == 4


# x86_64 system calls in which readline waits for a key: select, pselect6, poll, ppoll.
WAITING_FOR_INPUT = {"23", "270", "7", "271"}


async def at_the_prompt(child) -> None:
    """The prompt is shown and the client waits in readline. A SIGINT sent between
    the prompt being written and readline's wait would stay pending until the next
    key (CPython checks signals only when that wait is interrupted), and a Ctrl-D
    typed before readline sets up the terminal can be lost."""
    await expect(child, PROMPT)

    def waiting() -> None:
        while open(f"/proc/{child.pid}/syscall").read().split()[0] not in WAITING_FOR_INPUT:
            os.sched_yield()

    await asyncio.wait_for(in_thread(waiting), 60 * UNIT)


async def test_ctrl_c_twice_at_the_prompt_leaves(server, logs):
    child = spawn("--url", f"ws://127.0.0.1:{server.port}")
    try:
        await at_the_prompt(child)
        child.sendintr()
        await expect(child, r"\(Ctrl-C again or Ctrl-D to leave\)")
        await at_the_prompt(child)
        child.sendintr()
        assert await close(child) == 0
    finally:
        if child.isalive():
            child.kill(signal.SIGKILL)
    assert not logs.records("generation_accepted")


async def test_the_chat_survives_a_server_that_went_away(engine, logs):
    async with running_server(engine) as server:
        child = spawn(STOPLINE_PORT=str(server.port))
        await expect(child, PROMPT)
    try:
        # The server is gone: the question gets one line, and the chat goes on.
        child.sendline("Hello?")
        await expect(child, r"stopline: cannot connect to ws://127\.0\.0\.1:\d+/ws: connection refused")
        await at_the_prompt(child)
        child.sendeof()
        assert await close(child) == 0
    finally:
        if child.isalive():
            child.kill(signal.SIGKILL)
