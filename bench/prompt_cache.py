"""python -m bench prompt-cache: what the prompt cache across requests saves (docs/engine.md, "The prompt cache").

Servers started on the same cores, model file, slots and context per slot: Stopline on
the llama.cpp engine with its defaults (``ours_llama``: shared steps, which take every
compute thread), the same with
``--no-prompt-cache`` (``ours_llama_no_cache``), and llama-server with its own
defaults (its ``--cache-ram`` on, each request on the slot it picks). Each is paused
while another is measured. Three measurements, each skipped with ``--parts``:

* agent: N conversations of T turns, C at a time. Every prompt is a shared system
  prompt of S tokens and the conversation so far: each turn appends the previous
  answer and a new short user message. The TTFT of every turn, as the client sees
  it; the servers take turns batch by batch (C conversations), in alternating order.
* resend: a long prompt cancelled at a fraction of its evaluation (placed by a cold
  prompt as long, just before), then sent again with its last tokens changed. Its
  TTFT is set against the time to evaluate its new tokens: the TTFT of a cold prompt
  of that many tokens, and what the cold prompt's rate makes of them. Here llama-server's
  requests go to one slot, whose release line tells when the stop took effect.
* restart: a conversation's first turn on Stopline, the server stopped with SIGTERM
  (what the cache holds goes to disk) and started again on the same
  ``--prompt-cache-dir``, one short unrelated request to warm it up, then the second
  turn; its TTFT against the same turn with another system prompt, which nothing holds.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import shlex
import shutil
import signal
import sys
from pathlib import Path

from stopline.protocol.vocabulary import Outcome

from .drivers.base import ANY_SLOT, Driver, Lane, Request
from .drivers.llama_server import ENGINE as LLAMA_SERVER
from .drivers.llama_server import LlamaServerDriver, ensure_llama_server
from .drivers.stopline import ServedStopline
from .machine import load_average, machine
from .prompts import PromptMaker
from .report import BENCH_DIR, write_json, write_results_section
from .run import MODELS, pause_all_but, prompt_maker
from .scenarios import first_token_ms
from .tables import fmt, stat, table

OURS, NO_CACHE = "ours_llama", "ours_llama_no_cache"
TARGETS = (OURS, NO_CACHE, LLAMA_SERVER)
PARTS = ("agent", "resend", "restart")
# Chat-template tokens around each message, over its content's: room kept in the context.
TEMPLATE_TOKENS = 16


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench prompt-cache", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", choices=list(MODELS), default="smollm2")
    p.add_argument("--engines", default=",".join(TARGETS), help=f"any of {','.join(TARGETS)}")
    p.add_argument("--parts", default=",".join(PARTS), help=f"any of {','.join(PARTS)}")
    p.add_argument("--llama-server", metavar="PATH", help="the llama-server binary")
    p.add_argument("--build-llama-server", action="store_true", help="build llama-server from a pinned source (once)")
    agent = p.add_argument_group("agent")
    agent.add_argument("--conversations", type=int, default=8)
    agent.add_argument("--turns", type=int, default=6)
    agent.add_argument("--system-tokens", type=int, default=4000, help="the shared system prompt")
    agent.add_argument("--user-tokens", type=int, default=40, help="each new user message")
    agent.add_argument("--answer-tokens", type=int, default=48, help="max_tokens of each answer")
    agent.add_argument("--concurrency", type=int, default=4, help="conversations at once, and each server's slots")
    resend = p.add_argument_group("resend")
    resend.add_argument("--resend-tokens", type=int, default=8000, help="the prompt stopped and sent again")
    resend.add_argument("--cancel-at", type=float, default=0.7, help="the stop, as a fraction of its cold TTFT")
    resend.add_argument("--edit-tokens", type=int, default=20, help="prompt tokens changed at its end")
    resend.add_argument("--resend-reps", type=int, default=3)
    p.add_argument("--restart-reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="compute threads per slot, in all for each server's steps")
    p.add_argument("--cpus", help="the cores every server is confined to, e.g. 0,1 (default: all available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=BENCH_DIR / "out" / "prompt-cache", help="output directory")
    p.add_argument("--results-md", action="store_true", help="also write this run's section of bench/RESULTS.md")
    p.add_argument("--render", action="store_true", help="no measurement: the report again from --out's results.json")
    args = p.parse_args(argv)
    args.engines, args.parts = args.engines.split(","), args.parts.split(",")
    if set(args.engines) - set(TARGETS) or set(args.parts) - set(PARTS):
        p.error(f"--engines takes any of {','.join(TARGETS)}; --parts any of {','.join(PARTS)}")
    if LLAMA_SERVER in args.engines and not (args.render or args.llama_server or args.build_llama_server):
        p.error("the llama-server engine needs --llama-server PATH or --build-llama-server")
    args.cpu_set = frozenset(int(c) for c in args.cpus.split(",")) if args.cpus else frozenset(os.sched_getaffinity(0))
    return args


def context_length(args) -> int:
    """The context per slot: the longest conversation or the resent prompt, in whole 512s."""
    chat = args.system_tokens + args.turns * (args.user_tokens + args.answer_tokens + 2 * TEMPLATE_TOKENS)
    longest = max(chat, args.resend_tokens + TEMPLATE_TOKENS) + args.answer_tokens
    return -(-longest // 512) * 512


def start_order(drivers: list[Driver], k: int) -> list[Driver]:
    return drivers if k % 2 == 0 else drivers[::-1]


async def ask(lane: Lane, messages: list[dict], max_tokens: int, seed: int) -> dict:
    """One request, to its end: its TTFT as the client saw it, and what the server says it took from a cache."""
    stream = await lane.generate(Request(messages, max_tokens, seed, cache_prompt=True))
    end = await stream.wait_end()
    if end is None or end.outcome != Outcome.DONE:
        raise RuntimeError(f"a request ended {end}")
    # A one-token answer may come as its end alone (an end of sequence, or held-back bytes): then the end is its time.
    ttft = first_token_ms(stream) or (end.stop_ns - stream.sent_ns) / 1e6
    row = {"ttft_ms": ttft, "ttft_server_ms": end.ttft_server_ms}
    return row | {"prompt_tokens": end.prompt_tokens, "cached_tokens": end.prompt_tokens_reused, "text": stream.text}


class PromptCacheBench:
    def __init__(self, args, prompts: PromptMaker):
        self.args, self.prompts, self.rng = args, prompts, prompts.rng
        self.rows: list[dict] = []

    def system(self) -> dict:
        return {"role": "system", "content": self.prompts.story(self.args.system_tokens)[0]["content"]}

    def user(self) -> dict:
        return self.prompts.story(self.args.user_tokens)[0]

    def seed(self) -> int:
        return self.rng.randrange(2**31)

    async def agent(self, drivers: list[Driver]) -> None:
        """The conversations, C at a time, every server taking each batch in turn."""
        a = self.args
        system = self.system()
        chats = [([self.user() for _ in range(a.turns)], self.seed()) for _ in range(a.conversations)]
        for k, first in enumerate(range(0, a.conversations, a.concurrency)):
            batch = range(first, min(first + a.concurrency, a.conversations))
            for driver in start_order(drivers, k):
                pause_all_but(drivers, driver)
                await driver.wait_idle()
                await asyncio.gather(*(self.conversation(driver, i - first, i, system, *chats[i]) for i in batch))

    async def conversation(self, driver: Driver, lane_index: int, index: int, system: dict, users, seed) -> None:
        messages = [system]
        async with await driver.lane(lane_index, ANY_SLOT) as lane:
            for turn, user in enumerate(users, 1):
                messages.append(user)
                row = await ask(lane, list(messages), self.args.answer_tokens, seed + turn)
                messages.append({"role": "assistant", "content": row.pop("text")})
                self.rows.append({"part": "agent", "target": driver.name, "conversation": index, "turn": turn} | row)

    async def resend(self, drivers: list[Driver]) -> None:
        """Per rep and server: a cold prompt to place the stop, the stopped prompt, its edit, a cold reference."""
        a = self.args
        for rep in range(a.resend_reps):
            cold, original = self.prompts.story(a.resend_tokens), self.prompts.story(a.resend_tokens)
            edited = self.prompts.edit_tail(original, a.edit_tokens)
            for driver in start_order(drivers, rep):
                pause_all_but(drivers, driver)
                await driver.wait_idle()
                async with await driver.lane() as lane:
                    reference = await ask(lane, cold, 1, self.seed())
                    stream = await lane.generate(Request(original, 16, self.seed(), cache_prompt=True))
                    await asyncio.sleep(a.cancel_at * reference["ttft_ms"] / 1000)
                    in_prompt = not stream.tokens and not stream.ended
                    await stream.cancel()
                    await stream.stopped()
                    resent = await ask(lane, edited, 1, self.seed())
                    new = resent["prompt_tokens"] - resent["cached_tokens"]
                    fresh = await ask(lane, self.prompts.story(new), 1, self.seed())
                row = {"part": "resend", "target": driver.name, "rep": rep, "stopped_in_prompt": in_prompt}
                row |= {k: resent[k] for k in ("ttft_ms", "ttft_server_ms", "prompt_tokens", "cached_tokens")}
                row |= {"new_tokens": new, "cold_ttft_ms": reference["ttft_ms"]}
                row["cold_tokens"] = reference["prompt_tokens"]
                # The new tokens at the whole cold prompt's rate: they sit at its end, where each costs the most.
                row["at_cold_rate_ms"] = reference["ttft_ms"] * new / reference["prompt_tokens"]
                row |= {"new_cold_ttft_ms": fresh["ttft_ms"], "new_cold_tokens": fresh["prompt_tokens"]}
                self.rows.append(row)

    async def restart(self, drivers: list[Driver], ours: ServedStopline) -> None:
        a = self.args
        pause_all_but(drivers, ours)
        for rep in range(a.restart_reps):
            system, users, seed = self.system(), [self.user(), self.user()], self.seed()
            async with await ours.lane() as lane:
                first = await ask(lane, [system, users[0]], a.answer_tokens, seed)
            await ours.stop(signal.SIGTERM)
            await ours.start()
            turn = [users[0], {"role": "assistant", "content": first["text"]}, users[1]]
            async with await ours.lane() as lane:
                await ask(lane, [self.user()], 1, seed)
                after = await ask(lane, [system, *turn], 1, seed)
                cold = await ask(lane, [self.system(), *turn], 1, seed)
            row = {"part": "restart", "target": ours.name, "rep": rep, "cold_ttft_ms": cold["ttft_ms"]}
            row |= {"cold_tokens": cold["prompt_tokens"]} | {k: v for k, v in after.items() if k != "text"}
            self.rows.append(row)


def threads_in_all(args) -> int:
    """Each server's compute threads: Stopline's slots share each step, and the step takes them all,
    as llama-server's batch does. Never more than the cores both are confined to: ggml's threads
    wait for each other at every node, spinning."""
    return min(args.concurrency * args.threads, len(args.cpu_set))


def start_drivers(args, prompts: PromptMaker, out: Path) -> list[Driver]:
    gguf, context = MODELS[args.model].gguf(), context_length(args)
    threads = threads_in_all(args)
    drivers: list[Driver] = []
    for name in args.engines:
        if name == LLAMA_SERVER:
            binary = Path(args.llama_server) if args.llama_server else ensure_llama_server()
            tokenize = lambda messages: prompts.tokenizer.encode(prompts.tokenizer.render_chat(messages))  # noqa: E731
            drivers.append(
                LlamaServerDriver(
                    binary, gguf, out, args.concurrency, threads, context, tokenize, args.cpu_set, cache_ram=True
                )
            )
            continue
        cache_dir = out / f"cache-{name}"
        shutil.rmtree(cache_dir, ignore_errors=True)  # every run starts cold
        cache = ("--prompt-cache-dir", str(cache_dir)) if name == OURS else ("--no-prompt-cache",)
        extra = ("--context", str(context), *cache)
        drivers.append(
            ServedStopline("ours_llama_shared", out, args.concurrency, threads, name, extra, gguf, args.cpu_set)
        )
    return drivers


def argv_tail() -> list[str]:
    """This command's arguments, however it was started (python -m bench prompt-cache, or the module itself)."""
    return sys.argv[2 if sys.argv[1:2] == ["prompt-cache"] else 1 :]


