"""The baseline: ctransformers' own streaming API in a worker thread, stopped by a
``threading.Event`` that is checked between tokens.

This is the pattern most Python LLM services use, and the one cancellation
articles describe::

    for token in llm.generate(prompt_tokens):   # in run_in_executor
        if stop_event.is_set():
            break
        queue.put(token)

:class:`BaselineEngine` duck-types what :class:`stopline.scheduler.Scheduler` and
:class:`stopline.app.StoplineServer` use from :class:`stopline.engine.loop.Engine`, so
the baseline is served by the very same WebSocket protocol, scheduler and
metrics code; only the token loop differs. The loop here has two blind spots
that the native loop does not:

* The whole prompt is evaluated by one ``batch_eval`` call inside
  ``generate()`` (``batch_size`` 8), which nothing can interrupt.
* Each token's decode step (``eval`` of the sampled token) runs inside the
  generator before the token is yielded, so a cancel that arrives during it is
  seen only after it, and the token it produced is discarded.

It reports honest numbers: ``tokens_generated`` counts every token the model
computed, including one discarded after a cancel or deadline;
``tokens_after_cancel`` counts the tokens the generator yielded after the
cancel was requested; ``cancel_observed_ns`` is when the thread noticed it.
It has no backpressure window (the usual executor-plus-queue pattern has none).
"""

from __future__ import annotations

import os
import random
import threading
import time
from types import SimpleNamespace

from ctransformers import AutoModelForCausalLM

from stopline._core import ExitKind
from stopline.engine.loop import Engine, Stream
from stopline.engine.tokenizer import TextStream
from stopline.protocol.requests import SamplingParams
from stopline.protocol.vocabulary import AbortMode, Batching, EngineName

# ctransformers' default prompt batch, as a service calling generate() would get it.
BATCH_SIZE = 8


class BaselineSlot:
    """One ctransformers model instance (its own KV cache; the weights are mmapped and shared)."""

    def __init__(self, model_path: str, context_length: int, threads: int):
        self.llm = AutoModelForCausalLM.from_pretrained(
            model_path, model_type="llama", context_length=context_length, threads=threads
        )

    # generate() evaluates the whole prompt every time: nothing is held for reuse.
    n_held = 0

    def reusable_prefix(self, tokens: list[int], chunk: int) -> int:
        return 0

    def close(self) -> None:
        # The library frees the model when the object is collected.
        self.llm = None


