"""In-process measurements of the native loop: prompt speed by chunk size with
and without the step hook, and aborts at random moments.

``python -m bench`` runs these first (scenario ``native``), before it starts
any server; ``python -m bench native`` runs them alone.
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

from stopline._core import Generation
from stopline.engine.loop import Engine
from stopline.protocol.requests import SamplingParams, exit_outcome
from stopline.protocol.vocabulary import Outcome

from ..tables import fmt, stat, table

CHUNKS = (16, 32, 64, 128, 256, 512)
SWEEP_PROMPT_TOKENS = 512
STORM_TOKENS = 4
SWEEP_TEXT = "The history of bread is long, and every town tells it a little differently. "


def count_outcome(counts: dict, exit_ms: list, generation, result, cancelled_at_ns: int, parted) -> None:
    """Tally one generation of an abort storm: a cancel and how long its loop took to exit,
    or a run that escaped its cancel and must equal a fresh slot's greedy answer
    (``parted(generation)``: None if it does, else the name of the count it adds to)."""
    outcome, _ = exit_outcome(result.exit)
    if outcome is Outcome.CANCELLED:
        counts["cancelled"] += 1
        exit_ms.append((result.end_ns - cancelled_at_ns) / 1e6)
    elif outcome is Outcome.DONE:
        counts["done"] += 1
        if (name := parted(generation)) is not None:
            counts[name] += 1
    else:
        counts["other"] += 1


def greedy_params(max_tokens: int, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, seed=0, **fields)


def prefill_sweep(engine: Engine, reps: int = 1) -> list[dict]:
    """Prompt tokens per second and the longest graph node, by chunk size: the
    stock evaluation (no hook, logits for every token) against the hook with
    the output projection trimmed to the last token."""
    prompt = engine.encode(prompt=SWEEP_TEXT * 80)[:SWEEP_PROMPT_TOKENS]
    slot = engine.open_slot()
    rows = []
    try:
        for chunk in CHUNKS:
            for mode, step_abort, trim in (
                ("stock", False, False),
                ("in_step", True, False),
                ("in_step_trimmed", True, True),
            ):
                rates, nodes = [], []
                for _ in range(reps):
                    slot.forget()
                    result = Generation(
                        slot, prompt, greedy_params(1), prefill_chunk=chunk, step_abort=step_abort, trim_output=trim
                    ).run()
                    rates.append(len(prompt) / ((result.first_token_ns - result.start_ns) / 1e9))
                    nodes.append(result.longest_prefill_node_ns / 1e6)
                rows.append(
                    {
                        "chunk": chunk,
                        "mode": mode,
                        "prompt_tokens_per_s": statistics.median(rates),
                        "longest_node_ms": max(nodes) if step_abort else None,
                    }
                )
    finally:
        slot.close()
    return rows


def abort_storm(engine: Engine, prompt: list[int], cycles: int, threads: int, seed: int = 0) -> dict:
    """Cancel the same greedy generation at random moments, ``cycles`` times, on
    one slot. Every run that escapes its cancel, and a final one, must give the
    tokens of a fresh slot. Chunks of 16 make aborted prompts resume from reused
    prefixes of many lengths."""
    slot = engine.open_slot()

    def greedy():
        generation = Generation(slot, prompt, greedy_params(STORM_TOKENS), prefill_chunk=16, threads=threads)
        return generation, generation.run()

    try:
        generation, fresh = greedy()
        expected = b"".join(generation.take())
        # The same prompt again comes mostly from the cache and runs shorter:
        # cancels are placed within either length, so they land in both.
        generation, resumed = greedy()
        spans_s = [(r.end_ns - r.start_ns) / 1e9 for r in (fresh, resumed)]
        rng = random.Random(seed)
        counts = {
            "cycles": cycles,
            "cancelled": 0,
            "done": 0,
            "other": 0,
            "hangs": 0,
            "mismatches": int(b"".join(generation.take()) != expected),
        }
        exit_ms = []

        def differs(generation) -> str | None:
            return "mismatches" if b"".join(generation.take()) != expected else None

        for _ in range(cycles):
            generation = Generation(slot, prompt, greedy_params(STORM_TOKENS), prefill_chunk=16, threads=threads)
            cancelled_at = []
            timer = threading.Timer(
                rng.uniform(0, rng.choice(spans_s)),
                lambda g=generation: cancelled_at.append(time.monotonic_ns()) or g.cancel(),
            )
            timer.start()
            result = generation.run()
            timer.join(60)
            counts["hangs"] += timer.is_alive()
            count_outcome(counts, exit_ms, generation, result, cancelled_at[0], differs)
        generation, _ = greedy()
        counts["mismatches"] += b"".join(generation.take()) != expected
        counts["cancel_to_exit_ms"] = exit_ms
        return counts
    finally:
        slot.close()


def storm_prompt(engine: Engine) -> list[int]:
    return engine.encode(prompt="Once upon a time, in a village by the sea, there lived an old fisherman. " * 2)[:40]


def run(cycles: int = 500) -> dict:
    engine = Engine.load(threads=1, progress=False)
    results = {"sweep": prefill_sweep(engine), "storms": []}
    for threads in (1, 2):
        storm = abort_storm(engine, storm_prompt(engine), cycles, threads)
        results["storms"].append({"threads": threads, **storm})
    return results


def markdown(results: dict) -> str:
    stock_best = max(r["prompt_tokens_per_s"] for r in results["sweep"] if r["mode"] == "stock")
    by = {(r["chunk"], r["mode"]): r for r in results["sweep"]}
    sweep = []
    for chunk in CHUNKS:
        stock, hook, trim = (by[(chunk, m)] for m in ("stock", "in_step", "in_step_trimmed"))
        rates = [fmt(r["prompt_tokens_per_s"]) for r in (stock, hook, trim)]
        sweep.append(
            [str(chunk), *rates, fmt(trim["longest_node_ms"]), f"{trim['prompt_tokens_per_s'] / stock_best:.2f}×"]
        )
    storms = []
    for storm in results["storms"]:
        counts = [str(storm[k]) for k in ("threads", "cycles", "cancelled", "done", "mismatches", "hangs", "other")]
        storms.append(counts + [" / ".join(map(fmt, stat(storm["cancel_to_exit_ms"], "p50", "p99")))])
    sweep_header = "chunk|stock tok/s|hook, full logits tok/s|hook, last-token logits tok/s|longest node (ms)|"
    storm_header = "threads per slot|aborts|cancelled|escaped (done)|different tokens after|hangs|other outcomes|"
    return (
        f"{table(sweep_header + 'trimmed / best stock', sweep)}\n\n"
        f"{table(storm_header + 'cancel→exit p50 / p99 (ms)', storms)}\n"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench native", description=__doc__)
    p.add_argument("--abort-cycles", type=int, default=500, help="aborts per thread setting (1 and 2)")
    args = p.parse_args(argv)
    print(markdown(run(args.abort_cycles)))
    return 0
