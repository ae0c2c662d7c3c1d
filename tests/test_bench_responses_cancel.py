"""The bench's Responses cancel against DELETE (bench/responses_cancel.py): its arguments and its
report, from samples made up here; the measurement itself runs as ``python -m bench responses-cancel``."""

from __future__ import annotations

import pytest

from bench.responses_cancel import DELETE, RESPONSES, field_differences, parse_args, section, stop_table

RECORD = ["cancel_latency_ms", "event", "reason", "request_id", "tokens_after_cancel"]
FRAME = ["cancel_latency_ms", "id", "reason", "tokens_after_cancel", "type"]


def sample(kind: str, server_ms: float, status: str = "cancelled", **changed) -> dict:
    return {
        "kind": kind,
        "status": status,
        "reason": "user_cancelled" if status == "cancelled" else "max_tokens",
        "server_ms": server_ms,
        "frame_server_ms": server_ms,
        "client_ms": server_ms + 2,
        "tokens_after_cancel": 0,
        "record_fields": RECORD,
        "frame_fields": FRAME,
    } | changed


def results(samples: list[dict]) -> dict:
    meta = {
        "command": "python -m bench responses-cancel --rounds 2",
        "machine": {"cpu": "Some CPU", "cores_available": 2},
        "cpus": [0, 1],
        "rounds": 2,
        "seconds": 3.0,
        "max_output_tokens": 300,
        "max_delay_ms": 500,
        "load_average_start": [2.5, 2, 2],
        "load_average_end": [3.0, 2, 2],
        "server": {"model": "SmolLM2-135M-Instruct"},
    }
    return {"meta": meta, "samples": samples}


def test_the_arguments_default_to_a_hundred_rounds_on_every_core_and_refuse_nonsense():
    args = parse_args([])
    assert (args.rounds, args.max_output_tokens, args.max_delay_ms) == (100, 300, 500)
    assert args.cpu_set and not args.results_md
    assert parse_args(["--rounds", "3", "--cpus", "0,1"]).cpu_set == frozenset({0, 1})
    with pytest.raises(SystemExit):
        parse_args(["--rounds", "0"])


def test_the_table_has_a_row_per_kind_with_the_server_figures_of_the_cancelled_ones_only():
    samples = [sample(RESPONSES, ms) for ms in (0.1, 0.2, 0.3)] + [sample(DELETE, ms) for ms in (0.4, 1.5)]
    samples.append(sample(DELETE, 99.0, status="incomplete", tokens_after_cancel=None))
    header, _, responses, delete = stop_table(samples).splitlines()
    assert header.startswith("| stopped by | n | cancelled | server p50 (ms) | p90 | p99 | max |")
    assert responses.split(" | ")[1:4] == ["3", "3", "0.200"] and responses.endswith("| 0.300 | 0 | 2.20 | 2.30 | 0 |")
    assert delete.split(" | ")[1:3] == ["3", "2"] and "| 1.50 | 1 | 2.95 |" in delete and "99.0" not in delete


def test_the_section_says_whether_both_kinds_end_with_the_same_fields():
    alike = [sample(RESPONSES, 0.2), sample(DELETE, 0.3)]
    assert field_differences(alike) == {"record_fields": [], "frame_fields": []}
    text = section(results(alike))
    assert text.startswith("## Responses cancel against DELETE\n")
    assert "load average 2.5/3.0" in text and "same fields" in text and "user_cancelled" in text
    unlike = [sample(RESPONSES, 0.2, frame_fields=FRAME[:-1]), sample(DELETE, 0.3)]
    assert field_differences(unlike) == {"record_fields": [], "frame_fields": ["type"]}
    assert "different fields: frame: type." in section(results(unlike))
