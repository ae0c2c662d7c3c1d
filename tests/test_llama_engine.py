"""The llama.cpp engine: the same loop contract over today's llama.cpp, with the
real shim library, the real SmolLM2 and Gemma 3 270M files and real servers.

The server's tests (every stop path included) run on this engine through
conftest's ``engine``, which gives them llama.cpp first and ctransformers second.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path

import gguf
import numpy as np
import pytest

from bench.launch import run_stopline
from stopline import _core
from stopline.engine.llama_build import cached_library
from stopline.engine.loop import KV_MEMORY_SHARE, MAX_SEQUENCES, Engine, kv_bytes_per_token, sized_slots
from stopline.engine.model import embedded_tokenizer, gemma_gguf_path, original_gguf_path
from stopline.engine.model_check import ModelFileError, read_gguf_metadata
from stopline.engine.tokenizer import ChatTokenizer
from stopline.observability import ConsoleRenderer
from stopline.protocol.requests import SamplingParams, exit_outcome
from stopline.protocol.vocabulary import TERMINAL_TYPES, AbortMode, Batching, EngineName, PromptSteps
from support import LONG_ANSWER, UNIT, client_for, http_get, make_generation, running_server, started_running

FRANCE = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def engine(llama_engine) -> Engine:
    """The embedded SmolLM2, on the llama.cpp engine alone (overrides conftest's for this module,
    which is about that engine)."""
    return llama_engine


@pytest.fixture(scope="module")
def gemma() -> Engine:
    return Engine.load(gemma_gguf_path(progress=False), engine=EngineName.LLAMA_CPP, threads=1, progress=False)


@pytest.fixture
def slot(engine):
    slot = engine.open_slot()
    yield slot
    slot.close()


def greedy(engine: Engine, slot, prompt: list[int], max_tokens: int = 24) -> tuple[list[bytes], _core.LoopResult]:
    generation = make_generation(slot, prompt, max_tokens=max_tokens, prefill_chunk=engine.prefill_chunk, **GREEDY)
    result = generation.run()
    return generation.take(), result


# Two candidates this close in log probability may swap places when the same
# tokens are evaluated in batches of other shapes (llama.cpp's kernels sum in
# an order that depends on the shape, and a decode token batched with a
# 512-token chunk goes through the prompt's kernels): up to 0.163 apart, in
# these tests.
NEAR_TIE_LOGPROB = 0.2


@dataclass
class Reference:
    """A greedy generation's token ids, with the two likeliest tokens at each step."""

    ids: list[int]
    two_likeliest: list[list[tuple[int, float]]]

    def agrees_up_to_a_near_tie(self, ids: list[int]) -> bool:
        """``ids`` are these tokens up to the first step whose two likeliest were a near-tie,
        where ``ids`` took the second: each token is what a fresh, lone evaluation makes likeliest."""
        for step, (expected, token) in enumerate(zip(self.ids, ids)):
            if token != expected:
                (_, first_logprob), (second, second_logprob) = self.two_likeliest[step]
                return token == second and first_logprob - second_logprob <= NEAR_TIE_LOGPROB
        return len(ids) == len(self.ids)


def reference(engine: Engine, prompt: list[int], max_tokens: int) -> Reference:
    """The greedy generation of ``prompt`` on a fresh context of its own."""
    alone = engine.open_slot()
    try:
        generation = make_generation(
            alone, prompt, max_tokens=max_tokens, prefill_chunk=engine.prefill_chunk, logprobs=2, **GREEDY
        )
        generation.run()
        ids = generation.token_ids()
        return Reference(ids, [top for _, top in generation.logprobs(0, len(ids))])
    finally:
        alone.close()


async def test_by_default_eight_shared_slots_each_hold_the_models_trained_context(logs):
    # The README's command: the embedded model in shared steps, with as many slots of its
    # 8,192-token context as fit a quarter of the memory, up to 8 (a test machine has room for 8).
    engine = Engine.load(engine=EngineName.LLAMA_CPP, threads=1, progress=False)
    assert engine.context_length == 8192 == engine.model.context_limit
    [sized] = logs.records("slots_sized")
    assert sized["context_length"] == 8192 and sized["sequences"] == engine.sequences == MAX_SEQUENCES
    assert sized["why"] == "8 sequences: as many as fit, up to 8; the model's trained context"
    async with running_server(engine) as server:
        assert server.scheduler.batching is Batching.SHARED and server.scheduler.workers == MAX_SEQUENCES
        assert logs.records("server_started")[0]["workers"] == MAX_SEQUENCES
        async with client_for(server) as client:
            # Longer than the 2,048 tokens a slot held by default before.
            accepted = await client.generate("long", prompt="The history of bread is long. " * 450, max_tokens=4)
            assert accepted["type"] == "accepted" and accepted["prompt_tokens"] > 3031
            done = await client.terminal("long", timeout=120 * UNIT)
            assert done["type"] == "done" and done["tokens_generated"] == 4
            # Eight users at once: each starts at once (none is queued), beside the others.
            users = [f"user{n}" for n in range(MAX_SEQUENCES)]
            for n, user in enumerate(users):
                accepted = await client.generate(user, prompt=f"{n}. Tell me a long story.", max_tokens=400)
                assert accepted["queue_position"] == 0, user
            for user in users:
                await client.send({"type": "cancel", "id": user})
            ended = {}
            while len(ended) < len(users):
                frame = await client.recv_until(lambda f: f["type"] in TERMINAL_TYPES, timeout=60)
                ended[frame["id"]] = frame["type"]
    assert ended == dict.fromkeys(users, "cancelled")


def test_the_slots_are_llama_servers_four_or_as_many_as_hold_the_trained_context_up_to_eight(engine, logs):
    # SmolLM2: 30 layers, 3 KV heads of 64 dimensions, K and V in f16.
    per_token = kv_bytes_per_token(engine.model)
    assert per_token == 30 * 3 * (64 + 64) * 2

    def memory_for(sequences: int, context: int) -> int:
        return int(sequences * context * per_token / KV_MEMORY_SHARE)

    assert sized_slots(engine.model, None, None, memory_for(6, 8192)) == (6, 8192)
    assert logs.records("slots_sized")[-1]["why"] == "6 sequences: as many as fit, up to 8; the model's trained context"
    assert sized_slots(engine.model, None, None, memory_for(100, 8192)) == (8, 8192)
    # Too little for 4 of the trained context: 4, each with what fits.
    assert sized_slots(engine.model, None, None, memory_for(4, 4096)) == (4, 4096)
    assert logs.records("slots_sized")[-1]["why"] == (
        "4 sequences: llama-server's parallel sequences; the context that fits the KV cache's share of memory"
    )
    # A context asked for is what the sequences are counted in.
    assert sized_slots(engine.model, None, 2048, memory_for(7, 2048)) == (7, 2048)
    # Asked for both: nothing is sized, and nothing said.
    logs.clear()
    assert sized_slots(engine.model, 3, 1024, 1) == (3, 1024)
    assert not logs.records("slots_sized")


