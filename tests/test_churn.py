"""Memory under keep-alive churn: many short requests over a few connections that stay open.

Every structure a request leaves behind is bounded (the registry's ended entries, a
connection's ended ids, the stored responses); once a warm-up has filled them, more
requests must not grow the Python heap. The bounds are shrunk here so that a warm-up of a
few hundred requests fills them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import tracemalloc

import aiohttp

from support import UNIT, running_server

CHAT = {"model": "x", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}

# What the heap may grow by from the end of the warm-up to the last round, per 1,000 requests:
# room for the allocator's and tracemalloc's own noise, far below what one kept entry a request costs.
SLOPE_BYTES_PER_1000 = 256 * 1024


def shrink_bounds(server, remembered: int) -> None:
    """Bounds small enough for a short warm-up to fill: the registry's ended entries and
    each WebSocket connection's ended ids. The frame rate is unbounded instead: one-token
    requests, one after another, can pass the default rate, whose excess frames are dropped."""
    server.registry._remembered = remembered
    server.services.limits = dataclasses.replace(
        server.services.limits, remembered_ids=remembered, frames_per_second=1e9, frame_burst=10**9
    )


async def http_requests(session: aiohttp.ClientSession, url: str, count: int) -> None:
    async def one() -> None:
        async with session.post(url, json=CHAT) as response:
            await response.read()
            assert response.status == 200, response.status

    # As many at once as the connector keeps connections, each reused for request after request.
    for _ in range(0, count, 4):
        await asyncio.gather(*(one() for _ in range(4)))


async def websocket_requests(server, ws: aiohttp.ClientWebSocketResponse, first: int, count: int) -> None:
    for n in range(first, first + count):
        request_id = f"r{n}"
        await ws.send_str(json.dumps({"type": "generate", "id": request_id, "prompt": "Hi", "max_tokens": 1}))
        seen: list[dict] = []
        while True:
            try:
                frame = json.loads((await asyncio.wait_for(ws.receive(), 60 * UNIT)).data)
            except TimeoutError:
                live = [entry.describe() for entry in server.registry.live()]
                raise AssertionError(f"no terminal frame for {request_id}: frames {seen}, live {live}") from None
            seen.append(frame)
            assert frame.get("id") is not None, frame  # a frame about the connection: rate_limited, say
            if frame.get("id") == request_id and frame["type"] not in ("accepted", "token"):
                assert frame["type"] == "done", frame
                break


def traced_heap() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


async def heap_slope(run_round, warm_up_rounds: int, rounds: int, per_round: int) -> float:
    """Bytes the traced heap grows per 1,000 requests, from the end of the warm-up to the last round
    (the least-squares slope over the rounds, so that one noisy round does not decide)."""
    # Traced from before the warm-up: tracemalloc counts only what is allocated while it runs.
    tracemalloc.start()
    try:
        for _ in range(warm_up_rounds):
            await run_round(per_round)
        heaps = [traced_heap()]
        for _ in range(rounds):
            await run_round(per_round)
            heaps.append(traced_heap())
    finally:
        tracemalloc.stop()
    xs = [i * per_round for i in range(len(heaps))]
    mean_x, mean_y = sum(xs) / len(xs), sum(heaps) / len(heaps)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, heaps)) / sum((x - mean_x) ** 2 for x in xs)
    return slope * 1000


async def http_churn(llama_engine, logs, *, remembered: int | None, warm_up_rounds: int, rounds: int, per_round: int):
    async with running_server(llama_engine) as server:
        if remembered is not None:
            shrink_bounds(server, remembered)
        url = server.http.base_url + "/chat/completions"
        connector = aiohttp.TCPConnector(limit=4)
        async with aiohttp.ClientSession(connector=connector) as session:

            async def run_round(count: int) -> None:
                await http_requests(session, url, count)
                # The captured log lines are the test's, not the server's.
                logs.clear()

            return await heap_slope(run_round, warm_up_rounds, rounds, per_round)


async def websocket_churn(
    llama_engine, logs, *, remembered: int | None, warm_up_rounds: int, rounds: int, per_round: int
):
    async with running_server(llama_engine) as server:
        if remembered is not None:
            shrink_bounds(server, remembered)
        async with aiohttp.ClientSession() as session, session.ws_connect(server.ws_url) as ws:
            assert json.loads((await ws.receive()).data)["type"] == "hello"
            sent = 0

            async def run_round(count: int) -> None:
                nonlocal sent
                await websocket_requests(server, ws, sent, count)
                sent += count
                logs.clear()

            return await heap_slope(run_round, warm_up_rounds, rounds, per_round)


async def test_http_keep_alive_churn_levels_off(llama_engine, logs):
    slope = await http_churn(llama_engine, logs, remembered=100, warm_up_rounds=2, rounds=5, per_round=120)
    assert slope < SLOPE_BYTES_PER_1000, f"the heap grows {slope / 1024:.0f} KiB per 1,000 requests"


async def test_websocket_churn_levels_off(llama_engine, logs):
    slope = await websocket_churn(llama_engine, logs, remembered=100, warm_up_rounds=2, rounds=5, per_round=120)
    assert slope < SLOPE_BYTES_PER_1000, f"the heap grows {slope / 1024:.0f} KiB per 1,000 requests"
