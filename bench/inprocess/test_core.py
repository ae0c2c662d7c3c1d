"""Microbenchmarks of the native core, against the real model.

Run them with the other microbenchmarks (the test suite does not collect bench/):

    python -m pytest bench/ --benchmark-only

Every model benchmark uses pedantic mode with few rounds so the file takes a
couple of minutes; the numbers that matter (tokens/s, latencies) are in each
benchmark's extra_info, and are printed as they are measured (use -s).
"""

from __future__ import annotations

import itertools
import random
import select
import statistics
import threading
import time

import pytest

from stopline import _core
from stopline._core import ExitKind, Generation
from stopline.protocol.requests import SamplingParams

DECODE_TOKENS = 64
PREFILL_TOKENS = 512
CANCELS = 30
LONG_PROMPT_TEXT = "The history of bread is long. " * 220
LONG_ANSWER = [{"role": "user", "content": "Write a very long story about a dragon who learns to bake bread."}]


@pytest.fixture(scope="module")
def story_prompt(engine) -> list[int]:
    return engine.encode(messages=LONG_ANSWER)


@pytest.fixture(scope="module")
def long_prompt(engine) -> list[int]:
    tokens = engine.encode(prompt=LONG_PROMPT_TEXT)
    assert len(tokens) >= PREFILL_TOKENS
    return tokens


def report(benchmark, **values) -> None:
    benchmark.extra_info.update(values)
    print("\n" + ", ".join(f"{k}={v}" for k, v in values.items()))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# --- (a) one poll of the cancel flag and deadlines -------------------------------


def test_flag_poll(benchmark):
    iterations = 100_000
    per_poll = []
    benchmark.pedantic(lambda: per_poll.append(_core.measure_flag_poll(iterations)), rounds=20, iterations=1)
    report(
        benchmark,
        iterations=iterations,
        ns_per_poll=round(statistics.median(per_poll), 2),
        ns_per_poll_min=round(min(per_poll), 2),
    )


# --- (b) our loop against ctransformers' own Python generate() --------------------


def _run_ours(slot, prompt):
    generation = Generation(
        slot,
        prompt,
        SamplingParams(max_tokens=DECODE_TOKENS, temperature=0, top_k=40, top_p=0.95, repetition_penalty=1.1),
        prefill_chunk=8,
        threads=1,
        window=DECODE_TOKENS,
    )
    return generation.run(), generation.take()


def _decode_step_ms(result) -> float:
    return (result.end_ns - result.first_token_ns) / 1e6 / (result.tokens_generated - 1)


def test_decode_ours(benchmark, slot, story_prompt):
    runs = []
    benchmark.pedantic(lambda: runs.append(_run_ours(slot, story_prompt)), rounds=3, iterations=1, warmup_rounds=1)
    results = [r for r, _ in runs]
    assert all(r.tokens_generated == DECODE_TOKENS for r in results)
    step_ms = statistics.median(_decode_step_ms(r) for r in results)
    total = statistics.median(r.tokens_generated * 1e9 / (r.end_ns - r.start_ns) for r in results)
    report(
        benchmark,
        decode_tokens_per_s=round(1e3 / step_ms, 1),
        tokens_per_s_with_prefill=round(total, 1),
        step_ms=round(step_ms, 2),
        prompt_tokens=len(story_prompt),
    )


def test_decode_ctransformers(benchmark, engine, slot, story_prompt):
    """ctransformers' own generate() on the same prompt, greedy, 64 tokens, with
    our loop run just before each round so that the two compare under the same load."""
    from ctransformers import AutoModelForCausalLM

    llms, ours, theirs = [], [], []

    def setup():
        ours.append(_run_ours(slot, story_prompt))
        # A new model per round: generate(reset=True) would otherwise reuse the
        # previous round's KV cache for the common prompt prefix and skip prefill.
        llms[:] = [
            AutoModelForCausalLM.from_pretrained(
                str(engine.model_path), model_type="llama", context_length=2048, threads=1
            )
        ]
        return (), {}

    def run():
        stamps, tokens = [], []
        generator = llms[0].generate(
            story_prompt, top_k=1, temperature=1.0, repetition_penalty=1.1, batch_size=8, threads=1, reset=True
        )
        start = time.perf_counter_ns()
        for token in itertools.islice(generator, DECODE_TOKENS):
            tokens.append(token)
            stamps.append(time.perf_counter_ns())
        theirs.append((start, stamps, tokens))

    benchmark.pedantic(run, setup=setup, rounds=3, iterations=1, warmup_rounds=1)
    llms.clear()
    # The same greedy tokens, so the difference per step is the loops' own cost.
    for (result, pieces), (_, _stamps, tokens) in zip(ours, theirs):
        assert len(tokens) == DECODE_TOKENS == result.tokens_generated
        assert [slot.token_bytes(t) for t in tokens] == pieces
    their_steps = [(s[-1] - s[0]) / 1e6 / (len(s) - 1) for _, s, _ in theirs]
    our_steps = [_decode_step_ms(r) for r, _ in ours]
    total = statistics.median(len(s) * 1e9 / (s[-1] - start) for start, s, _ in theirs)
    report(
        benchmark,
        decode_tokens_per_s=round(1e3 / statistics.median(their_steps), 1),
        tokens_per_s_with_prefill=round(total, 1),
        step_ms=round(statistics.median(their_steps), 2),
        paired_ours_decode_tokens_per_s=round(1e3 / statistics.median(our_steps), 1),
        paired_ours_minus_theirs_ms_per_token=round(
            statistics.median(o - t for o, t in zip(our_steps, their_steps)), 3
        ),
    )


