"""Every way a generation stops, end to end over a real WebSocket against the real model."""

from __future__ import annotations

import asyncio
import gc
import json
import logging

import pytest
from websockets.asyncio.client import connect

from stopline.observability import ConsoleRenderer
from support import (
    CHAT_FRANCE,
    LONG_ANSWER,
    client_for,
    decode_step_ms,
    fetch_metrics,
    http_get,
    metric_value,
    running_server,
    wait_for,
)

pytestmark = pytest.mark.both_engines(why="every stop path ends in the engine's own loop")


async def test_greedy_chat_streams_tokens_then_done(server, logs):
    async with client_for(server) as client:
        assert client.hello["type"] == "hello" and client.hello["context_length"] == 2048
        accepted = await client.generate("r1", messages=CHAT_FRANCE, temperature=0, max_tokens=32)
        assert accepted.pop("request_id") != "r1" and len(accepted.pop("cancel_token")) >= 32
        prompt_tokens = accepted.pop("prompt_tokens")
        model = server.engine.name
        assert accepted == {"type": "accepted", "id": "r1", "queue_position": 0, "model": model}
        done = await client.terminal("r1")
        tokens = client.tokens("r1")
        assert [t["index"] for t in tokens] == list(range(len(tokens)))
        assert "Paris" in "".join(t["text"] for t in tokens)
        assert done["type"] == "done" and done["tokens_generated"] == len(tokens) and done["model"] == model
        assert done["reason"] == ("max_tokens" if len(tokens) == 32 else "eos")
        assert done["prompt_tokens"] == prompt_tokens > 20
        assert done["ttft_ms"] > 0 and done["duration_ms"] >= done["ttft_ms"]
    [end] = logs.records("generation_done", id="r1")
    assert end["tokens_wasted"] == 0 and end["prompt_tokens_evaluated"] == done["prompt_tokens"]


async def test_one_speed_in_the_frame_the_log_and_the_console(server, logs):
    # A long prompt and a short answer: all the tokens over the whole duration would give a
    # figure several times lower than the decode speed, which is the one shown everywhere.
    prompt = "The history of bread is long. " * 120
    async with client_for(server) as client:
        await client.generate("r1", prompt=prompt, temperature=0, max_tokens=12)
        done = await client.terminal("r1")
    assert done["tokens_generated"] == 12
    decoding_s = (done["duration_ms"] - done["ttft_ms"]) / 1000
    assert done["tokens_per_s"] == pytest.approx(11 / decoding_s, abs=0.05)
    assert done["tokens_per_s"] > 2 * 12 / (done["duration_ms"] / 1000)
    [end] = logs.records("generation_done", id="r1")
    assert end["tokens_per_s"] == done["tokens_per_s"]
    line = ConsoleRenderer()(None, "info", end)
    assert line.endswith(f"{done['tokens_per_s']:.1f} tokens/s"), line


async def test_cancel_during_decode(server, logs):
    async with client_for(server) as client:
        await client.generate("r1", messages=LONG_ANSWER, max_tokens=500)
        await client.recv_until(lambda f: f["type"] == "token" and f["index"] == 4)
        await client.send({"type": "cancel", "id": "r1"})
        cancelled = await client.terminal("r1")
        assert cancelled["type"] == "cancelled" and cancelled["reason"] == "user_cancelled"
        assert cancelled["tokens_after_cancel"] <= 1
        assert 5 <= cancelled["tokens_generated"] < 500
        assert len(client.tokens("r1")) == cancelled["tokens_generated"]
        assert cancelled["cancel_latency_ms"] >= 0
    [end] = logs.records("generation_cancelled", id="r1")
    assert end["reason"] == "user_cancelled" and end["cancel_latency_ms"] == cancelled["cancel_latency_ms"]
    assert end["tokens_wasted"] == end["prompt_tokens_evaluated"] + end["tokens_generated"]
    # What bounds a stop: the longest graph node of the prompt and of decode.
    assert end["longest_prefill_node_ms"] > 0 and end["longest_decode_node_ms"] > 0


