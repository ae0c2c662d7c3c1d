"""python -m bench run: how fast Stop stops, on every server of ``--engines``.

Starts each server in its own process on 127.0.0.1 and a free port, on the same
cores and model file: Stopline on its engines (``python -m bench serve``), the
same server code on ctransformers' generate() stopped by a threading.Event
between tokens ("baseline"), and llama.cpp's llama-server. Every scenario of
``bench/scenarios.py`` runs against each server whose driver can take part,
the servers taking turns part by part. ``--url`` measures a Stopline server
that is already running. The scenario cancel_via_replica starts servers of its
own: redis-server (from the PATH) and two replicas of "ours" sharing it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import math
import os
import random
import shlex
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from stopline.engine import model as embedded
from stopline.engine.llama_build import ensure_llama_library
from stopline.protocol.vocabulary import EngineName, Reason
from stopline.settings import DEFAULT_CONTEXT_LENGTH

from .drivers.base import Driver
from .drivers.llama_server import ENGINE as LLAMA_SERVER
from .drivers.llama_server import LlamaServerDriver, call_json, ensure_llama_server
from .drivers.stopline import ServedStopline, StoplineDriver
from .inprocess import llama_native, native, random_llama
from .machine import CpuMeter, load_average, machine
from .prompts import PromptMaker
from .report import BENCH_DIR, Report, plot_stop_latency_cdf, results_key, write_json, write_results_section
from .scenarios import ALL_SCENARIOS, CANCEL_VIA_REPLICA, DECODE_CONCURRENT, LONG_SCENARIOS, Bench, Plan
from .scenarios import cancel_via_replica as sample_cancel_via_replica
from .servers import RedisServer
from .servers.serve import ENGINES as SERVED_ENGINES

ENGINES = tuple(SERVED_ENGINES) + (LLAMA_SERVER,)
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
    # About 4.5 GB, for a GPU (python -m bench gpu-check).
    "llama-8b-shaped": BenchModel(
        f"{random_llama.TITLE_8B} (Q4_0)", lambda: random_llama.random_llama_8b_path(progress=True), False
    ),
}
# The sampling flags: their names in the plan (whose defaults they take), and what they mean.
PLAN_FLAGS = {
    "--requests": ("requests", "samples per scenario per engine (unlimited with --duration)"),
    "--long-requests": ("long_requests", "samples of the long scenarios (default: the smaller of --requests and 6)"),
    "--duration": ("duration_s", "seconds per scenario per engine; a scenario ends at this or at --requests"),
    "--concurrency": ("concurrency", "streams in the concurrent throughput run (default: one per slot)"),
    "--parallel": ("parallel", "requests in flight at once in the prefill, decode and timeout scenarios"),
    "--short-prompt-tokens": ("short_tokens", ""),
    "--long-prompt-tokens": ("long_tokens", ""),
    "--decode-tokens": ("decode_tokens", "max_tokens of each throughput request"),
    "--throughput-reps": ("throughput_reps", ""),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    what = p.add_argument_group("what to measure")
    what.add_argument("--engines", default="ours,ours_between_steps,baseline", help=f"any of {','.join(ENGINES)}")
    what.add_argument(
        "--model",
        choices=list(MODELS),
        default="smollm2",
        help="smollm2: the embedded SmolLM2-135M-Instruct; gemma3: Gemma 3 270M; llama-1b-shaped: Llama 3.2 1B's "
        "shapes with random weights (the last two on the llama.cpp engines and llama-server only)",
    )
    what.add_argument("--scenarios", default=",".join(ALL_SCENARIOS), help=f"any of {','.join(ALL_SCENARIOS)}")
    what.add_argument("--url", help="measure this running Stopline server (ws://host:port/ws) instead")
    what.add_argument("--llama-server", metavar="PATH", help="the llama-server binary for the llama-server engine")
    what.add_argument(
        "--build-llama-server", action="store_true", help="build llama-server from a pinned source (once)"
    )
    samples = p.add_argument_group("samples")
    plan = Plan()
    for flag, (dest, words) in PLAN_FLAGS.items():
        default = getattr(plan, dest) if dest not in ("requests", "long_requests") else None
        kind = float if dest == "duration_s" else int
        samples.add_argument(flag, dest=dest, type=kind, default=default, help=words or None)
    samples.add_argument("--rounds", type=int, default=3, help="parts of each scenario, the engines taking turns")
    samples.add_argument("--seed", type=int, default=0)
    servers = p.add_argument_group("the servers started")
    servers.add_argument("--workers", type=int, default=2, help="slots of each server")
    servers.add_argument("--threads", type=int, default=1, help="compute threads per slot")
    servers.add_argument(
        "--shared-threads",
        action="store_true",
        help="--threads is what each server's generations share (Stopline's default policy), not per slot",
    )
    servers.add_argument(
        "--context", type=int, default=DEFAULT_CONTEXT_LENGTH, help="context per slot, in tokens, of every server"
    )
    servers.add_argument(
        "--gpu-layers",
        default=None,
        help="llama-server's --n-gpu-layers (default: its own); Stopline offloads every layer where it has a GPU",
    )
    servers.add_argument("--cpus", help="the cores every server is confined to, e.g. 0,1 (default: all available)")
    servers.add_argument(
        "--wide-workers",
        type=int,
        default=0,
        help=f"then restart every server with this many slots for {' and '.join(WIDE_SCENARIOS)} (0: off)",
    )
    inprocess = p.add_argument_group("in-process measurements, first")
    inprocess.add_argument("--native", action="store_true", help="the ctransformers loop (bench/inprocess/native.py)")
    inprocess.add_argument("--abort-cycles", type=int, default=500, help="aborts per thread setting with --native")
    inprocess.add_argument(
        "--llama-native", action="store_true", help="the llama.cpp engine: abort storms, longest nodes, greedy output"
    )
    inprocess.add_argument("--llama-abort-cycles", type=int, default=1000, help="aborts per storm (1 and 4 streams)")
    inprocess.add_argument("--greedy-prompts", type=int, default=20, help="prompts compared greedy with llama-server")
    output = p.add_argument_group("output")
    output.add_argument("--out", type=Path, default=BENCH_DIR / "out", help="output directory (default bench/out)")
    output.add_argument(
        "--results-md", action="store_true", help="also write this run's section of bench/RESULTS.md and its chart"
    )
    args = p.parse_args(argv)
    if unknown := set(args.scenarios.split(",")) - set(ALL_SCENARIOS):
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
    args.plan = Plan(**{dest: getattr(args, dest) for dest, _ in PLAN_FLAGS.values()})
    return args


def planned_samples(bench: Bench, scenarios: list[str], drivers: list[Driver], replicas: bool) -> int | None:
    plan = bench.plan
    if not math.isfinite(plan.requests):
        return None
    total = int(plan.requests) if CANCEL_VIA_REPLICA in scenarios and replicas else 0
    for driver in drivers:
        for scenario in scenarios:
            if scenario == CANCEL_VIA_REPLICA or not bench.supports(driver, scenario):
                continue
            counts = sum(plan.stream_counts(driver.slots)) if scenario == "throughput" else 1
            total += int(plan.samples(scenario)) * counts
    return total


async def start_servers(args, model: BenchModel, workers: int, out_dir: Path, prompts: PromptMaker) -> list[Driver]:
    """The servers of ``--engines``, started with ``workers`` slots each, all confined to the same cores;
    their logs in ``out_dir``."""
    gguf = model.gguf()
    out_dir.mkdir(parents=True, exist_ok=True)
    drivers: list[Driver] = []
    for engine in args.engines.split(","):
        if engine == LLAMA_SERVER:
            # As many compute threads in all as ours has over its slots, or shares among them.
            threads = args.threads if args.shared_threads else workers * args.threads
            binary = Path(args.llama_server) if args.llama_server else ensure_llama_server()
            if not (binary.is_file() and os.access(binary, os.X_OK)):
                raise SystemExit(f"--llama-server {binary}: not an executable file")
            tokenize = lambda messages: prompts.tokenizer.encode(prompts.tokenizer.render_chat(messages))  # noqa: E731
            context = args.context
            peer = LlamaServerDriver(binary, gguf, out_dir, workers, threads, context, tokenize, args.cpu_set)
            peer.gpu_layers = args.gpu_layers
            drivers.append(peer)
            continue
        if SERVED_ENGINES[engine].unedited:
            # Built here, once, rather than while the benchmark waits for the server to start.
            ensure_llama_library(edited=False)
        # The ctransformers engines load the embedded model their own way (a converted copy).
        path = gguf if SERVED_ENGINES[engine].kind is EngineName.LLAMA_CPP else None
        extra = () if args.context == DEFAULT_CONTEXT_LENGTH else ("--context", str(args.context))
        served = ServedStopline(engine, out_dir, workers, args.threads, extra_args=extra, model=path, cpus=args.cpu_set)
        drivers.append(served)
    print(f"starting {', '.join(d.name for d in drivers)} with {workers} slots ...", file=sys.stderr)
    await asyncio.gather(*(d.start() for d in drivers))
    return drivers


def processes(drivers: list[Driver]) -> list[int]:
    # This one and the servers': the CPU use that is the benchmark's own.
    return [os.getpid()] + [d.pid for d in drivers if d.pid]


def prompt_maker(args, rng: random.Random) -> PromptMaker:
    """Prompts tokenized as the model under test tokenizes them: SmolLM2's with the embedded tokenizer,
    which both of its engines use; any other model with llama.cpp's own vocabulary and template."""
    if args.model == "smollm2":
        return PromptMaker(embedded.embedded_tokenizer(progress=False), rng)
    from stopline import _core
    from stopline.engine.tokenizer import LlamaTokenizer

    _core.load_llama_library(str(ensure_llama_library(progress=False)))
    return PromptMaker(LlamaTokenizer(_core.LlamaModel(str(MODELS[args.model].gguf()))), rng)


