"""The prompt cache across requests (stopline/engine/prompt_cache.py): KV states a
slot was about to lose, saved and restored on the real llama.cpp engine and the
embedded SmolLM2; its keys and its budget at unit level; and a real server's flags,
OpenAI usage and metrics."""

from __future__ import annotations

import argparse
import os
import threading
from pathlib import Path

import pytest

from stopline import _core
from stopline.engine.loop import Engine
from stopline.engine.prompt_cache import BLOCK_TOKENS, PromptCache, model_key
from stopline.protocol.requests import SamplingParams
from stopline.settings import MIB, Settings, add_flags, default_prompt_cache_bytes
from support import fetch_metrics, metric_value, openai_client, running_server

GREEDY = SamplingParams(max_tokens=8, temperature=0)
FIRST = [{"role": "user", "content": " ".join(f"Fact {i}: the {i}th stone is grey." for i in range(24)) + " Why?"}]


def others(count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Tell me about river number {i}. " * 8}] for i in range(count)]


@pytest.fixture(scope="module")
def engine(llama_engine) -> Engine:
    return llama_engine


@pytest.fixture
def slots(engine):
    opened = engine.open_slots(2)
    yield opened
    for slot in opened:
        slot.close()


@pytest.fixture
def cache(engine):
    engine.prompt_cache = PromptCache(256 * MIB)
    yield engine.prompt_cache
    engine.prompt_cache = None


def generate(engine: Engine, slot, prompt: list[int]) -> tuple[str, object, int]:
    stream = engine.start(slot, prompt, GREEDY)
    text = "".join(stream)
    assert stream.result is not None
    return text, stream.result, stream.prompt_tokens_cached


def test_a_prompt_after_every_slot_was_used_takes_all_but_its_last_token_from_the_cache(engine, slots, cache):
    first = engine.encode(messages=FIRST)
    answer, result, cached = generate(engine, slots[0], first)
    assert cached == 0 and result.prompt_tokens_reused == 0
    for i, messages in enumerate(others(3)):
        generate(engine, slots[i % 2], engine.encode(messages=messages))
    # Neither slot holds any of it now: only the cache does, in another context.
    assert slots[1].reusable_prefix(first, engine.prefill_chunk) < BLOCK_TOKENS
    again, result, cached = generate(engine, slots[1], first)
    assert cached == len(first) - 1
    assert result.prompt_tokens_reused == len(first) - 1 and result.prompt_tokens_evaluated == 1
    assert again == answer
    assert slots[1].kv_positions == slots[1].n_held
    stats = cache.stats
    assert stats.hits == 1 and stats.tokens_restored == cached and stats.saves >= 2
    assert stats.bytes_held > 0


def test_without_a_cache_the_same_repeat_evaluates_its_whole_prompt(engine, slots):
    assert engine.prompt_cache is None
    first = engine.encode(messages=FIRST)
    generate(engine, slots[0], first)
    for i, messages in enumerate(others(3)):
        generate(engine, slots[i % 2], engine.encode(messages=messages))
    _, result, cached = generate(engine, slots[1], first)
    assert cached == 0 and result.prompt_tokens_evaluated > len(first) - BLOCK_TOKENS


def test_a_stop_after_a_restore_leaves_the_slot_and_the_cache_consistent(engine, slots, cache):
    first = engine.encode(messages=FIRST)
    answer, _, _ = generate(engine, slots[0], first)
    generate(engine, slots[0], engine.encode(messages=others(1)[0]))
    # Stopped before its loop starts (the cache's work goes on): the loop ends at once.
    stream = engine.start(slots[1], first, GREEDY)
    stream.generation.cancel()
    worker = threading.Thread(target=stream._run, args=(False,))
    worker.start()
    worker.join()
    assert stream.result is not None and stream.result.exit == _core.ExitKind.CANCELLED
    assert stream.prompt_tokens_cached == len(first) - 1
    assert slots[1].kv_positions == slots[1].n_held == len(first) - 1
    # Stopped while the cache may be at work: whatever it did, the record matches the cache.
    generate(engine, slots[1], engine.encode(messages=others(2)[1]))
    stream = engine.start(slots[1], first, GREEDY)
    worker = threading.Thread(target=stream._run, args=(False,))
    worker.start()
    stream.generation.cancel()
    worker.join()
    assert slots[1].kv_positions == slots[1].n_held
    # And the cache still serves the prompt whole.
    again, result, cached = generate(engine, slots[0], first)
    assert cached == len(first) - 1 and again == answer


def test_a_stop_asked_before_the_loop_starts_skips_the_cache(engine, slots, cache):
    first = engine.encode(messages=FIRST)
    generate(engine, slots[0], first)
    generate(engine, slots[0], engine.encode(messages=others(1)[0]))
    stream = engine.start(slots[1], first, GREEDY)
    assert stream.cancel()
    assert "".join(stream) == ""
    assert stream.prompt_tokens_cached == 0
    assert slots[1].kv_positions == slots[1].n_held


def test_a_state_restores_only_into_a_sequence_that_can_hold_it(engine, slots):
    first = engine.encode(messages=FIRST)
    generate(engine, slots[0], first)
    state = slots[0].save_state()
    held, chunk = slots[0].held_record()
    assert state and held[: len(first)] == first and chunk == engine.prefill_chunk
    assert slots[1].restore_state(state, first[:40], chunk)
    assert slots[1].n_held == slots[1].kv_positions == 40
    assert slots[1].reusable_prefix(first, chunk) == 40
    # Garbage is refused, and leaves the sequence empty.
    assert not slots[1].restore_state(b"\0" * 64, first[:40], chunk)
    assert slots[1].n_held == 0 and slots[1].kv_positions == 0


# The cache's key and budget ------------------------------------------------


def tokens(start: int, count: int = 2 * BLOCK_TOKENS) -> list[int]:
    return list(range(start, start + count))


def test_another_model_file_template_or_shape_never_hits(tmp_path: Path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 60)
    key = model_key(model, "llama.cpp", 2048, 512, 1, "template A")
    assert key == model_key(model, "llama.cpp", 2048, 512, 1, "template A")
    assert key != model_key(model, "llama.cpp", 2048, 512, 1, "template B")
    assert key != model_key(model, "llama.cpp", 4096, 512, 1, "template A")
    assert key != model_key(model, "llama.cpp", 2048, 512, 2, "template A")
    other = tmp_path / "other.gguf"
    other.write_bytes(model.read_bytes())
    assert key != model_key(other, "llama.cpp", 2048, 512, 1, "template A")
    # The same path, rewritten: its size or its modification time differs.
    model.write_bytes(b"GGUF" + b"\1" * 61)
    assert key != model_key(model, "llama.cpp", 2048, 512, 1, "template A")

    cache = PromptCache(1 * MIB)
    assert cache.store(key, tokens(0), b"state")
    assert cache.lookup(key, tokens(0), 0) == (b"state", 2 * BLOCK_TOKENS)
    assert cache.lookup("another key", tokens(0), 0) is None
    stats = cache.stats
    assert (stats.hits, stats.misses) == (0, 1)  # a lookup alone counts no hit: a restore does


def test_a_lookup_finds_the_longest_shared_prefix_and_needs_a_block_more_than_the_slot():
    cache = PromptCache(1 * MIB)
    assert cache.store("k", tokens(0, 3 * BLOCK_TOKENS), b"long")
    assert cache.store("k", tokens(0, BLOCK_TOKENS) + tokens(9000), b"fork")
    prompt = tokens(0, 2 * BLOCK_TOKENS + 5) + [777]
    assert cache.lookup("k", prompt, 0) == (b"long", 2 * BLOCK_TOKENS + 5)
    assert cache.lookup("k", prompt, BLOCK_TOKENS + 6) is None
    assert cache.lookup("k", tokens(5000), 0) is None
    # A state whose tokens start another's replaces it.
    assert cache.store("k", tokens(0, 4 * BLOCK_TOKENS), b"longer")
    assert cache.stats.entries == 2
    assert cache.lookup("k", prompt, 0) == (b"longer", 2 * BLOCK_TOKENS + 5)


def test_the_least_recently_used_state_goes_first_under_the_budget():
    cache = PromptCache(250)
    for i in range(3):
        assert cache.store("k", tokens(1000 * i), bytes(100))
    # Two fit: the first went.
    stats = cache.stats
    assert (stats.entries, stats.bytes_held, stats.evictions) == (2, 200, 1)
    assert cache.lookup("k", tokens(0), 0) is None
    # Used, the second outlives the third.
    assert cache.lookup("k", tokens(1000), 0) is not None
    assert cache.store("k", tokens(3000), bytes(100))
    assert cache.lookup("k", tokens(1000), 0) is not None
    assert cache.lookup("k", tokens(2000), 0) is None
    # A state over the whole budget is not kept, and evicts nothing.
    assert not cache.store("k", tokens(4000), bytes(251))
    assert cache.stats.entries == 2


# Settings, and a real server --------------------------------------------------


def parse(*argv: str, env: dict | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        add_flags(parser)
        return parser.parse_args(list(argv))
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_the_flags_set_the_budget_or_turn_the_cache_off():
    assert parse().prompt_cache is True and parse().cache_ram_mib is None
    assert parse("--no-prompt-cache").prompt_cache is False
    assert parse(env={"STOPLINE_NO_PROMPT_CACHE": "1"}).prompt_cache is False
    assert parse("--cache-ram", "64").cache_ram_mib == 64
    assert Settings.build().prompt_cache_bytes == default_prompt_cache_bytes() <= 8 * 1024 * MIB
    assert Settings.build(cache_ram_mib=64).prompt_cache_bytes == 64 * MIB
    assert Settings.build(cache_ram_mib=0).prompt_cache_bytes == 0
    assert Settings.build(prompt_cache=False).prompt_cache_bytes == 0


async def test_no_prompt_cache_leaves_the_server_without_one(engine):
    async with running_server(engine, workers=1, prompt_cache=False) as server:
        assert server.prompt_cache is None and engine.prompt_cache is None
        text = await fetch_metrics(server)
        assert "stopline_prompt_cache_hits" not in text


async def test_openai_usage_reports_the_cached_prompt_tokens(engine):
    async with running_server(engine, workers=1, cache_ram_mib=256) as server:
        assert engine.prompt_cache is server.prompt_cache is not None
        client = openai_client(server)

        async def chat(messages):
            return await client.chat.completions.create(
                model=server.engine.name, messages=messages, temperature=0, max_tokens=4
            )

        first = await chat(FIRST)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        # Other prompts take every slot (a spare for preemption among them).
        for messages in others(len(server.scheduler._slots)):
            await chat(messages)
        again = await chat(FIRST)
        assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
        assert again.choices[0].message.content == first.choices[0].message.content
        text = await fetch_metrics(server)
        assert metric_value(text, "stopline_prompt_cache_hits_total") == 1
        assert metric_value(text, "stopline_prompt_tokens_cached_total") == again.usage.prompt_tokens - 1
        assert metric_value(text, "stopline_prompt_cache_bytes") > 0
    assert engine.prompt_cache is None
