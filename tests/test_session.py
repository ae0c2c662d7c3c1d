"""The scheduler and the session without a model: against a small in-process fake of the
engine (tests/fake_engine.py) and a fake transport, each test runs in milliseconds. The
real engine, the real loop and real sockets are the integration tests' (test_server_*)."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from fake_engine import FakeEngine

from stopline.auth import Keyring
from stopline.engine.cores import usable_cores
from stopline.observability import Metrics
from stopline.protocol.connection import AddressQuota
from stopline.protocol.frames import Frame
from stopline.protocol.requests import Request
from stopline.protocol.vocabulary import STATUS_BY_OUTCOME, Outcome, Reason
from stopline.quota import Quotas
from stopline.registry import Registry
from stopline.scheduler import Scheduler
from stopline.services import Services
from stopline.session import ClientSession
from stopline.settings import Settings


class FakeTransport:
    """Keeps every frame sent, as its JSON; ``blocked`` holds sends back like a client that stopped reading."""

    def __init__(self) -> None:
        self.peer = "test:1"
        self.frames: list[dict] = []
        self.blocked = False
        self.sent = asyncio.Event()

    async def send(self, frame: Frame) -> None:
        if self.blocked:
            await asyncio.Event().wait()
        self.frames.append(frame.json())
        self.sent.set()

    async def frame(self, predicate) -> dict:
        while True:
            found = [f for f in self.frames if predicate(f)]
            if found:
                return found[0]
            self.sent.clear()
            await asyncio.wait_for(self.sent.wait(), 5)


class Recorder:
    """A scheduler Sink that keeps what it was told."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.done = asyncio.Event()

    def started(self, request):
        self.events.append(("started", request.id))

    async def deliver(self, request, texts, logprobs=None):
        self.events.append(("deliver", request.id, tuple(texts)))

    async def finished(self, request, result):
        self.events.append(("finished", request.id, result.exit.name, result.tokens_generated))
        self.done.set()

    async def failed(self, request, message):
        self.events.append(("failed", request.id, message))

    async def cancelled_in_queue(self, request, now_ns):
        self.events.append(("cancelled_in_queue", request.id))

    async def expired_in_queue(self, request, now_ns):
        self.events.append(("expired_in_queue", request.id))


def request(request_id: str, max_tokens: int = 16) -> Request:
    from stopline.protocol.requests import SamplingParams

    return Request(request_id, [1, 2, 3], SamplingParams(max_tokens=max_tokens), received_ns=0)


async def until(condition, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0)


# --- the scheduler -----------------------------------------------------------------


async def test_the_scheduler_fills_its_slots_then_queues_then_starts_the_next_at_once():
    engine = FakeEngine()
    scheduler = Scheduler(engine, workers=2, max_queue=1, threads=1)
    sinks = [Recorder() for _ in range(3)]
    positions = [scheduler.submit(request(f"r{i}"), sink) for i, sink in enumerate(sinks)]
    assert positions == [0, 0, 1] and scheduler.active == 2 and scheduler.queue_depth == 1
    await until(lambda: all(sink.done.is_set() for sink in sinks))
    assert sinks[2].events[0] == ("started", "r2")
    assert sinks[2].events[-1] == ("finished", "r2", "EOS", 5)
    await scheduler.shutdown()
    assert all(slot.closed for slot in engine.slots)


async def test_the_queue_serves_a_lower_priority_value_first_and_equals_in_order_of_arrival():
    engine = FakeEngine()
    scheduler = Scheduler(engine, workers=1, max_queue=4, threads=1)
    sinks = {name: Recorder() for name in ("run", "late", "urgent", "later", "routine")}
    priorities = {"run": 0, "late": 1, "urgent": -1, "later": 1, "routine": 0}
    positions = []
    for name, sink in sinks.items():
        queued = request(name)
        queued.priority = priorities[name]
        positions.append(scheduler.submit(queued, sink))
        if name == "run":
            engine.streams[0].hold.clear()
    # Each is placed behind every request of its priority or a more urgent one.
    assert positions == [0, 1, 1, 3, 2]
    started: list[str] = []
    for sink in sinks.values():
        sink.started = lambda request, s=sink: started.append(request.id) or Recorder.started(s, request)
    engine.streams[0].hold.set()
    await until(lambda: all(sink.done.is_set() for sink in sinks.values()))
    assert started == ["urgent", "routine", "late", "later"]
    await scheduler.shutdown()