# --- (c) prefill speed by chunk size -------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 2, 4, 8, 16, 32])
def test_prefill_by_chunk(benchmark, slot, long_prompt, chunk):
    prompt = long_prompt[:PREFILL_TOKENS]
    results = []

    def run():
        results.append(
            Generation(
                slot,
                prompt,
                SamplingParams(max_tokens=1, temperature=0),
                prefill_chunk=chunk,
                threads=1,
            ).run()
        )

    benchmark.pedantic(run, rounds=3, iterations=1)
    assert all(r.prompt_tokens_evaluated == PREFILL_TOKENS for r in results)
    prefill_ns = statistics.median(r.first_token_ns - r.start_ns for r in results)
    report(
        benchmark,
        chunk=chunk,
        prefill_tokens_per_s=round(PREFILL_TOKENS * 1e9 / prefill_ns, 1),
        ms_per_chunk=round(prefill_ns / 1e6 / (PREFILL_TOKENS / chunk), 2),
    )


# --- (d) cancel-to-exit latency --------------------------------------------------------


class _Cycle:
    """One generation started on a thread and brought to a random point, ready to cancel."""

    def __init__(self, generation: Generation):
        self.generation = generation
        self.thread = threading.Thread(target=generation.run, daemon=True)
        self.thread.start()
        self.cancel_ns = 0

    def cancel_and_join(self):
        self.cancel_ns = time.monotonic_ns()
        self.generation.cancel()
        self.thread.join()


def _latencies(benchmark, cycles: list[_Cycle], phase: str) -> None:
    results = [c.generation.result for c in cycles]
    assert all(r.exit is ExitKind.CANCELLED for r in results)
    exit_ms = [(r.end_ns - c.cancel_ns) / 1e6 for c, r in zip(cycles, results)]
    seen_ms = [(r.cancel_observed_ns - c.cancel_ns) / 1e6 for c, r in zip(cycles, results)]
    report(
        benchmark,
        phase=phase,
        cancels=len(cycles),
        exit_ms_p50=round(percentile(exit_ms, 0.5), 2),
        exit_ms_p99=round(percentile(exit_ms, 0.99), 2),
        exit_ms_max=round(max(exit_ms), 2),
        observed_ms_p50=round(percentile(seen_ms, 0.5), 2),
        observed_ms_p99=round(percentile(seen_ms, 0.99), 2),
        max_tokens_after_cancel=max(r.tokens_after_cancel for r in results),
    )


def test_cancel_latency_during_decode(benchmark, engine, slot):
    prompt = engine.encode(prompt="Once upon a time")
    rng = random.Random(1)
    cycles: list[_Cycle] = []

    def setup():
        params = SamplingParams(max_tokens=500, temperature=0.7, seed=rng.randrange(1000))
        cycle = _Cycle(Generation(slot, prompt, params, prefill_chunk=engine.prefill_chunk, threads=1))
        # Some tokens in, then a random point inside a step.
        wanted, seen = rng.randint(1, 5), 0
        while seen < wanted:
            select.select([cycle.generation.fileno()], [], [], 1.0)
            seen += len(cycle.generation.take())
        time.sleep(rng.uniform(0, 0.015))
        cycles.append(cycle)
        return (), {}

    # The measured time is cancel() until the run() thread has returned.
    benchmark.pedantic(lambda: cycles[-1].cancel_and_join(), setup=setup, rounds=CANCELS, iterations=1)
    _latencies(benchmark, cycles, "decode")


@pytest.mark.parametrize("chunk", [1, 8])
def test_cancel_latency_during_prefill(benchmark, slot, long_prompt, chunk):
    rng = random.Random(2)
    cycles: list[_Cycle] = []

    def setup():
        cycle = _Cycle(
            Generation(
                slot,
                long_prompt,
                SamplingParams(max_tokens=16, seed=0),
                prefill_chunk=chunk,
                threads=1,
            )
        )
        time.sleep(rng.uniform(0.05, 0.3))
        cycles.append(cycle)
        return (), {}

    benchmark.pedantic(lambda: cycles[-1].cancel_and_join(), setup=setup, rounds=CANCELS, iterations=1)
    assert all(c.generation.result.tokens_generated == 0 for c in cycles)
    _latencies(benchmark, cycles, f"prefill chunk={chunk}")
