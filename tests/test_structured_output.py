"""Structured output on the llama.cpp engine: JSON Schema and json_object through llama.cpp's
grammar sampler, driven by the real ``openai`` package against a real server, and every stop
path while a grammar constrains the sampler."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from stopline.engine.loop import Engine
from stopline.protocol.connection import Connection, Tokenize
from stopline.protocol.requests import Limits
from stopline.structured.frame_grammar import frame_grammar
from stopline.structured.json_grammar import JSON_OBJECT_GRAMMAR, SchemaError, schema_grammar
from support import cancelled_records, delete, make_generation, openai_client, sse_events
from support.tools import GRAMMAR_TIMEOUT, PARAMETERS, TOOLS, WEATHER_TOOL, stream_slow_call

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}, "country": {"type": "string", "maxLength": 40}},
            "required": ["city", "country"],
            "additionalProperties": False,
        },
        "nickname": {"type": ["string", "null"], "maxLength": 20},
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "minLength": 3, "maxLength": 12}, "qty": {"type": "integer"}},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "gift": {"type": "boolean"},
    },
    "required": ["status", "items", "gift"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"const": "Paris"},
        "temperature_c": {"type": "number"},
        "sky": {"anyOf": [{"enum": ["clear", "cloudy", "rain"]}, {"type": "null"}]},
        "alerts": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 2},
    },
    "required": ["city", "temperature_c", "sky", "alerts"],
    "additionalProperties": False,
}
# As pydantic writes a nested model: $defs and $ref.
TEAM = {
    "$defs": {
        "Member": {
            "type": "object",
            "title": "Member",
            "properties": {"name": {"type": "string", "maxLength": 30}, "role": {"enum": ["lead", "dev", "qa"]}},
            "required": ["name", "role"],
            "additionalProperties": False,
        }
    },
    "type": "object",
    "properties": {
        "team": {"type": "string", "maxLength": 30},
        "members": {"type": "array", "items": {"$ref": "#/$defs/Member"}, "minItems": 1, "maxItems": 3},
    },
    "required": ["team", "members"],
    "additionalProperties": False,
}
SCHEMAS = {"person": PERSON, "order": ORDER, "weather": WEATHER, "team": TEAM}
ASK = {
    "person": "Describe a famous scientist as JSON.",
    "order": "Write an online shop order as JSON.",
    "weather": "Give today's weather in Paris as JSON.",
    "team": "Describe a small software team as JSON.",
}


@pytest.fixture(scope="module")
def engine(llama_engine) -> Engine:
    """The embedded SmolLM2 on the llama.cpp engine, the one with a grammar sampler
    (overrides conftest's for this module)."""
    return llama_engine


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "string", "pattern": "(?i)a"}, "pattern"),
        ({"type": "integer", "multipleOf": 2}, "multipleOf"),
        ({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 2}]}, "oneOf"),
        ({"type": "object", "properties": {"d": {"type": "string", "format": "ipv6"}}}, "format"),
        ({"type": "array", "items": {"$ref": "#/$defs/Missing"}}, "$ref"),
        ({"type": "object", "properties": {}, "required": ["x"]}, "required"),
        ({"type": "array", "minItems": 3, "maxItems": 2}, "maxItems"),
    ],
)
def test_a_keyword_the_grammar_cannot_enforce_is_refused_by_name(schema, keyword):
    with pytest.raises(SchemaError) as caught:
        schema_grammar(schema)
    assert caught.value.keyword == keyword and keyword in str(caught.value)


def test_the_protocol_turns_a_schema_into_a_grammar_or_refuses_it():
    def send(frame: dict, grammars: bool):
        conn = Connection(
            Limits(context_length=64, vocab_size=10, grammar_of=frame_grammar if grammars else None),
            lambda p, m: [1],
            0,
        )
        return conn.receive_text(json.dumps({"type": "generate", "id": "g", "prompt": "a", **frame}), 0)

    [action] = send({"json_schema": PERSON}, grammars=True)
    assert isinstance(action, Tokenize) and action.draft.frame.params.grammar == schema_grammar(PERSON)
    [action] = send({"json_object": True}, grammars=True)
    assert isinstance(action, Tokenize) and action.draft.frame.params.grammar == JSON_OBJECT_GRAMMAR
    for frame, words in [
        ({"json_schema": PERSON}, "--engine llama.cpp"),
        ({"json_object": True}, "--engine llama.cpp"),
    ]:
        [refusal] = send(frame, grammars=False)
        assert refusal.frame.json()["code"] == "invalid_field" and words in refusal.frame.json()["message"]
    for frame, words in [
        ({"json_schema": {"type": "string", "not": {}}}, "'not'"),
        ({"json_schema": PERSON, "tools": [WEATHER_TOOL]}, "not both"),
        ({"json_schema": PERSON, "json_object": True}, "not both"),
        ({"json_object": "yes"}, "true or false"),
    ]:
        [refusal] = send(frame, grammars=True)
        assert refusal.frame.json()["code"] == "invalid_field" and words in refusal.frame.json()["message"], refusal


