"""Every field of OpenAI's request bodies is honoured or refused by name: the table in
stopline/api/openai_fields.py, the one in docs/http.md, and a real server agree."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import openai
import pytest

from stopline.__main__ import parse_args, settings_from
from stopline.api.openai_fields import FIELDS, Endpoint, Treatment, fields_of
from support import CHAT_FRANCE, LONG_ANSWER, UNIT, client_for, running_server

pytestmark = pytest.mark.both_engines(why="each engine honours or refuses a field with its own sampler")

DOCS = Path(__file__).resolve().parent.parent / "docs" / "http.md"
# The fields whose value the test sets itself, around the one it sends.
BASE = {"messages", "prompt", "model"}
# Fields that are read together with another one.
COMPANIONS = {"top_logprobs": {"logprobs": True}, "tools": {"tool_choice": "none"}}


def docs_table() -> set[tuple[str, frozenset[Endpoint], Treatment]]:
    text = DOCS.read_text()
    table = text[text.index("<!-- fields-table: start -->") : text.index("<!-- fields-table: end -->")]
    rows = set()
    for line in table.splitlines():
        match = re.match(r"\| `(\w+)` \| (\w+) \| ([\w ]+) \|", line)
        if match:
            name, endpoint, treatment = match.groups()
            endpoints = frozenset(Endpoint) if endpoint == "both" else frozenset({Endpoint(endpoint)})
            rows.add((name, endpoints, Treatment(treatment)))
    return rows


def test_the_docs_table_is_the_code_table():
    assert docs_table() == {(f.name, f.endpoints, f.treatment) for f in FIELDS}
    # A field appears once per endpoint.
    for endpoint in Endpoint:
        names = [f.name for f in FIELDS if endpoint in f.endpoints]
        assert len(names) == len(set(names)) == len(fields_of(endpoint))


def base_body(server, endpoint: Endpoint) -> dict:
    body: dict = {"model": server.engine.name, "max_tokens": 2, "temperature": 0}
    if endpoint is Endpoint.CHAT:
        body["messages"] = CHAT_FRANCE
    else:
        body["prompt"] = "The capital of France is"
    return body


async def post(http, server, endpoint: Endpoint, body: dict) -> tuple[int, dict]:
    path = "chat/completions" if endpoint is Endpoint.CHAT else "completions"
    async with http.post(f"{server.http.base_url}/{path}", json=body) as response:
        if body.get("stream"):
            await response.read()
            return response.status, {}
        return response.status, await response.json()


async def test_every_field_is_honoured_or_refused_by_name(server, http):
    # The fields are independent: several are checked at once, as many as the test engine's slots.
    at_once = asyncio.Semaphore(4)

    async def check(endpoint: Endpoint, field) -> None:
        async with at_once:
            body = {**base_body(server, endpoint), **COMPANIONS.get(field.name, {}), field.name: field.example}
            status, answer = await post(http, server, endpoint, body)
            # Structured output needs an engine that constrains sampling to a grammar.
            honoured = field.treatment is Treatment.HONOURED and (
                field.name != "response_format" or server.limits.grammars
            )
            if honoured:
                assert status == 200, (endpoint, field.name, answer)
            else:
                assert status == 400, (endpoint, field.name, answer)
                assert answer["error"]["code"] == "unsupported_parameter", answer
                assert answer["error"]["param"] == field.name and field.name in answer["error"]["message"]
            # null is absent, and a default-only field takes its default. (A null length is the
            # default answer length, which the first full stop cuts short.)
            for value in (None, *field.neutral):
                body = {**base_body(server, endpoint), "stop": ".", field.name: value}
                status, answer = await post(http, server, endpoint, body)
                assert status == 200, (endpoint, field.name, value, answer)

    await asyncio.gather(
        *(
            check(endpoint, field)
            for endpoint in Endpoint
            for field in fields_of(endpoint).values()
            if field.name not in BASE
        )
    )


async def test_honoured_fields_take_effect(server, http, logs):
    status, answer = await post(
        http, server, Endpoint.CHAT, {**base_body(server, Endpoint.CHAT), "max_completion_tokens": 1, "max_tokens": 9}
    )
    assert status == 200 and answer["usage"]["completion_tokens"] == 1
    status, answer = await post(
        http,
        server,
        Endpoint.CHAT,
        {**base_body(server, Endpoint.CHAT), "safety_identifier": "bob", "max_tokens": 1},
    )
    assert status == 200
    [end] = logs.records("generation_done", request_id=answer["id"])
    # The client's own label; user_id is an API key's user, and there are no keys here.
    assert end["user"] == "bob" and end["user_id"] is None


async def test_the_samplers_extra_fields_take_effect_through_the_openai_client(server):
    async with openai.AsyncOpenAI(
        base_url=server.http.base_url, api_key="unused", max_retries=0, timeout=60 * UNIT
    ) as client:

        async def ask(max_tokens: int, **extra):
            return await client.chat.completions.create(
                model=server.engine.name, messages=CHAT_FRANCE, max_tokens=max_tokens, temperature=0, **extra
            )

        # The answer ("Paris") ends long before 40 tokens, unless the end of generation is never drawn.
        plain = await ask(40)
        assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 40
        endless = await ask(40, extra_body={"ignore_eos": True})
        assert endless.choices[0].finish_reason == "length" and endless.usage.completion_tokens == 40
        [banana] = server.engine.encode(prompt=" banana")[-1:]
        biased = await ask(3, logit_bias={str(banana): 100})
        assert biased.choices[0].message.content.count("banana") == 3
        # min_p 1 keeps only the likeliest token: at any temperature, the greedy answer.
        kept = await ask(8, extra_body={"min_p": 1.0, "temperature": 5.0, "seed": 1})
        greedy = await ask(8)
        wild = await ask(8, extra_body={"temperature": 5.0, "seed": 1})
        assert kept.choices[0].message.content == greedy.choices[0].message.content
        assert wild.choices[0].message.content != greedy.choices[0].message.content


async def test_structured_output_names_the_engine_that_has_it(ctransformers_engine):
    # About the engine without a grammar sampler: on ctransformers, response_format and tools are
    # refused by name, and the refusal names the engine that has them (test_structured_output.py).
    async with running_server(ctransformers_engine) as server:
        assert not server.limits.grammars
        await refuses_structured_output(server)


async def refuses_structured_output(server) -> None:
    client = openai.AsyncOpenAI(base_url=server.http.base_url, api_key="unused", max_retries=0, timeout=60 * UNIT)
    for response_format in (
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}},
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model=server.engine.name, messages=CHAT_FRANCE, response_format=response_format
            )
        assert caught.value.code == "unsupported_parameter" and caught.value.param == "response_format"
        assert "--engine llama.cpp" in caught.value.message
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    # auto too (the default when tools are given): unconstrained arguments would not be sure to parse.
    for tool_choice in ("required", "auto", openai.omit):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model=server.engine.name, messages=CHAT_FRANCE, tools=tools, tool_choice=tool_choice
            )
        assert caught.value.code == "unsupported_parameter" and caught.value.param == "tool_choice"
        assert "--engine llama.cpp" in caught.value.message
    await client.close()


async def test_a_field_not_in_the_table_is_refused_by_name(server, http):
    for endpoint in Endpoint:
        status, answer = await post(http, server, endpoint, {**base_body(server, endpoint), "temprature": 0.5})
        assert status == 400 and answer["error"]["param"] == "temprature"
        assert answer["error"]["code"] == "unsupported_parameter"


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "tool", "content": "42", "name": "f"}, "messages[1].name"),
        ({"role": "function", "content": "42"}, "messages[1].role"),
        ({"role": "user", "content": "Hi", "name": "ann"}, "messages[1].name"),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]},
            "messages[1].content",
        ),
    ],
)
async def test_messages_stopline_cannot_read_are_refused_by_name(server, http, message, param):
    body = {**base_body(server, Endpoint.CHAT), "messages": [*CHAT_FRANCE, message]}
    status, answer = await post(http, server, Endpoint.CHAT, body)
    assert status == 400 and answer["error"]["code"] == "unsupported_parameter"
    assert answer["error"]["param"] == param


async def test_any_model_name_is_answered_by_the_model_served(server, http):
    # Clients with a hard-coded name work, as with llama-server; the answer says what answered.
    client = openai.AsyncOpenAI(base_url=server.http.base_url, api_key="unused", max_retries=0, timeout=60 * UNIT)
    for asked in ("gpt-4o", server.engine.name):
        answer = await client.chat.completions.create(model=asked, messages=CHAT_FRANCE, max_tokens=1)
        assert answer.model == server.engine.name
    completion = await client.completions.create(model="gpt-3.5-turbo-instruct", prompt="Hi", max_tokens=1)
    assert completion.model == server.engine.name
    # The list and the lookup hold the served names only; every field the openai package and Open WebUI read.
    async with http.get(server.http.base_url + "/models") as response:
        listed = await response.json()
    assert listed["object"] == "list" and [m["id"] for m in listed["data"]] == [server.engine.name]
    [entry] = listed["data"]
    assert entry["object"] == "model" and entry["owned_by"] == "stopline"
    assert isinstance(entry["created"], int) and entry["created"] > 1_700_000_000
    model = await client.models.retrieve(server.engine.name)
    assert model.id == server.engine.name and model.owned_by == "stopline"
    with pytest.raises(openai.NotFoundError) as caught:
        await client.models.retrieve("gpt-4o")
    assert caught.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=7, messages=CHAT_FRANCE, max_tokens=1)
    assert caught.value.code == "invalid_field" and caught.value.param == "model"
    await client.close()


async def test_fields_the_openai_package_sends_at_their_limits(server):
    client = openai.AsyncOpenAI(base_url=server.http.base_url, api_key="unused", max_retries=0, timeout=60 * UNIT)
    # An n past the requests a client may run at once and an oversized max_tokens, as the openai package sends them.
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=server.engine.name, messages=CHAT_FRANCE, n=9)
    assert caught.value.code == "invalid_field" and caught.value.param == "n"
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=server.engine.name, messages=CHAT_FRANCE, max_tokens=10**6)
    assert caught.value.code == "invalid_field" and "max_tokens" in caught.value.message
    await client.close()


async def test_logprobs_with_the_openai_package_streaming_or_not(server):
    client = openai.AsyncOpenAI(base_url=server.http.base_url, api_key="unused", max_retries=0, timeout=60 * UNIT)
    # Greedy, and with no penalty (the default): the token drawn is the model's most likely one.
    fields = dict(model=server.engine.name, messages=CHAT_FRANCE, temperature=0, max_tokens=12)
    answer = await client.chat.completions.create(logprobs=True, top_logprobs=3, **fields)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.token == entry.top_logprobs[0].token and abs(entry.logprob - entry.top_logprobs[0].logprob) < 1e-6
    assert "".join(e.token for e in content) == answer.choices[0].message.content
    stream = await client.chat.completions.create(logprobs=True, stream=True, **fields)
    streamed = [
        e
        for c in [c async for c in stream]
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    assert all(e.top_logprobs == [] for e in streamed)
    plain = await client.chat.completions.create(**fields)
    assert plain.choices[0].logprobs is None
    completion = await client.completions.create(
        model=server.engine.name, prompt="The capital of France is", temperature=0, max_tokens=4, logprobs=2
    )
    columns = completion.choices[0].logprobs
    assert len(columns.tokens) == len(columns.token_logprobs) == completion.usage.completion_tokens
    assert all(1 <= len(top) <= 2 for top in columns.top_logprobs) and columns.text_offset[0] == 0
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(logprobs=True, top_logprobs=21, **fields)
    assert caught.value.code == "invalid_field" and "logprobs" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(top_logprobs=2, **fields)
    assert caught.value.param == "top_logprobs"
    await client.close()


@pytest.mark.parametrize(
    "penalty", [None, {"repetition_penalty": 1.3}, {"frequency_penalty": 1.0}, {"presence_penalty": 1.0}]
)
async def test_greedy_draws_the_top_token_unless_a_penalty_is_asked_for(server, penalty):
    # A request that names no penalty gets none, as from llama-server, vLLM and OpenAI: at
    # temperature 0 every token is the first of its alternatives (an equal one, on a tie).
    client = openai.AsyncOpenAI(base_url=server.http.base_url, api_key="unused", max_retries=0, timeout=60 * UNIT)
    answer = await client.chat.completions.create(
        model=server.engine.name,
        messages=LONG_ANSWER,
        temperature=0,
        max_tokens=48,
        logprobs=True,
        top_logprobs=2,
        extra_body=penalty,
    )
    await client.close()
    content = answer.choices[0].logprobs.content
    below_the_top = [e.token for e in content if e.logprob < e.top_logprobs[0].logprob - 1e-6]
    assert len(content) == 48
    if penalty is None:
        assert below_the_top == []
    else:
        # The check can fail: a penalty asked for does draw tokens below the top.
        assert below_the_top, penalty


async def test_served_model_names_and_only_those(engine):
    # Aliases, as vLLM has them, and the strict choice: a name not served is 404, as from vLLM.
    async with running_server(engine, served_model_names=("smol", "gpt-4o-mini"), model_names="served") as server:
        client = openai.AsyncOpenAI(base_url=server.http.base_url, api_key="unused", max_retries=0, timeout=60 * UNIT)
        assert [m.id for m in (await client.models.list()).data] == ["smol", "gpt-4o-mini"]
        assert (await client.models.retrieve("gpt-4o-mini")).id == "gpt-4o-mini"
        answer = await client.chat.completions.create(model="gpt-4o-mini", messages=CHAT_FRANCE, max_tokens=1)
        assert answer.model == "gpt-4o-mini"
        answer = await client.chat.completions.create(model=None, messages=CHAT_FRANCE, max_tokens=1)
        assert answer.model == "smol"
        for name in ("gpt-4o", server.engine.name):
            with pytest.raises(openai.NotFoundError) as caught:
                await client.chat.completions.create(model=name, messages=CHAT_FRANCE, max_tokens=1)
            assert caught.value.code == "model_not_found" and caught.value.param == "model"
            assert "'smol', 'gpt-4o-mini'" in caught.value.message and "--model-names any" in caught.value.message
        await client.close()
        # The first name is the one the server reports unasked.
        async with client_for(server) as ws:
            assert ws.hello["model"] == "smol"


def test_served_model_names_from_the_flag_or_its_variable(monkeypatch):
    monkeypatch.setenv("STOPLINE_SERVED_MODEL_NAME", "smol,gpt-4o-mini")
    assert settings_from(parse_args([])).served_model_names == ("smol", "gpt-4o-mini")
    # The command line replaces the variable's list, one name per flag.
    args = parse_args(["--served-model-name", "a", "--served-model-name", "b", "--model-names", "served"])
    settings = settings_from(args)
    assert settings.served_model_names == ("a", "b") and settings.model_names == "served"
    monkeypatch.delenv("STOPLINE_SERVED_MODEL_NAME")
    assert settings_from(parse_args([])).served_model_names == ()
    assert settings_from(parse_args([])).model_names == "any"
    with pytest.raises(SystemExit) as exited:
        parse_args(["--served-model-name", ""])
    assert exited.value.code == 2
