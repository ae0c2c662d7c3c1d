"""python -m stopline.client ["prompt"]: chat with Stopline in the terminal; Ctrl-C stops the answer.

With a prompt, it streams one answer and exits (0 done, 130 cancelled, 2
timeout, 1 error). Without one, it starts an interactive chat that keeps the
conversation: Ctrl-C stops the answer being written and returns to the prompt;
Ctrl-C twice at the prompt, or Ctrl-D, leaves. Every stop prints what it cost.
A small, honest client of the protocol in docs/protocol.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import sys
import uuid
from urllib.parse import urlsplit, urlunsplit

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from .protocol.errors import StoplineError, UsageError
from .protocol.requests import DEFAULT_SAMPLING
from .protocol.vocabulary import TERMINAL_TYPES, ErrorCode, Outcome
from .settings import client_api_key, client_url


class ServerUnreachable(StoplineError):
    """The server could not be reached or refused the WebSocket; one line for the user."""


SCHEMES = {"ws": "ws", "wss": "wss", "http": "ws", "https": "wss"}
EXIT_CODES = {Outcome.DONE: 0, Outcome.CANCELLED: 130, Outcome.TIMEOUT: 2, Outcome.ERROR: 1}
HELP = """\
Type a message and press Enter. Ctrl-C stops the answer being written.
  /system TEXT   set the system prompt (and start over); /system alone removes it
  /reset         forget the conversation (the system prompt stays)
  /help          this help
Ctrl-C twice at the prompt, or Ctrl-D, leaves."""


def websocket_url(url: str) -> str:
    """``ws(s)://`` or ``http(s)://`` HOST[:PORT], with or without ``/ws``, as the server's WebSocket URL."""
    parts = urlsplit(url.strip())
    if parts.scheme not in SCHEMES or not parts.hostname:
        raise UsageError(f"bad --url {url!r}: use ws://HOST:PORT, wss://, http:// or https://, with or without /ws")
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number in range
    except ValueError:
        raise UsageError(f"bad --url {url!r}: the port is not a number from 0 to 65535") from None
    path = parts.path.rstrip("/")
    if path not in ("", "/ws"):
        raise UsageError(f"bad --url {url!r}: the WebSocket path is /ws, not {parts.path}")
    return urlunsplit((SCHEMES[parts.scheme], parts.netloc, "/ws", "", ""))