async def run(args) -> dict:
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = prompt_maker(args, random.Random(args.seed))
    drivers = start_drivers(args, prompts, args.out)
    meta = {
        "command": "python -m bench prompt-cache " + shlex.join(argv_tail()),
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "model": MODELS[args.model].title,
        "model_choice": args.model,
        "context_per_slot": context_length(args),
        "load_average_start": load_average(),
        "sizes": {k: getattr(args, k) for k in ("conversations", "turns", "system_tokens", "user_tokens")}
        | {k: getattr(args, k) for k in ("answer_tokens", "concurrency", "resend_tokens", "cancel_at", "edit_tokens")}
        | {"threads": threads_in_all(args)},
    }
    bench = PromptCacheBench(args, prompts)
    print(f"starting {', '.join(d.name for d in drivers)} ...", file=sys.stderr)
    await asyncio.gather(*(d.start() for d in drivers))
    meta["servers"] = {d.name: d.info.get("command") or list(getattr(d, "args", ())) for d in drivers}
    try:
        for part in args.parts:
            print(f"{part} ...", file=sys.stderr)
            if part == "restart":
                if ours := next((d for d in drivers if d.name == OURS), None):
                    await bench.restart(drivers, ours)  # type: ignore[arg-type]
            else:
                await getattr(bench, part)(drivers)
    finally:
        pause_all_but(drivers, None)
        await asyncio.gather(*(d.stop() for d in drivers))
        meta["load_average_end"] = load_average()
        # What was measured before a failure is kept: --render reports it.
        write_json({"meta": meta, "rows": bench.rows}, args.out / "results.json")
    return {"meta": meta, "rows": bench.rows}


