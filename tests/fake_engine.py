"""A small in-process stand-in for the engine interface, for the model-free tier.

It speaks the scheduler's side of :class:`stopline.engine.loop.Engine` (open a slot,
start a stream on it) and the :class:`stopline.engine.loop.Stream` the scheduler
reads (batches of text, a cancel, a result), with no model, no native loop and
no threads: a generation publishes one word per event-loop turn, so a test
drives it in milliseconds. Integration tests keep the real engine.
"""

from __future__ import annotations

import asyncio
import time
from enum import Enum

from stopline.protocol.requests import GenerationResult, SamplingParams
from stopline.protocol.vocabulary import AbortMode, Batching, EngineName
from stopline.settings import Settings


class Exit(Enum):
    """The native loop's ways out that the fake takes, named as ``_core.ExitKind`` names them."""

    EOS = 1
    MAX_TOKENS = 2
    CANCELLED = 5


class FakeSlot:
    n_held = 0

    def __init__(self) -> None:
        self.closed = False

    def reusable_prefix(self, tokens, chunk: int) -> int:
        return 0

    def close(self) -> None:
        self.closed = True


class FakeGeneration:
    """What the scheduler touches of a running generation: its thread count, and close()."""

    def __init__(self, threads: int):
        self.threads = threads
        self.closed = False

    def close(self) -> None:
        self.closed = True


class FakeStream:
    """Publishes ``words`` one a turn (up to max_tokens), unless cancelled first."""

    def __init__(self, prompt_tokens: list[int], params: SamplingParams, words: list[str], threads: int):
        self.prompt_tokens = prompt_tokens
        self.words = words[: params.max_tokens]
        self.max_tokens = params.max_tokens
        self.generation = FakeGeneration(threads)
        self.cancelled = False
        self.cancel_observed_ns = 0
        self.urgent = False  # started by preempting another (Engine.start's urgent)
        self.result: GenerationResult | None = None
        # Set by a test to hold the generation after its first word, until released.
        self.hold = asyncio.Event()
        self.hold.set()

    def cancel(self) -> bool:
        if self.cancelled or self.result is not None:
            return False
        self.cancelled = True
        return True

    def take_logprobs(self) -> list[dict] | None:
        return None

    async def exited(self) -> None:
        """No thread runs this loop: it has exited once its batches end."""

    async def batches(self, executor=None):
        start_ns = time.monotonic_ns()
        first_token_ns = 0
        generated = 0
        exit = Exit.EOS
        for word in self.words:
            await asyncio.sleep(0)
            if generated == 1:
                await self.hold.wait()
            if self.cancelled:
                exit = Exit.CANCELLED
                break
            generated += 1
            first_token_ns = first_token_ns or time.monotonic_ns()
            yield [word]
        else:
            await asyncio.sleep(0)
            if self.cancelled:
                exit = Exit.CANCELLED
            elif generated == self.max_tokens:
                exit = Exit.MAX_TOKENS
        end_ns = time.monotonic_ns()
        self.result = GenerationResult(
            exit=exit,
            prompt_tokens=len(self.prompt_tokens),
            prompt_tokens_reused=0,
            prompt_tokens_evaluated=len(self.prompt_tokens),
            tokens_generated=generated,
            tokens_after_cancel=0,
            start_ns=start_ns,
            first_token_ns=first_token_ns,
            cancel_observed_ns=end_ns if exit is Exit.CANCELLED else 0,
            end_ns=end_ns,
            text_kept_bytes=0,
            longest_prefill_node_ns=0,
            longest_decode_node_ns=0,
            prompt_tokens_wasted=0,
            wasted_eval_ns=0,
        )


class FakeEngine:
    """The engine interface the scheduler and the sessions use, answering ``words``."""

    kind = EngineName.CTRANSFORMERS
    batching = Batching.PER_SLOT
    name = "fake"
    context_length = 256
    vocab_size = 100
    threads = 2
    prefill_chunk = 64
    abort_mode = AbortMode.IN_STEP

    def __init__(self, words: list[str] | None = None):
        self.words = words if words is not None else ["Paris", " is", " the", " capital", "."]
        self.slots: list[FakeSlot] = []
        self.streams: list[FakeStream] = []
        self.tokenizer = None
        # Set by a test to start every new stream held after its first word.
        self.hold_new_streams = False

    def open_slot(self) -> FakeSlot:
        slot = FakeSlot()
        self.slots.append(slot)
        return slot

    def open_slots(self, count: int, batching: Batching | None = None, prompt_steps=None) -> list[FakeSlot]:
        assert batching in (None, Batching.PER_SLOT)
        return [self.open_slot() for _ in range(count)]

    def encode(self, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
        text = prompt if prompt is not None else " ".join(m["content"] for m in messages or [])
        return [ord(c) % self.vocab_size for c in text][: self.context_length - 1]

    def start(
        self, slot, prompt_tokens, params, *, window=Settings.window, started_ns=None, threads=None, urgent=False
    ) -> FakeStream:
        stream = FakeStream(prompt_tokens, params, self.words, threads or self.threads)
        stream.urgent = urgent
        if self.hold_new_streams:
            stream.hold.clear()
        self.streams.append(stream)
        return stream
