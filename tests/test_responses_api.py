"""OpenAI's Responses API, driven by the real ``openai`` package against a real server, the real
model and the real loop: the same generation as every other API, in Responses' shapes; stopped
by its cancel, by id, or when the stream closes."""

from __future__ import annotations

import json

import aiohttp
import jsonschema
import openai
import pytest

from stopline import responses_api
from stopline.api.openai_fields import Treatment
from stopline.api.responses import FIELDS
from support import (
    CHAT_FRANCE,
    LONG_ANSWER,
    UNIT,
    cancelled_records,
    delete,
    openai_client,
    running_server,
    sse_events,
    wait_for,
)
from support.tools import GRAMMAR_TIMEOUT, PARAMETERS, WEATHER_TOOL

KEY = "responses-test-key-0123456789"
OTHER_KEY = "responses-other-key-0123456789"


def keyed_client(server, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.http.base_url, api_key=key, max_retries=0, timeout=120 * UNIT)


async def test_a_response_is_the_same_greedy_answer_as_a_chat_completion(server):
    async with openai_client(server) as client:
        response = await client.responses.create(
            model=server.engine.name, input=CHAT_FRANCE[0]["content"], max_output_tokens=32, temperature=0
        )
        chat = await client.chat.completions.create(
            model=server.engine.name, max_tokens=32, messages=CHAT_FRANCE, temperature=0
        )
    end = response.model_extra["stopline"]
    assert response.object == "response" and response.id == f"resp_{end['id']}"
    assert response.status == ("incomplete" if end["reason"] == "max_tokens" else "completed")
    [item] = response.output
    assert item.type == "message" and item.role == "assistant"
    assert response.output_text == chat.choices[0].message.content and "Paris" in response.output_text
    assert response.usage.input_tokens == chat.usage.prompt_tokens == end["prompt_tokens"]
    assert response.usage.output_tokens == end["tokens_generated"]
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens


