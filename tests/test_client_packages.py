"""Client packages that wrap OpenAI's API, ``langchain-openai`` and ``litellm``, driven against a
real server, the real model and the real loop: each answers as the ``openai`` package does, and
a stream it stops stops the model."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os

import jsonschema
import pytest_asyncio

# litellm fetches its model price list from the network on import unless told to use its own copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402

from support import CHAT_FRANCE, LONG_ANSWER, UNIT, openai_client, running_server, wait_for  # noqa: E402
from support.tools import GRAMMAR_TIMEOUT, PARAMETERS, WEATHER_TOOL  # noqa: E402


@pytest_asyncio.fixture
async def server(engine, logs):
    # Not conftest's server: these packages keep pooled connections of their own open after a
    # test, which its check for sockets the server leaked would count.
    async with running_server(engine) as served:
        yield served


def chat_model(server, **kwargs) -> ChatOpenAI:
    asked = dict(model=server.engine.name, base_url=server.http.base_url, api_key="unused", max_retries=0)
    return ChatOpenAI(**{**asked, "timeout": 120 * UNIT, **kwargs})


def litellm_args(server) -> dict:
    # openai/ routes litellm to an OpenAI-compatible server at api_base, with the model name after it.
    return dict(
        model=f"openai/{server.engine.name}", api_base=server.http.base_url, api_key="unused", timeout=120 * UNIT
    )


async def greedy_chat(server, max_tokens: int):
    """The same greedy request through the ``openai`` package: what each package must answer."""
    async with openai_client(server) as client:
        return await client.chat.completions.create(
            model=server.engine.name, max_tokens=max_tokens, messages=CHAT_FRANCE, temperature=0
        )


async def stopped_by_the_client(server, logs) -> None:
    """The one generation ended as the client's disconnect, with no token after the cancel but
    the one the loop may have been decoding then, and nothing is left running."""
    await wait_for(lambda: logs.records("generation_cancelled"), timeout=30 * UNIT)
    [end] = logs.records("generation_cancelled")
    assert end["reason"] == "client_disconnected" and end["tokens_after_cancel"] <= 1
    assert end["tokens_generated"] < 500
    await wait_for(lambda: server.scheduler.active == 0)


async def test_langchain_invoke_and_stream_are_the_same_greedy_answer(server):
    model = chat_model(server, temperature=0, max_tokens=32)
    answer = await model.ainvoke(CHAT_FRANCE)
    chunks = [chunk async for chunk in model.astream(CHAT_FRANCE)]
    chat = await greedy_chat(server, 32)
    expected = chat.choices[0].message.content
    assert answer.content == expected and "Paris" in answer.content
    assert "".join(chunk.content for chunk in chunks) == expected
    assert answer.response_metadata["finish_reason"] == chat.choices[0].finish_reason
    assert answer.usage_metadata["input_tokens"] == chat.usage.prompt_tokens
    assert answer.usage_metadata["output_tokens"] == chat.usage.completion_tokens


async def test_breaking_out_of_a_langchain_stream_stops_the_model(server, logs):
    model = chat_model(server, max_tokens=500)
    seen = 0
    # Leaving the block closes the stream, and with it the connection.
    async with contextlib.aclosing(model.astream(LONG_ANSWER)) as stream:
        async for chunk in stream:
            seen += bool(chunk.content)
            if seen == 5:
                break
    assert seen == 5
    await stopped_by_the_client(server, logs)


async def test_langchain_bind_tools_calls_a_function(llama_engine):
    async with running_server(llama_engine) as server:
        model = chat_model(server, temperature=0, timeout=GRAMMAR_TIMEOUT * UNIT)
        bound = model.bind_tools([WEATHER_TOOL], tool_choice="required", parallel_tool_calls=False)
        answer = await bound.ainvoke("What is the weather in Paris?")
    [call] = answer.tool_calls
    assert call["name"] == "get_weather" and call["id"]
    jsonschema.validate(call["args"], PARAMETERS["get_weather"])
    assert answer.response_metadata["finish_reason"] == "tool_calls"


async def test_litellm_completion_and_acompletion_are_the_same_greedy_answer(server):
    asked = dict(messages=CHAT_FRANCE, temperature=0, max_tokens=32, **litellm_args(server))
    # litellm's completion blocks: it runs in a thread, the server on this loop.
    whole = await asyncio.to_thread(litellm.completion, **asked)
    awaited = await litellm.acompletion(**asked)
    chat = await greedy_chat(server, 32)
    expected = chat.choices[0].message.content
    assert whole.choices[0].message.content == awaited.choices[0].message.content == expected
    assert "Paris" in expected and whole.usage.completion_tokens == chat.usage.completion_tokens
    assert whole.choices[0].finish_reason == awaited.choices[0].finish_reason == chat.choices[0].finish_reason


async def test_litellm_streams_the_same_greedy_answer(server):
    asked = dict(messages=CHAT_FRANCE, temperature=0, max_tokens=32, stream=True, **litellm_args(server))
    stream = await litellm.acompletion(**asked)
    pieces = [chunk.choices[0].delta.content or "" async for chunk in stream]

    def streamed() -> str:
        return "".join(chunk.choices[0].delta.content or "" for chunk in litellm.completion(**asked))

    expected = (await greedy_chat(server, 32)).choices[0].message.content
    assert "".join(pieces) == expected
    assert await asyncio.to_thread(streamed) == expected


async def test_breaking_out_of_a_litellm_stream_stops_the_model(server, logs):
    seen = 0
    async with await litellm.acompletion(
        messages=LONG_ANSWER, max_tokens=500, stream=True, **litellm_args(server)
    ) as stream:
        async for chunk in stream:
            seen += bool(chunk.choices[0].delta.content)
            if seen == 5:
                break
    assert seen == 5
    await stopped_by_the_client(server, logs)


async def test_litellm_passes_a_tool_call_through(llama_engine):
    async with running_server(llama_engine) as server:
        answer = await litellm.acompletion(
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[WEATHER_TOOL],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            **{**litellm_args(server), "timeout": GRAMMAR_TIMEOUT * UNIT},
        )
    [call] = answer.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and answer.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS["get_weather"])
