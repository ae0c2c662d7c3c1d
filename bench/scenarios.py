"""The measurements. Each scenario drives one target over real WebSockets and
appends plain-dict samples to :attr:`Bench.samples`.

Stop latency is measured with cancels placed at random points of each phase:

* ``queued``: every slot is held by a long generation; one more request is
  queued and cancelled after a random delay.
* ``prefill_short`` / ``prefill_long``: cancelled after a random delay shorter
  than the prompt's measured prefill time. A request that already received a
  token is counted under ``decode`` instead.
* ``decode``: cancelled after a random number of token frames plus a random
  fraction of a decode step.
* ``decode_after_token``: cancelled the moment a token frame arrives, when the
  next decode step has just begun: the case that waits out a whole step
  unless the step itself can be stopped.

* ``decode_concurrent``: 4 streams (one per slot) decode at once; one of them
  is cancelled after a random number of token frames plus a random fraction
  of a decode step, and the others run on to their ``max_tokens``: the
  cancelled stream's stop latency beside one stream's, and the tokens the
  others lose (each slot has its own context, so none should be lost).

Prompt speed and reuse:

* ``prefill_speed``: a long prompt with ``max_tokens`` 1; time to first token
  and prompt tokens per second, as the server measured them.
* ``multi_turn``: a six-turn chat on one connection, about 80 tokens of new
  text per turn; each turn's time to first token and the prompt tokens the
  server took from its KV cache.

Over the HTTP API (``/v1``, the same server and token loop):

* ``openai_stream_closed``: the ``openai`` package streams a chat completion
  and closes the stream after a random number of chunks; the time until
  ``/metrics`` shows no active generation, as in ``disconnect``.
* ``delete_prefill``: a long prompt streams over SSE; a second client sends
  ``DELETE /v1/generations/{request_id}`` at a random point of its prefill.

Scale-out (``--redis-url``, docs/deploy.md):

* ``cancel_via_replica``: redis-server and two replicas; a WebSocket generation
  on the first is cancelled, in turn, by a DELETE on its owner and by a DELETE
  on the other replica, which relays it through Redis. The DELETE's answer
  time and the time to the ``cancelled`` frame, owner against other replica.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import aiohttp
import openai

from stopline.protocol.requests import DEFAULT_SAMPLING
from stopline.protocol.vocabulary import Outcome, Reason, Status

from .client import Call, Session, healthz, metrics
from .prompts import PromptMaker
from .servers import CpuMeter, Target, load_average

STOP_SCENARIOS = ("queued", "prefill_short", "prefill_long", "decode", "decode_after_token")
# One of several streams decoding at once is cancelled (needs CONCURRENT_STREAMS slots).
DECODE_CONCURRENT = "decode_concurrent"
CONCURRENT_STREAMS = 4
# The streams that are not cancelled: long enough to outlast the cancelled one's 1-32 frames.
CONCURRENT_OTHER_TOKENS = 96
SPEED_SCENARIOS = ("prefill_speed", "multi_turn")
TIMEOUT_SCENARIOS = ("timeout_total", "timeout_ttft")
HTTP_SCENARIOS = ("openai_stream_closed", "delete_prefill")
# Runs once, on servers of its own (redis-server and two replicas), not against each engine.
CANCEL_VIA_REPLICA = "cancel_via_replica"
ALL_SCENARIOS = (
    STOP_SCENARIOS
    + (DECODE_CONCURRENT,)
    + ("throughput",)
    + SPEED_SCENARIOS
    + TIMEOUT_SCENARIOS
    + ("disconnect",)
    + HTTP_SCENARIOS
    + (CANCEL_VIA_REPLICA,)
)
# Where a cancel_via_replica sample's DELETE went.
VIA_OWNER, VIA_OTHER = "owner", "other replica"
# The scenarios that send the long prompt or a whole chat (and take --long-requests samples).
LONG_SCENARIOS = ("prefill_long", "timeout_ttft", "delete_prefill", "prefill_speed", "multi_turn")
TURNS = 6
TURN_TOKENS = 80

# Longest token-frame count before a decode-phase cancel or disconnect.
MAX_FRAMES_BEFORE_STOP = 32
# Generations that should still be running when they are stopped.
LONG_GENERATION = 1024
QUEUED_MAX_DELAY_MS = 100.0


@dataclass
class Plan:
    requests: float  # samples per scenario per target (math.inf: until the duration is up)
    long_requests: float  # the same for the two long-prompt scenarios
    duration_s: float | None
    short_tokens: int
    long_tokens: int
    concurrency: int | None  # streams in the concurrent throughput run (None: one per slot)
    throughput_reps: int
    decode_tokens: int
    parallel: int  # concurrent samplers in the scenarios whose samples are independent
    # Stream counts of the throughput scenario (empty: 1 and concurrency).
    streams: tuple[int, ...] = ()

    def stream_counts(self, slots: int) -> list[int]:
        """The throughput scenario's stream counts on a server with ``slots`` slots."""
        wanted = self.streams or (1, self.concurrency or slots)
        return sorted({n for n in wanted if n <= slots})


