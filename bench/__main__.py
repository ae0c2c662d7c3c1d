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
import json
import math
import os
import platform
import random
import shlex
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

from stopline.engine import model as embedded
from stopline.engine.llama_build import ensure_llama_library
from stopline.protocol.vocabulary import EngineName
from stopline.settings import DEFAULT_CONTEXT_LENGTH

from . import llama_native, native, random_llama
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
from .report import Report, plot_stop_latency_cdf, shared_threads, write_json
from .scenarios import (
    ALL_SCENARIOS as STOPLINE_SCENARIOS,
)
from .scenarios import (
    CANCEL_VIA_REPLICA,
    CONCURRENT_STREAMS,
    DECODE_CONCURRENT,
    LONG_SCENARIOS,
    TURNS,
    Plan,
    run_cancel_via_replica,
)
from .serve import ENGINES as SERVED_ENGINES
from .servers import CpuMeter, ManagedServer, RedisServer, Target, load_average
from .traffic import TrafficBench

ALL_SCENARIOS = STOPLINE_SCENARIOS + (NONSTREAM, DISCONNECT_BUSY)
ENGINES = tuple(SERVED_ENGINES) + (LLAMA_SERVER,)

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_REQUESTS = 30
DEFAULT_LONG_REQUESTS = 6
# The scenarios the servers with --wide-workers slots run: the ones that need 4 streams at once.
WIDE_SCENARIOS = ("throughput", DECODE_CONCURRENT)


@dataclass(frozen=True)
class BenchModel:
    """A model the benchmark can run: its name in reports, and the GGUF file each engine loads."""

    title: str
    # The file the llama.cpp engine and llama-server load.
    gguf: Callable[[], Path]
    # Whether the ctransformers engines (ours, ours_between_steps, baseline) can load it.
    ctransformers: bool


