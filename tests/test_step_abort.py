"""Stopping inside an evaluation, prompts at full speed, and KV-cache reuse,
against the real model and the real library.

Time bounds are in units measured in the same test (an evaluation, a node);
everything else is counts and token identity.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from bench.inprocess.native import abort_storm, storm_prompt
from stopline import _core
from stopline._core import ExitKind, Generation
from stopline.engine.loop import Engine
from stopline.protocol.vocabulary import AbortMode, EngineName
from support import (
    CHAT_FRANCE,
    UNIT,
    client_for,
    fetch_metrics,
    http_get,
    make_generation,
    metric_value,
    started_running,
)

# Aborts per thread setting in the robustness test (python -m bench --native runs 500 each).
ABORT_CYCLES = int(os.environ.get("STOPLINE_ABORT_CYCLES", "150"))
STORY = "Once upon a time, in a village by the sea, there lived an old fisherman and his clever daughter. "


# The tests up to the server's are about the ctransformers engine's step abort: the hook in its
# patched ggml, and the trimmed output projection it allows. The llama.cpp engine's stop inside an
# evaluation is tested in test_llama_edits.py and test_llama_engine.py.
@pytest.fixture(scope="module")
def slot(ctransformers_engine):
    context = ctransformers_engine.open_slot()
    yield context
    context.close()


def run_in_thread(generation: Generation):
    box = {}
    thread = threading.Thread(target=lambda: box.update(result=generation.run()), daemon=True)
    thread.start()
    return thread, box


def greedy(slot, prompt, max_tokens=8, chunk=16, threads=1):
    generation = make_generation(
        slot, prompt, max_tokens=max_tokens, temperature=0, prefill_chunk=chunk, threads=threads
    )
    result = generation.run()
    return result, b"".join(generation.take())


def test_the_engine_proves_the_hook_at_startup(ctransformers_engine):
    assert _core.step_abort_installed()
    assert ctransformers_engine.abort_mode is AbortMode.IN_STEP
    # The last token's logits, computed alone, are bit-identical to a full evaluation's.
    assert ctransformers_engine.trim_output


@pytest.mark.slow
def test_trimmed_output_projection_is_bit_identical_on_a_long_chunk(ctransformers_engine, slot):
    # 100 tokens: past the 32-token width where ggml's f16 dot products change summation order.
    tokens = ctransformers_engine.encode(prompt=STORY * 5)[:100]
    assert slot.probe_step_abort(tokens) == (True, True)


def test_cancel_stops_a_single_huge_evaluation_part_way(ctransformers_engine, slot):
    """One chunk of 512 tokens takes seconds; a cancel ends it between two graph nodes."""
    prompt = ctransformers_engine.encode(prompt=STORY * 30)[:600]
    slot.forget()
    generation = make_generation(slot, prompt, max_tokens=4, temperature=0, prefill_chunk=_core.MAX_PREFILL_CHUNK)
    thread, box = run_in_thread(generation)
    # Let the evaluation get going (the hook measures nodes from its start).
    started_running(generation)
    time.sleep(0.3 * UNIT)
    cancel_ns = time.monotonic_ns()
    assert generation.cancel() is True
    thread.join(120 * UNIT)
    result = box["result"]
    assert result.exit is ExitKind.CANCELLED
    # Nothing was counted as evaluated: the 512-token evaluation never completed.
    assert result.prompt_tokens_evaluated == 0 and result.tokens_generated == 0
    # The loop left long before the chunk could have ended: the longest node seen
    # so far bounds the wait, and the chunk holds hundreds of nodes.
    assert result.end_ns - cancel_ns < 50 * max(result.longest_prefill_node_ns, 1_000_000) * UNIT
    # The aborted positions are not reused.
    assert slot.n_held == 0


def test_first_token_deadline_stops_inside_an_evaluation(ctransformers_engine, slot):
    prompt = ctransformers_engine.encode(prompt=STORY * 30)[:600]
    slot.forget()
    deadline_ns = time.monotonic_ns() + int(0.3e9 * UNIT)
    result = make_generation(
        slot, prompt, max_tokens=4, prefill_chunk=_core.MAX_PREFILL_CHUNK, first_token_deadline_ns=deadline_ns
    ).run()
    assert result.exit is ExitKind.FIRST_TOKEN_DEADLINE
    assert result.prompt_tokens_evaluated == 0
    assert result.end_ns >= deadline_ns


@pytest.mark.slow
def test_between_steps_mode_finishes_the_evaluation_in_progress(ctransformers_engine, slot):
    prompt = ctransformers_engine.encode(prompt=STORY * 20)[:300]
    slot.forget()
    generation = make_generation(slot, prompt, max_tokens=4, prefill_chunk=128, step_abort=False)
    thread, box = run_in_thread(generation)
    # Well inside the first 128-token evaluation, which takes over a second.
    started_running(generation)
    time.sleep(0.2 * UNIT)
    generation.cancel()
    thread.join(120 * UNIT)
    result = box["result"]
    assert result.exit is ExitKind.CANCELLED
    # Whole chunks only: the evaluation under way when the cancel came was finished.
    assert result.prompt_tokens_evaluated % 128 == 0 and result.prompt_tokens_evaluated > 0


def test_follow_up_turn_evaluates_only_the_new_tokens(ctransformers_engine, slot):
    slot.forget()
    first = ctransformers_engine.encode(messages=CHAT_FRANCE)
    r1, answer = greedy(slot, first, max_tokens=24, chunk=ctransformers_engine.prefill_chunk)
    follow_up = ctransformers_engine.encode(
        messages=CHAT_FRANCE
        + [{"role": "assistant", "content": answer.decode()}, {"role": "user", "content": "And of Italy?"}]
    )
    # The cache holds the prompt and every answer token that was evaluated: all
    # but the last, unless the answer ended with EOS (never evaluated, never counted).
    last_evaluated = 0 if r1.exit is ExitKind.EOS else 1
    assert slot.n_held == len(first) + r1.tokens_generated - last_evaluated
    expected = slot.reusable_prefix(follow_up, ctransformers_engine.prefill_chunk)
    # The first turn's prompt, and as much of its answer as the new prompt repeats.
    assert expected >= len(first)
    r2, _ = greedy(slot, follow_up, max_tokens=8, chunk=ctransformers_engine.prefill_chunk)
    assert r2.prompt_tokens_reused == expected
    assert r2.prompt_tokens_evaluated == r2.prompt_tokens - expected


def test_a_resumed_prompt_computes_what_a_fresh_slot_computes(ctransformers_engine, slot):
    prompt = ctransformers_engine.encode(prompt=STORY * 3)
    slot.forget()
    _, fresh = greedy(slot, prompt, chunk=16)
    # Same prompt again: all but the last token is reused, and that token is
    # evaluated in a batch ending where the fresh one's did.
    again, text = greedy(slot, prompt, chunk=16)
    assert again.prompt_tokens_reused == len(prompt) - 1
    assert text == fresh


# Two compute threads spin-wait for each other at every node: beside another test, a preempted one
# stalls its partner, so that case runs alone.
@pytest.mark.parametrize("threads", [1, pytest.param(2, marks=pytest.mark.alone)])
@pytest.mark.slow
def test_aborts_at_random_moments_never_corrupt_a_slot(ctransformers_engine, threads):
    """The same generation cancelled at random moments, over and over, on one
    slot: no abort, in the prompt or in decode, may leave a trace. Every run
    that escapes its cancel, and a final one, gives a fresh slot's tokens."""
    counts = abort_storm(ctransformers_engine, storm_prompt(ctransformers_engine), ABORT_CYCLES, threads, seed=threads)
    print(f"\nthreads={threads}: " + ", ".join(f"{k} {v}" for k, v in counts.items() if k != "cancel_to_exit_ms"))
    assert counts["hangs"] == 0 and counts["other"] == 0 and counts["mismatches"] == 0
    # Some runs escape their cancel (it is placed at random within a run's
    # length); a good share must not.
    assert counts["cancelled"] >= ABORT_CYCLES // 4
    assert counts["cancelled"] + counts["done"] == ABORT_CYCLES


