"""python -m bench aiperf, without AIPerf: the command line it builds, and what it reads from
AIPerf's JSON export (``tests/data/aiperf_export.json``, a real AIPerf 0.13.0 run's summary
against Stopline, cut to the metrics the report reads) into the report's rows and tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import aiperf
from bench.aiperf import LLAMA_SERVER, STOPLINE, Profile, levels, parse_export, profile_command, tables, turns

EXPORT = Path(__file__).parent / "data" / "aiperf_export.json"
# What the report takes from it, as AIPerf's own console summary of that run showed it: 5 requests
# at concurrency 2 with 30% cancelled, on a machine busy with other work; 2 ran to their end,
# AIPerf cancelled 1, and 2 reached Stopline's first-token deadline (AIPerf's
# InvalidInferenceResultError: the stream ended with no content).
EXPECTED = {
    "output_tokens_per_s": 0.6182408754870644,
    "ttft_p50_ms": 39110.521038499995,
    "ttft_p99_ms": 47223.79921829,
    "itl_p50_ms": 616.4494608015873,
    "requests_per_s": 0.009660013679485381,
    "goodput_per_s": None,
    "completed": 2,
    "cancelled": 1,
    "errors": 2,
    "output_tokens_per_request": 64.0,
    "duration_s": 86.748099072,
}


def flag(command: list[str], name: str) -> str:
    """The value after ``name``; KeyError where it is absent."""
    if name not in command:
        raise KeyError(name)
    return command[command.index(name) + 1]


def test_the_profile_the_issue_asks_for() -> None:
    profile = Profile(
        url="http://127.0.0.1:8766",
        model="SmolLM2-135M-Instruct",
        tokenizer=Path("/tmp/tok"),
        concurrency=8,
        requests=100,
        warmup=2,
        artifact_dir=Path("/tmp/out/stopline/c8"),
    )
    command = profile_command("/venv/bin/aiperf", profile)
    assert command[:2] == ["/venv/bin/aiperf", "profile"]
    assert flag(command, "--endpoint-type") == "chat" and "--streaming" in command
    assert flag(command, "--url") == "http://127.0.0.1:8766"  # AIPerf adds /v1/chat/completions
    assert flag(command, "--model") == "SmolLM2-135M-Instruct"
    assert flag(command, "--tokenizer") == "/tmp/tok"
    assert flag(command, "--concurrency") == "8"
    assert flag(command, "--request-count") == "100"
    # Paced: AIPerf's sender sleeps between attempts instead of polling for a free slot.
    assert flag(command, "--request-rate") == "200" and flag(command, "--arrival-pattern") == "constant"
    assert flag(command, "--warmup-request-count") == "2"
    assert flag(command, "--synthetic-input-tokens-mean") == "200"
    assert flag(command, "--synthetic-input-tokens-stddev") == "0"
    assert flag(command, "--output-tokens-mean") == "64"
    assert flag(command, "--output-tokens-stddev") == "0"
    assert flag(command, "--extra-inputs") == "ignore_eos:true"
    assert flag(command, "--artifact-dir") == "/tmp/out/stopline/c8"
    assert flag(command, "--ui") == "none"
    assert "--request-cancellation-rate" not in command and "--goodput" not in command


def test_cancellation_and_goodput_are_passed_on() -> None:
    profile = Profile(
        url="http://127.0.0.1:1",
        model="m",
        tokenizer=Path("t"),
        concurrency=4,
        requests=10,
        artifact_dir=Path("a"),
        cancellation_rate=30.0,
        cancellation_delay_s=0.5,
        goodput="time_to_first_token:500 inter_token_latency:50",
    )
    command = profile_command("aiperf", profile)
    assert flag(command, "--request-cancellation-rate") == "30"
    assert flag(command, "--request-cancellation-delay") == "0.5"
    assert command[command.index("--goodput") + 1 :][:2] == ["time_to_first_token:500", "inter_token_latency:50"]
    assert "--warmup-request-count" not in command  # no warm-up asked for


def test_levels_run_both_servers_before_the_next_in_alternating_order() -> None:
    assert levels([1, 4], [4], 30.0) == [(1, None), (4, None), (4, 30.0)]
    assert levels([1, 4], [4], 0.0) == [(1, None), (4, None)]
    assert [turns(i) for i in range(3)] == [
        (STOPLINE, LLAMA_SERVER),
        (LLAMA_SERVER, STOPLINE),
        (STOPLINE, LLAMA_SERVER),
    ]


def test_the_export_is_read_into_a_row() -> None:
    row = parse_export(json.loads(EXPORT.read_text()))
    assert row == pytest.approx(EXPECTED)


def test_missing_metrics_are_none_not_zero() -> None:
    row = parse_export({"request_count": {"unit": "requests", "avg": 3}})
    assert row["completed"] == 3 and row["errors"] == 0 and row["cancelled"] == 0
    assert row["output_tokens_per_s"] is None and row["ttft_p50_ms"] is None and row["goodput_per_s"] is None


def test_the_tables_show_each_server_and_their_ratio() -> None:
    ours = parse_export(json.loads(EXPORT.read_text()))
    theirs = {k: (v * 2 if isinstance(v, float) else v) for k, v in ours.items()}
    rows = [
        {"server": STOPLINE, "concurrency": 2, "cancellation_rate": 30.0} | ours,
        {"server": LLAMA_SERVER, "concurrency": 2, "cancellation_rate": 30.0} | theirs,
    ]
    markdown = tables(rows)
    assert "### With 30% of requests cancelled" in markdown
    assert "### Every request to its end" not in markdown  # no such runs
    assert "| 2 | stopline |" in markdown and "| 2 | llama-server |" in markdown
    assert markdown.index("| 2 | stopline |") < markdown.index("| 2 | llama-server |")
    ratio_line = next(line for line in markdown.splitlines() if line.startswith("| 2, 30% cancelled |"))
    assert ratio_line.count("0.50") == 5, ratio_line
    assert aiperf.fmt(ours["output_tokens_per_s"]) in markdown


def test_each_level_gets_new_prompts_and_both_servers_the_same() -> None:
    args = aiperf.parse_args(["--llama-server", "/bin/true", "--seed", "5"])
    plans = [
        aiperf.plan_profile(args, f"http://{server}", "m", Path("t"), Path("o"), c, rate, level)
        for level, (c, rate) in enumerate(levels(args.concurrency, args.cancel_concurrency, args.cancellation_rate))
        for server in turns(level)
    ]
    seeds = [p.seed for p in plans]
    assert seeds[0] == seeds[1] == 5  # both servers at the first level
    assert len(set(seeds)) == len(plans) // 2  # a seed of its own at every level