MODELS = {
    "smollm2": BenchModel(f"{embedded.EMBEDDED_MODEL_NAME} Q4_1", lambda: embedded.original_gguf_path(False), True),
    "gemma3": BenchModel(embedded.GEMMA_MODEL_NAME, lambda: embedded.gemma_gguf_path(False), False),
    # Written into the cache on first use: about 700 MB, in seconds.
    "llama-1b-shaped": BenchModel(
        f"{random_llama.TITLE} (Q4_0)", lambda: random_llama.random_llama_path(progress=True), False
    ),
}


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
    p.add_argument(
        "--model",
        choices=list(MODELS),
        default="smollm2",
        help="smollm2: the embedded SmolLM2-135M-Instruct; gemma3: Gemma 3 270M (llama.cpp engines only); "
        "llama-1b-shaped: Llama 3.2 1B's shapes and Llama 3's vocabulary with random weights, so that graph "
        "nodes take as long as a 1B model's (llama.cpp engines only; written into the cache on first use)",
    )
    p.add_argument(
        "--cpus",
        default=None,
        help="the cores every started server is confined to, e.g. 0,1 (default: all available to the benchmark)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="each scenario's samples are taken in this many parts, the engines taking turns part by part",
    )
    p.add_argument(
        "--wide-workers",
        type=int,
        default=0,
        help=f"after the other scenarios, restart every engine with this many slots and run "
        f"{' and '.join(WIDE_SCENARIOS)} on them (0: off; {CONCURRENT_STREAMS} for the 4-stream figures)",
    )
    p.add_argument(
        "--llama-native",
        action="store_true",
        help="measure the llama.cpp engine in-process: aborts at random moments (1 and 4 streams, "
        "--llama-abort-cycles each), its longest graph nodes, and greedy agreement with llama-server",
    )
    p.add_argument(
        "--llama-abort-cycles", type=int, default=1000, help="aborts per storm (1 and 4 streams) with --llama-native"
    )
    p.add_argument("--greedy-prompts", type=int, default=20, help="prompts compared greedy with --llama-native")
    p.add_argument("--workers", type=int, default=2, help="slots of each started server")
    p.add_argument("--threads", type=int, default=1, help="compute threads per slot of each started server")
    p.add_argument(
        "--shared-threads",
        action="store_true",
        help="--threads is the cores each server shares among its running generations (Stopline's default "
        "policy: a lone generation takes them all) and llama-server's whole thread count, not per slot",
    )
    p.add_argument("--scenarios", default=",".join(ALL_SCENARIOS), help=f"any of {','.join(ALL_SCENARIOS)}")
    p.add_argument(
        "--native",
        action="store_true",
        help="first measure the native loop in-process: prompt speed by chunk size, and aborts at "
        "random moments (bench/native.py)",
    )
    p.add_argument("--abort-cycles", type=int, default=500, help="aborts per thread setting with --native")
    p.add_argument(
        "--render-only",
        action="store_true",
        help="run nothing: write the tables (and with --results-md, RESULTS.md) from --out's results.json",
    )
    p.add_argument(
        "--results-md",
        action="store_true",
        help="also write this run's section of bench/RESULTS.md and its chart (a section per model, and another "
        "per model for --shared-threads runs)",
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
    args.skipped = []
    if not MODELS[args.model].ctransformers:
        args.skipped = [
            e for e in engines if e in SERVED_ENGINES and SERVED_ENGINES[e].kind is EngineName.CTRANSFORMERS
        ]
        engines = [e for e in engines if e not in args.skipped]
        if not engines:
            p.error(f"--model {args.model} runs on the llama.cpp engines and llama-server only")
        args.engines = ",".join(engines)
    args.cpu_set = frozenset(int(c) for c in args.cpus.split(",")) if args.cpus else frozenset(os.sched_getaffinity(0))
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
            if scenario == DECODE_CONCURRENT and target.slots < CONCURRENT_STREAMS:
                continue
            if scenario == "throughput":
                total += plan.throughput_reps * sum(plan.stream_counts(target.slots))
            elif scenario in LONG_SCENARIOS:
                total += int(plan.long_requests) * (TURNS if scenario == "multi_turn" else 1)
            else:
                total += int(plan.requests)
    return total


def start_servers(args, model: BenchModel, workers: int, out_dir: Path) -> list:
    """The servers of ``--engines``, with ``workers`` slots each, all confined to the same cores;
    their logs in ``out_dir``."""
    gguf = model.gguf()
    out_dir.mkdir(parents=True, exist_ok=True)
    managed: list = []
    for engine in args.engines.split(","):
        if engine == LLAMA_SERVER:
            managed.append(peer_from_args(args, out_dir, DEFAULT_CONTEXT_LENGTH, gguf, workers, args.cpu_set))
        else:
            if SERVED_ENGINES[engine].unedited:
                # Built here, once, rather than while the benchmark waits for the server to start.
                ensure_llama_library(edited=False)
            # The ctransformers engines load the embedded model their own way (a converted copy).
            path = gguf if SERVED_ENGINES[engine].kind is EngineName.LLAMA_CPP else None
            managed.append(ManagedServer(engine, out_dir, workers, args.threads, model=path, cpus=args.cpu_set))
    return managed


def prompt_maker(args, rng: random.Random) -> PromptMaker:
    """Prompts tokenized as the model under test tokenizes them: SmolLM2's with the embedded tokenizer,
    which both of its engines use; any other model with llama.cpp's own vocabulary and template."""
    if args.model == "smollm2":
        return PromptMaker(embedded.embedded_tokenizer(progress=False), rng)
    from stopline import _core
    from stopline.engine.tokenizer import LlamaTokenizer

    _core.load_llama_library(str(ensure_llama_library(progress=False)))
    return PromptMaker(LlamaTokenizer(_core.LlamaModel(str(MODELS[args.model].gguf()))), rng)


def pause_all_but(targets: list[Target], measured: Target | None) -> None:
    """Pause every started server but ``measured`` (None: continue them all).

    An idle server still wakes up (its event loop's timers); each wake-up can preempt one of a
    multi-threaded server's threads, and its spinning partners then wait out the time slice.
    Paused, the servers not being measured cannot disturb the one that is."""
    for target in targets:
        if target.managed is not None:
            target.managed.pause(measured is not None and target is not measured)


async def run_scenarios(bench, peer, scenarios: list[str], targets: list[Target], rounds: int) -> None:
    """Scenario by scenario; within each, the engines take turns part by part, in alternating order,
    so that a drift in the machine's load favours none of them. The servers not being measured are
    paused meanwhile."""

    def runner(target: Target):
        return peer if target.name == LLAMA_SERVER else bench

    try:
        for scenario in scenarios:
            if scenario == CANCEL_VIA_REPLICA:
                continue
            for part in range(rounds):
                for target in targets if part % 2 == 0 else reversed(targets):
                    pause_all_but(targets, target)
                    await runner(target).run(scenario, target, part, rounds)
    finally:
        pause_all_but(targets, None)


async def run(args) -> dict:
    plan = make_plan(args)
    model = MODELS[args.model]
    scenarios = [s for s in ALL_SCENARIOS if s in args.scenarios.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    prompts = prompt_maker(args, rng)
    load_at_start = load_average()

    native_results = None
    if args.native and model.ctransformers:
        print("measuring the native loop in-process ...", file=sys.stderr)
        native_results = await asyncio.to_thread(native.run, args.abort_cycles)
    llama_results: dict | None = None
    if args.llama_native:
        print("measuring the llama.cpp engine in-process ...", file=sys.stderr)
        llama_results = await asyncio.to_thread(_llama_native, args, model)

    managed: list = []
    if args.url:
        targets = [await Target.from_url(args.url)]
    else:
        managed = start_servers(args, model, args.workers, args.out)
        print(f"starting {', '.join(m.engine for m in managed)} ...", file=sys.stderr)
        targets = list(await asyncio.gather(*(m.start() for m in managed)))

    meta = {
        "command": "python -m bench " + shlex.join(sys.argv[1:]),
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "model": model.title,
        "model_choice": args.model,
        "skipped_engines": args.skipped,
        "cpus": sorted(args.cpu_set),
        "rounds": args.rounds,
        "wide_workers": args.wide_workers,
        "load_average_start": load_at_start,
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

    main_scenarios = [s for s in scenarios if not (args.wide_workers and s == DECODE_CONCURRENT)]
    progress = tqdm(
        total=planned_samples(plan, main_scenarios, targets, plan.concurrency, lambda t, s: runner(t).supports(s)),
        file=sys.stderr,
        unit="sample",
        dynamic_ncols=True,
    )
    bench.progress = peer.progress = progress
    all_targets = list(targets)
    try:
        await _calibrate(meta, targets, runner, scenarios, progress)
        await run_scenarios(bench, peer, main_scenarios, targets, args.rounds)
        if llama_results is not None and LLAMA_SERVER in meta["targets"] and args.greedy_prompts > 0:
            progress.set_description("greedy agreement with llama-server")
            peer_target = next(t for t in targets if t.name == LLAMA_SERVER)
            llama_results["greedy"] = await _greedy_agreement(args, model, prompts, peer_target)
        wide = [s for s in WIDE_SCENARIOS if s in scenarios]
        if args.wide_workers and wide and not args.url:
            await asyncio.gather(*(m.stop() for m in managed))
            # Logs of their own: the first servers' logs are read after the run.
            managed = start_servers(args, model, args.wide_workers, args.out / "wide")
            print(
                f"starting {', '.join(m.engine for m in managed)} with {args.wide_workers} slots ...", file=sys.stderr
            )
            targets = list(await asyncio.gather(*(m.start() for m in managed)))
            if cpu is not None:
                cpu.pids = [os.getpid()] + [m.pid for m in managed]
            bench.plan = peer.plan = replace(plan, streams=(args.wide_workers,))
            wide_meta: dict = {"targets": {}}
            await _calibrate(wide_meta, targets, runner, [], progress)
            meta["wide"] = wide_meta
            await run_scenarios(bench, peer, wide, targets, args.rounds)
            all_targets += targets
        if CANCEL_VIA_REPLICA in scenarios and not args.url:
            await asyncio.gather(*(m.stop() for m in managed))  # the machine to the replicas alone
            progress.set_description(CANCEL_VIA_REPLICA)
            meta["cancel_via_replica"] = await _cancel_via_replica(bench, args)
    finally:
        progress.close()
        await asyncio.gather(*(m.stop() for m in managed))
    meta["load_average_end"] = load_average()

    results = {
        "meta": meta,
        "samples": bench.samples,
        "runs": bench.runs,
        "lag": {},
        "native": native_results,
        "llama_native": llama_results,
    }
    for target in all_targets:
        if target.managed:
            _attach_server_log(bench.samples, target)
            lag = _lag(target)
            # The wide servers' probe samples join their engine's.
            if target.name in results["lag"]:
                results["lag"][target.name]["under_load_ms"] += lag["under_load_ms"]
            else:
                results["lag"][target.name] = lag
    return results


async def _calibrate(meta: dict, targets: list[Target], runner, scenarios: list[str], progress) -> None:
    for target in targets:
        progress.set_description(f"calibrating [{target.name}]")
        pause_all_but(targets, target)
        try:
            calibration = await runner(target).calibrate(target, long=bool(set(LONG_SCENARIOS) & set(scenarios)))
        finally:
            pause_all_but(targets, None)
        info = {"ws_url": target.ws_url, "slots": target.slots, "calibration": calibration}
        if target.managed:
            info.update(
                {k: v for k, v in target.managed.info.items() if k in ("threads", "prefill_chunk", "command", "source")}
            )
        meta["targets"][target.name] = info


def _llama_native(args, model: BenchModel) -> dict:
    """The llama.cpp engine in-process: abort storms (in child processes) and its longest graph nodes."""
    gguf = model.gguf()
    storms = [
        llama_native.storm_in_child(gguf, args.llama_abort_cycles, streams, args.seed)
        for streams in (1, llama_native.STORM_STREAMS)
    ]
    nodes = llama_native.longest_nodes(llama_native.load(gguf, args.threads), args.long_prompt_tokens)
    return {"storms": storms, "nodes": nodes, "load_average": load_average()}


async def _greedy_agreement(args, model: BenchModel, prompts: PromptMaker, peer: Target) -> dict:
    """The same prompts greedy on our llama.cpp engine (in-process) and on llama-server."""
    from .llama_server import Completion

    engine = await asyncio.to_thread(llama_native.load, model.gguf(), args.threads)
    rows = []
    for _ in range(args.greedy_prompts):
        prompt = prompts.tokenizer.encode(prompts.tokenizer.render_chat(prompts.story(args.short_prompt_tokens)))
        ours = await asyncio.to_thread(llama_native.greedy_ours, engine, prompt, llama_native.GREEDY_TOKENS)
        call = await Completion.start(peer.http_url, llama_native.greedy_body(prompt, llama_native.GREEDY_TOKENS))
        try:
            answer = await call.wait_end() or {}
        finally:
            await call.dispose()
        rows.append(llama_native.compare_greedy(ours, answer, engine.model.token_bytes))
    return {"tokens_per_prompt": llama_native.GREEDY_TOKENS, "rows": rows}


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
            # The longest stretch between two stop checks, in the prompt and in decode: what a stop waits at most.
            longest_prefill_node_ms=end.get("longest_prefill_node_ms"),
            longest_decode_node_ms=end.get("longest_decode_node_ms"),
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


RESULTS_HEADER = """# Stopline benchmark results

Stop latency, tokens after cancel, prompt speed, conversation reuse, throughput, event-loop lag,
timeout precision and disconnect handling of Stopline's native token loop, one section per model,
each from one run of `python -m bench` (its command at the top of the section). The engines:

- **ours**: Stopline's loop on its default engine, ctransformers 0.2.27 (a 2023 llama.cpp), stopped
  inside an evaluation by its step hook;
- **ours_llama**: the same loop and server on its second engine, today's llama.cpp behind Stopline's
  own shim (`--engine llama.cpp`), stopped inside an evaluation by llama.cpp's abort callback; one
  llama.cpp context per slot (`--batching per_slot`, the default);
- **ours_llama_shared**: the same with `--batching shared`: the slots are the sequences of one
  llama.cpp context, and every step is one batch of every running generation's next tokens;
- **ours_llama_unedited**: ours_llama on a library built from unedited llama.cpp, without
  Stopline's edits (`stopline/engine/llama_edits.py`): it stops between graph nodes only, so a stop
  waits for the node under way; the measure of what the edits cost and buy;
- **ours_between_steps**: the same loop and server with the in-step abort switched off
  (`--abort-mode between_steps`): it stops only between evaluations, so it evaluates prompts one
  token at a time to keep a stop within about one decode step;
- **baseline**: the usual Python pattern, ctransformers' own `generate()` in an executor thread,
  checking a `threading.Event` between tokens, with its default prompt batch of 8 tokens evaluated
  in one uninterruptible call (`bench/baseline.py`);
- **llama-server**: llama.cpp's server, built from the same llama.cpp source and flags as
  ours_llama, on the same GGUF file.

"ours", "ours_llama", "ours_between_steps" and "baseline" are served by the same WebSocket server,
protocol, scheduler and metrics code; only the token loop or the engine under it differs. Ratios are
other/reference, the reference being ours where it runs, else ours_llama.
"""


def results_key(meta: dict) -> str:
    """A run's section of RESULTS.md: one per model, and one more for runs whose generations share the cores."""
    return f"{meta['model_choice']}-shared-cores" if shared_threads(meta) else meta["model_choice"]


def results_section(results: dict, tables: str, chart: str) -> str:
    """One model's section of RESULTS.md: how it was measured, then its tables."""
    meta = results["meta"]
    m = meta["machine"]
    targets = meta["targets"]
    slots = next(iter(targets.values()))["slots"] if targets else "?"
    threads = targets.get("ours", targets.get("ours_llama", {})).get("threads", "?")
    load_start, load_end = meta["load_average_start"], meta["load_average_end"]
    skipped = meta.get("skipped_engines") or []
    wide = meta.get("wide_workers") or 0
    peer_threads = targets.get(LLAMA_SERVER, {}).get("threads")
    llama_section = ""
    from .llama_report import LlamaReport

    llama = LlamaReport(Report(results)).markdown()
    if llama:
        llama_section = f"### The llama.cpp engine against llama-server\n\n{llama}\n\n"
    heading = meta["model"]
    if shared_threads(meta):
        heading += (
            ", the llama.cpp engine on shared cores\n\nThe llama.cpp engine with its default threads (the running "
            "generations share the cores), against llama-server with as many threads in all."
        )
    return f"""## {heading}

- Command: `{meta["command"]}` ({meta["started_at"]})
- Machine: {m["cpu"]}{" (virtual machine)" if m.get("virtual") else ""}, {m["cores"]} cores
  ({m["cores_available"]} available to the benchmark), shared with other work; Python {m["python"]};
  load average (1 / 5 / 15 min) {_load(load_start)} at the start and {_load(load_end)} at the end; each
  scenario's own is in the JSON file
- Model: {meta["model"]} GGUF, context 2048 per slot; engines: {", ".join(targets)}{
        f" ({', '.join(skipped)} skipped: ctransformers cannot load this model)" if skipped else ""
    }
- Equal resources: every server is confined to the same cores ({",".join(map(str, meta["cpus"]))}, by
  `sched_setaffinity` in the child before it starts); ours: {_ours_threads(meta, slots, threads)};
  llama-server: one process, `--parallel {slots}`, `--threads {peer_threads or "–"}` (as many in
  all){_wide_note(wide, threads, shared_threads(meta))}
- Interleaving: each scenario's samples are taken in {meta["rounds"]} parts, the engines taking turns
  part by part, in alternating order; while one engine is measured (or calibrated) the other servers
  are paused (SIGSTOP), because an idle server's wake-ups (its event loop's timers) preempt a thread of
  a multi-threaded server, whose other threads then spin at ggml's barrier until it runs again
- Servers: one process each (`python -m bench.serve`, or llama-server), on 127.0.0.1, started by the benchmark
- Prompts: about {meta["plan"]["short_tokens"]} tokens (short) and {meta["plan"]["long_tokens"]} tokens (long),
  each different, each asking for a long story; sampling at temperature 0.7
- Samples: {_count(meta["plan"]["requests"])} per scenario per engine, {_count(meta["plan"]["long_requests"])} for the
  long-prompt scenarios; one request at a time unless a scenario needs more

How the cancels are placed:

- **queued**: every slot runs a long generation; one more request is queued and cancelled 0–100 ms after
  its `accepted` frame (discarded if a slot freed up first).
- **prefill**: cancelled after a random delay shorter than the prompt's prefill time, measured beforehand
  (the calibration table). A request that had already received a token counts as a decode sample.
- **decode, random phase**: cancelled after 1–32 token frames plus a random fraction of a decode step.
- **decode, right after a token frame**: cancelled the moment the 1st–32nd token frame arrives, when the
  next decode step has just begun.
- **decode, 1 of 4 concurrent streams**: 4 streams decode at once (one per slot); the first is cancelled
  as in the random-phase case, the other 3 run on to their 96 tokens; tokens they fell short of are lost.
- **prompt speed**: a long prompt with `max_tokens` 1; the server's time to first token.
- **multi-turn**: a six-turn chat on one connection, about 80 tokens of new text per turn, 48-token answers;
  llama-server keeps the chat on one slot with `cache_prompt: true`, so it reuses its cache as ours does.
- **timeouts**: `timeout_s` = 1.25 × the short prompt's prefill + 100–600 ms; `ttft_timeout_s` = 5–25 % of
  the long prompt's prefill.
- **disconnect**: the socket is dropped after 1–32 token frames; `/metrics` is polled every ~1 ms until
  `stopline_active_generations` is 0 (the time is the arrival of the answer that showed it).
{_peer_method(results)}
{llama_section}{tables}
![Stop latency CDF per scenario, {meta["model"]}]({chart})

Every sample is in the JSON file the run wrote (`{meta["results_json"]}`).
"""


def write_results_section(path: Path, model: str, section: str) -> None:
    """Put ``section`` between this model's markers in RESULTS.md, keeping the other models' sections."""
    begin, end = f"<!-- results:{model} -->", f"<!-- /results:{model} -->"
    text = path.read_text() if path.is_file() else ""
    if "<!-- results:" not in text:
        text = RESULTS_HEADER
    block = f"{begin}\n{section}{end}\n"
    if begin in text and end in text:
        before, rest = text.split(begin, 1)
        after = rest.split(end, 1)[1].lstrip("\n")
        text = before + block + ("\n" + after if after else "")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text)


def _ours_threads(meta: dict, slots, threads) -> str:
    if shared_threads(meta):
        return (
            f"{slots} slots sharing {threads} compute threads (its default: a generation alone takes them "
            f"all, generations together divide them)"
        )
    return f"{slots} slots × {threads} compute thread per slot"


def _wide_note(wide: int, threads, shared: bool = False) -> str:
    if not wide:
        return ""
    if shared:
        total = threads
    else:
        total = wide * threads if isinstance(threads, int) else "?"
    return (
        f"; for the 4-stream figures every engine is restarted with {wide} slots "
        f"(llama-server `--parallel {wide}`, `--threads {total}`)"
    )


def _load(values) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


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
    json_path = args.out / "results.json"
    if args.render_only:
        # The tables and RESULTS.md section again, from a run's JSON file.
        results = json.loads(json_path.read_text())
    else:
        results = asyncio.run(run(args))
    section = results_key(results["meta"])
    chart_name = "stop_latency_cdf.png" if section == "smollm2" else f"stop_latency_cdf_{section.replace('-', '_')}.png"
    chart_path = args.out / chart_name
    write_json(results, json_path)
    plot_stop_latency_cdf(results, chart_path)
    tables = Report(results).markdown()
    print(tables)
    print(f"samples: {json_path}\nchart: {chart_path}", file=sys.stderr)
    if args.results_md:
        shutil.copyfile(chart_path, BENCH_DIR / chart_name)
        write_results_section(BENCH_DIR / "RESULTS.md", section, results_section(results, tables, chart_name))
        print(f"wrote {BENCH_DIR / 'RESULTS.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