# The report -----------------------------------------------------------------------------


def ratio(ours: float | None, base: float | None) -> str:
    return f"{ours / base:.2f}×" if ours is not None and base else "–"


def agent_table(rows: list[dict]) -> str | None:
    lines, p50 = [], {}
    for target in TARGETS:
        own = [r for r in rows if r["part"] == "agent" and r["target"] == target]
        if not own:
            continue
        p50[target], p99 = stat([r["ttft_ms"] for r in own], "p50", "p99")
        first, later = (stat([r["ttft_ms"] for r in own if (r["turn"] == 1) == f], "p50")[0] for f in (True, False))
        cached = sum(r["cached_tokens"] or 0 for r in own) / max(1, sum(r["prompt_tokens"] or 0 for r in own))
        tokens = stat([r["prompt_tokens"] for r in own], "p50")[0]
        row = [target, str(len(own)), fmt(tokens), fmt(p50[target]), fmt(p99), fmt(first), fmt(later)]
        lines.append(row + [f"{cached:.0%}"])
    return table(
        "server|turns|prompt tokens p50|TTFT p50 (ms)|TTFT p99 (ms)|turn 1 p50 (ms)|turns 2+ p50 (ms)|"
        "prompt tokens from a cache",
        lines,
    )


def agent_targets(rows: list[dict]) -> list[str]:
    def figure(target: str, key: str) -> float | None:
        return stat([r["ttft_ms"] for r in rows if r["part"] == "agent" and r["target"] == target], key)[0]

    lines = []
    for key in ("p50", "p99"):
        ours, peer = figure(OURS, key), figure(LLAMA_SERVER, key)
        if ours is not None and peer is not None:
            lines.append(f"- TTFT {key} ≤ llama-server's: {fmt(ours)} ms against {fmt(peer)} ms, {ratio(ours, peer)}")
    ours, off = figure(OURS, "p50"), figure(NO_CACHE, "p50")
    if ours is not None and off is not None:
        lines.append(f"- TTFT p50 ≤ 0.2× Stopline's with `--no-prompt-cache`: {ratio(ours, off)}")
    return lines


