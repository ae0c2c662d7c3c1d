"""python -m bench: measure how fast Stop stops, against the usual Python pattern.

Without --url it starts two servers, each in its own process on 127.0.0.1 and
a free port: Stopline with its native token loop ("ours"), and the same server
code on ctransformers' generate() stopped by a threading.Event between tokens
("baseline", bench/baseline.py). Both serve the same model file with the same
number of slots and threads per slot. Every scenario runs against each in turn,
over real WebSockets and the production protocol.

``--engines ours,baseline,llama-server`` adds llama.cpp's llama-server on the
same model file, driven over its own HTTP API (bench/llama_server.py).

The scenario cancel_via_replica starts servers of its own: redis-server (from
the PATH) and two replicas of "ours" sharing it (docs/deploy.md).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import os
import platform
import random
import shlex
import shutil
import sys
from pathlib import Path

from tqdm import tqdm

from stopline import model as embedded
from stopline.engine import DEFAULT_CONTEXT_LENGTH

from . import native
from .llama_server import (
    BUSY_MAX_TOKENS,
    DISCONNECT_BUSY,
    NONSTREAM,
    LlamaBench,
    peer_from_args,
)
from .llama_server import (
    ENGINE as LLAMA_SERVER,
)
from .prompts import PromptMaker
from .report import Report, plot_stop_latency_cdf, write_json
from .scenarios import (
    ALL_SCENARIOS as STOPLINE_SCENARIOS,
)
from .scenarios import (
    CANCEL_VIA_REPLICA,
    LONG_SCENARIOS,
    TURNS,
    Plan,
    run_cancel_via_replica,
)
from .serve import ENGINES as SERVED_ENGINES
from .servers import CpuMeter, ManagedServer, RedisServer, Target
from .traffic import TrafficBench

ALL_SCENARIOS = STOPLINE_SCENARIOS + (NONSTREAM, DISCONNECT_BUSY)
ENGINES = tuple(SERVED_ENGINES) + (LLAMA_SERVER,)

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_REQUESTS = 30
DEFAULT_LONG_REQUESTS = 6


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help=f"samples per scenario per engine (default {DEFAULT_REQUESTS}; unlimited with --duration)",
    )
    p.add_argument(
        "--long-requests",
        type=int,
        default=None,
        help="samples for the long-prompt scenarios, whose baseline samples each take a whole "
        f"long prefill (default: the smaller of --requests and {DEFAULT_LONG_REQUESTS})",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds per scenario per engine; a scenario ends at this or at --requests, whichever first",
    )
    p.add_argument(
        "--concurrency", type=int, default=None, help="streams in the concurrent throughput run (default: one per slot)"
    )
    p.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="requests in flight at once in the prefill, decode and timeout scenarios (default 1)",
    )
    p.add_argument("--short-prompt-tokens", type=int, default=50)
    p.add_argument("--long-prompt-tokens", type=int, default=1500)
    p.add_argument("--decode-tokens", type=int, default=128, help="max_tokens of each throughput request")
    p.add_argument("--throughput-reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=BENCH_DIR / "out", help="output directory (default bench/out)")
    p.add_argument(
        "--url",
        default=None,
        help="measure this running server (ws://host:port/ws) instead of starting ours and the baseline",
    )
    p.add_argument(
        "--engines",
        default="ours,ours_between_steps,baseline",
        help=f"servers to start, comma-separated: any of {','.join(ENGINES)}",
    )
    p.add_argument(
        "--llama-server", metavar="PATH", default=None, help="the llama-server binary for the llama-server engine"
    )
    p.add_argument(
        "--build-llama-server",
        action="store_true",
        help="build llama-server from a pinned llama.cpp source into the cache (once), for the llama-server engine",
    )
    p.add_argument("--workers", type=int, default=2, help="slots of each started server")
    p.add_argument("--threads", type=int, default=1, help="compute threads per slot of each started server")
    p.add_argument("--scenarios", default=",".join(ALL_SCENARIOS), help=f"any of {','.join(ALL_SCENARIOS)}")
    p.add_argument(
        "--native",
        action="store_true",
        help="first measure the native loop in-process: prompt speed by chunk size, and aborts at "
        "random moments (bench/native.py)",
    )
    p.add_argument("--abort-cycles", type=int, default=500, help="aborts per thread setting with --native")
    p.add_argument(
        "--results-md", action="store_true", help="also write bench/RESULTS.md and bench/stop_latency_cdf.png"
    )
    args = p.parse_args(argv)
    unknown = set(args.scenarios.split(",")) - set(ALL_SCENARIOS)
    if unknown:
        p.error(f"unknown scenarios: {', '.join(sorted(unknown))}")
    engines = [e for e in args.engines.split(",") if e]
    if not args.url and (not engines or set(engines) - set(ENGINES) or len(set(engines)) != len(engines)):
        p.error(f"--engines takes one or more of {','.join(ENGINES)}")
    if LLAMA_SERVER in engines and not args.url and not (args.llama_server or args.build_llama_server):
        p.error("the llama-server engine needs --llama-server PATH or --build-llama-server")
    return args


def make_plan(args) -> Plan:
    requests = args.requests if args.requests is not None else (DEFAULT_REQUESTS if args.duration is None else math.inf)
    long_requests = args.long_requests if args.long_requests is not None else min(requests, DEFAULT_LONG_REQUESTS)
    return Plan(
        requests=requests,
        long_requests=long_requests,
        duration_s=args.duration,
        short_tokens=args.short_prompt_tokens,
        long_tokens=args.long_prompt_tokens,
        concurrency=args.concurrency,
        throughput_reps=args.throughput_reps,
        decode_tokens=args.decode_tokens,
        parallel=max(1, args.parallel),
    )


def machine() -> dict:
    cpu, virtual = "unknown", False
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "unknown":
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                virtual = virtual or "hypervisor" in line.split()
    except OSError:
        pass
    return {
        "cpu": cpu,
        "virtual": virtual,
        "cores": os.cpu_count(),
        "cores_available": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def planned_samples(
    plan: Plan, scenarios: list[str], targets: list[Target], concurrency: int | None, supports
) -> int | None:
    if plan.duration_s is not None and not math.isfinite(plan.requests):
        return None
    total = int(plan.requests) if CANCEL_VIA_REPLICA in scenarios and targets[0].managed else 0
    for target in targets:
        for scenario in scenarios:
            if scenario == CANCEL_VIA_REPLICA or not supports(target, scenario):
                continue
            if scenario == "throughput":
                total += plan.throughput_reps * sum({1, concurrency or target.slots})
            elif scenario in LONG_SCENARIOS:
                total += int(plan.long_requests) * (TURNS if scenario == "multi_turn" else 1)
            else:
                total += int(plan.requests)
    return total


async def run(args) -> dict:
    plan = make_plan(args)
    scenarios = [s for s in ALL_SCENARIOS if s in args.scenarios.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    prompts = PromptMaker(embedded.embedded_tokenizer(progress=False), rng)

    native_results = None
    if args.native:
        print("measuring the native loop in-process ...", file=sys.stderr)
        native_results = await asyncio.to_thread(native.run, args.abort_cycles)

    managed: list = []
    if args.url:
        targets = [await Target.from_url(args.url)]
    else:
        managed = [
            ManagedServer(e, args.out, args.workers, args.threads)
            if e != LLAMA_SERVER
            else peer_from_args(args, args.out, DEFAULT_CONTEXT_LENGTH, embedded.original_gguf_path())
            for e in args.engines.split(",")
            if e
        ]
        print(f"starting {', '.join(m.engine for m in managed)} ...", file=sys.stderr)
        targets = list(await asyncio.gather(*(m.start() for m in managed)))

    meta = {
        "command": "python -m bench " + shlex.join(sys.argv[1:]),
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "model": embedded.EMBEDDED_MODEL_NAME + " Q4_1",
        "plan": {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(plan).items()},
        "scenarios": scenarios,
        "targets": {},
        "results_json": _shown(args.out / "results.json"),
    }
    # Other work's CPU use can be told apart only when every server is ours to watch.
    cpu = CpuMeter([os.getpid()] + [m.pid for m in managed]) if managed else None
    bench = TrafficBench(plan, prompts, rng, None, cpu)
    peer = LlamaBench(plan, prompts, rng, None, cpu)
    peer.samples, peer.runs = bench.samples, bench.runs  # one list of samples for the report

    def runner(target: Target):
        return peer if target.name == LLAMA_SERVER else bench

    progress = tqdm(
        total=planned_samples(plan, scenarios, targets, plan.concurrency, lambda t, s: runner(t).supports(s)),
        file=sys.stderr,
        unit="sample",
        dynamic_ncols=True,
    )
    bench.progress = peer.progress = progress
    try:
        for target in targets:
            progress.set_description(f"calibrating [{target.name}]")
            calibration = await runner(target).calibrate(target, long=bool(set(LONG_SCENARIOS) & set(scenarios)))
            info = {"ws_url": target.ws_url, "slots": target.slots, "calibration": calibration}
            if target.managed:
                info.update(
                    {
                        k: v
                        for k, v in target.managed.info.items()
                        if k in ("threads", "prefill_chunk", "command", "source")
                    }
                )
            meta["targets"][target.name] = info
        # Scenario by scenario, each engine in turn, so both see the machine in the same state.
        for scenario in scenarios:
            for target in targets:
                if scenario != CANCEL_VIA_REPLICA:
                    await runner(target).run(scenario, target)
        if CANCEL_VIA_REPLICA in scenarios and not args.url:
            await asyncio.gather(*(m.stop() for m in managed))  # the machine to the replicas alone
            progress.set_description(CANCEL_VIA_REPLICA)
            meta["cancel_via_replica"] = await _cancel_via_replica(bench, args)
    finally:
        progress.close()
        await asyncio.gather(*(m.stop() for m in managed))

    results = {"meta": meta, "samples": bench.samples, "runs": bench.runs, "lag": {}, "native": native_results}
    for target in targets:
        if target.managed:
            _attach_server_log(bench.samples, target)
            results["lag"][target.name] = _lag(target)
    return results


async def _cancel_via_replica(bench: TrafficBench, args) -> dict:
    """redis-server and two replicas of ours sharing it; the first owns the generations."""
    redis_server = RedisServer(args.out / "redis").start()
    replicas = [
        ManagedServer(
            "ours",
            args.out,
            args.workers,
            args.threads,
            name=f"replica-{name}",
            extra_args=("--redis-url", redis_server.url, "--replica-id", name),
        )
        for name in "ab"
    ]
    try:
        owner, other = await asyncio.gather(*(r.start() for r in replicas))
        await run_cancel_via_replica(bench, owner, other)
    finally:
        await asyncio.gather(*(r.stop() for r in replicas))
        redis_server.kill()
    return {
        "replicas": 2,
        "redis": "redis-server on 127.0.0.1 (loopback)",
        "workers": args.workers,
        "threads": args.threads,
    }


def _attach_server_log(samples: list[dict], target: Target) -> None:
    """Add what only the server's end-of-request log knows: prompt tokens evaluated, tokens wasted."""
    ends = target.managed.request_log()
    for sample in samples:
        end = ends.get(sample.get("id")) if sample["target"] == target.name else None
        if end is None:
            continue
        sample.update(
            tokens_wasted=end.get("tokens_wasted"),
            prompt_tokens_evaluated=end.get("prompt_tokens_evaluated"),
            log_tokens_generated=end.get("tokens_generated"),
        )
        if sample["scenario"] in ("disconnect", DISCONNECT_BUSY, "openai_stream_closed"):
            sample.update(server_ms=end.get("cancel_latency_ms"), tokens_after_cancel=end.get("tokens_after_cancel"))


