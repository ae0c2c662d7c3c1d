"""Generation slots and the bounded FIFO queue in front of them.

Each slot is one native context with one worker thread. A request waits in
the queue until a slot is free, runs there until its loop exits for any
reason, and the slot immediately takes the next queued request. A request's
deadlines count from its arrival, so one that expires while queued times out
in the queue without ever touching a slot.

A slot's KV cache keeps the tokens of its last generation. A new request goes
to the free slot whose cache is mostly the start of its prompt (a
conversation's next turn finds its own history there), and otherwise to the
free slot used least recently, whose history is the least likely to be wanted.

The scheduler owns the slots and the queue, nothing else. It reports facts to
each request's :class:`Sink` (took a slot, published text, the loop exited
with this result, left the queue on a cancel or at its deadline); which
outcome and reason follow from them is decided in :mod:`stopline.protocol`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from .engine import Engine, GenerationResult, Stream
from .observability import log
from .protocol import Request


class Busy(Exception):
    """Every slot is busy and the queue is full."""


class Sink(Protocol):
    """Where the scheduler reports what happened to a request: the session that
    submitted it, which hands each report to the protocol. The scheduler reports
    facts only; how a request ends is the protocol's decision."""

    def started(self, request: Request) -> None:
        """It took a slot (called synchronously, before its loop runs)."""

    async def deliver(self, request: Request, texts: list[str], logprobs: list[dict] | None = None) -> None:
        """Its loop published text (and, when asked for, the log probabilities of its tokens)."""

    async def finished(self, request: Request, result: GenerationResult) -> None:
        """Its loop exited and reported ``result``."""

    async def failed(self, request: Request, message: str) -> None:
        """Starting or running it raised."""

    async def cancelled_in_queue(self, request: Request, now_ns: int) -> None:
        """A cancel took it out of the queue at ``now_ns``."""

    async def expired_in_queue(self, request: Request, now_ns: int) -> None:
        """It was still queued at its deadline, ``now_ns``."""


class MachineLoad:
    """How busy the other processes on this machine keep its cores: the load average
    minus this process's own share of it, averaged the same way (over about a minute)
    from the CPU time this process used. ggml's threads spin while they wait for each
    other, so a generation given more threads than the cores left to it runs several
    times slower than on one thread."""

    def __init__(self) -> None:
        now, cpu = time.monotonic(), _cpu_seconds()
        # Until it is measured, count the start (loading, the step-abort proof) as busy.
        self._own = min(1.0, cpu / max(1.0, now - _PROCESS_STARTED))
        self._last = (now, cpu)

    def others(self) -> float:
        now, cpu = time.monotonic(), _cpu_seconds()
        wall = now - self._last[0]
        if wall > 0:
            decay = math.exp(-wall / 60)
            self._own = self._own * decay + (cpu - self._last[1]) / wall * (1 - decay)
        self._last = (now, cpu)
        return max(0.0, os.getloadavg()[0] - self._own)


def _cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


_PROCESS_STARTED = time.monotonic()

# How long generations that ran together keep sharing the cores after the last overlap:
# about one answer, so that two users taking turns do not each start on every core.
SHARE_WINDOW_S = 30.0


