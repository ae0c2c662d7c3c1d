"""Several models in one server (--model, repeated): each with its own engine and slots, a
request answered by the model it names, through every API, on real models (the embedded SmolLM2
and Gemma 3 270M) and a real server."""

from __future__ import annotations

import aiohttp
import ollama
import openai
import pytest

from bench.launch import ServerProcess
from stopline.__main__ import parse_args, settings_from
from stopline.engine.loop import Engine
from stopline.engine.model import gemma_gguf_path, original_gguf_path
from stopline.protocol.errors import UsageError
from stopline.protocol.vocabulary import ChatFormat, EngineName
from stopline.settings import Settings, served_names
from support import (
    CHAT_FRANCE,
    LONG_ANSWER,
    UNIT,
    fetch_metrics,
    metric_value,
    openai_client,
    running_server,
    wait_for,
)

NAMES = ("smol", "gemma")


@pytest.fixture(scope="module")
def gemma() -> Engine:
    return Engine.load(
        gemma_gguf_path(progress=False), engine=EngineName.LLAMA_CPP, threads=1, context_length=2048, progress=False
    )


@pytest.fixture
async def two(llama_engine, gemma, logs):
    async with running_server(llama_engine, others=[gemma], served_model_names=NAMES, workers=2) as server:
        yield server


async def greedy(client: openai.AsyncOpenAI, model: str):
    return await client.chat.completions.create(model=model, messages=CHAT_FRANCE, max_tokens=12, temperature=0)


async def test_each_request_is_answered_by_the_model_it_names(two, llama_engine, gemma):
    async with openai_client(two) as client:
        smol, gem = await greedy(client, "smol"), await greedy(client, "gemma")
        listed = (await client.models.list()).data
    assert (smol.model, gem.model) == NAMES and [m.id for m in listed] == list(NAMES)
    # Each listed with how a chat becomes its own prompt.
    own = [str(ChatFormat.of(e.tokenizer.chat_template, None)) for e in (llama_engine, gemma)]
    assert [m.chat_format for m in listed] == own
    # The same greedy prompt, two models: two answers, each its own model's.
    assert smol.choices[0].message.content != gem.choices[0].message.content
    assert "Paris" in smol.choices[0].message.content


async def test_a_name_not_served_is_model_not_found_when_several_models_are(two):
    async with openai_client(two) as client:
        with pytest.raises(openai.NotFoundError) as refused:
            await greedy(client, "gpt-4o")
    assert refused.value.body["code"] == "model_not_found"
    assert "'smol', 'gemma'" in refused.value.body["message"]
    async with aiohttp.ClientSession() as http:
        body = {"model": "gpt-4o", "max_tokens": 4, "messages": CHAT_FRANCE}
        async with http.post(f"{two.http.base_url}/messages", json=body) as response:
            assert response.status == 404 and (await response.json())["error"]["type"] == "not_found_error"


async def test_ollama_lists_every_model_and_answers_with_the_one_named(two):
    async with ollama.AsyncClient(host=two.http.base_url.removesuffix("/v1"), timeout=120 * UNIT) as client:
        tags = await client.list()
        running = await client.ps()
        answer = await client.chat(
            model="gemma:latest", messages=CHAT_FRANCE, options={"temperature": 0, "num_predict": 12}
        )
    assert [m.model for m in tags.models] == list(NAMES) == [m.model for m in running.models]
    assert answer.model == "gemma"
    async with openai_client(two) as other:
        assert answer.message.content == (await greedy(other, "gemma")).choices[0].message.content


