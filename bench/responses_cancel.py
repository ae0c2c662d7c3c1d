"""python -m bench responses-cancel: the Responses API's cancel against DELETE, on one server.

One ``python -m stopline`` with its defaults (the embedded SmolLM2). Each round stops two
generations of the same long answer, in turn, alternating which goes first: a background
response (``POST /v1/responses`` with ``background: true``) stopped by
``POST /v1/responses/{id}/cancel``, and a generation streamed over Server-Sent Events
(``POST /v1/generations``) stopped by ``DELETE /v1/generations/{id}`` from another client. Each
cancel goes out at a random moment of decode: a random delay (0 to ``--max-delay-ms``) after
the client has seen the first token (the streamed one on its stream, the background one by
polling ``GET /v1/responses/{id}``).

The server's stop figure is the end log record's ``cancel_latency_ms``, from reading the cancel
to the loop's exit, as in every stop-latency scenario of the bench; the record's
``tokens_after_cancel`` must be 0. Both kinds must end with the same fields, in the end log
record and in the terminal frame (the cancel's answer carries the Response's, the stream its own).

    python -m bench responses-cancel [--rounds 100] [--max-output-tokens 300] [--max-delay-ms 500]
                                     [--cpus 0,1] [--results-md]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import shlex
import sys
import time
from pathlib import Path

import aiohttp

from stopline.protocol.vocabulary import END_EVENTS

from .launch import ServerProcess
from .machine import load_average, machine
from .report import BENCH_DIR, write_json, write_results_section
from .tables import fmt, stat, table

RESPONSES, DELETE = "responses_cancel", "delete"
KINDS = (RESPONSES, DELETE)
LABELS = {
    RESPONSES: "`POST /v1/responses/{id}/cancel`, background response",
    DELETE: "`DELETE /v1/generations/{id}`, streamed generation",
}
LONG_ANSWER = "Write a very long story about a dragon who learns to bake bread."
# How often the client asks a background response whether its first token is out.
POLL_S = 0.005
# The promise: a stop ends the computation within a millisecond of the server reading it.
TARGET_MS = 1.0
# How long an end log record may take to be read from the server's output.
RECORD_WAIT_S = 30


class Rounds:
    """The client's side of one measurement: the server's API, two HTTP clients (the one that
    starts a generation and the one that stops it), the model, and the randomness of the delays."""

    def __init__(self, server: ServerProcess, owner, other, model: str, args: argparse.Namespace):
        self.server, self.owner, self.other = server, owner, other
        self.api, self.model = server.api_url, model
        self.max_output_tokens = args.max_output_tokens
        self.max_delay_s = args.max_delay_ms / 1000
        self.random = random.Random(args.seed)

    def delay(self) -> float:
        return self.random.uniform(0, self.max_delay_s)

    async def responses_cancel(self, delay_s: float) -> dict:
        body = {"model": self.model, "input": LONG_ANSWER, "max_output_tokens": self.max_output_tokens}
        async with self.owner.post(f"{self.api}/responses", json=body | {"background": True}) as response:
            created = await response.json()
            if response.status != 200:
                raise RuntimeError(f"POST /v1/responses: HTTP {response.status}: {created}")
            auth = {"Authorization": f"Bearer {response.headers['X-Cancel-Token']}"}
        response_id = created["id"]
        # Decode has begun once the Response holds text.
        while True:
            async with self.owner.get(f"{self.api}/responses/{response_id}", headers=auth) as response:
                now = await response.json()
            if now["output"] or now["status"] not in ("queued", "in_progress"):
                break
            await asyncio.sleep(POLL_S)
        await asyncio.sleep(delay_s)
        sent_ns = time.monotonic_ns()
        async with self.other.post(f"{self.api}/responses/{response_id}/cancel", headers=auth) as response:
            answer = await response.json()
        answered_ns = time.monotonic_ns()
        return {
            "request_id": response_id.removeprefix("resp_"),
            "status": answer["status"],
            # Once it has ended, a Response carries Stopline's terminal frame.
            "frame": answer.get("stopline", {}),
            "client_ms": (answered_ns - sent_ns) / 1e6,
        }

    async def delete(self, delay_s: float) -> dict:
        body = {"messages": [{"role": "user", "content": LONG_ANSWER}], "max_tokens": self.max_output_tokens}
        response = await self.owner.post(f"{self.api}/generations", json=body)
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()
        first_token: asyncio.Future = asyncio.get_running_loop().create_future()
        ended: asyncio.Future = asyncio.get_running_loop().create_future()

        async def read() -> None:
            # The stream is read to its end, so that the server never waits on a full socket.
            event = None
            async for raw in response.content:
                line = raw.decode().rstrip("\r\n")
                if line.startswith("event: "):
                    event = line[len("event: ") :]
                elif line.startswith("data: ") and event is not None:
                    frame = json.loads(line[len("data: ") :])
                    kind = frame.get("type")
                    if kind == "accepted" and not accepted.done():
                        accepted.set_result(frame)
                    elif kind == "token" and not first_token.done():
                        first_token.set_result(None)
                    elif kind not in ("accepted", "token") and not ended.done():
                        ended.set_result((time.monotonic_ns(), frame))
            for waiting in (accepted, first_token, ended):
                if not waiting.done():
                    waiting.set_exception(RuntimeError(f"the stream ended early: HTTP {response.status}"))

        reader = asyncio.create_task(read())
        try:
            frame = await accepted
            await first_token
            await asyncio.sleep(delay_s)
            sent_ns = time.monotonic_ns()
            url = f"{self.api}/generations/{frame['request_id']}"
            async with self.other.delete(url, headers={"Authorization": f"Bearer {frame['cancel_token']}"}) as answer:
                await answer.read()
            ended_ns, terminal = await ended
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            response.close()
        return {
            "request_id": frame["request_id"],
            "status": terminal["type"],
            "frame": terminal,
            "client_ms": (ended_ns - sent_ns) / 1e6,
        }

    async def stop(self, kind: str, delay_s: float) -> dict:
        """One generation of ``kind``, stopped ``delay_s`` after its first token: its sample."""
        stopped = await (self.responses_cancel if kind == RESPONSES else self.delete)(delay_s)
        request_id = stopped.pop("request_id")
        record = await asyncio.to_thread(
            self.server.wait_record,
            lambda r: r.get("request_id") == request_id and r.get("event") in END_EVENTS.values(),
            RECORD_WAIT_S,
        )
        frame = stopped.pop("frame")
        return {
            "kind": kind,
            "request_id": request_id,
            "delay_ms": delay_s * 1000,
            **stopped,
            "end_event": record["event"],
            "reason": record.get("reason"),
            "server_ms": record.get("cancel_latency_ms"),
            "frame_server_ms": frame.get("cancel_latency_ms"),
            "tokens_after_cancel": record.get("tokens_after_cancel"),
            "tokens_generated": record.get("tokens_generated"),
            "record_fields": sorted(record),
            "frame_fields": sorted(frame),
        }


async def measure(server: ServerProcess, args: argparse.Namespace) -> list[dict]:
    async with aiohttp.ClientSession() as owner, aiohttp.ClientSession() as other:
        async with owner.get(f"{server.api_url}/models") as response:
            model = (await response.json())["data"][0]["id"]
        rounds = Rounds(server, owner, other, model, args)
        # One of each first, unmeasured: the first generations warm the server up.
        for kind in KINDS:
            await rounds.stop(kind, 0.0)
        samples = []
        for n in range(args.rounds):
            for kind in KINDS if n % 2 == 0 else KINDS[::-1]:
                samples.append({"round": n, **await rounds.stop(kind, rounds.delay())})
            if (n + 1) % 10 == 0:
                print(f"responses-cancel: {n + 1}/{args.rounds} rounds", file=sys.stderr)
    return samples


def argv_tail() -> list[str]:
    return sys.argv[2 if sys.argv[1:2] == ["responses-cancel"] else 1 :]


async def run(args: argparse.Namespace) -> dict:
    args.out.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(
        *("--port", "0", "--http-port", "0"), cpus=args.cpu_set, stderr_path=args.out / "server-stopline.log"
    )
    meta = {
        "command": "python -m bench responses-cancel " + shlex.join(argv_tail()),
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "cpus": sorted(args.cpu_set),
        "rounds": args.rounds,
        "max_output_tokens": args.max_output_tokens,
        "max_delay_ms": args.max_delay_ms,
        "seed": args.seed,
        "load_average_start": load_average(),
    }
    started = time.monotonic()
    try:
        await server.started()
        meta["server"] = {k: server.start_record.get(k) for k in ("model", "engine", "threads")}
        samples = await measure(server, args)
    finally:
        await server.stopped()
    meta["seconds"] = round(time.monotonic() - started, 1)
    meta["load_average_end"] = load_average()
    results = {"meta": meta, "samples": samples}
    write_json(results, args.out / "results.json")
    return results


def stop_table(samples: list[dict]) -> str:
    """One row per kind: how its cancels ended, the server's stop figure, the client's, and the
    tokens after the cancel."""
    rows = []
    for kind in KINDS:
        mine = [s for s in samples if s["kind"] == kind]
        if not mine:
            continue
        cancelled = [s for s in mine if s["status"] == "cancelled"]
        server = stat([s["server_ms"] for s in cancelled], "p50", "p90", "p99", "max")
        client = stat([s["client_ms"] for s in cancelled], "p50", "p99")
        over = sum(1 for s in cancelled if s["server_ms"] is None or s["server_ms"] > TARGET_MS)
        after = max((s["tokens_after_cancel"] or 0 for s in cancelled), default=None)
        rows.append(
            [LABELS[kind], str(len(mine)), str(len(cancelled))]
            + [fmt(v) for v in server]
            + [str(over)]
            + [fmt(v) for v in client]
            + ["–" if after is None else str(after)]
        )
    text = table(
        "stopped by|n|cancelled|server p50 (ms)|p90|p99|max|server over 1 ms|client p50 (ms)|p99|"
        "tokens after cancel, max",
        rows,
    )
    return text or ""


def field_differences(samples: list[dict]) -> dict[str, list[str]]:
    """The end log record's and the terminal frame's fields that some stops carry and others
    lack, of either kind: empty lists when every one ends alike."""
    differences = {}
    for part in ("record_fields", "frame_fields"):
        sets = [set(s[part]) for s in samples if s["kind"] in KINDS and s["status"] == "cancelled"]
        # A field some end carries and another lacks, of either kind.
        odd = set().union(*sets) - set.intersection(*sets) if sets else set()
        differences[part] = sorted(odd)
    return differences


def section(results: dict) -> str:
    meta, m = results["meta"], results["meta"]["machine"]
    samples = results["samples"]
    loads = "/".join(f"{x:.1f}" for x in (meta["load_average_start"][0], meta["load_average_end"][0]))
    differences = field_differences(samples)
    server_agrees = all(
        s["frame_server_ms"] is not None and abs(s["frame_server_ms"] - s["server_ms"]) < 1e-6
        for s in samples
        if s["status"] == "cancelled"
    )
    ended = [s for s in samples if s["status"] != "cancelled"]
    reasons = sorted({str(s["reason"]) for s in samples if s["status"] == "cancelled"})
    fields = (
        "The two kinds' end log records carry the same fields, and so do their terminal frames."
        if not any(differences.values())
        else "The two kinds end with different fields: "
        + "; ".join(f"{part.split('_')[0]}: {', '.join(names)}" for part, names in differences.items() if names)
        + "."
    )
    server = meta.get("server") or {}
    return "\n".join(
        [
            "## Responses cancel against DELETE",
            "",
            f"`{meta['command']}`",
            "",
            f"{m.get('cpu', 'CPU')}, {m.get('cores_available', '?')} cores available, shared with other work: 1-minute "
            f"load average {loads} at the start/end. One `python -m stopline` with its defaults"
            + (f" ({server['model']})" if server.get("model") else "")
            + f", confined to cores {','.join(map(str, meta['cpus']))}; {meta['rounds']} rounds in "
            f"{meta.get('seconds', '?')} s.",
            "",
            f"Each round stops a background response (`background: true`) with `POST /v1/responses/{{id}}/cancel` and "
            f"a streamed generation (`POST /v1/generations`) with `DELETE /v1/generations/{{id}}` from another "
            f"client, the same long answer ({meta['max_output_tokens']} tokens at most), alternating which goes "
            f"first; each cancel is sent at a random moment of decode, 0–{meta['max_delay_ms']} ms after the client "
            "saw the first token. Server: the end log record's `cancel_latency_ms`, cancel read → token loop exited"
            + (" (the terminal frame's figure, equal)" if server_agrees else "")
            + ". Client: cancel sent → the cancelled Response answered (cancel), or the `cancelled` frame on the "
            "stream (DELETE). Tokens after cancel: the record's `tokens_after_cancel`.",
            "",
            stop_table(samples),
            "",
            f"Every stop ended with reason {', '.join(reasons) or '–'}"
            + (f"; {len(ended)} generations had ended before their cancel." if ended else ".")
            + f" {fields}",
            "",
        ]
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench responses-cancel",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rounds", type=int, default=100, help="rounds, each stopping one generation of each kind")
    parser.add_argument("--max-output-tokens", type=int, default=300, help="the length each generation may reach")
    parser.add_argument(
        "--max-delay-ms", type=float, default=500, help="the latest a cancel goes out after the first token"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the cancels' random delays")
    parser.add_argument("--cpus", help="the cores the server is confined to, e.g. 0,1 (default: all available)")
    parser.add_argument("--out", type=Path, default=BENCH_DIR / "out" / "responses-cancel", help="output directory")
    parser.add_argument("--results-md", action="store_true", help="also write this run's section of bench/RESULTS.md")
    parser.add_argument("--render", action="store_true", help="no measurement: the report again from --out")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.max_output_tokens < 1 or args.max_delay_ms < 0:
        parser.error("--rounds and --max-output-tokens must be positive, --max-delay-ms not negative")
    args.cpu_set = frozenset(int(c) for c in args.cpus.split(",")) if args.cpus else frozenset(os.sched_getaffinity(0))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = json.loads((args.out / "results.json").read_text()) if args.render else asyncio.run(run(args))
    text = section(results)
    (args.out / "report.md").write_text(text)
    print(text)
    if args.results_md:
        write_results_section(BENCH_DIR / "RESULTS.md", "responses-cancel", text)
    return 0
