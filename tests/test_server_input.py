"""Bad input gets an error with a stable code; nothing crashes, nothing leaks."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import connect
from websockets.client import ClientProtocol
from websockets.exceptions import ConnectionClosedError, InvalidStatus
from websockets.uri import parse_uri

from support import (
    CHAT_FRANCE,
    LONG_ANSWER,
    client_for,
    fetch_metrics,
    http_get,
    metric_value,
    running_server,
    wait_for,
)

pytestmark = pytest.mark.both_engines(
    why="input that could kill the process is checked before each engine's native call"
)

BAD_FRAMES = [
    ("not json", "invalid_json"),
    ("[1, 2, 3]", "invalid_frame"),
    ('"generate"', "invalid_frame"),
    ("{}", "invalid_frame"),
    ('{"type": 7}', "invalid_frame"),
    ('{"type": "explode"}', "unknown_type"),
    ('{"type": "generate"}', "invalid_field"),
    ('{"type": "generate", "prompt": "a", "messages": []}', "invalid_field"),
    ('{"type": "generate", "prompt": 12}', "invalid_field"),
    ('{"type": "generate", "prompt": ""}', "invalid_field"),
    ('{"type": "generate", "messages": [{"role": "wizard", "content": "x"}]}', "invalid_field"),
    ('{"type": "generate", "messages": "hi"}', "invalid_field"),
    ('{"type": "generate", "prompt": "a", "max_tokens": -1}', "invalid_field"),
    ('{"type": "generate", "prompt": "a", "max_tokens": 1e12}', "invalid_field"),
    ('{"type": "generate", "prompt": "a", "max_tokens": 2.5}', "invalid_field"),
    ('{"type": "generate", "prompt": "a", "max_tokens": true}', "invalid_field"),
    ('{"type": "generate", "prompt": "a", "temperature": "hot"}', "invalid_field"),
    ('{"type": "generate", "prompt": "a", "temperature": -0.1}', "invalid_field"),
    ('{"type": "generate", "prompt": "a", "top_p": 0}', "invalid_field"),
    ('{"type": "generate", "prompt": "a", "timeout_s": 0}', "invalid_field"),
    ('{"type": "generate", "prompt": "a", "timeout_s": -5}', "invalid_field"),
    ('{"type": "generate", "prompt": "a", "seed": -1}', "invalid_field"),
    ('{"type": "generate", "prompt": "a", "stop": [1]}', "invalid_field"),
    ('{"type": "generate", "prompt": "a", "stop": ["a", "b", "c", "d", "e"]}', "invalid_field"),
    ('{"type": "generate", "prompt": "a", "id": ""}', "invalid_field"),
    ('{"type": "generate", "prompt": "a", "id": 5}', "invalid_field"),
    ('{"type": "cancel"}', "invalid_field"),
    ('{"type": "cancel", "id": ["x"]}', "invalid_field"),
]


@pytest.mark.parametrize("raw, code", BAD_FRAMES)
async def test_bad_frame_gets_a_stable_error_code_and_the_connection_stays_open(server, raw, code):
    async with client_for(server) as client:
        await client.send(raw)
        error = await client.recv()
        assert error["type"] == "error" and error["code"] == code, error
        assert error["message"]
        # The same connection still works: its next frame gets its answer.
        await client.send({"type": "cancel", "id": "probe"})
        answer = await client.recv()
        assert (answer["type"], answer["id"]) == ("cancel_ack", "probe"), answer


async def test_binary_frame_is_rejected(server):
    async with client_for(server) as client:
        await client.send(b"\x00\x01binary")
        error = await client.recv()
        assert error["code"] == "binary_frame"
        await client.send({"type": "cancel", "id": "x"})
        assert (await client.recv())["type"] == "cancel_ack"


async def test_prompt_longer_than_the_context_is_rejected_before_a_slot(server):
    async with client_for(server) as client:
        error = await client.generate("big", prompt="bread " * 3000)
        assert error["type"] == "error" and error["code"] == "prompt_too_long" and error["id"] == "big"
        assert "2048" in error["message"]
    assert server.scheduler.active == 0


async def test_duplicate_live_id_is_rejected(server):
    async with client_for(server) as client:
        await client.generate("dup", messages=LONG_ANSWER, max_tokens=300)
        error = await client.generate("dup", messages=CHAT_FRANCE)
        assert error["type"] == "error" and error["code"] == "duplicate_id"
        await client.send({"type": "cancel", "id": "dup"})
        assert (await client.terminal("dup"))["type"] == "cancelled"
        # Once it has ended, the id may be used again.
        assert (await client.generate("dup", messages=CHAT_FRANCE, max_tokens=2))["type"] == "accepted"
        await client.terminal("dup")


async def test_per_connection_cap_and_full_queue(engine):
    async with running_server(engine, workers=1, max_queue=1, requests_per_connection=3) as server:
        async with client_for(server) as first, client_for(server) as second:
            await first.generate("a", messages=LONG_ANSWER, max_tokens=300)
            assert (await first.generate("b", messages=LONG_ANSWER))["queue_position"] == 1
            busy = await second.generate("c", messages=CHAT_FRANCE)
            assert busy["type"] == "error" and busy["code"] == "busy"
            # The queue is bounded, and so is each connection.
            await first.send({"type": "generate", "id": "d", "messages": CHAT_FRANCE})
            assert (await first.recv_until(lambda f: f.get("id") == "d"))["code"] == "busy"
            for request_id in ("a", "b"):
                await first.send({"type": "cancel", "id": request_id})
                await first.terminal(request_id)
        metrics = await fetch_metrics(server)
        assert metric_value(metrics, "stopline_requests_total", outcome="error", reason="busy") == 2
    async with running_server(engine, workers=2, max_queue=8, requests_per_connection=2) as server:
        async with client_for(server) as client:
            await client.generate("a", messages=LONG_ANSWER, max_tokens=300)
            await client.generate("b", messages=LONG_ANSWER, max_tokens=300)
            capped = await client.generate("c", messages=CHAT_FRANCE)
            assert capped["code"] == "too_many_requests"
            for request_id in ("a", "b"):
                await client.send({"type": "cancel", "id": request_id})
                await client.terminal(request_id)


async def test_flood_is_rate_limited(engine):
    async with running_server(engine, frames_per_second=20, frame_burst=10) as server:
        async with client_for(server) as client:
            for i in range(60):
                await client.send({"type": "cancel", "id": f"f{i}"})
            frames = [await client.recv() for _ in range(11)]
            acks = [f for f in frames if f["type"] == "cancel_ack"]
            limited = [f for f in frames if f["type"] == "error"]
            assert len(acks) == 10 and [f["code"] for f in limited] == ["rate_limited"]
            # Dropped frames get no answer; after a pause the bucket refills.
            await asyncio.sleep(0.5)
            await client.send({"type": "cancel", "id": "after"})
            assert await client.recv_until(lambda f: f.get("id") == "after")


async def test_oversized_frame_closes_with_1009(server):
    async with client_for(server) as client:
        await client.send(json.dumps({"type": "generate", "prompt": "x" * (2 << 20)}))
        with pytest.raises(ConnectionClosedError) as closed:
            await client.recv()
        assert closed.value.rcvd.code == 1009
    assert server.scheduler.active == 0


async def test_origin_allow_list(engine):
    async with running_server(engine, allowed_origins=("http://localhost:3000",)) as server:
        async with connect(server.ws_url, origin="http://localhost:3000") as ws:
            assert json.loads(await ws.recv())["type"] == "hello"
        async with connect(server.ws_url, origin=f"http://127.0.0.1:{server.port}") as ws:
            assert json.loads(await ws.recv())["type"] == "hello"
        # Same origin means the same host and port: another local port is another site.
        with pytest.raises(InvalidStatus) as rejected:
            async with connect(server.ws_url, origin="http://localhost:3001"):
                pass
        assert rejected.value.response.status_code == 403


async def test_cross_site_origin_is_refused(server):
    # A page on another site may not drive a user's local server (cross-site WebSocket hijacking).
    with pytest.raises(InvalidStatus) as rejected:
        async with connect(server.ws_url, origin="https://evil.example"):
            pass
    assert rejected.value.response.status_code == 403


async def test_http_routes(server):
    status, body = await http_get(server, "/healthz")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, body = await http_get(server, "/")
    assert status == 200 and "<html" in body.lower()
    status, _ = await http_get(server, "/app.js")
    assert status == 200
    for path in ("/../pyproject.toml", "/nope", "/%2e%2e/README.md"):
        status, _ = await http_get(server, path)
        assert status == 404, path


@pytest.mark.slow
async def test_slow_consumer_is_cancelled_and_memory_stays_bounded(engine, logs):
    async with running_server(
        engine, slow_consumer_grace_s=0.5, window=8, write_limit=1024, socket_send_buffer=4096
    ) as server:
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setblocking(False)
        # A tiny receive window; after the handshake this client never reads again.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        await loop.sock_connect(sock, ("127.0.0.1", server.port))
        protocol = ClientProtocol(parse_uri(server.ws_url))
        protocol.send_request(protocol.connect())
        await loop.sock_sendall(sock, b"".join(protocol.data_to_send()))
        while protocol.handshake_exc is None and not protocol.events_received():
            protocol.receive_data(await loop.sock_recv(sock, 1))
        try:
            for i in range(2):
                protocol.send_text(
                    json.dumps(
                        {
                            "type": "generate",
                            "id": f"slow{i}",
                            "messages": LONG_ANSWER,
                            "max_tokens": 2000,
                            # Greedy, so neither generation can end by itself before the server cancels it.
                            "temperature": 0,
                        }
                    ).encode()
                )
            await loop.sock_sendall(sock, b"".join(protocol.data_to_send()))

            def both_cancelled():
                return len(logs.records("generation_cancelled", reason="slow_consumer")) == 2

            await wait_for(both_cancelled, timeout=60)
            for end in logs.records("generation_cancelled", reason="slow_consumer"):
                assert end["tokens_generated"] < 2000 and end["tokens_after_cancel"] <= 1
            assert server.scheduler.active == 0
        finally:
            sock.close()


SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=True), st.text(max_size=30)
)
FIELDS = st.sampled_from(
    [
        "type",
        "id",
        "prompt",
        "messages",
        "max_tokens",
        "temperature",
        "top_k",
        "top_p",
        "repetition_penalty",
        "seed",
        "stop",
        "timeout_s",
        "ttft_timeout_s",
    ]
)
FRAMES = st.one_of(
    st.dictionaries(
        FIELDS,
        st.recursive(
            SCALARS,
            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
            max_leaves=8,
        ),
        max_size=6,
    ),
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(["generate", "cancel"]),
            "id": st.text(min_size=1, max_size=6),
            "prompt": st.text(min_size=1, max_size=40),
        },
        optional={
            "max_tokens": st.integers(-5, 3),
            "temperature": SCALARS,
            "timeout_s": st.floats(-1, 0.2),
            "stop": st.lists(st.text(max_size=3)),
        },
    ),
    st.text(max_size=50),
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(frames=st.lists(FRAMES, min_size=1, max_size=6))
@pytest.mark.slow
async def test_random_frames_never_crash_or_leak_a_slot(server, frames):
    async with client_for(server) as client:
        for frame in frames:
            await client.send(frame if isinstance(frame, str) else json.dumps(frame))
        # The connection still answers, in order, after whatever came before.
        await client.send({"type": "cancel", "id": "__probe__"})
        await client.recv_until(lambda f: f.get("type") == "cancel_ack" and f.get("id") == "__probe__")
        for frame in client.frames:
            assert frame["type"] in {"accepted", "token", "done", "cancelled", "timeout", "error", "cancel_ack"}
    # Closing the connection stopped whatever it started.
    await wait_for(lambda: server.scheduler.active == 0 and server.scheduler.queue_depth == 0)
