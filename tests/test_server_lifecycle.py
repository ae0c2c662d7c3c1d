"""Every way a generation stops, end to end over a real WebSocket against the real model."""

from __future__ import annotations

import asyncio

from conftest import CHAT_FRANCE, LONG_ANSWER, UNIT, client_for, metric_value, running_server


async def test_greedy_chat_streams_tokens_then_done(server, logs):
    async with client_for(server) as client:
        assert client.hello["type"] == "hello" and client.hello["context_length"] == 2048
        accepted = await client.generate("r1", messages=CHAT_FRANCE, temperature=0, max_tokens=32)
        assert accepted == {"type": "accepted", "id": "r1", "queue_position": 0}
        done = await client.terminal("r1")
        tokens = client.tokens("r1")
        assert [t["index"] for t in tokens] == list(range(len(tokens)))
        assert "Paris" in "".join(t["text"] for t in tokens)
        assert done["type"] == "done" and done["reason"] == "eos"
        assert done["tokens_generated"] == len(tokens)
        assert done["prompt_tokens"] > 20 and done["ttft_ms"] > 0 and done["duration_ms"] >= done["ttft_ms"]
    [end] = logs.records("generation_done", request_id="r1")
    assert end["tokens_wasted"] == 0 and end["prompt_tokens_evaluated"] == done["prompt_tokens"]


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
    [end] = logs.records("generation_cancelled", request_id="r1")
    assert end["reason"] == "user_cancelled" and end["latency_ms"] == cancelled["cancel_latency_ms"]
    assert end["tokens_wasted"] == end["prompt_tokens_evaluated"] + end["tokens_generated"]


async def test_cancel_during_prefill_stops_within_one_chunk(server):
    long_prompt = "The history of bread is long. " * 220  # about 1,500 tokens
    async with client_for(server) as client:
        await client.generate("r1", prompt=long_prompt, max_tokens=16)
        await asyncio.sleep(0.3 * UNIT)
        await client.send({"type": "cancel", "id": "r1"})
        cancelled = await client.terminal("r1")
        assert cancelled["type"] == "cancelled" and cancelled["tokens_generated"] == 0
        assert client.tokens("r1") == []
    metrics = await _metrics(server)
    assert metric_value(metrics, "stopline_requests_total", outcome="cancelled", reason="user_cancelled") == 1


async def _metrics(server) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    data = await reader.read()
    writer.close()
    return data.decode().partition("\r\n\r\n")[2]
