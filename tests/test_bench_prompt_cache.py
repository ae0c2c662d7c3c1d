"""The bench's prompt-cache measurements (bench/prompt_cache.py): the servers it starts,
the edited resend, and its report."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from bench.drivers.llama_server import LlamaServerDriver
from bench.prompt_cache import LLAMA_SERVER, NO_CACHE, OURS, context_length, parse_args, section, start_drivers
from bench.prompts import PromptMaker


class WordTokenizer:
    """One token per word: enough to count what an edit changes."""

    def render_chat(self, messages: list[dict]) -> str:
        return " ".join(f"<{m['role']}> {m['content']} <end>" for m in messages) + " <assistant>"

    def encode(self, text: str) -> list[str]:
        return text.split()


def test_llama_server_keeps_its_own_prompt_cache_only_where_asked(tmp_path):
    def command(**extra) -> list[str]:
        return LlamaServerDriver(Path("/s"), Path("/m.gguf"), tmp_path, 2, 2, 2048, **extra).command()

    off = command()
    assert off[off.index("--cache-ram") + 1] == "0"
    assert "--cache-ram" not in command(cache_ram=True)  # its default budget


def test_stopline_serves_its_default_shared_steps_with_as_many_threads_as_llama_server(tmp_path):
    def threads(concurrency: int, cpus: str) -> list[str]:
        argv = ["--engines", f"{OURS},{NO_CACHE},{LLAMA_SERVER}", "--llama-server", "/s", "--cpus", cpus]
        args = parse_args([*argv, "--concurrency", str(concurrency)])
        ours, no_cache, peer = start_drivers(args, PromptMaker(WordTokenizer(), random.Random(1)), tmp_path)
        served = [dict(zip(driver.args[1::2], driver.args[2::2])) for driver in (ours, no_cache)]
        assert [s["--engine"] for s in served] == ["ours_llama_shared"] * 2
        return [s["--threads"] for s in served] + [str(peer.threads)]

    assert threads(2, "0,1,2,3") == ["2"] * 3
    # Never more threads than cores.
    assert threads(4, "0,1") == ["2"] * 3


def test_an_edit_changes_the_last_tokens_and_keeps_the_rest():
    prompts = PromptMaker(WordTokenizer(), random.Random(1))
    original = prompts.story(300)
    before = prompts.tokens(original)
    edited = prompts.edit_tail(original, 20)
    a, b = (WordTokenizer().encode(WordTokenizer().render_chat(m)) for m in (original, edited))
    same = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert 20 <= len(b) - same <= 30 and abs(prompts.tokens(edited) - before) <= 10


def test_the_context_holds_the_longest_conversation_and_the_resent_prompt():
    sizes = dict(system_tokens=4000, turns=6, user_tokens=40, answer_tokens=48, resend_tokens=8000)
    context = context_length(argparse.Namespace(**sizes))
    assert context % 512 == 0 and context >= 8000 + 48
    assert context_length(argparse.Namespace(**(sizes | {"resend_tokens": 100}))) >= 4000 + 6 * (40 + 48) + 48


def test_the_report_sets_each_measurement_against_its_target():
    agent = [
        {"part": "agent", "target": t, "conversation": 0, "turn": turn, "ttft_ms": ms * turn_ms}
        | {"prompt_tokens": 1000, "cached_tokens": 0 if turn == 1 else 900}
        for t, ms in ((OURS, 1.0), (NO_CACHE, 10.0), (LLAMA_SERVER, 2.0))
        for turn, turn_ms in ((1, 100.0), (2, 10.0), (3, 10.0))
    ]
    resend = {"part": "resend", "target": OURS, "rep": 0, "stopped_in_prompt": True, "ttft_ms": 220.0}
    resend |= {"prompt_tokens": 2000, "cached_tokens": 1500, "new_tokens": 500, "cold_ttft_ms": 800.0}
    resend |= {"cold_tokens": 2000, "at_cold_rate_ms": 200.0, "new_cold_ttft_ms": 200.0, "new_cold_tokens": 500}
    restart = {"part": "restart", "target": OURS, "rep": 0, "ttft_ms": 30.0, "cold_ttft_ms": 300.0}
    restart |= {"prompt_tokens": 400, "cached_tokens": 380}
    sizes = dict(conversations=1, turns=3, system_tokens=900, user_tokens=40, answer_tokens=48, concurrency=1)
    sizes |= dict(resend_tokens=2000, cancel_at=0.7, edit_tokens=20)
    meta = {"model": "M", "command": "python -m bench prompt-cache", "machine": {}, "context_per_slot": 2560}
    meta |= {"load_average_start": [1.0], "load_average_end": [1.0], "sizes": sizes}
    text = section({"meta": meta, "rows": [*agent, resend, restart]})
    assert "`python -m bench prompt-cache`" in text
    assert "TTFT p50 ≤ llama-server's: 10.0 ms against 20.0 ms, 0.50×" in text
    assert "Stopline's with `--no-prompt-cache`: 0.10×" in text
    assert "| ours_llama | 3 | 1000 | 10.0 | 98.2 | 100 | 10.0 | 60% |" in text
    assert "| 220 | 200 (1.10×) | 200 (1.10×) |" in text
    assert "| 1 | 400 | 380 | 30.0 | 300 | 0.10× |" in text
