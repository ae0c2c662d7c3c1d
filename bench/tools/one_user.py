"""python -m bench one-user: what the default configuration gives one user, and two.

Starts ``python -m stopline`` three times on the embedded model: with its defaults, with
``--workers 1`` and with ``--threads 1``. In every round, each server in turn (the order rotates
from round to round, so that drift on the shared machine favours none) streams one greedy
generation alone, then two at once on two connections, and the client times every token frame.
A stream's decode speed is its tokens after the first over the time from its first token to
its last; a user's wait is the time from sending ``generate`` to the first token; and what two
users get in all is their tokens over the time from the first request to the last token. The machine's
load average is recorded around every round, since every figure depends on it.

    python -m bench one-user [--rounds 5] [--max-tokens 200] [--out bench/out]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from pathlib import Path

from ..drivers.base import Request
from ..drivers.stopline import StoplineDriver
from ..launch import ServerProcess

CONFIGURATIONS = {"default": (), "--workers 1": ("--workers", "1"), "--threads 1": ("--threads", "1")}
STORY = [{"role": "user", "content": "Write a very long story about a dragon who learns to bake bread."}]


async def stream(ws_url: str, max_tokens: int) -> dict:
    """One greedy generation on a connection of its own: its wait for the first token and its decode speed."""
    async with await StoplineDriver("stopline", ws_url=ws_url).lane() as lane:
        call = await lane.generate(Request(STORY, max_tokens, seed=0, temperature=0))
        await call.wait_end()
    sent, times = call.sent_ns / 1e9, [ns / 1e9 for ns, _ in call.tokens]
    decode_s = times[-1] - times[0] if len(times) > 1 else float("nan")
    wait_ms = (times[0] - sent) * 1000
    return {
        "sent": sent,
        "last": times[-1],
        "wait_ms": wait_ms,
        "tokens": len(times),
        "tokens_per_s": (len(times) - 1) / decode_s,
    }


async def measure(rounds: int, max_tokens: int) -> dict:
    servers = {
        name: await ServerProcess("--port", "0", "--http-port", "0", *flags).started()
        for name, flags in CONFIGURATIONS.items()
    }
    results: dict[str, dict[str, list]] = {name: {"alone": [], "together": []} for name in servers}
    loads = []
    try:
        for server in servers.values():
            await stream(server.ws_url, 16)  # warm up
        names = list(servers)
        for round_ in range(rounds):
            before = os.getloadavg()[0]
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                ws_url = servers[name].ws_url
                results[name]["alone"].append(await stream(ws_url, max_tokens))
                first = asyncio.create_task(stream(ws_url, max_tokens))
                await asyncio.sleep(0.05)  # the first user is the first to be served
                results[name]["together"].append(await asyncio.gather(first, stream(ws_url, max_tokens)))
            loads.append((round(before, 2), round(os.getloadavg()[0], 2)))
            print(f"round {round_ + 1}/{rounds}: load average {loads[-1][0]} → {loads[-1][1]}", file=sys.stderr)
    finally:
        for server in servers.values():
            await server.stopped()
    return {"rounds": rounds, "max_tokens": max_tokens, "load_average": loads, "results": results}


def served_per_s(pair: list[dict]) -> float:
    """Both users' tokens over the time from the first request to the last token: what the server
    delivered to the two, whether it served them together or one after the other."""
    return sum(r["tokens"] for r in pair) / (max(r["last"] for r in pair) - min(r["sent"] for r in pair))


def summary(result: dict) -> dict[str, dict[str, float]]:
    """Medians over the rounds, per configuration."""
    table = {}
    for name, runs in result["results"].items():
        pairs = runs["together"]
        table[name] = {
            "alone_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs["alone"]),
            "together_tokens_per_s_each": statistics.median(r["tokens_per_s"] for pair in pairs for r in pair),
            "together_tokens_per_s_total": statistics.median(served_per_s(pair) for pair in pairs),
            "second_user_wait_ms": statistics.median(pair[1]["wait_ms"] for pair in pairs),
        }
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench one-user", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5, help="rounds; each measures every configuration once")
    p.add_argument("--max-tokens", type=int, default=200, help="tokens per generation")
    p.add_argument("--out", type=Path, default=None, help="write one_user.json here")
    args = p.parse_args(argv)
    result = asyncio.run(measure(args.rounds, args.max_tokens))
    result["summary"] = table = summary(result)
    default = table["default"]["alone_tokens_per_s"]
    print("| configuration | one user, tokens/s | two users, tokens/s each | two users, in all | 2nd user's wait, ms |")
    print("|---|---|---|---|---|")
    for name, row in table.items():
        print(
            f"| {name} | {row['alone_tokens_per_s']:.1f} | {row['together_tokens_per_s_each']:.1f} | "
            f"{row['together_tokens_per_s_total']:.1f} | {row['second_user_wait_ms']:.0f} |"
        )
    print(
        "one user: default ÷ --workers 1 = "
        f"{default / table['--workers 1']['alone_tokens_per_s']:.2f}, "
        f"default ÷ --threads 1 = {default / table['--threads 1']['alone_tokens_per_s']:.2f}; "
        f"load average per round {result['load_average']}"
    )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "one_user.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0
