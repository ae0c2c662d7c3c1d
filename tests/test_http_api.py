"""The HTTP API against the real server and model: SSE generations, DELETE by request id, and the
OpenAI-compatible endpoints driven by the real ``openai`` package and a real aiohttp client."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

from stopline.app import StoplineServer
from stopline.settings import Settings
from support import (
    CHAT_FRANCE,
    LONG_ANSWER,
    UNIT,
    cancelled_records,
    client_for,
    delete,
    fetch_metrics,
    http_get,
    metric_value,
    openai_client,
    sse_events,
    wait_for,
)

# Tokens a closed connection may still cost beyond the one step the loop was in: tokens the
# server had already produced and written but the client had not read when it closed.
IN_FLIGHT_STEPS = 8
LONG_PROMPT = "The history of bread is long. " * 220  # about 1,500 tokens


async def get(http, server, request_id: str, token: str) -> tuple[int, dict]:
    async with http.get(
        f"{server.http.base_url}/generations/{request_id}", headers={"Authorization": f"Bearer {token}"}
    ) as response:
        return response.status, await response.json()


async def test_healthz_names_the_http_api(server):
    status, body = await http_get(server, "/healthz")
    assert status == 200 and json.loads(body)["http_api"] == server.http.base_url
    assert server.http.base_url.startswith("http://127.0.0.1:") and server.http.base_url.endswith("/v1")


async def test_openai_chat_and_completion_not_streaming(server, logs):
    client = openai_client(server)
    models = await client.models.list()
    assert [m.id for m in models.data] == [server.engine.name]
    chat = await client.chat.completions.create(
        model=server.engine.name, messages=CHAT_FRANCE, temperature=0, max_tokens=32, user="alice"
    )
    assert "Paris" in chat.choices[0].message.content
    # The answer ends with EOS ("stop") unless it used all 32 tokens ("length").
    assert chat.choices[0].finish_reason == ("length" if chat.usage.completion_tokens == 32 else "stop")
    assert chat.usage.completion_tokens == chat.model_extra["stopline"]["tokens_generated"]
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    [accepted] = logs.records("generation_accepted", request_id=chat.id)
    [end] = logs.records("generation_done", request_id=chat.id)
    # The client's user is its own label; without API keys no user_id is known.
    assert accepted["user"] == end["user"] == "alice" and accepted["user_id"] is end["user_id"] is None
    completion = await client.completions.create(
        model=server.engine.name, prompt="The capital of France is", max_tokens=3, temperature=0, seed=1, stop=["\n"]
    )
    assert completion.choices[0].finish_reason in ("length", "stop") and completion.usage.completion_tokens <= 3
    await client.close()


async def test_openai_streaming_with_usage(server):
    client = openai_client(server)
    stream = await client.chat.completions.create(
        model=server.engine.name,
        messages=CHAT_FRANCE,
        temperature=0,
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    # EOS ends it with "stop" unless all 32 tokens were used ("length").
    used = finals[0].model_extra["stopline"]["tokens_generated"]
    assert [c.choices[0].finish_reason for c in finals] == ["length" if used == 32 else "stop"]
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == finals[0].model_extra["stopline"]["tokens_generated"]
    )
    assert len({c.id for c in chunks}) == 1
    await client.close()


async def test_openai_errors_have_openai_shape(server):
    client = openai_client(server)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=server.engine.name, messages=CHAT_FRANCE, max_tokens=0)
    assert caught.value.code == "invalid_field" and "max_tokens" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(model=server.engine.name, prompt=LONG_PROMPT * 3, max_tokens=4)
    assert caught.value.code == "prompt_too_long"
    with pytest.raises(openai.NotFoundError) as caught:
        await client.moderations.create(input="x")
    assert caught.value.code == "not_found"
    await client.close()


async def test_closing_an_openai_stream_stops_the_model(server, logs):
    await _close_an_openai_stream(server, logs, active_after=0)


@pytest.mark.slow
async def test_closing_an_openai_stream_stops_the_model_under_other_traffic(server, logs):
    async with client_for(server) as other:
        # Another client streams on the other slot, and reads every token, the whole time.
        # Greedy counting goes on until max_tokens: the traffic cannot end early.
        await other.generate("other", prompt="1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", temperature=0, max_tokens=1500)
        reading = asyncio.create_task(other.terminal("other", timeout=300))
        await wait_for(lambda: other.tokens("other"))
        await _close_an_openai_stream(server, logs, active_after=1)
        assert not reading.done()
        await other.send({"type": "cancel", "id": "other"})
        assert (await reading)["type"] == "cancelled"


async def _close_an_openai_stream(server, logs, active_after: int):
    client = openai_client(server)
    stream = await client.chat.completions.create(
        model=server.engine.name, messages=LONG_ANSWER, max_tokens=500, stream=True
    )
    seen = 0
    async for chunk in stream:
        seen += bool(chunk.choices and chunk.choices[0].delta.content)
        if seen == 5:
            break
    request_id = chunk.id
    await stream.close()
    # The active generations drop without another request or client action.
    await wait_for(lambda: logs.records("generation_cancelled", request_id=request_id))
    assert server.scheduler.active == active_after
    [end] = logs.records("generation_cancelled", request_id=request_id)
    assert end["reason"] == "client_disconnected" and end["tokens_after_cancel"] <= 1
    assert end["tokens_generated"] <= seen + 1 + IN_FLIGHT_STEPS
    metrics = await fetch_metrics(server)
    assert metric_value(metrics, "stopline_requests_total", outcome="cancelled", reason="client_disconnected") == 1
    await client.close()


async def test_a_closed_non_streaming_request_stops_the_model(server, logs, http):
    body = {"messages": LONG_ANSWER, "max_tokens": 500, "user": "leaves-early"}
    waiting = asyncio.create_task(http.post(f"{server.http.base_url}/chat/completions", json=body))
    accepted = await wait_for(lambda: logs.records("generation_accepted", user="leaves-early"))
    entry = server.registry.get(accepted[0]["request_id"])
    await wait_for(lambda: entry.describe()["tokens_generated"] >= 5, timeout=60)
    generated_at_close = entry.describe()["tokens_generated"]
    waiting.cancel()  # the client gives up: its connection closes
    with pytest.raises(asyncio.CancelledError):
        await waiting
    # The end is logged just after the slot is freed: wait for the record itself.
    [end] = await wait_for(lambda: logs.records("generation_cancelled", user="leaves-early"))
    assert server.scheduler.active == 0
    assert end["reason"] == "client_disconnected" and end["tokens_after_cancel"] <= 1
    assert end["tokens_generated"] <= generated_at_close + 1 + IN_FLIGHT_STEPS


async def _sse_until(events, predicate):
    async for event, data in events:
        if predicate(event, data):
            return event, data
    raise AssertionError("the stream ended first")


@pytest.mark.parametrize("phase", ["prefill", "decoding"])
async def test_delete_from_a_second_client(server, logs, http, phase):
    body = (
        {"prompt": LONG_PROMPT, "max_tokens": 16}
        if phase == "prefill"
        else {"messages": LONG_ANSWER, "max_tokens": 500}
    )
    async with http.post(f"{server.http.base_url}/generations", json=body) as response:
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
        events = sse_events(response)
        _, accepted = await _sse_until(events, lambda event, data: event == "accepted")
        request_id, token = accepted["request_id"], accepted["cancel_token"]
        assert response.headers["X-Request-Id"] == request_id and accepted["id"] == request_id
        if phase == "decoding":
            await _sse_until(events, lambda event, data: event == "token" and data["index"] == 3)
        status, state = await get(http, server, request_id, token)
        assert status == 200 and state["status"] == phase
        async with aiohttp.ClientSession() as second:
            assert await delete(second, server, request_id, token) == (
                200,
                {"request_id": request_id, "status": "cancelled"},
            )
        rest = [pair async for pair in events]
    tokens = [data for event, data in rest if event == "token"]
    [(event, cancelled)] = [pair for pair in rest if pair[0] != "token"]
    assert event == "cancelled" and cancelled["reason"] == "user_cancelled"
    assert cancelled["tokens_after_cancel"] <= 1
    if phase == "prefill":
        assert cancelled["tokens_generated"] == 0 and tokens == []
    else:
        assert 4 <= cancelled["tokens_generated"] < 500
    # A repeat gets the same answer; GET reports the outcome and its counts.
    assert await delete(http, server, request_id, token) == (200, {"request_id": request_id, "status": "cancelled"})
    status, state = await get(http, server, request_id, token)
    assert status == 200 and state["status"] == "cancelled" and state["reason"] == "user_cancelled"
    assert state["tokens_generated"] == cancelled["tokens_generated"]
    [end] = logs.records("generation_cancelled", request_id=request_id)
    assert end["reason"] == "user_cancelled"


async def test_delete_after_done_answers_finished(server, http):
    async with http.post(f"{server.http.base_url}/generations", json={"prompt": "Hello", "max_tokens": 2}) as response:
        events = [pair async for pair in sse_events(response)]
    assert events[0][0] == "accepted" and events[-1][0] == "done"
    assert {event for event, _ in events[1:-1]} <= {"token"}
    accepted = events[0][1]
    assert await delete(http, server, accepted["request_id"], accepted["cancel_token"]) == (
        200,
        {"request_id": accepted["request_id"], "status": "finished"},
    )


async def test_delete_needs_the_token_and_a_known_id(server, http):
    async with http.post(f"{server.http.base_url}/generations", json={"prompt": "Hello", "max_tokens": 1}) as response:
        events = [pair async for pair in sse_events(response)]
    request_id, token = events[0][1]["request_id"], events[0][1]["cancel_token"]
    for wrong in (None, "", token[:-1], token + "x", "not-the-token"):
        status, body = await delete(http, server, request_id, wrong)
        assert status == 403 and body["code"] == "invalid_cancel_token"
    status, body = await get(http, server, request_id, "not-the-token")
    assert status == 403 and body["code"] == "invalid_cancel_token"
    status, body = await delete(http, server, "00000000-0000-0000-0000-000000000000", token)
    assert status == 404 and body["code"] == "unknown_request"


async def test_websocket_generation_cancelled_by_delete(server, http):
    async with client_for(server) as client:
        accepted = await client.generate("r1", messages=LONG_ANSWER, max_tokens=500)
        await client.recv_until(lambda f: f["type"] == "token" and f["index"] == 3)
        assert await delete(http, server, accepted["request_id"], accepted["cancel_token"]) == (
            200,
            {"request_id": accepted["request_id"], "status": "cancelled"},
        )
        cancelled = await client.terminal("r1")
        assert cancelled["reason"] == "user_cancelled" and cancelled["tokens_after_cancel"] <= 1
        assert len(client.tokens("r1")) == cancelled["tokens_generated"]
        # The connection's own cancel now finds the request already cancelled.
        await client.send({"type": "cancel", "id": "r1"})
        assert await client.recv() == {"type": "cancel_ack", "id": "r1", "status": "cancelled"}


async def test_delete_ends_an_openai_stream_with_openai_s_finish_reason_and_stopline_s_reason(server, http):
    client = openai_client(server)
    stream = await client.chat.completions.create(
        model=server.engine.name, messages=LONG_ANSWER, max_tokens=500, stream=True
    )
    token = stream.response.headers["X-Cancel-Token"]
    chunks = []
    async for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 4:
            status, _ = await delete(http, server, chunk.id, token)
            assert status == 200
    final = chunks[-1]
    # One of OpenAI's values, so that OpenAI's clients take it as the end it is ...
    assert final.choices[0].finish_reason == "stop"
    # ... and Stopline's own reason and figures beside it.
    end = final.model_extra["stopline"]
    assert end["type"] == "cancelled" and end["reason"] == "user_cancelled"
    assert end["tokens_after_cancel"] <= 1 and end["tokens_generated"] < 500
    await client.close()


async def test_a_client_chosen_request_id_stops_a_non_streamed_completion_while_it_runs(server, http, logs):
    client = openai_client(server)
    request_id, token = "nightly-job.42:a", "a-cancel-token-the-client-chose"
    chosen = {"X-Request-Id": request_id, "X-Cancel-Token": token}
    answer = asyncio.create_task(
        client.chat.completions.with_raw_response.create(
            model=server.engine.name, messages=LONG_ANSWER, max_tokens=500, extra_headers=chosen
        )
    )

    async def decoding() -> bool:
        status, body = await get(http, server, request_id, token)
        return status == 200 and body["status"] == "decoding" and body["tokens_generated"] >= 3

    # Another connection finds it by the client's id while the body is still to come.
    await wait_for(decoding, timeout=60)
    # The id is the running generation's: another request may not take it.
    with pytest.raises(openai.ConflictError) as refused:
        await client.chat.completions.create(
            model=server.engine.name, messages=CHAT_FRANCE, max_tokens=4, extra_headers=chosen
        )
    assert refused.value.code == "duplicate_id"
    assert (await delete(http, server, request_id, "not-the-token"))[0] == 403
    assert await delete(http, server, request_id, token) == (200, {"request_id": request_id, "status": "cancelled"})
    raw = await answer
    completion = raw.parse()
    assert raw.headers["X-Request-Id"] == request_id and raw.headers["X-Cancel-Token"] == token
    assert completion.id == request_id and completion.choices[0].finish_reason == "stop"
    end = completion.choices[0].model_extra["stopline"]
    assert end["type"] == "cancelled" and end["reason"] == "user_cancelled" and end["tokens_after_cancel"] == 0
    assert completion.usage.completion_tokens == end["tokens_generated"] < 500
    [record] = await cancelled_records(logs, request_id)
    assert record["reason"] == "user_cancelled" and record["tokens_after_cancel"] == 0
    # Once it has ended, the id is free again.
    again = await client.chat.completions.create(
        model=server.engine.name, messages=CHAT_FRANCE, max_tokens=4, extra_headers=chosen
    )
    assert again.id == request_id and again.choices[0].model_extra["stopline"]["type"] == "done"
    await client.close()


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ({"X-Request-Id": ""}, "invalid_field"),
        ({"X-Request-Id": "a/b"}, "invalid_field"),
        ({"X-Request-Id": "x" * 129}, "invalid_field"),
        ({"X-Request-Id": "resp_1"}, "invalid_field"),
        ({"X-Cancel-Token": "short"}, "invalid_field"),
    ],
)
async def test_a_client_chosen_request_id_or_cancel_token_that_does_not_fit_is_refused(server, http, headers, code):
    body = {"messages": CHAT_FRANCE, "max_tokens": 4}
    async with http.post(f"{server.http.base_url}/chat/completions", json=body, headers=headers) as response:
        assert response.status == 400 and (await response.json())["error"]["code"] == code
    async with http.post(f"{server.http.base_url}/generations", json=body, headers=headers) as response:
        assert response.status == 400 and (await response.json())["code"] == code
    # Several choices are several generations, and one id names one.
    async with http.post(
        f"{server.http.base_url}/chat/completions", json={**body, "n": 2}, headers={"X-Request-Id": "two"}
    ) as response:
        refusal = (await response.json())["error"]
        assert response.status == 400 and refusal["code"] == "invalid_field" and "n above 1" in refusal["message"]
    metrics = await fetch_metrics(server)
    assert metric_value(metrics, "stopline_requests_total") == 0


async def test_cross_origin_browser_calls_are_refused(server, http):
    headers = {"Origin": "https://elsewhere.example"}
    async with http.post(
        f"{server.http.base_url}/chat/completions", json={"messages": CHAT_FRANCE}, headers=headers
    ) as response:
        assert response.status == 403 and (await response.json())["error"]["code"] == "origin_not_allowed"
    async with http.options(f"{server.http.base_url}/chat/completions", headers=headers) as response:
        assert response.status == 403
    metrics = await fetch_metrics(server)
    assert metric_value(metrics, "stopline_requests_total") == 0


async def test_shutdown_ends_http_streams_with_cancelled_shutdown(engine, logs):
    server = StoplineServer(engine, Settings.build(host="127.0.0.1", port=0))
    await server.start()
    stopping = None
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(
                f"{server.http.base_url}/generations", json={"messages": LONG_ANSWER, "max_tokens": 500}
            ) as sse:
                events = sse_events(sse)
                await _sse_until(events, lambda event, data: event == "token")
                stopping = asyncio.create_task(server.shutdown())
                rest = [pair async for pair in events]
    finally:
        await asyncio.wait_for(stopping or server.shutdown(), 30 * UNIT)
    assert rest[-1][0] == "cancelled" and rest[-1][1]["reason"] == "shutdown"
    assert server.scheduler.active == 0
