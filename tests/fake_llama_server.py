"""A stand-in for llama.cpp's llama-server, for the benchmark adapter's tests.

It takes the same command line the adapter passes, listens on the port it is
given (0: a free one) and speaks the parts of llama-server's HTTP API the
adapter uses: ``GET /health``, ``GET /slots``, and ``POST /completion`` with
token-id prompts, streamed as server-sent events over chunked encoding or
answered whole. It logs to stderr as llama-server does: the ``listening on``
line, and a slot's ``release`` line when a request ends. Generation is a token
every ``--token-ms`` (default 2 ms). A streaming request stops at the first
token after its client went away; a non-streaming one never notices and runs
to ``n_predict``, the case the benchmark's "busy" scenario exposes.

Every request's end is also appended as a JSON line to ``--accounts`` (if
given), so a test can compare the adapter's figures with what really happened.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--parallel", type=int, default=1)
    p.add_argument("--token-ms", type=float, default=2.0)
    p.add_argument("--accounts", default=None)
    args, _ = p.parse_known_args(argv)  # the rest of llama-server's flags are accepted and ignored
    return args


class FakeLlamaServer:
    def __init__(self, args):
        self.args = args
        self.busy = [False] * args.parallel
        self.tasks = 0

    def log(self, text: str) -> None:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def account(self, record: dict) -> None:
        if self.args.accounts:
            with open(self.args.accounts, "a") as f:
                f.write(json.dumps(record) + "\n")

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
                method, path, _ = head[0].split(" ")
                headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:] if h)}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                if method == "GET" and path == "/health":
                    self.respond(writer, 200, {"status": "ok"})
                elif method == "GET" and path == "/slots":
                    self.respond(writer, 200, [{"id": i, "is_processing": b} for i, b in enumerate(self.busy)])
                elif method == "POST" and path == "/completion":
                    await self.completion(reader, writer, json.loads(body))
                    return
                else:
                    self.respond(writer, 404, {"error": "not found"})
                await writer.drain()
                if headers.get("connection", "").lower() == "close":
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    def respond(self, writer, status: int, payload) -> None:
        data = json.dumps(payload).encode()
        writer.write(
            f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
            + data
        )

    async def completion(self, reader, writer, request: dict) -> None:
        slot = request.get("id_slot", 0)
        if slot < 0:
            slot = self.busy.index(False)
        prompt, n_predict, stream = len(request["prompt"]), request["n_predict"], request.get("stream", False)
        self.tasks += 1
        task = self.tasks
        self.busy[slot] = True
        gone = asyncio.Event()

        async def watch():  # the client sends nothing more: EOF or a reset means it left
            try:
                await reader.read()
            except ConnectionError:
                pass
            gone.set()

        watcher = asyncio.create_task(watch())
        generated = 0
        started = time.monotonic()
        try:
            if stream:
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                )
            while generated < n_predict and not (stream and gone.is_set()):
                await asyncio.sleep(self.args.token_ms / 1000)
                generated += 1
                if stream and not gone.is_set():
                    self.chunk(
                        writer,
                        {
                            "index": 0,
                            "content": "x",
                            "tokens": [1],
                            "stop": False,
                            "id_slot": slot,
                            "tokens_predicted": generated,
                            "tokens_evaluated": prompt,
                        },
                    )
            ms = (time.monotonic() - started) * 1000
            final = {
                "index": 0,
                "content": "" if stream else "x" * generated,
                "tokens": [],
                "id_slot": slot,
                "stop": True,
                "tokens_predicted": generated,
                "tokens_evaluated": prompt,
                "stop_type": "limit",
                "timings": {
                    "prompt_n": prompt,
                    "prompt_ms": 1.0,
                    "prompt_per_second": prompt * 1000.0,
                    "predicted_n": generated,
                    "predicted_ms": ms,
                    "predicted_per_second": generated / (ms / 1000),
                },
            }
            if not gone.is_set():
                if stream:
                    self.chunk(writer, final)
                    writer.write(b"0\r\n\r\n")
                else:
                    self.respond(writer, 200, final)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            watcher.cancel()
            self.busy[slot] = False
            # As llama-server: the context holds the prompt and every sampled token but the last.
            n_tokens = prompt + max(0, generated - 1)
            self.log(
                f"slot      release: id  {slot} | task {task} | stop processing: n_tokens = {n_tokens}, truncated = 0"
            )
            self.account(
                {"task": task, "slot": slot, "stream": stream, "generated": generated, "client_gone": gone.is_set()}
            )

    def chunk(self, writer, event: dict) -> None:
        data = f"data: {json.dumps(event)}\n\n".encode()
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")


async def main() -> None:
    if "--version" in sys.argv:
        print("version: 0 (fake)")
        return
    args = parse_args()
    fake = FakeLlamaServer(args)
    server = await asyncio.start_server(fake.handle, args.host, args.port)
    port = server.sockets[0].getsockname()[1]
    fake.log(f"main: server is listening on http://{args.host}:{port}")
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
