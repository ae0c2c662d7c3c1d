"""Anthropic's Messages API, driven by the real ``anthropic`` package against a real server,
the real model and the real loop: the same generation as every other API, in Anthropic's shapes,
and stopped when the stream closes."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from stopline.api.anthropic_messages import FIELDS
from stopline.api.openai_fields import Treatment
from support import CHAT_FRANCE, LONG_ANSWER, UNIT, running_server, wait_for
from support.tools import GRAMMAR_TIMEOUT, PARAMETERS, TOOLS

# The tools in Anthropic's shape.
ANTHROPIC_TOOLS = [
    {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
    | ({"description": t["function"]["description"]} if "description" in t["function"] else {})
    for t in TOOLS
]
WEATHER_IN_PARIS = [{"role": "user", "content": "What is the weather in Paris today? Use the tool."}]

KEY = "anthropic-test-key-0123456789"


def client_of(server, api_key: str = "unused", timeout: float = 120) -> anthropic.AsyncAnthropic:
    # The package appends /v1/messages to its base URL.
    base = server.http.base_url.removesuffix("/v1")
    return anthropic.AsyncAnthropic(base_url=base, api_key=api_key, max_retries=0, timeout=timeout * UNIT)


async def test_a_message_is_the_same_greedy_answer_as_a_chat_completion(server):
    async with client_of(server) as client:
        message = await client.messages.create(
            model=server.engine.name, max_tokens=32, messages=CHAT_FRANCE, extra_body={"temperature": 0}
        )
    assert message.type == "message" and message.role == "assistant" and message.model == server.engine.name
    [block] = message.content
    assert block.type == "text" and "Paris" in block.text
    end = message.model_extra["stopline"]
    assert message.stop_reason == ("max_tokens" if end["tokens_generated"] == 32 else "end_turn")
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == end["prompt_tokens"]
    assert (
        usage.cache_read_input_tokens == end["prompt_tokens_reused"] and usage.output_tokens == end["tokens_generated"]
    )
    assert message.id == f"msg_{end['id']}"
    async with openai.AsyncOpenAI(base_url=server.http.base_url, api_key="unused", max_retries=0) as other:
        chat = await other.chat.completions.create(
            model=server.engine.name, max_tokens=32, messages=CHAT_FRANCE, temperature=0
        )
    assert chat.choices[0].message.content == block.text
    assert chat.usage.prompt_tokens == usage.input_tokens + usage.cache_read_input_tokens


async def test_a_repeated_conversation_reads_its_prompt_from_the_cache(server):
    """The same conversation again: its prompt is served from the cache, and usage says how much,
    in the final message streamed or not (input_tokens and cache_read_input_tokens add up to the prompt)."""
    messages = [{"role": "user", "content": "Name three rivers of Europe, one per line."}]
    asked = dict(model=server.engine.name, max_tokens=4, messages=messages, extra_body={"temperature": 0})
    async with client_of(server) as client:
        first = await client.messages.create(**asked)
        again = await client.messages.create(**asked)
        async with client.messages.stream(**asked) as s:
            streamed = await s.get_final_message()
    prompt = first.model_extra["stopline"]["prompt_tokens"]
    assert again.usage.cache_read_input_tokens == again.model_extra["stopline"]["prompt_tokens_reused"]
    for usage in (again.usage, streamed.usage):
        assert usage.cache_read_input_tokens > 0 and usage.cache_creation_input_tokens == 0
        assert usage.input_tokens + usage.cache_read_input_tokens == prompt


async def test_a_streamed_message_has_anthropics_events_and_the_same_text(server):
    asked = dict(model=server.engine.name, max_tokens=12, stop_sequences=["\n"], extra_body={"temperature": 0})
    messages = [{"role": "user", "content": [{"type": "text", "text": "Count: "}, {"type": "text", "text": "1, 2,"}]}]
    async with client_of(server) as client:
        whole = await client.messages.create(messages=messages, system="You count.", **asked)
        events = []
        async with client.messages.stream(
            messages=messages, system=[{"type": "text", "text": "You count."}], **asked
        ) as s:
            async for event in s:
                events.append(event.type)
            final = await s.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert events[1] == "content_block_start" and "content_block_stop" in events and "message_delta" in events
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    # A stop sequence given alone is the one that ended the answer.
    if whole.stop_reason == "stop_sequence":
        assert whole.stop_sequence == "\n" and "\n" not in whole.content[0].text
    else:
        assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 12


async def test_closing_a_message_stream_stops_the_model(server, logs):
    async with client_of(server) as client:
        async with client.messages.stream(model=server.engine.name, max_tokens=500, messages=LONG_ANSWER) as s:
            seen = 0
            async for event in s:
                seen += event.type == "content_block_delta"
                if seen == 5:
                    break
    await wait_for(lambda: logs.records("generation_cancelled"))
    [end] = logs.records("generation_cancelled")
    assert end["reason"] == "client_disconnected" and end["tokens_after_cancel"] <= 1
    await wait_for(lambda: server.scheduler.active == 0)


async def test_count_tokens_is_the_prompt_a_message_takes(server):
    async with client_of(server) as client:
        # With a system prompt of its own, and with the model's default one.
        for system in ({"system": "You answer in one word."}, {}):
            asked = dict(model=server.engine.name, messages=CHAT_FRANCE, **system)
            counted = await client.messages.count_tokens(**asked)
            message = await client.messages.create(max_tokens=2, **asked)
            assert counted.input_tokens == message.model_extra["stopline"]["prompt_tokens"] > 0
        with pytest.raises(anthropic.BadRequestError) as refused:
            await client.post(
                "/v1/messages/count_tokens",
                cast_to=anthropic.types.MessageTokensCount,
                body={"model": server.engine.name, "messages": CHAT_FRANCE, "max_tokens": 8},
            )
    assert "max_tokens" in refused.value.body["error"]["message"]


async def test_a_forced_tool_call_is_a_tool_use_block_streamed_or_not(server):
    asked = dict(
        model=server.engine.name,
        max_tokens=200,
        messages=WEATHER_IN_PARIS,
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    )
    async with client_of(server, timeout=GRAMMAR_TIMEOUT) as client:
        message = await client.messages.create(**asked)
        deltas = []
        async with client.messages.stream(**asked) as stream:
            async for event in stream:
                if event.type == "content_block_delta":
                    deltas.append(event.delta)
            streamed = await stream.get_final_message()
    for answer in (message, streamed):
        assert answer.stop_reason == "tool_use", answer
        [call] = [block for block in answer.content if block.type == "tool_use"]
        assert call.name == "get_weather" and call.id.startswith("toolu_")
        jsonschema.validate(call.input, PARAMETERS["get_weather"])
    # The input arrives in pieces of JSON that make it whole.
    pieces = [d.partial_json for d in deltas if d.type == "input_json_delta"]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == streamed.content[-1].input


async def test_a_tool_result_goes_back_and_the_answer_uses_it(server):
    async with client_of(server, timeout=GRAMMAR_TIMEOUT) as client:
        first = await client.messages.create(
            model=server.engine.name,
            max_tokens=200,
            messages=WEATHER_IN_PARIS,
            tools=ANTHROPIC_TOOLS,
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
        )
        [call] = [block for block in first.content if block.type == "tool_use"]
        result = {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 31 degrees."}
        conversation = [
            *WEATHER_IN_PARIS,
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": [result]},
        ]
        answer = await client.messages.create(
            model=server.engine.name,
            max_tokens=40,
            messages=conversation,
            tools=ANTHROPIC_TOOLS,
            tool_choice={"type": "none"},
            extra_body={"temperature": 0},
        )
        counted = await client.messages.count_tokens(model=server.engine.name, messages=conversation)
    assert answer.stop_reason in ("end_turn", "max_tokens") and [b.type for b in answer.content] == ["text"]
    # The call and its result are in the prompt: longer than the question alone.
    assert counted.input_tokens > answer.usage.input_tokens // 2 > 0
    assert answer.model_extra["stopline"]["prompt_tokens"] > len(server.engine.encode(messages=WEATHER_IN_PARIS))


@pytest.mark.parametrize(
    "change, named",
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0"),
        ({"temperature": 9}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"metadata": {"session": "x"}}, "metadata"),
        ({"bogus": 1}, "bogus"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": [1]}]}]}, "tool_use_id"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f"}]}]}, "tool_use block"),
    ],
)
async def test_what_is_not_honoured_is_refused_by_name(server, change, named):
    body = {"model": server.engine.name, "max_tokens": 8, "messages": CHAT_FRANCE, **change}
    body = {k: v for k, v in body.items() if v is not None}
    async with client_of(server) as client:
        with pytest.raises(anthropic.BadRequestError) as refused:
            await client.post("/v1/messages", cast_to=anthropic.types.Message, body=body)
    assert refused.value.status_code == 400
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert named in refused.value.body["error"]["message"]
    assert server.scheduler.active == 0


def test_every_field_is_honoured_or_refused():
    assert set(FIELDS.values()) == {Treatment.HONOURED, Treatment.REFUSED}
    assert {"model", "messages", "max_tokens", "system", "stop_sequences", "stream"} <= {
        name for name, treatment in FIELDS.items() if treatment is Treatment.HONOURED
    }


async def test_anthropics_key_header_is_an_api_key(engine):
    async with running_server(engine, api_keys=(KEY,)) as server:
        async with client_of(server, KEY) as client:
            message = await client.messages.create(model=server.engine.name, max_tokens=2, messages=CHAT_FRANCE)
            assert message.usage.output_tokens >= 1
        async with client_of(server, "not-the-key-0123456789") as client:
            with pytest.raises(anthropic.AuthenticationError):
                await client.messages.create(model=server.engine.name, max_tokens=2, messages=CHAT_FRANCE)
