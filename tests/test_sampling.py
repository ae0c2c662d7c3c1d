"""What the native sampler does with OpenAI's sampling fields, on both engines, checked
against the logits the loop itself sampled from."""

from __future__ import annotations

import numpy as np
import pytest

from stopline._core import ExitKind
from support import make_generation

pytestmark = pytest.mark.both_engines(why="each engine samples with its own code")

COUNTING = "1, 2, 1, 2, 1, 2, 1, 2, 1, 2,"


@pytest.fixture
def slot(engine):
    slot = engine.open_slot()
    yield slot
    slot.close()


def logits_of(slot) -> np.ndarray:
    raw = slot.last_logits()
    assert raw is not None
    return np.frombuffer(raw, dtype=np.float32).astype(np.float64)


def greedy_run(slot, prompt: list[int], max_tokens: int, **sampling):
    # Prefill one token at a time: every position is then computed exactly as a decode step computes it.
    generation = make_generation(slot, prompt, max_tokens=max_tokens, temperature=0, prefill_chunk=1, **sampling)
    result = generation.run()
    return generation.token_ids(), result, logits_of(slot)


@pytest.mark.parametrize(("frequency", "presence"), [(0.7, 0.4), (-0.5, 1.5), (2.0, 0.0)])
def test_penalties_follow_openais_definition(engine, slot, frequency, presence):
    prompt = engine.encode(prompt=COUNTING)
    tokens, result, penalized = greedy_run(
        slot, prompt, 8, frequency_penalty=frequency, presence_penalty=presence, repetition_penalty=1.0
    )
    # The last draw saw every published token but the one it drew (an end of generation is not published).
    counted = tokens if result.exit == ExitKind.EOS else tokens[:-1]
    assert counted, "the generation ended before any token counted"
    slot.forget()
    _, _, raw = greedy_run(slot, prompt + counted, 1, repetition_penalty=1.0)
    expected = raw.copy()
    for token in set(counted):
        expected[token] -= counted.count(token) * frequency + presence
    assert np.max(np.abs(penalized - expected)) < 1e-4
    if result.exit != ExitKind.EOS:
        assert tokens[-1] == int(np.argmax(penalized))


def test_no_penalty_leaves_the_logits_as_the_model_computed_them(engine, slot):
    prompt = engine.encode(prompt=COUNTING)
    tokens, _, logits = greedy_run(slot, prompt, 4, repetition_penalty=1.0)
    slot.forget()
    _, _, raw = greedy_run(slot, prompt + tokens[:-1], 1, repetition_penalty=1.0)
    assert np.max(np.abs(logits - raw)) < 1e-4


def test_a_frequency_penalty_changes_what_greedy_decoding_says(engine, slot):
    prompt = engine.encode(prompt=COUNTING)
    plain, _, _ = greedy_run(slot, prompt, 12, repetition_penalty=1.0)
    slot.forget()
    penalized, _, _ = greedy_run(slot, prompt, 12, repetition_penalty=1.0, frequency_penalty=2.0)
    # Unpenalized, the model repeats itself; penalized, no token is drawn as often.
    assert max(penalized.count(t) for t in penalized) < max(plain.count(t) for t in plain)


# The repetition penalty looks this far back, the prompt's tokens included (_core.pyx's LAST_N_TOKENS).
PENALTY_WINDOW = 64


def penalized(logits: np.ndarray, context: list[int], window: int) -> np.ndarray:
    """llama.cpp's repetition penalty (2.0) over the context's last ``window`` tokens."""
    out = logits.copy()
    for token in set(context[-window:]):
        out[token] = out[token] * 2.0 if out[token] <= 0 else out[token] / 2.0
    return out


def test_the_repetition_penalty_is_llama_cpps_over_the_last_64_tokens(engine, slot):
    # " Paris" comes more than 64 tokens before the question it answers: outside the window.
    text = "I was born in Paris. " + "One, two, three, four, five, six, seven, eight, nine, ten. " * 4
    prompt = engine.encode(prompt=text + "The capital of France is")
    tokens, _, _ = greedy_run(slot, prompt, 6, repetition_penalty=2.0)
    changed = window_mattered = 0
    for step, token in enumerate(tokens):
        slot.forget()
        context = prompt + tokens[:step]
        _, _, raw = greedy_run(slot, context, 1, repetition_penalty=1.0)
        expected = int(np.argmax(penalized(raw, context, PENALTY_WINDOW)))
        assert token == expected, f"step {step}"
        changed += expected != int(np.argmax(raw))
        window_mattered += expected != int(np.argmax(penalized(raw, context, 2 * PENALTY_WINDOW)))
    # Otherwise the prompt would not test the penalty, or its window.
    assert changed and window_mattered


def log_softmax(logits: np.ndarray) -> np.ndarray:
    top = logits.max()
    return logits - (top + np.log(np.exp(logits - top).sum()))


