"""Stopline's edits to llama.cpp's CPU backend (stopline/engine/llama_edits.py): every anchor is
where the edits expect it in the pinned source, a moved one fails the build in one line
and leaves the tree as it was, and the engine's library stops an evaluation inside a
graph node: on the 2-layer Llama-3.2-1B-shaped model, whose output projection is most
of a decode step and whose FFN is a quarter of a prompt chunk, a stop at a random moment
waits a small fraction of the evaluation under way, not for the node."""

from __future__ import annotations

import random
import shutil
import statistics
import threading
import time
from pathlib import Path

import pytest

from bench.inprocess.random_llama import random_llama_path
from stopline import _core
from stopline.engine.llama_build import SDIST_VERSION, llama_source_dir
from stopline.engine.llama_edits import EDITS, STOP_CHECK, LlamaEditError, apply_edits
from stopline.engine.loop import Engine
from stopline.protocol.vocabulary import Batching, EngineName
from support import make_generation, started_running

STOPS = 30


def test_the_interface_header_names_the_one_pinned_source():
    # llama_build.SDIST_VERSION is the pin; the header declaring the binary interface says what it matches.
    header = (Path(__file__).parent.parent / "ext" / "llama_abi.h").read_text()
    assert f"llama-cpp-python {SDIST_VERSION} source" in header


@pytest.fixture(scope="module")
def source() -> Path:
    return llama_source_dir()


@pytest.fixture
def edited_files(source, tmp_path) -> Path:
    """A copy of the files the edits touch, in the tree's layout."""
    for path in {edit.path for edit in EDITS}:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source / path, tmp_path / path)
    return tmp_path


def test_every_anchor_occurs_as_often_as_its_edit_says(source):
    for edit in EDITS:
        assert (source / edit.path).read_text().count(edit.anchor) == edit.count, (edit.path, edit.anchor)


def test_the_edits_put_the_stop_check_in_every_file_they_touch(edited_files):
    apply_edits(edited_files)
    for path in {edit.path for edit in EDITS}:
        # The CPU backend's kernels ask the check; the scheduler ends the evaluation when its eval callback says so.
        expected = STOP_CHECK if path.startswith("ggml/src/ggml-cpu/") else "return GGML_STATUS_ABORTED;  // Stopline"
        assert expected in (edited_files / path).read_text(), path


def test_a_moved_anchor_fails_in_one_line_and_changes_nothing(edited_files):
    moved = next(edit for edit in EDITS if "job" in edit.anchor)
    target = edited_files / moved.path
    target.write_text(target.read_text().replace(moved.anchor, moved.anchor.replace("job", "task"), 1))
    before = {path: (edited_files / path).read_text() for path in {edit.path for edit in EDITS}}
    with pytest.raises(LlamaEditError) as failure:
        apply_edits(edited_files)
    message = str(failure.value)
    assert "\n" not in message and moved.path in message and f"expected {moved.count}" in message
    assert {path: (edited_files / path).read_text() for path in before} == before


@pytest.fixture(scope="module")
def engine() -> Engine:
    # Two threads: the second takes pieces of every node too, and must see the stop as well.
    return Engine.load(random_llama_path(2), engine=EngineName.LLAMA_CPP, threads=2, prefill_chunk=512, progress=False)


def test_the_engine_library_is_built_with_the_edits(engine):
    assert _core.llama_checks_inside_nodes()


def stop_at_random_moments(engine: Engine, prompt: list[int], max_tokens: int, span_s: float) -> list[float]:
    """Cancel generations at random moments within ``span_s`` of their start; each stop's
    time from the cancel to the loop's exit, in seconds."""
    rng = random.Random(7)
    slot = engine.open_slot()
    waits = []
    try:
        for _ in range(STOPS):
            slot.forget()
            generation = make_generation(
                slot, prompt, max_tokens=max_tokens, prefill_chunk=engine.prefill_chunk, threads=engine.threads
            )
            cancelled_ns: list[int] = []
            delay = rng.uniform(0.0, span_s)

            def cancel(delay=delay, generation=generation, cancelled_ns=cancelled_ns):
                time.sleep(delay)
                cancelled_ns.append(time.monotonic_ns())
                generation.cancel()

            canceller = threading.Thread(target=cancel)
            canceller.start()
            result = generation.run()
            canceller.join()
            generation.take()
            if result.exit is _core.ExitKind.CANCELLED:
                waits.append((result.end_ns - cancelled_ns[0]) / 1e9)
    finally:
        slot.close()
    return waits


def timed(engine: Engine, prompt: list[int], max_tokens: int) -> _core.LoopResult:
    slot = engine.open_slot()
    try:
        generation = make_generation(
            slot, prompt, max_tokens=max_tokens, prefill_chunk=engine.prefill_chunk, threads=engine.threads
        )
        result = generation.run()
        generation.take()
        return result
    finally:
        slot.close()


# Timing with two compute threads on two cores: left out of the fast tier, whose other worker
# would preempt a thread, and a stop would wait for the OS to run it again, not for the node.
@pytest.mark.slow
@pytest.mark.alone
def test_a_stop_in_decode_waits_a_small_part_of_a_step(engine):
    prompt = engine.encode(prompt="Once upon a time")
    result = timed(engine, prompt, 8)
    step_s = (result.end_ns - result.first_token_ns) / 1e9 / (result.tokens_generated - 1)
    waits = stop_at_random_moments(engine, prompt, 48, 6 * step_s)
    assert len(waits) >= STOPS // 2
    # Unedited, a stop that lands in the output projection (128,256 rows) waits for its end:
    # a quarter of the stops would wait over a quarter of a step. (Not the longest tail, which
    # a thread preempted by another process decides.)
    assert statistics.quantiles(waits, n=4)[-1] < 0.1 * step_s, (waits, step_s)


