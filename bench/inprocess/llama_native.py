"""In-process measurements of the llama.cpp engine's loop, and its greedy output
against llama-server's.

* The abort storm: greedy generations cancelled at random moments, 1,000 times
  on one slot, then 1,000 times spread over 4 slots running at once (the 4
  sequences of one llama.cpp context, whose running generations share each
  step, as the server's slots do). After every generation the
  slot's KV cache must hold exactly the positions the loop's record says it
  holds (``LlamaSequence.kv_positions == Slot.n_held``), and every run that
  escaped its cancel, and a final one per slot, must give a fresh slot's
  tokens, or part from them only where the two likeliest were within
  ``NEAR_TIE_LOGPROB`` (with 4 streams, a prompt chunk may be evaluated beside
  other sequences' tokens, in kernels of another shape, which sum in another
  order). It runs in a child process, so that a crash is counted, not fatal,
  and a generation that never returns is counted as a hang.
* The longest graph node between two abort checks, in decode and in a long
  prompt: the most a stop waits, to set beside the server's stop latency.
* Greedy agreement: the same prompts, as the same token ids, greedy
  (temperature 0, repetition penalty 1.0) on our llama.cpp engine and on
  llama-server over the same GGUF file, compared token for token. llama-server
  reports the two likeliest tokens' log-probabilities at every step, so a
  divergence can be told apart as a near-tie (the two within
  ``NEAR_TIE_LOGPROB``) or a real difference.

``python -m bench llama-native storm --model PATH`` runs the storm alone and
prints its counts as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from stopline._core import Generation
from stopline.engine.loop import Engine
from stopline.protocol.requests import SamplingParams
from stopline.protocol.vocabulary import Batching, EngineName

from ..launch import run_stopline
from .native import count_outcome, greedy_params, storm_prompt

STORM_TOKENS = 4
STORM_CHUNK = 16
STORM_STREAMS = 4
# A generation that has not returned this long after its cancel is hung.
HANG_S = 30.0
NODE_PROMPT_TOKENS = 1500
NODE_DECODE_TOKENS = 64
GREEDY_TOKENS = 64
# Two candidates this close in log-probability are a tie that float rounding may break either way.
NEAR_TIE_LOGPROB = 0.05


def load(model: Path | None, threads: int = 1) -> Engine:
    return Engine.load(model, engine=EngineName.LLAMA_CPP, threads=threads, progress=False)


# The abort storm -------------------------------------------------------------------------


@dataclass(frozen=True)
class Greedy:
    """A greedy run's tokens and, at each, how far apart its two likeliest were (log-probability)."""

    ids: list[int]
    margins: list[float]

    @classmethod
    def of(cls, generation: Generation) -> Greedy:
        ids = generation.token_ids()
        return cls(ids, [top[0][1] - top[1][1] for _, top in generation.logprobs(0, len(ids))])

    def parted_from(self, other: Greedy) -> str | None:
        """None if the two runs agree; else "near_ties" where they part at a near-tie in
        either run, "mismatches" anywhere else (an end of generation has no margin)."""
        if self.ids == other.ids:
            return None
        shorter = min(len(self.ids), len(other.ids))
        at = next((i for i, (a, b) in enumerate(zip(self.ids, other.ids)) if a != b), shorter)
        margins = [run.margins[at] for run in (self, other) if at < len(run.margins)]
        return "near_ties" if margins and min(margins) <= NEAR_TIE_LOGPROB else "mismatches"


def _storm_lane(
    engine: Engine, slot, prompt: list[int], cycles: int, seed: int, counts: dict, lock: threading.Lock
) -> None:
    """``cycles`` cancels at random moments on ``slot``; results added to ``counts``."""
    rng = random.Random(seed)

    def generation() -> Generation:
        # The two likeliest tokens' log-probabilities tell a near-tie from a difference.
        params = greedy_params(STORM_TOKENS, logprobs=2)
        return Generation(slot, prompt, params, prefill_chunk=STORM_CHUNK, threads=engine.threads)

    def parted(g: Generation) -> str | None:
        return expected.parted_from(Greedy.of(g))

    def compare(g: Generation) -> None:
        if (name := parted(g)) is not None:
            local[name] += 1

    def kv_matches() -> bool:
        return slot.kv_positions == slot.n_held

    local = {"cancelled": 0, "done": 0, "other": 0, "hangs": 0, "mismatches": 0, "near_ties": 0, "kv_mismatches": 0}
    exit_ms: list[float] = []
    try:
        slot.forget()
        g = generation()
        fresh = g.run()
        expected = Greedy.of(g)
        local["kv_mismatches"] += not kv_matches()
        # The same prompt again comes mostly from the cache and runs shorter:
        # cancels are placed within either length, so they land in both.
        g = generation()
        resumed = g.run()
        compare(g)
        local["kv_mismatches"] += not kv_matches()
        spans_s = [(r.end_ns - r.start_ns) / 1e9 for r in (fresh, resumed)]
        for _ in range(cycles):
            g = generation()
            cancelled_at: list[int] = []
            timer = threading.Timer(
                rng.uniform(0, rng.choice(spans_s)),
                lambda g=g: cancelled_at.append(time.monotonic_ns()) or g.cancel(),
            )
            worker = threading.Thread(target=g.run, daemon=True)
            timer.start()
            worker.start()
            worker.join(HANG_S + spans_s[0] * 10)
            timer.join(HANG_S)
            if worker.is_alive() or timer.is_alive():
                local["hangs"] += 1
                break  # the slot is stuck in a call that never returns: nothing more to learn from it
            result = g.result
            assert result is not None
            local["kv_mismatches"] += not kv_matches()
            count_outcome(local, exit_ms, g, result, cancelled_at[0], parted)
        else:
            g = generation()
            g.run()
            compare(g)
            local["kv_mismatches"] += not kv_matches()
    finally:
        slot.close()
    with lock:
        for key, value in local.items():
            counts[key] += value
        counts["cancel_to_exit_ms"].extend(exit_ms)