def pause_all_but(drivers: list[Driver], measured: Driver | None) -> None:
    """Pause every started server but ``measured`` (None: continue them all).

    An idle server still wakes up (its event loop's timers); each wake-up can preempt one of a
    multi-threaded server's threads, and its spinning partners then wait out the time slice."""
    for driver in drivers:
        driver.pause(measured is not None and driver is not measured)


async def run_scenarios(bench: Bench, scenarios: list[str], drivers: list[Driver], rounds: int) -> None:
    """Scenario by scenario; within each, the servers take turns part by part, in alternating order,
    so that a drift in the machine's load favours none of them."""
    try:
        for scenario in scenarios:
            for part in range(rounds):
                for driver in drivers if part % 2 == 0 else reversed(drivers):
                    pause_all_but(drivers, driver)
                    await bench.run(scenario, driver, part, rounds)
    finally:
        pause_all_but(drivers, None)


async def calibrate(bench: Bench, meta: dict, drivers: list[Driver], long: bool) -> None:
    for driver in drivers:
        if bench.progress is not None:
            bench.progress.set_description(f"calibrating [{driver.name}]")
        pause_all_but(drivers, driver)
        try:
            calibration = await bench.calibrate(driver, long)
        finally:
            pause_all_but(drivers, None)
        info = {"slots": driver.slots, "calibration": calibration}
        info |= {k: v for k, v in driver.info.items() if k in ("threads", "prefill_chunk", "command", "source")}
        meta["targets"][driver.name] = info


