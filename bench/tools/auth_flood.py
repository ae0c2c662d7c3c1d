"""python -m bench auth-flood: what a flood of wrong API keys costs a client that has a good one.

Starts ``python -m stopline`` with a keys file (one slot, one compute thread),
then streams long generations over a WebSocket with a good key and records the
gap between consecutive token frames as the client sees them, while another
process sends 10,000 requests with wrong keys to ``/v1/chat/completions``
(keep-alive, several connections in parallel), each answered 401. The flood
comes in bursts, each followed by a pause as long as itself, so that the gaps
during bursts and between them are taken over the same stretch of time, under
the same other work. It prints p50/p99 of both, the flood's rate, and the
machine's load average, which the figures depend on (the flood, the server and
this client share the machine's cores).

    python -m bench auth-flood [--requests 10000] [--connections 8] [--bursts 10] [--out bench/out]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import aiohttp

from stopline.auth import Quota, add_key
from stopline.engine.model import EMBEDDED_MODEL_NAME

from ..drivers.base import Request
from ..drivers.stopline import StoplineDriver
from ..launch import ServerProcess, module_command
from ..machine import CpuMeter

LONG_ANSWER = [{"role": "user", "content": "Write a very long story about a dragon who learns to bake bread."}]
WRONG_KEY = "stopline_wrong-key-for-the-flood-0123456789"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def token_gaps(ws_url: str, key: str, until: asyncio.Event | None, rounds: int) -> list[tuple[float, float]]:
    """(when, gap ms) between token frames of long generations: ``rounds`` of them, or until ``until`` is set.
    ``when`` is CLOCK_MONOTONIC, which every process on the machine shares."""
    gaps: list[tuple[float, float]] = []
    async with await StoplineDriver("stopline", ws_url=ws_url, key=key).lane() as lane:
        done = 0
        while (until is None and done < rounds) or (until is not None and not until.is_set()):
            stream = await lane.generate(Request(LONG_ANSWER, 300, seed=done))
            await stream.wait_end()
            # The first gap is the time to first token, not a gap between tokens.
            times = [ns / 1e9 for ns, _ in stream.tokens]
            gaps += [(now, (now - last) * 1000) for last, now in zip(times, times[1:])]
            done += 1
    return gaps


async def flood(api: str, requests: int, connections: int, bursts: int) -> dict:
    """Send ``requests`` chat completions with a wrong key in ``bursts`` bursts, each followed by a pause
    as long as itself; report when each burst ran and the answers by status."""
    statuses: dict[int, int] = {}
    body = {"model": EMBEDDED_MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    headers = {"Authorization": f"Bearer {WRONG_KEY}"}
    windows = []

    async def worker(session: aiohttp.ClientSession, left: list[int]) -> None:
        while left[0] > 0:
            left[0] -= 1
            async with session.post(f"{api}/chat/completions", json=body, headers=headers) as response:
                await response.read()
                statuses[response.status] = statuses.get(response.status, 0) + 1

    connector = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=connector) as session:
        for burst in range(bursts):
            left = [requests // bursts + (burst < requests % bursts)]
            started = time.monotonic()
            await asyncio.gather(*(worker(session, left) for _ in range(connections)))
            windows.append((started, time.monotonic()))
            await asyncio.sleep(windows[-1][1] - started)
    flooding = sum(end - start for start, end in windows)
    return {"statuses": statuses, "windows": windows, "per_second": round(requests / flooding)}


def run_flood(api: str, requests: int, connections: int, bursts: int) -> None:
    """The flood in a process of its own (``--flood``), so that it does not share this client's event loop."""
    print(json.dumps(asyncio.run(flood(api, requests, connections, bursts))))


def summary(gaps: list[float]) -> dict:
    return {"n": len(gaps), "p50": round(percentile(gaps, 0.5), 2), "p99": round(percentile(gaps, 0.99), 2)}


async def measure(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        keys_file = Path(directory) / "keys.jsonl"
        key, _ = add_key(keys_file, "bench", Quota())
        flags = ("--workers", "1", "--threads", "1", "--api-keys-file", str(keys_file))
        server = await ServerProcess("--port", "0", "--http-port", "0", *flags).started()
        ws_url, api = server.ws_url, server.api_url
        meter = CpuMeter([server.pid, os.getpid()])
        try:
            await token_gaps(ws_url, key, None, 1)  # warm up
            load_before = os.getloadavg()
            flooding = asyncio.Event()
            cpu_before = meter.read()
            victim = asyncio.create_task(token_gaps(ws_url, key, flooding, 0))
            flooder = await asyncio.create_subprocess_exec(
                *module_command("bench", "auth-flood"),
                "--flood",
                api,
                "--requests",
                str(args.requests),
                "--connections",
                str(args.connections),
                "--bursts",
                str(args.bursts),
                stdout=asyncio.subprocess.PIPE,
            )
            out, _ = await flooder.communicate()
            flooding.set()
            gaps = await victim
            cpu = meter.usage_since(cpu_before)
            load_after = os.getloadavg()
        finally:
            await server.stopped()
    flood_result = json.loads(out)
    windows = flood_result.pop("windows")
    # Each gap ends at ``when``: it belongs to a burst if it ended inside one. Gaps before the first
    # burst and after the last pause are left out, so that both sides share the same stretch of time.
    first, last = windows[0][0], windows[-1][1] + (windows[-1][1] - windows[-1][0])
    during = [gap for when, gap in gaps if any(start <= when <= end for start, end in windows)]
    between = [gap for when, gap in gaps if first <= when <= last and not any(s <= when <= e for s, e in windows)]
    result = {
        "requests": args.requests,
        "connections": args.connections,
        "bursts": args.bursts,
        "flood": flood_result,
        "gaps_ms": {"between_bursts": summary(between), "during_bursts": summary(during)},
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "cpu": cpu,
    }
    result["p99_increase_pct"] = round(100 * (summary(during)["p99"] / summary(between)["p99"] - 1), 1)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench auth-flood", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=10_000, help="requests with wrong keys")
    p.add_argument("--connections", type=int, default=8, help="keep-alive connections of the flood")
    p.add_argument("--bursts", type=int, default=10, help="the flood comes in this many bursts, each then paused")
    p.add_argument("--out", type=Path, default=None, help="write auth_flood.json here")
    p.add_argument("--flood", metavar="API", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.flood:
        run_flood(args.flood, args.requests, args.connections, args.bursts)
        return 0
    result = asyncio.run(measure(args))
    alone, flooded = result["gaps_ms"]["between_bursts"], result["gaps_ms"]["during_bursts"]
    print(
        f"token gaps between bursts: p50 {alone['p50']:.1f} ms, p99 {alone['p99']:.1f} ms ({alone['n']} gaps)\n"
        f"during bursts of {result['requests']} wrong-key requests ({result['flood']['per_second']}/s, "
        f"answers {result['flood']['statuses']}): p50 {flooded['p50']:.1f} ms, p99 {flooded['p99']:.1f} ms "
        f"({flooded['n']} gaps): p99 {result['p99_increase_pct']:+.1f}%\n"
        f"load average before {result['load_average_before']}, after {result['load_average_after']}"
    )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "auth_flood.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0
