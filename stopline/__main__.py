"""python -m stopline: run Stopline (by default on the embedded SmolLM2 model).

python -m stopline cache list|prune: the converted copies of models given with --model."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import socket
import sys
import threading

from . import __version__
from . import model as embedded
from .app import ServerConfig, StoplineServer
from .auth import KeyFileError, Keyring, check_key
from .engine import DEFAULT_CONTEXT_LENGTH, Engine, EngineError
from .errors import StoplineError, UsageError
from .model import EMBEDDED_CONTEXT_LIMIT
from .model_check import WHAT_WORKS, ModelFileError
from .observability import LOG_FORMATS, configure_logging, log
from .origin import WILDCARD_HOSTS, OriginPolicy
from .protocol import MAX_SECONDS
from .tokenizer import CHAT_TEMPLATES, TokenizerError, load_chat_template
from .vocabulary import AbortMode, EngineName

# Flag value types: each raises ArgumentTypeError with the reason, which argparse
# prints as one line before exiting with status 2.


def _integer(low: int, high: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(
                f"{value} is out of range: give {low} to {high}"
                if high is not None
                else f"{value} is too small: give at least {low}"
            )
        return value

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= MAX_SECONDS:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text} is out of range: give more than 0 and at most {MAX_SECONDS:g}")
    return value


def _host(text: str) -> str:
    if not text.strip() or text.strip() == "*":
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a host; to listen on every interface, give --host 0.0.0.0 explicitly"
        )
    return text.strip()


def _one_of(values: list[str]):
    def parse(text: str) -> str:
        if text not in values:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(values)}")
        return text

    return parse


def _list(validate):
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(item.strip() for item in text.split(",") if item.strip())
        try:
            validate(items)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return items

    return parse


def _redis_url(text: str) -> str:
    from redis.asyncio.connection import parse_url  # only a deployment with a store needs it

    try:
        parse_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _chat_template(text: str) -> str:
    try:
        load_chat_template(text)
    except (OSError, TokenizerError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _replica_id(text: str) -> str:
    # It becomes part of Redis key and channel names, inside a {hash tag}.
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a replica id: give 1 to 64 letters, digits, '.', '_' or '-'")
    return text


def _api_key(text: str) -> str:
    try:
        return check_key(text.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_PORT = _integer(0, 65535)
_POSITIVE = _integer(1)

# flag, type, default, help. Every flag also reads STOPLINE_<FLAG>. Defaults come from
# ServerConfig (and through it from protocol.Limits), never repeated here.
SETTINGS = [
    ("--host", _host, ServerConfig.host, "address to listen on; 0.0.0.0 listens on every interface"),
    ("--port", _PORT, ServerConfig.port, "port to listen on (0: any free port)"),
    ("--http-port", _PORT, None, "port of the HTTP API under /v1 (default: --port + 1; 0: any free port)"),
    ("--model", str, None, "model file (default: the embedded SmolLM2-135M-Instruct); see below for what works"),
    ("--model-type", str, None, "ctransformers model type of a GGML file (default: llama)"),
    (
        "--chat-template",
        _chat_template,
        None,
        f"a Jinja chat template file, or one of {', '.join(CHAT_TEMPLATES)} (default: the model file's own, "
        "else chatml)",
    ),
    (
        "--engine",
        _one_of([str(e) for e in EngineName]),
        str(EngineName.CTRANSFORMERS),
        "ctransformers: the 2023 engine the embedded model was made for; llama.cpp: today's llama.cpp, "
        "for any GGUF it knows (built once on first use; python -m stopline.llama_build builds it ahead)",
    ),
    ("--workers", _POSITIVE, ServerConfig.workers, "generation slots: users served at once"),
    (
        "--threads",
        _POSITIVE,
        None,
        "compute threads per generation (default: every core other processes leave idle for a "
        "generation that runs alone; generations that run together share them)",
    ),
    ("--context-length", _integer(2), DEFAULT_CONTEXT_LENGTH, "tokens per slot, up to the model's limit"),
    (
        "--abort-mode",
        _one_of([str(m) for m in AbortMode]),
        str(AbortMode.IN_STEP),
        "in_step: stop inside an evaluation, between graph nodes (falls back to between_steps if this build "
        "cannot); between_steps: stop only between evaluations",
    ),
    (
        "--prefill-chunk",
        _integer(1, 512),
        None,
        "prompt tokens per evaluation (default: 64 with --abort-mode in_step, else 1)",
    ),
    ("--max-queue", _integer(0), ServerConfig.max_queue, "requests that may wait for a slot"),
    (
        "--requests-per-connection",
        _POSITIVE,
        ServerConfig.requests_per_connection,
        "live requests (running or queued) per connection",
    ),
    (
        "--requests-per-address",
        _POSITIVE,
        ServerConfig.requests_per_address,
        "live requests of all connections from one client address",
    ),
    ("--max-connections", _POSITIVE, ServerConfig.max_connections, "open WebSocket connections"),
    ("--max-header-bytes", _integer(1024), ServerConfig.max_header_bytes, "bytes a handshake request may carry"),
    (
        "--handshake-timeout",
        _seconds,
        ServerConfig.handshake_timeout_s,
        "seconds a client has to complete its handshake request",
    ),
    (
        "--bytes-per-second",
        _integer(1024),
        ServerConfig.bytes_per_second,
        "bytes of frames each connection may send a second, in bursts of one largest frame (1 MiB)",
    ),
    (
        "--allowed-origins",
        _list(lambda items: OriginPolicy.build("127.0.0.1", allowed_origins=items)),
        "",
        "comma-separated scheme://host[:port] origins allowed on /ws besides same-origin pages; * allows any",
    ),
    (
        "--allowed-hosts",
        _list(lambda items: OriginPolicy.build("127.0.0.1", allowed_hosts=items)),
        "",
        "comma-separated extra host names the server answers to (its address and localhost always are)",
    ),
    ("--timeout", _seconds, ServerConfig.default_timeout_s, "default total timeout, s"),
    ("--ttft-timeout", _seconds, ServerConfig.default_ttft_timeout_s, "default first-token timeout, s"),
    (
        "--slow-consumer-grace",
        _seconds,
        ServerConfig.slow_consumer_grace_s,
        "seconds a client may stop reading before its request is cancelled",
    ),
    (
        "--redis-url",
        _redis_url,
        None,
        "redis://host:port/db of the store shared by replicas behind a load balancer (docs/deploy.md); "
        "default: none, this process alone",
    ),
    ("--status-ttl", _POSITIVE, ServerConfig.status_ttl_s, "seconds a generation's status stays in the shared store"),
    ("--replica-id", _replica_id, None, "this replica's name in the shared store (default: <hostname>-<port>)"),
    (
        "--api-keys-file",
        str,
        None,
        "JSON Lines file of API keys (hashes), their users and limits; re-read on SIGHUP; "
        "see 'stopline keys add' (default: none)",
    ),
    ("--metrics-key", _api_key, None, "the key /metrics asks for as 'Authorization: Bearer' (default: open)"),
    ("--log-level", _one_of(["debug", "info", "warning", "error"]), "info", "log level"),
    (
        "--log-format",
        _one_of(list(LOG_FORMATS)),
        "auto",
        "text: a short line per event; json: one JSON object per line; auto: text on a terminal, else json",
    ),
]

# Subcommands: `python -m stopline NAME ...` runs COMMANDS[NAME](argv) instead of the server.
COMMANDS: dict = {}


def env_name(flag: str) -> str:
    return "STOPLINE_" + flag.lstrip("-").replace("-", "_").upper()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m stopline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "Every flag also reads STOPLINE_<FLAG>, e.g. STOPLINE_PORT=9000.\n\n"
            "Model files: " + WHAT_WORKS + ". A file that cannot work is refused before loading, "
            "with one line that says why."
        ),
    )
    for flag, kind, default, help_text in SETTINGS:
        raw = os.environ.get(env_name(flag))
        if raw is not None:
            # An environment variable is checked like the flag, and named in the error.
            try:
                default = kind(raw)
            except argparse.ArgumentTypeError as exc:
                p.error(f"{env_name(flag)}={raw!r}: {exc}")
        elif kind is not str and isinstance(default, str):
            default = kind(default)
        shown = "" if default in (None, "") or "default:" in help_text else f" (default: {default})"
        p.add_argument(flag, type=kind, default=default, help=help_text + shown)
    # Repeatable, so outside SETTINGS; the environment variable holds a comma-separated list.
    raw_keys = os.environ.get("STOPLINE_API_KEYS", "")
    try:
        env_keys = [_api_key(key) for key in raw_keys.split(",") if key.strip()]
    except argparse.ArgumentTypeError as exc:
        p.error(f"STOPLINE_API_KEYS: {exc}")  # the message never holds the value
    p.add_argument(
        "--api-key",
        dest="api_keys",
        metavar="KEY",
        action="append",
        type=_api_key,
        default=env_keys,
        help="an API key that may generate, without limits; repeatable (also STOPLINE_API_KEYS=k1,k2)",
    )
    p.add_argument("--version", action="version", version=f"stopline {__version__}")
    args = p.parse_args(argv)
    try:
        Keyring(args.api_keys, args.api_keys_file)  # checked now, before the model loads
    except KeyFileError as exc:
        p.error(f"argument --api-keys-file: {exc}")
    if args.model is None and args.context_length > EMBEDDED_CONTEXT_LIMIT:
        p.error(
            f"argument --context-length: {args.context_length} exceeds the embedded model's limit "
            f"of {EMBEDDED_CONTEXT_LIMIT}"
        )
    if args.model_type is not None and args.engine != EngineName.CTRANSFORMERS:
        p.error(f"argument --model-type: a GGML file's type, which only --engine {EngineName.CTRANSFORMERS} loads")
    if args.prefill_chunk and args.prefill_chunk > args.context_length:
        p.error(f"argument --prefill-chunk: {args.prefill_chunk} exceeds --context-length {args.context_length}")
    return args


def bind_ports(args: argparse.Namespace) -> None:
    """Take both ports before the model loads, so that a port in use fails at once.
    Raises UsageError naming the flag."""
    args.sock = _bind("--port", args.host, args.port)
    http_port = args.http_port
    flag = "--http-port"
    if http_port is None:
        http_port = args.port + 1 if args.port else 0
        flag = "--http-port (by default --port + 1)"
    try:
        args.http_sock = _bind(flag, args.host, http_port)
    except UsageError:
        args.sock.close()
        raise


def _bind(flag: str, host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise UsageError(f"--host: cannot resolve {host!r}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise UsageError(f"{flag}: cannot listen on {where}: {exc.strerror}") from None
    sock.setblocking(False)
    return sock


async def serve(args: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signalled: list[int] = []

    def on_signal(sig: int) -> None:
        signalled.append(sig)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    servers: list[StoplineServer] = []

    # SIGHUP reads the keys file again; one that comes while the model loads has nothing to reload yet.
    def on_hangup() -> None:
        for server in servers:
            server.reload_keys()

    loop.add_signal_handler(signal.SIGHUP, on_hangup)

    if args.host in WILDCARD_HOSTS:
        log.warning("listening_on_every_interface", host=args.host)
    if "*" in args.allowed_origins:
        log.warning("any_origin_allowed", detail="any web page may drive this server")
    # Without --threads, each generation takes the cores the others leave (Scheduler).
    threads = args.threads or _usable_cores()
    loaded = _in_daemon_thread(
        loop,
        lambda: Engine.load(
            args.model,
            args.model_type,
            engine=args.engine,
            context_length=args.context_length,
            threads=threads,
            prefill_chunk=args.prefill_chunk,
            abort_mode=args.abort_mode,
        ),
    )
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([loaded, stopped], return_when=asyncio.FIRST_COMPLETED)
    if not loaded.done():
        # Loading runs in C and cannot be interrupted; the process ends without it, and
        # without any partial download or conversion, whose progress bars stop here.
        stopped.cancel()
        embedded.abandon()
        log.info("startup_interrupted", signal=signal.Signals(signalled[0]).name)
        return 128 + signalled[0]
    stopped.cancel()
    engine = loaded.result()
    if args.chat_template is not None:
        engine.tokenizer = engine.tokenizer.with_chat_template(load_chat_template(args.chat_template))
    config = ServerConfig(
        host=args.host,
        port=args.sock.getsockname()[1],
        http_port=args.http_sock.getsockname()[1],
        workers=args.workers,
        threads=args.threads,
        max_queue=args.max_queue,
        allowed_origins=args.allowed_origins,
        allowed_hosts=args.allowed_hosts,
        requests_per_connection=args.requests_per_connection,
        requests_per_address=args.requests_per_address,
        max_connections=args.max_connections,
        max_header_bytes=args.max_header_bytes,
        handshake_timeout_s=args.handshake_timeout,
        bytes_per_second=args.bytes_per_second,
        default_timeout_s=args.timeout,
        max_timeout_s=max(args.timeout, ServerConfig.max_timeout_s),
        default_ttft_timeout_s=args.ttft_timeout,
        max_ttft_timeout_s=max(args.ttft_timeout, ServerConfig.max_ttft_timeout_s),
        slow_consumer_grace_s=args.slow_consumer_grace,
        redis_url=args.redis_url,
        status_ttl_s=args.status_ttl,
        replica_id=args.replica_id,
        api_keys=tuple(args.api_keys),
        api_keys_file=args.api_keys_file,
        metrics_key=args.metrics_key,
    )
    server = StoplineServer(engine, config)
    servers.append(server)
    await server.start(sock=args.sock, http_sock=args.http_sock)
    await stop.wait()
    await server.shutdown()
    return 0


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the cores this process may run on
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _in_daemon_thread(loop: asyncio.AbstractEventLoop, work) -> asyncio.Future:
    """Run ``work`` in a daemon thread, which does not keep the process alive if asked to stop."""
    future = loop.create_future()

    def settle(outcome, exc) -> None:
        if future.done():
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(outcome)

    def run() -> None:
        try:
            outcome, exc = work(), None
        except BaseException as error:  # handed to the event loop
            outcome, exc = None, error
        if isinstance(exc, StopIteration):
            # A Future cannot hold a StopIteration (set_exception raises TypeError, and the
            # future would never settle): hand over a RuntimeError that says what it was.
            exc = RuntimeError(f"StopIteration escaped while loading: {exc!r}")
        try:
            loop.call_soon_threadsafe(settle, outcome, exc)
        except RuntimeError:
            pass  # the loop has closed: startup was interrupted

    threading.Thread(target=run, name="stopline-load", daemon=True).start()
    return future


def _keys(argv: list[str]) -> int:
    from .keys import main as keys_main

    return keys_main(argv)


# ``stopline NAME …``: commands beside the server, each its own parser.
COMMANDS["keys"] = _keys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]](argv[1:])
    log_format = "json"
    try:
        args = parse_args(argv)
        log_format = configure_logging(args.log_level, args.log_format)
        bind_ports(args)
        return asyncio.run(serve(args))
    except UsageError as exc:
        # Like a bad flag value: one line, before anything was loaded or logged.
        print(f"stopline: {exc}", file=sys.stderr)
        return 2
    except ModelFileError as exc:
        # A file that cannot work is a usage error: one line that says why and what would work
        # (on a terminal, that line alone; a log reader gets it as an event too).
        if log_format == "json":
            log.error("startup_failed", error=str(exc))
        print(f"stopline: {exc}", file=sys.stderr)
        return 2
    except (StoplineError, EngineError, OSError) as exc:
        # Expected: the model could not be fetched, built or loaded, or the machine refused a file.
        log.error("startup_failed", error=str(exc))
        return 1
    except KeyboardInterrupt:  # before the signal handlers were installed
        return 128 + signal.SIGINT
    except Exception as exc:  # a bug: one event, with its traceback, and the process ends
        log.exception("startup_failed", error=f"{type(exc).__name__}: {exc}")
        return 1


def cache_command(argv: list[str]) -> int:
    """``stopline cache list|prune [--keep N]``: the converted copies of models given with --model."""
    p = argparse.ArgumentParser(
        prog="python -m stopline cache",
        description=(
            f"Models given with --model are converted once into {embedded.converted_dir()}; the "
            f"{embedded.converted_keep()} most recently used copies are kept (STOPLINE_CONVERTED_KEEP)."
        ),
    )
    p.add_argument("action", choices=["list", "prune"], help="list the copies, or delete those beyond --keep")
    p.add_argument(
        "--keep", type=_integer(0), default=None, help="copies to keep when pruning (default: STOPLINE_CONVERTED_KEEP)"
    )
    args = p.parse_args(argv)
    if args.action == "prune":
        for path in embedded.prune_converted(args.keep):
            print(f"deleted {path}")
        return 0
    files = embedded.converted_files()
    for path in files:
        print(f"{path.stat().st_size / 1e6:10.1f} MB  {path}")
    total_mb = sum(p.stat().st_size for p in files) / 1e6
    print(f"{len(files)} converted copies, {total_mb:.1f} MB in {embedded.converted_dir()}")
    return 0


COMMANDS["cache"] = cache_command


def run() -> None:
    """The ``stopline`` console script and ``python -m stopline``."""
    code = main()
    sys.stdout.flush()
    # A model still loading in a daemon thread would hold up a normal exit; nothing else is left to clean up.
    os._exit(code) if code >= 128 else sys.exit(code)


if __name__ == "__main__":
    run()
