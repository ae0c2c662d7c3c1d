"""python -m server.client "prompt": stream an answer in the terminal; Ctrl-C stops it.

A small, honest client of the protocol in docs/protocol.md. Ctrl-C sends a
cancel frame, waits for the one terminal message, prints its figures and exits
with status 130.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import uuid

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

TERMINAL = {"done", "cancelled", "timeout", "error"}


async def run(url: str, prompt: str, max_tokens: int, temperature: float, raw: bool, out=sys.stdout,
              err=sys.stderr) -> int:
    request_id = f"cli-{uuid.uuid4().hex[:8]}"
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop_requested.set)
    try:
        async with connect(url) as ws:
            body = {"prompt": prompt} if raw else {"messages": [{"role": "user", "content": prompt}]}
            await ws.send(json.dumps({"type": "generate", "id": request_id, "max_tokens": max_tokens,
                                      "temperature": temperature, **body}))
            cancel_sent = False
            receive = asyncio.ensure_future(ws.recv())
            stop_wait = asyncio.ensure_future(stop_requested.wait())
            while True:
                await asyncio.wait({receive, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
                if stop_wait.done() and not cancel_sent:
                    cancel_sent = True
                    await ws.send(json.dumps({"type": "cancel", "id": request_id}))
                if not receive.done():
                    continue
                frame = json.loads(receive.result())
                receive = asyncio.ensure_future(ws.recv())
                if frame.get("id") != request_id:
                    continue
                if frame["type"] == "token":
                    out.write(frame["text"])
                    out.flush()
                elif frame["type"] in TERMINAL:
                    receive.cancel()
                    stop_wait.cancel()
                    return _report(frame, out, err)
    except (OSError, ConnectionClosed) as exc:
        err.write(f"\nstopline: connection to {url} failed: {exc}\n")
        return 1
    finally:
        loop.remove_signal_handler(signal.SIGINT)


def _report(frame: dict, out, err) -> int:
    out.write("\n")
    kind = frame["type"]
    if kind == "done":
        err.write(f"[done: {frame['reason']}, {frame['tokens_generated']} tokens, "
                  f"first token {frame['ttft_ms']:.0f} ms, total {frame['duration_ms']:.0f} ms]\n")
        return 0
    if kind == "cancelled":
        err.write(f"[cancelled: {frame['reason']}, {frame['tokens_generated']} tokens, "
                  f"{frame['tokens_after_cancel']} after the cancel, stopped in {frame['cancel_latency_ms']:.1f} ms]\n")
        return 130
    if kind == "timeout":
        err.write(f"[timeout: {frame['reason']} after {frame['elapsed_ms']:.0f} ms, "
                  f"{frame['tokens_generated']} tokens]\n")
        return 2
    err.write(f"[error {frame['code']}: {frame['message']}]\n")
    return 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m server.client", description=__doc__.splitlines()[0])
    p.add_argument("prompt")
    p.add_argument("--url", default="ws://127.0.0.1:8765/ws")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--raw", action="store_true", help="send the prompt as raw text, not as a chat message")
    args = p.parse_args(argv)
    return asyncio.run(run(args.url, args.prompt, args.max_tokens, args.temperature, args.raw))


if __name__ == "__main__":
    sys.exit(main())