async def test_a_streamed_response_has_responses_events_in_order_and_the_same_text(server):
    asked = dict(
        model=server.engine.name,
        instructions="You count.",
        input=[
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "Count: "}, {"type": "input_text", "text": "1, 2,"}],
            }
        ],
        max_output_tokens=12,
        temperature=0,
        metadata={"run": "streamed"},
    )
    async with openai_client(server) as client:
        whole = await client.responses.create(**asked)
        events = [event async for event in await client.responses.create(stream=True, **asked)]
    names = [e.type for e in events]
    assert names[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert names[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if whole.status == "completed" else "response.incomplete",
    ]
    assert set(names[4:-4]) <= {"response.output_text.delta"}
    numbers = [e.sequence_number for e in events]
    assert numbers == sorted(set(numbers))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    final = events[-1]
    assert final.response.id == events[0].response.id and final.response.output_text == text
    assert final.response.metadata == {"run": "streamed"} and final.response.instructions == "You count."
    assert (
        final.model_extra["stopline"]["tokens_generated"]
        == whole.usage.output_tokens
        == final.response.usage.output_tokens
    )


async def test_max_output_tokens_leaves_a_response_incomplete(server):
    async with openai_client(server) as client:
        response = await client.responses.create(model=server.engine.name, input=LONG_ANSWER, max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[0].status == "incomplete"


async def test_cancel_by_id_stops_a_streamed_response(engine, logs):
    async with running_server(engine, api_keys=(KEY, OTHER_KEY)) as server:
        async with keyed_client(server, KEY) as client, keyed_client(server, OTHER_KEY) as other:
            stream = await client.responses.create(
                model=server.engine.name, input=LONG_ANSWER, max_output_tokens=500, stream=True
            )
            deltas, response_id = 0, ""
            async for event in stream:
                if event.type == "response.created":
                    response_id = event.response.id
                deltas += event.type == "response.output_text.delta"
                if deltas == 5:
                    break
            # Only the key that started it may stop it.
            with pytest.raises(openai.PermissionDeniedError):
                await other.responses.cancel(response_id)
            cancelled = await client.responses.cancel(response_id)
            rest = [event async for event in stream]
            again = await client.responses.retrieve(response_id)
    assert cancelled.id == response_id and cancelled.status == "cancelled"
    # OpenAI's cancelled Response has no incomplete_details; Stopline's reason is in its own field.
    assert cancelled.incomplete_details is None
    assert cancelled.model_extra["stopline"]["reason"] == "user_cancelled"
    final = rest[-1]
    assert final.type == "response.incomplete" and final.response.status == "cancelled"
    end = final.model_extra["stopline"]
    assert end["type"] == "cancelled" and end["reason"] == "user_cancelled" and end["tokens_after_cancel"] <= 1
    # The stream carried every token generated, and the cancel's answer counts them all.
    deltas += sum(e.type == "response.output_text.delta" for e in rest)
    assert deltas == end["tokens_generated"] == cancelled.usage.output_tokens
    assert again.status == "cancelled" and again.output_text == cancelled.output_text
    [record] = logs.records("generation_cancelled", request_id=end["id"])
    assert record["reason"] == "user_cancelled"


async def test_closing_a_response_stream_stops_the_model(server, logs):
    async with openai_client(server) as client:
        stream = await client.responses.create(
            model=server.engine.name, input=LONG_ANSWER, max_output_tokens=500, stream=True
        )
        deltas = 0
        async for event in stream:
            deltas += event.type == "response.output_text.delta"
            if deltas == 5:
                break
        await stream.close()
    await wait_for(lambda: logs.records("generation_cancelled"))
    [end] = logs.records("generation_cancelled")
    assert end["reason"] == "client_disconnected" and end["tokens_after_cancel"] <= 1
    await wait_for(lambda: server.scheduler.active == 0)


async def test_a_background_response_is_answered_at_once_and_cancelled_by_id(engine):
    async with running_server(engine, api_keys=(KEY,)) as server, keyed_client(server, KEY) as client:
        done = await client.responses.create(
            model=server.engine.name, input=CHAT_FRANCE[0]["content"], max_output_tokens=8, background=True
        )
        assert done.status in ("queued", "in_progress") and done.background
        finished = await wait_for(lambda: _settled(client, done.id))
        assert finished.status in ("completed", "incomplete") and finished.usage.output_tokens >= 1
        running = await client.responses.create(
            model=server.engine.name, input=LONG_ANSWER, max_output_tokens=500, background=True
        )
        assert running.status in ("queued", "in_progress")
        cancelled = await client.responses.cancel(running.id)
        assert cancelled.status == "cancelled" and cancelled.usage.output_tokens < 500
        assert (await client.responses.retrieve(running.id)).status == "cancelled"
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve("resp_00000000-0000-0000-0000-000000000000")


async def test_a_response_cancel_and_a_delete_end_alike(server, logs):
    """The Responses cancel is DELETE by another route: one stop, with the same end record and
    the same terminal frame, figures included."""
    api = server.http.base_url
    async with aiohttp.ClientSession() as http:
        asked = {"model": server.engine.name, "input": LONG_ANSWER, "max_output_tokens": 500, "background": True}
        async with http.post(f"{api}/responses", json=asked) as response:
            response_id = (await response.json())["id"]
            auth = {"Authorization": f"Bearer {response.headers['X-Cancel-Token']}"}

        async def decoding():
            async with http.get(f"{api}/responses/{response_id}", headers=auth) as response:
                return (await response.json())["output"]

        await wait_for(decoding, timeout=60)
        async with http.post(f"{api}/responses/{response_id}/cancel", headers=auth) as response:
            cancelled = await response.json()
        async with http.post(f"{api}/generations", json={"messages": LONG_ANSWER, "max_tokens": 500}) as response:
            events = sse_events(response)
            event, accepted = await anext(events)
            assert event == "accepted"
            while (await anext(events))[0] != "token":
                pass
            assert await delete(http, server, accepted["request_id"], accepted["cancel_token"]) == (
                200,
                {"request_id": accepted["request_id"], "status": "cancelled"},
            )
            terminal = [data async for _, data in events][-1]
    by_cancel = cancelled["stopline"]
    assert cancelled["status"] == "cancelled" and by_cancel["type"] == terminal["type"] == "cancelled"
    assert by_cancel["reason"] == terminal["reason"] == "user_cancelled"
    assert by_cancel.keys() == terminal.keys()
    [responses_end] = await cancelled_records(logs, response_id.removeprefix("resp_"))
    [delete_end] = await cancelled_records(logs, accepted["request_id"])
    assert responses_end.keys() == delete_end.keys()
    for end, frame in ((responses_end, by_cancel), (delete_end, terminal)):
        assert end["cancel_latency_ms"] == frame["cancel_latency_ms"] is not None
        assert end["tokens_after_cancel"] == frame["tokens_after_cancel"] <= 1


async def _settled(client, response_id: str):
    response = await client.responses.retrieve(response_id)
    return response if response.status not in ("queued", "in_progress") else None


@pytest.mark.parametrize(
    "change, named",
    [
        ({"tools": [{"type": "web_search"}]}, "web_search"),
        ({"tools": [{"type": "function", "name": "f"}], "tool_choice": "nope"}, "tool_choice"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input_image"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
        ({"background": True, "stream": True}, "background"),
        ({"temperature": 9}, "temperature"),
        ({"bogus": 1}, "bogus"),
    ],
)
async def test_what_is_not_honoured_is_refused_by_name(server, change, named):
    body = {"model": server.engine.name, "input": "Hi", "max_output_tokens": 4, **change}
    async with openai_client(server) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.post("/responses", cast_to=openai.types.responses.Response, body=body)
    assert refused.value.status_code == 400
    assert named in refused.value.body["message"]
    assert server.scheduler.active == 0


def test_every_field_is_honoured_or_refused():
    assert set(FIELDS.values()) == {Treatment.HONOURED, Treatment.REFUSED}
    assert {"model", "input", "instructions", "max_output_tokens", "stream", "background"} <= {
        name for name, treatment in FIELDS.items() if treatment is Treatment.HONOURED
    }


async def test_text_format_json_schema_constrains_the_answer(llama_engine):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    text = {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}
    async with running_server(llama_engine) as server, openai_client(server) as client:
        response = await client.responses.create(
            model=server.engine.name, input=CHAT_FRANCE, max_output_tokens=64, temperature=0, text=text
        )
    assert response.status == "completed" and response.text.format.type == "json_schema"
    assert isinstance(json.loads(response.output_text)["city"], str)


async def test_previous_response_id_continues_the_conversation(engine):
    first_input = "My name is Ada. Say hello to me."
    async with running_server(engine, api_keys=(KEY, OTHER_KEY)) as server, keyed_client(server, KEY) as client:
        first = await client.responses.create(
            model=server.engine.name,
            instructions="You are terse.",
            input=first_input,
            max_output_tokens=12,
            temperature=0,
        )
        second = await client.responses.create(
            model=server.engine.name,
            previous_response_id=first.id,
            input=[{"role": "user", "content": "What is my name?"}],
            max_output_tokens=16,
            temperature=0,
        )
        # The same turns as a chat: the first input and answer, then the new input; the first
        # response's instructions are not carried over.
        chat = await client.chat.completions.create(
            model=server.engine.name,
            messages=[
                {"role": "user", "content": first_input},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "What is my name?"},
            ],
            max_tokens=16,
            temperature=0,
        )
        # A chain goes on: the third response comes after both earlier turns.
        third = await client.responses.create(
            model=server.engine.name, previous_response_id=second.id, input="Thanks.", max_output_tokens=1
        )
        fetched = await client.responses.retrieve(second.id)
        # Only the key that started a response may continue it: to another it is not here.
        async with keyed_client(server, OTHER_KEY) as other:
            refused = await previous_refused(other, server, second.id)
        assert isinstance(refused, openai.NotFoundError) and refused.body["param"] == "previous_response_id"
    assert first.output_text and second.previous_response_id == first.id == fetched.previous_response_id
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


async def previous_refused(client, server, previous: str) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as refused:
        await client.responses.create(
            model=server.engine.name, previous_response_id=previous, input="Hi", max_output_tokens=1
        )
    return refused.value


async def test_an_unknown_unstored_or_forgotten_previous_response_is_not_found(server, monkeypatch):
    monkeypatch.setattr(responses_api, "REMEMBERED", 1)
    async with openai_client(server) as client:
        unstored = await client.responses.create(model=server.engine.name, input="Hi", max_output_tokens=1, store=False)
        oldest = await client.responses.create(model=server.engine.name, input="Hi", max_output_tokens=1)
        newest = await client.responses.create(model=server.engine.name, input="Hi", max_output_tokens=1)
        newer = await client.responses.create(model=server.engine.name, input="Hi", max_output_tokens=1)
        for previous in ("resp_no-such-response", unstored.id, oldest.id):
            refused = await previous_refused(client, server, previous)
            assert isinstance(refused, openai.NotFoundError), previous
            assert refused.body["code"] == "not_found" and refused.body["param"] == "previous_response_id"
            assert previous in refused.body["message"]
        # The last one remembered is still there to continue.
        kept = await client.responses.create(
            model=server.engine.name, previous_response_id=newer.id, input="Hi", max_output_tokens=1
        )
    assert kept.previous_response_id == newer.id and newest.id != newer.id
    assert server.scheduler.active == 0


async def test_a_response_still_running_cannot_be_continued_yet(engine):
    async with running_server(engine, api_keys=(KEY,)) as server, keyed_client(server, KEY) as client:
        running = await client.responses.create(
            model=server.engine.name, input=LONG_ANSWER, max_output_tokens=2000, background=True
        )
        refused = await previous_refused(client, server, running.id)
        assert isinstance(refused, openai.BadRequestError) and refused.body["code"] == "invalid_field"
        assert refused.body["param"] == "previous_response_id"
        await client.responses.cancel(running.id)


# Responses' function tool: the chat tool's function, flat.
WEATHER = {"type": "function", **WEATHER_TOOL["function"]}
QUESTION = "What is the weather in Paris?"


async def test_a_function_call_and_its_output_go_round_as_on_chat_completions(llama_engine):
    async with running_server(llama_engine) as server, openai_client(server, GRAMMAR_TIMEOUT) as client:
        called = await client.responses.create(
            model=server.engine.name,
            input=QUESTION,
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
        )
        [call] = called.output
        assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), PARAMETERS["get_weather"])
        assert called.status == "completed" and called.tools[0].name == "get_weather"
        # The call and its output sent back: the same prompt and greedy answer as the chat's.
        items = [
            {"role": "user", "content": QUESTION},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "22 degrees and sunny"},
        ]
        answered = await client.responses.create(
            model=server.engine.name,
            input=items,
            tools=[WEATHER],
            tool_choice="none",
            temperature=0,
            max_output_tokens=24,
        )
        chat = await client.chat.completions.create(
            model=server.engine.name,
            messages=[
                {"role": "user", "content": QUESTION},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "22 degrees and sunny"},
            ],
            tools=[WEATHER_TOOL],
            tool_choice="none",
            temperature=0,
            max_tokens=24,
        )
        assert answered.usage.input_tokens == chat.usage.prompt_tokens
        assert answered.output_text == chat.choices[0].message.content and answered.output_text
        # Or after the response that called, by its id: only the output is sent.
        continued = await client.responses.create(
            model=server.engine.name,
            previous_response_id=called.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "22 degrees and sunny"}],
            tools=[WEATHER],
            temperature=0,
            max_output_tokens=24,
        )
    assert continued.output and continued.usage.input_tokens > called.usage.input_tokens