def resend_table(rows: list[dict]) -> str | None:
    lines = []
    for r in sorted((r for r in rows if r["part"] == "resend"), key=lambda r: (TARGETS.index(r["target"]), r["rep"])):
        line = [r["target"], str(r["rep"] + 1), fmt(r["cold_ttft_ms"]), "yes" if r["stopped_in_prompt"] else "no"]
        line += [str(r["prompt_tokens"]), str(r["cached_tokens"]), str(r["new_tokens"]), fmt(r["ttft_ms"])]
        line += [f"{fmt(r['new_cold_ttft_ms'])} ({ratio(r['ttft_ms'], r['new_cold_ttft_ms'])})"]
        lines.append(line + [f"{fmt(r['at_cold_rate_ms'])} ({ratio(r['ttft_ms'], r['at_cold_rate_ms'])})"])
    return table(
        "server|rep|cold TTFT of the whole prompt (ms)|stopped in its prompt|resent prompt tokens|from a cache|new|"
        "resend TTFT (ms)|a cold prompt of the new tokens' TTFT (ms, resend's ratio)|"
        "the new tokens at the cold rate (ms, ratio)",
        lines,
    )


def restart_table(rows: list[dict]) -> str | None:
    lines = [
        [str(r["rep"] + 1), str(r["prompt_tokens"]), str(r["cached_tokens"]), fmt(r["ttft_ms"])]
        + [fmt(r["cold_ttft_ms"]), ratio(r["ttft_ms"], r["cold_ttft_ms"])]
        for r in rows
        if r["part"] == "restart"
    ]
    return table(
        "rep|prompt tokens|from the cache|TTFT after the restart (ms)|TTFT cold (ms)|after the restart / cold", lines
    )