async def test_a_cancel_of_one_model_leaves_the_other_streaming(two, logs):
    async with openai_client(two) as client:
        kept = await client.chat.completions.create(
            model="gemma",
            messages=LONG_ANSWER,
            max_tokens=48,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        stopped = await client.chat.completions.create(
            model="smol",
            messages=LONG_ANSWER,
            max_tokens=400,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        first = [await anext(aiter(kept)), await anext(aiter(stopped))]
        assert [c.model for c in first] == ["gemma", "smol"]
        await stopped.close()
        # Gemma's stream goes on to its end while SmolLM2's generation is stopped.
        rest = [chunk async for chunk in kept]
    assert rest[-1].choices[0].finish_reason == "length"
    cancelled = await wait_for(lambda: logs.records("generation_cancelled", model="smol"), timeout=60)
    assert cancelled[0]["reason"] == "client_disconnected" and cancelled[0]["tokens_after_cancel"] == 0
    completed = await wait_for(lambda: logs.records("generation_done", model="gemma"), timeout=60)
    assert len(completed) == 1 and completed[0]["tokens_generated"] == 48
    text = await fetch_metrics(two)
    assert metric_value(text, "stopline_model_requests_total", model="smol", outcome="cancelled") == 1
    assert metric_value(text, "stopline_model_requests_total", model="gemma", outcome="done") == 1
    assert metric_value(text, "stopline_model_tokens_generated_total", model="gemma") == 48
    await wait_for(lambda: two.active == 0)
    assert metric_value(await fetch_metrics(two), "stopline_active_generations") == 0


async def test_one_model_answers_to_any_name_as_before(llama_engine):
    async with running_server(llama_engine) as server, openai_client(server) as client:
        answer = await greedy(client, "whatever")
    assert answer.model == server.engine.name
    assert [m.name for m in server.served] == [server.engine.name]


async def test_a_request_that_names_no_model_runs_on_the_first(two):
    async with aiohttp.ClientSession() as http:
        body = {"messages": CHAT_FRANCE, "max_tokens": 4, "temperature": 0}
        async with http.post(f"{two.http.base_url}/chat/completions", json=body) as response:
            assert response.status == 200 and (await response.json())["model"] == "smol"


def test_model_is_repeatable_and_names_each_model():
    settings = settings_from(parse_args(["--model", "a.gguf", "--model", "b.gguf"]))
    assert settings.models == ("a.gguf", "b.gguf")
    assert settings_from(parse_args([])).models == ()
    assert served_names((), ["a", "b"]) == [("a",), ("b",)]
    assert served_names(("x", "y"), ["a", "b"]) == [("x",), ("y",)]
    # One model keeps every name it is given.
    assert served_names(("x", "y"), ["a"]) == [("x", "y")]
    with pytest.raises(UsageError, match="both be served as 'a'"):
        served_names((), ["a", "a"])
    with pytest.raises(UsageError, match="one name for each"):
        Settings(models=("a.gguf", "b.gguf"), served_model_names=("x",))


def test_a_folder_stands_for_each_gguf_model_in_it(tmp_path):
    for name in ("b.gguf", "a.GGUF", "big-00001-of-00002.gguf", "big-00002-of-00002.gguf", "mmproj-a.gguf", "a.txt"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "inner.gguf").mkdir()
    settings = settings_from(parse_args(["--model", str(tmp_path), "--model", "c.gguf"]))
    assert settings.models == tuple(str(tmp_path / n) for n in ("a.GGUF", "b.gguf", "big-00001-of-00002.gguf")) + (
        "c.gguf",
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit):
        parse_args(["--model", str(empty)])


@pytest.mark.slow
async def test_a_server_given_a_folder_serves_each_model_in_it(tmp_path):
    (tmp_path / "smollm2.gguf").symlink_to(original_gguf_path(progress=False))
    (tmp_path / "gemma.gguf").symlink_to(gemma_gguf_path(progress=False))
    with ServerProcess("--port", "0", "--model", str(tmp_path), "--context-length", "512") as process:
        api = (await process.started(120 * UNIT)).api_url
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60 * UNIT)) as http:
            async with http.get(f"{api}/models") as response:
                assert [m["id"] for m in (await response.json())["data"]] == ["gemma", "smollm2"]
            for name in ("gemma", "smollm2"):
                body = {"model": name, "prompt": "The capital of France is", "max_tokens": 2}
                async with http.post(f"{api}/completions", json=body) as response:
                    answer = await response.json()
                assert response.status == 200 and answer["model"] == name, answer
