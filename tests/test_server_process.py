"""The service as a process: startup, signals, shutdown, and long runs."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import psutil
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from bench.launch import ServerProcess, run_stopline
from support import (
    CHAT_FRANCE,
    LONG_ANSWER,
    UNIT,
    client_for,
    decode_step_ms,
    fetch_metrics,
    metric_value,
    running_server,
    wait_for,
)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_signal_cancels_everything_with_shutdown_and_exits_quickly(sig):
    with ServerProcess("--port", "0", "--workers", "1") as process:
        async with connect((await process.started(120 * UNIT)).ws_url) as ws:
            await ws.recv()  # hello
            for request_id in ("running", "queued"):
                await ws.send(
                    json.dumps({"type": "generate", "id": request_id, "messages": LONG_ANSWER, "max_tokens": 1000})
                )
            frames = []
            # A few tokens in, so that its end record measures a decode step.
            while len([f for f in frames if f["type"] == "token"]) < 3:
                frames.append(json.loads(await ws.recv()))
            process.send_signal(sig)
            with pytest.raises(ConnectionClosed) as closed:
                while True:
                    frames.append(json.loads(await asyncio.wait_for(ws.recv(), 10 * UNIT)))
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
        terminals = {f["id"]: f for f in frames if f["type"] in ("done", "cancelled", "timeout", "error")}
        assert terminals["running"]["type"] == "cancelled" and terminals["running"]["reason"] == "shutdown"
        assert terminals["queued"]["type"] == "cancelled" and terminals["queued"]["reason"] == "shutdown"
        assert terminals["running"]["tokens_after_cancel"] <= 1
        assert await process.ended(10 * UNIT) == 0
        records = process.records
        assert [r["event"] for r in records].count("generation_cancelled") == 2
        assert records[-1]["event"] == "server_stopped"
        # The running generation stopped within a couple of decode steps of the shutdown's cancel.
        [running] = [r for r in records if r["event"] == "generation_cancelled" and r["id"] == "running"]
        assert terminals["running"]["cancel_latency_ms"] < 2 * decode_step_ms(running), (terminals, running)


@pytest.mark.parametrize(
    "args, problem",
    [
        (["--model", "/nonexistent/model.gguf"], "not found"),
        (["--model", "/etc/hostname"], "not a GGUF file"),
    ],
)
async def test_bad_model_fails_to_start_with_a_clear_message(args, problem):
    result = run_stopline("--port", "0", *args, timeout=60 * UNIT)
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1 and problem in result.stderr
    [failure] = [json.loads(line) for line in result.stdout.splitlines() if '"startup_failed"' in line]
    assert problem in failure["error"]


async def test_metrics_count_outcomes_and_give_a_cancellation_rate(server):
    async with client_for(server) as client:
        await client.generate("ok", messages=CHAT_FRANCE, temperature=0, max_tokens=8)
        done = await client.terminal("ok")
        await client.generate("stop", messages=LONG_ANSWER, max_tokens=300)
        await client.recv_until(lambda f: f["type"] == "token" and f["id"] == "stop")
        await client.send({"type": "cancel", "id": "stop"})
        cancelled = await client.terminal("stop")
        await client.send("not json")
        await client.recv()
    text = await fetch_metrics(server)
    total = metric_value(text, "stopline_requests_total")
    assert total == 2
    assert metric_value(text, "stopline_requests_total", outcome="cancelled") / total == 0.5
    assert (
        metric_value(text, "stopline_tokens_generated_total")
        == done["tokens_generated"] + cancelled["tokens_generated"]
    )
    assert metric_value(text, "stopline_tokens_wasted_total", outcome="cancelled", reason="user_cancelled") > 0
    assert metric_value(text, "stopline_cancel_latency_seconds_count", reason="user_cancelled") == 1
    # The histogram resolves a single millisecond.
    assert 'stopline_cancel_latency_seconds_bucket{le="0.001",reason="user_cancelled"}' in text
    assert metric_value(text, "stopline_ttft_seconds_count") == 2
    assert metric_value(text, "stopline_rejected_frames_total", code="invalid_json") == 1
    assert metric_value(text, "stopline_queue_depth") == 0 and metric_value(text, "stopline_active_generations") == 0


@pytest.mark.slow
@pytest.mark.both_engines(why="each engine allocates and frees its own native state")
async def test_connect_generate_disconnect_cycles_leak_nothing(engine):
    """Many short lives of a connection: RSS stays flat, no slot, thread or fd is left behind."""
    cycles = int(os.environ.get("STOPLINE_SOAK_CYCLES", "150"))
    rss = psutil.Process().memory_info
    async with running_server(engine) as server:

        async def one_cycle(i: int):
            async with client_for(server) as client:
                await client.generate(f"s{i}", prompt="Hello", max_tokens=2)
                if i % 2:
                    await client.terminal(f"s{i}")
            # Odd cycles wait for the end; even ones leave mid-generation.

        for i in range(20):
            await one_cycle(i)
        # Generations at once too: the slots' thread pool starts its threads as they are first needed.
        await asyncio.gather(*(one_cycle(1000 + i) for i in range(2 * server.scheduler.workers)))
        threads, fds, before = len(psutil.Process().threads()), len(os.listdir("/proc/self/fd")), rss().rss
        for i in range(cycles):
            await one_cycle(i)
        # The even cycles' generations end once the server sees their connections gone.
        await wait_for(lambda: server.scheduler.active == 0 and server.scheduler.queue_depth == 0)
        await wait_for(lambda: len(os.listdir("/proc/self/fd")) <= fds)
        after = rss().rss
        print(f"RSS before {before / 2**20:.1f} MiB, after {cycles} cycles {after / 2**20:.1f} MiB")
        assert after - before < 32 * 2**20
        assert len(psutil.Process().threads()) <= threads
