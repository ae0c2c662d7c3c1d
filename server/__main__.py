"""python -m server: run Stopline (by default on the embedded SmolLM2 model)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from .app import ServerConfig, StoplineServer
from .engine import DEFAULT_CONTEXT_LENGTH, Engine, EngineError
from .model import ModelFetchError
from .model_check import ModelFileError
from .vocabulary import AbortMode
from .observability import configure_logging, log


def _env(name: str, default):
    return os.environ.get(f"STOPLINE_{name}", default)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m server", description=__doc__,
                                epilog="Every flag also reads STOPLINE_<FLAG>, e.g. STOPLINE_PORT=9000.")
    p.add_argument("--host", default=_env("HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(_env("PORT", 8765)))
    p.add_argument("--http-port", type=int, default=_env("HTTP_PORT", None),
                   help="port of the HTTP API under /v1 (default: --port + 1; 0 picks a free port)")
    p.add_argument("--model", default=_env("MODEL", None), help="model file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--model-type", default=_env("MODEL_TYPE", None), help="ctransformers model type (default: llama)")
    p.add_argument("--workers", type=int, default=int(_env("WORKERS", 2)), help="generation slots")
    p.add_argument("--threads", type=int, default=int(_env("THREADS", 0)) or None,
                   help="compute threads per slot (default: cores / workers)")
    p.add_argument("--context-length", type=int, default=int(_env("CONTEXT_LENGTH", DEFAULT_CONTEXT_LENGTH)))
    p.add_argument("--prefill-chunk", type=int, default=int(_env("PREFILL_CHUNK", 0)) or None,
                   help="prompt tokens per evaluation (default: 64 with --abort-mode in_step, else 1)")
    p.add_argument("--abort-mode", default=_env("ABORT_MODE", str(AbortMode.IN_STEP)),
                   choices=[str(m) for m in AbortMode],
                   help="in_step: stop inside an evaluation, between graph nodes (falls back to between_steps "
                        "if this build cannot); between_steps: stop only between evaluations")
    p.add_argument("--max-queue", type=int, default=int(_env("MAX_QUEUE", 16)))
    p.add_argument("--allowed-origins", default=_env("ALLOWED_ORIGINS", ""),
                   help="comma-separated extra Origin values allowed on /ws and /v1 "
                        "(same-origin and localhost always are)")
    p.add_argument("--timeout", type=float, default=float(_env("TIMEOUT", 300)), help="default total timeout, s")
    p.add_argument("--ttft-timeout", type=float, default=float(_env("TTFT_TIMEOUT", 120)),
                   help="default first-token timeout, s")
    p.add_argument("--slow-consumer-grace", type=float, default=float(_env("SLOW_CONSUMER_GRACE", 10)))
    p.add_argument("--log-level", default=_env("LOG_LEVEL", "info"),
                   choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.workers)
    engine = await asyncio.to_thread(Engine.load, args.model, args.model_type, context_length=args.context_length,
                                     threads=threads, prefill_chunk=args.prefill_chunk, abort_mode=args.abort_mode)
    config = ServerConfig(
        host=args.host, port=args.port, http_port=args.http_port, workers=args.workers, max_queue=args.max_queue,
        allowed_origins=tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()),
        default_timeout_s=args.timeout, max_timeout_s=max(args.timeout, 600.0),
        default_ttft_timeout_s=args.ttft_timeout, max_ttft_timeout_s=max(args.ttft_timeout, 600.0),
        slow_consumer_grace_s=args.slow_consumer_grace)
    server = StoplineServer(engine, config)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.shutdown()


def main(argv=None) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level)
    try:
        asyncio.run(serve(args))
    except ModelFileError as exc:
        # A file that cannot work is a usage error: one line that says why and what would work.
        log.error("startup_failed", error=str(exc))
        print(f"stopline: {exc}", file=sys.stderr)
        return 2
    except (EngineError, ModelFetchError, ValueError, OSError) as exc:
        log.error("startup_failed", error=str(exc))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