def streamed_items(events) -> list[dict]:
    """The output items a Responses stream built, checked against its events' order: each item
    added, then its pieces, then done, at its own output index; the pieces add up to the whole."""
    items: dict[int, dict] = {}
    done: set[int] = set()
    for event in events:
        at = getattr(event, "output_index", None)
        if event.type == "response.output_item.added":
            assert at == len(items)
            assert all(index in done for index in items), "an item opened before the one before it was done"
            items[at] = {"item": event.item, "text": "", "arguments": ""}
        elif event.type == "response.output_text.delta":
            assert at in items and at not in done and items[at]["item"].type == "message"
            items[at]["text"] += event.delta
        elif event.type == "response.function_call_arguments.delta":
            assert at in items and at not in done and event.item_id == items[at]["item"].id
            items[at]["arguments"] += event.delta
        elif event.type == "response.function_call_arguments.done":
            assert event.arguments == items[at]["arguments"] and event.name == items[at]["item"].name
        elif event.type == "response.output_item.done":
            assert at in items and at not in done
            done.add(at)
            item = event.item
            if item.type == "function_call":
                assert item.arguments == items[at]["arguments"] and item.id == items[at]["item"].id
            else:
                assert item.content[0].text == items[at]["text"]
            items[at]["item"] = item
    assert done == set(items)
    return [items[index]["item"].model_dump() for index in sorted(items)]


