"""What a grammar costs the llama.cpp engine's loop, and whether a stop still lands at once.

    python -m bench structured [--runs 6] [--stops 100]

Prints, for no constraint, json_object, a json_schema and tool_choice auto's
prose-or-calls grammar: the decode time per
token (first token to end, over greedy runs of 96 tokens at most) and the
difference a grammar makes as a share of a step; then, with the schema's grammar
active and without one, the latency from Generation.cancel() right after a
token was published to the loop's exit (p50, p99, max).
"""

from __future__ import annotations

import argparse
import os
import select
import statistics
import threading
import time

from stopline._core import Generation
from stopline.engine.loop import Engine
from stopline.protocol.requests import SamplingParams
from stopline.structured.json_grammar import JSON_OBJECT_GRAMMAR, schema_grammar
from stopline.structured.tool_calls import ToolChoice, calls_grammar

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}, "country": {"enum": ["FR", "DE", "US"]}},
            "required": ["city", "country"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "skills", "address"],
    "additionalProperties": False,
}
# Long enough that a stop always lands mid-answer.
ENDLESS = {"type": "array", "items": {"type": "integer"}, "minItems": 500}
MESSAGES = [{"role": "user", "content": "Describe a famous scientist as JSON with name, age, skills and address."}]


def per_token_ms(engine: Engine, slot, prompt: list[int], grammar: str | None, seed: int) -> tuple[float, int]:
    params = SamplingParams(max_tokens=96, temperature=0.7, seed=seed, grammar=grammar)
    generation = Generation(slot, prompt, params, prefill_chunk=engine.prefill_chunk, threads=1, window=1000)
    result = generation.run()
    steps = result.tokens_generated - 1
    return (result.end_ns - result.first_token_ns) / 1e6 / max(steps, 1), result.tokens_generated


def stop_latencies(engine: Engine, slot, prompt: list[int], grammar: str | None, count: int, seed: int) -> list[float]:
    latencies = []
    for i in range(seed, seed + count):
        params = SamplingParams(max_tokens=1000, temperature=0.7, seed=i, grammar=grammar)
        generation = Generation(slot, prompt, params, prefill_chunk=engine.prefill_chunk, threads=1, window=1000)
        worker = threading.Thread(target=generation.run)
        worker.start()
        # Stop right after the (3 + i % 5)-th token is published.
        wanted, seen = 3 + i % 5, 0
        while seen < wanted:
            select.select([generation.fileno()], [], [])
            seen += len(generation.take())
        asked = time.monotonic_ns()
        generation.cancel()
        worker.join()
        assert generation.result is not None
        latencies.append((generation.result.end_ns - asked) / 1e6)
    return latencies


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench structured", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--stops", type=int, default=100)
    args = parser.parse_args(argv)
    engine = Engine.load(engine="llama.cpp", threads=1, progress=False)
    slot = engine.open_slot()
    prompt = engine.encode(messages=MESSAGES)
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    grammars = {
        "none": None,
        "json_object": JSON_OBJECT_GRAMMAR,
        "json_schema": schema_grammar(SCHEMA),
        # Prose that may turn into calls: the text an answer with tool_choice auto is held to.
        "tools_auto": calls_grammar([{"name": "describe", "parameters": SCHEMA}], ToolChoice.AUTO, parallel=True),
    }
    times: dict[str, list[float]] = {name: [] for name in grammars}
    tokens: dict[str, int] = dict.fromkeys(grammars, 0)
    for run in range(args.runs):
        # Interleaved, so that a change in the machine's load falls on every variant alike.
        for name, grammar in grammars.items():
            slot.forget()
            ms, n = per_token_ms(engine, slot, prompt, grammar, seed=run)
            times[name].append(ms)
            tokens[name] += n
            print(f"  run {run} {name}: {ms:.3f} ms/token over {n} tokens", flush=True)
    base = statistics.median(times["none"])
    for name in grammars:
        median = statistics.median(times[name])
        print(
            f"{name:12s} {median:7.3f} ms/token ({1000 / median:6.1f} tok/s, {tokens[name]} tokens) "
            f"cost {100 * (median - base) / base:+6.1f}% of a step"
        )
    # Interleaved again: with and without a grammar, one stop each in turn.
    stops: dict[str, list[float]] = {"none": [], "json_schema": []}
    for i in range(args.stops):
        for name, grammar in (("none", None), ("json_schema", schema_grammar(ENDLESS))):
            stops[name] += stop_latencies(engine, slot, prompt, grammar, 1, seed=i)
    for name, latencies in stops.items():
        latencies.sort()
        p50, p99 = statistics.quantiles(latencies, n=100)[49], statistics.quantiles(latencies, n=100)[98]
        print(
            f"stop after a token, grammar {name:11s}: p50 {p50:.3f} ms, p99 {p99:.3f} ms, "
            f"max {latencies[-1]:.3f} ms ({len(latencies)} stops)"
        )
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    slot.close()
    return 0