async def test_the_scheduler_refuses_past_its_queue_and_stops_where_the_request_is():
    from stopline.protocol.errors import Busy

    engine = FakeEngine()
    scheduler = Scheduler(engine, workers=1, max_queue=1, threads=1)
    running, queued = Recorder(), Recorder()
    first, second = request("run"), request("wait")
    scheduler.submit(first, running)
    engine.streams[0].hold.clear()
    scheduler.submit(second, queued)
    with pytest.raises(Busy):
        scheduler.submit(request("more"), Recorder())
    scheduler.cancel(second)  # queued: it leaves the queue and never starts
    await until(lambda: ("cancelled_in_queue", "wait") in queued.events)
    scheduler.cancel(first)  # running: its loop is told to stop
    engine.streams[0].hold.set()
    await running.done.wait()
    # The engine reports only the way out; no reason is invented for the stop.
    assert running.events[-1][:3] == ("finished", "run", "CANCELLED")
    await scheduler.shutdown()


async def test_the_scheduler_warns_when_threads_per_slot_outnumber_the_cores(logs):
    cores = usable_cores()
    fits = Scheduler(FakeEngine(), workers=cores, max_queue=0, threads=1)
    unset = Scheduler(FakeEngine(), workers=cores + 1, max_queue=0)
    assert not logs.records("threads_outnumber_cores")
    crowded = Scheduler(FakeEngine(), workers=2, max_queue=0, threads=cores)
    [warning] = logs.records("threads_outnumber_cores")
    assert (warning["threads"], warning["cores"]) == (2 * cores, cores)
    for scheduler in (fits, unset, crowded):
        await scheduler.shutdown()


# --- the session -------------------------------------------------------------------


@pytest.fixture
async def services():
    engine = FakeEngine()
    settings = Settings.build(workers=1, max_queue=4, slow_consumer_grace_s=0.05)
    metrics = Metrics()
    lanes = (ThreadPoolExecutor(1), ThreadPoolExecutor(1))
    scheduler = Scheduler(engine, settings.workers, settings.max_queue, metrics=metrics, threads=1)
    limits = settings.limits_for(engine)
    found = Services(
        model=engine.name,
        encode=lambda prompt, messages: engine.encode(prompt=prompt, messages=messages),
        limits=limits,
        scheduler=scheduler,
        registry=Registry(),
        metrics=metrics,
        quotas=Quotas(metrics),
        keyring=Keyring(),
        address_quota=AddressQuota(limits.requests_per_address),
        tokenizer_lanes=lanes,
        slow_consumer_grace_s=settings.slow_consumer_grace_s,
    )
    found.engine = engine  # type: ignore[attr-defined]
    yield found
    await scheduler.shutdown()
    for lane in lanes:
        lane.shutdown()


def open_session(services: Services) -> tuple[ClientSession, FakeTransport]:
    transport = FakeTransport()
    return ClientSession(services, transport, "127.0.0.1"), transport


async def generate(session: ClientSession, request_id: str, **fields) -> None:
    frame = {"type": "generate", "id": request_id, "prompt": "Hi", "max_tokens": 16, **fields}
    await session.receive_text(json.dumps(frame), time.monotonic_ns())


def terminal(request_id: str):
    return lambda f: f["type"] in {str(o) for o in Outcome} and f["id"] == request_id


