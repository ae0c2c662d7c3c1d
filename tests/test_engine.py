"""The native token loop (ext/stopline/_core.pyx) and its Python face (stopline/engine/loop.py),
against the real model.

Bounds on time are expressed in decode steps or prefill chunks measured in the
same test, plus a slack that scales with UNIT, so the tests hold on a slow or
busy machine. The only ratio is the GIL test's.
"""

from __future__ import annotations

import errno
import gc
import itertools
import math
import os
import random
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import psutil
import pytest

from stopline import _core
from stopline._core import ExitKind, Generation, GenerationState
from stopline.engine.errors import ContextOverflowError, EngineError, ModelLoadError
from stopline.engine.loop import Engine
from stopline.protocol.requests import SamplingParams, exit_outcome
from stopline.protocol.vocabulary import EngineName, Outcome, Reason
from support import CHAT_FRANCE, LONG_ANSWER, UNIT, make_generation, started_running

# Scheduling noise allowed on top of a bound measured in steps or chunks.
SLACK_NS = int(50e6 * UNIT)
# Every wait for the loop to finish is capped by this (never reached when things work).
JOIN_TIMEOUT_S = 120 * UNIT
# About 1,500 tokens of plain prose.
LONG_PROMPT_TEXT = "The history of bread is long. " * 220
# A raw prompt the model continues for as long as it is allowed to, without EOS.
COUNTING_TEXT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,"
SHORT_COUNTING_TEXT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"


# --- helpers ---------------------------------------------------------------


def ended_done(result: _core.LoopResult) -> bool:
    """Whether the loop ended by itself: the service calls that outcome done."""
    return ended(result)[0] is Outcome.DONE


def ended(result) -> tuple:
    """What a loop's way out means to a client, as the protocol names it: (outcome, reason);
    a cancel's reason is None, for the request that asked for the stop holds it."""
    return exit_outcome(result.exit)


class Runner(threading.Thread):
    """Runs ``Generation.run()`` on its own thread, as the server's slot workers do."""

    def __init__(self, generation: Generation, yield_to_reader: bool = False):
        super().__init__(name="test-generation", daemon=True)
        self.generation = generation
        self.yield_to_reader = yield_to_reader
        self.result = None
        self.returned_ns = 0
        self.error: BaseException | None = None

    def run(self):
        try:
            self.result = self.generation.run(self.yield_to_reader)
            self.returned_ns = time.monotonic_ns()
        except BaseException as exc:  # handed back to the test thread by finish()
            self.error = exc

    def finish(self):
        self.join(JOIN_TIMEOUT_S)
        assert not self.is_alive(), "the token loop did not end"
        if self.error is not None:
            raise self.error
        return self.result


def start(generation: Generation, yield_to_reader: bool = False) -> Runner:
    runner = Runner(generation, yield_to_reader)
    runner.start()
    return runner