def test_a_context_sized_from_the_model_fits_the_kv_caches_share_of_memory(engine, logs):
    per_token = kv_bytes_per_token(engine.model)
    # Memory for 4 slots of 4,096 tokens: the trained 8,192 is halved.
    memory = int(4 * 4096 * per_token / KV_MEMORY_SHARE)
    assert sized_slots(engine.model, 4, None, memory) == (4, 4096)
    assert logs.records("slots_sized")[-1]["why"] == "the context that fits the KV cache's share of memory"
    # Never under 2,048 tokens, nor over the trained context.
    assert sized_slots(engine.model, 4, None, 1 << 20) == (4, 2048)
    assert sized_slots(engine.model, 1, None, 1 << 50) == (1, 8192)


def test_the_engine_proves_its_abort_and_names_itself(engine):
    assert engine.kind is EngineName.LLAMA_CPP and engine.abort_mode is AbortMode.IN_STEP
    assert engine.name == "SmolLM2-135M-Instruct" and engine.context_length == 2048
    # llama-server's batch: a stop inside a node makes a chunk's size cost a stop nothing.
    assert engine.prefill_chunk == 512 and engine.trim_output is False
    assert _core.llama_checks_inside_nodes()


async def test_healthz_names_the_engine(server):
    status, body = await http_get(server, "/healthz")
    assert status == 200 and json.loads(body)["engine"] == "llama.cpp"


def test_the_shim_exports_only_its_own_functions():
    # Loaded RTLD_LOCAL and exporting no ggml symbol, its ggml can never bind libctransformers' calls.
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("binutils' nm is not installed")
    command = [nm, "-D", "--defined-only", str(cached_library())]
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    exported = {line.split()[-1] for line in out.stdout.splitlines() if line.strip()}
    assert exported and all(name.startswith("sll_") for name in exported), sorted(exported)[:20]


def test_both_engines_in_one_process_keep_their_in_step_stop(engine):
    # The ctransformers engine still proves its GOT hook with llama.cpp's ggml loaded beside it.
    other = Engine.load(threads=1, progress=False, engine=EngineName.CTRANSFORMERS)
    assert other.kind is EngineName.CTRANSFORMERS and other.abort_mode is AbortMode.IN_STEP
    slot = other.open_slot()
    try:
        generation = make_generation(slot, other.encode(messages=FRANCE), max_tokens=400, prefill_chunk=64)
        worker = threading.Thread(target=generation.run)
        worker.start()
        started_running(generation)
        generation.cancel()
        worker.join()
        assert generation.result.exit is _core.ExitKind.CANCELLED
    finally:
        slot.close()


def test_greedy_answer_and_the_models_own_tokenizer(engine, slot):
    prompt = engine.encode(messages=FRANCE)
    # llama.cpp's tokenizer agrees with the byte-level BPE the ctransformers engine uses.
    assert prompt == embedded_tokenizer(progress=False).encode(engine.tokenizer.render_chat(FRANCE))
    pieces, result = greedy(engine, slot, prompt)
    assert "Paris" in b"".join(pieces).decode()
    assert result.tokens_generated == len(pieces)
    # The last token was sampled, never evaluated: the answer's last at max_tokens, or the
    # end-of-text token, which the answer does not count.
    assert result.exit in (_core.ExitKind.MAX_TOKENS, _core.ExitKind.EOS)
    unevaluated = 1 if result.exit is _core.ExitKind.MAX_TOKENS else 0
    assert slot.kv_positions == slot.n_held == result.prompt_tokens + result.tokens_generated - unevaluated


def test_detokenizing_keeps_nul_bytes(engine):
    model = engine.model
    nul = [t for t in range(model.vocab_size) if b"\x00" in model.token_bytes(t)]
    assert nul, "the byte-level vocabulary has a token for the NUL byte"
    assert model.token_bytes(nul[0]) == b"\x00"


def test_a_follow_up_turn_evaluates_only_its_new_tokens(engine, slot):
    first = engine.encode(messages=FRANCE)
    pieces, _ = greedy(engine, slot, first)
    answer = {"role": "assistant", "content": b"".join(pieces).decode()}
    turn = [*FRANCE, answer, {"role": "user", "content": "And Spain?"}]
    second = engine.encode(messages=turn)
    generation = make_generation(slot, second, max_tokens=24, prefill_chunk=engine.prefill_chunk, **GREEDY)
    reused = generation.run()
    assert reused.prompt_tokens_reused > len(first) // 2
    assert reused.prompt_tokens_evaluated == reused.prompt_tokens - reused.prompt_tokens_reused
    # The reused answer was evaluated token by token, a fresh one in chunks: equally valid, not bit-identical.
    assert reference(engine, second, 24).agrees_up_to_a_near_tie(generation.token_ids())


def test_a_context_keeps_its_compute_threads_between_evaluations():
    # Left to itself, ggml would start and join a thread for each of these evaluations,
    # and a stop would wait for a thread that had not yet got a core.
    engine = Engine.load(engine=EngineName.LLAMA_CPP, threads=2, progress=False)
    slot = engine.open_slot()
    try:
        before = set(os.listdir("/proc/self/task"))
        prompt = engine.encode(messages=LONG_ANSWER)
        generation = make_generation(slot, prompt, max_tokens=32, prefill_chunk=256, threads=2, **GREEDY)
        loop = threading.Thread(target=generation.run)
        loop.start()
        seen: set[str] = set()
        while loop.is_alive():
            seen |= set(os.listdir("/proc/self/task"))
            time.sleep(0.0002)
        loop.join()
        assert generation.result.tokens_generated == 32
        assert seen - before - {str(loop.native_id)} == set()
    finally:
        slot.close()