async def test_a_session_greets_accepts_streams_and_ends_once(services):
    session, transport = open_session(services)
    await session.open()
    await generate(session, "r1")
    done = await transport.frame(terminal("r1"))
    assert [f["type"] for f in transport.frames] == ["hello", "accepted"] + ["token"] * 5 + ["done"]
    assert done["reason"] == "eos" and done["tokens_generated"] == 5
    assert "".join(f["text"] for f in transport.frames if f["type"] == "token") == "Paris is the capital."
    [accepted] = [f for f in transport.frames if f["type"] == "accepted"]
    entry = services.registry.get(accepted["request_id"])
    assert entry is not None and entry.status is STATUS_BY_OUTCOME[Outcome.DONE]


async def test_a_cancel_frame_ends_the_request_with_user_cancelled(services):
    session, transport = open_session(services)
    await generate(session, "r1")
    await transport.frame(lambda f: f["type"] == "token")
    await session.receive_text(json.dumps({"type": "cancel", "id": "r1"}), time.monotonic_ns())
    cancelled = await transport.frame(terminal("r1"))
    assert (cancelled["type"], cancelled["reason"]) == ("cancelled", "user_cancelled")


async def test_a_public_cancel_and_a_shutdown_take_their_own_reasons(services):
    # One decision per stop: the reason is the one the protocol recorded, whoever asked.
    engine = services.engine  # type: ignore[attr-defined]
    session, transport = open_session(services)
    await generate(session, "deleted")
    await transport.frame(lambda f: f["type"] == "accepted")
    engine.streams[-1].hold.clear()
    await transport.frame(lambda f: f["type"] == "token")
    [live] = session.protocol.live.values()
    await session.cancel(live, Reason.USER_CANCELLED, time.monotonic_ns())
    engine.streams[-1].hold.set()
    assert (await transport.frame(terminal("deleted")))["reason"] == "user_cancelled"

    await generate(session, "running")
    await transport.frame(lambda f: f["type"] == "accepted" and f["id"] == "running")
    engine.streams[-1].hold.clear()
    await session.stop_all(Reason.SHUTDOWN, time.monotonic_ns())
    engine.streams[-1].hold.set()
    shutdown = await transport.frame(terminal("running"))
    assert (shutdown["type"], shutdown["reason"]) == ("cancelled", "shutdown")


async def test_a_client_that_leaves_stops_its_requests_and_its_queue(services):
    engine = services.engine  # type: ignore[attr-defined]
    engine.hold_new_streams = True
    session, transport = open_session(services)
    await generate(session, "running")
    await transport.frame(lambda f: f["type"] == "accepted" and f["id"] == "running")
    await generate(session, "queued")
    await transport.frame(lambda f: f["type"] == "accepted" and f["id"] == "queued")
    assert services.scheduler.queue_depth == 1
    requests = list(session.protocol.live.values())
    await session.client_gone()
    # Every task the session started has ended by then: none is left for the loop to drop.
    assert [
        t
        for t in asyncio.all_tasks()
        if getattr(t.get_coro(), "cr_frame", None) and t.get_coro().cr_frame.f_locals.get("self") is session
    ] == []
    engine.streams[0].hold.set()
    await until(lambda: all(services.registry.get(r.request_id).ending is not None for r in requests))
    for r in requests:
        ending = services.registry.get(r.request_id).ending
        assert (ending.outcome, ending.reason) == (Outcome.CANCELLED, Reason.CLIENT_DISCONNECTED)


async def test_a_client_that_stops_reading_is_cancelled_as_a_slow_consumer(services):
    session, transport = open_session(services)
    await generate(session, "r1")
    await transport.frame(lambda f: f["type"] == "accepted")
    transport.blocked = True
    [live] = session.protocol.live.values()
    await until(lambda: services.registry.get(live.request_id).ending is not None)
    ending = services.registry.get(live.request_id).ending
    assert (ending.outcome, ending.reason) == (Outcome.CANCELLED, Reason.SLOW_CONSUMER)


async def test_a_refused_frame_is_counted_and_answered(services):
    session, transport = open_session(services)
    await session.receive_text("not json", time.monotonic_ns())
    assert transport.frames == [
        {"type": "error", "id": None, "code": "invalid_json", "message": "the frame is not valid JSON"}
    ]
    assert services.metrics.rejected.labels("invalid_json")._value.get() == 1
