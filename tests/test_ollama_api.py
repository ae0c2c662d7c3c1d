"""Ollama's API, driven by the real ``ollama`` package against a real server, the real model and
the real loop: the same generation as every other API, in Ollama's shapes, and stopped when the
stream closes."""

from __future__ import annotations

import json

import ollama
import pytest

from stopline.api.ollama import CHAT_FIELDS, GENERATE_FIELDS, OPTIONS
from stopline.api.openai_fields import Treatment
from support import CHAT_FRANCE, LONG_ANSWER, UNIT, openai_client, running_server, wait_for

GREEDY = {"temperature": 0, "num_predict": 32}


def api_url(server) -> str:
    # The HTTP API's port; Ollama's API is under /api.
    return server.http.base_url.removesuffix("/v1")


def client_of(server) -> ollama.AsyncClient:
    return ollama.AsyncClient(host=api_url(server), timeout=120 * UNIT)


def ended(part, num_predict: int = GREEDY["num_predict"]) -> None:
    """The final object: done, with Ollama's counts and done_reason."""
    assert part.done is True and part.prompt_eval_count > 0 and part.eval_count >= 1
    assert part.total_duration > 0 and part.eval_duration >= 0 and part.load_duration == 0
    assert part.done_reason == ("length" if part.eval_count == num_predict else "stop")


async def test_a_chat_is_the_same_greedy_answer_as_a_chat_completion(server):
    async with client_of(server) as client:
        answer = await client.chat(model=server.engine.name, messages=CHAT_FRANCE, options=GREEDY, stream=False)
    assert answer.model == server.engine.name and answer.message.role == "assistant"
    assert "Paris" in answer.message.content
    ended(answer)
    async with openai_client(server) as other:
        chat = await other.chat.completions.create(
            model=server.engine.name, max_tokens=32, messages=CHAT_FRANCE, temperature=0
        )
    assert chat.choices[0].message.content == answer.message.content
    assert chat.usage.prompt_tokens == answer.prompt_eval_count
    assert chat.usage.completion_tokens == answer.eval_count


async def test_a_streamed_chat_joins_to_the_same_text(server):
    asked = dict(model=server.engine.name, messages=CHAT_FRANCE, options={**GREEDY, "stop": ["\n"]})
    async with client_of(server) as client:
        whole = await client.chat(stream=False, **asked)
        parts = [part async for part in await client.chat(stream=True, **asked)]
    *pieces, last = parts
    assert pieces and not any(p.done for p in pieces)
    assert "".join(p.message.content for p in pieces) == whole.message.content
    ended(last)
    assert last.message.content == "" and last.eval_count == whole.eval_count
    assert last.done_reason == whole.done_reason


async def test_the_final_line_carries_stoplines_terminal_frame(server, http):
    body = {"model": server.engine.name, "prompt": "Count: 1, 2,", "options": {"num_predict": 4, "temperature": 0}}
    async with http.post(api_url(server) + "/api/generate", json=body) as response:
        assert response.status == 200 and response.content_type == "application/x-ndjson"
        assert response.headers["X-Request-Id"]
        lines = [json.loads(line) async for line in response.content]
    *pieces, last = lines
    assert [p["done"] for p in pieces] == [False] * len(pieces) and len(pieces) == 4
    end = last["stopline"]
    assert end["type"] == "done" and end["reason"] == "max_tokens" and last["done_reason"] == "length"
    assert last["prompt_eval_count"] == end["prompt_tokens"] and last["eval_count"] == end["tokens_generated"] == 4
    async with http.post(api_url(server) + "/api/generate", json={**body, "stream": False}) as response:
        whole = await response.json()
    assert whole["response"] == "".join(p["response"] for p in pieces)
    assert whole["stopline"]["tokens_generated"] == 4 and whole["done_reason"] == "length"


async def test_generate_answers_as_the_chat_and_raw_as_the_completion(server):
    system = "You answer in one word."
    question = "What is the capital of France?"
    async with client_of(server) as client:
        generated = await client.generate(model=server.engine.name, prompt=question, system=system, options=GREEDY)
        chat = await client.chat(
            model=server.engine.name,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            options=GREEDY,
        )
        raw_parts = [
            p
            async for p in await client.generate(
                model=server.engine.name, prompt="The capital of France is", raw=True, options=GREEDY, stream=True
            )
        ]
    assert generated.response == chat.message.content and generated.eval_count == chat.eval_count
    ended(generated)
    ended(raw_parts[-1])
    raw = "".join(p.response for p in raw_parts)
    async with openai_client(server) as other:
        completion = await other.completions.create(
            model=server.engine.name, prompt="The capital of France is", max_tokens=32, temperature=0
        )
    assert raw == completion.choices[0].text


async def test_an_empty_generate_only_loads_the_model(server):
    async with client_of(server) as client:
        loaded = await client.generate(model=server.engine.name)
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""
    assert server.scheduler.active == 0