async def test_cancel_during_prefill_stops_within_one_chunk(server, logs):
    long_prompt = "The history of bread is long. " * 220  # about 1,500 tokens
    async with client_for(server) as client:
        await client.generate("r1", prompt=long_prompt, max_tokens=16)
        # Its prompt takes seconds: once it holds a slot, it is evaluating the prompt.
        await wait_for(lambda: server.scheduler.active == 1)
        await client.send({"type": "cancel", "id": "r1"})
        cancelled = await client.terminal("r1")
        assert cancelled["type"] == "cancelled" and cancelled["tokens_generated"] == 0
        assert client.tokens("r1") == []
    [end] = logs.records("generation_cancelled", id="r1")
    assert end["prompt_tokens_evaluated"] < end["prompt_tokens"]
    # What the stop threw away: the chunk it cut short, if it came inside one, and that chunk's time.
    wasted = cancelled["prompt_tokens_wasted"]
    assert wasted == end["prompt_tokens_wasted"] and (wasted > 0) == (cancelled["wasted_eval_ms"] > 0)
    assert cancelled["tokens_wasted"] == end["prompt_tokens_evaluated"] + wasted
    metrics = await fetch_metrics(server)
    assert metric_value(metrics, "stopline_requests_total", outcome="cancelled", reason="user_cancelled") == 1
    assert metric_value(metrics, "stopline_prompt_tokens_wasted_total", outcome="cancelled") == wasted


async def test_cancel_while_queued_computes_nothing(server, logs):
    busy = [f"busy{i}" for i in range(server.scheduler.workers)]
    async with client_for(server) as client:
        for request_id in busy:
            await client.generate(request_id, messages=LONG_ANSWER, max_tokens=400)
        queued = await client.generate("q", messages=CHAT_FRANCE)
        assert queued["queue_position"] == 1
        await client.send({"type": "cancel", "id": "q"})
        cancelled = await client.terminal("q")
        assert cancelled["type"] == "cancelled" and cancelled["tokens_generated"] == 0
        assert cancelled["tokens_after_cancel"] == 0
        [end] = logs.records("generation_cancelled", id="q")
        assert end["prompt_tokens_evaluated"] == 0 and end["tokens_wasted"] == 0
        assert cancelled["prompt_tokens_wasted"] == 0 and cancelled["wasted_eval_ms"] == 0
        for request_id in busy:
            await client.send({"type": "cancel", "id": request_id})
            assert (await client.terminal(request_id))["type"] == "cancelled"


async def test_freed_slot_starts_the_next_queued_request_at_once(server, logs):
    others = [f"b{i}" for i in range(server.scheduler.workers - 1)]
    async with client_for(server) as client:
        for request_id in ("a", *others):
            await client.generate(request_id, messages=LONG_ANSWER, max_tokens=400)
        assert (await client.generate("c", messages=CHAT_FRANCE, temperature=0))["queue_position"] == 1
        await client.recv_until(lambda f: f["type"] == "token" and f["id"] == "a")
        await client.send({"type": "cancel", "id": "a"})
        await client.terminal("a")
        assert (await client.terminal("c"))["type"] == "done"
        for request_id in others:
            await client.send({"type": "cancel", "id": request_id})
            await client.terminal(request_id)
    [a_end] = logs.records("generation_cancelled", id="a")
    [c_end] = logs.records("generation_done", id="c")
    # c waited exactly as long as a ran: it started when a's loop exited, within a decode step.
    assert c_end["queue_ms"] <= a_end["duration_ms"] + decode_step_ms(c_end)