def test_every_rule_of_a_grammar_is_defined_once():
    # llama.cpp would merge a rule defined twice: a schema's rule must never take a fixed rule's name.
    for grammar in [JSON_OBJECT_GRAMMAR, *(schema_grammar(s) for s in SCHEMAS.values())]:
        names = [line.split(" ::= ")[0] for line in grammar.splitlines() if " ::= " in line]
        assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_llama_cpp_parses_every_grammar_written(engine):
    slot = engine.open_slot()
    try:
        for grammar in [JSON_OBJECT_GRAMMAR, *(schema_grammar(s) for s in SCHEMAS.values())]:
            make_generation(slot, [1, 2], grammar=grammar).close()
        with pytest.raises(ValueError, match="cannot parse the grammar"):
            make_generation(slot, [1, 2], grammar="root ::= undefined-rule")
    finally:
        slot.close()


async def structured(client, server, name: str, *, seed: int, stream: bool = False) -> tuple[str, str]:
    """(content, finish_reason) of one json_schema chat completion."""
    fields = dict(
        model=server.engine.name,
        messages=[{"role": "user", "content": ASK[name]}],
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}},
        max_tokens=400,
        seed=seed,
    )
    if not stream:
        answer = await client.chat.completions.create(**fields)
        return answer.choices[0].message.content, answer.choices[0].finish_reason
    chunks = [c async for c in await client.chat.completions.create(stream=True, **fields)]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)


async def test_json_schema_output_always_parses_and_validates(server):
    client = openai_client(server, GRAMMAR_TIMEOUT)
    for seed, name in enumerate(SCHEMAS):
        for stream in (False, True):
            text, finish_reason = await structured(client, server, name, seed=seed, stream=stream)
            assert finish_reason == "stop", (name, text)
            jsonschema.validate(json.loads(text), SCHEMAS[name])
    await client.close()


# Requests with a grammar, seeds 0 to 19: each schema of SCHEMAS several times, AT_ONCE at a time,
# one on each of the test engine's slots.
MANY_REQUESTS = 20
AT_ONCE = 4


@pytest.mark.slow
async def test_many_json_schema_requests(server):
    client = openai_client(server, GRAMMAR_TIMEOUT)
    names = list(SCHEMAS)
    for start in range(0, MANY_REQUESTS, AT_ONCE):
        results = await asyncio.gather(
            *(structured(client, server, names[i % len(names)], seed=i) for i in range(start, start + AT_ONCE))
        )
        for i, (text, finish_reason) in zip(range(start, start + AT_ONCE), results, strict=True):
            assert finish_reason == "stop", text
            jsonschema.validate(json.loads(text), SCHEMAS[names[i % len(names)]])
    await client.close()


@pytest.mark.slow
async def test_many_json_object_requests(server):
    client = openai_client(server, GRAMMAR_TIMEOUT)
    names = list(SCHEMAS)
    for start in range(0, MANY_REQUESTS, AT_ONCE):
        answers = await asyncio.gather(
            *(
                client.chat.completions.create(
                    model=server.engine.name,
                    messages=[{"role": "user", "content": ASK[names[i % len(names)]]}],
                    response_format={"type": "json_object"},
                    max_tokens=1000,
                    seed=i,
                )
                for i in range(start, start + AT_ONCE)
            )
        )
        for answer in answers:
            assert answer.choices[0].finish_reason == "stop", answer.choices[0].message.content
            assert isinstance(json.loads(answer.choices[0].message.content), dict)
    await client.close()


async def test_json_object_output_is_an_object(server):
    client = openai_client(server, GRAMMAR_TIMEOUT)
    for seed in range(3):
        answer = await client.chat.completions.create(
            model=server.engine.name,
            messages=[{"role": "user", "content": "List three fruits and their colours as JSON."}],
            response_format={"type": "json_object"},
            max_tokens=400,
            seed=seed,
        )
        assert answer.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(answer.choices[0].message.content), dict)
    await client.close()


# An answer that cannot end soon by itself: an array of at least 500 integers.
ENDLESS = {"type": "array", "items": {"type": "integer"}, "minItems": 500}


