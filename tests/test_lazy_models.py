"""A model beyond the first is loaded when first asked for and unloaded once idle for its keep_alive,
on real models (the embedded SmolLM2 first, Gemma 3 270M second) and a real server."""

from __future__ import annotations

import asyncio
import json
import threading
from datetime import datetime

import aiohttp
import ollama
import openai
import pytest

from stopline.__main__ import parse_args, settings_from
from stopline.engine.loop import Engine, engine_memory_bytes, file_memory_bytes
from stopline.engine.model import gemma_gguf_path
from stopline.protocol.vocabulary import EngineName
from stopline.residency import Loader
from stopline.settings import MIB, keep_alive
from support import CHAT_FRANCE, LONG_ANSWER, UNIT, client_for, openai_client, running_server, wait_for

NAMES = ("smol", "gemma")


class GemmaLoader:
    """Loads Gemma as the server asks, counting the loads; with ``gated``, each load waits for
    :meth:`open` first, so that a test can act while it is under way."""

    def __init__(self, gated: bool = False):
        self.loads = 0
        self.started = threading.Event()
        self.gate = threading.Event()
        if not gated:
            self.gate.set()

    def __call__(self) -> Engine:
        self.loads += 1
        self.started.set()
        self.gate.wait(120)
        return Engine.load(
            gemma_gguf_path(progress=False), engine=EngineName.LLAMA_CPP, threads=1, context_length=2048, progress=False
        )

    def open(self) -> None:
        self.gate.set()


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def ps(server) -> dict[str, str]:
    """The loaded models, as Ollama's /api/ps lists them: name to expires_at."""
    async with ollama.AsyncClient(host=server.http.base_url.removesuffix("/v1"), timeout=60 * UNIT) as client:
        running = await client.ps()
    return {m.model: m.expires_at for m in running.models}


async def greedy(client: openai.AsyncOpenAI, model: str):
    return await client.chat.completions.create(model=model, messages=CHAT_FRANCE, max_tokens=8, temperature=0)


async def test_a_second_model_loads_on_its_first_request_and_requests_share_the_load(llama_engine, logs):
    loader = GemmaLoader()
    async with (
        running_server(
            llama_engine, others=[Loader("gemma-3-270m", loader)], served_model_names=NAMES, keep_alive_s=-1
        ) as server,
        openai_client(server) as client,
    ):
        assert list(await ps(server)) == ["smol"]
        # Listed though not loaded; how a chat becomes its prompt is known once it has loaded.
        listed = (await client.models.list()).data
        assert [m.id for m in listed] == list(NAMES) and not hasattr(listed[1], "chat_format")
        assert loader.loads == 0 and not logs.records("model_loaded") and not logs.records("no_chat_template")
        answers = await asyncio.gather(greedy(client, "gemma"), greedy(client, "gemma"), greedy(client, "smol"))
        assert [a.model for a in answers] == ["gemma", "gemma", "smol"]
        assert answers[0].choices[0].message.content
        # Two requests arrived during one load, and waited for it.
        assert loader.loads == 1
        loaded = logs.records("model_loaded", model="gemma")
        assert len(loaded) == 1 and loaded[0]["why"] == "requested"
        # Gemma 3 270M is a base model: said as it loads, as it would be at startup.
        assert [r["model"] for r in logs.records("no_chat_template")] == ["gemma"]
        assert [m.chat_format for m in (await client.models.list()).data] == ["model_template", "plain_text"]
        running = await ps(server)
        assert list(running) == list(NAMES)
        # keep_alive -1: never unloaded, as Ollama writes it.
        assert running["gemma"].year == 2999


async def test_an_idle_model_unloads_after_its_keep_alive_and_loads_again_when_asked(llama_engine, logs):
    loader = GemmaLoader()
    size = gemma_gguf_path(progress=False).stat().st_size
    async with (
        running_server(
            llama_engine, others=[Loader("gemma-3-270m", loader)], served_model_names=NAMES, keep_alive_s=0.5
        ) as server,
        openai_client(server) as client,
    ):
        before = rss_bytes()
        first = await greedy(client, "gemma")
        loaded_rss = rss_bytes()
        running = await ps(server)
        # Half a second from the end of its last request.
        assert 0 < (running["gemma"] - datetime.now(running["gemma"].tzinfo)).total_seconds() <= 0.5
        unloaded = await wait_for(lambda: logs.records("model_unloaded", model="gemma"), timeout=30)
        assert unloaded[0]["why"] == "keep_alive"
        assert list(await ps(server)) == ["smol"]
        # The native model and its contexts are freed, not left to the garbage collector: the
        # memory the load took comes back (its weights are most of it).
        assert loaded_rss - before > size / 2
        assert loaded_rss - rss_bytes() > size / 2
        again = await greedy(client, "gemma")
        assert again.choices[0].message.content == first.choices[0].message.content
        assert loader.loads == 2 and len(logs.records("model_loaded", model="gemma")) == 2
    assert len(logs.records("model_unloaded", model="gemma")) == 2  # the second at shutdown