def run_in_child(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python process from the checkout; it must exit with status 0."""
    child = subprocess.run(
        [sys.executable, "-c", code],
        cwd=os.path.dirname(os.path.dirname(__file__)),
        capture_output=True,
        text=True,
        timeout=JOIN_TIMEOUT_S,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    return child


def wait_for_tokens(generation: Generation, count: int, pieces: list[bytes]) -> list[bytes]:
    """Read published tokens into ``pieces`` until there are ``count`` or the loop ended."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while len(pieces) < count and not generation.finished:
        assert time.monotonic() < deadline, "no tokens published"
        select.select([generation.fileno()], [], [], 0.05)
        pieces.extend(generation.take())
    return pieces


@dataclass(frozen=True)
class Costs:
    chunk_ns: float  # one prefill chunk of `chunk` tokens
    prefill_ns: float  # the whole prompt
    step_ns: float  # one decode step (sample + publish + one-token eval)


def measure_costs(slot, prompt: list[int], chunk: int, decode_tokens: int = 8) -> Costs:
    """Time an uncancelled run on this machine, now, to scale the bounds of a test."""
    slot.forget()
    generation = make_generation(
        slot, prompt, max_tokens=decode_tokens, temperature=0, prefill_chunk=chunk, window=decode_tokens
    )
    result = generation.run()
    assert ended_done(result) and result.prompt_tokens_evaluated == len(prompt)
    chunks = math.ceil(result.prompt_tokens_evaluated / chunk)
    steps = max(1, result.tokens_generated - 1)
    return Costs(
        chunk_ns=(result.first_token_ns - result.start_ns) / chunks,
        prefill_ns=result.first_token_ns - result.start_ns,
        step_ns=(result.end_ns - result.first_token_ns) / steps,
    )


def stream_text(engine: Engine, slot, prompt: list[int], **params) -> tuple[str, object]:
    stream = engine.start(slot, prompt, SamplingParams(**params))
    text = "".join(stream)
    assert stream.tokens_read == stream.result.tokens_generated
    return text, stream.result


@pytest.fixture(scope="module")
def engine(ctransformers_engine) -> Engine:
    """The ctransformers engine alone (overrides conftest's for this module): this module is the
    loop's contract on that engine, and some of its tests drive ctransformers directly (its native
    context, its own generate(), its tokenizer). The same contract on llama.cpp is in
    test_llama_engine.py, and the server's tests run on both engines."""
    return ctransformers_engine


@pytest.fixture(scope="module")
def slot(engine):
    context = engine.open_slot()
    yield context
    context.close()


@pytest.fixture
def second_slot(engine):
    context = engine.open_slot()
    yield context
    context.close()


@pytest.fixture(scope="module")
def long_prompt(engine) -> list[int]:
    tokens = engine.encode(prompt=LONG_PROMPT_TEXT)
    assert 1400 <= len(tokens) <= 1600
    return tokens


@pytest.fixture(scope="module")
def france_answer(engine, slot) -> str:
    """The greedy answer, the reference for determinism and stop-sequence tests. It is
    computed with the engine's prefill chunk: greedy text depends on the chunk size
    (see test_same_tokens_as_ctransformers_own_generate)."""
    text, result = stream_text(engine, slot, engine.encode(messages=CHAT_FRANCE), max_tokens=48, temperature=0)
    assert ended(result)[0] == "done"
    return text


# --- cancel ----------------------------------------------------------------


def test_cancel_during_decode_via_take(engine, slot):
    generation = make_generation(slot, engine.encode(messages=LONG_ANSWER), max_tokens=500, temperature=0)
    runner = start(generation)
    pieces = wait_for_tokens(generation, 5, [])
    assert generation.cancel() is True
    result = runner.finish()
    pieces += generation.take()

    assert result.exit is ExitKind.CANCELLED
    # The loop polls the flag before every token: at most the one in flight is wasted.
    assert result.tokens_after_cancel <= 1
    assert 5 <= result.tokens_generated < 500
    assert len(pieces) == result.tokens_generated
    assert result.prompt_tokens_evaluated == result.prompt_tokens
    assert 0 < result.cancel_observed_ns <= result.end_ns


@pytest.mark.slow
def test_cancel_during_decode_via_stream(engine, slot):
    costs = measure_costs(slot, engine.encode(prompt=COUNTING_TEXT), chunk=engine.prefill_chunk)
    stream = engine.start(slot, engine.encode(messages=LONG_ANSWER), SamplingParams(max_tokens=500, temperature=0))
    chunks, cancel_ns = [], None
    for text in stream:
        chunks.append(text)
        if len(chunks) == 5 and cancel_ns is None:
            cancel_ns = time.monotonic_ns()
            assert stream.cancel() is True
    result = stream.result

    assert ended(result) == (Outcome.CANCELLED, None)
    assert result.tokens_after_cancel <= 1
    assert stream.tokens_read == result.tokens_generated
    # Exit within the step in flight.
    assert result.end_ns - cancel_ns <= costs.step_ns + SLACK_NS


@pytest.mark.parametrize(
    "chunk,step_abort",
    [pytest.param(1, False, marks=pytest.mark.slow), pytest.param(8, False, marks=pytest.mark.slow), (64, True)],
)
def test_cancel_during_long_prompt_exits_within_a_chunk(engine, slot, long_prompt, chunk, step_abort):
    assert slot.context_length == 2048
    # The cost of one chunk, from a short uncancelled run over the first tokens of the same prompt.
    slot.forget()
    reference = make_generation(slot, long_prompt[:128], max_tokens=1, temperature=0, prefill_chunk=chunk)
    ref = reference.run()
    assert ref.prompt_tokens_evaluated == 128
    chunk_ns = (ref.first_token_ns - ref.start_ns) / math.ceil(ref.prompt_tokens_evaluated / chunk)
    if step_abort:
        # Stopped between graph nodes, the wait is the longest node, far below a chunk.
        chunk_ns = ref.longest_prefill_node_ns

    slot.forget()
    generation = make_generation(
        slot, long_prompt, max_tokens=16, temperature=0, prefill_chunk=chunk, step_abort=step_abort
    )
    runner = start(generation)
    # Cancel about half-way through what the reference evaluated, well inside the prompt.
    started_running(generation)
    time.sleep((ref.first_token_ns - ref.start_ns) / 2e9)
    cancel_ns = time.monotonic_ns()
    assert generation.cancel() is True
    result = runner.finish()

    assert result.exit is ExitKind.CANCELLED
    # Only whole chunks count; stopped part-way, the first one may not have completed.
    assert (0 if step_abort else 1) <= result.prompt_tokens_evaluated < len(long_prompt)
    assert result.prompt_tokens_evaluated % chunk == 0
    assert result.tokens_generated == 0 and result.tokens_after_cancel == 0 and result.first_token_ns == 0
    assert generation.take() == []
    assert cancel_ns <= result.cancel_observed_ns <= result.end_ns
    exit_ns = result.end_ns - cancel_ns
    print(f"\nchunk={chunk}: one chunk {chunk_ns / 1e6:.1f} ms, cancel-to-exit {exit_ns / 1e6:.1f} ms")
    assert exit_ns <= 3 * chunk_ns + SLACK_NS


def test_cancel_before_run(engine, slot):
    generation = make_generation(slot, engine.encode(messages=CHAT_FRANCE), max_tokens=16)
    assert generation.cancel() is True
    result = generation.run()
    assert result.exit is ExitKind.CANCELLED
    assert result.tokens_generated == 0 and result.prompt_tokens_evaluated == 0 and result.tokens_after_cancel == 0
    assert result.start_ns <= result.cancel_observed_ns <= result.end_ns
    assert generation.take() == []
    # The cancel-before-start path must leave the context usable.
    again = make_generation(slot, engine.encode(messages=CHAT_FRANCE), max_tokens=2, temperature=0).run()
    assert again.exit is ExitKind.MAX_TOKENS and again.tokens_generated == 2


def test_the_loop_is_told_to_stop_never_why(engine, slot):
    generation = make_generation(slot, engine.encode(messages=CHAT_FRANCE), max_tokens=2)
    with pytest.raises(TypeError):
        generation.cancel(Reason.SHUTDOWN)
    # Nor is the stream: the reason stays with the request, whose protocol names it.
    stream = engine.start(slot, engine.encode(messages=CHAT_FRANCE), SamplingParams(max_tokens=2))
    with pytest.raises(TypeError):
        stream.cancel(Reason.SHUTDOWN)  # type: ignore[call-arg]
    assert stream.cancel() is True
    assert list(stream) == []
    assert stream.generation.result.exit is ExitKind.CANCELLED
    assert stream.result.exit is ExitKind.CANCELLED and ended(stream.result) == (Outcome.CANCELLED, None)
    assert not hasattr(stream.result, "reason")


def test_cancel_twice_only_first_counts(engine, slot):
    stream = engine.start(slot, engine.encode(messages=LONG_ANSWER), SamplingParams(max_tokens=500, temperature=0))
    runner = start(stream.generation)
    wait_for_tokens(stream.generation, 1, [])
    assert stream.cancel() is True
    assert stream.cancel() is False
    runner.finish()
    assert stream.cancel() is False
    assert ended(stream.result) == (Outcome.CANCELLED, None)


def test_concurrent_cancels_exactly_one_wins(engine, slot):
    generation = make_generation(slot, engine.encode(messages=LONG_ANSWER), max_tokens=500, temperature=0)
    runner = start(generation)
    wait_for_tokens(generation, 1, [])
    barrier = threading.Barrier(8)
    won = []

    def cancel(i):
        barrier.wait()
        won.append(generation.cancel() and i)

    threads = [threading.Thread(target=cancel, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert runner.finish().exit is ExitKind.CANCELLED
    assert len([i for i in won if i is not False]) == 1


def test_concurrent_stream_cancels_exactly_one_wins(engine, slot):
    # Four stops asked for at once (why is the protocol's to keep): one reaches the loop.
    reasons = [Reason.USER_CANCELLED, Reason.CLIENT_DISCONNECTED, Reason.SHUTDOWN, Reason.SLOW_CONSUMER]
    stream = engine.start(slot, engine.encode(messages=LONG_ANSWER), SamplingParams(max_tokens=500, temperature=0))
    runner = start(stream.generation)
    wait_for_tokens(stream.generation, 1, [])
    barrier = threading.Barrier(len(reasons))
    won = []

    def cancel(reason):
        barrier.wait()
        if stream.cancel():
            won.append(reason)

    threads = [threading.Thread(target=cancel, args=(reason,)) for reason in reasons]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    runner.finish()
    assert len(won) == 1
    assert ended(stream.result) == (Outcome.CANCELLED, None)


def test_cancel_after_finish_changes_nothing(engine, slot):
    generation = make_generation(slot, engine.encode(messages=CHAT_FRANCE), max_tokens=3, temperature=0)
    result = generation.run()
    assert result.exit is ExitKind.MAX_TOKENS
    assert generation.cancel() is False
    assert generation.result is result
    assert (result.exit, result.cancel_observed_ns) == (ExitKind.MAX_TOKENS, 0)


# --- publication order ---------------------------------------------------------


def test_a_reader_that_sees_finished_always_finds_the_result(engine, slot):
    """The loop's record is published before the finished state, and both before
    the last wake-up; the result is built from the record by its first reader.
    A watcher polls the state of many short generations and reads the result
    the moment it sees them finished; the test thread waits on the eventfd.
    (A wrong order, the state before the record, shows under the GIL once
    Python code runs between the two stores.)"""
    prompt = engine.encode(prompt="Once upon a time")
    switch = sys.getswitchinterval()
    # Switch threads as often as possible, to interleave the watcher with run()'s last steps.
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(60):
            generation = make_generation(slot, prompt, max_tokens=1, temperature=0)
            seen = {}

            def watch(generation=generation, seen=seen):
                while not generation.finished:
                    pass
                seen["result"] = generation.result

            watcher = threading.Thread(target=watch)
            watcher.start()
            runner = start(generation)
            # The wake-up after the finish: a reader woken by it finds the generation finished.
            fd = generation.fileno()
            while True:
                select.select([fd], [], [], JOIN_TIMEOUT_S)
                generation.take()
                if generation.finished:
                    assert generation.result is not None
                    break
            watcher.join(JOIN_TIMEOUT_S)
            result = runner.finish()
            assert seen["result"] is result
            assert generation.state is GenerationState.FINISHED
    finally:
        sys.setswitchinterval(switch)


def test_a_finished_loop_stays_out_of_the_gil_until_its_reader_lets_it_return(engine, slot):
    """With yield_to_reader, the loop's thread publishes its end and then comes
    back into Python only once the reader calls let_return(), or after
    READER_GRACE_S: the reader woken by the end does its work (a terminal
    frame to send) without that thread taking the GIL from it."""
    prompt = engine.encode(prompt="Once upon a time")
    grace_ns = _core.READER_GRACE_S * 1e9
    for _ in range(10):
        generation = make_generation(slot, prompt, max_tokens=4, temperature=0)
        runner = start(generation, yield_to_reader=True)
        while not generation.finished:
            time.sleep(0.0001)
        generation.take()
        let_go_ns = time.monotonic_ns()
        generation.let_return()
        runner.finish()
        # Only the grace could have let it return before let_return().
        assert runner.returned_ns >= let_go_ns or runner.returned_ns - generation.result.end_ns >= grace_ns
    # A reader that never lets it go holds it for the grace, no longer.
    generation = make_generation(slot, prompt, max_tokens=4, temperature=0)
    runner = start(generation, yield_to_reader=True)
    result = runner.finish()
    assert runner.returned_ns - result.end_ns >= grace_ns


def test_the_states_a_generation_goes_through(engine, slot):
    generation = make_generation(slot, engine.encode(messages=LONG_ANSWER), max_tokens=500, temperature=0)
    assert generation.state is GenerationState.NEW and generation.result is None
    runner = start(generation)
    wait_for_tokens(generation, 1, [])
    assert generation.state is GenerationState.RUNNING and generation.result is None
    generation.cancel()
    runner.finish()
    assert generation.state is GenerationState.FINISHED and generation.result is not None


# --- deadlines -------------------------------------------------------------


@pytest.mark.slow
def test_total_deadline_fires_within_a_step(engine, slot):
    prompt = engine.encode(prompt=COUNTING_TEXT)
    costs = measure_costs(slot, prompt, chunk=engine.prefill_chunk)
    # Expire mid-decode: well after the prompt (twice its measured cost) plus about ten tokens.
    timeout_s = (2 * costs.prefill_ns + 10 * costs.step_ns) / 1e9
    started_ns = time.monotonic_ns()
    stream = engine.start(
        slot, prompt, SamplingParams(max_tokens=1000, temperature=0, timeout_s=timeout_s), started_ns=started_ns
    )
    text = "".join(stream)
    result = stream.result
    deadline_ns = started_ns + int(timeout_s * 1e9)

    assert ended(result) == ("timeout", "total_timeout")
    assert 0 < result.tokens_generated < 1000 and text
    assert result.end_ns >= deadline_ns
    assert result.end_ns - deadline_ns <= costs.step_ns + SLACK_NS


def test_first_token_deadline_fires_during_prefill(engine, slot, long_prompt):
    costs = measure_costs(slot, long_prompt[:64], chunk=engine.prefill_chunk)
    slot.forget()
    started_ns = time.monotonic_ns()
    stream = engine.start(
        slot, long_prompt, SamplingParams(max_tokens=16, ttft_timeout_s=0.3 * UNIT), started_ns=started_ns
    )
    assert list(stream) == []
    result = stream.result
    deadline_ns = started_ns + int(0.3 * UNIT * 1e9)

    assert ended(result) == ("timeout", "first_token_timeout")
    assert result.tokens_generated == 0
    assert result.prompt_tokens_evaluated < len(long_prompt)
    assert result.end_ns >= deadline_ns
    # Stopped inside the chunk under way; a whole chunk bounds it even without the hook.
    assert result.end_ns - deadline_ns <= costs.chunk_ns + SLACK_NS


@pytest.mark.slow
def test_first_token_deadline_with_generation_directly(engine, slot, long_prompt):
    costs = measure_costs(slot, long_prompt[:64], chunk=8)
    slot.forget()
    deadline_ns = time.monotonic_ns() + int(0.3 * UNIT * 1e9)
    generation = make_generation(slot, long_prompt, max_tokens=16, prefill_chunk=8, first_token_deadline_ns=deadline_ns)
    result = generation.run()
    assert result.exit is ExitKind.FIRST_TOKEN_DEADLINE
    assert result.tokens_generated == 0 and result.prompt_tokens_evaluated % 8 == 0
    assert 0 <= result.end_ns - deadline_ns <= costs.chunk_ns + SLACK_NS


@pytest.mark.slow
def test_first_token_deadline_does_not_fire_after_first_token(engine, slot):
    prompt = engine.encode(prompt=SHORT_COUNTING_TEXT)
    costs = measure_costs(slot, prompt, chunk=engine.prefill_chunk)
    ttft_ns = 5 * costs.prefill_ns + SLACK_NS
    # Generate for about twice as long as the first-token deadline.
    max_tokens = int(2 * ttft_ns / costs.step_ns) + 1
    started_ns = time.monotonic_ns()
    _, result = stream_text(engine, slot, prompt, max_tokens=max_tokens, temperature=0, ttft_timeout_s=ttft_ns / 1e9)
    assert ended(result) == ("done", "max_tokens")
    assert result.tokens_generated == max_tokens
    assert result.end_ns > started_ns + ttft_ns  # the deadline did pass during the run


# --- the GIL -----------------------------------------------------------------


@dataclass(frozen=True)
class Counting:
    rate: float  # iterations per second of wall time
    blocked: float  # fraction of wall time neither on a CPU nor waiting for one


def _schedstat() -> tuple[int, int]:
    # This thread's time on a CPU and time runnable but waiting for a CPU, in ns.
    with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
        on_cpu, waiting, _ = f.read().split()
    return int(on_cpu), int(waiting)


def _count(seconds: float, python_hog: bool = False) -> Counting:
    """Count in a pure-Python loop on a fresh thread. A counting thread never sleeps
    by itself: any time it spends blocked is time spent waiting for the GIL."""
    out, stop = [], threading.Event()

    def count():
        n = 0
        cpu0, wait0 = _schedstat()
        start_ns = time.perf_counter_ns()
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            for _ in range(1000):
                n += 1
        wall = time.perf_counter_ns() - start_ns
        cpu1, wait1 = _schedstat()
        out.append(Counting(rate=n * 1e9 / wall, blocked=max(0, wall - (cpu1 - cpu0) - (wait1 - wait0)) / wall))

    def hog():  # a Python thread that holds the GIL whenever it can
        while not stop.is_set():
            sum(range(10000))

    threads = [threading.Thread(target=count)] + ([threading.Thread(target=hog)] if python_hog else [])
    for t in threads:
        t.start()
    threads[0].join()
    stop.set()
    for t in threads[1:]:
        t.join()
    return out[0]


@pytest.mark.slow
def test_python_threads_keep_running_during_generation(engine, slot):
    # The loop runs without the GIL: a Python thread keeps (nearly) its solo speed.
    ratios, blocked = [], []
    for _ in range(3):
        solo = _count(1.0)
        generation = make_generation(
            slot, engine.encode(messages=LONG_ANSWER), max_tokens=1000, temperature=0, threads=1, window=1024
        )
        runner = start(generation)
        busy = _count(1.0)
        running = not generation.finished
        generation.cancel()
        result = runner.finish()
        assert running and result.exit is ExitKind.CANCELLED
        ratios.append(busy.rate / solo.rate)
        blocked.append(busy.blocked)
        if ratios[-1] >= 0.8:
            break
    print(
        f"\nGIL: during a generation the counter keeps {', '.join(f'{r:.2f}' for r in ratios)} of its solo "
        f"rate, and is blocked {', '.join(f'{b:.1%}' for b in blocked)} of the time"
    )
    if max(ratios) >= 0.8:
        return
    # A machine busy with other work: two runnable threads share less than two cores,
    # which slows the counter whatever the GIL does. Check the cause directly: the
    # counter was runnable (on a CPU or queued for one) at least 80% of the time,
    # while the same measure does see a Python thread that competes for the GIL.
    contended = _count(1.0, python_hog=True)
    print(f"GIL: beside a GIL-holding Python thread the counter is blocked {contended.blocked:.1%} of the time")
    assert contended.blocked >= 0.1
    assert min(blocked) <= 0.2


# --- outputs -----------------------------------------------------------------


def test_greedy_is_deterministic_and_answers_paris(engine, slot, france_answer):
    text, result = stream_text(engine, slot, engine.encode(messages=CHAT_FRANCE), max_tokens=48, temperature=0)
    assert text == france_answer
    assert "Paris" in text
    assert ended(result)[0] == "done" and result.tokens_generated > 0


@pytest.mark.parametrize("chunk", [1, 8])
@pytest.mark.slow
def test_same_tokens_as_ctransformers_own_generate(engine, slot, chunk):
    # The loop drives the same C calls as ctransformers' Python generate(): greedy output
    # must match token for token. (It depends on the prefill batch size in both: the
    # library's batched evaluation is not bit-identical to token-by-token evaluation.)
    from ctransformers import AutoModelForCausalLM

    prompt = engine.encode(messages=CHAT_FRANCE)
    slot.forget()
    llm = AutoModelForCausalLM.from_pretrained(
        str(engine.model_path), model_type="llama", context_length=256, threads=1
    )
    try:
        theirs = list(
            itertools.islice(
                llm.generate(
                    prompt, top_k=1, temperature=1.0, repetition_penalty=1.1, batch_size=chunk, threads=1, reset=True
                ),
                24,
            )
        )
    finally:
        del llm
    # ctransformers' generate() applies its penalty whatever the temperature; Stopline's only when asked.
    generation = make_generation(
        slot, prompt, max_tokens=24, temperature=0, repetition_penalty=1.1, prefill_chunk=chunk
    )
    result = generation.run()
    ours = generation.take()
    assert result.tokens_generated == len(theirs)
    assert ours == [slot.token_bytes(t) for t in theirs]


@pytest.mark.parametrize("stop", [" Paris", "ari", "France is"])
def test_stop_sequence_ends_generation_and_is_not_streamed(engine, slot, france_answer, stop):
    # " Paris" is a whole token, "ari" sits inside one, "France is" spans two.
    assert stop in france_answer
    expected = france_answer[: france_answer.index(stop)]
    text, result = stream_text(
        engine, slot, engine.encode(messages=CHAT_FRANCE), max_tokens=48, temperature=0, stop=("never-appears", stop)
    )
    assert ended(result) == ("done", "stop_sequence")
    assert text == expected
    assert result.text_kept_bytes == len(expected.encode())


def test_stop_sequences_cut_at_the_earliest_match_whatever_their_order(engine, slot, france_answer):
    # The longer stop starts three characters before "Paris", and both complete with the token " Paris".
    start = france_answer.index(" Paris") - 3
    assert start >= 0
    longer = france_answer[start : start + 9]
    expected = france_answer[:start]
    text, result = stream_text(
        engine, slot, engine.encode(messages=CHAT_FRANCE), max_tokens=48, temperature=0, stop=("Paris", longer)
    )
    assert ended(result)[1] == "stop_sequence"
    assert text == expected


@pytest.mark.slow
def test_stop_sequence_that_never_appears(engine, slot, france_answer):
    text, result = stream_text(
        engine, slot, engine.encode(messages=CHAT_FRANCE), max_tokens=48, temperature=0, stop=("zebra",)
    )
    assert text == france_answer and ended(result)[1] != "stop_sequence"


def test_max_tokens(engine, slot):
    generation = make_generation(slot, engine.encode(messages=LONG_ANSWER), max_tokens=5, temperature=0)
    result = generation.run()
    pieces = generation.take()
    assert result.exit is ExitKind.MAX_TOKENS
    assert result.tokens_generated == 5 == len(pieces)
    assert result.text_kept_bytes == len(b"".join(pieces))


@pytest.mark.slow
def test_max_tokens_is_clamped_to_the_context(engine):
    context = _core.CtransformersSlot(str(engine.model_path), engine.model_type, 64)
    try:
        prompt = engine.encode(prompt=COUNTING_TEXT)
        assert len(prompt) < 64
        generation = make_generation(context, prompt, max_tokens=500, temperature=0)
        assert generation.max_tokens == 64 - len(prompt)
        result = generation.run()
        # Ended by the context, not by the request's max_tokens; a client hears max_tokens either way.
        assert result.exit is ExitKind.CONTEXT_FULL
        assert ended(result) == (Outcome.DONE, Reason.MAX_TOKENS)
        assert result.tokens_generated == 64 - len(prompt) == len(generation.take())
        # A prompt that fills the context leaves no room for a token.
        with pytest.raises(ContextOverflowError):
            make_generation(context, (prompt * 2)[:64])
        assert make_generation(context, (prompt * 2)[:63]).max_tokens == 1
    finally:
        context.close()


@pytest.mark.slow
def test_slow_reader_pauses_the_loop(engine, slot):
    prompt = engine.encode(prompt=SHORT_COUNTING_TEXT)
    costs = measure_costs(slot, prompt, chunk=engine.prefill_chunk)
    # Long enough for the prompt and twenty tokens, three times over.
    wait_s = 3 * (costs.prefill_ns + 20 * costs.step_ns) / 1e9
    generation = make_generation(
        slot, prompt, max_tokens=500, temperature=0, prefill_chunk=engine.prefill_chunk, window=4
    )
    runner = start(generation)
    started_running(generation)
    time.sleep(wait_s)
    assert len(generation.take()) == 4  # paused a full window ahead, not further
    time.sleep(wait_s)
    assert len(generation.take()) == 4  # taking let it run exactly one more window
    time.sleep(wait_s)
    assert not generation.finished
    cancel_ns = time.monotonic_ns()
    assert generation.cancel() is True
    result = runner.finish()
    assert result.exit is ExitKind.CANCELLED
    assert result.tokens_generated == 12 and result.tokens_after_cancel == 0
    # A paused loop sees the flag within its pause poll, far below a step.
    assert result.end_ns - cancel_ns <= costs.step_ns + SLACK_NS


# --- Stream: every token reaches a slow consumer ------------------------------------


@pytest.mark.slow
def test_slow_consumer_gets_every_token(engine, slot):
    # The loop runs ahead (up to its window) while the consumer handles a chunk, and
    # ends meanwhile; the stream must still deliver everything it generated.
    stream = engine.start(slot, engine.encode(messages=LONG_ANSWER), SamplingParams(max_tokens=40, temperature=0))
    for _ in stream:
        time.sleep(0.05 * UNIT)
    assert ended(stream.result)[0] == "done"
    assert stream.tokens_read == stream.result.tokens_generated == 40


@pytest.mark.slow
async def test_slow_async_consumer_gets_every_token(engine, slot):
    import asyncio

    stream = engine.start(slot, engine.encode(messages=LONG_ANSWER), SamplingParams(max_tokens=40, temperature=0))
    async for _ in stream:
        await asyncio.sleep(0.05 * UNIT)
    assert ended(stream.result)[0] == "done"
    assert stream.tokens_read == stream.result.tokens_generated == 40


@pytest.mark.slow
def test_fast_consumer_gets_every_token(engine, slot):
    text, result = stream_text(engine, slot, engine.encode(messages=LONG_ANSWER), max_tokens=40, temperature=0)
    assert result.tokens_generated == 40 and text


# --- resources ---------------------------------------------------------------


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _cycle(engine, slot, prompt, rng: random.Random, mode: int) -> None:
    # A window of one token holds the loop until the consumer reads, so a cancel at the
    # first chunk always lands long before the 16th token.
    window = 1 if mode in (1, 3) else 64
    stream = engine.start(
        slot, prompt, SamplingParams(max_tokens=16, temperature=0.7, seed=rng.randrange(1000)), window=window
    )
    if mode == 0:  # cancelled before the loop starts
        assert stream.cancel() is True
        assert list(stream) == []
        assert ended(stream.result)[0] == "cancelled" and stream.result.prompt_tokens_evaluated == 0
    elif mode == 1:  # cancelled at the first token
        for _ in stream:
            stream.cancel()
        assert ended(stream.result) == ("cancelled", None)
        assert stream.result.tokens_generated < 16 and stream.result.tokens_after_cancel <= 1
    elif mode == 2:  # cancelled at a random point: mid-prompt, mid-decode or after the end
        accepted: list[bool] = []
        timer = threading.Timer(rng.uniform(0, 0.15 * UNIT), lambda: accepted.append(stream.cancel()))
        timer.start()
        list(stream)
        timer.join()
        result = stream.result
        outcome, reason = ended(result)
        if outcome == "cancelled":
            assert accepted == [True] and reason is None
            # Polled before every token: a cancelled loop never reaches max_tokens.
            assert result.tokens_generated < 16 and result.tokens_after_cancel <= 1
        else:
            # Only a loop past its last poll may finish: it had produced every token it would.
            assert outcome == "done"
            assert reason == "eos" or (reason, result.tokens_generated) == ("max_tokens", 16)
    else:  # the consumer goes away after one chunk
        chunks = iter(stream)
        assert next(chunks, None) is not None
        chunks.close()
        assert ended(stream.result) == ("cancelled", None)
        assert stream.result.tokens_generated < 16


@pytest.mark.slow
def test_start_cancel_cycles_leak_nothing(engine, slot):
    prompt = engine.encode(prompt="Once upon a time")
    rng = random.Random(1234)
    process = psutil.Process()
    for i in range(20):  # warm-up: allocator pools, lazy imports
        _cycle(engine, slot, prompt, rng, i % 4)
    gc.collect()
    threads, native_threads, fds = threading.active_count(), process.num_threads(), _fd_count()
    rss = process.memory_info().rss

    for _ in range(200):
        _cycle(engine, slot, prompt, rng, rng.randrange(4))
    gc.collect()

    growth_mb = (process.memory_info().rss - rss) / 2**20
    print(f"\n200 cycles: RSS growth {growth_mb:.1f} MB")
    assert threading.active_count() == threads
    assert process.num_threads() == native_threads
    assert _fd_count() == fds  # every generation's eventfd was closed
    assert growth_mb < 20


# --- several slots -------------------------------------------------------------


@pytest.mark.slow
def test_two_slots_run_concurrently(engine, slot, second_slot, france_answer):
    prompt = engine.encode(messages=CHAT_FRANCE)
    generations = [
        make_generation(s, prompt, max_tokens=48, temperature=0, prefill_chunk=engine.prefill_chunk)
        for s in (slot, second_slot)
    ]
    runners = [start(g) for g in generations]
    results = [r.finish() for r in runners]
    texts = [b"".join(g.take()).decode() for g in generations]
    # Same answer as alone: the contexts share weights but not state.
    assert texts == [france_answer, france_answer]
    assert all(ended_done(r) for r in results)
    # The two loops overlapped in time.
    assert max(r.start_ns for r in results) < min(r.end_ns for r in results)


def test_one_slot_runs_one_generation_at_a_time(engine, slot):
    first = make_generation(slot, engine.encode(messages=LONG_ANSWER), max_tokens=500, temperature=0)
    runner = start(first)
    wait_for_tokens(first, 1, [])
    second = make_generation(slot, engine.encode(messages=CHAT_FRANCE), max_tokens=4)
    with pytest.raises(EngineError, match="another generation is running"):
        second.run()
    with pytest.raises(EngineError, match="while a generation runs"):
        slot.close()
    with pytest.raises(EngineError, match="running generation"):
        first.close()
    first.cancel()
    assert runner.finish().exit is ExitKind.CANCELLED
    # The refused generation was never started and can still run.
    assert ended_done(second.run())


# --- bad input -----------------------------------------------------------------


def test_missing_model_file(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        Engine.load(tmp_path / "missing.gguf", progress=False, engine=EngineName.CTRANSFORMERS)
    with pytest.raises(ModelLoadError, match="not a file"):
        Engine.load(tmp_path, progress=False, engine=EngineName.CTRANSFORMERS)


def test_non_gguf_file(tmp_path):
    path = tmp_path / "random.bin"
    path.write_bytes(random.Random(7).randbytes(1 << 20))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        Engine.load(path, progress=False, engine=EngineName.CTRANSFORMERS)
    # With a model type it must be a GGML file, and it does not start like one.
    with pytest.raises(ModelLoadError, match="not a GGML file, nor a GGUF one"):
        Engine.load(path, model_type="llama", progress=False, engine=EngineName.CTRANSFORMERS)


@pytest.mark.slow
def test_truncated_gguf(tmp_path):
    from stopline.engine.model import original_gguf_path

    path = tmp_path / "truncated.gguf"
    with open(original_gguf_path(progress=False), "rb") as f:
        path.write_bytes(f.read(5 << 20))
    with pytest.raises(ModelLoadError, match="truncated|not a readable GGUF") as info:
        Engine.load(path, progress=False, engine=EngineName.CTRANSFORMERS)
    assert str(path) in str(info.value)


@pytest.mark.slow
def test_a_model_without_a_readable_bpe_vocab_uses_ctransformers_tokenizer(engine):
    # The converted cache file stores raw-byte tokens, which no byte-level BPE can be
    # rebuilt from: the engine falls back to the model's own (ctransformers) tokenizer.
    other = Engine.load(engine.model_path, threads=1, progress=False, engine=EngineName.CTRANSFORMERS)
    assert type(other.tokenizer).__name__ == "NativeTokenizer"
    ids = other.encode(prompt="Once upon a time")
    assert ids and all(0 <= i < other.vocab_size for i in ids)
    assert "<|im_start|>" in other.tokenizer.render_chat([{"role": "user", "content": "hi"}])
    slot = other.open_slot()
    try:
        stream = other.start(slot, ids, SamplingParams(max_tokens=8, temperature=0))
        text = "".join(stream)
        assert text.strip() and ended(stream.result)[0] == "done" and stream.result.tokens_generated >= 1
    finally:
        slot.close()


def test_native_context_refuses_a_non_model_file(engine, tmp_path):
    path = tmp_path / "random.bin"
    path.write_bytes(random.Random(8).randbytes(1 << 16))
    with pytest.raises(ModelLoadError, match="could not create"):
        _core.CtransformersSlot(str(path), "llama", 64)
    # A failed system call brings its errno and the system's words for it.
    with pytest.raises(ModelLoadError, match="No such file or directory") as info:
        _core.CtransformersSlot(str(tmp_path / "missing.gguf"), "llama", 64)
    assert info.value.errno == errno.ENOENT


def test_no_file_descriptor_left_for_the_wake_up_is_an_os_error(engine):
    # In a child process, which uses up its file descriptors.
    code = f"""
import os, resource
from stopline import _core
from stopline.engine.loop import _ctransformers_library_path
from stopline.protocol.requests import SamplingParams
_core.load_ctransformers_library(_ctransformers_library_path())
context = _core.CtransformersSlot({str(engine.model_path)!r}, "llama", 64)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
try:
    while True:
        os.open("/dev/null", os.O_RDONLY)
except OSError:
    pass
try:
    _core.Generation(context, [1, 2], SamplingParams())
except OSError as error:
    print(error.errno, error)
"""
    child = run_in_child(code)
    assert (
        child.stdout.strip() == f"{errno.EMFILE} [Errno {errno.EMFILE}] eventfd() failed: {os.strerror(errno.EMFILE)}"
    )


def test_a_library_that_cannot_be_loaded_says_why(tmp_path):
    # In a child process: the library loads once per process.
    path = tmp_path / "libnot-a-library.so"
    path.write_bytes(b"not an ELF file" * 300)
    code = f"""
from stopline import _core
try:
    _core.load_ctransformers_library({str(path)!r})
except _core.EngineError as error:
    print(error)
"""
    child = run_in_child(code)
    # The loader's own explanation (dlerror()), after the path.
    assert child.stdout.startswith(f"cannot load {path}: ") and "invalid ELF header" in child.stdout


def test_prompt_longer_than_the_context(engine, slot):
    prompt = engine.encode(prompt=LONG_PROMPT_TEXT * 2)
    assert len(prompt) > slot.context_length
    with pytest.raises(ContextOverflowError) as info:
        make_generation(slot, prompt)
    assert isinstance(info.value, ValueError) and isinstance(info.value, EngineError)
    assert f"{len(prompt)} tokens" in str(info.value) and str(slot.context_length) in str(info.value)
    with pytest.raises(ContextOverflowError):
        engine.start(slot, prompt, SamplingParams())


@pytest.mark.parametrize("bad", [[-1], [1, 2, 10**6], "vocab_size"])
def test_invalid_prompt_tokens(engine, slot, bad):
    tokens = [1, engine.vocab_size] if bad == "vocab_size" else bad
    with pytest.raises(ValueError, match="outside the vocabulary"):
        make_generation(slot, tokens)


def test_invalid_arguments(engine, slot):
    with pytest.raises(ValueError, match="no tokens"):
        make_generation(slot, [])
    for name in ("max_tokens", "prefill_chunk", "threads", "window"):
        with pytest.raises(ValueError, match="positive"):
            make_generation(slot, [1, 2], **{name: 0})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        make_generation(slot, [1, 2], logit_bias=((1, 2.0), (engine.vocab_size, 1.0)))
    with pytest.raises(ValueError, match="min_p"):
        make_generation(slot, [1, 2], min_p=1.5)
    # Sampling arguments have one source, SamplingParams: the loop has no defaults of its own.
    with pytest.raises(TypeError):
        Generation(slot, [1, 2])  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="SamplingParams"):
        Generation(slot, [1, 2], {"max_tokens": 4})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="exactly one"):
        engine.encode()


def test_a_generation_runs_once(engine, slot):
    generation = make_generation(slot, engine.encode(messages=CHAT_FRANCE), max_tokens=2, temperature=0)
    assert ended_done(generation.run())
    with pytest.raises(EngineError, match="only once"):
        generation.run()


def test_closed_context(engine):
    context = _core.CtransformersSlot(str(engine.model_path), engine.model_type, 64)
    context.close()
    assert context.closed
    context.close()  # idempotent
    with pytest.raises(EngineError, match="closed"):
        context.token_bytes(1)


@pytest.mark.slow
def test_failed_construction_leaves_other_fds_alone(engine):
    # In a child process: the bug closes whatever file descriptor 0 is.
    code = f"""
import os, sys
from stopline import _core
from stopline.engine.loop import _ctransformers_library_path
from stopline.protocol.requests import SamplingParams
_core.load_ctransformers_library(_ctransformers_library_path())
context = _core.CtransformersSlot({str(engine.model_path)!r}, "llama", 64)
context.close()
r, w = os.pipe()
os.dup2(r, 0)
params = SamplingParams()
for bad in (lambda: _core.Generation(context, [1, 2], params), lambda: _core.Generation(context, 5, params)):
    try:
        bad()
    except Exception:
        pass
    try:
        os.fstat(0)
    except OSError:
        sys.exit(3)
"""
    run_in_child(code)  # exit status 3 would mean the bug closed fd 0