async def test_the_served_model_is_listed_shown_and_running(server):
    name = server.engine.name
    async with client_of(server) as client:
        tags = await client.list()
        shown = await client.show(name)
        running = await client.ps()
        with pytest.raises(ollama.ResponseError) as missing:
            await client.show("no-such-model")
        version = (await client._request_raw("GET", "/api/version")).json()
    assert [m.model for m in tags.models] == [name]
    assert shown.modelinfo["stopline.context_length"] == server.http.services.limits.context_length
    assert [m.model for m in running.models] == [name]
    assert running.models[0].context_length == server.http.services.limits.context_length
    assert missing.value.status_code == 404 and "no-such-model" in missing.value.error
    assert set(version) == {"version", "stopline"}


async def test_format_json_constrains_the_answer_where_the_engine_can(server):
    asked = dict(model=server.engine.name, messages=CHAT_FRANCE, format="json", options={"num_predict": 64})
    async with client_of(server) as client:
        if not server.http.services.limits.grammars:
            with pytest.raises(ollama.ResponseError) as refused:
                await client.chat(**asked)
            assert refused.value.status_code == 400 and "format" in refused.value.error
            return
        answer = await client.chat(**asked)
    if answer.done_reason == "stop":
        assert isinstance(json.loads(answer.message.content), dict)


async def test_closing_a_chat_stream_stops_the_model(server, logs):
    async with client_of(server) as client:
        parts = await client.chat(
            model=server.engine.name, messages=LONG_ANSWER, options={"num_predict": 500}, stream=True
        )
        seen = 0
        async for _ in parts:
            seen += 1
            if seen == 5:
                break
        await parts.aclose()
        await wait_for(lambda: logs.records("generation_cancelled"))
    [end] = logs.records("generation_cancelled")
    assert end["reason"] == "client_disconnected" and end["tokens_after_cancel"] <= 1
    await wait_for(lambda: server.scheduler.active == 0)


@pytest.mark.parametrize(
    "change, named",
    [
        ({"options": {"mirostat": 2}}, "options.mirostat"),
        ({"options": {"num_gpu": 1}}, "options.num_gpu"),
        ({"options": {"num_ctx": 10_000_000}}, "--context-length"),
        ({"options": {"bogus": 1}}, "options.bogus"),
        ({"think": True}, "think"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, "images"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
        ({"options": {"temperature": 9}}, "temperature"),
        ({"bogus": 1}, "bogus"),
    ],
)
async def test_what_is_not_honoured_is_refused_by_name(server, http, change, named):
    body = {"model": server.engine.name, "messages": CHAT_FRANCE, **change}
    async with http.post(api_url(server) + "/api/chat", json=body) as response:
        assert response.status == 400
        refused = await response.json()
    assert set(refused) == {"error", "code"} and named in refused["error"]
    assert refused["code"] in ("unsupported_parameter", "invalid_field")
    assert server.scheduler.active == 0


async def test_the_ollama_package_raises_the_refusal(server):
    async with client_of(server) as client:
        with pytest.raises(ollama.ResponseError) as refused:
            await client.chat(model=server.engine.name, messages=CHAT_FRANCE, options={"typical_p": 0.5})
    assert refused.value.status_code == 400 and "options.typical_p" in refused.value.error


async def test_the_defaults_clients_send_are_accepted(server, http):
    # Continue sends num_ctx and keep_alive with every request; the ollama package sends tools: [].
    body = {
        "model": server.engine.name + ":latest",
        "messages": CHAT_FRANCE,
        "tools": [],
        "keep_alive": 1800,
        "stream": False,
        "options": {"num_ctx": 128, "num_predict": 2, "mirostat": 0},
    }
    async with http.post(api_url(server) + "/api/chat", json=body) as response:
        assert response.status == 200, await response.text()
        answer = await response.json()
    assert answer["done"] and answer["eval_count"] == 2 and answer["done_reason"] == "length"


def test_every_field_is_honoured_or_refused():
    for table in (CHAT_FIELDS, GENERATE_FIELDS, OPTIONS):
        assert {f.treatment for f in table.values()} <= set(Treatment)
    assert {"model", "messages", "stream", "format", "options"} <= set(CHAT_FIELDS)
    honoured = {name for name, f in OPTIONS.items() if f.treatment is Treatment.HONOURED}
    assert {"temperature", "top_k", "top_p", "min_p", "seed", "num_predict", "stop", "repeat_penalty"} <= honoured


async def test_the_key_comes_as_a_bearer_header(engine):
    key = "ollama-test-key-0123456789"
    async with running_server(engine, api_keys=(key,)) as server:
        async with ollama.AsyncClient(host=api_url(server), headers={"Authorization": f"Bearer {key}"}) as client:
            answer = await client.chat(model=server.engine.name, messages=CHAT_FRANCE, options={"num_predict": 2})
            assert answer.eval_count >= 1
        async with ollama.AsyncClient(host=api_url(server)) as client:
            with pytest.raises(ollama.ResponseError) as refused:
                await client.chat(model=server.engine.name, messages=CHAT_FRANCE, options={"num_predict": 2})
            assert refused.value.status_code == 401