@pytest.mark.slow
@pytest.mark.alone
def test_a_stop_in_a_prompt_chunk_waits_a_small_part_of_the_chunk(engine):
    prompt = engine.encode(prompt="The history of bread is long. " * 120)[:512]
    result = timed(engine, prompt, 1)
    chunk_s = (result.first_token_ns - result.start_ns) / 1e9
    waits = stop_at_random_moments(engine, prompt, 1, chunk_s)
    assert len(waits) >= STOPS // 2
    # Unedited, each of the two layers' FFN matmuls (a quarter of the chunk each) is one node,
    # and the median stop would wait a tenth of the chunk.
    assert statistics.median(waits) < 0.02 * chunk_s, (waits, chunk_s)


@pytest.mark.slow
@pytest.mark.alone
def test_a_stop_in_a_shared_step_waits_a_small_part_of_a_step_whichever_generation_leads(engine):
    # 4 generations share each step, evaluated on the thread of the one that posted last; a
    # quarter of the stops land on that one. It hands the others' evaluation back instead of
    # re-running it on its own thread, so none of the stops waits for the others' step.
    rng = random.Random(11)
    prompt = engine.encode(prompt="Once upon a time")
    slots = engine.open_slots(4, Batching.SHARED)
    waits, steps = [], []
    try:
        for _ in range(24):
            for slot in slots:
                slot.forget()
            generations = [
                make_generation(slot, prompt, max_tokens=400, prefill_chunk=engine.prefill_chunk, threads=2)
                for slot in slots
            ]
            workers = [threading.Thread(target=g.run) for g in generations]
            for worker in workers:
                worker.start()
            deadline = time.monotonic() + 60
            while min(len(g.token_ids()) for g in generations) < 4:
                assert time.monotonic() < deadline and not any(g.finished for g in generations)
                time.sleep(0.001)
            stopped = rng.randrange(4)
            time.sleep(rng.uniform(0, 0.02))
            cancelled_ns = time.monotonic_ns()
            generations[stopped].cancel()
            workers[stopped].join(60)
            for generation in generations:
                generation.cancel()
            for worker in workers:
                worker.join(60)
                assert not worker.is_alive(), "a loop hung"
            result = generations[stopped].result
            assert result.exit is _core.ExitKind.CANCELLED
            waits.append((result.end_ns - cancelled_ns) / 1e9)
            steps.append((cancelled_ns - result.first_token_ns) / 1e9 / (result.tokens_generated - 1))
            assert all(slot.kv_positions == slot.n_held for slot in slots)
    finally:
        for slot in slots:
            slot.close()
    step_s = statistics.median(steps)
    # A re-run of the others' step would be most of a step (a quarter of the stops); a stop that
    # finds its thread preempted while 4 generations sample on 2 cores waits for the OS (rare).
    assert sum(wait > 0.4 * step_s for wait in waits) <= 2, (waits, step_s)


@pytest.mark.slow
@pytest.mark.alone
def test_a_stopped_prompt_chunk_waiting_for_room_in_a_shared_step_leaves_at_once(engine):
    # One generation decodes; two more post a 512-token chunk each, and only one chunk fits a
    # batch beside the decode token. The other waits for the next step, and a stop meanwhile
    # ends it at once, not after the evaluation it is no part of (a whole chunk).
    chunk = engine.encode(prompt="The history of bread is long. " * 120)[:512]
    chunk_s = (lambda r: (r.first_token_ns - r.start_ns) / 1e9)(timed(engine, chunk, 1))
    slots = engine.open_slots(3, Batching.SHARED)
    waits = []
    try:
        for _ in range(4):
            for slot in slots:
                slot.forget()
            decoding, first, second = (
                make_generation(slot, prompt, max_tokens=max_tokens, prefill_chunk=512, threads=2)
                for slot, prompt, max_tokens in zip(
                    slots, (engine.encode(prompt="Once upon a time"), chunk, chunk[::-1]), (2000, 4, 4), strict=True
                )
            )
            workers = {g: threading.Thread(target=g.run) for g in (decoding, first, second)}
            workers[decoding].start()
            deadline = time.monotonic() + 60
            while len(decoding.token_ids()) < 2:
                assert time.monotonic() < deadline and not decoding.finished
                time.sleep(0.001)
            # The first posts its chunk before the second does, so it is the one that fits.
            for generation in (first, second):
                workers[generation].start()
                started_running(generation)
                time.sleep(0.02)
            time.sleep(0.1 * chunk_s)
            cancelled_ns = time.monotonic_ns()
            second.cancel()
            workers[second].join(60)
            for generation, worker in workers.items():
                generation.cancel()
                worker.join(60)
                assert not worker.is_alive(), "a loop hung"
            assert second.result.exit is _core.ExitKind.CANCELLED and second.result.tokens_generated == 0
            waits.append((second.result.end_ns - cancelled_ns) / 1e9)
            assert all(slot.kv_positions == slot.n_held for slot in slots)
    finally:
        for slot in slots:
            slot.close()
    assert max(waits) < 0.1 * chunk_s, (waits, chunk_s)
