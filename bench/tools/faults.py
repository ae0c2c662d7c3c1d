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

``cache-churn`` starts ``python -m stopline`` with a prompt cache of ``--cache-ram`` MiB in memory
and ``--disk-mib`` MiB on disk (a temporary folder), and for ``--minutes`` sends one-token chat
completions, two at a time, each one of a few shared system prompts or none, then 100 to 1,500
tokens of fresh text: the shared prefixes hit the cache, the fresh text keeps it saving and
evicting. Every 15 seconds it reads the server's RSS, the disk tier's files and the cache's
/metrics. Its targets: the RSS stays within the server's own footprint and the memory budget
plus 5%, and the files on disk within their budget. The footprint is the RSS less what the cache
holds, read after ``--warmup-minutes`` of the same churn: by then every KV cell of the two slots
has been written (llama.cpp allocates the cache whole, and its pages count once touched), and
the allocator has its working set.

    python -m bench faults churn [--requests 20000] [--warmup 2000] [--server-args '--no-prompt-cache']
    python -m bench faults kill [--rounds 5] [--generations 3]
    python -m bench faults cache-churn [--minutes 30] [--cache-ram 64] [--disk-mib 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
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
from stopline.engine import model as embedded

from ..drivers.stopline import parse_metrics
from ..launch import ServerProcess
from ..prompts import PromptMaker
from ..report import write_results_section
from ..servers import RedisServer

AT_ONCE = 4
SAMPLE_EVERY = 1000
CHAT = {"model": "x", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
LONG_ANSWER = [{"role": "user", "content": "Write a very long story about a dragon who learns to bake bread."}]
# cache-churn: two requests at once, one for each core of the machine it was written for, on as
# many slots of a context short enough that the warm-up writes every cell of their KV cache.
CACHE_AT_ONCE = 2
CACHE_CONTEXT = 2048
CACHE_SAMPLE_S = 15
# A few shared system prompts, so that some prompts find their prefix in the cache; short enough
# that one and the longest fresh text fit the smallest context a slot gets.
SYSTEM_PROMPTS = 4
SYSTEM_TOKENS = (200, 400)
FRESH_TOKENS = (100, 1500)
# A prompt without a system prompt: fresh text alone, which nothing in the cache starts.
NO_SYSTEM_ODDS = 0.25
RSS_SLACK = 1.05
MIB = 1024 * 1024
CACHE_GAUGES = ("bytes", "budget_bytes", "entries", "disk_bytes", "disk_budget_bytes", "disk_entries")
CACHE_COUNTERS = ("saves", "evictions", "hits", "misses", "disk_writes", "disk_evictions", "disk_hits")


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


def directory_bytes(directory: Path) -> int:
    """The sizes of the files under ``directory``, those half written included."""
    total = 0
    for root, _, names in os.walk(directory):
        for name in names:
            try:
                total += (Path(root) / name).stat().st_size
            except FileNotFoundError:
                pass  # removed between the listing and its stat: an eviction
    return total


def cache_metrics(metrics: dict[str, float]) -> dict[str, int]:
    """The prompt cache's gauges and counters, by their names without the prefix (counters without ``_total``)."""
    prefix = "stopline_prompt_cache_"
    gauges = {name: int(metrics.get(prefix + name, 0)) for name in CACHE_GAUGES}
    return gauges | {name: int(metrics.get(f"{prefix}{name}_total", 0)) for name in CACHE_COUNTERS}


def cache_prompt(prompts: PromptMaker, systems: list[str]) -> list[dict]:
    """A chat of one of ``systems`` (or none) and fresh text of FRESH_TOKENS."""
    rng = prompts.rng
    fresh = prompts.story(rng.randint(*FRESH_TOKENS))
    if rng.random() < NO_SYSTEM_ODDS:
        return fresh
    return [{"role": "system", "content": rng.choice(systems)}, *fresh]


def cache_verdicts(result: dict) -> dict[str, bool]:
    """Whether the RSS over the server's footprint stayed within the memory budget and 5%, and the disk tier
    within its budget."""
    return {
        "rss": result["rss_growth_mib"] <= result["rss_limit_mib"],
        "disk": result["peak_disk_bytes"] <= result["disk_budget_bytes"],
    }


async def cache_churn(args) -> dict:
    rng = random.Random(args.seed)
    prompts = PromptMaker(embedded.embedded_tokenizer(progress=False), rng)
    systems = [prompts.story(rng.randint(*SYSTEM_TOKENS))[0]["content"] for _ in range(SYSTEM_PROMPTS)]
    with tempfile.TemporaryDirectory(prefix="stopline-cache-churn-") as directory:
        disk_dir = Path(directory) / "prompt-cache"
        server = ServerProcess(
            *("--port", "0", "--http-port", "0", "--threads", "1", "--cache-ram", str(args.cache_ram)),
            *("--workers", str(CACHE_AT_ONCE), "--context-length", str(CACHE_CONTEXT)),
            *("--prompt-cache-dir", str(disk_dir), "--prompt-cache-disk", str(args.disk_mib)),
            stderr_path=Path(directory) / "server.stderr",
        )
        try:
            await server.started()
            return await cache_churn_on(server, disk_dir, args, prompts, systems)
        finally:
            await server.stopped()


async def cache_churn_on(server: ServerProcess, disk_dir: Path, args, prompts: PromptMaker, systems) -> dict:
    metrics_url = server.start_record["url"] + "metrics"
    samples: list[dict] = []
    sent = 0
    # The samples on a session of their own, so that they wait for no request: the requests keep both of theirs busy.
    async with (
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CACHE_AT_ONCE)) as session,
        aiohttp.ClientSession() as sampling_session,
    ):

        async def ask(messages: list[dict]) -> None:
            body = {"model": "x", "messages": messages, "max_tokens": 1, "temperature": 0}
            async with session.post(f"{server.api_url}/chat/completions", json=body) as response:
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
                await response.read()

        async def sample(started: float) -> dict:
            async with sampling_session.get(metrics_url) as response:
                metrics = parse_metrics(await response.text())
            row = {"s": round(time.monotonic() - started, 1), "requests": sent}
            row |= {"rss_mib": round(rss_mib(server.pid), 2), "disk_files_bytes": directory_bytes(disk_dir)}
            return row | cache_metrics(metrics)

        started = time.monotonic()
        warmed_up = started + args.warmup_minutes * 60
        deadline = warmed_up + args.minutes * 60
        baseline: dict = {}

        async def lane() -> None:
            nonlocal sent
            while time.monotonic() < deadline:
                await ask(cache_prompt(prompts, systems))
                sent += 1

        async def sampler() -> None:
            await asyncio.sleep(max(0.0, warmed_up - time.monotonic()))
            baseline.update(await sample(started))
            while True:
                await asyncio.sleep(CACHE_SAMPLE_S)
                samples.append(await sample(started))
                last = samples[-1]
                print(
                    f"cache-churn: {last['s']:.0f} s, {sent} requests, RSS {last['rss_mib']} MiB, "
                    f"cache {last['bytes'] / MIB:.1f} MiB, disk {last['disk_files_bytes'] / MIB:.1f} MiB, "
                    f"{last['hits']} hits, {last['evictions']} evictions",
                    file=sys.stderr,
                )

        sampling = asyncio.create_task(sampler())
        try:
            await asyncio.gather(*(lane() for _ in range(CACHE_AT_ONCE)))
        finally:
            sampling.cancel()
        samples.append(await sample(started))
    last = samples[-1]
    budget_mib = (last["budget_bytes"] or args.cache_ram * MIB) / MIB
    peak_rss = max(s["rss_mib"] for s in samples)
    footprint = baseline["rss_mib"] - baseline["bytes"] / MIB
    result = {
        "minutes": args.minutes,
        "warmup_minutes": args.warmup_minutes,
        "seconds": last["s"],
        "cache_ram_mib": args.cache_ram,
        "disk_mib": args.disk_mib,
        "requests": sent,
        "baseline_rss_mib": baseline["rss_mib"],
        "footprint_mib": round(footprint, 2),
        "peak_rss_mib": peak_rss,
        "rss_growth_mib": round(peak_rss - footprint, 2),
        "memory_budget_mib": round(budget_mib, 2),
        "rss_limit_mib": round(budget_mib * RSS_SLACK, 2),
        "peak_cache_bytes": max(s["bytes"] for s in samples),
        "peak_disk_bytes": max(s["disk_files_bytes"] for s in samples),
        "peak_disk_metric_bytes": max(s["disk_bytes"] for s in samples),
        "disk_budget_bytes": last["disk_budget_bytes"] or args.disk_mib * MIB,
        **{name: last[name] - baseline[name] for name in CACHE_COUNTERS},
        "baseline": baseline,
        "samples": samples,
    }
    verdicts = cache_verdicts(result)
    return result | {"rss_met": verdicts["rss"], "disk_met": verdicts["disk"]}