def comparable(item):
    """An output item without what names its response (ids), nor what the stream helper adds."""
    if isinstance(item, list):
        return [comparable(part) for part in item]
    if not isinstance(item, dict):
        return item
    dropped = ("id", "call_id", "parsed_arguments", "parsed")
    return {key: comparable(value) for key, value in item.items() if key not in dropped}


@pytest.mark.parametrize("choice", ["required", "auto"])
async def test_a_streamed_function_call_arrives_in_pieces_and_ends_as_the_whole_one(llama_engine, choice):
    asked = dict(input=QUESTION, tools=[WEATHER], tool_choice=choice, parallel_tool_calls=False, temperature=0)
    if choice == "auto":
        # The model may answer in text instead, which can run long: both ends are the whole one's.
        asked["max_output_tokens"] = 64
    async with running_server(llama_engine) as server, openai_client(server, GRAMMAR_TIMEOUT) as client:
        asked["model"] = server.engine.name
        whole = await client.responses.create(**asked)
        async with client.responses.stream(**asked) as stream:
            events = [event async for event in stream]
    names = [event.type for event in events]
    assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == f"response.{whole.status}"
    final = events[-1].response
    assert final.status == whole.status in ("completed", "incomplete")
    numbers = [event.sequence_number for event in events]
    assert numbers == sorted(set(numbers))
    items = streamed_items(events)
    expected = [comparable(item.model_dump()) for item in whole.output]
    assert [comparable(item) for item in items] == expected
    assert [comparable(item.model_dump()) for item in final.output] == expected
    if choice == "required":
        [call] = final.output
        assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), PARAMETERS["get_weather"])
        # The arguments came in pieces, between the item's added and done events.
        assert names[2] == "response.output_item.added" and names[-3:-1] == [
            "response.function_call_arguments.done",
            "response.output_item.done",
        ]
        assert names.count("response.function_call_arguments.delta") > 1
        assert "response.output_text.delta" not in names
    assert final.usage.output_tokens == whole.usage.output_tokens
