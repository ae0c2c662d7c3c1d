"""OpenAI's ``n``: several choices in one answer, each a generation of its own on the real
model and the real loop, streamed side by side or answered in one body, and stopped together."""

from __future__ import annotations

from collections import defaultdict

import aiohttp
import openai
import pytest

from support import CHAT_FRANCE, LONG_ANSWER, UNIT, running_server, wait_for

STORY = [{"role": "user", "content": "Tell me a story about a cat."}]


@pytest.fixture
async def client(server):
    async with openai.AsyncOpenAI(
        base_url=server.http.base_url, api_key="unused", max_retries=0, timeout=120 * UNIT
    ) as client:
        yield client


async def test_several_choices_are_answered_in_one_body(engine):
    # Each choice on a context of its own: in shared steps a token's logits depend on the
    # batch it was evaluated in, so a seeded draw repeats only where the batches do.
    async with running_server(engine, batching="per_slot") as server:
        async with openai.AsyncOpenAI(
            base_url=server.http.base_url, api_key="unused", max_retries=0, timeout=120 * UNIT
        ) as client:
            await several_choices_in_one_body(server, client)


async def several_choices_in_one_body(server, client):
    asked = dict(model=server.engine.name, messages=STORY, max_tokens=12, temperature=1.0, seed=5)
    answer = await client.chat.completions.create(n=3, **asked)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    texts = [c.message.content for c in answer.choices]
    # Each choice draws with a seed of its own: they differ, and the same request gives them again.
    assert len(set(texts)) > 1
    again = await client.chat.completions.create(n=3, **asked)
    assert [c.message.content for c in again.choices] == texts
    # Choice 0 is the answer one choice with that seed gets.
    alone = await client.chat.completions.create(**asked)
    assert alone.choices[0].message.content == texts[0]
    # Each choice's own terminal frame; the prompt counted once, the completions summed.
    ends = [c.model_extra["stopline"] for c in answer.choices]
    assert all(end["type"] == "done" for end in ends)
    assert answer.usage.prompt_tokens == ends[0]["prompt_tokens"] == alone.usage.prompt_tokens
    assert answer.usage.completion_tokens == sum(end["tokens_generated"] for end in ends)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    assert [c.finish_reason for c in answer.choices] == ["length"] * 3


async def test_several_choices_stream_side_by_side(server, client):
    stream = await client.completions.create(
        model=server.engine.name,
        prompt="The capital of France is",
        n=2,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = defaultdict(str)
    finals: dict[int, dict] = {}
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            assert not chunk.choices and not finals.keys() ^ {0, 1}, "usage comes last"
            usage = chunk.usage
            continue
        [choice] = chunk.choices
        assert choice.index not in finals, "nothing follows a choice's final chunk"
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finals[choice.index] = chunk.model_extra["stopline"]
    # Greedy, both choices are the same text.
    assert texts[0] == texts[1] and texts[0]
    assert usage is not None and usage.completion_tokens == sum(f["tokens_generated"] for f in finals.values())


async def test_closing_a_stream_of_several_choices_stops_every_one(server, client, logs):
    stream = await client.chat.completions.create(
        model=server.engine.name, messages=LONG_ANSWER, n=2, max_tokens=500, temperature=1.0, stream=True
    )
    seen: set[int] = set()
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            seen.add(chunk.choices[0].index)
        if seen == {0, 1}:
            break
    await stream.close()
    await wait_for(lambda: len(logs.records("generation_cancelled")) == 2)
    ends = logs.records("generation_cancelled")
    assert {end["reason"] for end in ends} == {"client_disconnected"}
    assert all(end["tokens_after_cancel"] <= 1 for end in ends)
    await wait_for(lambda: server.scheduler.active == 0)


@pytest.mark.parametrize("n", [0, 9, 1.5, True, "2"])
async def test_n_outside_what_a_client_may_run_at_once_is_refused(server, n):
    body = {"model": server.engine.name, "messages": CHAT_FRANCE, "n": n}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{server.http.base_url}/chat/completions", json=body) as response:
            assert response.status == 400
            error = (await response.json())["error"]
    assert error["code"] == "invalid_field" and error["param"] == "n"
    assert "1 to 8" in error["message"]