def test_logprobs_are_the_log_softmax_of_the_loops_own_logits(engine, slot):
    prompt = engine.encode(prompt=COUNTING)
    generation = make_generation(
        slot, prompt, max_tokens=4, temperature=0.9, seed=3, repetition_penalty=1.0, logprobs=20
    )
    result = generation.run()
    tokens = generation.token_ids()
    found = generation.logprobs(0, len(tokens))
    assert found is not None and len(found) == len(tokens) == result.tokens_generated
    if result.exit == ExitKind.EOS:
        pytest.skip("the last draw was the end of generation, which has no entry")
    # The slot still holds the logits the last token was drawn from.
    expected = log_softmax(logits_of(slot))
    chosen, top = found[-1]
    assert abs(chosen - expected[tokens[-1]]) < 1e-4
    assert len(top) == 20
    values = [value for _, value in top]
    assert values == sorted(values, reverse=True)
    for token, value in top:
        assert abs(value - expected[token]) < 1e-4
    # They are the 20 best: none left out is better than the last one in.
    assert np.sort(expected)[-20] <= values[-1] + 1e-4
    # Asked for no alternatives, each token still has its own.
    slot.forget()
    generation = make_generation(slot, prompt, max_tokens=2, temperature=0, logprobs=0)
    generation.run()
    assert all(top == [] and value <= 0 for value, top in generation.logprobs(0, len(generation.token_ids())))
    assert make_generation(slot, prompt, max_tokens=2).logprobs(0, 0) is None


def test_a_logit_bias_is_added_to_its_tokens_logits(engine, slot):
    prompt = engine.encode(prompt=COUNTING)
    _, _, raw = greedy_run(slot, prompt, 1, repetition_penalty=1.0)
    likeliest, runner_up = (int(t) for t in np.argsort(raw)[::-1][:2])
    bias = ((likeliest, -3.5), (runner_up, 2.0), (0, 7.0))
    slot.forget()
    [token], _, biased = greedy_run(slot, prompt, 1, repetition_penalty=1.0, logit_bias=bias)
    expected = raw.copy()
    for t, amount in bias:
        expected[t] += amount
    assert np.max(np.abs(biased - expected)) < 1e-4
    assert token == int(np.argmax(expected))
    # A large bias makes a token the only one greedy decoding draws.
    slot.forget()
    tokens, result, _ = greedy_run(slot, prompt, 5, repetition_penalty=1.0, logit_bias=((runner_up, 100.0),))
    assert tokens == [runner_up] * 5 and result.exit == ExitKind.MAX_TOKENS


def test_ignore_eos_never_draws_an_end_of_generation_token(engine, slot):
    ends = slot.end_tokens()
    assert 0 < len(ends) < 100
    prompt = engine.encode(prompt=COUNTING)
    # Biased to be certain, the end comes at once...
    forced = tuple((t, 100.0) for t in ends)
    tokens, result, _ = greedy_run(slot, prompt, 6, logit_bias=forced)
    assert tokens == [] and result.exit == ExitKind.EOS
    # ...unless the request ignores it: then the answer runs to max_tokens, at temperature 0 and above.
    for temperature in (0, 1.0):
        slot.forget()
        generation = make_generation(
            slot, prompt, max_tokens=6, temperature=temperature, prefill_chunk=1, logit_bias=forced, ignore_eos=True
        )
        result = generation.run()
        assert result.exit == ExitKind.MAX_TOKENS and len(generation.token_ids()) == 6
        assert not set(generation.token_ids()) & set(ends)
        assert np.all(np.isneginf(logits_of(slot)[list(ends)]))


@pytest.mark.parametrize("kept", [2, 12])
def test_min_p_drops_the_tokens_under_its_share_of_the_likeliest(engine, slot, kept):
    prompt = engine.encode(prompt="Once upon a time, there was a")
    _, _, raw = greedy_run(slot, prompt, 1, repetition_penalty=1.0)
    # Each token's probability as a share of the likeliest one's; min_p halfway between
    # the shares of the last token to keep and the first to drop.
    share = np.exp(raw - raw.max())
    ranked = np.sort(share)[::-1]
    min_p = float(np.sqrt(ranked[kept - 1] * ranked[kept]))
    slot.forget()
    generation = make_generation(
        slot, prompt, max_tokens=1, temperature=1.0, top_k=0, top_p=1.0, min_p=min_p, prefill_chunk=1
    )
    generation.run()
    after = logits_of(slot)
    dropped = share < min_p
    assert (~dropped).sum() == kept
    assert np.all(np.isneginf(after[dropped]))
    assert np.max(np.abs(after[~dropped] - raw[~dropped])) < 1e-4
    assert generation.token_ids()[0] in np.flatnonzero(~dropped)
