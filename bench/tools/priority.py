"""python -m bench priority: many users at once, and a request of higher priority among them.

Starts ``python -m stopline`` with its defaults and measures, each user on a WebSocket
connection of its own, the time from sending ``generate`` to the first token frame (TTFT):

* unloaded: a short request of priority 0, alone, ``--unloaded`` times;
* queue: 4 long greedy generations (llama-server's parallel sequences), then requests 5 to 8
  (the short request, default priority) sent one by one, ``--arrival-gap-s`` apart: queued
  where the server has 4 workers, started at once where it has 8;
* priority: 8 long greedy generations of priority 10 (``ignore_eos``, so that each runs its
  full length), and while they run, the short request at priority 0, ``--highs-per-round``
  times a round, each once the one before it has ended and ``--arrival-gap-s`` has passed.

Every short request has a prompt of its own, so that none is served from another's cache.
Each long prompt is also generated once alone, and once more under the same load with no
request of priority 0 (the control round): a preempted generation's tokens are compared with
both. Tokens in shared steps may differ from a run alone where the two likeliest were within
``NEAR_TIE_LOGPROB`` (docs/engine.md), so a text that parts from another is counted as parting
at a near tie or elsewhere; the long generations ask for ``logprobs`` to tell which. From the
server's end records: prompt tokens evaluated more than once (reused and evaluated beyond the
prompt, and any chunk a stop cut short), and the preemptions each generation went through.

    python -m bench priority [--unloaded 10] [--rounds 3] [--long-tokens 512] [--highs-per-round 4]
                             [--arrival-gap-s 0.5] [--server-args '--workers 4'] [--cpus 0,1] [--results-md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from stopline.protocol.vocabulary import END_EVENTS, TERMINAL_TYPES, Outcome

from ..inprocess.llama_native import NEAR_TIE_LOGPROB
from ..launch import ServerProcess
from ..machine import load_average, machine
from ..report import write_results_section
from ..tables import fmt, stat, table

LOW, HIGH = 10, 0
# The short request; the number first, so that no two share more than their first token.
SHORT = "{n}. Name the capital of France in one word."
SHORT_TOKENS = 8
# One opening per long generation, so that each has a text of its own to compare.
OPENINGS = [
    "Once upon a time, in a village at the edge of a great forest,",
    "The ship had been drifting for eleven days when the captain",
    "In the year 2157, the last library on Earth",
    "My grandmother kept a small notebook in which she wrote",
    "The old lighthouse keeper climbed the stairs every evening and",
    "Deep beneath the city, in tunnels no map had ever shown,",
    "When the first snow fell that winter, the children of the valley",
    "The letter arrived on a Tuesday, addressed to a man who had died",
]
CONCURRENT = len(OPENINGS)
# The users before requests 5 to 8: as many as llama-server serves at once by default.
FIRST_USERS = 4
DONE = END_EVENTS[Outcome.DONE]


@dataclass
class Call:
    """One request on a connection of its own: its frames, stamped with ``time.monotonic_ns()``."""

    name: str
    body: dict
    sent_ns: int = 0
    first_token_ns: int = 0
    accepted: dict = field(default_factory=dict)
    frames: list[dict] = field(default_factory=list)
    end: dict = field(default_factory=dict)
    first_token: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None

    @property
    def ttft_ms(self) -> float:
        return (self.first_token_ns - self.sent_ns) / 1e6

    @property
    def tokens_before_preemption(self) -> int | None:
        """Tokens read before the first ``preempted`` frame (None: never preempted)."""
        count = 0
        for frame in self.frames:
            if frame["type"] == "preempted":
                return count
            count += len(frame.get("logprobs", [])) if frame["type"] == "token" else 0
        return None

    def of_type(self, kind: str) -> list[dict]:
        return [frame for frame in self.frames if frame["type"] == kind]

    @property
    def text(self) -> str:
        return "".join(frame["text"] for frame in self.of_type("token"))

    @property
    def tokens(self) -> list[dict]:
        """One entry per token read (the long generations ask for ``logprobs``)."""
        return [entry for frame in self.of_type("token") for entry in frame.get("logprobs", [])]

    async def run(self, session: aiohttp.ClientSession, ws_url: str) -> Call:
        async with session.ws_connect(ws_url, max_msg_size=1 << 22) as ws:
            await ws.receive()  # hello
            self.sent_ns = time.monotonic_ns()
            await ws.send_str(json.dumps({"type": "generate", "id": self.name, **self.body}))
            async for message in ws:
                now = time.monotonic_ns()
                frame = json.loads(message.data)
                self.frames.append(frame)
                if frame["type"] == "accepted":
                    self.accepted = frame
                elif frame["type"] == "token" and not self.first_token_ns:
                    self.first_token_ns = now
                    self.first_token.set()
                elif frame["type"] in TERMINAL_TYPES:
                    self.end = frame
                    break
        self.first_token.set()
        if self.end.get("type") != str(Outcome.DONE):
            raise RuntimeError(f"{self.name} did not end with done: {self.end or self.frames[-1:]}")
        return self

    def start(self, session: aiohttp.ClientSession, ws_url: str) -> Call:
        self.task = asyncio.create_task(self.run(session, ws_url))
        return self

    async def ended(self) -> Call:
        assert self.task is not None
        return await self.task


def short_call(name: str, n: int, priority: int | None) -> Call:
    # ignore_eos: a prompt the model would answer with its end at once still gets a first token.
    body = {"prompt": SHORT.format(n=n), "max_tokens": SHORT_TOKENS, "temperature": 0, "seed": 0, "ignore_eos": True}
    return Call(name, body | ({"priority": priority} if priority is not None else {}))


def long_call(name: str, opening: int, max_tokens: int, priority: int | None) -> Call:
    body = {
        "prompt": OPENINGS[opening],
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 0,
        "ignore_eos": True,
        # The two likeliest alternatives besides the token read, however ignore_eos bent the choice.
        "logprobs": 3,
    }
    return Call(name, body | ({"priority": priority} if priority is not None else {}))


def margin(entry: dict) -> float | None:
    """How far the token read was ahead of the likeliest other token it could have been. A likelier
    one is one ``ignore_eos`` ruled out (greedy with no penalty reads the likeliest otherwise), so
    only the alternatives below it count."""
    others = [
        alternative["logprob"]
        for alternative in entry.get("top_logprobs", [])
        if alternative["bytes"] != entry["bytes"] and alternative["logprob"] <= entry["logprob"]
    ]
    return entry["logprob"] - max(others) if others else None


def parting(run: list[dict], other: list[dict]) -> tuple[str, int] | None:
    """None if two greedy runs read the same tokens; else where they part, and "near_tie" if
    the token read there was within NEAR_TIE_LOGPROB of another in either run, "elsewhere" if not."""
    ids = [[tuple(entry["bytes"]) for entry in tokens] for tokens in (run, other)]
    if ids[0] == ids[1]:
        return None
    at = next((i for i, (a, b) in enumerate(zip(*ids)) if a != b), min(map(len, ids)))
    margins = [m for tokens in (run, other) if at < len(tokens) and (m := margin(tokens[at])) is not None]
    return ("near_tie" if margins and min(margins) <= NEAR_TIE_LOGPROB else "elsewhere"), at


class Bench:
    def __init__(self, server: ServerProcess, session: aiohttp.ClientSession, args: argparse.Namespace):
        self.server, self.session, self.args = server, session, args
        self.workers = int(server.start_record["workers"])
        self.numbered = 0

    def next_short(self, name: str, priority: int | None) -> Call:
        self.numbered += 1
        return short_call(f"{name}-{self.numbered}", self.numbered, priority)

    async def alone(self, call: Call) -> Call:
        return await call.run(self.session, self.server.ws_url)

    async def unloaded(self) -> list[Call]:
        return [await self.alone(self.next_short("unloaded", HIGH)) for _ in range(self.args.unloaded)]

    async def start_longs(self, round_: str, count: int, priority: int | None) -> list[Call]:
        calls = [
            long_call(f"{round_}-long-{n}", n, self.args.long_tokens, priority).start(self.session, self.server.ws_url)
            for n in range(count)
        ]
        # Every worker runs a long generation before anything else is sent.
        await asyncio.gather(*(call.first_token.wait() for call in calls[: self.workers]))
        return calls

    async def queue_round(self, round_: int) -> dict:
        longs = await self.start_longs(f"queue{round_}", FIRST_USERS, None)
        queued = []
        for _ in range(FIRST_USERS + 1, CONCURRENT + 1):
            queued.append(self.next_short(f"queue{round_}", None).start(self.session, self.server.ws_url))
            await asyncio.sleep(self.args.arrival_gap_s)
        await asyncio.gather(*(call.ended() for call in longs + queued))
        return {"longs": longs, "queued": queued}

    async def priority_round(self, round_: int, highs: int) -> dict:
        lows = await self.start_longs(f"priority{round_}", CONCURRENT, LOW)
        sent = []
        for _ in range(highs):
            await asyncio.sleep(self.args.arrival_gap_s)
            if all(call.task is not None and call.task.done() for call in lows):
                break
            sent.append(await self.alone(self.next_short(f"priority{round_}", HIGH)))
        await asyncio.gather(*(call.ended() for call in lows))
        return {"lows": lows, "highs": sent}

    async def measure(self) -> dict:
        await self.alone(self.next_short("warmup", HIGH))
        started = time.monotonic()

        def progress(what: str) -> None:
            print(f"{time.monotonic() - started:6.0f} s  {what}", file=sys.stderr)

        references = []
        for n in range(CONCURRENT):
            references.append(await self.alone(long_call(f"alone-long-{n}", n, self.args.long_tokens, LOW)))
            progress(f"long generation alone {n + 1}/{CONCURRENT}")
        unloaded = await self.unloaded()
        progress("unloaded")
        queue = []
        for round_ in range(self.args.rounds):
            queue.append(await self.queue_round(round_))
            progress(f"queue round {round_ + 1}/{self.args.rounds}")
        priority = []
        for round_ in range(self.args.rounds):
            priority.append(await self.priority_round(round_, self.args.highs_per_round))
            progress(f"priority round {round_ + 1}/{self.args.rounds}")
        control = await self.priority_round(self.args.rounds, 0)
        progress("control round")
        return {
            "references": references,
            "unloaded": unloaded,
            "queue": queue,
            "priority": priority,
            "control": control,
        }


def preempted_by(records: list[dict]) -> dict[str, str]:
    """Each preempting request's id, from the server's preempted events: request_id -> by."""
    return {r["by"]: r["request_id"] for r in records if r.get("event") == "preempted"}


def ends(records: list[dict]) -> dict[str, dict]:
    """The end record of every request, by request_id."""
    return {r["request_id"]: r for r in records if r.get("event") in END_EVENTS.values()}


def recomputed(record: dict) -> int:
    """Prompt tokens evaluated beyond the prompt: counted in both reused and evaluated, or cut short by a stop."""
    reused, evaluated = record.get("prompt_tokens_reused", 0), record["prompt_tokens_evaluated"]
    return max(0, reused + evaluated - record["prompt_tokens"]) + record.get("prompt_tokens_wasted", 0)


def analyse(measured: dict, records: list[dict], long_tokens: int) -> dict:
    """The figures of a run: TTFT per case, and how the long generations compare."""
    by_id = ends(records)
    preempting = preempted_by(records)
    highs = [call for r in measured["priority"] for call in r["highs"]]
    preempting_highs = [call for call in highs if call.accepted["request_id"] in preempting]

    def ttfts(calls: list[Call]) -> dict:
        client = [call.ttft_ms for call in calls]
        server = [by_id[call.accepted["request_id"]]["ttft_ms"] for call in calls]
        p50, p99 = stat(client, "p50", "p99")
        server_p50, server_p99 = stat(server, "p50", "p99")
        return {"n": len(calls), "p50_ms": p50, "p99_ms": p99, "server_p50_ms": server_p50, "server_p99_ms": server_p99}

    unloaded = ttfts(measured["unloaded"])
    cases = {
        "unloaded": unloaded,
        "queue": ttfts([call for r in measured["queue"] for call in r["queued"]]),
        "priority": ttfts(preempting_highs),
    }
    for case in cases.values():
        for q in ("p50", "p99"):
            base, value = unloaded[f"{q}_ms"], case[f"{q}_ms"]
            case[f"{q}_ratio"] = value / base if value is not None and base else None
    cases["priority"]["sent"] = len(highs)

    reference = {call.body["prompt"]: call.tokens for call in measured["references"]}
    control = {call.body["prompt"]: call.tokens for call in measured["control"]["lows"]}
    lows = [call for r in measured["priority"] for call in r["lows"]]
    preempted = [call for call in lows if call.of_type("preempted")]
    unpreempted = [call for call in lows if not call.of_type("preempted")]

    def compared(calls: list[Call], against: dict[str, list[dict]]) -> dict:
        partings = [(call, parting(call.tokens, against[call.body["prompt"]])) for call in calls]
        kinds = [p[0] if p else None for _, p in partings]
        return {
            "partings": [
                {"name": call.name, "kind": p[0], "at": p[1], "paused_at": call.tokens_before_preemption}
                for call, p in partings
                if p is not None
            ],
            "n": len(calls),
            "equal": kinds.count(None),
            "near_tie": kinds.count("near_tie"),
            "elsewhere": kinds.count("elsewhere"),
            # A preempted generation that parted before its first pause parted for another cause.
            "parted_after_preemption": sum(
                p is not None and (before := call.tokens_before_preemption) is not None and p[1] >= before
                for call, p in partings
            ),
        }

    under_load = lows + measured["control"]["lows"] + [call for r in measured["queue"] for call in r["longs"]]
    long_records = [by_id[call.accepted["request_id"]] for call in under_load]
    texts = {
        "preempted_vs_alone": compared(preempted, reference),
        "preempted_vs_control": compared(preempted, control),
        "unpreempted_vs_alone": compared(unpreempted, reference),
        "control_vs_alone": compared(measured["control"]["lows"], reference),
    }
    accounting = {
        "preemptions": sum(r.get("preemptions", 0) for r in long_records),
        "preempted_generations": len(preempted),
        "preempted_and_resumed_frames": [
            sum(len(call.of_type(kind)) for call in preempted) for kind in ("preempted", "resumed")
        ],
        "prompt_tokens_recomputed": sum(recomputed(r) for r in long_records),
        # Tokens a client read other than once each: every long generation reads long_tokens.
        "tokens_not_read_once": sum(abs(len(call.tokens) - long_tokens) for call in under_load),
        "frame_index_gaps": sum(
            [f["index"] for f in call.of_type("token")] != list(range(len(call.of_type("token"))))
            for call in under_load
        ),
        "preempted_ms_p50": stat([r["preempted_ms"] for r in long_records if r.get("preemptions")], "p50")[0],
    }
    calls = [
        {
            "name": call.name,
            "priority": call.body.get("priority"),
            "ttft_ms": round(call.ttft_ms, 2),
            "tokens": call.end.get("tokens_generated"),
            "preempted": len(call.of_type("preempted")),
        }
        for call in [*measured["unloaded"], *highs, *under_load]
    ]
    return {"ttft": cases, "texts": texts, "accounting": accounting, "calls": calls}


async def run(args: argparse.Namespace) -> dict:
    server = ServerProcess("--port", "0", "--http-port", "0", *shlex.split(args.server_args), cpus=args.cpu_set)
    try:
        await server.started()
        load_before = load_average()
        async with aiohttp.ClientSession() as session:
            measured = await Bench(server, session, args).measure()
        load_after = load_average()
    finally:
        await server.stopped()
    result = analyse(measured, server.records, args.long_tokens)
    result["meta"] = {
        "command": " ".join(["python -m bench priority", *args.argv]),
        "started_at": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": machine(),
        "cpus": sorted(args.cpu_set),
        "load_average": [load_before, load_after],
        "model": server.start_record.get("model"),
        "workers": server.start_record.get("workers"),
        "unloaded": args.unloaded,
        "rounds": args.rounds,
        "long_tokens": args.long_tokens,
        "highs_per_round": args.highs_per_round,
        "arrival_gap_s": args.arrival_gap_s,
    }
    return result


def ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def ttft_table(result: dict) -> str:
    cases = result["ttft"]
    names = {
        "unloaded": "a short request alone (priority 0)",
        "queue": "requests 5 to 8, with 4 long generations running (default priority)",
        "priority": f"priority 0 among {CONCURRENT} generations of priority {LOW}, preempting one",
    }
    rows = [
        [names[name]]
        + [str(c["n"]), fmt(c["p50_ms"]), fmt(c["p99_ms"]), ratio(c["p50_ratio"]), ratio(c["p99_ratio"])]
        + [fmt(c["server_p50_ms"]), fmt(c["server_p99_ms"])]
        for name, c in cases.items()
    ]
    header = "TTFT of|requests|p50 (ms)|p99 (ms)|p50 ÷ alone|p99 ÷ alone|server's p50 (ms)|server's p99 (ms)"
    return table(header, rows) or ""


def texts_table(result: dict) -> str:
    names = {
        "preempted_vs_alone": "preempted, against the same prompt alone",
        "preempted_vs_control": "preempted, against the same prompt in the control round",
        "unpreempted_vs_alone": "not preempted, same load, against alone",
        "control_vs_alone": "control round (no priority 0), against alone",
    }
    rows = [
        [names[name], str(t["n"]), str(t["equal"]), str(t["near_tie"]), str(t["elsewhere"])]
        + [str(t["parted_after_preemption"]) if name.startswith("preempted") else "–"]
        for name, t in result["texts"].items()
    ]
    header = (
        f"greedy generations|count|same tokens|parted at a near tie (≤ {NEAR_TIE_LOGPROB})|parted elsewhere"
        "|parted at or after its first pause"
    )
    return table(header, rows) or ""


def partings_line(result: dict) -> str:
    """Where each preempted generation parted from its run alone, against where it was first paused."""
    partings = result["texts"]["preempted_vs_alone"]["partings"]
    if not partings:
        return ""
    where = "; ".join(
        f"{p['name']} at token {p['at']} ({p['kind']}), first paused at {p['paused_at']}" for p in partings
    )
    return f"Preempted generations that parted from their run alone: {where}.\n"


def accounting_line(result: dict) -> str:
    a = result["accounting"]
    preempted_frames, resumed_frames = a["preempted_and_resumed_frames"]
    return (
        f"{a['preemptions']} preemptions in the end records, of {a['preempted_generations']} generations "
        f"({preempted_frames} `preempted` and {resumed_frames} `resumed` frames), paused "
        f"{fmt(a['preempted_ms_p50'])} ms each at the median; prompt tokens evaluated twice or cut short: "
        f"{a['prompt_tokens_recomputed']}; "
        f"tokens a client read other than once: {a['tokens_not_read_once']}; token frames out of order: "
        f"{a['frame_index_gaps']}."
    )


def section(result: dict) -> str:
    meta = result["meta"]
    sent = result["ttft"]["priority"]["sent"]
    return "\n".join(
        [
            "## Many users at once, and priority",
            "",
            f"`{meta['command']}`, {meta['started_at']}, {meta['model']} with the server's defaults "
            f"({meta['workers']} workers), on {meta['machine']['cores_available']} cores "
            f"(load average {meta['load_average'][0][0]:.1f} before, {meta['load_average'][1][0]:.1f} after). "
            f"Each user on a connection of its own; TTFT from sending `generate` to the first token frame. "
            f"{meta['unloaded']} requests alone; {meta['rounds']} rounds of each load, the long generations "
            f"{meta['long_tokens']} tokens, greedy, `ignore_eos`; {sent} requests of priority 0 sent "
            f"({meta['highs_per_round']} a round at most), the table counting those that preempted one; "
            "with this few, p99 is about the largest. The cases run minutes apart on shared cores.",
            "",
            ttft_table(result),
            "",
            texts_table(result),
            "",
            partings_line(result),
            accounting_line(result),
            "",
        ]
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench priority", description=__doc__.splitlines()[0])
    p.add_argument("--unloaded", type=int, default=10, help="short requests alone")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the queue load and of the priority load")
    p.add_argument("--long-tokens", type=int, default=512, help="tokens of each long generation")
    p.add_argument("--highs-per-round", type=int, default=4, help="requests of priority 0 in a priority round")
    p.add_argument("--arrival-gap-s", type=float, default=0.5, help="between one arrival and the next")
    p.add_argument("--server-args", default="", help="flags for the server, e.g. '--workers 8'")
    p.add_argument("--cpus", help="the cores the server is confined to, e.g. 0,1 (default: all available)")
    p.add_argument("--out", type=Path, default=Path("bench/out"))
    p.add_argument("--results-md", action="store_true", help="also write the run's section of bench/RESULTS.md")
    args = p.parse_args(argv)
    args.argv = argv
    args.cpu_set = frozenset(int(c) for c in args.cpus.split(",")) if args.cpus else frozenset(os.sched_getaffinity(0))
    result = asyncio.run(run(args))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "priority.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(ttft_table(result), texts_table(result), accounting_line(result), sep="\n\n")
    print(f"written to {path}", file=sys.stderr)
    if args.results_md:
        write_results_section(Path(__file__).resolve().parents[1] / "RESULTS.md", "priority", section(result))
    return 0