def section(results: dict) -> str:
    meta, rows = results["meta"], results["rows"]
    s, m = meta["sizes"], meta["machine"]
    threads = f", {s['threads']} compute threads in all for each server" if "threads" in s else ""
    loads = "/".join(f"{x:.1f}" for x in (meta["load_average_start"][0], meta["load_average_end"][0]))
    parts = [
        f"## The prompt cache across requests: {meta['model']}\n",
        f"`{meta['command']}`\n",
        f"{m.get('cpu', 'CPU')}, {m.get('cores_available', '?')} cores available, 1-minute load average "
        f"{loads} at the start/end; {s['concurrency']} slots per server, {meta['context_per_slot']} tokens of "
        f"context each{threads}. Stopline on the llama.cpp engine with its defaults (`ours_llama`) and with "
        "`--no-prompt-cache`; llama-server with its defaults (its `--cache-ram` on, each request on the slot it "
        "picks). TTFT is the client's, from sending to the first token.\n",
    ]
    if agent := agent_table(rows):
        parts += [
            f"### Agent-like conversations\n\n{s['conversations']} conversations × {s['turns']} turns, "
            f"{s['concurrency']} at a time: a shared {s['system_tokens']}-token system prompt, each turn adding the "
            f"previous answer (at most {s['answer_tokens']} tokens) and a new {s['user_tokens']}-token user message. "
            "The servers take each batch of conversations in turn.\n",
            agent + "\n",
            "\n".join(agent_targets(rows)) + "\n",
        ]
    if resend := resend_table(rows):
        parts += [
            f"### Stop, edit, resend\n\nA {s['resend_tokens']}-token prompt stopped at {s['cancel_at']:.0%} of its "
            f"cold TTFT, then sent again with its last {s['edit_tokens']} tokens changed (llama-server's requests on "
            "one slot, whose release line says when the stop took effect); the target: the resend's TTFT at most "
            '1.1× the time to evaluate its new tokens. "From a cache" is what the server kept of the stopped '
            "prompt, with whatever it evaluated after the stop: llama-server sees a closed connection only at its "
            "next check of the client.\n",
            resend + "\n",
        ]
    if restart := restart_table(rows):
        parts += [
            "### Restart\n\nA conversation's first turn, the server stopped (SIGTERM) and started again on the same "
            "`--prompt-cache-dir`, a short unrelated request, then the second turn; cold: the same turn under another "
            "system prompt. The target: at most 0.3× cold.\n",
            restart + "\n",
        ]
    return "\n".join(parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.render:
        results = json.loads((args.out / "results.json").read_text())
    else:
        results = asyncio.run(run(args))
    text = section(results)
    (args.out / "report.md").write_text(text)
    print(text)
    if args.results_md:
        write_results_section(BENCH_DIR / "RESULTS.md", f"prompt-cache-{results['meta']['model_choice']}", text)
    return 0
