"""The bench's fault measurements (bench/tools/faults.py): the prompt cache's churn section and
its targets' verdicts, on results made up here."""

from __future__ import annotations

import random

from bench.tools.faults import MIB, cache_churn_section, cache_metrics, cache_prompt, cache_verdicts, directory_bytes


def churn_result(**fields) -> dict:
    result = {
        "minutes": 30,
        "cache_ram_mib": 64,
        "disk_mib": 64,
        "requests": 1234,
        "hits": 300,
        "saves": 900,
        "evictions": 850,
        "disk_evictions": 700,
        "warmup_minutes": 3,
        "baseline_rss_mib": 510.0,
        "footprint_mib": 500.0,
        "peak_rss_mib": 560.0,
        "rss_growth_mib": 60.0,
        "rss_limit_mib": 67.2,
        "peak_disk_bytes": 60 * MIB,
        "disk_budget_bytes": 64 * MIB,
        "samples": [
            {"rss_mib": 530.0, "bytes": 20 * MIB},
            {"rss_mib": 560.0, "bytes": 58 * MIB},
            {"rss_mib": 545.0, "bytes": 30 * MIB},
        ],
    }
    return result | fields


def test_the_targets_met_at_their_limits_and_missed_past_them():
    assert cache_verdicts(churn_result()) == {"rss": True, "disk": True}
    at_limits = churn_result(rss_growth_mib=67.2, peak_disk_bytes=64 * MIB)
    assert cache_verdicts(at_limits) == {"rss": True, "disk": True}
    past = churn_result(rss_growth_mib=67.3, peak_disk_bytes=64 * MIB + 1)
    assert cache_verdicts(past) == {"rss": False, "disk": False}


def test_the_section_has_its_heading_command_table_and_one_line_per_target():
    command = "python -m bench faults cache-churn --results-md"
    section = cache_churn_section(churn_result(peak_disk_bytes=65 * MIB), command)
    lines = section.splitlines()
    assert lines[0] == "## The prompt cache's memory under churn"
    assert lines[2].startswith(f"`{command}`: ")
    assert "`--cache-ram 64`" in lines[2] and "then 30 minutes" in lines[2]
    assert lines[4].startswith("| requests | hits | saves | evictions |")
    assert lines[6] == "| 1,234 | 300 | 900 | 850 | 700 | 500.0 | 560.0 | +60.0 | 65.0 |"
    assert "RSS over the footprint ≤ budget + 5%: 60.0 MiB against 67.2 MiB, met." in lines
    assert "Disk ≤ its budget: 65.0 MiB against 64.0 MiB, not met." in lines
    # Beyond the cache's bytes: 10, 2 and 15 MiB.
    assert "the cache's own bytes, sample by sample: +10.0 MiB at the median, +15.0 MiB at most (3 samples)." in section
    assert section.endswith("\n")


def test_the_cache_metrics_read_gauges_and_counters_by_short_names():
    metrics = {
        "stopline_prompt_cache_bytes": 5.0,
        "stopline_prompt_cache_budget_bytes": 16.0 * MIB,
        "stopline_prompt_cache_saves_total": 7.0,
        "stopline_prompt_cache_disk_evictions_total": 2.0,
    }
    read = cache_metrics(metrics)
    assert read["bytes"] == 5 and read["budget_bytes"] == 16 * MIB
    assert read["saves"] == 7 and read["disk_evictions"] == 2 and read["hits"] == 0


class Words:
    """A PromptMaker's stand-in: a user message of the token count asked for."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.asked: list[int] = []

    def story(self, target_tokens: int) -> list[dict]:
        self.asked.append(target_tokens)
        return [{"role": "user", "content": "word " * target_tokens}]


def test_prompts_mix_shared_system_prompts_with_fresh_text():
    prompts = Words(random.Random(0))
    systems = ["system a", "system b"]
    chats = [cache_prompt(prompts, systems) for _ in range(200)]
    used = {chat[0]["content"] for chat in chats if chat[0]["role"] == "system"}
    assert used == set(systems)
    assert any(chat[0]["role"] == "user" for chat in chats)
    assert min(prompts.asked) >= 100 and max(prompts.asked) <= 1500


def test_directory_bytes_counts_the_files_below(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 10)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / ".b.tmp").write_bytes(b"y" * 5)
    assert directory_bytes(tmp_path) == 15
    assert directory_bytes(tmp_path / "missing") == 0
