"""python -m stopline: run Stopline (by default on the embedded SmolLM2 model).

python -m stopline cache list|prune: the converted copies of models given with --model.
python -m stopline models [rm NAME]: the GGUF models in the Hugging Face hub's cache (--model hf:...).
python -m stopline keys add|list|revoke|path: the API keys file.
python -m stopline --help-markdown: every flag as the Markdown table of docs/configuration.md."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import threading
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from . import __version__
from .auth import KeyFileError, Keyring
from .engine import conversion
from .engine import model as embedded
from .engine.hub import HubError, HubModelName, is_hub_model, models_command
from .engine.hub import resolve as resolve_hub_model
from .engine.model import EMBEDDED_CONTEXT_LIMIT
from .engine.model_check import WHAT_WORKS, ModelFileError, models_in_folder
from .engine.tokenizer import TokenizerError, load_chat_template
from .observability import configure_logging, log
from .protocol.errors import StoplineError, UsageError
from .protocol.origin import WILDCARD_HOSTS
from .residency import Loader
from .settings import FLAGS, Settings, add_flags, converted_keep, flags_table, integer

if TYPE_CHECKING:
    from .app import StoplineServer

# Subcommands: `python -m stopline NAME ...` runs COMMANDS[NAME](argv) instead of the server.
COMMANDS: dict = {}


class _Parser(argparse.ArgumentParser):
    """A bad value for a flag (or for its environment variable) is one line that names
    it: the usage, 30 lines of every flag, would bury it. Other mistakes, such as an
    unknown flag, still show the usage."""

    def error(self, message: str) -> NoReturn:
        if message.startswith(("argument ", "STOPLINE_")):
            self.exit(2, f"{self.prog}: error: {message}\n")
        super().error(message)


class _PrintAndExit(argparse.Action):
    """Like --version: print ``text`` and exit, before the ports are taken or a model loads."""

    def __init__(self, option_strings, dest, text: str, help: str) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)
        self.text = text

    def __call__(self, parser: argparse.ArgumentParser, namespace, values, option_string=None) -> NoReturn:
        sys.stdout.write(self.text)
        parser.exit(0)


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(
        prog="python -m stopline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "Every flag also reads STOPLINE_<FLAG>, e.g. STOPLINE_PORT=9000.\n\n"
            "Model files: " + WHAT_WORKS + ". A file that cannot work is refused before loading, "
            "with one line that says why."
        ),
    )
    repeated_defaults = add_flags(p)
    p.add_argument("--version", action="version", version=f"stopline {__version__}")
    p.add_argument(
        "--help-markdown",
        action=_PrintAndExit,
        text=flags_table(),
        help="print every flag as a Markdown table (docs/configuration.md holds it) and exit",
    )
    args = p.parse_args(argv)
    for setting, default in repeated_defaults.items():
        given = getattr(args, setting)
        setattr(args, setting, tuple(given) if given is not None else default)
    if args.chat_template is not None:
        try:
            load_chat_template(args.chat_template)  # compiled now, before the model loads
        except (OSError, TokenizerError) as exc:
            p.error(f"argument --chat-template: {exc}")
    try:
        Keyring(args.api_keys, args.api_keys_file)  # checked now, before the model loads
    except KeyFileError as exc:
        p.error(f"argument --api-keys-file: {exc}")
    args.models = tuple(_each_model(p, args.models))
    for model in args.models:
        if is_hub_model(model):
            try:
                HubModelName.parse(model)  # its form now; the hub is asked once the ports are taken
            except HubError as exc:
                p.error(f"argument --model: {exc}")
    if not args.models and args.context_length and args.context_length > EMBEDDED_CONTEXT_LIMIT:
        p.error(
            f"argument --context-length: {args.context_length} exceeds the embedded model's limit "
            f"of {EMBEDDED_CONTEXT_LIMIT}"
        )
    try:
        settings_from(args)  # the rules between settings
    except UsageError as exc:
        p.error(str(exc))
    return args


def _each_model(parser: argparse.ArgumentParser, models: tuple[str, ...]):
    """The models named, a folder standing for the models in it, as if each were named."""
    for model in models:
        if is_hub_model(model) or not Path(model).is_dir():
            yield model
            continue
        found = models_in_folder(Path(model))
        if not found:
            parser.error(f"argument --model: the folder {model} holds no GGUF model")
        yield from (str(path) for path in found)


def settings_from(args: argparse.Namespace) -> Settings:
    """The settings the flags (and their environment variables) give."""
    return Settings.build(
        **{flag.setting: getattr(args, flag.setting) for flag in FLAGS}, api_keys=tuple(args.api_keys)
    )


def resolve_model(settings: Settings) -> Settings:
    """The settings with each model named on the hub (``--model hf:…``) as a file in the hub's cache,
    downloaded if need be, served under the name it was asked for unless --served-model-name
    names others. Raises HubError (a UsageError) with one line."""
    if not any(is_hub_model(model) for model in settings.models):
        return settings
    paths, names = [], []
    for model in settings.models:
        if is_hub_model(model):
            resolved = resolve_hub_model(model)
            paths.append(str(resolved.path))
            names.append(resolved.name)
        else:
            # The name its engine would give it (Engine.load): the file's, without the extension.
            paths.append(model)
            names.append(Path(model).stem)
    return replace(settings, models=tuple(paths), served_model_names=settings.served_model_names or tuple(names))


def bind_ports(settings: Settings) -> tuple[socket.socket, socket.socket]:
    """Take both ports before the model loads, so that a port in use fails at once.
    Raises UsageError naming the flag."""
    sock = _bind("--port", settings.host, settings.port)
    flag = "--http-port" if settings.http_port is not None else "--http-port (by default --port + 1)"
    try:
        return sock, _bind(flag, settings.host, settings.http_port_or_default)
    except UsageError:
        sock.close()
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


async def serve(settings: Settings, sock: socket.socket, http_sock: socket.socket) -> int:
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

    if settings.host in WILDCARD_HOSTS:
        log.warning("listening_on_every_interface", host=settings.host)
    if "*" in settings.allowed_origins:
        log.warning("any_origin_allowed", detail="any web page may drive this server")
    # Imported here, not at the top: the flags (and --help) need no compiled engine. And only
    # once the signal handlers are in: a Ctrl-C during the import ends the start as one would
    # during the load.
    from .app import StoplineServer
    from .engine.loop import Engine, file_memory_bytes

    # Without --threads, each generation takes the cores the others leave (Scheduler).
    # Each model by its own engine, with slots of its own; none named: the embedded model.
    def load(model: str | None) -> Engine:
        return Engine.load(
            model,
            settings.model_type,
            engine=settings.engine,
            context_length=settings.context_length,
            threads=settings.threads,
            prefill_chunk=settings.prefill_chunk,
            abort_mode=settings.abort_mode,
            sequences=settings.workers,
            gpu_layers=settings.gpu_layers,
        )

    # The first model loads now, and the server is ready once it has; each other when first asked
    # for (stopline/residency.py), under the name resolve_model gave it.
    first, *rest = settings.models or (None,)
    others = [
        Loader(
            Path(model).stem,
            partial(load, model),
            file_memory_bytes(Path(model), settings.workers, settings.context_length)
            if settings.memory_budget_bytes
            else None,
        )
        for model in rest
    ]
    loaded = _in_daemon_thread(loop, lambda: [load(first)])
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
    engines = loaded.result()
    if settings.chat_template is not None:
        for engine in engines:
            engine.tokenizer = engine.tokenizer.with_chat_template(load_chat_template(settings.chat_template))
    # The ports actually taken (either may have been 0: any free port).
    settings = replace(settings, port=sock.getsockname()[1], http_port=http_sock.getsockname()[1])
    server = StoplineServer(engines[0], settings, others=others)
    servers.append(server)
    await server.start(sock=sock, http_sock=http_sock)
    await stop.wait()
    await server.shutdown()
    return 0


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
        settings = settings_from(args)
        log_format = configure_logging(settings.log_level, settings.log_format)
        sock, http_sock = bind_ports(settings)
        # After the ports: a port in use fails at once, not after a download.
        settings = resolve_model(settings)
        return asyncio.run(serve(settings, sock, http_sock))
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
    except (StoplineError, OSError) as exc:
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
            f"Models given with --model are converted once into {conversion.converted_dir()}; the "
            f"{converted_keep()} most recently used copies are kept (STOPLINE_CONVERTED_KEEP)."
        ),
    )
    p.add_argument("action", choices=["list", "prune"], help="list the copies, or delete those beyond --keep")
    p.add_argument(
        "--keep", type=integer(0), default=None, help="copies to keep when pruning (default: STOPLINE_CONVERTED_KEEP)"
    )
    args = p.parse_args(argv)
    if args.action == "prune":
        for path in conversion.prune_converted(args.keep):
            print(f"deleted {path}")
        return 0
    files = conversion.converted_files()
    for path in files:
        print(f"{path.stat().st_size / 1e6:10.1f} MB  {path}")
    total_mb = sum(p.stat().st_size for p in files) / 1e6
    print(f"{len(files)} converted copies, {total_mb:.1f} MB in {conversion.converted_dir()}")
    return 0


COMMANDS["cache"] = cache_command
COMMANDS["models"] = models_command


def run() -> None:
    """The ``stopline`` console script and ``python -m stopline``."""
    code = main()
    sys.stdout.flush()
    # A model still loading in a daemon thread would hold up a normal exit; nothing else is left to clean up.
    os._exit(code) if code >= 128 else sys.exit(code)


if __name__ == "__main__":
    run()
