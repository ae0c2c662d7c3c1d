"""python -m bench faults: what faults and long runs leave behind.

``churn`` starts ``python -m stopline`` with its defaults and sends short requests (one token
each) over connections that stay open: OpenAI chat completions over HTTP keep-alive, then
WebSocket generations, four at a time either way. The server's resident memory (VmRSS) is read
every 1,000 requests; what counts is its growth from request 4,000 to the last, after the
warm-up has filled every bounded structure.

``kill`` starts redis-server and two replicas sharing it, starts generations on a third, kills
that one with SIGKILL, and times how long a DELETE through a survivor takes to answer, and how
long until every one of the dead replica's generations reads a terminal status in Redis, with
one cancellation-log record each. It does this ``--rounds`` times.

    python -m bench faults churn [--requests 20000] [--warmup 2000] [--server-args '--no-prompt-cache']
    python -m bench faults kill [--rounds 5] [--generations 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import redis.asyncio as aioredis

from stopline.cluster import CANCELLATIONS, ENDED_STATUSES, StoreEvent, generation_key

from ..launch import ServerProcess
from ..report import write_results_section
from ..servers import RedisServer

AT_ONCE = 4
SAMPLE_EVERY = 1000
CHAT = {"model": "x", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
LONG_ANSWER = [{"role": "user", "content": "Write a very long story about a dragon who learns to bake bread."}]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def http_churn(api_url: str, count: int, on_request) -> None:
    connector = aiohttp.TCPConnector(limit=AT_ONCE)
    async with aiohttp.ClientSession(connector=connector) as session:
        pending = iter(range(count))

        async def lane() -> None:
            for _ in pending:
                async with session.post(f"{api_url}/chat/completions", json=CHAT) as response:
                    await response.read()
                    if response.status != 200:
                        raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
                on_request()

        await asyncio.gather(*(lane() for _ in range(AT_ONCE)))


async def websocket_churn(ws_url: str, count: int, on_request) -> None:
    async with aiohttp.ClientSession() as session:
        pending = iter(range(count))

        async def lane(number: int) -> None:
            async with session.ws_connect(ws_url) as ws:
                for n in pending:
                    request_id = f"c{number}-{n}"
                    generate = {"type": "generate", "id": request_id, "prompt": "Hi", "max_tokens": 1}
                    await ws.send_str(json.dumps(generate))
                    while True:
                        frame = json.loads((await ws.receive()).data)
                        if frame.get("id") == request_id and frame["type"] not in ("accepted", "token"):
                            if frame["type"] != "done":
                                raise RuntimeError(f"not done: {frame}")
                            break
                    on_request()

        await asyncio.gather(*(lane(n) for n in range(AT_ONCE)))


async def churn(args) -> dict:
    total = args.warmup + args.requests
    results = {}
    for name, run in (("http_keep_alive", http_churn), ("websocket", websocket_churn)):
        server = await ServerProcess("--port", "0", "--http-port", "0", *shlex.split(args.server_args)).started()
        samples: list[tuple[int, float]] = []
        done = 0
        started = time.monotonic()

        def on_request() -> None:
            nonlocal done
            done += 1
            if done % SAMPLE_EVERY == 0:
                samples.append((done, round(rss_mib(server.pid), 2)))
                print(f"{name}: {done}/{total} requests, RSS {samples[-1][1]} MiB", file=sys.stderr)

        try:
            await run(server.api_url if name == "http_keep_alive" else server.ws_url, total, on_request)
        finally:
            await server.stopped()
        # Twice the warm-up: by then every bounded structure has long been full.
        growth_from = 2 * args.warmup
        first = dict(samples)[growth_from]
        results[name] = {
            "requests": total,
            "seconds": round(time.monotonic() - started, 1),
            "rss_mib": samples,
            "growth_mib": round(samples[-1][1] - first, 2),
            "growth_from_request": growth_from,
        }
    return results


async def kill_round(redis_server: RedisServer, directory: Path, generations: int) -> dict:
    def replica(name: str, *extra: str) -> ServerProcess:
        return ServerProcess(
            *("--port", "0", "--http-port", "0", "--workers", str(generations), "--threads", "1"),
            *("--redis-url", redis_server.url, "--replica-id", name, *extra),
            stderr_path=directory / f"{name}.stderr",
        )

    survivors = [replica(name) for name in ("a", "b")]
    doomed = replica("doomed")
    store = aioredis.from_url(redis_server.url, decode_responses=True)
    try:
        for server in (*survivors, doomed):
            await server.started()
            await asyncio.to_thread(server.wait_event, StoreEvent.UP, 60)
        async with aiohttp.ClientSession() as http, http.ws_connect(doomed.ws_url) as ws:
            accepted = []
            for n in range(generations):
                generate = {"type": "generate", "id": f"g{n}", "messages": LONG_ANSWER, "max_tokens": 1500}
                await ws.send_str(json.dumps(generate))
            while len(accepted) < generations:
                frame = json.loads((await ws.receive()).data)
                if frame["type"] == "accepted":
                    accepted.append(frame)
            ids = [frame["request_id"] for frame in accepted]
            # Every generation has reached the store.
            while not all([await store.exists(generation_key(i)) for i in ids]):
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.5)
            doomed.kill()
            killed = time.monotonic()
            first = accepted[0]
            url = f"{survivors[0].api_url}/generations/{first['request_id']}"
            async with http.delete(url, headers={"Authorization": f"Bearer {first['cancel_token']}"}) as response:
                answer = {"http_status": response.status, **await response.json()}
            delete_s = time.monotonic() - killed
            while True:
                statuses = [await store.hget(generation_key(i), "status") for i in ids]
                if all(status in ENDED_STATUSES for status in statuses):
                    break
                await asyncio.sleep(0.005)
            ended_s = time.monotonic() - killed
            records = [fields["request_id"] for _, fields in await store.xrange(CANCELLATIONS)]
        return {
            "delete_s": round(delete_s, 3),
            "delete_answer": answer.get("status") or answer,
            "all_ended_s": round(ended_s, 3),
            "statuses": sorted(set(statuses)),
            "log_records_per_id": sorted({records.count(i) for i in ids}),
        }
    finally:
        await store.aclose()
        for server in (*survivors, doomed):
            await server.stopped(signal.SIGTERM)


async def kill(args) -> dict:
    rounds = []
    with tempfile.TemporaryDirectory(prefix="stopline-faults-") as directory:
        for n in range(args.rounds):
            redis_server = RedisServer(Path(directory) / f"redis-{n}").start()
            try:
                rounds.append(await kill_round(redis_server, Path(directory), args.generations))
            finally:
                redis_server.kill()
            print(f"round {n + 1}/{args.rounds}: {rounds[-1]}", file=sys.stderr)
    return {
        "rounds": rounds,
        "delete_s_median": statistics.median(r["delete_s"] for r in rounds),
        "delete_s_max": max(r["delete_s"] for r in rounds),
        "all_ended_s_median": statistics.median(r["all_ended_s"] for r in rounds),
        "all_ended_s_max": max(r["all_ended_s"] for r in rounds),
    }


def churn_section(result: dict, command: str) -> str:
    rows = [
        f"| {name} | {r['requests']:,} | {dict(r['rss_mib'])[r['growth_from_request']]:.1f} | "
        f"{r['rss_mib'][-1][1]:.1f} | {r['growth_mib']:+.2f} |"
        for name, r in result.items()
    ]
    first = next(iter(result.values()))["growth_from_request"]
    return "\n".join(
        [
            "## Memory under keep-alive churn",
            "",
            f"`{command}`: the server's defaults, one-token requests, four at a time on connections that stay open.",
            "",
            f"| connections | requests | RSS at request {first:,} (MiB) | RSS at the last (MiB) | growth (MiB) |",
            "|---|---:|---:|---:|---:|",
            *rows,
            "",
        ]
    )


def kill_section(result: dict, command: str) -> str:
    rows = [
        f"| {n + 1} | {r['delete_s'] * 1000:.0f} | {r['delete_answer']} | {r['all_ended_s'] * 1000:.0f} | "
        f"{', '.join(r['statuses'])} | {', '.join(map(str, r['log_records_per_id']))} |"
        for n, r in enumerate(result["rounds"])
    ]
    return "\n".join(
        [
            "## A replica killed with generations running",
            "",
            f"`{command}`: redis-server and two replicas on the loopback, a third killed (SIGKILL) while it runs"
            " its generations; times from the kill.",
            "",
            "| round | DELETE through a survivor answered (ms) | its answer | every generation ended in Redis (ms) |"
            " statuses | cancellation-log records per id |",
            "|---:|---:|---|---:|---|---|",
            *rows,
            "",
        ]
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench faults", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    churn_parser = commands.add_parser("churn", help="memory under keep-alive churn")
    churn_parser.add_argument("--requests", type=int, default=20_000)
    churn_parser.add_argument("--warmup", type=int, default=2_000)
    churn_parser.add_argument("--server-args", default="", help="flags for the server, e.g. '--no-prompt-cache'")
    kill_parser = commands.add_parser("kill", help="a replica killed with generations running")
    kill_parser.add_argument("--rounds", type=int, default=5)
    kill_parser.add_argument("--generations", type=int, default=3)
    for sub in (churn_parser, kill_parser):
        sub.add_argument("--out", type=Path, default=Path("bench/out"))
        sub.add_argument("--results-md", action="store_true", help="also write the run's section of bench/RESULTS.md")
    args = parser.parse_args(argv)
    result = asyncio.run(churn(args) if args.command == "churn" else kill(args))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"faults-{args.command}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"written to {path}", file=sys.stderr)
    if args.results_md:
        command = " ".join(["python -m bench faults", *argv])
        section = (churn_section if args.command == "churn" else kill_section)(result, command)
        write_results_section(Path(__file__).resolve().parents[1] / "RESULTS.md", f"faults-{args.command}", section)
    return 0
