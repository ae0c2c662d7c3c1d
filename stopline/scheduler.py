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
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from .engine import Engine, GenerationResult, Stream
from .observability import log
from .protocol import Ending, Request
from .vocabulary import ErrorCode, Outcome, Reason


class Busy(Exception):
    """Every slot is busy and the queue is full."""


class Sink(Protocol):
    """Where a request's output goes: the connection that sent it."""

    def started(self, request: Request) -> None: ...
    async def deliver(self, request: Request, texts: list[str]) -> None: ...
    async def finish(self, request: Request, ending: Ending) -> None: ...


def _ms(start_ns: int, end_ns: int) -> float:
    return round((end_ns - start_ns) / 1e6, 3)


def ending_from_result(request: Request, result: GenerationResult) -> Ending:
    """Turn what the native loop reported into the request's ending."""
    outcome = Outcome(result.outcome)
    if outcome is Outcome.ERROR:
        return Ending(outcome, str(ErrorCode.INTERNAL_ERROR), prompt_tokens=result.prompt_tokens,
                      prompt_tokens_evaluated=result.prompt_tokens_evaluated,
                      tokens_generated=result.tokens_generated, message="the model failed to evaluate a batch",
                      duration_ms=_ms(request.received_ns, result.end_ns))
    cancelled = outcome is Outcome.CANCELLED
    return Ending(
        outcome, str(result.reason),
        prompt_tokens=result.prompt_tokens, prompt_tokens_reused=result.prompt_tokens_reused,
        prompt_tokens_evaluated=result.prompt_tokens_evaluated,
        tokens_generated=result.tokens_generated, tokens_after_cancel=result.tokens_after_cancel,
        queue_ms=_ms(request.received_ns, request.started_ns),
        ttft_ms=_ms(request.received_ns, result.first_token_ns) if result.first_token_ns else None,
        duration_ms=_ms(request.received_ns, result.end_ns),
        cancel_latency_ms=_ms(request.cancel_requested_ns, result.end_ns) if cancelled else None)


class Scheduler:
    def __init__(self, engine: Engine, workers: int, max_queue: int, window: int = 64, metrics=None):
        if workers < 1 or max_queue < 0:
            raise ValueError("workers must be at least 1 and max_queue at least 0")
        self.engine = engine
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

    def cancel(self, request: Request, reason: Reason) -> None:
        """Stop ``request`` wherever it is. The protocol has already recorded why and when."""
        stream = self._running.get(request)
        if stream is not None:
            stream.cancel(str(reason))
        else:
            self._end_in_queue(request, Outcome.CANCELLED, reason)

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
            stream = self.engine.start(slot, request.prompt_tokens, request.params, window=self.window,
                                       started_ns=request.received_ns)
        except Exception:
            self._free.appendleft(slot)
            raise
        self._running[request] = stream
        sink.started(request)
        if request.cancel_reason is not None:
            stream.cancel(str(request.cancel_reason))
        self._update_gauges()
        self._spawn(self._run(request, sink, slot, stream))

    async def _run(self, request: Request, sink: Sink, slot, stream: Stream) -> None:
        try:
            async with contextlib.aclosing(stream.batches(self._executor)) as batches:
                async for texts in batches:
                    await sink.deliver(request, texts)
            ending = ending_from_result(request, stream.result)
        except Exception as exc:
            # Leaving the batches has already stopped the loop and waited for it.
            log.exception("generation_failed", request_id=request.request_id, id=request.id)
            ending = Ending(Outcome.ERROR, str(ErrorCode.INTERNAL_ERROR), prompt_tokens=len(request.prompt_tokens),
                            message=f"{type(exc).__name__}: {exc}")
        finally:
            del self._running[request]
            stream.generation.close()
            # The slot is free the moment the loop has exited: start the next request first.
            self._release(slot)
        await sink.finish(request, ending)

    def _release(self, slot) -> None:
        while self._queue and not self._closed:
            request, sink = self._queue.popleft()
            self._disarm_queue_deadline(request)
            try:
                self._start(request, sink, slot)
                return
            except Exception as exc:
                ending = Ending(Outcome.ERROR, str(ErrorCode.INTERNAL_ERROR), message=str(exc))
                self._spawn(sink.finish(request, ending))
        self._free.append(slot)
        self._update_gauges()

    def _end_in_queue(self, request: Request, outcome: Outcome, reason: Reason) -> None:
        """End a request that never reached a slot: nothing was computed for it."""
        for index, (queued, sink) in enumerate(self._queue):
            if queued is request:
                del self._queue[index]
                break
        else:
            return
        self._disarm_queue_deadline(request)
        self._update_gauges()
        now = time.monotonic_ns()
        ending = Ending(outcome, str(reason), prompt_tokens=len(request.prompt_tokens),
                        queue_ms=_ms(request.received_ns, now), duration_ms=_ms(request.received_ns, now),
                        cancel_latency_ms=_ms(request.cancel_requested_ns, now) if outcome is Outcome.CANCELLED else None)
        self._spawn(sink.finish(request, ending))

    def _arm_queue_deadline(self, request: Request) -> None:
        params = request.params
        deadlines = [(s, reason) for s, reason in ((params.timeout_s, Reason.TOTAL_TIMEOUT),
                                                   (params.ttft_timeout_s, Reason.FIRST_TOKEN_TIMEOUT)) if s]
        if not deadlines:
            return
        seconds, reason = min(deadlines)
        loop = asyncio.get_running_loop()
        # loop.time() is time.monotonic(), the clock received_ns was read from.
        when = request.received_ns / 1e9 + seconds
        self._queue_timers[request] = loop.call_at(when, self._expire_queued, request, reason)

    def _disarm_queue_deadline(self, request: Request) -> None:
        timer = self._queue_timers.pop(request, None)
        if timer is not None:
            timer.cancel()

    def _expire_queued(self, request: Request, reason: Reason) -> None:
        self._queue_timers.pop(request, None)
        self._end_in_queue(request, Outcome.TIMEOUT, reason)

    def _update_gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(len(self._queue))
            self.metrics.active.set(len(self._running))