def cache_churn_section(result: dict, command: str) -> str:
    verdicts = cache_verdicts(result)

    def met(ok: bool) -> str:
        return "met" if ok else "not met"

    r = result
    beyond = sorted(s["rss_mib"] - s["bytes"] / MIB - r["footprint_mib"] for s in r["samples"])
    return "\n".join(
        [
            "## The prompt cache's memory under churn",
            "",
            f"`{command}`: the server's defaults but `--cache-ram {r['cache_ram_mib']}`, `--prompt-cache-disk"
            f" {r['disk_mib']}`, `--threads 1`, `--workers {CACHE_AT_ONCE}` and `--context-length {CACHE_CONTEXT}`;"
            f" for {r['warmup_minutes']:g} minutes of warm-up and then {r['minutes']:g} minutes, one-token chat"
            " completions two at a time, each one of a few shared system prompts or none and 100 to 1,500 tokens of"
            f" fresh text; the RSS, the disk tier's files and /metrics read every {CACHE_SAMPLE_S} s. The server's"
            " footprint is its RSS less the cache's bytes at the end of the warm-up.",
            "",
            "| requests | hits | saves | evictions | evictions from disk | footprint (MiB) | peak RSS (MiB) |"
            " peak RSS over the footprint (MiB) | peak on disk (MiB) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            f"| {r['requests']:,} | {r['hits']:,} | {r['saves']:,} | {r['evictions']:,} | {r['disk_evictions']:,} |"
            f" {r['footprint_mib']:.1f} | {r['peak_rss_mib']:.1f} | {r['rss_growth_mib']:+.1f} |"
            f" {r['peak_disk_bytes'] / MIB:.1f} |",
            "",
            f"RSS over the footprint ≤ budget + 5%: {r['rss_growth_mib']:.1f} MiB against {r['rss_limit_mib']:.1f} MiB,"
            f" {met(verdicts['rss'])}.",
            "",
            f"RSS over the footprint and the cache's own bytes, sample by sample: {beyond[len(beyond) // 2]:+.1f} MiB"
            f" at the median, {beyond[-1]:+.1f} MiB at most ({len(beyond)} samples).",
            "",
            f"Disk ≤ its budget: {r['peak_disk_bytes'] / MIB:.1f} MiB against {r['disk_budget_bytes'] / MIB:.1f} MiB,"
            f" {met(verdicts['disk'])}.",
            "",
        ]
    )


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
    cache_parser = commands.add_parser("cache-churn", help="the prompt cache's memory and disk under churn")
    cache_parser.add_argument("--minutes", type=float, default=30)
    cache_parser.add_argument("--warmup-minutes", type=float, default=3, help="churn before the footprint is read")
    cache_parser.add_argument("--cache-ram", type=int, default=64, help="MiB of memory for the prompt cache")
    cache_parser.add_argument("--disk-mib", type=int, default=64, help="MiB of disk for its disk tier")
    cache_parser.add_argument("--seed", type=int, default=0)
    for sub in (churn_parser, kill_parser, cache_parser):
        sub.add_argument("--out", type=Path, default=Path("bench/out"))
        sub.add_argument("--results-md", action="store_true", help="also write the run's section of bench/RESULTS.md")
    args = parser.parse_args(argv)
    run, section_of, after = {
        "churn": (churn, churn_section, None),
        "kill": (kill, kill_section, None),
        "cache-churn": (cache_churn, cache_churn_section, "faults-churn"),
    }[args.command]
    result = asyncio.run(run(args))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"faults-{args.command}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    command = " ".join(["python -m bench faults", *argv])
    if args.command == "cache-churn":
        # Its samples are in the file; the section says what they come to.
        print(section_of(result, command))
    else:
        print(json.dumps(result, indent=2))
    print(f"written to {path}", file=sys.stderr)
    if args.results_md:
        results_md = Path(__file__).resolve().parents[1] / "RESULTS.md"
        write_results_section(results_md, f"faults-{args.command}", section_of(result, command), after)
    return 0