class BaselineEngine:
    """Serves the model file of ``engine`` through ctransformers' Python API."""

    kind = EngineName.CTRANSFORMERS

    def __init__(self, engine: Engine):
        self._engine = engine
        self.name = engine.name
        self.model_path = engine.model_path
        self.context_length = engine.context_length
        self.vocab_size = engine.vocab_size
        self.threads = engine.threads
        self.prefill_chunk = BATCH_SIZE
        self.abort_mode = AbortMode.BETWEEN_STEPS
        # Both engines get the same prompt ids, from the real engine's tokenizer.
        self.tokenizer = engine.tokenizer
        # The real engine keeps one native context open for its first slot; it is not used here.
        engine.open_slot().close()

    def open_slot(self) -> BaselineSlot:
        return BaselineSlot(str(self.model_path), self.context_length, self.threads)

    def open_slots(self, count: int, batching: Batching = Batching.PER_SLOT) -> list[BaselineSlot]:
        return [self.open_slot() for _ in range(count)]

    def encode(self, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
        # ctransformers' own tokenizer is wrong for this vocabulary; both engines get the same ids.
        return self._engine.encode(prompt=prompt, messages=messages)

    def start(
        self,
        slot: BaselineSlot,
        prompt_tokens: list[int],
        params: SamplingParams,
        *,
        window: int = 64,
        started_ns: int | None = None,
        threads: int | None = None,
    ) -> Stream:
        # ``threads``: ctransformers takes its threads once, when it loads the model.
        now = started_ns if started_ns is not None else time.monotonic_ns()
        if not prompt_tokens:
            raise ValueError("the prompt has no tokens")
        if len(prompt_tokens) >= self.context_length:
            raise ValueError(f"the prompt has {len(prompt_tokens)} tokens; the context holds {self.context_length}")
        generation = BaselineGeneration(slot, list(prompt_tokens), params, self.context_length, now)
        # The product's Stream works on any generation with its surface (run, take, cancel, ...).
        return Stream(generation, TextStream([s.encode() for s in params.stop if s]))


def _deadline(now_ns: int, seconds: float | None) -> int:
    return 0 if seconds is None else now_ns + int(seconds * 1e9)


class BaselineGeneration:
    """One generation on a worker thread; the same surface as ``stopline._core.Generation``."""

    def __init__(
        self, slot: BaselineSlot, prompt_tokens: list[int], params: SamplingParams, context_length: int, now_ns: int
    ):
        self._llm = slot.llm
        self._prompt = prompt_tokens
        self._params = params
        self._max_tokens = min(params.max_tokens, context_length - len(prompt_tokens))
        self._deadline_ns = _deadline(now_ns, params.timeout_s)
        self._first_token_deadline_ns = _deadline(now_ns, params.ttft_timeout_s)
        self._stops = [s.encode() for s in params.stop if s]
        self._stop_event = threading.Event()
        self._lock = threading.Lock()
        self._pending: list[bytes] = []
        self._yielded = 0
        self._yielded_at_cancel = 0
        self._cancelled = False
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.finished = False
        self.result = None

    @property
    def prompt_tokens(self) -> int:
        return len(self._prompt)

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def cancel(self) -> bool:
        with self._lock:
            if self.finished or self._cancelled:
                return False
            self._cancelled = True
            self._yielded_at_cancel = self._yielded
        self._stop_event.set()
        return True

    def take(self) -> list[bytes]:
        try:
            os.eventfd_read(self._fd)
        except BlockingIOError:
            pass
        with self._lock:
            pieces, self._pending = self._pending, []
        return pieces

    def let_return(self) -> None:
        """Generation.let_return(): this loop never waits for its reader."""

    def logprobs(self, start: int, end: int) -> None:
        """None: the usual approach reports no log probabilities."""
        return None

    def _wake(self) -> None:
        os.eventfd_write(self._fd, 1)

    def run(self, yield_to_reader: bool = False):
        # yield_to_reader is Generation.run()'s: this loop is Python, and takes the GIL between tokens anyway.
        p = self._params
        llm = self._llm
        # generate() reuses the KV cache for a shared prefix of the previous prompt;
        # forget it so that every request evaluates its whole prompt, as the native loop does.
        llm._context.clear()
        top_k, temperature = (1, 1.0) if p.temperature <= 0 else (p.top_k, p.temperature)
        seed = p.seed if p.seed is not None else random.randrange(2**31)
        start_ns = time.monotonic_ns()
        first_token_ns = cancel_observed_ns = 0
        published = 0
        text = bytearray()
        kept = None
        exit = ExitKind.EOS
        prompt_evaluated = 0
        tokens = llm.generate(
            self._prompt,
            top_k=top_k,
            top_p=p.top_p,
            temperature=temperature,
            repetition_penalty=p.repetition_penalty,
            seed=seed,
            batch_size=BATCH_SIZE,
            threads=llm.config.threads,
        )
        try:
            for token in tokens:
                prompt_evaluated = len(self._prompt)
                with self._lock:
                    self._yielded += 1
                # The only place where the loop looks at the outside world: between tokens.
                now = time.monotonic_ns()
                if self._stop_event.is_set():
                    cancel_observed_ns = now
                    exit = ExitKind.CANCELLED
                    break
                if self._deadline_ns and now >= self._deadline_ns:
                    exit = ExitKind.TOTAL_DEADLINE
                    break
                if self._first_token_deadline_ns and published == 0 and now >= self._first_token_deadline_ns:
                    exit = ExitKind.FIRST_TOKEN_DEADLINE
                    break
                piece = llm.detokenize([token], decode=False)
                old_size = len(text)
                text += piece
                with self._lock:
                    self._pending.append(piece)
                published += 1
                if published == 1:
                    first_token_ns = time.monotonic_ns()
                self._wake()
                kept = self._stop_match(text, old_size)
                if kept is not None:
                    exit = ExitKind.STOP_SEQUENCE
                    break
                if published >= self._max_tokens:
                    exit = ExitKind.MAX_TOKENS
                    break
            else:
                prompt_evaluated = len(self._prompt)  # generate() returned at EOS
        except Exception:
            exit = ExitKind.EVAL_FAILED
        finally:
            tokens.close()
        end_ns = time.monotonic_ns()
        with self._lock:
            yielded = self._yielded
            # The fields of stopline._core.LoopResult; this loop measures no graph nodes.
            self.result = SimpleNamespace(
                exit=exit,
                prompt_tokens=len(self._prompt),
                prompt_tokens_reused=0,
                prompt_tokens_evaluated=prompt_evaluated,
                tokens_generated=yielded,
                tokens_after_cancel=yielded - self._yielded_at_cancel if exit is ExitKind.CANCELLED else 0,
                start_ns=start_ns,
                first_token_ns=first_token_ns,
                cancel_observed_ns=cancel_observed_ns,
                end_ns=end_ns,
                text_kept_bytes=len(text) if kept is None else kept,
                longest_prefill_node_ns=0,
                longest_decode_node_ns=0,
                # Stopped between steps only: no evaluation is ever cut short.
                prompt_tokens_wasted=0,
                wasted_eval_ns=0,
            )
            self.finished = True
        self._wake()
        return self.result

    def _stop_match(self, text: bytearray, old_size: int) -> int | None:
        for stop in self._stops:
            found = text.find(stop, max(0, old_size - len(stop) + 1))
            if found != -1:
                return found
        return None