class Conversation:
    """One server, one conversation: every question is a generate frame over a fresh
    connection, carrying the conversation so far."""

    def __init__(
        self, url: str, max_tokens: int, temperature: float, system: str | None = None, out=sys.stdout, err=sys.stderr
    ):
        self.url = url
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.system = system
        self.history: list[dict] = []
        self.out = out
        self.err = err
        self.model: str | None = None

    def messages(self, question: str) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.history + [{"role": "user", "content": question}]

    async def greet(self) -> dict:
        """Connect once to learn who answers; raises ServerUnreachable."""
        async with self._connect() as ws:
            hello = json.loads(await ws.recv())
        _check_key(hello)
        self.model = hello.get("model")
        return hello

    async def ask(self, body: dict) -> tuple[dict, str]:
        """Stream one answer to stdout. Ctrl-C sends a cancel; return the terminal frame and the text."""
        request_id = f"cli-{uuid.uuid4().hex[:8]}"
        stop_requested = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, stop_requested.set)
        text = []
        try:
            async with self._connect() as ws:
                await ws.send(
                    json.dumps(
                        {
                            "type": "generate",
                            "id": request_id,
                            "max_tokens": self.max_tokens,
                            "temperature": self.temperature,
                            **body,
                        }
                    )
                )
                cancel_sent = False
                receive = asyncio.ensure_future(ws.recv())
                stop_wait = asyncio.ensure_future(stop_requested.wait())
                try:
                    while True:
                        await asyncio.wait({receive, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
                        if stop_wait.done() and not cancel_sent:
                            cancel_sent = True
                            await ws.send(json.dumps({"type": "cancel", "id": request_id}))
                        if not receive.done():
                            continue
                        frame = json.loads(receive.result())
                        receive = asyncio.ensure_future(ws.recv())
                        _check_key(frame)
                        if frame.get("id") != request_id:
                            continue
                        if frame["type"] == "token":
                            text.append(frame["text"])
                            self.out.write(frame["text"])
                            self.out.flush()
                        elif frame["type"] in TERMINAL_TYPES:
                            return frame, "".join(text)
                finally:
                    receive.cancel()
                    stop_wait.cancel()
        except ConnectionClosed as exc:
            if text:
                self.out.write("\n")
            how = f"code {exc.rcvd.code} {exc.rcvd.reason}".strip() if exc.rcvd else "no close frame"
            raise ServerUnreachable(f"the connection to {self.url} closed before the answer ended ({how})") from None
        finally:
            loop.remove_signal_handler(signal.SIGINT)

    def _connect(self):
        return _Connection(self.url)

    def report(self, frame: dict) -> int:
        """The newline after the answer, then one summary line on stderr; return the exit code."""
        self.out.write("\n")
        self.out.flush()
        self.err.write(summary(frame) + "\n")
        self.err.flush()
        return EXIT_CODES[frame["type"]]


class _Connection:
    """``connect()`` whose failures become one readable line (ServerUnreachable)."""

    def __init__(self, url: str):
        self.url = url
        # A server that asks for an API key reads it from the handshake (docs/protocol.md#api-keys).
        key = client_api_key()
        headers = {"Authorization": f"Bearer {key}"} if key else None
        self._cm = connect(url, open_timeout=10, max_size=2**20, additional_headers=headers)

    async def __aenter__(self):
        try:
            return await self._cm.__aenter__()
        except (TimeoutError, OSError, InvalidHandshake, InvalidURI) as exc:
            raise ServerUnreachable(f"cannot connect to {self.url}: {_reason(exc, self.url)}") from None

    async def __aexit__(self, *exc_info):
        return await self._cm.__aexit__(*exc_info)


def _check_key(frame: dict) -> None:
    if frame.get("type") == Outcome.ERROR and frame.get("code") == ErrorCode.UNAUTHORIZED:
        if client_api_key():
            raise ServerUnreachable("the server refused the key in STOPLINE_API_KEY: it is not one of its keys")
        raise ServerUnreachable("the server needs an API key: set STOPLINE_API_KEY to one of its keys")


def _reason(exc: BaseException, url: str) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (is the server running? start it with: python -m stopline)"
    if isinstance(exc, asyncio.TimeoutError):
        return "no answer within 10 s"
    if isinstance(exc, InvalidStatus):
        return _refused_upgrade(exc, url)
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text


def _refused_upgrade(exc: InvalidStatus, url: str) -> str:
    """An HTTP answer instead of a WebSocket: what came back, and where the WebSocket may be.
    Stopline's HTTP API says where its WebSocket is; any other server gets the default layout."""
    status = exc.response.status_code
    got = f"HTTP {status} there, not a WebSocket"
    try:
        told = json.loads(exc.response.body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        told = ""
    found = re.search(r"the WebSocket is at (\S+)", told) if isinstance(told, str) else None
    if found:
        return f"{got}: this port serves Stopline's HTTP API (/v1); its WebSocket is at {found[1]} (--url {found[1]})"
    parts = urlsplit(url)
    hint = "Stopline's WebSocket is on its --port (8765 by default), and its HTTP API (/v1) on --port + 1"
    if status == 404 and parts.hostname and parts.port:
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        hint += f"; if this is the HTTP API's port, try --url ws://{host}:{parts.port - 1}/ws"
    return f"{got}. {hint}"


def summary(frame: dict) -> str:
    kind = frame["type"]
    if kind == Outcome.DONE:
        return (
            f"[done: {frame['reason']}, {frame['tokens_generated']} tokens, "
            f"first token {frame['ttft_ms']:.0f} ms, total {frame['duration_ms']:.0f} ms]"
        )
    if kind == Outcome.CANCELLED:
        return (
            f"[cancelled: {frame['reason']}, {frame['tokens_generated']} tokens, "
            f"{frame['tokens_after_cancel']} after the cancel, stopped in {frame['cancel_latency_ms']:.1f} ms]"
        )
    if kind == Outcome.TIMEOUT:
        return f"[timeout: {frame['reason']} after {frame['duration_ms']:.0f} ms, {frame['tokens_generated']} tokens]"
    return f"[error {frame['code']}: {frame['message']}]"


async def run(
    url: str,
    prompt: str,
    max_tokens: int,
    temperature: float,
    raw: bool,
    out=sys.stdout,
    err=sys.stderr,
    system: str | None = None,
) -> int:
    """One question, one answer: the exit code says how it ended."""
    session = Conversation(url, max_tokens, temperature, system, out, err)
    body = {"prompt": prompt} if raw else {"messages": session.messages(prompt)}
    try:
        frame, _ = await session.ask(body)
    except ServerUnreachable as exc:
        err.write(f"stopline: {exc}\n")
        return 1
    return session.report(frame)


def chat(session: Conversation, read=input) -> int:
    """The interactive chat: read a line, stream the answer, repeat. Returns the exit code."""
    loop = asyncio.new_event_loop()
    err = session.err
    try:
        try:
            loop.run_until_complete(session.greet())
        except ServerUnreachable as exc:
            err.write(f"stopline: {exc}\n")
            return 1
        err.write(
            f"Chatting with {session.model or 'Stopline'} at {session.url}. /help for commands, "
            f"Ctrl-C stops an answer, Ctrl-D leaves.\n"
        )
        interrupted = False
        while True:
            try:
                line = read("> ")
            except EOFError:
                session.out.write("\n")
                return 0
            except KeyboardInterrupt:
                if interrupted:
                    session.out.write("\n")
                    return 0
                interrupted = True
                err.write("\n(Ctrl-C again or Ctrl-D to leave)\n")
                continue
            interrupted = False
            question = line.strip()
            if not question:
                continue
            if question.startswith("/"):
                command(session, question)
                continue
            try:
                frame, text = loop.run_until_complete(session.ask({"messages": session.messages(question)}))
            except ServerUnreachable as exc:
                err.write(f"stopline: {exc}\n")
                continue
            session.report(frame)
            if frame["type"] == Outcome.ERROR:
                # It never reached the model (or broke it): leave it out of the conversation.
                if frame.get("code") == ErrorCode.PROMPT_TOO_LONG:
                    err.write("The conversation no longer fits the model's context; /reset starts over.\n")
                continue
            # A stopped answer stays in the conversation as far as it got, as on the page.
            session.history += [{"role": "user", "content": question}, {"role": "assistant", "content": text}]
    finally:
        loop.close()


def command(session: Conversation, line: str) -> None:
    name, _, argument = line.partition(" ")
    argument = argument.strip()
    err = session.err
    if name == "/help":
        err.write(HELP + "\n")
    elif name == "/reset":
        session.history = []
        err.write("(conversation cleared)\n")
    elif name == "/system":
        session.system = argument or None
        session.history = []
        err.write(
            "(system prompt set; conversation cleared)\n"
            if argument
            else "(system prompt removed; conversation cleared)\n"
        )
    else:
        err.write(f"unknown command {name}; /help lists the commands\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m stopline.client",
        description=__doc__.splitlines()[0],
        epilog="Without --url it connects to STOPLINE_HOST:STOPLINE_PORT (default 127.0.0.1:8765). "
        "STOPLINE_API_KEY is sent as the API key, for a server that asks for one.",
    )
    p.add_argument("prompt", nargs="?", help="ask this and exit; without it, chat interactively")
    p.add_argument("--url", default=None, help="ws(s):// or http(s):// address of the server, /ws optional")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_SAMPLING.max_tokens,
        help=f"longest answer, in tokens (default: {DEFAULT_SAMPLING.max_tokens})",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=DEFAULT_SAMPLING.temperature,
        help=f"sampling temperature: 0 always picks the likeliest token (default: {DEFAULT_SAMPLING.temperature:g})",
    )
    p.add_argument("--raw", action="store_true", help="send the prompt as raw text, not as a chat message")
    args = p.parse_args(argv)
    try:
        url = websocket_url(args.url) if args.url is not None else websocket_url(client_url())
    except UsageError as exc:
        print(f"stopline: {exc}", file=sys.stderr)
        return 2
    if args.prompt is not None:
        if not args.prompt.strip():
            print(
                "stopline: the prompt is empty; ask something, or give no prompt to chat interactively", file=sys.stderr
            )
            return 2
        return asyncio.run(run(url, args.prompt, args.max_tokens, args.temperature, args.raw, system=args.system))
    if args.raw:
        print("stopline: --raw needs a prompt", file=sys.stderr)
        return 2
    try:
        import readline  # noqa: F401 - line editing and up-arrow history for input()
    except ImportError:
        pass
    return chat(Conversation(url, args.max_tokens, args.temperature, args.system))


if __name__ == "__main__":
    sys.exit(main())
