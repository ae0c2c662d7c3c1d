"""python -m bench serve: one benchmarked server in its own process.

Runs a StoplineServer on the native engine (``--engine ours``), on the native
engine stopping only between evaluations (``--engine ours_between_steps``, the
in-step abort switched off), on the ctransformers baseline (``--engine
baseline``), or on the same loop over today's llama.cpp (``--engine
ours_llama``; ``ours_llama_shared``, its slots sharing each step; and
``ours_llama_between_steps``), on 127.0.0.1 and a free port,
and next to it, on the same event loop, a probe that sleeps 10 ms over and over
and records how late it wakes up: the event-loop lag the server's own work
causes. A separate process keeps the benchmark client's work off the server's
loop and out of its GIL.

Prints one JSON line when ready, the ``server_started`` record Stopline logs
(``"url"`` and ``"http_api"``) with the engine's settings, serves until stdin
closes (or SIGTERM/SIGINT), shuts down as the server does (its prompt cache to
disk), then writes the lag samples to ``--lag-out`` and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import threading
import time
from dataclasses import dataclass

from stopline.app import StoplineServer
from stopline.engine.llama_build import ensure_llama_library
from stopline.engine.loop import Engine
from stopline.observability import configure_logging
from stopline.protocol.vocabulary import AbortMode, Batching, EngineName
from stopline.settings import DEFAULT_CONTEXT_LENGTH, Settings


@dataclass(frozen=True)
class ServedEngine:
    """What a bench engine name loads: which native engine, stopped how."""

    kind: EngineName
    abort_mode: AbortMode
    batching: Batching = Batching.PER_SLOT
    # The llama.cpp engine on a library built from unedited llama.cpp: it stops between graph nodes only.
    unedited: bool = False


ENGINES = {
    "ours": ServedEngine(EngineName.CTRANSFORMERS, AbortMode.IN_STEP),
    "ours_between_steps": ServedEngine(EngineName.CTRANSFORMERS, AbortMode.BETWEEN_STEPS),
    "baseline": ServedEngine(EngineName.CTRANSFORMERS, AbortMode.IN_STEP),
    "ours_llama": ServedEngine(EngineName.LLAMA_CPP, AbortMode.IN_STEP),
    "ours_llama_shared": ServedEngine(EngineName.LLAMA_CPP, AbortMode.IN_STEP, Batching.SHARED),
    "ours_llama_between_steps": ServedEngine(EngineName.LLAMA_CPP, AbortMode.BETWEEN_STEPS),
    "ours_llama_unedited": ServedEngine(EngineName.LLAMA_CPP, AbortMode.IN_STEP, unedited=True),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench serve", description=__doc__)
    p.add_argument("--engine", choices=list(ENGINES), required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="compute threads per slot")
    p.add_argument("--model", default=None, help="a GGUF file (default: the embedded model, as each engine loads it)")
    p.add_argument("--lag-interval-ms", type=float, default=10.0)
    p.add_argument("--lag-out", required=True, help="where to write the lag samples (JSON)")
    p.add_argument("--log-file", required=True, help="the server's JSON log")
    p.add_argument("--redis-url", default=None, help="the store shared with other replicas (docs/deploy.md)")
    p.add_argument("--replica-id", default=None, help="this replica's name in the store")
    p.add_argument("--context", type=int, default=DEFAULT_CONTEXT_LENGTH, help="context per slot, in tokens")
    p.add_argument("--no-prompt-cache", action="store_true", help="no prompt cache across requests")
    p.add_argument("--prompt-cache-dir", default=None, help="the prompt cache's disk tier (default: the user cache)")
    p.add_argument("--cache-ram", type=int, default=None, metavar="MIB", help="the prompt cache's memory budget")
    return p.parse_args(argv)


async def lag_probe(interval_s: float, samples: list[tuple[int, int]]) -> None:
    """Sleep ``interval_s`` repeatedly; record (start ns, overshoot ns) of each sleep."""
    while True:
        start = time.monotonic_ns()
        await asyncio.sleep(interval_s)
        samples.append((start, time.monotonic_ns() - start - int(interval_s * 1e9)))


def _stop_on_stdin_eof(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    # The parent holds our stdin: EOF means it is done, or gone.
    def wait():
        sys.stdin.buffer.read()
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=wait, name="bench-stdin", daemon=True).start()


async def serve(args: argparse.Namespace) -> None:
    served = ENGINES[args.engine]
    engine = await asyncio.to_thread(
        Engine.load,
        args.model,
        engine=served.kind,
        threads=args.threads,
        progress=False,
        abort_mode=served.abort_mode,
        # The context per slot llama-server is given (bench/run.py), whatever the model.
        context_length=args.context,
        llama_library=ensure_llama_library(progress=False, edited=False) if served.unedited else None,
    )
    if args.engine == "baseline":
        from .baseline import BaselineEngine

        engine = BaselineEngine(engine)
    # The benchmark sets its own deadlines (the longest a request may ask for follows); a slow
    # engine's long prompt must not hit the defaults.
    server = StoplineServer(
        engine,
        Settings.build(
            host="127.0.0.1",
            port=0,
            workers=args.workers,
            batching=str(served.batching),
            default_timeout_s=3600,
            default_ttft_timeout_s=3600,
            redis_url=args.redis_url,
            replica_id=args.replica_id,
            prompt_cache=not args.no_prompt_cache,
            prompt_cache_dir=args.prompt_cache_dir,
            cache_ram_mib=args.cache_ram,
        ),
    )
    await server.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    _stop_on_stdin_eof(loop, stop)
    samples: list[tuple[int, int]] = []
    probe = asyncio.create_task(lag_probe(args.lag_interval_ms / 1000, samples))
    print(
        json.dumps(
            {
                "event": "server_started",
                "url": server.url,
                "http_api": server.http.base_url,
                "port": server.port,
                "engine": args.engine,
                "native_engine": str(engine.kind),
                "model": engine.name,
                "threads": engine.threads,
                "workers": args.workers,
                "prefill_chunk": engine.prefill_chunk,
                "abort_mode": str(engine.abort_mode),
            }
        ),
        flush=True,
    )
    await stop.wait()
    probe.cancel()
    await server.shutdown()
    with open(args.lag_out, "w") as f:
        json.dump({"interval_ms": args.lag_interval_ms, "samples": samples}, f)


def main(argv=None) -> int:
    args = parse_args(argv)
    with open(args.log_file, "a", buffering=1) as log_stream:
        configure_logging("info", stream=log_stream)
        asyncio.run(serve(args))
    return 0