async def test_a_delete_stops_a_constrained_generation(server, http):
    body = {"prompt": "A list of every word you know:", "json_schema": ENDLESS, "max_tokens": 1500}
    async with http.post(f"{server.http.base_url}/generations", json=body) as response:
        assert response.status == 200
        events = sse_events(response)
        _, accepted = await anext(events)
        tokens, terminal = 0, None
        async for event, data in events:
            if event != "token":
                terminal = (event, data)
                break
            tokens += 1
            if tokens == 5:
                status, answer = await delete(http, server, accepted["request_id"], accepted["cancel_token"])
                assert status == 200 and answer["status"] == "cancelled"
        assert terminal is not None and terminal[0] == "cancelled" and terminal[1]["reason"] == "user_cancelled"
        assert terminal[1]["tokens_generated"] < 1500


async def test_closing_a_constrained_openai_stream_stops_the_model(server, logs):
    client = openai_client(server, GRAMMAR_TIMEOUT)
    stream = await client.chat.completions.create(
        model=server.engine.name,
        messages=[{"role": "user", "content": "List every word you know."}],
        response_format={"type": "json_schema", "json_schema": {"name": "words", "schema": ENDLESS}},
        max_tokens=1500,
        stream=True,
    )
    ids = []
    async for chunk in stream:
        ids.append(chunk.id)
        if len(ids) == 5:
            break
    await stream.close()
    [record] = await cancelled_records(logs, ids[0])
    assert record["reason"] == "client_disconnected"
    await client.close()


async def call_tool(client, server, messages: list, tool_choice, *, stream: bool):
    """(name, arguments, id, finish_reason) of a tool-calling completion."""
    fields = dict(
        model=server.engine.name,
        messages=messages,
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=200,
        seed=1,
    )
    if not stream:
        answer = await client.chat.completions.create(**fields)
        choice = answer.choices[0]
        assert choice.message.content is None
        [call] = choice.message.tool_calls
        return call.function.name, call.function.arguments, call.id, choice.finish_reason
    chunks = [c async for c in await client.chat.completions.create(stream=True, **fields)]
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    # One call: its id and name first, then pieces of its arguments.
    assert {d.index for d in deltas} == {0} and [d.id for d in deltas if d.id] == [deltas[0].id]
    arguments = "".join(d.function.arguments for d in deltas)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return deltas[0].function.name, arguments, deltas[0].id, finish[0]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tool_calling_loop_with_the_openai_package(server, stream):
    client = openai_client(server, GRAMMAR_TIMEOUT)
    messages: list = [{"role": "user", "content": "What is the weather in Paris?"}]
    name, arguments, call_id, finish_reason = await call_tool(client, server, messages, "required", stream=stream)
    assert finish_reason == "tool_calls" and name in PARAMETERS
    jsonschema.validate(json.loads(arguments), PARAMETERS[name])
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "22 degrees and sunny"},
    ]
    final = await client.chat.completions.create(
        model=server.engine.name, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=60, seed=1
    )
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.content and final.choices[0].message.tool_calls is None
    # A named function is the one called, with arguments valid against its parameters.
    choice = {"type": "function", "function": {"name": "add"}}
    name, arguments, _, finish_reason = await call_tool(
        client, server, [{"role": "user", "content": "Add 2 and 3."}], choice, stream=stream
    )
    assert (name, finish_reason) == ("add", "tool_calls")
    jsonschema.validate(json.loads(arguments), PARAMETERS["add"])
    await client.close()


async def test_bad_tools_and_tool_choices_are_refused_by_name(server):
    client = openai_client(server, GRAMMAR_TIMEOUT)
    for tools, tool_choice, param in [
        (TOOLS, "sometimes", "tool_choice"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([{"type": "function", "function": {"name": "bad name!"}}], "required", "tools"),
    ]:
        fields = {"tools": tools} | ({"tool_choice": tool_choice} if tool_choice is not None else {})
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(
                model=server.engine.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, **fields
            )
        assert caught.value.param == param, caught.value.message
    await client.close()


async def test_closing_or_deleting_a_tool_calling_stream_stops_the_model(server, logs, http):
    client = openai_client(server, GRAMMAR_TIMEOUT)
    for how in ("close", "delete"):
        stream = await stream_slow_call(client, server.engine.name)
        first = await anext(aiter(stream))
        if how == "close":
            await stream.close()
            [record] = await cancelled_records(logs, first.id)
            assert record["reason"] == "client_disconnected"
            continue
        token = stream.response.headers["X-Cancel-Token"]
        status, answer = await delete(http, server, first.id, token)
        assert status == 200 and answer["status"] == "cancelled"
        rest = [c async for c in stream]
        finals = [c for c in rest if c.choices and c.choices[0].finish_reason]
        # OpenAI's value, and Stopline's own reason beside it.
        assert [c.choices[0].finish_reason for c in finals] == ["stop"]
        assert finals[0].model_extra["stopline"]["reason"] == "user_cancelled"
    await client.close()