async def test_client_disconnect_stops_every_request_of_the_connection(server, logs):
    async with client_for(server) as client:
        await client.generate("d1", messages=LONG_ANSWER, max_tokens=500)
        await client.generate("d2", messages=LONG_ANSWER, max_tokens=500)
        await client.recv_until(lambda f: f["type"] == "token" and f["id"] == "d1" and f["index"] >= 3)
    # The socket is closed: both generations stop within one decode step.
    await wait_for(lambda: len(logs.records("generation_cancelled", reason="client_disconnected")) >= 2)
    for request_id in ("d1", "d2"):
        [end] = logs.records("generation_cancelled", id=request_id)
        assert end["reason"] == "client_disconnected" and end["tokens_after_cancel"] <= 1
        assert end["tokens_generated"] < 500
    assert server.scheduler.active == 0
    metrics = await fetch_metrics(server)
    assert metric_value(metrics, "stopline_requests_total", outcome="cancelled", reason="client_disconnected") == 2
    assert metric_value(metrics, "stopline_active_generations") == 0


async def test_clients_that_leave_at_once_leave_no_task_behind(engine):
    """200 clients, on the WebSocket and over HTTP, each send a long prompt and leave while
    it is tokenized or evaluated: every task their sessions started has ended when they
    are gone, so asyncio destroys none still pending."""
    destroyed: list[str] = []

    class Pending(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "destroyed but it is pending" in record.getMessage():
                destroyed.append(record.getMessage())

    handler = Pending()
    logging.getLogger("asyncio").addHandler(handler)
    prompt = "Tell me everything about the sea. " * 200
    body = json.dumps({"prompt": prompt}).encode()
    try:
        async with running_server(engine, max_queue=64) as server:
            host, port = "127.0.0.1", int(server.http.base_url.rsplit(":", 1)[1].split("/")[0])
            for cycle in range(100):
                async with connect(server.ws_url) as websocket:
                    await websocket.recv()  # the greeting
                    await websocket.send(json.dumps({"type": "generate", "id": f"c{cycle}", "prompt": prompt}))
                # An HTTP client that sends its request and closes the connection at once.
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(
                    f"POST /v1/generations HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
                writer.close()
                await writer.wait_closed()
            await wait_for(lambda: server.scheduler.active == 0 and not server.sessions, timeout=60)
        gc.collect()
    finally:
        logging.getLogger("asyncio").removeHandler(handler)
    assert destroyed == []


async def test_a_serving_server_keeps_its_startup_heap_out_of_full_collections(engine):
    """Everything built before the server serves lives as long as it: it is frozen, so a full
    collection, which runs on whichever thread allocates when it falls due, walks only what
    came after. Shutdown hands it back to the collector."""
    gc.collect()
    built_before = len(gc.get_objects())
    async with running_server(engine) as server, client_for(server) as client:
        # gc.get_objects() leaves out the frozen objects.
        assert gc.get_freeze_count() >= built_before and len(gc.get_objects()) < gc.get_freeze_count() / 10
        await client.generate("r1", messages=CHAT_FRANCE, max_tokens=4)
        assert (await client.terminal("r1"))["type"] == "done"
    assert gc.get_freeze_count() == 0


# A four-token raw prompt: its prefill is short, so a deadline lands in decode.
STORY_START = "Once upon a time"


async def test_total_timeout_default_override_and_cap(engine, logs):
    async with running_server(engine, default_timeout_s=0.4, max_timeout_s=0.8) as server:
        async with client_for(server) as client:
            # A first request pays for warming the model, so none of the deadlines below
            # runs out before its first token on a loaded machine.
            await client.generate("warm", prompt=STORY_START, max_tokens=2)
            await client.terminal("warm")
            # The server default applies.
            await client.generate("t1", prompt=STORY_START, max_tokens=2000)
            t1 = await client.terminal("t1")
            # A request may shorten it...
            await client.generate("t2", prompt=STORY_START, max_tokens=2000, timeout_s=0.25)
            t2 = await client.terminal("t2")
            # ...but not lengthen it past the server's cap.
            await client.generate("t3", prompt=STORY_START, max_tokens=2000, timeout_s=100)
            t3 = await client.terminal("t3")
    for frame, deadline_ms in ((t1, 400), (t2, 250), (t3, 800)):
        assert frame["type"] == "timeout" and frame["reason"] == "total_timeout", frame
        assert frame["tokens_generated"] > 0
        # It fires at the deadline, not before, and within a few decode steps after.
        [end] = logs.records("generation_timeout", id=frame["id"])
        assert deadline_ms <= frame["duration_ms"] <= deadline_ms + 5 * decode_step_ms(end), (frame, end)


async def test_first_token_timeout_stops_prefill(engine, logs):
    long_prompt = "The history of bread is long. " * 220
    async with running_server(engine, default_ttft_timeout_s=0.3) as server:
        async with client_for(server) as client:
            # The unit for how late a deadline may fire: a decode step on this machine, now.
            await client.generate("step", prompt=STORY_START, max_tokens=8, temperature=0)
            await client.terminal("step")
            [reference] = logs.records("generation_done", id="step")
            await client.generate("f1", prompt=long_prompt, max_tokens=8)
            f1 = await client.terminal("f1")
            await client.generate("f2", prompt=long_prompt, max_tokens=8, ttft_timeout_s=0.15)
            f2 = await client.terminal("f2")
    for frame, deadline_ms in ((f1, 300), (f2, 150)):
        assert frame["type"] == "timeout" and frame["reason"] == "first_token_timeout", frame
        assert frame["tokens_generated"] == 0
        # Stopped between two graph nodes of a prompt chunk: a node takes less than a decode step.
        assert deadline_ms <= frame["duration_ms"] <= deadline_ms + 5 * decode_step_ms(reference), frame
    [end] = logs.records("generation_timeout", id="f2")
    assert end["prompt_tokens_evaluated"] < end["prompt_tokens"]


async def test_timeout_while_queued_never_takes_a_slot(engine, logs):
    async with running_server(engine, workers=1) as server:
        async with client_for(server) as client:
            await client.generate("long", messages=LONG_ANSWER, max_tokens=400)
            await client.generate("waits", messages=CHAT_FRANCE, timeout_s=0.2)
            waits = await client.terminal("waits")
            assert waits["type"] == "timeout" and waits["reason"] == "total_timeout"
            assert waits["tokens_generated"] == 0
            await client.send({"type": "cancel", "id": "long"})
            await client.terminal("long")
    [end] = logs.records("generation_timeout", id="waits")
    assert end["prompt_tokens_evaluated"] == 0


async def test_cancel_racing_finish_gives_exactly_one_terminal_message(server):
    async with client_for(server) as client:
        for attempt in range(12):
            request_id = f"race{attempt}"
            await client.generate(request_id, prompt="Count: one, two, three,", max_tokens=3)
            # Cancel as the last tokens arrive: sometimes the cancel wins, sometimes the finish.
            first = await client.recv_until(
                lambda f: (
                    f["id"] == request_id
                    and (f["type"] == "done" or (f["type"] == "token" and f["index"] >= attempt % 3))
                )
            )
            await client.send({"type": "cancel", "id": request_id})
            terminal = first if first["type"] == "done" else await client.terminal(request_id)
            if terminal["type"] != "cancelled":
                ack = await client.recv_until(lambda f: f["type"] == "cancel_ack" and f["id"] == request_id)
                assert ack["status"] == {"done": "finished"}.get(terminal["type"], terminal["type"])
        # Drain: nothing else may arrive for any of them.
        await client.send({"type": "cancel", "id": "sentinel"})
        await client.recv_until(lambda f: f["type"] == "cancel_ack" and f["id"] == "sentinel")
        for attempt in range(12):
            request_id = f"race{attempt}"
            terminals = [
                f
                for f in client.frames
                if f.get("id") == request_id and f["type"] in ("done", "cancelled", "timeout", "error")
            ]
            assert len(terminals) == 1, terminals


async def test_late_and_repeated_cancels_are_acknowledged_not_errors(server):
    async with client_for(server) as client:
        await client.send({"type": "cancel", "id": "never-sent"})
        assert await client.recv() == {"type": "cancel_ack", "id": "never-sent", "status": "unknown"}
        await client.generate("fin", messages=CHAT_FRANCE, temperature=0, max_tokens=4)
        await client.terminal("fin")
        await client.send({"type": "cancel", "id": "fin"})
        assert await client.recv() == {"type": "cancel_ack", "id": "fin", "status": "finished"}
        await client.generate("twice", messages=LONG_ANSWER, max_tokens=300)
        await client.send({"type": "cancel", "id": "twice"})
        await client.send({"type": "cancel", "id": "twice"})
        terminal = await client.terminal("twice")
        assert terminal["type"] == "cancelled"
        # The second cancel found the request already stopping; it is answered once the outcome is known.
        await client.recv_until(lambda f: f["type"] == "cancel_ack" and f["id"] == "twice")
        assert client.frames.index(terminal) < len(client.frames) - 1
        acks = [f for f in client.frames if f["type"] == "cancel_ack" and f["id"] == "twice"]
        assert acks == [{"type": "cancel_ack", "id": "twice", "status": "cancelled"}]


async def test_a_connection_cannot_cancel_or_see_another_connections_request(server):
    async with client_for(server) as owner, client_for(server) as stranger:
        await owner.generate("mine", messages=CHAT_FRANCE, temperature=0, max_tokens=16)
        await stranger.send({"type": "cancel", "id": "mine"})
        assert await stranger.recv() == {"type": "cancel_ack", "id": "mine", "status": "unknown"}
        assert (await owner.terminal("mine"))["type"] == "done"
        # The stranger saw nothing of it.
        await stranger.send({"type": "cancel", "id": "probe"})
        await stranger.recv()
        assert all(f.get("id") != "mine" or f["type"] == "cancel_ack" for f in stranger.frames)


async def test_shared_ids_on_two_connections_do_not_collide(server):
    async with client_for(server) as a, client_for(server) as b:
        await a.generate("same", messages=CHAT_FRANCE, temperature=0, max_tokens=8)
        await b.generate("same", messages=LONG_ANSWER, max_tokens=300)
        await b.send({"type": "cancel", "id": "same"})
        assert (await b.terminal("same"))["type"] == "cancelled"
        assert (await a.terminal("same"))["type"] == "done"


async def test_server_assigns_ids_when_the_client_does_not(server):
    async with client_for(server) as client:
        await client.send({"type": "generate", "messages": CHAT_FRANCE, "max_tokens": 2})
        accepted = await client.recv()
        assert accepted["type"] == "accepted" and len(accepted["id"]) == 36
        assert accepted["request_id"] == accepted["id"]  # one id is enough
        assert (await client.terminal(accepted["id"]))["type"] == "done"


@pytest.mark.slow
async def test_event_loop_stays_responsive_while_every_slot_generates(server, logs):
    async with client_for(server) as client:
        await client.generate("x1", messages=LONG_ANSWER, max_tokens=300)
        await client.generate("x2", messages=LONG_ANSWER, max_tokens=300)
        decoding = set()

        def both_decoding(frame) -> bool:
            # Each request past its second token, so each one's record gives a decode step.
            if frame["type"] == "token" and frame["index"] >= 2:
                decoding.add(frame["id"])
            return decoding == {"x1", "x2"}

        await client.recv_until(both_decoding)
        # Timer overshoot on the server's own loop while both slots decode.
        overshoots = []
        for _ in range(50):
            start = asyncio.get_running_loop().time()
            await asyncio.sleep(0.005)
            overshoots.append(asyncio.get_running_loop().time() - start - 0.005)
        status, body = await http_get_healthz(server)
        assert status == 200 and '"active": 2' in body
        for request_id in ("x1", "x2"):
            await client.send({"type": "cancel", "id": request_id})
            await client.terminal(request_id)
    overshoots.sort()
    # Bounded in decode steps: the loop is never blocked for one.
    step_s = min(decode_step_ms(r) for r in logs.records("generation_cancelled")) / 1000
    assert overshoots[len(overshoots) // 2] < step_s, (overshoots, step_s)


async def http_get_healthz(server):
    return await http_get(server, "/healthz")
