"""The bench's abort storm on the llama.cpp engine (bench/inprocess/llama_native.py):
how it tells a run that parted from the fresh one at a near-tie from a real difference."""

from __future__ import annotations

from bench.inprocess.llama_native import NEAR_TIE_LOGPROB, Greedy, storm
from bench.inprocess.random_llama import random_llama_path

TIE = NEAR_TIE_LOGPROB / 2
CLEAR = NEAR_TIE_LOGPROB * 10


def test_runs_that_agree_have_not_parted():
    assert Greedy([1, 2, 3], [CLEAR] * 3).parted_from(Greedy([1, 2, 3], [TIE] * 3)) is None


def test_a_run_parting_where_either_run_had_a_near_tie_is_a_near_tie():
    fresh = Greedy([1, 2, 3], [CLEAR, TIE, CLEAR])
    assert fresh.parted_from(Greedy([1, 5, 6], [CLEAR, CLEAR, CLEAR])) == "near_ties"
    assert Greedy([1, 2, 3], [CLEAR] * 3).parted_from(Greedy([1, 5, 6], [CLEAR, TIE, CLEAR])) == "near_ties"


def test_a_run_parting_where_both_were_clear_is_a_mismatch():
    fresh = Greedy([1, 2, 3], [TIE, CLEAR, TIE])
    assert fresh.parted_from(Greedy([1, 5, 3], [TIE, CLEAR, TIE])) == "mismatches"


def test_a_run_ending_early_parts_where_the_longer_one_goes_on():
    fresh = Greedy([1, 2, 3], [CLEAR, CLEAR, TIE])
    assert fresh.parted_from(Greedy([1, 2], [CLEAR, CLEAR])) == "near_ties"
    assert Greedy([1, 2, 3], [CLEAR] * 3).parted_from(Greedy([1], [CLEAR])) == "mismatches"


def test_a_short_storm_on_shared_steps_accounts_for_every_abort():
    counts = storm(random_llama_path(2), cycles=12, streams=4, seed=3)
    assert counts["cancelled"] + counts["done"] + counts["other"] == 12
    assert counts["hangs"] == counts["kv_mismatches"] == counts["mismatches"] == counts["other"] == 0
    assert len(counts["cancel_to_exit_ms"]) == counts["cancelled"]
