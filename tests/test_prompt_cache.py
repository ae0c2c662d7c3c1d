"""The prompt cache across requests (stopline/engine/prompt_cache.py): KV states a
slot was about to lose, saved and restored on the real llama.cpp engine and the
embedded SmolLM2; its keys and its budget at unit level; and a real server's flags,
OpenAI usage and metrics."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stopline import _core
from stopline.engine import prompt_cache as prompt_cache_module
from stopline.engine.loop import Engine
from stopline.engine.model import gemma_gguf_path
from stopline.engine.prompt_cache import BLOCK_TOKENS, PromptCache, model_key
from stopline.protocol.requests import SamplingParams
from stopline.protocol.vocabulary import EngineName
from stopline.settings import (
    MIB,
    Settings,
    add_flags,
    cache_dir,
    default_prompt_cache_bytes,
    default_prompt_cache_dir,
)
from support import UNIT, fetch_metrics, metric_value, openai_client, running_server

GREEDY = SamplingParams(max_tokens=8, temperature=0)
FIRST = [{"role": "user", "content": " ".join(f"Fact {i}: the {i}th stone is grey." for i in range(24)) + " Why?"}]


def others(count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Tell me about river number {i}. " * 8}] for i in range(count)]


@pytest.fixture(scope="module")
def engine(llama_engine) -> Engine:
    return llama_engine


@pytest.fixture(scope="module")
def gemma_engine() -> Engine:
    return Engine.load(
        gemma_gguf_path(progress=False),
        engine=EngineName.LLAMA_CPP,
        threads=1,
        context_length=2048,
        progress=False,
        sequences=2,
    )


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


# The live tier: another sequence's cells, shared in place ---------------------------

SHARED = "The history of bread is long, and every town tells it its own way. " * 24


def live_prompts(engine: Engine) -> tuple[list[int], list[int], int]:
    """Two prompts sharing a long prefix, and its length."""
    shared = engine.encode(prompt=SHARED)
    return (
        shared + engine.encode(prompt=" Tell me about rye."),
        shared + engine.encode(prompt=" And wheat?"),
        len(shared),
    )


def running_source(engine: Engine, slot, prompt: list[int], max_tokens: int):
    """A stream on ``slot`` that has evaluated its prompt and is decoding, and its thread."""
    stream = engine.start(slot, prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    worker = threading.Thread(target=stream._run, args=(False,))
    worker.start()
    deadline = time.monotonic() + 60 * UNIT
    while len(stream.generation.token_ids()) < 2:
        assert time.monotonic() < deadline and not stream.generation.finished
        time.sleep(0.001)
    return stream, worker


def without_cache(engine: Engine, slot, prompt: list[int]) -> str:
    assert engine.prompt_cache is None
    slot.forget()
    text, result, _ = generate(engine, slot, prompt)
    assert result.prompt_tokens_reused == 0
    slot.forget()
    return text


def test_a_generation_shares_a_running_sequences_prefix_and_evaluates_only_its_own_tokens(engine, slots):
    first, second, shared = live_prompts(engine)
    expected = without_cache(engine, slots[1], second)
    engine.prompt_cache = cache = PromptCache(256 * MIB)
    try:
        source, worker = running_source(engine, slots[0], first, max_tokens=64)
        answer, result, cached = generate(engine, slots[1], second)
        source.cancel()
        worker.join()
    finally:
        engine.prompt_cache = None
    # The shared prefix's cells were taken from the running sequence: only the new tokens were evaluated.
    assert cached == shared
    assert result.prompt_tokens_reused == shared and result.prompt_tokens_evaluated == len(second) - shared
    # Evaluated with the same prefill chunk, it gives the answer of a prompt evaluated whole.
    assert answer == expected
    stats = cache.stats
    assert stats.live_hits == stats.hits == 1 and stats.live_tokens == stats.tokens_restored == shared
    assert all(slot.kv_positions == slot.n_held for slot in slots)


@pytest.mark.parametrize("source_end", ["stopped", "finished"])
def test_the_copy_outlives_its_sources_stop_and_cells(engine, slots, cache, source_end):
    first, second, shared = live_prompts(engine)
    engine.prompt_cache = None
    expected = without_cache(engine, slots[1], second)
    engine.prompt_cache = cache
    source, worker = running_source(engine, slots[0], first, max_tokens=12 if source_end == "finished" else 400)
    copied = cache.prepare(cache_key(engine, slots[1]), slots[1], second, engine.prefill_chunk)
    assert copied == shared and slots[1].kv_positions == slots[1].n_held == shared
    if source_end == "stopped":
        source.cancel()
    worker.join()
    assert source.result is not None
    # The source's cells go, then others take their place: the copy keeps its own.
    slots[0].forget()
    assert slots[0].kv_positions == 0 and slots[1].kv_positions == shared
    generate(engine, slots[0], engine.encode(messages=others(1)[0]))
    engine.prompt_cache = None
    answer, result, _ = generate(engine, slots[1], second)
    assert result.prompt_tokens_reused == shared and result.prompt_tokens_evaluated == len(second) - shared
    assert answer == expected


def test_a_stop_during_a_copy_ends_the_stream_within_a_step(engine, slots, cache):
    first, second, shared = live_prompts(engine)
    source, worker = running_source(engine, slots[0], first, max_tokens=400)
    try:
        # The copy waits for the source's step under way at most; the stream then ends at once.
        stream = engine.start(slots[1], second, GREEDY)
        copier = threading.Thread(target=stream._run, args=(False,))
        copier.start()
        started = time.monotonic_ns()
        stream.cancel()
        copier.join(60 * UNIT)
        assert not copier.is_alive()
        result = stream.result
        assert result is not None and result.exit == _core.ExitKind.CANCELLED and result.tokens_generated == 0
        assert stream.prompt_tokens_cached in (0, shared)
        assert slots[1].kv_positions == slots[1].n_held
    finally:
        source.cancel()
        worker.join()
    decoded = source.result
    step_ns = (decoded.end_ns - decoded.first_token_ns) / max(decoded.tokens_generated - 1, 1)
    assert result.end_ns - started < (4 * step_ns + 50e6) * UNIT


async def test_openai_usage_and_metrics_count_a_prefix_shared_from_a_running_request(engine):
    async with running_server(engine, workers=2, cache_ram_mib=256) as server:
        client = openai_client(server)
        system = {"role": "system", "content": SHARED}

        def asked(question: str, **options):
            messages = [system, {"role": "user", "content": question}]
            return client.chat.completions.create(model=server.engine.name, messages=messages, temperature=0, **options)

        running = await asked("Tell me about rye.", max_tokens=400, stream=True)
        # Its prompt is evaluated once it has sent text.
        async for chunk in running:
            if chunk.choices and chunk.choices[0].delta.content:
                break
        second = await asked("And wheat?", max_tokens=4)
        await running.close()
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= len(engine.encode(prompt=SHARED)) - BLOCK_TOKENS
        text = await fetch_metrics(server)
        assert metric_value(text, "stopline_prompt_cache_live_hits_total") == 1
        assert metric_value(text, "stopline_prompt_cache_live_tokens_total") == cached
        assert metric_value(text, "stopline_prompt_tokens_cached_total") == cached


def test_a_copy_of_nothing_or_of_a_prefix_too_short_changes_nothing(engine, slots):
    first, second, shared = live_prompts(engine)
    generate(engine, slots[0], first)
    chunk = engine.prefill_chunk
    assert slots[1].copy_live_prefix([], chunk, -5) == 0
    # Another chunk's record, or a prefix no longer than asked for, is not taken.
    assert slots[1].copy_live_prefix(second[:-1], chunk + 1, 0) == 0
    assert slots[1].copy_live_prefix(second[:-1], chunk, shared) == 0
    assert slots[1].kv_positions == slots[1].n_held == 0
    # Ids outside the vocabulary are only compared, never evaluated.
    assert slots[1].copy_live_prefix([-1, 10**9], chunk, -5) == 0
    assert slots[1].copy_live_prefix(second[:-1], chunk, -5) == shared
    assert slots[1].kv_positions == slots[1].n_held == shared


def test_a_sliding_window_model_shares_nothing(gemma_engine):
    slots = gemma_engine.open_slots(2)
    try:
        prompt = gemma_engine.encode(prompt=SHARED)
        generate(gemma_engine, slots[0], prompt)
        assert slots[1].copy_live_prefix(prompt[:-1], gemma_engine.prefill_chunk, 0) == 0
        assert slots[1].kv_positions == slots[1].n_held == 0
    finally:
        for slot in slots:
            slot.close()


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


# The disk tier -------------------------------------------------------------------


def evict_all(cache: PromptCache) -> None:
    """Push every entry out of memory, to the disk tier, through the real eviction path."""
    filler = cache.budget_bytes - cache.stats.bytes_held + 1
    assert cache.store("filler", tokens(10**6), bytes(filler))
    assert cache.stats.entries == 1
    cache.disk.flush()


def test_an_entry_evicted_from_memory_is_written_to_disk_and_restored_from_there(engine, slots, tmp_path):
    first = engine.encode(messages=FIRST)
    engine.prompt_cache = cache = PromptCache(16 * MIB, disk_dir=tmp_path, disk_budget_bytes=256 * MIB)
    try:
        answer, _, _ = generate(engine, slots[0], first)
        generate(engine, slots[0], engine.encode(messages=others(1)[0]))
        assert cache.stats.saves == 1 and cache.stats.disk_entries == 0
        evict_all(cache)
        stats = cache.stats
        assert stats.disk_writes == 1 and stats.disk_entries == 1 and stats.disk_bytes > 0
        assert len(list(tmp_path.glob("*.kv"))) == 1
        again, result, cached = generate(engine, slots[1], first)
        assert cached == len(first) - 1 and result.prompt_tokens_evaluated == 1
        assert again == answer
        stats = cache.stats
        assert stats.disk_hits == 1 and stats.hits == 1
        # Read back, it is in memory again: the next lookup does not touch the disk.
        assert cache.lookup(cache_key(engine, slots[1]), first, 0) is not None
        assert cache.stats.disk_hits == 1
    finally:
        engine.prompt_cache = None
        cache.close()


def cache_key(engine: Engine, slot) -> str:
    return engine._prompt_cache_key(slot)


def test_a_new_cache_on_the_same_directory_serves_a_repeated_prompt_from_disk(engine, slots, tmp_path):
    first = engine.encode(messages=FIRST)
    engine.prompt_cache = cache = PromptCache(16 * MIB, disk_dir=tmp_path, disk_budget_bytes=256 * MIB)
    try:
        answer, _, _ = generate(engine, slots[0], first)
        # As a server stops: the slots' contents, then memory, go to disk.
        engine.keep_in_prompt_cache(slots)
        cache.close()
        engine.prompt_cache = cache = PromptCache(16 * MIB, disk_dir=tmp_path, disk_budget_bytes=256 * MIB)
        assert cache.stats.disk_entries == 1 and cache.stats.entries == 0
        generate(engine, slots[1], engine.encode(messages=others(1)[0]))
        again, result, cached = generate(engine, slots[1], first)
        assert cached == len(first) - 1 and result.prompt_tokens_evaluated == 1 and again == answer
        assert cache.stats.disk_hits == 1
    finally:
        engine.prompt_cache = None
        cache.close()


def write_entry(tmp_path: Path, key: str = "a" * 64, start: int = 0, size: int = 100) -> Path:
    cache = PromptCache(1 * MIB, disk_dir=tmp_path, disk_budget_bytes=1 * MIB)
    assert cache.store(key, tokens(start), bytes(range(256)) * (size // 256) + bytes(size % 256))
    cache.close()
    [path] = [p for p in tmp_path.glob("*.kv") if p.name.startswith(key[:16]) and p.stat().st_size > size]
    return path


def skipped_lines(log_capture) -> list[dict]:
    return log_capture.records("prompt_cache_file_skipped")


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "model_key", "version"])
def test_a_damaged_or_mismatched_file_is_skipped_with_one_line_and_removed(tmp_path, log_capture, damage):
    key = "a" * 64
    path = write_entry(tmp_path, key, size=1000)
    raw = bytearray(path.read_bytes())
    if damage == "corrupt":
        raw[-10] ^= 0xFF  # the state: found out by its digest, when it is read
    elif damage == "truncated":
        raw = raw[:-10]
    elif damage == "version":
        raw[8] += 1
    path.write_bytes(bytes(raw))
    if damage == "model_key":
        # Another model's file, under this model's name.
        other = write_entry(tmp_path, "b" * 64, size=1000)
        path.unlink()
        other.rename(path)
    before = len(skipped_lines(log_capture))
    cache = PromptCache(1 * MIB, disk_dir=tmp_path, disk_budget_bytes=1 * MIB)
    try:
        assert cache.lookup(key, tokens(0), 0) is None
        lines = skipped_lines(log_capture)[before:]
        assert [line["reason"] for line in lines] == [damage]
        assert lines[0]["file"] == path.name
        assert not path.exists()
        stats = cache.stats
        assert stats.disk_skipped == 1 and stats.disk_entries == 0 and stats.disk_hits == 0
    finally:
        cache.close()


def test_another_models_file_is_never_loaded(tmp_path):
    write_entry(tmp_path, "b" * 64)
    cache = PromptCache(1 * MIB, disk_dir=tmp_path, disk_budget_bytes=1 * MIB)
    try:
        assert cache.stats.disk_entries == 1
        assert cache.lookup("a" * 64, tokens(0), 0) is None
        assert cache.lookup("b" * 64, tokens(0), 0) is not None
    finally:
        cache.close()


def test_a_write_cut_short_leaves_no_file_and_is_cleared_at_startup(tmp_path):
    (tmp_path / ".x.kv.1.tmp").write_bytes(b"half")
    cache = PromptCache(1 * MIB, disk_dir=tmp_path, disk_budget_bytes=1 * MIB)
    cache.close()
    assert list(tmp_path.iterdir()) == []


def test_the_disk_budget_removes_the_least_recently_used_file_first(tmp_path):
    key = "k" * 64
    file_size = 1000 + prompt_cache_module._HEADER.size + 4 * len(tokens(0))
    cache = PromptCache(1000, disk_dir=tmp_path, disk_budget_bytes=2 * file_size + 100)
    try:
        # Each state evicts the one before it from memory, to disk.
        for i in range(3):
            assert cache.store(key, tokens(1000 * i), bytes(1000))
        cache.disk.flush()
        assert cache.stats.disk_entries == 2 and cache.stats.disk_writes == 2
        # Read back, the first is used more recently than the second; the third, evicted
        # from memory by it, takes the second's room.
        assert cache.lookup(key, tokens(0), 0) is not None
        cache.disk.flush()
        stats = cache.stats
        assert (stats.disk_entries, stats.disk_evictions, stats.disk_bytes) == (2, 1, 2 * file_size)
        assert cache.disk.longest(key, tokens(0), 0)[0] is not None
        assert cache.disk.longest(key, tokens(1000), 0)[0] is None
        assert cache.disk.longest(key, tokens(2000), 0)[0] is not None
        assert len(list(tmp_path.glob("*.kv"))) == 2
    finally:
        cache.close()


def test_the_disk_tier_makes_room_before_it_writes(tmp_path, monkeypatch):
    file_size = 1000 + prompt_cache_module._HEADER.size + 4 * len(tokens(0))
    budget = 2 * file_size + 100
    # What the folder holds as each file is finished, the file itself included.
    held = []
    replace = os.replace

    def spy(source, target):
        held.append(sum(path.stat().st_size for path in tmp_path.iterdir()))
        replace(source, target)

    monkeypatch.setattr(prompt_cache_module.os, "replace", spy)
    cache = PromptCache(1000, disk_dir=tmp_path, disk_budget_bytes=budget)
    try:
        for i in range(5):
            assert cache.store("k" * 64, tokens(1000 * i), bytes(1000))
        cache.disk.flush()
        assert len(held) == 4 and max(held) <= budget
        assert cache.stats.disk_evictions == 2
    finally:
        cache.close()


def test_files_are_written_on_the_writer_thread_only(tmp_path, monkeypatch):
    threads = []
    replace = os.replace

    def spy(source, target):
        threads.append(threading.current_thread().name)
        replace(source, target)

    monkeypatch.setattr(prompt_cache_module.os, "replace", spy)
    cache = PromptCache(1000, disk_dir=tmp_path, disk_budget_bytes=1 * MIB)
    assert cache.store("k" * 64, tokens(0), bytes(1000))
    assert cache.store("k" * 64, tokens(1000), bytes(1000))
    cache.disk.flush()
    cache.close()
    assert threads == ["stopline-prompt-cache-writer"] * 2


def test_the_disk_flags():
    assert parse().prompt_cache_dir is None and parse().prompt_cache_disk_mib is None
    assert parse("--prompt-cache-dir", "/x", "--prompt-cache-disk", "16").prompt_cache_disk_mib == 16
    # (Imported before the tests' own folder stands in for it.)
    assert default_prompt_cache_dir() == cache_dir() / "prompt-cache"
    assert Settings.build(prompt_cache_dir="/x").prompt_cache_path == Path("/x")
    assert Settings.build(prompt_cache_disk_mib=16).prompt_cache_disk_bytes == 16 * MIB
    assert 0 < Settings.build().prompt_cache_disk_bytes <= 4 * 1024 * MIB
    assert Settings.build(prompt_cache_disk_mib=0).prompt_cache_disk_bytes == 0
    assert Settings.build(prompt_cache=False, prompt_cache_disk_mib=16).prompt_cache_disk_bytes == 0


async def chat_first(server) -> object:
    client = openai_client(server)
    return await client.chat.completions.create(model=server.engine.name, messages=FIRST, temperature=0, max_tokens=4)


@pytest.mark.parametrize("disk_mib", [0, 256], ids=["memory-alone", "disk"])
async def test_after_a_restart_a_repeated_prompt_is_served_from_disk(engine, tmp_path, disk_mib):
    config = dict(workers=1, cache_ram_mib=256, prompt_cache_dir=str(tmp_path), prompt_cache_disk_mib=disk_mib)
    async with running_server(engine, **config) as server:
        first = await chat_first(server)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
    async with running_server(engine, **config) as server:
        again = await chat_first(server)
        assert again.choices[0].message.content == first.choices[0].message.content
        text = await fetch_metrics(server)
        if disk_mib:
            assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
            assert metric_value(text, "stopline_prompt_cache_disk_hits_total") == 1
            assert metric_value(text, "stopline_prompt_cache_disk_entries") >= 1
            assert metric_value(text, "stopline_prompt_cache_disk_bytes") > 0
        else:
            assert again.usage.prompt_tokens_details.cached_tokens == 0
            assert "stopline_prompt_cache_disk_hits" not in text


# Large blocks written and freed in turn, as KV states are, between small ones that stay:
# prints how many bytes the process's RSS kept after the large ones were freed.
FREED_STATES = """
import os
from stopline import _core
from stopline.engine.llama_build import engine_library

def rss():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

_core.load_llama_library(str(engine_library(progress=False)))
size = 4 * _core.LARGE_BLOCK_BYTES
# A larger block freed first: glibc's own threshold would rise above the states' size.
first = b"\x01" * (2 * size)
del first
before = rss()
states, kept = [], []
for _ in range(8):
    states.append(b"\x01" * size)
    kept.append(bytearray(64 * 1024))
del states
print(rss() - before)
"""


def test_a_freed_kv_state_goes_back_to_the_system():
    # Without a fixed threshold, glibc would serve the states after the first from its heap,
    # and keep their space once they are freed: the RSS would hold 8 states no one holds.
    run = subprocess.run([sys.executable, "-c", FREED_STATES], capture_output=True, text=True, check=True)
    kept = int(run.stdout)
    assert kept < 2 * _core.LARGE_BLOCK_BYTES, f"{kept / 2**20:.1f} MiB kept"
