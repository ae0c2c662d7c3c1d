"""Tool calls on the llama.cpp engine with the real ``openai`` package: tool_choice auto, argument
pieces streamed as OpenAI streams them, parallel_tool_calls, and the reader of the call format;
and JSON Schema keywords (pattern, format, bounds, oneOf, allOf) held by the grammar or refused."""

from __future__ import annotations

import datetime
import json
import urllib.parse

import jsonschema
import openai
import pytest

from stopline.engine.loop import Engine
from stopline.structured.json_grammar import SchemaError, schema_grammar
from stopline.structured.tool_calls import ArgumentsPiece, CallReader, CallStarted, Prose, ToolChoice, calls_grammar
from support import cancelled_records, openai_client
from support.tools import GRAMMAR_TIMEOUT, PARAMETERS, TOOLS, stream_slow_call


@pytest.fixture(scope="module")
def engine(llama_engine) -> Engine:
    """The embedded SmolLM2 on the llama.cpp engine, the one with a grammar sampler
    (overrides conftest's for this module)."""
    return llama_engine


# A conversation with one call and its result already in it: the small model then calls again.
HISTORY = [
    {"role": "user", "content": "What is the weather in London?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "London", "unit": "celsius"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "15 degrees and cloudy"},
    {"role": "assistant", "content": "It is 15 degrees and cloudy in London."},
    {"role": "user", "content": "What is the weather in Paris?"},
]


def read_all(text: str, prose: bool, size: int) -> list:
    """The reader's events for ``text`` fed ``size`` characters at a time."""
    reader = CallReader(prose=prose)
    events = [e for at in range(0, len(text), size) for e in reader.feed(text[at : at + size])]
    return [*events, *reader.finish()], reader.complete


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_the_reader_splits_prose_from_calls_and_streams_arguments(size):
    text = (
        'Let me see. <tool_call>{"name": "add", "arguments": {"a": "}", "b": [2]} }</tool_call>\n'
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    )
    events, complete = read_all(text, prose=True, size=size)
    assert complete
    assert "".join(e.text for e in events if isinstance(e, Prose)) == "Let me see."
    assert [e for e in events if isinstance(e, CallStarted)] == [CallStarted(0, "add"), CallStarted(1, "f")]
    pieces = ["".join(e.text for e in events if isinstance(e, ArgumentsPiece) and e.index == i) for i in (0, 1)]
    assert [json.loads(p) for p in pieces] == [{"a": "}", "b": [2]}, {}]
    if size == 1:
        assert sum(isinstance(e, ArgumentsPiece) for e in events) > 2
    # Prose that only looks like the start of a call is given back whole at the end.
    events, complete = read_all("a < b and <tool_", prose=True, size=size)
    assert "".join(e.text for e in events) == "a < b and <tool_" and not complete
    # A call cut short is started but not complete.
    events, complete = read_all('<tool_call>{"name": "add", "arguments": {"a": 1', prose=False, size=size)
    assert events[0] == CallStarted(0, "add") and not complete


def test_the_call_grammar_allows_one_call_unless_parallel():
    functions = [t["function"] for t in TOOLS]
    assert '"\\n" calls' in calls_grammar(functions, ToolChoice.AUTO, parallel=True)
    assert '"\\n" calls' not in calls_grammar(functions, ToolChoice.AUTO, parallel=False)
    assert calls_grammar(functions, ToolChoice.REQUIRED, parallel=True).startswith("root ::= calls")
    with pytest.raises(SchemaError) as caught:
        calls_grammar([{"name": "f", "parameters": {"type": "object", "not": {}}}], ToolChoice.AUTO, True)
    assert caught.value.keyword == "not"


async def tool_answer(client, server, messages, *, stream: bool, **fields):
    """(content, [(id, name, arguments)], finish_reason) of a chat completion with TOOLS; streamed,
    put together by the openai package's own stream helper."""
    fields = {"model": server.engine.name, "messages": messages, "tools": TOOLS, "max_tokens": 100, "seed": 0, **fields}
    if stream:
        async with client.chat.completions.stream(**fields) as events:
            async for _ in events:
                pass
            answer = await events.get_final_completion()
    else:
        answer = await client.chat.completions.create(**fields)
    choice = answer.choices[0]
    calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return choice.message.content, calls, choice.finish_reason


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tool_calling_loop_with_tool_choice_auto(server, stream):
    client = openai_client(server, GRAMMAR_TIMEOUT)
    messages = list(HISTORY)
    # tool_choice is left out: auto, OpenAI's default when tools are given.
    content, calls, finish_reason = await tool_answer(client, server, messages, stream=stream)
    assert finish_reason == "tool_calls" and calls, content
    for _, name, arguments in calls:
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])
    assert len({call_id for call_id, _, _ in calls}) == len(calls)
    messages += [
        {
            "role": "assistant",
            "content": content,
            "tool_calls": [{"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls],
        },
        *({"role": "tool", "tool_call_id": i, "content": "22 degrees and sunny"} for i, _, _ in calls),
    ]
    content, calls, finish_reason = await tool_answer(
        client, server, messages, stream=stream, tool_choice="auto", seed=2
    )
    assert finish_reason == "stop" and content and not calls
    await client.close()


async def test_streamed_arguments_come_in_pieces_as_openai_streams_them(server):
    client = openai_client(server, GRAMMAR_TIMEOUT)
    stream = await client.chat.completions.create(
        model=server.engine.name, messages=HISTORY, tools=TOOLS, max_tokens=100, seed=0, stream=True
    )
    chunks = [c async for c in stream]
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    first, rest = deltas[0], deltas[1:]
    assert (first.index, first.type, first.function.arguments) == (0, "function", "")
    assert first.id.startswith("call_") and first.function.name == "get_weather"
    # Every later piece names only its call's index and a piece of the arguments, one per token.
    assert len(rest) > 3
    assert all(d.index == 0 and d.id is None and d.function.name is None and d.function.arguments for d in rest)
    arguments = json.loads("".join(d.function.arguments for d in rest))
    jsonschema.validate(arguments, PARAMETERS["get_weather"])
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["tool_calls"]
    await client.close()


async def test_parallel_tool_calls_false_never_gives_two_calls(server):
    client = openai_client(server, GRAMMAR_TIMEOUT)
    messages = [{"role": "user", "content": "Add 2 and 3, and tell me the weather in Paris."}]
    counts = []
    for seed in range(4):
        for parallel in (False, True):
            answer = await client.chat.completions.create(
                model=server.engine.name,
                messages=messages,
                tools=TOOLS,
                tool_choice="required",
                parallel_tool_calls=parallel,
                max_tokens=150,
                seed=seed,
                temperature=1.0,
                # Unpenalized (the default), the small model may repeat itself inside a string
                # until max_tokens cuts the call short; what is tested here is the call count.
                extra_body={"repetition_penalty": 1.1},
            )
            calls = answer.choices[0].message.tool_calls or []
            counts.append((parallel, len(calls)))
            for call in calls:
                jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
            assert len({c.id for c in calls}) == len(calls)
    assert all(n == 1 for parallel, n in counts if not parallel), counts
    await client.close()


async def test_closing_the_stream_inside_a_call_stops_the_model(server, logs):
    client = openai_client(server, GRAMMAR_TIMEOUT)
    stream = await stream_slow_call(client, server.engine.name)
    pieces, request_id = 0, None
    async for chunk in stream:
        request_id = chunk.id
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            pieces += bool(delta.function.arguments)
        if pieces == 5:
            break
    await stream.close()
    [record] = await cancelled_records(logs, request_id)
    assert record["reason"] == "client_disconnected" and record["tokens_generated"] < 1500
    await client.close()


async def test_a_delete_by_the_clients_id_inside_a_streamed_call_ends_it_with_one_final_chunk(server, http, logs):
    """An agent's Stop while the model writes a call's arguments: a DELETE, from another connection,
    by the id and token the agent chose. The stream ends with one final chunk, which says how; the
    arguments read are a prefix of what the model wrote, and nothing came after the cancel."""
    client = openai_client(server, GRAMMAR_TIMEOUT)
    request_id, token = "agent-turn.7", "an-agents-own-cancel-token"
    stream = await stream_slow_call(
        client, server.engine.name, extra_headers={"X-Request-Id": request_id, "X-Cancel-Token": token}
    )
    pieces, finals, deleted = [], [], None
    async for chunk in stream:
        choice = chunk.choices[0]
        pieces += [d.function.arguments for d in choice.delta.tool_calls or [] if d.function.arguments]
        if choice.finish_reason:
            finals.append((choice.finish_reason, chunk.model_extra["stopline"]))
        if len(pieces) == 5 and deleted is None:
            async with http.delete(
                f"{server.http.base_url}/generations/{request_id}", headers={"Authorization": f"Bearer {token}"}
            ) as response:
                deleted = response.status, await response.json()
    assert deleted == (200, {"request_id": request_id, "status": "cancelled"})
    [(finish_reason, end)] = finals
    assert finish_reason == "stop" and end["type"] == "cancelled" and end["reason"] == "user_cancelled"
    assert end["tokens_after_cancel"] == 0 and len(pieces) <= end["tokens_generated"] < 1500
    # A cut call: the start of an object, never a whole one.
    arguments = "".join(pieces)
    assert arguments.lstrip().startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(arguments)
    [record] = await cancelled_records(logs, request_id)
    assert record["reason"] == "user_cancelled" and record["tokens_after_cancel"] == 0
    await client.close()


# Schemas with each keyword the grammar holds, and a check beyond jsonschema's where it has none.
KEYWORD_SCHEMAS = {
    "pattern": (
        {
            "type": "object",
            "properties": {
                "code": {"type": "string", "pattern": "^[A-Z]{3}-\\d{2,4}$"},
                "phone": {"type": "string", "pattern": "^\\+?(\\d{2} ){2}\\d{2}$"},
                "word": {"type": "string", "pattern": "(?:yes|no|maybe)[.!]?"},
                "quoted": {"type": "string", "pattern": '^[^a-z]"[a-z]{1,5}"$'},
            },
            "required": ["code", "phone", "word", "quoted"],
        },
        "Give a product code, a phone number, an answer and a quote as JSON.",
    ),
    "format": (
        {
            "type": "object",
            "properties": {
                name: {"type": "string", "format": name}
                for name in ("date", "time", "date-time", "uuid", "email", "ipv4", "uri")
            },
            "required": ["date", "time", "date-time", "uuid", "email", "ipv4", "uri"],
        },
        "Describe a server log entry as JSON.",
    ),
    "bounds": (
        {
            "type": "object",
            "properties": {
                "age": {"type": "integer", "minimum": 18, "maximum": 99},
                "floor": {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 12},
                "debt": {"type": "integer", "maximum": -100},
                "big": {"type": "integer", "minimum": 1000},
                "ratio": {"type": "number", "minimum": 0, "maximum": 1},
                "temperature": {"type": "number", "exclusiveMinimum": -40, "exclusiveMaximum": 50},
                "name": {"type": "string", "minLength": 2, "maxLength": 8},
                "tags": {"type": "array", "items": {"const": "x"}, "minItems": 1, "maxItems": 2},
            },
            "required": ["age", "floor", "debt", "big", "ratio", "temperature", "name", "tags"],
            "additionalProperties": False,
        },
        "Describe a person and their flat as JSON.",
    ),
    "combined": (
        {
            "$defs": {
                "Cat": {
                    "type": "object",
                    "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer", "minimum": 1, "maximum": 9}},
                    "required": ["kind", "lives"],
                },
                "Dog": {
                    "type": "object",
                    "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
                    "required": ["kind", "good"],
                },
                "Named": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}},
            },
            "type": "object",
            "properties": {
                "pet": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]},
                "id": {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 10}]},
                "owner": {
                    "allOf": [
                        {"$ref": "#/$defs/Named"},
                        {"properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"]},
                    ]
                },
                "extra": {"type": "object", "additionalProperties": False},
            },
            "required": ["pet", "id", "owner", "extra"],
        },
        "Describe a pet and its owner as JSON.",
    ),
}
# The formats of the schemas' own draft (a bare FormatChecker checks "time" as draft 3 did).
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER


def check_formats(value: dict) -> None:
    """time, date-time and uri, which jsonschema checks only with extra packages."""
    assert datetime.time.fromisoformat(value["time"]).tzinfo is not None
    assert datetime.datetime.fromisoformat(value["date-time"]).tzinfo is not None
    parts = urllib.parse.urlsplit(value["uri"])
    assert parts.scheme and parts.netloc, value["uri"]


@pytest.mark.parametrize("name", list(KEYWORD_SCHEMAS))
async def test_schemas_with_each_keyword_always_validate(server, name):
    schema, ask = KEYWORD_SCHEMAS[name]
    client = openai_client(server, GRAMMAR_TIMEOUT)
    for seed in range(4):
        answer = await client.chat.completions.create(
            model=server.engine.name,
            messages=[{"role": "user", "content": ask}],
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
            max_tokens=500,
            seed=seed,
            # Unpenalized (the default), the small model may repeat itself inside a string with
            # no maxLength until max_tokens cuts it short; what is tested here is the schema.
            extra_body={"repetition_penalty": 1.1},
        )
        assert answer.choices[0].finish_reason == "stop", answer.choices[0].message.content
        value = json.loads(answer.choices[0].message.content)
        jsonschema.validate(value, schema, format_checker=FORMATS)
        if name == "format":
            check_formats(value)
    await client.close()


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "string", "pattern": "(?=a)a"}, "pattern"),
        ({"type": "string", "pattern": "(a)\\1"}, "pattern"),
        ({"type": "string", "pattern": "\\bword"}, "pattern"),
        ({"type": "string", "pattern": "a^b"}, "pattern"),
        ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "maxLength"),
        ({"type": "string", "format": "hostname"}, "format"),
        ({"type": "number", "minimum": 0.5}, "minimum"),
        ({"type": "integer", "minimum": 10, "maximum": 5}, "minimum"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
        ({"oneOf": [{"type": "object"}, {"type": "object", "properties": {"a": {"const": 1}}}]}, "oneOf"),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allOf"),
        ({"type": "integer", "multipleOf": 5}, "multipleOf"),
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"not": {"type": "null"}}, "not"),
    ],
)
async def test_a_keyword_the_grammar_cannot_hold_is_refused_by_name(server, schema, keyword):
    with pytest.raises(SchemaError) as caught:
        schema_grammar(schema)
    assert caught.value.keyword == keyword and keyword in str(caught.value)
    client = openai_client(server, GRAMMAR_TIMEOUT)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(
            model=server.engine.name,
            messages=[{"role": "user", "content": "Hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        )
    assert refused.value.code == "invalid_field" and keyword in refused.value.message
    tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": schema}}},
    }
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(
            model=server.engine.name, messages=[{"role": "user", "content": "Hi"}], tools=[tool]
        )
    assert refused.value.code == "invalid_field" and keyword in refused.value.message
    await client.close()