async def test_a_cancel_during_the_load_ends_the_request_at_once(llama_engine, logs):
    loader = GemmaLoader(gated=True)
    async with (
        running_server(
            llama_engine, others=[Loader("gemma-3-270m", loader)], served_model_names=NAMES, keep_alive_s=-1
        ) as server,
        aiohttp.ClientSession() as http,
    ):
        url = f"{server.http.base_url}/chat/completions"
        body = {"model": "gemma", "messages": LONG_ANSWER, "max_tokens": 32, "stream": True}
        headers = {"X-Request-Id": "during-load", "X-Cancel-Token": "t" * 32}
        posted = asyncio.ensure_future(http.post(url, json=body, headers=headers))
        await asyncio.to_thread(loader.started.wait, 60)
        try:
            async with http.delete(
                f"{server.http.base_url}/generations/during-load", headers={"Authorization": "Bearer " + "t" * 32}
            ) as deleted:
                assert deleted.status == 200 and (await deleted.json())["status"] == "cancelled"
            async with asyncio.timeout(10 * UNIT):
                response = await posted
                text = await response.text()
            # Ended while the model still loads: the load waits behind the gate.
            assert not logs.records("model_loaded")
        finally:
            loader.open()
        assert response.status == 200
        chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        last = chunks[-1]
        # The stream's usual ending for a stop: OpenAI's finish_reason, and Stopline's own reason beside it.
        assert last["choices"][0]["finish_reason"] == "stop" and last["model"] == "gemma"
        assert last["stopline"]["type"] == "cancelled" and last["stopline"]["reason"] == "user_cancelled"
        assert text.rstrip().endswith("data: [DONE]")
        ended = logs.records("generation_cancelled", request_id="during-load")
        assert len(ended) == 1 and ended[0]["reason"] == "user_cancelled" and ended[0]["model"] == "gemma"
        assert ended[0]["tokens_generated"] == 0

        # A client that goes away during a load ends its request too, with client_disconnected;
        # the load goes on, and the model is there for the next request.
        await wait_for(lambda: logs.records("model_loaded", model="gemma"), timeout=60)
        async with openai_client(server) as client:
            assert (await greedy(client, "gemma")).model == "gemma"
        assert loader.loads == 1


async def test_a_client_that_leaves_during_the_load_ends_with_client_disconnected(llama_engine, logs):
    loader = GemmaLoader(gated=True)
    async with running_server(
        llama_engine, others=[Loader("gemma-3-270m", loader)], served_model_names=NAMES, keep_alive_s=-1
    ) as server:
        try:
            async with openai_client(server) as client:
                asked = asyncio.ensure_future(greedy(client, "gemma"))
                await asyncio.to_thread(loader.started.wait, 60)
                asked.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await asked
            ended = await wait_for(lambda: logs.records("generation_cancelled", model="gemma"), timeout=10)
            assert ended[0]["reason"] == "client_disconnected"
            assert not logs.records("model_loaded")
        finally:
            loader.open()
        # Nobody waits for the load any more: it ends with the model loaded, and idle.
        await wait_for(lambda: logs.records("model_loaded", model="gemma"), timeout=60)
        assert list(await ps(server)) == list(NAMES)


