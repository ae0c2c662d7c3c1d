"""The measurements, each written once over the drivers (``bench/drivers/``): a scenario drives
one server and appends samples, one schema whichever the driver, to :attr:`Bench.samples`; a
server whose driver cannot take part in a scenario is skipped for it. How each places its stop
is in bench/RESULTS.md ("How the cancels are placed"); in short:

* stops: ``queued``, ``prefill_short``/``prefill_long`` (a random delay within the calibrated
  prefill), ``decode`` (after 1-32 token frames and part of a step), ``decode_after_token``,
  ``decode_concurrent`` (1 of as many decoding streams as the server has slots, at least 4; the
  others' lost tokens);
* speed: ``throughput``, ``prefill_speed``, ``multi_turn``; deadlines: ``timeout_total``, ``timeout_ttft``;
* a client that goes away: ``disconnect``, ``disconnect_busy`` (while another client streams),
  ``nonstream``; over Stopline's HTTP API, ``openai_stream_closed`` and ``delete_prefill``;
* ``cancel_via_replica`` (docs/deploy.md): a DELETE on the owner against one relayed by another replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from dataclasses import dataclass

import aiohttp

from stopline.protocol.vocabulary import Outcome, Reason, Status

from .drivers import base
from .drivers.base import Driver, End, Lane, Request, Stream
from .drivers.stopline import StoplineDriver, delete_generation
from .machine import CpuMeter, load_average
from .prompts import PromptMaker

STOP_SCENARIOS = ("queued", "prefill_short", "prefill_long", "decode", "decode_after_token")
DECODE_CONCURRENT = "decode_concurrent"
# The fewest streams decode_concurrent runs: it runs one per slot (--wide-workers sets them).
CONCURRENT_STREAMS = 4
# The streams that are not cancelled: long enough to outlast the cancelled one's 1-32 frames.
CONCURRENT_OTHER_TOKENS = 96
TIMEOUT_SCENARIOS = ("timeout_total", "timeout_ttft")
HTTP_SCENARIOS = ("openai_stream_closed", "delete_prefill")
NONSTREAM, DISCONNECT_BUSY = "nonstream", "disconnect_busy"
CANCEL_VIA_REPLICA = "cancel_via_replica"
# Where a cancel_via_replica sample's DELETE went.
VIA_OWNER, VIA_OTHER = "owner", "other replica"
TURNS = 6
TURN_TOKENS = 80
# Longest token-frame count before a decode-phase cancel or disconnect.
MAX_FRAMES_BEFORE_STOP = 32
# Generations that should still be running when they are stopped.
LONG_GENERATION = 1024
QUEUED_MAX_DELAY_MS = 100.0
# Bounds each sample in which a server never notices that its client left: it runs to its end.
BUSY_MAX_TOKENS = 256


@dataclass(frozen=True)
class Scenario:
    name: str
    needs: frozenset[str] = frozenset()  # the driver capabilities it uses (drivers/base.py)
    long: bool = False  # sends the long prompt or a whole chat, and takes --long-requests samples
    slots: int = 1  # the slots it needs at once
    lanes: bool = False  # --parallel samplers at once


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("queued", frozenset({base.QUEUE})),
        Scenario("prefill_short", lanes=True),
        Scenario("prefill_long", long=True, lanes=True),
        Scenario("decode", lanes=True),
        Scenario("decode_after_token", lanes=True),
        Scenario(DECODE_CONCURRENT, slots=CONCURRENT_STREAMS),
        Scenario("throughput"),
        Scenario("prefill_speed", long=True, lanes=True),
        Scenario("multi_turn", long=True, lanes=True),
        Scenario("timeout_total", frozenset({base.DEADLINES}), lanes=True),
        Scenario("timeout_ttft", frozenset({base.DEADLINES}), long=True, lanes=True),
        Scenario("disconnect"),
        Scenario("openai_stream_closed", frozenset({base.OPENAI})),
        Scenario("delete_prefill", frozenset({base.DELETE}), long=True),
        Scenario(CANCEL_VIA_REPLICA, frozenset({"replicas"})),
        Scenario(NONSTREAM, frozenset({base.NONSTREAM})),
        Scenario(DISCONNECT_BUSY, slots=2),
    )
}
ALL_SCENARIOS = tuple(SCENARIOS)
LONG_SCENARIOS = tuple(name for name, s in SCENARIOS.items() if s.long)


@dataclass
class Plan:
    requests: float | None = None  # samples per scenario per server (None: 30, or until the duration is up)
    long_requests: float | None = None  # the same for the long scenarios (None: the smaller of requests and 6)
    duration_s: float | None = None
    short_tokens: int = 50
    long_tokens: int = 1500
    concurrency: int | None = None  # streams in the concurrent throughput run (None: one per slot)
    throughput_reps: int = 3
    decode_tokens: int = 128
    parallel: int = 1  # concurrent samplers in the scenarios whose samples are independent
    # Stream counts of the throughput scenario (empty: 1 and concurrency).
    streams: tuple[int, ...] = ()

    def __post_init__(self):
        if self.requests is None:
            self.requests = 30 if self.duration_s is None else math.inf
        if self.long_requests is None:
            self.long_requests = min(self.requests, 6)

    def stream_counts(self, slots: int) -> list[int]:
        """The throughput scenario's stream counts on a server with ``slots`` slots."""
        return sorted({n for n in (self.streams or (1, self.concurrency or slots)) if n <= slots})

    def samples(self, scenario: str) -> float:
        """Samples of ``scenario`` per server in all (a chat is TURNS samples)."""
        if scenario == "throughput":
            return self.throughput_reps
        wanted = self.long_requests if SCENARIOS[scenario].long else self.requests
        return wanted * (TURNS if scenario == "multi_turn" else 1)


