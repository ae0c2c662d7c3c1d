"""Generation slots and the bounded queue in front of them, ordered by priority.

Each slot is one sequence: on llama.cpp's shared steps, one of the sequences of a
context whose steps its own thread leads; otherwise one native context of its own.
A request waits in the queue until a slot is free, runs there until its loop exits
for any reason, and the slot immediately takes the next queued request. The queue is
ordered by priority (lower first), then by arrival. A request's deadlines count from
its arrival, so one that expires while queued times out in the queue without ever
touching a slot.

A request of a higher priority than a running one, arriving when every slot is busy,
may preempt it: the running generation pauses where it is, its KV cache kept, and
takes the first free slot again before any queued request, resuming with nothing
recomputed. Spare sequences (``PREEMPTION_SLOTS``) are what the preempting request runs on.

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
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from .engine.cores import LOOK_INTERVAL_S, MachineLoad, usable_cores
from .engine.loop import Engine, Stream
from .observability import log
from .protocol.errors import Busy
from .protocol.requests import GenerationResult, Request
from .protocol.vocabulary import Batching, PromptSteps
from .settings import Settings

# Sequences beyond the workers in a context of shared steps: how many generations of a
# higher priority can start at once by preempting running ones (each spare sequence adds
# one context length to the KV cache).
PREEMPTION_SLOTS = 1


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

    async def preempted(self, request: Request) -> None:
        """Its loop was paused for a request of higher priority, keeping what it evaluated."""

    async def resumed(self, request: Request) -> None:
        """Its paused loop goes on."""

    async def failed(self, request: Request, message: str) -> None:
        """Starting or running it raised."""

    async def cancelled_in_queue(self, request: Request, now_ns: int) -> None:
        """A cancel took it out of the queue at ``now_ns``."""

    async def expired_in_queue(self, request: Request, now_ns: int) -> None:
        """It was still queued at its deadline, ``now_ns``."""


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        workers: int | None,
        max_queue: int,
        window: int = Settings.window,
        metrics=None,
        threads: int | None = None,
        batching: Batching | None = None,
        prompt_steps: PromptSteps = PromptSteps.MIXED,
    ):
        if (workers is not None and workers < 1) or max_queue < 0:
            raise ValueError("workers must be at least 1 and max_queue at least 0")
        self.engine = engine
        # Compute threads per generation; None: the engine's threads (the cores), shared
        # among the generations running together (threads_each).
        self.threads = threads
        self.machine = MachineLoad()
        self._look_timer: asyncio.TimerHandle | None = None
        self.window = window
        self.max_queue = max_queue
        self.metrics = metrics
        # Whether the running generations share each evaluation (the llama.cpp engine's
        # continuous batching) or evaluate each on its own context.
        self.batching = batching or engine.batching
        # None: the slots the engine is sized for.
        self._workers = workers or engine.sequences
        # Free slots, least recently used first. Generations in shared steps get spare sequences
        # beyond the workers: a request of higher priority starts on one while the generation
        # it preempts keeps its own sequence, and its cache (see _preempt).
        spare = PREEMPTION_SLOTS if self.batching is Batching.SHARED else 0
        self._free = deque(engine.open_slots(self._workers + spare, self.batching, prompt_steps))
        self._slots = list(self._free)
        self._executor = ThreadPoolExecutor(max_workers=self._workers + spare, thread_name_prefix="stopline-slot")
        # Waiting requests, by priority (lower first), then in order of arrival.
        self._queue: deque[tuple[Request, Sink]] = deque()
        self._queue_timers: dict[Request, asyncio.TimerHandle] = {}
        self._running: dict[Request, Stream] = {}
        self._sinks: dict[Request, Sink] = {}
        # Running requests preempted by ones of higher priority, in the order they were paused.
        self._paused: dict[Request, Stream] = {}
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self._warn_if_threads_outnumber_cores()

    def _warn_if_threads_outnumber_cores(self) -> None:
        """A --threads that puts more compute threads than cores to work when every slot runs.
        ggml's threads spin at every node's barrier while they wait for a partner the OS has
        preempted, and decode slows many times over against the cores shared (docs/engine.md,
        "Threads", has the measurement)."""
        if self.threads is None:
            return
        evaluations = 1 if self.batching is Batching.SHARED else self.workers
        cores = usable_cores()
        if self.threads * evaluations > cores:
            log.warning(
                "threads_outnumber_cores",
                threads=self.threads * evaluations,
                cores=cores,
                detail=f"--threads {self.threads} on each of {evaluations} evaluations at once; without "
                "--threads the running generations share the cores",
            )

    @property
    def workers(self) -> int:
        """How many generations run at once (paused ones aside)."""
        return self._workers

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def active(self) -> int:
        return len(self._running)

    def threads_each(self, running: int) -> int:
        """Threads for each of ``running`` generations: the cores other processes leave,
        shared equally. So a user alone gets every idle core, and users together get a
        share each; more threads than cores make ggml's spinning threads slow every
        generation down. Generations evaluated together in one batch per step share
        the step, so the step gets every core left."""
        if self.threads is not None:
            return self.threads
        cores = max(1, self.engine.threads - round(self.machine.others()))
        if self.batching is Batching.SHARED:
            return cores
        return max(1, cores // max(1, running))

    def _share_cores(self) -> None:
        """Give every running generation its share now (each takes it at its next step),
        and look again in LOOK_INTERVAL_S while any runs, to follow the other processes."""
        if self._look_timer is not None:
            self._look_timer.cancel()
            self._look_timer = None
        if self.threads is not None or not self._running:
            return
        share = self.threads_each(len(self._running))
        for stream in self._running.values():
            stream.generation.threads = share
        self._look_timer = asyncio.get_running_loop().call_later(LOOK_INTERVAL_S, self._share_cores)

    def submit(self, request: Request, sink: Sink) -> int:
        """Queue ``request``; returns its queue position (0: it starts now)."""
        if self._closed:
            raise Busy("the server is shutting down")
        if self._free:
            preempting = self._workers_busy()
            if not preempting or self._preempt_for(request):
                self._start(request, sink, self._take_free_slot(request.prompt_tokens), urgent=preempting)
                return 0
        if len(self._queue) >= self.max_queue:
            raise Busy(f"all {self.workers} slots are busy and the queue is full ({self.max_queue})")
        # Behind every request of the same or a higher priority (a lower or equal value).
        position = next((i for i, (queued, _) in enumerate(self._queue) if queued.priority > request.priority), None)
        position = len(self._queue) if position is None else position
        self._queue.insert(position, (request, sink))
        self._arm_queue_deadline(request)
        self._update_gauges()
        return position + 1

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

    async def shutdown(self, keep: Callable[[list], None] | None = None) -> None:
        """Wait for every request to end (the caller has cancelled them), then free the slots,
        first handing them to ``keep`` (on a worker thread) if given."""
        self.close()
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        self._executor.shutdown(wait=True)
        if keep is not None:
            await asyncio.to_thread(keep, self._slots)
        for slot in self._slots:
            slot.close()

    # internals ---------------------------------------------------------------

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _workers_busy(self) -> bool:
        """Every worker runs a generation (paused ones aside): a request starts now only by
        preempting one."""
        return len(self._running) - len(self._paused) >= self.workers

    def _preempt_for(self, request: Request) -> bool:
        """Pause the running generation of the lowest priority below ``request``'s (the
        latest started among equals), if there is one, so that ``request`` can start now
        on a spare slot. Its loop ends the step under way and then waits, its cache kept:
        it resumes where it stopped, nothing recomputed (Generation.pause)."""
        if self.batching is not Batching.SHARED:
            return False
        below = [r for r in self._running if r not in self._paused and r.priority > request.priority]
        if not below:
            return False
        victim = max(below, key=lambda r: (r.priority, r.started_ns))
        stream = self._running[victim]
        stream.generation.pause()
        self._paused[victim] = stream
        log.info("preempted", request_id=victim.request_id, by=request.request_id, priority=victim.priority)
        if self.metrics is not None:
            self.metrics.preemptions.inc()
        self._spawn(self._sinks[victim].preempted(victim))
        return True

    def _resume(self, request: Request) -> None:
        stream = self._paused.pop(request)
        stream.generation.resume()
        log.info("resumed", request_id=request.request_id)
        self._spawn(self._sinks[request].resumed(request))

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

    def _start(self, request: Request, sink: Sink, slot, urgent: bool) -> None:
        """Start ``request`` on ``slot``; ``urgent``: it preempted a running generation, and
        interrupts the step under way rather than wait for it."""
        try:
            stream = self.engine.start(
                slot,
                request.prompt_tokens,
                request.params,
                window=self.window,
                started_ns=request.received_ns,
                threads=self.threads_each(len(self._running) + 1),
                urgent=urgent,
            )
        except Exception:
            self._free.appendleft(slot)
            raise
        self._running[request] = stream
        self._sinks[request] = sink
        self._share_cores()
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
            del self._sinks[request]
            self._paused.pop(request, None)
            self._share_cores()
            # The slot is free the moment the loop has published its result: start the next request first.
            self._release(slot)
        try:
            # The client hears first; the loop's thread is still returning.
            if result is not None:
                await sink.finished(request, result)
            else:
                await sink.failed(request, failure)
        finally:
            # Its eventfd is closed once that thread can no longer wake it.
            with contextlib.suppress(Exception):
                await stream.exited()
            stream.generation.close()

    def _release(self, slot) -> None:
        """``slot`` is free. While fewer than the workers run, resume the preempted generation
        or start the queued request of the highest priority (a preempted one first among
        equals); then let a queued request preempt a running one of a lower priority."""
        self._free.append(slot)
        while not self._closed:
            paused = min(self._paused, key=lambda r: r.priority, default=None)
            queued = self._queue[0][0] if self._queue else None
            preempting = self._workers_busy()
            if not preempting:
                if paused is not None and (queued is None or paused.priority <= queued.priority):
                    self._resume(paused)
                    continue
                if queued is None or not self._free:
                    break
            elif queued is None or not self._free or not self._preempt_for(queued):
                break
            request, sink = self._queue.popleft()
            self._disarm_queue_deadline(request)
            try:
                self._start(request, sink, self._take_free_slot(request.prompt_tokens), urgent=preempting)
            except Exception as exc:
                self._spawn(sink.failed(request, str(exc)))
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