def storm(model: Path | None, cycles: int, streams: int, seed: int = 0) -> dict:
    """``cycles`` aborts in all, spread over ``streams`` slots generating at once."""
    engine = load(model)
    prompt = storm_prompt(engine)
    counts: dict = {
        "streams": streams,
        "cycles": cycles,
        "cancelled": 0,
        "done": 0,
        "other": 0,
        "hangs": 0,
        "mismatches": 0,
        "near_ties": 0,
        "kv_mismatches": 0,
        "cancel_to_exit_ms": [],
    }
    lock = threading.Lock()
    lanes = [
        threading.Thread(
            target=_storm_lane,
            args=(engine, slot, prompt, cycles // streams + (i < cycles % streams), seed + i, counts, lock),
            daemon=True,
        )
        for i, slot in enumerate(engine.open_slots(streams, Batching.SHARED))
    ]
    for lane in lanes:
        lane.start()
    for lane in lanes:
        lane.join()
    return counts


def storm_in_child(model: Path | None, cycles: int, streams: int, seed: int = 0) -> dict:
    """The storm in a child process: a crash is a count, not the end of the benchmark."""
    command = ["llama-native", "storm", "--cycles", str(cycles), "--streams", str(streams), "--seed", str(seed)]
    child = run_stopline(*command, *(["--model", str(model)] if model else []), module="bench", timeout=None)
    if child.returncode != 0:
        return {
            "streams": streams,
            "cycles": cycles,
            "crashed": True,
            "returncode": child.returncode,
            "stderr_tail": child.stderr[-2000:],
        }
    return {**json.loads(child.stdout.strip().splitlines()[-1]), "crashed": False}


# The longest node ------------------------------------------------------------------------


def longest_nodes(engine: Engine, prompt_tokens: int = NODE_PROMPT_TOKENS, reps: int = 3) -> dict:
    """The longest graph node of a decode step and of a long prompt's chunks, as the loop records them."""
    text = "The history of bread is long, and every town tells it a little differently. " * 200
    prompt = engine.encode(prompt=text)[:prompt_tokens]
    slot = engine.open_slot()
    decode_ms, prefill_ms, rates = [], [], []
    try:
        for _ in range(reps):
            slot.forget()
            g = Generation(
                slot,
                prompt,
                greedy_params(NODE_DECODE_TOKENS),
                prefill_chunk=engine.prefill_chunk,
                threads=engine.threads,
            )
            r = g.run()
            g.take()
            prefill_ms.append(r.longest_prefill_node_ns / 1e6)
            decode_ms.append(r.longest_decode_node_ns / 1e6)
            rates.append(len(prompt) / ((r.first_token_ns - r.start_ns) / 1e9))
    finally:
        slot.close()
    return {
        "prompt_tokens": len(prompt),
        "prefill_chunk": engine.prefill_chunk,
        "threads": engine.threads,
        "longest_prefill_node_ms": prefill_ms,
        "longest_decode_node_ms": decode_ms,
        "prompt_tokens_per_s": statistics.median(rates),
    }


# Greedy agreement with llama-server ------------------------------------------------------


def greedy_ours(engine: Engine, prompt: list[int], max_tokens: int) -> list[bytes]:
    """Each generated token's bytes, greedy, with no repetition penalty (as :func:`greedy_body` asks)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, repetition_penalty=1.0, seed=0)
    slot = engine.open_slot()
    try:
        g = Generation(slot, prompt, params, prefill_chunk=engine.prefill_chunk, threads=1)
        g.run()
        return list(g.take())
    finally:
        slot.close()


def compare_greedy(ours: list[bytes], answer: dict, token_bytes) -> dict:
    """Token for token, up to the first difference; whether that difference is a near-tie."""
    theirs = [token_bytes(t) for t in answer.get("tokens", [])]
    probs = answer.get("completion_probabilities", [])
    same = 0
    while same < min(len(ours), len(theirs)) and ours[same] == theirs[same]:
        same += 1
    row: dict = {"compared": min(len(ours), len(theirs)), "same": same, "ours_n": len(ours), "theirs_n": len(theirs)}
    if same < min(len(ours), len(theirs)):
        top = probs[same].get("top_logprobs", []) if same < len(probs) else []
        gap = top[0]["logprob"] - top[1]["logprob"] if len(top) >= 2 else None
        row.update(
            diverged_at=same,
            ours_piece=ours[same].decode(errors="replace"),
            theirs_piece=theirs[same].decode(errors="replace"),
            logprob_gap=gap,
            near_tie=gap is not None and gap <= NEAR_TIE_LOGPROB,
        )
    return row


def greedy_body(prompt: list[int], max_tokens: int) -> dict:
    return {
        "prompt": prompt,
        "n_predict": max_tokens,
        "stream": False,
        "temperature": 0.0,
        "repeat_penalty": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "n_probs": 2,
        "return_tokens": True,
        "cache_prompt": False,
        "seed": 0,
    }


# The child's entry point ---------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench llama-native", description=__doc__)
    p.add_argument("what", choices=["storm"])
    p.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the embedded model's original)")
    p.add_argument("--cycles", type=int, default=1000)
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(json.dumps(storm(args.model, args.cycles, args.streams, args.seed)))
    return 0