@pytest.mark.alone
def test_a_thread_that_wakes_during_an_evaluation_soon_gets_a_core():
    # The compute threads fill every core. The event loop that reads a cancel, and the
    # thread of a generation whose stop has come, must not wait out their time slices.
    cores = len(os.sched_getaffinity(0))
    if cores > 8:
        pytest.skip("the compute threads fill the cores only where there are few")
    engine = Engine.load(engine=EngineName.LLAMA_CPP, threads=cores, progress=False)
    slot = engine.open_slot()

    def waited_for_a_core_ns() -> int:
        with open("/proc/thread-self/schedstat") as stat:
            return int(stat.read().split()[1])

    try:
        prompt = engine.encode(messages=LONG_ANSWER)
        waits: list[int] = []
        decode_steps_ns = []
        while len(waits) < 1000:
            generation = make_generation(slot, prompt, max_tokens=128, threads=cores, **GREEDY)
            loop = threading.Thread(target=generation.run)
            loop.start()
            started_running(generation)
            while loop.is_alive():
                before = waited_for_a_core_ns()
                time.sleep(0.001)
                waits.append(waited_for_a_core_ns() - before)
                generation.take()
            loop.join()
            result = generation.result
            assert result.tokens_generated == 128
            decode_steps_ns.append((result.end_ns - result.first_token_ns) / (result.tokens_generated - 1))
        # Without the compute threads' offer of their cores, the 99th percentile was a
        # quarter of a decode step (SmolLM2 on 2 threads and 2 cores); with it, a fiftieth.
        assert np.percentile(waits, 99) < min(decode_steps_ns) / 10
    finally:
        slot.close()


def test_invalid_input_is_refused_before_it_reaches_llama_cpp(engine, slot):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        make_generation(slot, [1, engine.vocab_size], max_tokens=4)
    with pytest.raises(ValueError, match="batch limit"):
        make_generation(slot, [1, 2], max_tokens=4, prefill_chunk=slot.max_batch + 1)
    with pytest.raises(_core.ContextOverflowError):
        make_generation(slot, [1] * slot.context_length, max_tokens=4)


def test_the_native_loop_reads_every_sampling_parameter(slot):
    read = set()

    class Recording(SamplingParams):
        def __getattribute__(self, name):
            read.add(name)
            return super().__getattribute__(name)

    _core.Generation(slot, [1, 2], Recording(max_tokens=4, seed=0)).close()
    # The deadlines are the engine's: Engine.start turns them into the loop's deadline_ns and
    # first_token_deadline_ns. Every other field of SamplingParams, and nothing else, the
    # native side reads, so a field added on either side without the other fails here.
    deadlines = {"timeout_s", "ttft_timeout_s"}
    assert {name for name in read if not name.startswith("_")} == {f.name for f in fields(SamplingParams)} - deadlines


def random_aborts(engine: Engine, slot, control, count: int, seed: int, compare_every: int = 1) -> dict:
    """Cancel ``count`` generations on ``slot`` at random moments (in the prompt or in
    decode), and check after each one that the KV cache holds exactly the positions
    the slot's record says; after every ``compare_every``-th one, also that:

    - the next greedy generation, taking what it can from the cache, equals the one
      a ``control`` slot gives after doing the same work without the aborted step
      (the same generation, ended where the abort ended it);
    - and, from an emptied cache, it equals a fresh context's.

    The control, not a fresh context, is the reference with the cache reused: a
    resumed prompt is evaluated in batches of other shapes than a fresh one, and
    llama.cpp's kernels sum differently for different shapes."""
    rng = random.Random(seed)
    prompt = engine.encode(messages=[{"role": "user", "content": "Tell me about bread. " * 20}])
    control.forget()
    reference, _ = greedy(engine, control, prompt, max_tokens=16)
    tally = {"cancelled": 0, "finished": 0, "mismatched_state": 0, "changed_continuations": 0}
    for n in range(count):
        head = prompt[: rng.randrange(2, len(prompt) + 1)]
        options = {"prefill_chunk": engine.prefill_chunk, "seed": n}
        slot.forget()
        generation = make_generation(slot, head, max_tokens=64, **options)
        worker = threading.Thread(target=generation.run)
        worker.start()
        started_running(generation)
        time.sleep(rng.uniform(0, 0.2) * UNIT)
        generation.cancel()
        worker.join(60 * UNIT)
        assert not worker.is_alive(), "the loop hung after a cancel"
        result = generation.result
        tally["cancelled" if result.exit is _core.ExitKind.CANCELLED else "finished"] += 1
        tally["mismatched_state"] += slot.kv_positions != slot.n_held
        if n % compare_every:
            continue
        # The same work on the control, without the aborted step: the same
        # generation, ended when its cache held what the slot's does (a
        # generation ends holding every token it sampled but the last).
        control.forget()
        if result.tokens_generated:
            make_generation(control, head, max_tokens=slot.n_held - len(head) + 1, **options).run()
        elif slot.n_held:
            make_generation(control, head[: slot.n_held], max_tokens=1, **options).run()
        tally["mismatched_state"] += control.n_held != slot.n_held
        resumed, _ = greedy(engine, slot, prompt, max_tokens=16)
        expected, _ = greedy(engine, control, prompt, max_tokens=16)
        tally["changed_continuations"] += resumed != expected
        slot.forget()
        tally["changed_continuations"] += greedy(engine, slot, prompt, max_tokens=16)[0] != reference
    return tally


def test_aborts_at_random_moments_leave_a_consistent_cache(engine):
    slot, control = engine.open_slot(), engine.open_slot()
    try:
        tally = random_aborts(engine, slot, control, 6, seed=1)
    finally:
        slot.close()
        control.close()
    assert tally["mismatched_state"] == 0 and tally["changed_continuations"] == 0, tally
    assert tally["cancelled"] >= 4, tally


# The slow tier's storms: STORM_ABORTS aborts at random moments, in each batching mode. The bench
# (python -m bench run --llama-native) runs 1,000 of each, on every model.
STORM_ABORTS = 120


