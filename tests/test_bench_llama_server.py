"""The benchmark's llama-server driver, under the scenarios written once for every server,
against a stand-in that speaks its HTTP API (``tests/fake_llama_server.py``): a real process,
real sockets on port 0, llama-server's streaming format and log lines. The real llama-server
is never built here."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from bench.drivers.llama_server import LlamaServerDriver
from bench.prompts import PromptMaker
from bench.report import LLAMA, OURS, OURS_LLAMA, Report, write_results_section
from bench.run import parse_args
from bench.scenarios import (
    BUSY_MAX_TOKENS,
    CONCURRENT_STREAMS,
    DECODE_CONCURRENT,
    DISCONNECT_BUSY,
    NONSTREAM,
    TURNS,
    Bench,
    Plan,
    share,
    share_range,
)
from stopline.engine import model as embedded

FAKE = Path(__file__).with_name("fake_llama_server.py")
SLOTS = 2


@pytest.fixture(scope="module")
def prompts() -> PromptMaker:
    return PromptMaker(embedded.embedded_tokenizer(progress=False), random.Random(1))


async def start_fake(tmp_path: Path, slots: int):
    accounts = tmp_path / "accounts.jsonl"
    binary = tmp_path / "llama-server"
    binary.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" --accounts "{accounts}" "$@"\n')
    binary.chmod(0o755)
    tokenizer = embedded.embedded_tokenizer(progress=False)
    driver = LlamaServerDriver(
        binary,
        tmp_path / "model.gguf",
        tmp_path,
        slots=slots,
        threads=1,
        context_length=2048,
        tokenize=lambda messages: tokenizer.encode(tokenizer.render_chat(messages)),
    )
    return await driver.start(), accounts


@pytest.fixture
async def peer(tmp_path):
    driver, accounts = await start_fake(tmp_path, SLOTS)
    yield driver, accounts
    await driver.stop()


@pytest.fixture
async def wide_peer(tmp_path):
    driver, accounts = await start_fake(tmp_path, CONCURRENT_STREAMS)
    yield driver, accounts
    await driver.stop()


def small_plan(**fields) -> Plan:
    """A plan of short runs; ``fields`` override its defaults."""
    defaults = dict(
        requests=1,
        long_requests=1,
        duration_s=None,
        short_tokens=50,
        long_tokens=300,
        concurrency=None,
        throughput_reps=1,
        decode_tokens=16,
        parallel=1,
    )
    return Plan(**{**defaults, **fields})


def bench_for(prompts: PromptMaker, requests: int) -> Bench:
    plan = small_plan(requests=requests, long_requests=requests, throughput_reps=2)
    return Bench(plan, prompts, random.Random(2))


def ends(accounts: Path) -> list[dict]:
    return [json.loads(line) for line in accounts.read_text().splitlines()]


def test_serves_the_same_model_context_slots_and_threads(tmp_path):
    driver = LlamaServerDriver(
        Path("/bin/llama-server"), Path("/m.gguf"), tmp_path, slots=3, threads=2, context_length=2048
    )
    command = driver.command()

    def value(flag):
        return command[command.index(flag) + 1]

    assert value("--model") == "/m.gguf" and value("--port") == "0"
    assert value("--parallel") == "3" and value("--threads") == "2" and value("--threads-batch") == "2"
    # The context is per slot, as in ours: the KV pool holds one context per slot, not shared.
    assert value("--ctx-size") == str(3 * 2048) and "--no-kv-unified" in command
    assert "--slots" in command


async def test_stops_by_closing_the_stream_and_counts_tokens_from_the_release_line(peer, prompts):
    target, accounts = peer
    bench = bench_for(prompts, requests=3)
    calibration = await bench.calibrate(target)
    assert set(calibration["prefill_ms"]) == {50, 300} and calibration["step_ms"] > 0
    await bench.run("decode", target)
    await bench.run("disconnect", target)
    decode = [s for s in bench.samples if s["scenario"] == "decode"]
    disconnect = [s for s in bench.samples if s["scenario"] == "disconnect"]
    assert len(decode) == 3 and len(disconnect) == 3
    # The three calibration requests ran to their end; every later one was stopped by its client.
    real = [e for e in ends(accounts)][3:]
    assert len(real) == 6 and all(e["client_gone"] and e["stream"] for e in real)
    for sample, end in zip(decode + disconnect, real):
        assert sample["outcome"] == "cancelled" and not sample["ran_to_end"]
        assert sample["tokens_generated"] == end["generated"]
        assert sample["tokens_wasted"] == sample["prompt_tokens_evaluated"] + end["generated"]
        assert sample["tokens_after_cancel"] == end["generated"] - sample["token_frames"] >= 0
        assert sample["token_frames"] >= sample["cancel_after_frames"]
        assert sample["client_ms"] > 0 and sample["slots_confirm_ms"] >= sample["client_ms"]
    assert {s["reason"] for s in decode} == {"stream_closed"}
    assert {s["reason"] for s in disconnect} == {"client_disconnected"}
    assert [r["valid"] for r in bench.runs] == [3, 3]


@pytest.mark.slow
async def test_a_non_streaming_request_that_never_notices_runs_to_its_end(peer, prompts):
    target, accounts = peer
    bench = bench_for(prompts, requests=2)
    await bench.calibrate(target, long=False)
    await bench.run(NONSTREAM, target)
    await bench.run(DISCONNECT_BUSY, target)
    await target.wait_idle()  # the background stream's end is logged once its slot is free
    samples = [s for s in bench.samples if s["scenario"] in (NONSTREAM, DISCONNECT_BUSY)]
    assert [s["scenario"] for s in samples] == [NONSTREAM] * 2 + [DISCONNECT_BUSY] * 2
    for sample in samples:
        assert sample["ran_to_end"] and sample["outcome"] == "done"
        assert sample["tokens_generated"] == BUSY_MAX_TOKENS and sample["token_frames"] == 0
    measured = [e for e in ends(accounts) if not e["stream"]]
    assert len(measured) == 4 and all(e["client_gone"] and e["generated"] == BUSY_MAX_TOKENS for e in measured)
    # In the busy scenario another client streamed on the other slot the whole time.
    assert {e["slot"] for e in measured[2:]} == {1}
    assert any(e["stream"] and e["slot"] == 0 and e["client_gone"] for e in ends(accounts))


async def test_throughput_reads_the_stream_and_its_timings(peer, prompts):
    target, accounts = peer
    bench = bench_for(prompts, requests=1)
    await bench.calibrate(target, long=False)
    await bench.run("throughput", target)
    samples = [s for s in bench.samples if s["scenario"] == "throughput"]
    assert sorted(s["streams"] for s in samples) == [1, 1, 2, 2, 2, 2]
    for sample in samples:
        assert sample["outcome"] == "done" and sample["tokens"] == 16
        assert sample["ttft_client_ms"] > 0 and sample["tokens_per_s_client"] > 0
        assert sample["tokens_per_s_server"] > 0 and sample["aggregate_tokens_per_s"] > 0
    # Scenarios it cannot take part in take no samples and send nothing.
    before = len(ends(accounts))
    await bench.run("queued", target)
    assert len(ends(accounts)) == before and len(bench.runs) == 1


async def test_takes_part_in_prompt_speed_multi_turn_and_the_4_stream_cancel(wide_peer, prompts):
    target, accounts = wide_peer
    bench = bench_for(prompts, requests=2)
    await bench.calibrate(target, long=True)
    for scenario in ("prefill_speed", "multi_turn", "decode_after_token", DECODE_CONCURRENT):
        await bench.run(scenario, target)
    counts = {s["scenario"]: 0 for s in bench.samples}
    for sample in bench.samples:
        counts[sample["scenario"]] += 1
    assert counts == {"prefill_speed": 2, "multi_turn": 2 * TURNS, "decode_after_token": 2, DECODE_CONCURRENT: 2}
    assert all(s["prompt_tokens_per_s"] > 0 for s in bench.samples if s["scenario"] == "prefill_speed")
    assert {s["turn"] for s in bench.samples if s["scenario"] == "multi_turn"} == set(range(1, TURNS + 1))
    for sample in (s for s in bench.samples if s["scenario"] == DECODE_CONCURRENT):
        assert sample["outcome"] == "cancelled" and sample["streams"] == CONCURRENT_STREAMS
        # The other streams ran to their end: they lost nothing.
        assert sample["others_lost_tokens"] == 0 and sample["others_not_done"] == 0


def test_engines_and_binary_flags():
    args = parse_args(["--engines", "ours,baseline,llama-server", "--llama-server", "/x/llama-server"])
    assert args.engines.split(",") == ["ours", "baseline", "llama-server"]
    assert parse_args(["--engines", "llama-server", "--build-llama-server"]).build_llama_server
    for bad in (["--engines", "llama-server"], ["--engines", "ours,vllm"], ["--engines", "ours,ours"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_gemma_runs_only_the_engines_that_can_load_it():
    args = parse_args(["--model", "gemma3", "--engines", "ours,ours_llama,llama-server", "--build-llama-server"])
    assert args.engines == "ours_llama,llama-server" and args.skipped == ["ours"]
    with pytest.raises(SystemExit):
        parse_args(["--model", "gemma3", "--engines", "ours,baseline"])
    assert parse_args(["--cpus", "0,1"]).cpu_set == frozenset({0, 1})


def test_samples_split_into_parts_that_add_up():
    for total in (0, 1, 5, 10):
        assert sum(share(total, part, 3) for part in range(3)) == total
        assert [r for part in range(3) for r in share_range(total, part, 3)] == list(range(total))
    plan = small_plan(streams=())
    assert plan.stream_counts(2) == [1, 2] and plan.stream_counts(4) == [1, 4]
    assert small_plan(streams=(4,)).stream_counts(4) == [4] and small_plan(streams=(4,)).stream_counts(2) == []


def test_each_model_keeps_its_own_section_of_the_results(tmp_path):
    path = tmp_path / "RESULTS.md"
    write_results_section(path, "smollm2", "## SmolLM2\n\nSECTION-ONE\n")
    write_results_section(path, "gemma3", "## Gemma\n\nSECTION-TWO\n")
    write_results_section(path, "smollm2", "## SmolLM2\n\nSECTION-AGAIN\n")
    text = path.read_text()
    assert text.startswith("# Stopline benchmark results")
    assert "SECTION-AGAIN" in text and "SECTION-ONE" not in text and "SECTION-TWO" in text
    assert text.index("SECTION-AGAIN") < text.index("SECTION-TWO")
    # A new section may follow the one it belongs to; rewritten, it stays where it is.
    write_results_section(path, "smollm2-in-process", "STORMS-ONE\n", after="smollm2")
    write_results_section(path, "smollm2", "## SmolLM2\n\nSECTION-THREE\n")
    write_results_section(path, "smollm2-in-process", "STORMS-TWO\n", after="smollm2")
    text = path.read_text()
    assert text.index("SECTION-THREE") < text.index("STORMS-TWO") < text.index("SECTION-TWO")
    assert "STORMS-ONE" not in text and text.count("<!-- results:") == 3


def test_report_puts_llama_server_beside_ours_and_says_where_it_is_better():
    def stop(scenario, target, ms, **extra):
        return {
            "scenario": scenario,
            "target": target,
            "client_ms": ms,
            "server_ms": None,
            "tokens_after_cancel": 0,
            "frames_after_cancel": 0,
            **extra,
        }

    def rate(target, tok_s, ttft):
        return {
            "scenario": "throughput",
            "target": target,
            "streams": 1,
            "rep": 0,
            "tokens": 64,
            "tokens_per_s_client": tok_s,
            "tokens_per_s_server": tok_s,
            "aggregate_tokens_per_s": tok_s,
            "ttft_client_ms": ttft,
            "ttft_server_ms": ttft,
        }

    samples = [
        stop("prefill_long", OURS, 8.0),
        stop("prefill_long", LLAMA, 4000.0),
        stop("decode", OURS, 10.0),
        stop("decode", LLAMA, 5.0),
        stop(DISCONNECT_BUSY, OURS, 9.0),
        stop(DISCONNECT_BUSY, LLAMA, 3000.0, ran_to_end=True),
        rate(OURS, 80.0, 400.0),
        rate(LLAMA, 160.0, 200.0),
    ]
    calibration = {"prefill_ms": {"50": 400.0, "1500": 15000.0}, "step_ms": 11.0}
    results = {
        "meta": {
            "plan": {"short_tokens": 50, "long_tokens": 1500},
            "targets": {
                OURS: {"calibration": calibration},
                LLAMA: {"calibration": {"prefill_ms": {"50": 200.0, "1500": 3000.0}}},
            },
        },
        "samples": samples,
        "runs": [],
        "lag": {},
    }
    text = Report(results).markdown()
    assert "### Against llama-server" in text and "|  | ours | llama-server | llama-server/ours |" in text
    headline = text.split("### Calibration")[0]
    assert "| stop during a ~1,500-token prompt, client p50 ms | 8.00 | 4000 | **500×** |" in headline
    assert "| stop at a random phase of decode, client p50 ms | 10.0 | 5.00 | **0.50×** |" in headline
    assert "| decode tok/s, 1 stream, p50 (client) | 80.0 | 160 | **2.00×** |" in headline
    # No prompt-speed samples: the calibrated prefill of the long prompt gives the rate.
    assert "| prompt tok/s, ~1,500-token prompt | 100 | 500 | **5.00×** |" in headline
    # Figures no engine has (here the multi-turn chat) are left out.
    assert "multi-turn TTFT" not in headline
    better = headline.split("llama-server is better at: ")[1].split(". ")[0]
    assert better == (
        "decode tok/s, 1 stream, p50 (client) (2.00×); prompt tok/s, ~1,500-token prompt (5.00×); "
        "time to first token, 1 stream, p50 ms (client) (2.00×); stop at a random phase of decode, client p50 ms "
        "(2.00×); stop at a random phase of decode, client p99 ms (2.00×)"
    )
    assert "ours is better at: stop during a ~1,500-token prompt, client p50 ms (500×)" in headline
    assert "1 llama-server requests never noticed" in headline
    assert "ended with an error" not in text
    results["server_errors"] = {OURS: 3}
    assert "**Requests the servers ended with an error** (ours 3)" in Report(results).markdown()
    # A section of a measurement the run did not make is left out.
    assert "### Stop latency (ms)" in text and "### Multi-turn chat" not in text


def test_the_in_process_measurements_have_a_section_of_their_own():
    storm = dict(streams=4, cycles=10, cancelled=6, done=4, other=0, hangs=0, mismatches=0, near_ties=0)
    storm |= {"kv_mismatches": 0, "cancel_to_exit_ms": [0.1, 0.2, 0.3]}
    nodes = {"prompt_tokens": 1500, "prefill_chunk": 512, "prompt_tokens_per_s": 230.0}
    nodes |= {"longest_prefill_node_ms": [6.0], "longest_decode_node_ms": [2.0]}
    greedy = {"tokens_per_prompt": 64, "rows": [{"compared": 64, "same": 64, "ours_n": 64, "theirs_n": 64}]}
    meta = {
        "command": "python -m bench run --llama-native --shared-threads",
        "started_at": "2026-12-03T00:00:00+00:00",
        "model": "Model X",
        "machine": {"cpu": "CPU", "virtual": True, "cores": 2},
        "load_average_start": [1.0, 1.0, 1.0],
        "plan": {"short_tokens": 50, "long_tokens": 1500},
        "targets": {OURS_LLAMA: {"slots": 2, "threads": 2}, LLAMA: {"slots": 2, "threads": 2}},
    }
    results = {"meta": meta, "samples": [], "runs": [], "lag": {}}
    assert Report(results).in_process_section() is None
    results["llama_native"] = {"storms": [storm], "nodes": nodes, "greedy": greedy, "load_average": [2.0, 1.5, 1.2]}
    section = Report(results).in_process_section()
    assert section.startswith("## Model X: the llama.cpp engine in-process\n")
    assert "| 4 | 10 | 0 | 6 | 4 | 0 | 0 | 0 | 0 | 0 | 0.200 / 0.298 |" in section
    assert "decode 2.00 ms; prompt 6.00 ms" in section and "1 identical token for token" in section
    assert "2.00 / 1.50 / 1.20 once they were done" in section