async def test_a_memory_budget_unloads_the_least_recently_used_idle_model_and_never_a_busy_one(llama_engine, logs):
    """Three Gemmas beside SmolLM2, and room for two: each load unloads the idle model used least
    recently, never one that is generating; with none idle, the request is refused."""
    gemma = file_memory_bytes(gemma_gguf_path(progress=False), None, 2048)
    # Its file and its slots' KV cache: more than the file alone.
    assert gemma > gemma_gguf_path(progress=False).stat().st_size
    fixed = engine_memory_bytes(llama_engine, llama_engine.sequences)
    budget_mib = -(-(fixed + 2 * gemma) // MIB)
    assert (fixed + 3 * gemma) > budget_mib * MIB
    names = ("smol", "a", "b", "c")
    others = [Loader(f"gemma-{name}", GemmaLoader(), gemma) for name in names[1:]]
    async with (
        running_server(
            llama_engine, others=others, served_model_names=names, keep_alive_s=-1, memory_budget_mib=budget_mib
        ) as server,
        openai_client(server) as client,
    ):

        def unloads() -> list[tuple[str, str]]:
            return [(r["model"], r["why"]) for r in logs.records("model_unloaded")]

        async def generating(model: str):
            """A long answer on ``model``, running once its first token is read."""
            stream = await client.chat.completions.create(
                model=model, messages=LONG_ANSWER, max_tokens=1500, stream=True, extra_body={"ignore_eos": True}
            )
            await anext(aiter(stream))
            return stream

        await greedy(client, "a")
        await greedy(client, "b")
        assert list(await ps(server)) == ["smol", "a", "b"] and unloads() == []
        # Measured once loaded, a model takes what its file's estimate said.
        assert [m.memory_bytes for m in server.lazy[:2]] == [gemma, gemma]
        await greedy(client, "a")
        # b was used least recently.
        await greedy(client, "c")
        assert unloads() == [("b", "memory_budget")]
        assert sorted(await ps(server)) == ["a", "c", "smol"]

        # a is generating; c, used since, is idle: c unloads for b, though a was used less recently.
        on_a = await generating("a")
        await greedy(client, "c")
        await greedy(client, "b")
        assert unloads() == [("b", "memory_budget"), ("c", "memory_budget")]
        # Both loaded models are generating: no room for c, and nothing else is unloaded.
        on_b = await generating("b")
        with pytest.raises(openai.APIStatusError) as refused:
            await greedy(client, "c")
        assert refused.value.status_code == 503
        assert refused.value.body["code"] == "insufficient_memory" and "'c'" in refused.value.body["message"]
        assert unloads() == [("b", "memory_budget"), ("c", "memory_budget")]
        await on_a.close()
        await on_b.close()
        # Once a request is done with a, it may make room again.
        await wait_for(lambda: server.lazy[0].holders == 0, timeout=10)
        assert (await greedy(client, "c")).model == "c"
        assert unloads()[-1] == ("a", "memory_budget")


async def test_ollama_keep_alive_sets_the_models_from_that_request_on(llama_engine, logs):
    loader = GemmaLoader()
    async with running_server(
        llama_engine, others=[Loader("gemma-3-270m", loader)], served_model_names=NAMES, keep_alive_s=-1
    ) as server:
        host = server.http.base_url.removesuffix("/v1")
        async with ollama.AsyncClient(host=host, timeout=120 * UNIT) as client:
            # No messages: Ollama's way to load a model.
            loaded = await client.chat(model="gemma", messages=[], keep_alive="5m")
            assert loaded.done_reason == "load" and loader.loads == 1
            expires = (await ps(server))["gemma"]
            assert 290 < (expires - datetime.now(expires.tzinfo)).total_seconds() <= 300
            answer = await client.chat(
                model="gemma", messages=CHAT_FRANCE, options={"temperature": 0, "num_predict": 4}, keep_alive=0
            )
            assert answer.model == "gemma"
            unloaded = await wait_for(lambda: logs.records("model_unloaded", model="gemma"), timeout=10)
            assert unloaded[0]["keep_alive_s"] == 0
            assert list(await ps(server)) == ["smol"]
            # The first model is always loaded: its keep_alive is accepted and changes nothing.
            await client.chat(model="smol", messages=CHAT_FRANCE, options={"num_predict": 2}, keep_alive=0)
            assert list(await ps(server)) == ["smol"]
            with pytest.raises(ollama.ResponseError):
                await client.chat(model="gemma", messages=CHAT_FRANCE, keep_alive="soon")


def test_keep_alive_is_read_as_ollama_writes_it():
    assert [keep_alive(v) for v in ("5m", "30s", "1h", "-1", "0", "250ms", 7, -1)] == [
        300,
        30,
        3600,
        -1,
        0,
        0.25,
        7,
        -1,
    ]
    with pytest.raises(ValueError):
        keep_alive("forever")
    assert settings_from(parse_args([])).keep_alive_s == 300
    assert settings_from(parse_args(["--keep-alive", "10m"])).keep_alive_s == 600
    assert settings_from(parse_args(["--keep-alive", "-1"])).keep_alive_s == -1


async def test_websocket_requests_on_one_connection_run_on_the_models_they_name(llama_engine, logs):
    loader = GemmaLoader()
    async with (
        running_server(
            llama_engine, others=[Loader("gemma-3-270m", loader)], served_model_names=NAMES, keep_alive_s=-1
        ) as server,
        client_for(server) as ws,
    ):
        # The greeting names every model a frame may name, loaded or not, and the one it runs on unnamed.
        assert ws.hello["model"] == NAMES[0] and ws.hello["models"] == list(NAMES)
        # Not loaded yet: the first frame that names it loads it, as an HTTP request would.
        ask = {"type": "generate", "messages": CHAT_FRANCE, "max_tokens": 8, "temperature": 0}
        await ws.send({**ask, "id": "g", "model": "gemma"})
        await ws.send({**ask, "id": "s"})
        ends: dict[str, dict] = {}
        while len(ends) < 2:
            frame = await ws.recv(60)
            if frame["type"] in ("done", "cancelled", "timeout", "error"):
                ends[frame["id"]] = frame
        accepted = {f["id"]: f for f in ws.frames if f["type"] == "accepted"}
        assert {i: (accepted[i]["model"], ends[i]["model"]) for i in ends} == {
            "g": ("gemma", "gemma"),
            "s": ("smol", "smol"),
        }
        assert all(end["type"] == "done" for end in ends.values())
        assert loader.loads == 1
        assert {r["request_id"]: r["model"] for r in logs.records("generation_done")} == {
            accepted["g"]["request_id"]: "gemma",
            accepted["s"]["request_id"]: "smol",
        }
        # A greedy answer is the one the HTTP API gives for the same model.
        async with openai_client(server) as http:
            for request_id, name in (("g", "gemma"), ("s", "smol")):
                text = "".join(f["text"] for f in ws.tokens(request_id))
                assert text and text == (await greedy(http, name)).choices[0].message.content

        # A name no model is served under: the error every API answers it with.
        refused = await ws.generate("x", messages=CHAT_FRANCE, model="gpt-4o")
        assert refused["type"] == "error" and refused["code"] == "model_not_found"
        assert "'smol', 'gemma'" in refused["message"]

        # A cancel of one model's request stops it with nothing computed after it; the other's goes on.
        long = {"messages": LONG_ANSWER, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
        await ws.generate("g2", model="gemma", **long)
        await ws.generate("s2", **long)
        await ws.recv_until(lambda f: f["type"] == "token" and f["id"] == "g2")
        await ws.send({"type": "cancel", "id": "g2"})
        cancelled = await ws.terminal("g2")
        assert cancelled["type"] == "cancelled" and cancelled["reason"] == "user_cancelled"
        assert cancelled["model"] == "gemma" and cancelled["tokens_after_cancel"] == 0
        after = len(ws.frames)
        ended = [f for f in ws.frames if f.get("id") == "s2" and f["type"] in ("done", "error")]
        done = ended[0] if ended else await ws.terminal("s2")
        assert done["type"] == "done" and done["model"] == "smol" and done["tokens_generated"] == 64
        # Nothing of the cancelled request came after its terminal frame.
        assert not [f for f in ws.frames[after:] if f.get("id") == "g2"]


async def test_a_websocket_cancel_during_the_load_ends_the_request_at_once(llama_engine, logs):
    loader = GemmaLoader(gated=True)
    async with (
        running_server(
            llama_engine, others=[Loader("gemma-3-270m", loader)], served_model_names=NAMES, keep_alive_s=-1
        ) as server,
        client_for(server) as ws,
    ):
        try:
            await ws.send({"type": "generate", "id": "g", "model": "gemma", "messages": LONG_ANSWER})
            await asyncio.to_thread(loader.started.wait, 60)
            await ws.send({"type": "cancel", "id": "g"})
            cancelled = await ws.terminal("g", timeout=10)
            # Ended while the model still loads: the load waits behind the gate.
            assert not logs.records("model_loaded")
        finally:
            loader.open()
        assert [f["type"] for f in ws.frames] == ["accepted", "cancelled"]
        assert cancelled["reason"] == "user_cancelled" and cancelled["tokens_generated"] == 0
        assert ws.frames[0]["model"] == cancelled["model"] == "gemma"
        # The first model answers meanwhile, and the load goes on for the next request.
        assert (await ws.generate("s", messages=CHAT_FRANCE, max_tokens=4))["model"] == "smol"
        assert (await ws.terminal("s"))["type"] == "done"
        await wait_for(lambda: logs.records("model_loaded", model="gemma"), timeout=60)
        assert (await ws.generate("g2", model="gemma", messages=CHAT_FRANCE, max_tokens=4))["model"] == "gemma"
        assert (await ws.terminal("g2"))["type"] == "done"
        assert loader.loads == 1