def _lag(target: Target) -> dict:
    """The probe's samples while a scenario ran against this server (its idle time left out)."""
    samples = target.managed.lag_samples()
    by_scenario: dict[str, list[float]] = {}
    under_load: list[float] = []
    for name, start, end in target.windows:
        overs = [over / 1e6 for t, over in samples if start <= t < end]
        by_scenario.setdefault(name, []).extend(overs)
        under_load.extend(overs)
    return {
        "interval_ms": 10.0,
        "under_load_ms": under_load,
        "by_scenario_ms": by_scenario,
        "windows": target.windows,
        "samples": samples,
    }


def results_markdown(results: dict, tables: str) -> str:
    meta = results["meta"]
    m = meta["machine"]
    targets = meta["targets"]
    slots = next(iter(targets.values()))["slots"] if targets else "?"
    threads = next(iter(targets.values())).get("threads", "?") if targets else "?"
    return f"""# Stopline benchmark results

Stop latency, tokens after cancel, prompt speed, conversation reuse, throughput, event-loop lag,
timeout precision and disconnect handling of Stopline's native token loop, against:

- **ours_between_steps**: the same loop and server with the in-step abort switched off
  (`--abort-mode between_steps`): it stops only between evaluations, so it evaluates prompts one
  token at a time to keep a stop within about one decode step;
- **baseline**: the usual Python pattern, ctransformers' own `generate()` in an executor thread,
  checking a `threading.Event` between tokens, with its default prompt batch of 8 tokens evaluated
  in one uninterruptible call (`bench/baseline.py`);
- **llama-server**: llama.cpp's server on the same model file, when it takes part.

"ours", "ours_between_steps" and "baseline" are served by the same WebSocket server, protocol,
scheduler and metrics code; only the token loop differs. Ratios are other/ours.

- Command: `{meta["command"]}` ({meta["started_at"]})
- Machine: {m["cpu"]}{" (virtual machine)" if m.get("virtual") else ""}, {m["cores"]} cores
  ({m["cores_available"]} available to the benchmark), shared with other work; Python {m["python"]}
- Model: {meta["model"]} GGUF (the embedded model), context 2048, both engines on the same converted
  file; {slots} slots per server, {threads} compute thread per slot
- Servers: one process each (`python -m bench.serve`), on 127.0.0.1, started by the benchmark
- Prompts: about {meta["plan"]["short_tokens"]} tokens (short) and {meta["plan"]["long_tokens"]} tokens (long),
  each different, each asking for a long story; sampling at temperature 0.7
- Samples: {_count(meta["plan"]["requests"])} per scenario per engine, {_count(meta["plan"]["long_requests"])} for the
  long-prompt scenarios (each baseline sample there costs a whole long prefill); one request at a time
  unless a scenario needs more ({meta["plan"]["parallel"]} in flight in the prefill, decode and timeout scenarios)

How the cancels are placed:

- **queued**: every slot runs a long generation; one more request is queued and cancelled 0–100 ms after
  its `accepted` frame (discarded if a slot freed up first).
- **prefill**: cancelled after a random delay shorter than the prompt's prefill time, measured beforehand
  (the calibration table). A request that had already received a token counts as a decode sample.
- **decode, random phase**: cancelled after 1–32 token frames plus a random fraction of a decode step.
- **decode, right after a token frame**: cancelled the moment the 1st–32nd token frame arrives, when the
  next decode step has just begun.
- **prompt speed**: a long prompt with `max_tokens` 1; the server's time to first token.
- **multi-turn**: a six-turn chat on one connection, about 80 tokens of new text per turn, 48-token answers.
- **timeouts**: `timeout_s` = 1.25 × the short prompt's prefill + 100–600 ms; `ttft_timeout_s` = 5–25 % of
  the long prompt's prefill.
- **disconnect**: the socket is dropped after 1–32 token frames; `/metrics` is polled every ~1 ms until
  `stopline_active_generations` is 0 (the time is the arrival of the answer that showed it).
{_peer_method(results)}
{tables}
![Stop latency CDF per scenario, ours against the other engines](stop_latency_cdf.png)

Every sample is in the JSON file the run wrote (`{meta["results_json"]}`).
"""