class Scheduler:
    def __init__(
        self, engine: Engine, workers: int, max_queue: int, window: int = 64, metrics=None, threads: int | None = None
    ):
        if workers < 1 or max_queue < 0:
            raise ValueError("workers must be at least 1 and max_queue at least 0")
        self.engine = engine
        # Compute threads per generation; None: the engine's threads (the cores), shared
        # among the generations running together (threads_for_next).
        self.threads = threads
        self._recent_peak = 1
        self._shared_until = 0.0
        self.machine = MachineLoad()
        self.window = window
        self.max_queue = max_queue
        self.metrics = metrics
        # Free slots, least recently used first.
        self._free = deque(engine.open_slot() for _ in range(workers))
        self._slots = list(self._free)
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stopline-slot")
        self._queue: deque[tuple[Request, Sink]] = deque()
        self._queue_timers: dict[Request, asyncio.TimerHandle] = {}
        self._running: dict[Request, Stream] = {}
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    @property
    def workers(self) -> int:
        return len(self._slots)

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def active(self) -> int:
        return len(self._running)

    def threads_for_next(self) -> int:
        """Threads for a generation starting now: the cores other processes leave, divided
        among the generations running at once, counting the most seen together in the last
        SHARE_WINDOW_S. So a user alone gets every idle core, and users taking turns get a
        share each: a generation keeps its count until it ends (the native loop takes it
        once), and more threads than cores make ggml's spinning threads slow every
        generation down."""
        if self.threads is not None:
            return self.threads
        now = time.monotonic()
        together = len(self._running) + 1
        if now >= self._shared_until:
            self._recent_peak = 1
        if together > 1:
            self._shared_until = now + SHARE_WINDOW_S
            self._recent_peak = max(self._recent_peak, together)
        cores = max(1, self.engine.threads - round(self.machine.others()))
        return max(1, cores // max(together, self._recent_peak))

    def submit(self, request: Request, sink: Sink) -> int:
        """Queue ``request``; returns its queue position (0: it starts now)."""
        if self._closed:
            raise Busy("the server is shutting down")
        if self._free:
            self._start(request, sink, self._take_free_slot(request.prompt_tokens))
            return 0
        if len(self._queue) >= self.max_queue:
            raise Busy(f"all {self.workers} slots are busy and the queue is full ({self.max_queue})")
        self._queue.append((request, sink))
        self._arm_queue_deadline(request)
        self._update_gauges()
        return len(self._queue)

    def cancel(self, request: Request) -> None:
        """Stop ``request`` wherever it is. The protocol has recorded why and when."""
        stream = self._running.get(request)
        if stream is not None:
            stream.cancel()
            return
        sink = self._take_from_queue(request)
        if sink is not None:
            self._spawn(sink.cancelled_in_queue(request, time.monotonic_ns()))

    def close(self) -> None:
        """Refuse new requests from now on; those already here are unaffected."""
        self._closed = True

    async def shutdown(self) -> None:
        """Wait for every request to end (the caller has cancelled them), then free the slots."""
        self.close()
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        self._executor.shutdown(wait=True)
        for slot in self._slots:
            slot.close()

    # internals ---------------------------------------------------------------

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _take_free_slot(self, prompt_tokens: list[int]):
        # A slot whose cache is mostly the start of this prompt holds this
        # conversation: take the one that saves the most. Otherwise take the
        # least recently used, rather than evict another conversation's history
        # for the sake of a shared system prompt.
        best, best_reuse = self._free[0], 0
        for slot in self._free:
            reuse = slot.reusable_prefix(prompt_tokens, self.engine.prefill_chunk)
            if reuse > best_reuse and 2 * reuse >= slot.n_held:
                best, best_reuse = slot, reuse
        self._free.remove(best)
        return best

    def _start(self, request: Request, sink: Sink, slot) -> None:
        try:
            stream = self.engine.start(
                slot,
                request.prompt_tokens,
                request.params,
                window=self.window,
                started_ns=request.received_ns,
                threads=self.threads_for_next(),
            )
        except Exception:
            self._free.appendleft(slot)
            raise
        self._running[request] = stream
        sink.started(request)
        self._update_gauges()
        self._spawn(self._run(request, sink, slot, stream))

    async def _run(self, request: Request, sink: Sink, slot, stream: Stream) -> None:
        result = None
        failure = "the loop ended without a result"
        try:
            async with contextlib.aclosing(stream.batches(self._executor)) as batches:
                async for texts in batches:
                    await sink.deliver(request, texts, stream.take_logprobs())
            result = stream.result
        except Exception as exc:
            # Leaving the batches has already stopped the loop and waited for it.
            log.exception("generation_failed", request_id=request.request_id, id=request.id)
            failure = f"{type(exc).__name__}: {exc}"
        finally:
            del self._running[request]
            stream.generation.close()
            # The slot is free the moment the loop has exited: start the next request first.
            self._release(slot)
        if result is not None:
            await sink.finished(request, result)
        else:
            await sink.failed(request, failure)

    def _release(self, slot) -> None:
        while self._queue and not self._closed:
            request, sink = self._queue.popleft()
            self._disarm_queue_deadline(request)
            try:
                self._start(request, sink, slot)
                return
            except Exception as exc:
                self._spawn(sink.failed(request, str(exc)))
        self._free.append(slot)
        self._update_gauges()

    def _take_from_queue(self, request: Request) -> Sink | None:
        """Take ``request`` out of the queue; its sink, or None if it was not queued."""
        for index, (queued, sink) in enumerate(self._queue):
            if queued is request:
                del self._queue[index]
                self._disarm_queue_deadline(request)
                self._update_gauges()
                return sink
        return None

    def _arm_queue_deadline(self, request: Request) -> None:
        deadline_ns = request.queue_deadline_ns
        if deadline_ns is None:
            return
        # loop.time() is time.monotonic(), the clock received_ns was read from.
        self._queue_timers[request] = asyncio.get_running_loop().call_at(
            deadline_ns / 1e9, self._expire_queued, request
        )

    def _disarm_queue_deadline(self, request: Request) -> None:
        timer = self._queue_timers.pop(request, None)
        if timer is not None:
            timer.cancel()

    def _expire_queued(self, request: Request) -> None:
        self._queue_timers.pop(request, None)
        sink = self._take_from_queue(request)
        if sink is not None:
            self._spawn(sink.expired_in_queue(request, time.monotonic_ns()))

    def _update_gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._queue))
            self.metrics.active.set(len(self._running))