def share(total: float, part: int, parts: int) -> float:
    """Part ``part`` of ``parts`` of ``total`` samples, so that the parts add up to it exactly."""
    if math.isinf(total):
        return total
    return int(total) * (part + 1) // parts - int(total) * part // parts


def share_range(total: int, part: int, parts: int) -> range:
    """The repetitions of part ``part`` of ``parts``, numbered as in one run of ``total``."""
    return range(total * part // parts, total * (part + 1) // parts)


async def sleep_until(ns: int) -> None:
    await asyncio.sleep(max(0.0, (ns - time.monotonic_ns()) / 1e9))


def stop_record(scenario: str, driver: Driver, stream: Stream, end: End, cancel_ns: int, **extra) -> dict:
    """A stop's sample: from the cancel (or the client's leaving) to the end the client saw."""
    record = sample(scenario, driver, stream, end, client_ms=(end.stop_ns - cancel_ns) / 1e6)
    record |= {"server_ms": end.server_ms, "tokens_after_cancel": end.tokens_after_cancel}
    record["frames_after_cancel"] = sum(1 for ns, _ in stream.tokens if ns > cancel_ns)
    record |= {"tokens_generated": end.tokens_generated, "token_frames": len(stream.tokens)}
    return record | end.extra | extra


def sample(scenario: str, driver: Driver, stream: Stream, end: End | None, **extra) -> dict:
    """What every sample holds: which scenario and server, the request, and how it ended."""
    outcome, reason = (end.outcome, end.reason) if end else (Outcome.ERROR, None)
    return {"scenario": scenario, "target": driver.name, "id": stream.id, "outcome": outcome, "reason": reason} | extra


def lost_tokens(end: End | None, max_tokens: int) -> int:
    """Tokens a stream that was not cancelled fell short of: none if it ended on its own."""
    if end is not None and end.outcome == Outcome.DONE and end.reason != Reason.MAX_TOKENS:
        return 0  # end of sequence or a stop sequence: nothing more was due
    return max(0, max_tokens - int(end.tokens_generated or 0 if end else 0))


def first_token_ms(stream: Stream) -> float | None:
    return (stream.tokens[0][0] - stream.sent_ns) / 1e6 if stream.tokens else None


class Bench:
    def __init__(
        self, plan: Plan, prompts: PromptMaker, rng: random.Random, progress=None, cpu: CpuMeter | None = None
    ):
        self.plan, self.prompts, self.rng, self.progress, self.cpu = plan, prompts, rng, progress, cpu
        self.samples: list[dict] = []
        # One entry per (scenario, server): requests sent, discards, the /metrics deltas.
        self.runs: list[dict] = []

    def request(self, tokens: int, max_tokens: int, **extra) -> Request:
        seed = self.rng.randrange(2**31)
        return Request(self.prompts.story(tokens), max_tokens, seed, **extra)

    def supports(self, driver: Driver, scenario: str) -> bool:
        needs = SCENARIOS[scenario]
        return driver.supports(needs.needs) and driver.slots >= needs.slots

    async def calibrate(self, driver: Driver, long: bool = True) -> dict:
        """Measure the prefill time of each prompt length, and the decode step, before placing cancels."""
        plan = self.plan
        async with await driver.lane() as lane:
            for _ in range(2):  # the first run warms the slot up
                short = await (await lane.generate(self.request(plan.short_tokens, 24))).wait_end()
            assert short is not None and short.outcome == Outcome.DONE, f"{driver.name}: calibration ended {short}"
            driver.prefill_ms[plan.short_tokens] = short.ttft_server_ms or short.duration_ms or 0.0
            driver.step_ms = short.step_ms or driver.step_ms
            if long:
                end = await (await lane.generate(self.request(plan.long_tokens, 1))).wait_end()
                assert end is not None, f"{driver.name}: no end to the long calibration"
                driver.prefill_ms[plan.long_tokens] = end.ttft_server_ms or end.duration_ms or 0.0
        return {"prefill_ms": dict(driver.prefill_ms), "step_ms": driver.step_ms}

    # The sampling loop ---------------------------------------------------------------------

    async def run(self, scenario: str, driver: Driver, part: int = 0, parts: int = 1) -> None:
        """Take part ``part`` of ``parts`` of the scenario's samples: the servers take turns, part by
        part, so that a change in the machine's load cannot favour one of them."""
        if not self.supports(driver, scenario) or scenario == CANCEL_VIA_REPLICA:
            return
        plan = self.plan
        if scenario == "throughput":
            reps = share_range(plan.throughput_reps, part, parts)
            wanted = float(len(reps))
        else:
            wanted = share(plan.samples(scenario), part, parts)
        if wanted <= 0:
            return
        await driver.wait_idle()
        start, run = await self.open_run(scenario, driver)
        if scenario == "throughput":
            await self._throughput(driver, run, reps)
        elif scenario in ("queued", DISCONNECT_BUSY):
            await getattr(self, f"_{scenario}")(driver, run, wanted)
        else:
            lanes = plan.parallel if SCENARIOS[scenario].lanes else 1
            await self._lanes(driver, run, wanted, lanes, self._sampler(scenario))
        await self.end_run(driver, run, start)

    def _sampler(self, scenario: str):
        plan = self.plan
        return {
            "prefill_short": lambda d, lane: self._prefill(d, lane, "prefill_short", plan.short_tokens),
            "prefill_long": lambda d, lane: self._prefill(d, lane, "prefill_long", plan.long_tokens),
            "decode": self._decode,
            "decode_after_token": lambda d, lane: self._decode(d, lane, "decode_after_token"),
            DECODE_CONCURRENT: self._concurrent,
            "prefill_speed": self._prefill_speed,
            "multi_turn": self._multi_turn,
            "timeout_total": lambda d, lane: self._timeout(d, lane, "timeout_total"),
            "timeout_ttft": lambda d, lane: self._timeout(d, lane, "timeout_ttft"),
            "disconnect": lambda d, _: self._leave(d, "disconnect"),
            NONSTREAM: lambda d, _: self._leave(d, NONSTREAM, whole=True),
            "openai_stream_closed": lambda d, _: self._leave(d, "openai_stream_closed", transport=base.OPENAI),
            "delete_prefill": self._delete_prefill,
        }[scenario]

    async def open_run(self, scenario: str, driver: Driver) -> tuple[int, dict]:
        """The start time and the account of one scenario on one server."""
        if self.progress is not None:
            self.progress.set_description(f"{scenario} [{driver.name}]")
        run = dict(scenario=scenario, target=driver.name, requests=0, valid=0, discarded=0)
        run |= {"metrics_before": await driver.metrics(), "cpu_before": self.cpu.read() if self.cpu else None}
        return time.monotonic_ns(), run | {"load_average": load_average()}

    async def end_sampling(self, driver: Driver, run: dict) -> None:
        """Close the scenario's accounts (/metrics deltas, CPU use), before any clean-up requests."""
        if "metrics_before" not in run:
            return
        before, cpu_before = run.pop("metrics_before"), run.pop("cpu_before")
        if before is not None:
            after = await driver.metrics() or {}
            for key in ("tokens_wasted", "tokens_generated"):
                run[f"{key}_delta"] = after.get(f"stopline_{key}_total", 0.0) - before.get(f"stopline_{key}_total", 0.0)
        if cpu_before is not None and self.cpu is not None:
            run["cpu"] = self.cpu.usage_since(cpu_before)

    async def end_run(self, driver: Driver, run: dict, start: int) -> None:
        await self.end_sampling(driver, run)
        driver.windows.append((run["scenario"], start, time.monotonic_ns()))
        self.runs.append(run)

    def more(self, run: dict, wanted: float, started_s: float) -> bool:
        # A scenario whose samples keep being discarded must still end.
        if run["valid"] >= wanted or run["requests"] >= 3 * min(wanted, 10**6) + 5:
            return False
        return self.plan.duration_s is None or time.monotonic() - started_s < self.plan.duration_s

    def keep(self, scenario: str, run: dict, records: list[dict], requests: int = 1) -> None:
        run["requests"] += requests
        own = [r for r in records if r["scenario"] == scenario]
        run["valid"] += len(own)
        run["discarded"] += not records
        run["moved_to_decode"] = run.get("moved_to_decode", 0) + len(records) - len(own)
        self.samples.extend(records)
        if own and self.progress is not None:
            self.progress.update(len(own))

    async def _lanes(self, driver: Driver, run: dict, wanted: float, lanes: int, sample) -> None:
        """Take samples until the scenario has enough, ``lanes`` at a time, each on a lane of its own."""
        started = time.monotonic()

        async def lane(index: int) -> None:
            async with await driver.lane(index) as lane:
                while self.more(run, wanted, started):
                    self.keep(run["scenario"], run, await sample(driver, lane))

        await asyncio.gather(*(lane(index) for index in range(lanes)))

    # Stop latency ---------------------------------------------------------------------------

    async def _prefill(self, driver: Driver, lane: Lane, scenario: str, tokens: int, moved: str | None = "decode"):
        estimate = driver.prefill_ms[tokens]
        delay_ms = self.rng.uniform(0.0, 0.9 * estimate)
        stream = await lane.generate(self.request(tokens, 64))
        await sleep_until(stream.sent_ns + int(delay_ms * 1e6))
        if stream.ended or (stream.tokens and moved is None):
            return []
        cancel_ns = await stream.cancel()
        end = await stream.stopped()
        # The client saw a token, so the cancel landed after the prefill: it is a decode sample.
        actual = moved if stream.tokens else scenario
        if end.outcome != Outcome.CANCELLED or actual is None:
            return []
        placed = {"delay_ms": delay_ms, "prefill_estimate_ms": estimate, "prompt_tokens": tokens}
        return [stop_record(actual, driver, stream, end, cancel_ns, **placed, measured_as=scenario)]

    async def _delete_prefill(self, driver: Driver, _lane) -> list[dict]:
        """A second client DELETEs a generation over SSE at a random point of its long prompt's prefill."""
        async with await driver.lane(transport=base.DELETE) as lane:
            return await self._prefill(driver, lane, "delete_prefill", self.plan.long_tokens, moved=None)

    def _decode_point(self, driver: Driver, jitter: bool = True) -> tuple[int, float]:
        """Where a decode-phase stop lands: after 1-32 token frames, plus part of a step."""
        frames = self.rng.randint(1, MAX_FRAMES_BEFORE_STOP)
        return frames, self.rng.uniform(0.0, driver.step_ms) if jitter else 0.0

    @staticmethod
    async def _reach(stream: Stream, frames: int, jitter_ms: float) -> bool:
        """Wait for the stop's moment; False if the request ended first."""
        await stream.wait_tokens(frames)
        if stream.ended:
            return False
        await sleep_until(stream.tokens[frames - 1][0] + int(jitter_ms * 1e6))
        return True

    async def _decode(self, driver: Driver, lane: Lane, scenario: str = "decode") -> list[dict]:
        # Right after a token: the moment its frame arrives, when the next step has just begun.
        frames, jitter_ms = self._decode_point(driver, scenario == "decode")
        stream = await lane.generate(self.request(self.plan.short_tokens, LONG_GENERATION))
        if not await self._reach(stream, frames, jitter_ms):
            return []
        cancel_ns = await stream.cancel()
        end = await stream.stopped()
        if end.outcome != Outcome.CANCELLED:
            return []  # it finished on its own first
        placed = {"cancel_after_frames": frames, "jitter_ms": jitter_ms, "prompt_tokens": self.plan.short_tokens}
        return [stop_record(scenario, driver, stream, end, cancel_ns, **placed, measured_as=scenario)]

    async def _concurrent(self, driver: Driver, _lane) -> list[dict]:
        """Cancel one of the decoding streams, one per slot; the others run to their end."""
        await driver.wait_idle()
        frames, jitter_ms = self._decode_point(driver)
        count = driver.slots
        async with contextlib.AsyncExitStack() as stack:
            lanes = [await stack.enter_async_context(await driver.lane(i)) for i in range(count)]
            streams = [
                await lane.generate(
                    self.request(self.plan.short_tokens, LONG_GENERATION if i == 0 else CONCURRENT_OTHER_TOKENS)
                )
                for i, lane in enumerate(lanes)
            ]
            cancelled, others = streams[0], streams[1:]
            # Every stream must be decoding when the cancel lands.
            await asyncio.gather(*(s.wait_tokens(1) for s in others))
            if not await self._reach(cancelled, frames, jitter_ms) or any(s.ended for s in others):
                return []
            cancel_ns = await cancelled.cancel()
            end = await cancelled.stopped()
            ends = await asyncio.gather(*(s.wait_end() for s in others))
        if end.outcome != Outcome.CANCELLED:
            return []
        placed = {"cancel_after_frames": frames, "jitter_ms": jitter_ms, "prompt_tokens": self.plan.short_tokens}
        others = {"others_lost_tokens": sum(lost_tokens(e, CONCURRENT_OTHER_TOKENS) for e in ends)}
        others["others_not_done"] = sum(e is None or e.outcome != Outcome.DONE for e in ends)
        record = stop_record(DECODE_CONCURRENT, driver, cancelled, end, cancel_ns, **placed, **others)
        return [record | {"measured_as": DECODE_CONCURRENT, "streams": count}]

    async def _queued(self, driver: Driver, run: dict, wanted: float) -> None:
        """Hold every slot with a long generation, then queue one more request and cancel it."""
        holders, lane = await driver.lane(), await driver.lane()

        async def hold() -> Stream:
            stream = await holders.generate(self.request(self.plan.short_tokens, 1900))
            await stream.wait_tokens(1)
            return stream

        blockers = list(await asyncio.gather(*(hold() for _ in range(driver.slots))))
        started = time.monotonic()
        try:
            while self.more(run, wanted, started):
                # A holder that finished on its own frees its slot: replace it first.
                for i, blocker in enumerate(blockers):
                    if blocker.ended:
                        blockers[i] = await hold()
                stream = await lane.generate(self.request(self.plan.short_tokens, 64))
                await stream.wait_accepted()
                if stream.ended or stream.accepted is None or stream.accepted["queue_position"] == 0:
                    if not stream.ended:
                        await stream.cancel()
                        await stream.wait_end()
                    self.keep("queued", run, [])
                    continue
                delay_ms = self.rng.uniform(0.0, QUEUED_MAX_DELAY_MS)
                await sleep_until(stream.accepted_ns + int(delay_ms * 1e6))
                cancel_ns = await stream.cancel()
                end = await stream.stopped()
                # If a holder ended first, the request may have left the queue before the cancel.
                still_queued = all(b.end is None or b.end.stop_ns > end.stop_ns for b in blockers)
                if end.outcome != Outcome.CANCELLED or stream.tokens or not still_queued:
                    self.keep("queued", run, [])
                    continue
                placed = {"delay_ms": delay_ms, "queue_position": stream.accepted["queue_position"]}
                record = stop_record("queued", driver, stream, end, cancel_ns, **placed)
                self.keep("queued", run, [record | {"prompt_tokens": self.plan.short_tokens, "measured_as": "queued"}])
        finally:
            await self.end_sampling(driver, run)
            for blocker in blockers:
                if not blocker.ended:
                    await blocker.cancel()
            await asyncio.gather(*(b.wait_end() for b in blockers))
            await holders.close()
            await lane.close()

    # A client that goes away ----------------------------------------------------------------

    async def _leave(
        self, driver: Driver, scenario: str, whole: bool = False, transport: str = "", others: int = 0
    ) -> list[dict]:
        """The client goes away during decode, and the time until the server has stopped (with
        ``others`` generations of other clients still running). ``whole``: a request answered at its
        end, left after its calibrated prefill plus 1-32 steps; else a stream, after 1-32 token frames."""
        if not others:
            await driver.wait_idle()
        frames = self.rng.randint(1, MAX_FRAMES_BEFORE_STOP)
        # A lane of its own: past the other clients' (on llama-server, a slot of its own).
        async with await driver.lane(others, transport) as lane:
            if whole:
                delay_ms = driver.prefill_ms[self.plan.short_tokens] + (frames + self.rng.random()) * driver.step_ms
                stream = await lane.generate(self.request(self.plan.short_tokens, BUSY_MAX_TOKENS, stream=False))
                await sleep_until(stream.sent_ns + int(delay_ms * 1e6))
                placed: dict = {"delay_ms": delay_ms, "max_tokens": BUSY_MAX_TOKENS}
                reached = not stream.ended
            else:
                jitter_ms = self.rng.uniform(0.0, driver.step_ms)
                stream = await lane.generate(self.request(self.plan.short_tokens, LONG_GENERATION))
                placed = {"cancel_after_frames": frames, "jitter_ms": jitter_ms}
                reached = await self._reach(stream, frames, jitter_ms)
            if not reached:
                return []
            # The openai package closes its stream; any other client here vanishes (a reset).
            gone_ns = await stream.cancel() if transport == base.OPENAI else stream.drop()
            end = await stream.stopped(others)
        if whole and not end.tokens_generated:
            return []  # it had not reached decode: under load the server had not even begun it
        placed["prompt_tokens"] = self.plan.short_tokens
        return [stop_record(scenario, driver, stream, end, gone_ns, **placed, measured_as=scenario)]

    async def _disconnect_busy(self, driver: Driver, run: dict, wanted: float) -> None:
        """One client streams without pause; another goes away during decode. Where the server
        answers requests whole, the measured one is such a request: its handler writes nothing
        until the end, the case in which a server may never notice."""
        whole = base.NONSTREAM in driver.capabilities
        background: Stream | None = None
        started = time.monotonic()
        async with await driver.lane(0) as streamer:
            try:
                while self.more(run, wanted, started):
                    if background is None or background.ended:
                        background = await streamer.generate(self.request(self.plan.short_tokens, LONG_GENERATION))
                        await background.wait_tokens(1)
                    records = await self._leave(driver, DISCONNECT_BUSY, whole=whole, others=1)
                    # Only samples during which the other client was streaming the whole time count.
                    self.keep(DISCONNECT_BUSY, run, records if not background.ended else [])
            finally:
                await self.end_sampling(driver, run)
                if background is not None and not background.ended:
                    await background.cancel()
                    await background.stopped()

    # Deadlines -------------------------------------------------------------------------------

    async def _timeout(self, driver: Driver, lane: Lane, scenario: str) -> list[dict]:
        plan = self.plan
        if scenario == "timeout_total":
            # A deadline meant for the decode phase: well past the prefill, before the generation would end.
            deadline_ms = 1.25 * driver.prefill_ms[plan.short_tokens] + self.rng.uniform(100.0, 600.0)
            reason = Reason.TOTAL_TIMEOUT
            request = self.request(plan.short_tokens, LONG_GENERATION, timeout_s=deadline_ms / 1000)
        else:
            # A first-token deadline in the first quarter of a long prompt's prefill.
            deadline_ms = driver.prefill_ms[plan.long_tokens] * self.rng.uniform(0.05, 0.25)
            reason = Reason.FIRST_TOKEN_TIMEOUT
            request = self.request(plan.long_tokens, 16, ttft_timeout_s=deadline_ms / 1000)
        stream = await lane.generate(request)
        end = await stream.wait_end()
        if end is None or end.outcome != Outcome.TIMEOUT or end.reason != reason or end.duration_ms is None:
            return []
        if scenario == "timeout_total" and not stream.tokens:
            # The prefill ran longer than calibrated and the deadline fell inside it: kept apart.
            scenario = "timeout_total_prefill"
        record = stop_record(scenario, driver, stream, end, stream.sent_ns, deadline_ms=deadline_ms)
        record["client_over_ms"] = record.pop("client_ms") - deadline_ms
        return [record | {"server_over_ms": end.duration_ms - deadline_ms}]

    # Speed ------------------------------------------------------------------------------------

    async def _prefill_speed(self, driver: Driver, lane: Lane) -> list[dict]:
        stream = await lane.generate(self.request(self.plan.long_tokens, 1))
        end = await stream.wait_end()
        if end is None or end.outcome != Outcome.DONE or not end.ttft_server_ms:
            return []
        return [
            self._speed_record("prefill_speed", driver, stream, end, prompt_tokens_per_s=end.prompt_tokens_per_s_server)
        ]

    def _speed_record(self, scenario: str, driver: Driver, stream: Stream, end: End, **extra) -> dict:
        prompt = {"prompt_tokens": end.prompt_tokens, "prompt_tokens_reused": end.prompt_tokens_reused}
        ttft = {"ttft_server_ms": end.ttft_server_ms, "ttft_client_ms": first_token_ms(stream)}
        return sample(scenario, driver, stream, end, **prompt, **ttft, **extra)

    async def _multi_turn(self, driver: Driver, lane: Lane) -> list[dict]:
        """One chat of TURNS turns on one lane; each user turn brings about TURN_TOKENS tokens of new text."""
        messages: list[dict] = []
        records = []
        for turn in range(1, TURNS + 1):
            # story() pads a one-message chat; its content alone is the new turn's text.
            messages.append(self.prompts.story(TURN_TOKENS + 25)[0])
            request = Request(list(messages), 48, self.rng.randrange(2**31), cache_prompt=True)
            stream = await lane.generate(request)
            end = await stream.wait_end()
            if end is None or end.outcome != Outcome.DONE:
                return []
            messages.append({"role": "assistant", "content": stream.text})
            records.append(self._speed_record("multi_turn", driver, stream, end, turn=turn))
        return records

    async def _throughput(self, driver: Driver, run: dict, reps: range) -> None:
        """Decode rate and time to first token, with one stream and with N concurrent streams."""
        for streams in self.plan.stream_counts(driver.slots):
            for rep in reps:
                async with contextlib.AsyncExitStack() as stack:
                    lanes = [await stack.enter_async_context(await driver.lane(i)) for i in range(streams)]
                    calls = [
                        await lane.generate(self.request(self.plan.short_tokens, self.plan.decode_tokens))
                        for lane in lanes
                    ]
                    ends = await asyncio.gather(*(c.wait_end() for c in calls))
                records = [self._throughput_record(driver, c, end, streams, rep) for c, end in zip(calls, ends)]
                spans = [(c.tokens[0][0], c.tokens[-1][0]) for c in calls if len(c.tokens) >= 2]
                if spans:
                    produced = sum(r["tokens"] - 1 for r in records if r["tokens_per_s_client"] is not None)
                    aggregate = produced / ((max(last for _, last in spans) - min(first for first, _ in spans)) / 1e9)
                    for r in records:
                        r["aggregate_tokens_per_s"] = aggregate
                self.keep("throughput", run, records, requests=streams)

    def _throughput_record(self, driver: Driver, stream: Stream, end: End | None, streams: int, rep: int) -> dict:
        n = (end.tokens_generated or 0) if end else 0
        rate_client = None
        if len(stream.tokens) >= 2 and n >= 2:
            # A frame may carry several tokens (held-back UTF-8), so count tokens, not frames.
            rate_client = (n - 1) / ((stream.tokens[-1][0] - stream.tokens[0][0]) / 1e9)
        record = sample("throughput", driver, stream, end, streams=streams, rep=rep, tokens=n)
        record |= {"ttft_client_ms": first_token_ms(stream), "ttft_server_ms": end and end.ttft_server_ms}
        record |= {"tokens_per_s_client": rate_client, "tokens_per_s_server": end and end.decode_tokens_per_s_server}
        return record | {"prompt_tokens_per_s_server": end and end.prompt_tokens_per_s_server}


async def cancel_via_replica(bench: Bench, owner: StoplineDriver, other: StoplineDriver) -> None:
    """DELETE a running generation of ``owner``, alternately on ``owner`` and on ``other``."""
    for driver in (owner, other):
        async with asyncio.timeout(30):
            while (await driver.healthz()).get("store", {}).get("state") != "up":
                await asyncio.sleep(0.05)
    start, run = await bench.open_run(CANCEL_VIA_REPLICA, owner)
    started = time.monotonic()
    apis = {VIA_OWNER: owner.api_url, VIA_OTHER: other.api_url}
    # One keep-alive connection per replica, opened before the first sample, as a gateway would hold.
    async with aiohttp.ClientSession() as http, await owner.lane() as lane:
        for api in apis.values():
            async with http.get(f"{api}/models") as response:
                await response.read()
        while bench.more(run, bench.plan.requests, started):
            via = (VIA_OWNER, VIA_OTHER)[run["requests"] % 2]
            frames = bench.rng.randint(1, 8)
            stream = await lane.generate(bench.request(bench.plan.short_tokens, LONG_GENERATION))
            await stream.wait_tokens(frames)
            records = []
            if not stream.ended and stream.accepted is not None:
                sent_ns = time.monotonic_ns()
                status, replica = await delete_generation(http, apis[via], stream.accepted)
                answered_ns = time.monotonic_ns()
                end = await stream.stopped()
                if end.outcome == Outcome.CANCELLED and status == Status.CANCELLED:
                    delete_ms = (answered_ns - sent_ns) / 1e6
                    placed = {"via": via, "answered_by": replica, "delete_ms": delete_ms, "cancel_after_frames": frames}
                    records.append(stop_record(CANCEL_VIA_REPLICA, owner, stream, end, sent_ns, **placed))
            else:
                await stream.wait_end()
            bench.keep(CANCEL_VIA_REPLICA, run, records)
    await bench.end_run(owner, run, start)