def _peer_method(results: dict) -> str:
    """The method bullets for the scenarios added for llama-server, when it took part."""
    meta = results["meta"]
    if LLAMA_SERVER not in meta["targets"]:
        return ""
    peer = meta["targets"][LLAMA_SERVER]
    return f"""- **disconnect while another client streams**: one client streams without pause on one slot; on the
  other, the measured client goes away during decode (ours: the WebSocket dropped after 1–32 token frames,
  `/metrics` polled until only the other generation is active; llama-server: a non-streaming request reset
  after its calibrated prefill plus 1–32 decode steps). A llama-server request that generated all its
  {BUSY_MAX_TOKENS} tokens never noticed; its time is the time that took.
- **non-streaming request, client gone** (llama-server only; ours streams every request): the same, with
  no other traffic.
- **llama-server** ({peer.get("source", "llama.cpp")}; `{shlex.join(peer.get("command", []))}`): every stop is
  the client closing the connection (it has no cancel request); it counts as stopped when its log prints
  the release of the request's slot, stamped as the line arrives; see "Against llama-server" below.
"""


def _shown(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(BENCH_DIR.parent)) if path.is_relative_to(BENCH_DIR.parent) else str(path)


def _count(value) -> str:
    return "unlimited (time-boxed)" if value is None else str(value)


def main(argv=None) -> int:
    args = parse_args(argv)
    results = asyncio.run(run(args))
    json_path = args.out / "results.json"
    chart_path = args.out / "stop_latency_cdf.png"
    write_json(results, json_path)
    plot_stop_latency_cdf(results, chart_path)
    tables = Report(results).markdown()
    print(tables)
    print(f"samples: {json_path}\nchart: {chart_path}", file=sys.stderr)
    if args.results_md:
        shutil.copyfile(chart_path, BENCH_DIR / "stop_latency_cdf.png")
        (BENCH_DIR / "RESULTS.md").write_text(results_markdown(results, tables))
        print(f"wrote {BENCH_DIR / 'RESULTS.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