async def run(args) -> dict:
    plan, model = args.plan, MODELS[args.model]
    scenarios = [s for s in ALL_SCENARIOS if s in args.scenarios.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    prompts = prompt_maker(args, rng)
    load_at_start = load_average()
    native_results = llama_results = None
    if args.native and model.ctransformers:
        print("measuring the native loop in-process ...", file=sys.stderr)
        native_results = await asyncio.to_thread(native.run, args.abort_cycles)
    if args.llama_native:
        print("measuring the llama.cpp engine in-process ...", file=sys.stderr)
        llama_results = await asyncio.to_thread(measure_llama_native, args, model)
    if args.url:
        drivers = [await StoplineDriver.attach(args.url)]
    else:
        drivers = await start_servers(args, model, args.workers, args.out, prompts)
    started = list(drivers)
    meta = {
        "command": "python -m bench run " + shlex.join(sys.argv[2 if sys.argv[1:2] == ["run"] else 1 :]),
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
        "results_json": shown(args.out / "results.json"),
    }
    # Other work's CPU use can be told apart only when every server is ours to watch.
    cpu = None if args.url else CpuMeter(processes(drivers))
    bench = Bench(plan, prompts, rng, None, cpu)
    main_scenarios = [s for s in scenarios if not (args.wide_workers and s == DECODE_CONCURRENT)]
    total = planned_samples(bench, main_scenarios, drivers, not args.url)
    bench.progress = tqdm(total=total, file=sys.stderr, unit="sample", dynamic_ncols=True)
    try:
        await calibrate(bench, meta, drivers, long=bool(set(LONG_SCENARIOS) & set(scenarios)))
        await run_scenarios(bench, main_scenarios, drivers, args.rounds)
        peer = next((d for d in drivers if d.name == LLAMA_SERVER), None)
        if llama_results is not None and peer is not None and args.greedy_prompts > 0:
            bench.progress.set_description("greedy agreement with llama-server")
            llama_results["greedy"] = await greedy_agreement(args, model, prompts, peer)
        wide = [s for s in WIDE_SCENARIOS if s in scenarios]
        if args.wide_workers and wide and not args.url:
            await asyncio.gather(*(d.stop() for d in drivers))
            # Logs of their own: the first servers' logs are read after the run.
            drivers = await start_servers(args, model, args.wide_workers, args.out / "wide", prompts)
            started += drivers
            if cpu is not None:
                cpu.pids = processes(drivers)
            bench.plan = dataclasses.replace(plan, streams=(args.wide_workers,))
            meta["wide"] = {"targets": {}}
            await calibrate(bench, meta["wide"], drivers, long=False)
            await run_scenarios(bench, wide, drivers, args.rounds)
        if CANCEL_VIA_REPLICA in scenarios and not args.url:
            await asyncio.gather(*(d.stop() for d in drivers))  # the machine to the replicas alone
            bench.progress.set_description(CANCEL_VIA_REPLICA)
            meta[CANCEL_VIA_REPLICA] = await cancel_via_replica(bench, args)
    finally:
        bench.progress.close()
        await asyncio.gather(*(d.stop() for d in drivers))
    meta["load_average_end"] = load_average()
    results = {"meta": meta, "samples": bench.samples, "runs": bench.runs, "lag": {}, "server_errors": {}}
    results |= {"native": native_results, "llama_native": llama_results}
    for driver in started:
        if errors := attach_server_log(bench.samples, driver):
            results["server_errors"][driver.name] = results["server_errors"].get(driver.name, 0) + errors
        if lag := lag_of(driver):
            # The wide servers' probe samples join their engine's.
            if driver.name in results["lag"]:
                results["lag"][driver.name]["under_load_ms"] += lag["under_load_ms"]
            else:
                results["lag"][driver.name] = lag
    return results


def measure_llama_native(args, model: BenchModel) -> dict:
    """The llama.cpp engine in-process: abort storms (in child processes) and its longest graph nodes."""
    gguf = model.gguf()
    storms = [
        llama_native.storm_in_child(gguf, args.llama_abort_cycles, streams, args.seed)
        for streams in (1, llama_native.STORM_STREAMS)
    ]
    nodes = llama_native.longest_nodes(llama_native.load(gguf, args.threads), args.long_tokens)
    return {"storms": storms, "nodes": nodes, "load_average": load_average()}


async def greedy_agreement(args, model: BenchModel, prompts: PromptMaker, peer: LlamaServerDriver) -> dict:
    """The same prompts greedy on our llama.cpp engine (in-process) and on llama-server."""
    engine = await asyncio.to_thread(llama_native.load, model.gguf(), args.threads)
    rows = []
    for _ in range(args.greedy_prompts):
        prompt = peer.tokenize(prompts.story(args.short_tokens))
        ours = await asyncio.to_thread(llama_native.greedy_ours, engine, prompt, llama_native.GREEDY_TOKENS)
        answer = await call_json(
            peer.http_url, "/completion", llama_native.greedy_body(prompt, llama_native.GREEDY_TOKENS)
        )
        rows.append(llama_native.compare_greedy(ours, answer, engine.model.token_bytes))
    return {"tokens_per_prompt": llama_native.GREEDY_TOKENS, "rows": rows}


async def cancel_via_replica(bench: Bench, args) -> dict:
    """redis-server and two replicas of ours sharing it; the first owns the generations."""
    redis_server = RedisServer(args.out / "redis").start()
    replicas = [
        ServedStopline(
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
        await sample_cancel_via_replica(bench, owner, other)
    finally:
        await asyncio.gather(*(r.stop() for r in replicas))
        redis_server.kill()
    return {"replicas": 2, "redis": "redis-server on 127.0.0.1 (loopback)", "workers": args.workers}


def attach_server_log(samples: list[dict], driver: Driver) -> int:
    """Add what only the server's end-of-request log knows: prompt tokens evaluated, tokens wasted.
    Returns how many requests the server ended with an error, which a scenario discards."""
    ends = driver.request_log()
    for sample in samples:
        end = ends.get(sample.get("id")) if sample["target"] == driver.name else None
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
        if sample.get("reason") == Reason.CLIENT_DISCONNECTED and sample.get("server_ms") is None:
            # A client that left: only the log says how the server stopped.
            sample.update(server_ms=end.get("cancel_latency_ms"), tokens_after_cancel=end.get("tokens_after_cancel"))
    return sum(1 for end in ends.values() if end.get("event") == "generation_error")


def lag_of(driver: Driver) -> dict | None:
    """The server's event-loop probe while a scenario ran against it (its idle time left out)."""
    if not (samples := driver.lag_samples()):
        return None
    by_scenario: dict[str, list[float]] = {}
    for name, start, end in driver.windows:
        by_scenario.setdefault(name, []).extend(over / 1e6 for t, over in samples if start <= t < end)
    under_load = [over for overs in by_scenario.values() for over in overs]
    return {
        "interval_ms": 10.0,
        "under_load_ms": under_load,
        "by_scenario_ms": by_scenario,
        "windows": driver.windows,
        "samples": samples,
    }


def shown(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(BENCH_DIR.parent)) if path.is_relative_to(BENCH_DIR.parent) else str(path)


def publish(results: dict, out: Path, results_md: bool) -> None:
    """The JSON file, the chart and the tables; with ``results_md``, the run's section of RESULTS.md."""
    json_path, section = out / "results.json", results_key(results["meta"])
    chart_name = "stop_latency_cdf.png" if section == "smollm2" else f"stop_latency_cdf_{section.replace('-', '_')}.png"
    write_json(results, json_path)
    plot_stop_latency_cdf(results, out / chart_name)
    report = Report(results)
    tables = report.markdown()
    print(tables)
    print(f"samples: {json_path}\nchart: {out / chart_name}", file=sys.stderr)
    if results_md:
        shutil.copyfile(out / chart_name, BENCH_DIR / chart_name)
        path = BENCH_DIR / "RESULTS.md"
        write_results_section(path, section, report.results_section(tables, chart_name))
        # A run without the in-process measurements leaves the last run's that had them.
        if in_process := report.in_process_section():
            write_results_section(path, f"{section}-in-process", in_process, after=section)
        print(f"wrote {path}", file=sys.stderr)


def main(argv=None) -> int:
    args = parse_args(argv)
    publish(asyncio.run(run(args)), args.out, args.results_md)
    return 0


def render(argv=None) -> int:
    """python -m bench render: the tables, chart and RESULTS.md section again, from a run's JSON file."""
    p = argparse.ArgumentParser(prog="python -m bench render", description=render.__doc__)
    p.add_argument("--out", type=Path, default=BENCH_DIR / "out", help="the run's directory, with results.json")
    p.add_argument("--results-md", action="store_true", help="also write its section of bench/RESULTS.md")
    args = p.parse_args(argv)
    publish(json.loads((args.out / "results.json").read_text()), args.out, args.results_md)
    return 0