# --- the server ----------------------------------------------------------------


@pytest.mark.both_engines(why="each engine stops inside a step its own way")
async def test_health_and_metrics_report_the_abort_mode(server):
    status, body = await http_get(server, "/healthz")
    assert status == 200 and '"abort_mode": "in_step"' in body
    text = await fetch_metrics(server)
    assert metric_value(text, "stopline_abort_mode", mode="in_step") == 1
    assert metric_value(text, "stopline_abort_mode", mode="between_steps") == 0


@pytest.mark.slow
@pytest.mark.both_engines(why="each engine keeps a conversation in its own cache")
async def test_a_conversation_comes_back_to_the_slot_that_holds_it(server, engine, logs):
    """Two conversations alternate on two slots; each turn finds its own history."""
    conversations = {
        "a": [{"role": "user", "content": "Name a fruit. " + STORY * 3}],
        "b": [{"role": "user", "content": "Name a colour. " + STORY * 3}],
    }
    ends = {"a": [], "b": []}
    async with client_for(server) as client:
        for turn in range(3):
            for name, messages in conversations.items():
                request_id = f"{name}{turn}"
                await client.generate(request_id, messages=messages, max_tokens=8, temperature=0)
                end = await client.terminal(request_id)
                assert end["type"] == "done"
                ends[name].append(end)
                answer = "".join(f["text"] for f in client.tokens(request_id))
                messages += [
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": "Another one, please."},
                ]
    for turns in ends.values():
        assert turns[0]["prompt_tokens_reused"] == 0
        for before, after in zip(turns, turns[1:]):
            # All of the previous turn's prompt came from the cache.
            assert after["prompt_tokens_reused"] >= before["prompt_tokens"]
    reused = [end["prompt_tokens_reused"] for turns in ends.values() for end in turns]
    text = await fetch_metrics(server)
    assert metric_value(text, "stopline_prompt_tokens_reused_total") == sum(reused)
    assert sorted(r["prompt_tokens_reused"] for r in logs.records("generation_done")) == sorted(reused)


@pytest.mark.slow
def test_between_steps_fallback_is_explicit(ctransformers_engine):
    other = Engine.load(threads=1, progress=False, abort_mode=AbortMode.BETWEEN_STEPS, engine=EngineName.CTRANSFORMERS)
    assert other.abort_mode is AbortMode.BETWEEN_STEPS and not other.trim_output
    assert other.prefill_chunk == 1