def share(total: float, part: int, parts: int) -> float:
    """Part ``part`` of ``parts`` of ``total`` samples, so that the parts add up to it exactly."""
    if total == float("inf"):
        return total
    return int(total) * (part + 1) // parts - int(total) * part // parts


def share_range(total: int, part: int, parts: int) -> range:
    """The repetitions of part ``part`` of ``parts``, numbered as in one run of ``total``."""
    return range(total * part // parts, total * (part + 1) // parts)


async def sleep_until(ns: int) -> None:
    await asyncio.sleep(max(0.0, (ns - time.monotonic_ns()) / 1e9))


def stop_record(scenario: str, target: Target, call: Call, cancel_ns: int, **extra) -> dict:
    term = call.terminal
    return {
        "scenario": scenario,
        "target": target.name,
        "id": call.id,
        "outcome": term["type"],
        "reason": term.get("reason"),
        "client_ms": (call.terminal_ns - cancel_ns) / 1e6,
        "server_ms": term.get("cancel_latency_ms"),
        "tokens_after_cancel": term.get("tokens_after_cancel"),
        "frames_after_cancel": sum(1 for ns, _ in call.tokens if ns > cancel_ns),
        "tokens_generated": term.get("tokens_generated"),
        "token_frames": len(call.tokens),
        **extra,
    }


def lost_tokens(terminal: dict, max_tokens: int) -> int:
    """Tokens a stream that was not cancelled fell short of: none if it ended on its own."""
    if terminal["type"] == Outcome.DONE and terminal.get("reason") != Reason.MAX_TOKENS:
        return 0  # end of sequence or a stop sequence: nothing more was due
    return max(0, max_tokens - int(terminal.get("tokens_generated") or 0))


class Bench:
    def __init__(self, plan: Plan, prompts: PromptMaker, rng: random.Random, progress, cpu: CpuMeter | None = None):
        self.plan = plan
        self.cpu = cpu
        self.prompts = prompts
        self.rng = rng
        self.progress = progress
        self.samples: list[dict] = []
        # One entry per (scenario, target): requests sent, discards, the /metrics deltas.
        self.runs: list[dict] = []

    def _seed(self) -> int:
        return self.rng.randrange(2**31)

    def _generate_fields(self, tokens: int, max_tokens: int, **extra) -> dict:
        return {
            "messages": self.prompts.story(tokens),
            "max_tokens": max_tokens,
            "temperature": DEFAULT_SAMPLING.temperature,
            "seed": self._seed(),
            **extra,
        }

    # Calibration --------------------------------------------------------------

    async def calibrate(self, target: Target, long: bool = True) -> dict:
        """Measure the prefill time of each prompt length, and the decode step, before placing cancels."""
        plan = self.plan
        session = await Session.open(target.ws_url)
        try:
            for _ in range(2):  # the first run warms the slot up
                call = await session.generate("calibrate", **self._generate_fields(plan.short_tokens, 24))
                short = await call.wait_end()
            target.prefill_ms[plan.short_tokens] = short.get("ttft_ms") or short["duration_ms"]
            if short.get("ttft_ms") and short["tokens_generated"] > 1:
                target.step_ms = (short["duration_ms"] - short["ttft_ms"]) / (short["tokens_generated"] - 1)
            if long:
                call = await session.generate("calibrate", **self._generate_fields(plan.long_tokens, 1))
                end = await call.wait_end()
                target.prefill_ms[plan.long_tokens] = end.get("ttft_ms") or end["duration_ms"]
        finally:
            await session.close()
        return {"prefill_ms": dict(target.prefill_ms), "step_ms": target.step_ms}

    # The sampling loop ------------------------------------------------------------

    async def run(self, scenario: str, target: Target, part: int = 0, parts: int = 1) -> None:
        """Take part ``part`` of ``parts`` of the scenario's samples: the engines take turns, part by
        part, so that a change in the machine's load cannot favour one of them."""
        plan = self.plan
        long = scenario in LONG_SCENARIOS
        wanted = share(plan.long_requests if long else plan.requests, part, parts)
        if scenario == "multi_turn":
            wanted *= TURNS  # a sample per turn, long_requests chats
        if wanted <= 0:
            return
        start, run = await self._open_run(scenario, target)
        if scenario == "queued":
            await self._queued(target, run, wanted)
        elif scenario == "throughput":
            await self._throughput(target, run, share_range(plan.throughput_reps, part, parts))
        elif scenario == DECODE_CONCURRENT:
            if target.slots >= CONCURRENT_STREAMS:
                await self._lanes(target, run, wanted, 1, self._concurrent_sample, own_session=True)
        elif scenario == "disconnect":
            await self._lanes(target, run, wanted, 1, self._disconnect_sample, own_session=True)
        elif scenario == "openai_stream_closed":
            await self._lanes(target, run, wanted, 1, self._openai_closed_sample, own_session=True)
        elif scenario == "delete_prefill":
            await self._lanes(target, run, wanted, 1, self._delete_prefill_sample, own_session=True)
        else:
            sample = {
                "prefill_short": lambda t, s: self._prefill_sample(t, s, "prefill_short", plan.short_tokens),
                "prefill_long": lambda t, s: self._prefill_sample(t, s, "prefill_long", plan.long_tokens),
                "decode": self._decode_sample,
                "decode_after_token": lambda t, s: self._decode_sample(t, s, "decode_after_token"),
                "prefill_speed": self._prefill_speed_sample,
                "multi_turn": self._multi_turn_sample,
                "timeout_total": self._timeout_total_sample,
                "timeout_ttft": self._timeout_ttft_sample,
            }[scenario]
            await self._lanes(target, run, wanted, plan.parallel, sample)
        await self._end_sampling(target, run)
        target.windows.append((scenario, start, time.monotonic_ns()))
        self.runs.append(run)

    async def _open_run(self, scenario: str, target: Target) -> tuple[int, dict]:
        """The start time and the account of one scenario on one target."""
        if self.progress is not None:
            self.progress.set_description(f"{scenario} [{target.name}]")
        run = {
            "scenario": scenario,
            "target": target.name,
            "requests": 0,
            "valid": 0,
            "discarded": 0,
            "metrics_before": await metrics(target.http_url),
            "cpu_before": self.cpu.read() if self.cpu else None,
            "load_average": load_average(),
        }
        return time.monotonic_ns(), run

    def _keep_throughput(self, run: dict, records: list[dict], streams: int, spans: list[tuple[int, int]]) -> None:
        """Keep one throughput repetition: ``spans`` are (first, last) token times of the timed streams."""
        if spans:
            produced = sum(r["tokens"] - 1 for r in records if r["tokens_per_s_client"] is not None)
            aggregate = produced / ((max(last for _, last in spans) - min(first for first, _ in spans)) / 1e9)
            for r in records:
                r["aggregate_tokens_per_s"] = aggregate
        self.samples.extend(records)
        run["requests"] += streams
        run["valid"] += streams
        if self.progress is not None:
            self.progress.update(streams)

    async def _end_sampling(self, target: Target, run: dict) -> None:
        """Close the scenario's accounts: /metrics deltas and CPU use. Called before any cleanup
        requests (the queued scenario's slot holders) so that they are not counted."""
        if "metrics_before" not in run:
            return
        before, after = run.pop("metrics_before"), await metrics(target.http_url)
        for key in ("tokens_wasted", "tokens_generated"):
            name = f"stopline_{key}_total"
            run[f"{key}_delta"] = after.get(name, 0.0) - before.get(name, 0.0)
        cpu_before = run.pop("cpu_before")
        if cpu_before is not None:
            run["cpu"] = self.cpu.usage_since(cpu_before)

    def _more(self, run: dict, wanted: float, started_s: float) -> bool:
        if run["valid"] >= wanted:
            return False
        # A scenario whose samples keep being discarded must still end.
        if run["requests"] >= 3 * min(wanted, 10**6) + 5:
            return False
        return self.plan.duration_s is None or time.monotonic() - started_s < self.plan.duration_s

    def _keep(self, scenario: str, run: dict, records: list[dict]) -> None:
        run["requests"] += 1
        own = [r for r in records if r["scenario"] == scenario]
        run["valid"] += len(own)
        run["discarded"] += not records
        run["moved_to_decode"] = run.get("moved_to_decode", 0) + len(records) - len(own)
        self.samples.extend(records)
        if own and self.progress is not None:
            self.progress.update(len(own))

    async def _lanes(
        self, target: Target, run: dict, wanted: float, lanes: int, sample, own_session: bool = False
    ) -> None:
        """Take samples until the scenario has enough, ``lanes`` at a time, each lane on its own connection."""
        started = time.monotonic()

        async def lane():
            session = None if own_session else await Session.open(target.ws_url)
            try:
                while self._more(run, wanted, started):
                    self._keep(run["scenario"], run, await sample(target, session))
            finally:
                if session is not None:
                    await session.close()

        await asyncio.gather(*(lane() for _ in range(lanes)))

    # Stop latency -------------------------------------------------------------------

    async def _prefill_sample(self, target: Target, session: Session, scenario: str, tokens: int) -> list[dict]:
        estimate = target.prefill_ms[tokens]
        delay_ms = self.rng.uniform(0.0, 0.9 * estimate)
        call = await session.generate(scenario, **self._generate_fields(tokens, 64))
        await sleep_until(call.sent_ns + int(delay_ms * 1e6))
        if call.ended:
            return self._discard(session, call)
        cancel_ns = await session.cancel(call)
        await call.wait_end()
        session.forget(call)
        if call.terminal["type"] != Outcome.CANCELLED:
            return []
        # The client saw a token, so the cancel landed after the prefill: it is a decode sample.
        actual = scenario if not call.tokens else "decode"
        return [
            stop_record(
                actual,
                target,
                call,
                cancel_ns,
                delay_ms=delay_ms,
                prefill_estimate_ms=estimate,
                prompt_tokens=tokens,
                measured_as=scenario,
            )
        ]

    async def _decode_sample(self, target: Target, session: Session, scenario: str = "decode") -> list[dict]:
        frames = self.rng.randint(1, MAX_FRAMES_BEFORE_STOP)
        jitter_ms = self.rng.uniform(0.0, target.step_ms) if scenario == "decode" else 0.0
        call = await session.generate(scenario, **self._generate_fields(self.plan.short_tokens, LONG_GENERATION))
        await call.wait_tokens(frames)
        if call.ended:
            return self._discard(session, call)
        await sleep_until(call.tokens[frames - 1][0] + int(jitter_ms * 1e6))
        cancel_ns = await session.cancel(call)
        await call.wait_end()
        session.forget(call)
        if call.terminal["type"] != Outcome.CANCELLED:
            return []  # it finished on its own first
        return [
            stop_record(
                scenario,
                target,
                call,
                cancel_ns,
                cancel_after_frames=frames,
                jitter_ms=jitter_ms,
                prompt_tokens=self.plan.short_tokens,
                measured_as=scenario,
            )
        ]

    async def _concurrent_sample(self, target: Target, _session) -> list[dict]:
        """Cancel one of CONCURRENT_STREAMS decoding streams; the others run to their end."""
        await self._wait_idle(target)
        frames = self.rng.randint(1, MAX_FRAMES_BEFORE_STOP)
        jitter_ms = self.rng.uniform(0.0, target.step_ms)
        sessions = [await Session.open(target.ws_url) for _ in range(CONCURRENT_STREAMS)]
        try:
            calls = [
                await s.generate(
                    DECODE_CONCURRENT,
                    **self._generate_fields(
                        self.plan.short_tokens, LONG_GENERATION if i == 0 else CONCURRENT_OTHER_TOKENS
                    ),
                )
                for i, s in enumerate(sessions)
            ]
            cancelled, others = calls[0], calls[1:]
            # Every stream must be decoding when the cancel lands.
            await asyncio.gather(*(c.wait_tokens(1) for c in others), cancelled.wait_tokens(frames))
            if any(c.ended for c in calls):
                return []
            await sleep_until(cancelled.tokens[frames - 1][0] + int(jitter_ms * 1e6))
            cancel_ns = await sessions[0].cancel(cancelled)
            await cancelled.wait_end()
            ends = await asyncio.gather(*(c.wait_end() for c in others))
        finally:
            for s in sessions:
                await s.close()
        if cancelled.terminal["type"] != Outcome.CANCELLED:
            return []
        return [
            stop_record(
                DECODE_CONCURRENT,
                target,
                cancelled,
                cancel_ns,
                cancel_after_frames=frames,
                jitter_ms=jitter_ms,
                prompt_tokens=self.plan.short_tokens,
                measured_as=DECODE_CONCURRENT,
                streams=CONCURRENT_STREAMS,
                others_lost_tokens=sum(lost_tokens(end, CONCURRENT_OTHER_TOKENS) for end in ends),
                others_not_done=sum(end["type"] != Outcome.DONE for end in ends),
            )
        ]

    # Prompt speed and reuse ---------------------------------------------------------

    async def _prefill_speed_sample(self, target: Target, session: Session) -> list[dict]:
        tokens = self.plan.long_tokens
        call = await session.generate("prefill_speed", **self._generate_fields(tokens, 1))
        term = await call.wait_end()
        session.forget(call)
        if term["type"] != Outcome.DONE or not term.get("ttft_ms"):
            return []
        return [
            {
                "scenario": "prefill_speed",
                "target": target.name,
                "id": call.id,
                "outcome": Outcome.DONE,
                "prompt_tokens": term["prompt_tokens"],
                "prompt_tokens_reused": term.get("prompt_tokens_reused", 0),
                "ttft_server_ms": term["ttft_ms"],
                "ttft_client_ms": (call.tokens[0][0] - call.sent_ns) / 1e6 if call.tokens else None,
                "prompt_tokens_per_s": (term["prompt_tokens"] - term.get("prompt_tokens_reused", 0))
                / (term["ttft_ms"] / 1e3),
            }
        ]

    async def _multi_turn_sample(self, target: Target, session: Session) -> list[dict]:
        """One chat of TURNS turns; each user turn brings about TURN_TOKENS tokens of new text."""
        messages: list[dict] = []
        records = []
        for turn in range(1, TURNS + 1):
            # story() pads a one-message chat; its content alone is the new turn's text.
            messages.append(self.prompts.story(TURN_TOKENS + 25)[0])
            call = await session.generate(
                "multi_turn",
                messages=messages,
                max_tokens=48,
                temperature=DEFAULT_SAMPLING.temperature,
                seed=self._seed(),
            )
            term = await call.wait_end()
            session.forget(call)
            if term["type"] != Outcome.DONE:
                return []
            messages.append({"role": "assistant", "content": "".join(frame["text"] for _, frame in call.tokens)})
            records.append(
                {
                    "scenario": "multi_turn",
                    "target": target.name,
                    "id": call.id,
                    "turn": turn,
                    "outcome": Outcome.DONE,
                    "prompt_tokens": term["prompt_tokens"],
                    "prompt_tokens_reused": term.get("prompt_tokens_reused", 0),
                    "ttft_server_ms": term["ttft_ms"],
                    "ttft_client_ms": (call.tokens[0][0] - call.sent_ns) / 1e6 if call.tokens else None,
                }
            )
        return records

    def _discard(self, session: Session, call: Call) -> list[dict]:
        session.forget(call)
        return []

    async def _queued(self, target: Target, run: dict, wanted: float) -> None:
        """Hold every slot with a long generation, then queue one more request and cancel it."""
        holders = await Session.open(target.ws_url)
        session = await Session.open(target.ws_url)

        async def hold() -> Call:
            call = await holders.generate("holder", **self._generate_fields(self.plan.short_tokens, 1900))
            await call.wait_tokens(1)
            return call

        blockers = list(await asyncio.gather(*(hold() for _ in range(target.slots))))
        started = time.monotonic()
        try:
            while self._more(run, wanted, started):
                # A holder that finished on its own frees its slot: replace it first.
                for i, blocker in enumerate(blockers):
                    if blocker.ended:
                        holders.forget(blocker)
                        blockers[i] = await hold()
                call = await session.generate("queued", **self._generate_fields(self.plan.short_tokens, 64))
                await call.wait_accepted()
                if call.ended or call.accepted["queue_position"] == 0:
                    if not call.ended:
                        await session.cancel(call)
                        await call.wait_end()
                    self._keep("queued", run, self._discard(session, call))
                    continue
                delay_ms = self.rng.uniform(0.0, QUEUED_MAX_DELAY_MS)
                await sleep_until(call.accepted_ns + int(delay_ms * 1e6))
                cancel_ns = await session.cancel(call)
                await call.wait_end()
                session.forget(call)
                # If a holder ended first, the request may have left the queue before the cancel.
                still_queued = all(not b.ended or b.terminal_ns > call.terminal_ns for b in blockers)
                if call.terminal["type"] != Outcome.CANCELLED or call.tokens or not still_queued:
                    self._keep("queued", run, [])
                    continue
                self._keep(
                    "queued",
                    run,
                    [
                        stop_record(
                            "queued",
                            target,
                            call,
                            cancel_ns,
                            delay_ms=delay_ms,
                            queue_position=call.accepted["queue_position"],
                            prompt_tokens=self.plan.short_tokens,
                            measured_as="queued",
                        )
                    ],
                )
        finally:
            await self._end_sampling(target, run)
            for blocker in blockers:
                if not blocker.ended:
                    await holders.cancel(blocker)
            await asyncio.gather(*(b.wait_end() for b in blockers))
            await holders.close()
            await session.close()

    # Throughput ------------------------------------------------------------------------

    async def _throughput(self, target: Target, run: dict, reps: range) -> None:
        """Decode rate and time to first token, with one stream and with N concurrent streams."""
        for streams in self.plan.stream_counts(target.slots):
            for rep in reps:
                sessions = [await Session.open(target.ws_url) for _ in range(streams)]
                try:
                    calls = [
                        await s.generate(
                            "throughput", **self._generate_fields(self.plan.short_tokens, self.plan.decode_tokens)
                        )
                        for s in sessions
                    ]
                    await asyncio.gather(*(c.wait_end() for c in calls))
                finally:
                    for s in sessions:
                        await s.close()
                records = [self._throughput_record(target, call, streams, rep) for call in calls]
                self._keep_throughput(
                    run, records, streams, [(c.tokens[0][0], c.tokens[-1][0]) for c in calls if len(c.tokens) >= 2]
                )

    def _throughput_record(self, target: Target, call: Call, streams: int, rep: int) -> dict:
        term = call.terminal
        n = term.get("tokens_generated", 0)
        rate_client = rate_server = None
        if len(call.tokens) >= 2 and n >= 2:
            # Frames may carry several tokens (held-back UTF-8), so count tokens, not frames.
            rate_client = (n - 1) / ((call.tokens[-1][0] - call.tokens[0][0]) / 1e9)
            if term.get("ttft_ms") is not None and term["duration_ms"] > term["ttft_ms"]:
                rate_server = (n - 1) / ((term["duration_ms"] - term["ttft_ms"]) / 1e3)
        return {
            "scenario": "throughput",
            "target": target.name,
            "id": call.id,
            "streams": streams,
            "rep": rep,
            "outcome": term["type"],
            "reason": term.get("reason"),
            "tokens": n,
            "ttft_client_ms": (call.tokens[0][0] - call.sent_ns) / 1e6 if call.tokens else None,
            "ttft_server_ms": term.get("ttft_ms"),
            "tokens_per_s_client": rate_client,
            "tokens_per_s_server": rate_server,
        }

    # Timeouts ----------------------------------------------------------------------------

    async def _timeout_total_sample(self, target: Target, session: Session) -> list[dict]:
        # A deadline meant for the decode phase: well past the prefill, before the generation would end.
        deadline_ms = 1.25 * target.prefill_ms[self.plan.short_tokens] + self.rng.uniform(100.0, 600.0)
        call = await session.generate(
            "timeout_total",
            **self._generate_fields(self.plan.short_tokens, LONG_GENERATION, timeout_s=deadline_ms / 1000),
        )
        return self._timeout_record(
            "timeout_total", Reason.TOTAL_TIMEOUT, target, session, call, deadline_ms, await call.wait_end()
        )

    async def _timeout_ttft_sample(self, target: Target, session: Session) -> list[dict]:
        # A first-token deadline in the first quarter of a long prompt's prefill.
        deadline_ms = target.prefill_ms[self.plan.long_tokens] * self.rng.uniform(0.05, 0.25)
        call = await session.generate(
            "timeout_ttft", **self._generate_fields(self.plan.long_tokens, 16, ttft_timeout_s=deadline_ms / 1000)
        )
        return self._timeout_record(
            "timeout_ttft", Reason.FIRST_TOKEN_TIMEOUT, target, session, call, deadline_ms, await call.wait_end()
        )

    def _timeout_record(
        self, scenario: str, reason: str, target: Target, session: Session, call: Call, deadline_ms: float, term: dict
    ) -> list[dict]:
        session.forget(call)
        if term["type"] != Outcome.TIMEOUT or term.get("reason") != reason:
            return []
        if scenario == "timeout_total" and not call.tokens:
            # The prefill ran longer than calibrated and the deadline fell inside it: kept apart.
            scenario = "timeout_total_prefill"
        return [
            {
                "scenario": scenario,
                "target": target.name,
                "id": call.id,
                "outcome": term["type"],
                "reason": term["reason"],
                "deadline_ms": deadline_ms,
                "server_over_ms": term["duration_ms"] - deadline_ms,
                "client_over_ms": (call.terminal_ns - call.sent_ns) / 1e6 - deadline_ms,
                "tokens_generated": term.get("tokens_generated"),
                "token_frames": len(call.tokens),
            }
        ]

    # Disconnect ----------------------------------------------------------------------------

    async def _disconnect_sample(
        self, target: Target, _session, scenario: str = "disconnect", others: int = 0
    ) -> list[dict]:
        """Drop the socket mid-generation; time until /metrics shows only ``others`` active generations."""
        if not others:
            await self._wait_idle(target)
        session = await Session.open(target.ws_url)
        frames = self.rng.randint(1, MAX_FRAMES_BEFORE_STOP)
        jitter_ms = self.rng.uniform(0.0, target.step_ms)
        try:
            call = await session.generate(scenario, **self._generate_fields(self.plan.short_tokens, LONG_GENERATION))
            await call.wait_tokens(frames)
            if call.ended:
                return []
            await sleep_until(call.tokens[frames - 1][0] + int(jitter_ms * 1e6))
            dropped_ns = session.drop()
        finally:
            await session.close()
        return [
            {
                "scenario": scenario,
                "target": target.name,
                "id": call.id,
                "outcome": Outcome.CANCELLED,
                "reason": Reason.CLIENT_DISCONNECTED,
                **await self._until_idle(target, dropped_ns, others),
                "cancel_after_frames": frames,
                "jitter_ms": jitter_ms,
                "token_frames": len(call.tokens),
            }
        ]

    async def _until_idle(self, target: Target, since_ns: int, others: int = 0) -> dict:
        """Poll /metrics until only ``others`` generations are active; the times are from ``since_ns``."""
        polls = 0
        while True:
            sent_ns = time.monotonic_ns()
            active = (await metrics(target.http_url)).get("stopline_active_generations", 0.0)
            seen_ns = time.monotonic_ns()
            polls += 1
            if active <= others:
                break
            # A short pause keeps the polling itself from loading the server it measures.
            await asyncio.sleep(0.001)
        # The generation stopped between this poll's request and its answer: report the answer (upper bound).
        return {"client_ms": (seen_ns - since_ns) / 1e6, "lower_bound_ms": (sent_ns - since_ns) / 1e6, "polls": polls}

    async def _wait_idle(self, target: Target, timeout: float = 120.0) -> None:
        async with asyncio.timeout(timeout):
            while True:
                m = await metrics(target.http_url)
                if m.get("stopline_active_generations", 0.0) == 0 and m.get("stopline_queue_depth", 0.0) == 0:
                    return
                await asyncio.sleep(0.01)

    # The HTTP API ------------------------------------------------------------------------

    async def _api_url(self, target: Target) -> str:
        if target.api_url is None:
            target.api_url = (await healthz(target.http_url))["http_api"]
        return target.api_url

    async def _openai_closed_sample(self, target: Target, _session) -> list[dict]:
        """Close an OpenAI chat stream mid-generation, as a client of the openai package does."""
        await self._wait_idle(target)
        client = openai.AsyncOpenAI(base_url=await self._api_url(target), api_key="unused", max_retries=0)
        chunks = self.rng.randint(1, MAX_FRAMES_BEFORE_STOP)
        jitter_ms = self.rng.uniform(0.0, target.step_ms)
        fields = self._generate_fields(self.plan.short_tokens, LONG_GENERATION)
        try:
            stream = await client.chat.completions.create(model=target.name, stream=True, **fields)
            arrivals = []
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    arrivals.append(time.monotonic_ns())
                if len(arrivals) == chunks or (chunk.choices and chunk.choices[0].finish_reason):
                    break
            if len(arrivals) < chunks:
                return []  # it ended on its own first
            await sleep_until(arrivals[-1] + int(jitter_ms * 1e6))
            closed_ns = time.monotonic_ns()
            await stream.close()
        finally:
            await client.close()
        return [
            {
                "scenario": "openai_stream_closed",
                "target": target.name,
                "id": chunk.id,
                "outcome": Outcome.CANCELLED,
                "reason": Reason.CLIENT_DISCONNECTED,
                **await self._until_idle(target, closed_ns),
                "cancel_after_frames": chunks,
                "jitter_ms": jitter_ms,
                "token_frames": len(arrivals),
            }
        ]

    async def _delete_prefill_sample(self, target: Target, _session) -> list[dict]:
        """A second client DELETEs a generation at a random point of its long prompt's prefill."""
        api = await self._api_url(target)
        estimate = target.prefill_ms[self.plan.long_tokens]
        delay_ms = self.rng.uniform(0.0, 0.9 * estimate)
        events: list[tuple[int, str, dict]] = []
        async with aiohttp.ClientSession() as owner, aiohttp.ClientSession() as other:
            sent_ns = time.monotonic_ns()
            response = await owner.post(f"{api}/generations", json=self._generate_fields(self.plan.long_tokens, 64))
            reader = asyncio.create_task(_read_sse(response, events))
            try:
                async with asyncio.timeout(60):
                    while not events:
                        await asyncio.sleep(0.001)
                _, kind, accepted = events[0]
                if kind != "accepted":
                    return []
                await sleep_until(sent_ns + int(delay_ms * 1e6))
                if len(events) > 1:
                    return []  # a token or its end came first: not a prefill sample
                cancel_ns = time.monotonic_ns()
                async with other.delete(
                    f"{api}/generations/{accepted['request_id']}",
                    headers={"Authorization": f"Bearer {accepted['cancel_token']}"},
                ) as answer:
                    status = (await answer.json())["status"]
                answered_ns = time.monotonic_ns()
                await asyncio.wait_for(reader, 60)
            finally:
                reader.cancel()
                response.close()
        terminal_ns, kind, terminal = events[-1]
        tokens = [ns for ns, event, _ in events if event == "token"]
        if kind != Outcome.CANCELLED or tokens or status != Status.CANCELLED:
            return []
        return [
            {
                "scenario": "delete_prefill",
                "target": target.name,
                "id": accepted["request_id"],
                "outcome": kind,
                "reason": terminal["reason"],
                "client_ms": (terminal_ns - cancel_ns) / 1e6,
                "delete_answer_ms": (answered_ns - cancel_ns) / 1e6,
                "server_ms": terminal["cancel_latency_ms"],
                "tokens_after_cancel": terminal["tokens_after_cancel"],
                "tokens_generated": terminal["tokens_generated"],
                "delay_ms": delay_ms,
                "prefill_estimate_ms": estimate,
                "prompt_tokens": self.plan.long_tokens,
            }
        ]


async def _read_sse(response: aiohttp.ClientResponse, events: list) -> None:
    """Append (arrival ns, event, data) for each server-sent event until the stream ends."""
    event = None
    async for raw in response.content:
        now = time.monotonic_ns()
        line = raw.decode().rstrip("\r\n")
        if line.startswith("event: "):
            event = line[len("event: ") :]
        elif line.startswith("data: ") and event is not None:
            events.append((now, event, json.loads(line[len("data: ") :])))
            event = None


async def run_cancel_via_replica(bench: Bench, owner: Target, other: Target) -> None:
    """DELETE a running generation of ``owner``, alternately on ``owner`` and on ``other``."""
    for target in (owner, other):
        async with asyncio.timeout(30):
            while (await healthz(target.http_url)).get("store", {}).get("state") != "up":
                await asyncio.sleep(0.05)
    start, run = await bench._open_run(CANCEL_VIA_REPLICA, owner)
    started = time.monotonic()
    apis = {VIA_OWNER: await bench._api_url(owner), VIA_OTHER: await bench._api_url(other)}
    session = await Session.open(owner.ws_url)
    # One keep-alive connection per replica, opened before the first sample, as a gateway would hold.
    async with aiohttp.ClientSession() as http:
        for api in apis.values():
            async with http.get(f"{api}/models") as response:
                await response.read()
        try:
            while bench._more(run, bench.plan.requests, started):
                via = (VIA_OWNER, VIA_OTHER)[run["requests"] % 2]
                bench._keep(CANCEL_VIA_REPLICA, run, await _cancel_via(bench, owner, session, http, apis[via], via))
        finally:
            await session.close()
    await bench._end_sampling(owner, run)
    owner.windows.append((CANCEL_VIA_REPLICA, start, time.monotonic_ns()))
    bench.runs.append(run)


async def _cancel_via(
    bench: Bench, owner: Target, session: Session, http: aiohttp.ClientSession, api: str, via: str
) -> list[dict]:
    frames = bench.rng.randint(1, 8)
    call = await session.generate(
        CANCEL_VIA_REPLICA, **bench._generate_fields(bench.plan.short_tokens, LONG_GENERATION)
    )
    await call.wait_tokens(frames)
    if call.ended:
        return bench._discard(session, call)
    accepted = call.accepted
    sent_ns = time.monotonic_ns()
    async with http.delete(
        f"{api}/generations/{accepted['request_id']}", headers={"Authorization": f"Bearer {accepted['cancel_token']}"}
    ) as response:
        answer = await response.json()
        replica = response.headers.get("X-Stopline-Replica")
    answered_ns = time.monotonic_ns()
    await call.wait_end()
    session.forget(call)
    if call.terminal["type"] != "cancelled" or answer.get("status") != "cancelled":
        return []
    return [
        stop_record(
            CANCEL_VIA_REPLICA,
            owner,
            call,
            sent_ns,
            via=via,
            answered_by=replica,
            delete_ms=(answered_ns - sent_ns) / 1e6,
            cancel_after_frames=frames,
        )
    ]