@pytest.mark.slow
def test_a_storm_of_aborts_at_random_moments(engine):
    pairs = [(engine.open_slot(), engine.open_slot()) for _ in range(2)]
    try:
        tallies: list[dict] = []
        threads = [
            threading.Thread(
                target=lambda p=p, i=i: tallies.append(random_aborts(engine, *p, STORM_ABORTS // 2, i, 10))
            )
            for i, p in enumerate(pairs)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for pair in pairs:
            for s in pair:
                s.close()
    assert len(tallies) == 2 and sum(t["cancelled"] for t in tallies) >= 0.9 * STORM_ABORTS, tallies
    assert sum(t["mismatched_state"] for t in tallies) == 0, tallies
    assert sum(t["changed_continuations"] for t in tallies) == 0, tallies


STORIES = [
    [{"role": "user", "content": f"Tell me a short story about {thing}."}]
    for thing in ("a dragon", "bread", "the sea", "a lighthouse keeper")
]


def run_together(generations: list) -> list[_core.LoopResult]:
    """Run ``generations`` at once, each on its own thread, as the scheduler does."""
    workers = [threading.Thread(target=g.run) for g in generations]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120 * UNIT)
        assert not worker.is_alive(), "a loop hung"
    return [g.result for g in generations]


def test_generations_on_one_context_share_its_steps(engine):
    prompts = [engine.encode(messages=story) for story in STORIES]
    expected = [reference(engine, prompt, 32) for prompt in prompts]
    slots = engine.open_slots(4, Batching.SHARED)
    try:
        generations = [
            make_generation(slot, prompt, max_tokens=32, prefill_chunk=engine.prefill_chunk, **GREEDY)
            for slot, prompt in zip(slots, prompts, strict=True)
        ]
        results = run_together(generations)
        assert [r.exit for r in results] == [_core.ExitKind.MAX_TOKENS] * 4
        # Each computed what it computes alone, token for token up to a near-tie.
        assert all(e.agrees_up_to_a_near_tie(g.token_ids()) for e, g in zip(expected, generations, strict=True))
        steps, carried, reruns, _ = slots[0].owner.step_counts
        # 4 prompts of one chunk and 31 evaluated tokens each, mostly in shared steps.
        assert carried == 4 * 32 and steps < carried / 2 and reruns == 0
        assert all(slot.kv_positions == slot.n_held for slot in slots)
    finally:
        for slot in slots:
            slot.close()


def test_a_cancel_in_a_shared_step_costs_the_others_one_step_at_most(engine):
    prompts = [engine.encode(messages=story) for story in STORIES]
    expected = [reference(engine, prompt, 48) for prompt in prompts[1:]]
    slots = engine.open_slots(4, Batching.SHARED)
    try:
        generations = [
            make_generation(slot, prompt, max_tokens=48, prefill_chunk=engine.prefill_chunk, **GREEDY)
            for slot, prompt in zip(slots, prompts, strict=True)
        ]
        workers = [threading.Thread(target=g.run) for g in generations]
        for worker in workers:
            worker.start()
        started_running(generations[0])
        wait_for_tokens(generations[0], 8)
        generations[0].cancel()
        for worker in workers:
            worker.join(120 * UNIT)
            assert not worker.is_alive()
        cancelled = generations[0].result
        assert cancelled.exit is _core.ExitKind.CANCELLED and cancelled.tokens_after_cancel == 0
        # The others finished, and computed what they compute alone, up to a near-tie.
        assert [g.result.exit for g in generations[1:]] == [_core.ExitKind.MAX_TOKENS] * 3
        assert all(e.agrees_up_to_a_near_tie(g.token_ids()) for e, g in zip(expected, generations[1:], strict=True))
        # A decoding generation's stop never aborts the step it leaves: the others go on with it.
        assert slots[0].owner.step_counts[2] == 0
        assert all(slot.kv_positions == slot.n_held for slot in slots)
    finally:
        for slot in slots:
            slot.close()


def test_a_prompts_last_chunk_alone_costs_the_running_generations_no_token(engine):
    # With --prompt-steps alone, the step of a newcomer's last chunk leaves the decode tokens
    # out, handing them to the next step: each generation still computes what it computes alone.
    prompts = [engine.encode(messages=story) for story in STORIES[:3]]
    expected = [reference(engine, prompt, 32) for prompt in prompts]
    slots = engine.open_slots(3, Batching.SHARED, PromptSteps.ALONE)
    try:
        assert slots[0].owner.prompts_first
        generations = [
            make_generation(slot, prompt, max_tokens=32, prefill_chunk=engine.prefill_chunk, **GREEDY)
            for slot, prompt in zip(slots, prompts, strict=True)
        ]
        workers = [threading.Thread(target=g.run) for g in generations]
        workers[0].start()
        # The others arrive one by one while the first decodes.
        for index, worker in enumerate(workers[1:], start=1):
            wait_for_tokens(generations[0], 8 * index)
            worker.start()
        for worker in workers:
            worker.join(120 * UNIT)
            assert not worker.is_alive()
        assert [g.result.exit for g in generations] == [_core.ExitKind.MAX_TOKENS] * 3
        assert all(e.agrees_up_to_a_near_tie(g.token_ids()) for e, g in zip(expected, generations, strict=True))
        assert all(slot.kv_positions == slot.n_held for slot in slots)
    finally:
        for slot in slots:
            slot.close()


def test_a_short_second_chunk_never_takes_a_decode_tokens_room(engine):
    # A step holds one whole chunk and one token of every other sequence. A newcomer's prompt
    # of exactly that spare room arrives while a long prompt is in its chunks: it waits for a
    # later step rather than push the decoding generation's token out of this one.
    slots = engine.open_slots(3, Batching.SHARED)
    owner = slots[0].owner
    chunk = engine.prefill_chunk
    long_prompt = engine.encode(prompt="The history of bread is long. " * 200)
    assert len(long_prompt) > 2 * chunk
    short_prompt = engine.encode(messages=STORIES[1])[: len(owner.sequences) - 1]
    try:
        decoding = make_generation(
            slots[0], engine.encode(messages=STORIES[0]), max_tokens=400, prefill_chunk=chunk, **GREEDY
        )
        prefilling = make_generation(slots[1], long_prompt, max_tokens=1, prefill_chunk=chunk, **GREEDY)
        newcomer = make_generation(slots[2], short_prompt, max_tokens=1, prefill_chunk=chunk, **GREEDY)
        workers = [threading.Thread(target=g.run) for g in (decoding, prefilling, newcomer)]
        workers[0].start()
        wait_for_tokens(decoding, 2)
        workers[1].start()
        started_running(prefilling)
        workers[2].start()
        for worker in workers[1:]:
            worker.join(120 * UNIT)
            assert not worker.is_alive()
        decoding.cancel()
        workers[0].join(120 * UNIT)
        assert [g.result.exit for g in (prefilling, newcomer)] == [_core.ExitKind.MAX_TOKENS] * 2
        assert owner.decode_tokens_deferred == 0
        assert all(slot.kv_positions == slot.n_held for slot in slots)
    finally:
        for slot in slots:
            slot.close()


def test_a_stopped_generation_leaves_the_shared_step_under_way(engine):
    # A long prompt's chunks make the steps long; a second generation decodes beside them, its
    # token in each of those steps. Stopped during one, it ends while that step goes on for the
    # prompt, which is neither aborted nor evaluated again.
    long_prompt = engine.encode(prompt="The history of bread is long. " * 120)
    prompt = engine.encode(messages=STORIES[0])
    slots = engine.open_slots(2, Batching.SHARED)
    owner = slots[0].owner
    ended_during_the_step = []
    try:
        # A stop that comes between two steps (while the generation samples) cannot
        # show it: a few tries, of which one is enough.
        for _ in range(3):
            for slot in slots:
                slot.forget()
            decoding = make_generation(slots[0], prompt, max_tokens=400, prefill_chunk=engine.prefill_chunk, **GREEDY)
            prefilling = make_generation(
                slots[1], long_prompt, max_tokens=1, prefill_chunk=engine.prefill_chunk, **GREEDY
            )
            workers = [threading.Thread(target=g.run) for g in (decoding, prefilling)]
            workers[0].start()
            wait_for_tokens(decoding, 2)
            deadline = time.monotonic() + 60 * UNIT
            workers[1].start()
            started_running(prefilling)
            time.sleep(0.02 * UNIT)
            while not owner.step_under_way:
                assert time.monotonic() < deadline and not prefilling.finished
            decoding.cancel()
            while not decoding.finished:
                assert time.monotonic() < deadline
            ended_during_the_step.append(owner.step_under_way)
            for worker in workers:
                worker.join(120 * UNIT)
                assert not worker.is_alive()
            cancelled, finished = decoding.result, prefilling.result
            assert cancelled.exit is _core.ExitKind.CANCELLED and cancelled.tokens_after_cancel == 0
            assert finished.exit is _core.ExitKind.MAX_TOKENS and finished.prompt_tokens_wasted == 0
            assert finished.prompt_tokens_evaluated == len(long_prompt)
            # Its positions in the step it left are dropped once that step ends.
            assert all(slot.kv_positions == slot.n_held for slot in slots)
            if ended_during_the_step[-1]:
                break
        assert any(ended_during_the_step), ended_during_the_step
        assert owner.step_counts[2] == 0
    finally:
        for slot in slots:
            slot.close()


def wait_for_tokens(generation, count: int) -> None:
    deadline = time.monotonic() + 60 * UNIT
    while len(generation.token_ids()) < count:
        assert time.monotonic() < deadline and not generation.finished
        time.sleep(0.001)


def test_a_paused_generation_takes_no_step_and_resumes_from_its_cache(engine):
    prompts = [engine.encode(messages=story) for story in STORIES[:2]]
    expected = reference(engine, prompts[0], 48)
    slots = engine.open_slots(2, Batching.SHARED)
    try:
        paused = make_generation(slots[0], prompts[0], max_tokens=48, prefill_chunk=engine.prefill_chunk, **GREEDY)
        other = make_generation(slots[1], prompts[1], max_tokens=2000, ignore_eos=True, **GREEDY)
        workers = [threading.Thread(target=g.run) for g in (paused, other)]
        for worker in workers:
            worker.start()
        wait_for_tokens(paused, 4)
        at_pause = len(paused.token_ids())
        paused.pause()
        # The step under way ends (its token is published), and then no other is taken while
        # the other generation goes on alone.
        wait_for_tokens(other, len(other.token_ids()) + 8)
        held = len(paused.token_ids())
        wait_for_tokens(other, len(other.token_ids()) + 16)
        assert at_pause <= len(paused.token_ids()) == held <= at_pause + 1
        paused.resume()
        workers[0].join(120 * UNIT)
        assert not workers[0].is_alive()
        result = paused.result
        assert result.exit is _core.ExitKind.MAX_TOKENS and result.tokens_generated == 48
        # It went on from its cache: the prompt was evaluated once, and the text is what it is unpaused.
        assert result.preemptions == 1 and result.preempted_ns > 0
        assert result.prompt_tokens_evaluated == len(prompts[0]) and result.prompt_tokens_wasted == 0
        assert expected.agrees_up_to_a_near_tie(paused.token_ids())
        # A stop ends a paused generation at once.
        other.pause()
        other.cancel()
        workers[1].join(60 * UNIT)
        assert not workers[1].is_alive()
        assert other.result.exit is _core.ExitKind.CANCELLED and other.result.tokens_after_cancel == 0
        assert all(slot.kv_positions == slot.n_held for slot in slots)
    finally:
        for slot in slots:
            slot.close()


def test_an_urgent_generation_interrupts_the_step_under_way_and_the_others_lose_nothing(engine):
    prompts = [engine.encode(messages=story) for story in STORIES[:2]]
    # Within the loop's window: nobody reads these generations' tokens as they come.
    expected = [reference(engine, prompt, 60) for prompt in prompts]
    urgent_prompt = engine.encode(messages=FRANCE)
    urgent_expected = reference(engine, urgent_prompt, 4)
    slots = engine.open_slots(3, Batching.SHARED)
    owner = slots[0].owner
    try:
        running = [
            make_generation(slot, prompt, max_tokens=60, prefill_chunk=engine.prefill_chunk, **GREEDY)
            for slot, prompt in zip(slots, prompts, strict=False)
        ]
        workers = [threading.Thread(target=g.run) for g in running]
        for worker in workers:
            worker.start()
        for generation in running:
            wait_for_tokens(generation, 4)
        # Steps follow one another while two generations decode, but a post can fall between
        # two: a few preemptions make an interrupted step all but certain.
        urgent_results = []
        for _ in range(4):
            running[1].pause()
            urgent = make_generation(
                slots[2], urgent_prompt, max_tokens=4, prefill_chunk=engine.prefill_chunk, urgent=True, **GREEDY
            )
            urgent.run()
            urgent_results.append((urgent.result, urgent.token_ids()))
            slots[2].forget()
            running[1].resume()
            if owner.step_counts[3] or any(g.finished for g in running):
                break
        for worker in workers:
            worker.join(120 * UNIT)
            assert not worker.is_alive()
        _, _, reruns, interruptions = owner.step_counts
        assert 1 <= interruptions <= len(urgent_results) and reruns == 0
        # The interrupted steps' work was done again: every generation's text is its own greedy one.
        for result, ids in urgent_results:
            assert result.exit is _core.ExitKind.MAX_TOKENS and urgent_expected.agrees_up_to_a_near_tie(ids)
        for generation, reference_ids in zip(running, expected, strict=True):
            assert generation.result.exit is _core.ExitKind.MAX_TOKENS
            assert generation.result.prompt_tokens_wasted == 0
            assert reference_ids.agrees_up_to_a_near_tie(generation.token_ids())
        assert all(slot.kv_positions == slot.n_held for slot in slots)
    finally:
        for slot in slots:
            slot.close()


def test_an_interrupted_prompt_chunk_keeps_its_finished_pieces(engine):
    # A newcomer that preempts ends the step under way, here a prompt chunk in pieces of
    # 16: the chunk keeps the pieces finished before it and evaluates only the rest.
    chunk = engine.prefill_chunk
    context = _core.LlamaContext(engine.model, 4 * chunk, chunk, engine.threads, 2, 16)
    slot, other = context.sequences
    try:
        prompt = engine.encode(prompt="The history of bread is long. " * 100)[: chunk + chunk // 4]
        begun = time.monotonic()
        expected = reference(engine, prompt, 12)
        first_chunk = (time.monotonic() - begun) * chunk / len(prompt)
        generation = make_generation(slot, prompt, max_tokens=12, prefill_chunk=chunk, **GREEDY)
        worker = threading.Thread(target=generation.run)
        worker.start()
        started_running(generation)
        time.sleep(first_chunk / 2)
        urgent = make_generation(other, engine.encode(messages=FRANCE), max_tokens=2, prefill_chunk=chunk, urgent=True)
        assert urgent.run().exit is _core.ExitKind.MAX_TOKENS
        worker.join(120 * UNIT)
        result = generation.result
        assert context.step_counts[3] == 1
        kept = context.kept_after_aborts
        assert 0 < kept < chunk and kept % 16 == 0
        # Every prompt token evaluated once, and the answer a lone evaluation's.
        assert result.exit is _core.ExitKind.MAX_TOKENS and result.prompt_tokens_evaluated == len(prompt)
        assert result.prompt_tokens_wasted == 0
        assert slot.kv_positions == slot.n_held
        assert expected.agrees_up_to_a_near_tie(generation.token_ids())
    finally:
        for sequence in context.sequences:
            sequence.close()


async def test_a_request_of_higher_priority_preempts_one_of_lower_and_it_resumes_losing_nothing(engine, logs):
    async with running_server(engine, workers=2) as server:
        async with client_for(server) as client:
            for name in ("low-1", "low-2"):
                await client.generate(name, messages=LONG_ANSWER, max_tokens=120, ignore_eos=True, priority=5)
                await client.recv_until(lambda f, n=name: f["type"] == "token" and f["id"] == n)
            # Both workers run: the urgent request starts at once on the spare sequence, and the
            # low-priority request started last is paused.
            accepted = await client.generate("urgent", messages=FRANCE, max_tokens=8, temperature=0)
            assert accepted["queue_position"] == 0
            preempted = await client.recv_until(lambda f: f["type"] == "preempted", timeout=60 * UNIT)
            urgent = await client.terminal("urgent", timeout=120 * UNIT)
            resumed = await client.recv_until(lambda f: f["type"] == "resumed", timeout=60 * UNIT)
            ends = {name: await client.terminal(name, timeout=180 * UNIT) for name in ("low-1", "low-2")}
    assert preempted["id"] == resumed["id"] == "low-2" and urgent["type"] == "done"
    # The urgent request ended before the preempted one was resumed.
    order = [(f["type"], f["id"]) for f in client.frames]
    assert order.index(("done", "urgent")) < order.index(("resumed", "low-2"))
    # Every token of the preempted request came once, in order, and it ran to its end.
    for name, end in ends.items():
        assert end["type"] == "done" and end["tokens_generated"] == 120
        assert [f["index"] for f in client.tokens(name)] == list(range(120))
    [record] = logs.records("generation_done", id="low-2")
    # Its prompt was evaluated once: the prefix low-1's sequence held was shared (the prompt
    # cache's live tier), the rest evaluated, and none of it again after the pause.
    assert record["preemptions"] == 1
    assert record["prompt_tokens_evaluated"] + record["prompt_tokens_reused"] == record["prompt_tokens"]


async def test_a_server_with_shared_steps_stops_one_request_and_finishes_the_other(engine, logs):
    async with running_server(engine, workers=2, batching="shared") as server:
        async with client_for(server) as client:
            await client.generate("kept", messages=LONG_ANSWER, max_tokens=48, temperature=0)
            await client.generate("stopped", messages=LONG_ANSWER, max_tokens=500, temperature=0)
            await client.recv_until(lambda f: f["type"] == "token" and f["id"] == "stopped" and f["index"] == 4)
            await client.send({"type": "cancel", "id": "stopped"})
            cancelled = await client.terminal("stopped")
            kept = await client.terminal("kept")
        steps, carried, _, _ = server.scheduler._slots[0].owner.step_counts
    assert cancelled["type"] == "cancelled" and cancelled["tokens_after_cancel"] == 0
    assert kept["type"] == "done" and kept["tokens_generated"] == 48
    assert len(client.tokens("kept")) == 48
    # The two generations shared their steps.
    assert carried > steps


def batched_aborts(engine: Engine, slot, count: int, seed: int) -> dict:
    """Cancel ``count`` generations on ``slot`` at random moments while the other
    sequences of its context do the same, and check after each that the cache holds
    exactly the positions the slot's record says."""
    rng = random.Random(seed)
    prompt = engine.encode(messages=[{"role": "user", "content": "Tell me about bread. " * 20}])
    tally = {"cancelled": 0, "finished": 0, "failed": 0, "mismatched_state": 0}
    for n in range(count):
        head = prompt[: rng.randrange(2, len(prompt) + 1)]
        if rng.random() < 0.5:
            slot.forget()
        generation = make_generation(slot, head, max_tokens=256, prefill_chunk=engine.prefill_chunk, seed=n)
        worker = threading.Thread(target=generation.run)
        worker.start()
        time.sleep(rng.uniform(0, 0.2) * UNIT)
        generation.cancel()
        worker.join(60 * UNIT)
        assert not worker.is_alive(), "the loop hung after a cancel"
        exit = generation.result.exit
        tally["cancelled" if exit is _core.ExitKind.CANCELLED else "finished"] += 1
        tally["failed"] += exit is _core.ExitKind.EVAL_FAILED
        tally["mismatched_state"] += slot.kv_positions != slot.n_held
    return tally


@pytest.mark.parametrize("count", [12, pytest.param(STORM_ABORTS // 4, marks=pytest.mark.slow)])
def test_aborts_at_random_moments_in_shared_steps(engine, count):
    # count aborts on each of 4 sequences of one context.
    slots = engine.open_slots(4, Batching.SHARED)
    alone = engine.open_slot()
    prompt = engine.encode(messages=FRANCE)
    try:
        tallies: list[dict] = []
        workers = [
            threading.Thread(target=lambda s=s, i=i: tallies.append(batched_aborts(engine, s, count, i)))
            for i, s in enumerate(slots)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        assert len(tallies) == 4, "a thread failed"
        assert sum(t["mismatched_state"] + t["failed"] for t in tallies) == 0, tallies
        assert sum(t["cancelled"] for t in tallies) >= 3 * count, tallies
        # After the storm, every sequence resumes from what its cache holds, and
        # from an emptied cache generates exactly what a fresh context does. (A
        # resumed prompt is evaluated in batches of other shapes, which llama.cpp's
        # kernels sum differently: random_aborts compares it with a control.)
        expected, _ = greedy(engine, alone, prompt)
        for slot in slots:
            _, resumed = greedy(engine, slot, prompt)
            assert resumed.exit in (_core.ExitKind.EOS, _core.ExitKind.MAX_TOKENS)
            assert slot.kv_positions == slot.n_held
            slot.forget()
            assert greedy(engine, slot, prompt)[0] == expected
    finally:
        for slot in (*slots, alone):
            slot.close()


def test_a_stop_during_the_prompt_ends_inside_an_evaluation(engine, slot):
    prompt = engine.encode(prompt="The history of bread is long. " * 220)
    generation = make_generation(slot, prompt, max_tokens=8, prefill_chunk=engine.prefill_chunk)
    worker = threading.Thread(target=generation.run)
    worker.start()
    started_running(generation)
    time.sleep(0.05 * UNIT)
    generation.cancel()
    worker.join()
    result = generation.result
    assert result.exit is _core.ExitKind.CANCELLED and result.tokens_generated == 0
    assert result.prompt_tokens_evaluated < result.prompt_tokens
    # The piece under way was abandoned, and its positions dropped; the pieces of the
    # chunk that the evaluation finished are kept.
    ubatch = slot.owner.ubatch
    assert 1 < ubatch < engine.prefill_chunk
    assert result.prompt_tokens_evaluated % ubatch == 0
    assert slot.kv_positions == slot.n_held == result.prompt_tokens_evaluated
    # Its work is reported as thrown away: the piece under way, and its share of the time.
    assert result.prompt_tokens_wasted == min(ubatch, result.prompt_tokens - result.prompt_tokens_evaluated)
    assert 0 < result.wasted_eval_ns <= result.end_ns - result.start_ns
    # The chunks before it are kept: a resend evaluates from where the stop came.
    if result.prompt_tokens_evaluated:
        again = make_generation(slot, prompt, max_tokens=1, prefill_chunk=engine.prefill_chunk).run()
        assert again.prompt_tokens_reused == result.prompt_tokens_evaluated


def test_a_stop_keeps_the_pieces_of_its_chunk_that_were_finished(engine):
    # One chunk in pieces of 16: a stop halfway through keeps the pieces before it, and a
    # resend evaluates only the rest, with the answer of a fresh evaluation.
    chunk = engine.prefill_chunk
    slot = _core.LlamaContext(engine.model, 2 * chunk, chunk, engine.threads, ubatch=16).sequences[0]
    try:
        prompt = engine.encode(prompt="The history of bread is long. " * 80)[:chunk]
        begun = time.monotonic()
        expected, cold = greedy(engine, slot, prompt, 12)
        whole = time.monotonic() - begun
        assert cold.prompt_tokens_evaluated == chunk
        slot.forget()
        generation = make_generation(slot, prompt, max_tokens=8, prefill_chunk=chunk)
        worker = threading.Thread(target=generation.run)
        worker.start()
        started_running(generation)
        time.sleep(whole / 2)
        generation.cancel()
        worker.join()
        result = generation.result
        assert result.exit is _core.ExitKind.CANCELLED and result.tokens_generated == 0
        kept = result.prompt_tokens_evaluated
        assert 0 < kept < chunk and kept % 16 == 0
        assert result.prompt_tokens_wasted == 16
        assert slot.kv_positions == slot.n_held == kept
        answer, again = greedy(engine, slot, prompt, 12)
        assert again.prompt_tokens_reused == kept and again.prompt_tokens_evaluated == chunk - kept
        assert answer == expected
    finally:
        slot.close()


async def test_a_base_model_says_so_and_completes_a_chat_as_plain_text(gemma, logs, http):  # noqa: F811
    # Gemma 3 270M is a base model: its file has no chat template. ChatML, which it never saw,
    # filled its answers with <|im_end|>; a chat is now the text of its messages, completed.
    assert gemma.tokenizer.chat_template is None
    async with running_server(gemma) as server:
        # One line at startup says so, and what gives it a template.
        [said] = logs.records("no_chat_template")
        line = ConsoleRenderer()(None, "warning", said)
        assert "\n" not in line and "has no chat template" in line and "--chat-template chatml" in line
        assert logs.records("server_started")[0]["chat_format"] == "plain_text"
        async with http.get(server.http.base_url + "/models") as response:
            assert [m["chat_format"] for m in (await response.json())["data"]] == ["plain_text"]
        text = "The capital of France is Paris. The capital of Italy is"
        common = {"temperature": 0, "max_tokens": 8}
        body = {"messages": [{"role": "user", "content": text}], **common}
        async with http.post(server.http.base_url + "/chat/completions", json=body) as response:
            chat = await response.json()
        async with http.post(server.http.base_url + "/completions", json={"prompt": text, **common}) as response:
            completion = await response.json()
    # The chat's prompt is the text itself, and its answer the completion's.
    assert chat["usage"]["prompt_tokens"] == len(gemma.encode(prompt=text)) == completion["usage"]["prompt_tokens"]
    answer = chat["choices"][0]["message"]["content"]
    assert answer == completion["choices"][0]["text"] and "Rome" in answer
    assert "<|im_" not in answer


def test_gemma_loads_generates_and_resumes_mid_conversation(gemma):
    assert gemma.kind is EngineName.LLAMA_CPP and gemma.abort_mode is AbortMode.IN_STEP
    assert gemma.vocab_size == 262144 and gemma.tokenizer.bos_token == "<bos>"
    prompt = gemma.encode(prompt="The capital of France is")
    assert prompt[0] == gemma.model.special_tokens[0]  # the model wants its bos
    slot, control = gemma.open_slot(), gemma.open_slot()
    try:
        pieces, result = greedy(gemma, slot, prompt)
        assert b"".join(pieces).startswith(b" the capital") and result.tokens_generated == 24
        # A sliding-window model resumes from a prefix (its cache keeps every
        # position), and computes what the same two steps compute on another context.
        longer = gemma.encode(prompt="The capital of France is Paris. The capital of Italy is")
        resumed, again = greedy(gemma, slot, longer)
        greedy(gemma, control, prompt)
        expected, _ = greedy(gemma, control, longer)
        assert again.prompt_tokens_reused == len(prompt) and resumed == expected
        assert slot.kv_positions == slot.n_held
    finally:
        slot.close()
        control.close()


def test_gemmas_sentencepiece_vocabulary_is_rebuilt_as_llama_cpp_tokenizes(gemma):
    # The bench's AIPerf counts Gemma's tokens with this rebuilt tokenizer, which has no merges to read.
    tokenizer = ChatTokenizer.from_gguf(gemma_gguf_path(progress=False))
    docs = (Path(__file__).parent.parent / "docs" / "http.md").read_text("utf-8")
    docs += " 日本語、中文。Ünïcödé ёлка 😀 \x01"
    rng = random.Random(5)
    texts = ["Hello world", "  two  spaces\n\n\tand a tab", "<start_of_turn>user\nHi<end_of_turn>", "<b>x</b>", "   "]
    texts += [docs[a : a + rng.randrange(1, 300)] for a in (rng.randrange(len(docs)) for _ in range(150))]
    for text in texts:
        ids = tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
        assert ids == gemma.model.tokenize(text), text
        assert tokenizer.decode(ids) == text
    assert tokenizer.bos_token == "<bos>" and tokenizer.chat_template is None


def test_a_prefix_a_sliding_window_gave_away_is_evaluated_again(gemma):
    # Gemma 3's sliding-window layers (a 512-token window) keep their cells in
    # one pool for every sequence of a shared context, and llama.cpp hands the
    # cells of a sequence's positions outside its window to whatever comes next.
    words = random.Random(3).choices(["bread", "river", "stone", "garden", "tower", "lamp", "window"], k=1600)

    def tokens(n: int, offset: int = 0) -> list[int]:
        ids = gemma.encode(prompt=" ".join(words[offset : offset + n]))
        assert len(ids) >= n
        return ids[:n]

    slots = gemma.open_slots(2, Batching.SHARED)
    try:
        greedy(gemma, slots[0], tokens(600), max_tokens=1)
        held = tokens(1100)
        greedy(gemma, slots[1], held, max_tokens=1)
        # The first sequence starts again after its first token: its second
        # chunk takes the cells of the other's first positions, out of its window.
        greedy(gemma, slots[0], tokens(1200, offset=1), max_tokens=1)
        # The record still holds the first 700 of the 1100, but the window of the
        # 701st reaches back to positions the cache gave away: nothing is reused.
        prompt = held[:700] + tokens(101, offset=800)[1:]
        expected = reference(gemma, prompt, 8)
        generation = make_generation(slots[1], prompt, max_tokens=8, prefill_chunk=gemma.prefill_chunk, **GREEDY)
        result = generation.run()
        assert exit_outcome(result.exit)[0] == "done" and result.prompt_tokens_reused == 0
        assert result.prompt_tokens_evaluated == len(prompt)
        assert expected.agrees_up_to_a_near_tie(generation.token_ids())
        assert slots[1].kv_positions == slots[1].n_held
    finally:
        for slot in slots:
            slot.close()


def test_a_stream_on_the_llama_engine_reports_like_the_other(engine, slot):
    stream = engine.start(slot, engine.encode(messages=FRANCE), SamplingParams(max_tokens=24, temperature=0))
    text = "".join(stream)
    assert "Paris" in text and exit_outcome(stream.result.exit)[0] == "done"


def run_llama_stopline(*args: str) -> subprocess.CompletedProcess:
    return run_stopline("--engine", "llama.cpp", "--port", "0", "--http-port", "0", *args, timeout=120 * UNIT)


def write_incomplete_llama(path: Path) -> None:
    """A GGUF with a llama architecture, a vocabulary and one tensor: no hyperparameters, no layers."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "c"])
    writer.add_tensor("token_embd.weight", np.zeros((3, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_mamba(path: Path) -> None:
    """A tiny Mamba (a recurrent model llama.cpp loads and runs) with random weights and
    SmolLM2's vocabulary."""
    writer = gguf.GGUFWriter(str(path), "mamba")
    for name, field in read_gguf_metadata(original_gguf_path(progress=False)).fields.items():
        if name.startswith("tokenizer."):
            writer.add_key_value(name, field.contents(), gguf.GGUFValueType(field.value_type), sub_type=(
                None if field.item_type is None else gguf.GGUFValueType(field.item_type)
            ))  # fmt: skip
    width, inner, state, conv, rank, vocab = 16, 32, 4, 4, 2, 49152
    writer.add_context_length(2048)
    writer.add_embedding_length(width)
    writer.add_block_count(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_ssm_conv_kernel(conv)
    writer.add_ssm_inner_size(inner)
    writer.add_ssm_state_size(state)
    writer.add_ssm_time_step_rank(rank)
    random = np.random.default_rng(0)
    # numpy's shapes are ggml's reversed.
    shapes = {
        "token_embd.weight": (vocab, width),
        "output_norm.weight": (width,),
        "blk.0.attn_norm.weight": (width,),
        "blk.0.ssm_in.weight": (2 * inner, width),
        "blk.0.ssm_conv1d.weight": (inner, conv),
        "blk.0.ssm_conv1d.bias": (inner,),
        "blk.0.ssm_x.weight": (rank + 2 * state, inner),
        "blk.0.ssm_dt.weight": (inner, rank),
        "blk.0.ssm_dt.bias": (inner,),
        "blk.0.ssm_a": (inner, state),
        "blk.0.ssm_d": (inner,),
        "blk.0.ssm_out.weight": (width, inner),
    }
    for name, shape in shapes.items():
        writer.add_tensor(name, random.standard_normal(shape, dtype=np.float32) * 0.1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_recurrent_model_loads_in_llama_cpp_and_is_refused_by_name(tmp_path):
    # Stopping mid-prompt cuts a sequence's cache back to a position, which a recurrent state cannot be.
    path = tmp_path / "mamba.gguf"
    write_mamba(path)
    with pytest.raises(ModelFileError, match="recurrent or hybrid model") as refused:
        Engine.load(path, progress=False)
    assert "llama.cpp cannot load it" not in str(refused.value)  # llama.cpp could: Stopline refused it


@pytest.mark.slow
@pytest.mark.parametrize(
    "make, problem",
    [
        (lambda p: p.write_text("not a model"), "not a GGUF file"),
        (lambda p: p.write_bytes(b"GGUF" + (1).to_bytes(4, "little")), "GGUF version 1 is not supported"),
        (
            lambda p: p.write_bytes(original_gguf_path(progress=False).read_bytes()[: 40 << 20]),
            "the file is truncated",
        ),
        # Well formed, of a known architecture, but not a model llama.cpp can build.
        (lambda p: write_incomplete_llama(p), "llama.cpp cannot load it"),
    ],
    ids=["text", "gguf-v1", "truncated", "incomplete"],
)
def test_a_file_llama_cpp_cannot_load_is_one_line_and_status_2(tmp_path, make, problem):
    path = tmp_path / "model.gguf"
    make(path)
    finished = run_llama_stopline("--model", str(path))
    assert finished.returncode == 2, finished.stderr
    [line] = [line for line in finished.stderr.splitlines() if line.startswith("stopline:")]
    assert problem in line and "Traceback" not in finished.stderr


def test_model_type_is_refused_with_the_llama_engine():
    finished = run_llama_stopline("--model-type", "gpt2")
    assert finished.returncode == 2 and "--model-type" in finished.stderr
