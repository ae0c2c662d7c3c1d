"""The llama.cpp engine's tables: each figure of ``ours_llama`` next to llama-server's
(and, on SmolLM2, next to the ctransformers engine's in the same run), the stop
targets checked against what bounds them, the abort storms and greedy agreement."""

from __future__ import annotations

import statistics

from .llama_native import NEAR_TIE_LOGPROB
from .report import LLAMA, OURS, OURS_LLAMA, Report, _get, _table, fmt, fmt_ratio, shared_threads, summary
from .scenarios import DECODE_CONCURRENT, TURNS

# What a stop during a long prompt may take, beyond one decode step (the target).
PREFILL_STOP_MARGIN_MS = 5.0


def _show(value) -> str:
    """A count as an integer, any other figure as the report writes figures."""
    return str(value) if isinstance(value, int) else fmt(value)


def _p(values, key: str) -> float | None:
    return _get(summary(values), key)


class LlamaReport:
    def __init__(self, report: Report):
        self.r = report
        self.results = report.results
        self.engines = [t for t in (OURS_LLAMA, LLAMA, OURS) if t in report.targets]

    # Figures ---------------------------------------------------------------------------

    def stop(self, scenario: str, target: str, key: str, side: str = "client_ms") -> float | None:
        return _p((s.get(side) for s in self.r.of(scenario, target)), key)

    def aggregate(self, target: str, streams: int) -> float | None:
        samples = self.r.of("throughput", target, streams=streams)
        return _p({s["rep"]: s.get("aggregate_tokens_per_s") for s in samples}.values(), "p50")

    def decode_rate(self, target: str) -> float | None:
        return _p((s["tokens_per_s_client"] for s in self.r.of("throughput", target, streams=1)), "p50")

    def ttft(self, target: str) -> float | None:
        return _p((s["ttft_client_ms"] for s in self.r.of("throughput", target, streams=1)), "p50")

    def prompt_rate(self, target: str) -> float | None:
        return _p((s["prompt_tokens_per_s"] for s in self.r.of("prefill_speed", target)), "p50")

    def turn_ratio(self, target: str) -> float | None:
        samples = self.r.of("multi_turn", target)
        first = _p((s["ttft_server_ms"] for s in samples if s["turn"] == 1), "p50")
        last = _p((s["ttft_server_ms"] for s in samples if s["turn"] == TURNS), "p50")
        return last / first if first and last else None

    def tokens_after_cancel_max(self, target: str) -> int | None:
        after = [
            s["tokens_after_cancel"]
            for s in self.r.samples
            if s["target"] == target
            and s["scenario"] in ("prefill_long", "decode", "decode_after_token", DECODE_CONCURRENT)
            and s.get("tokens_after_cancel") is not None
        ]
        return max(after) if after else None

    def lost_tokens(self, target: str) -> tuple[int, int] | None:
        samples = self.r.of(DECODE_CONCURRENT, target)
        if not samples:
            return None
        return sum(s.get("others_lost_tokens") or 0 for s in samples), 3 * len(samples)

    def streams_seen(self) -> list[int]:
        return sorted({s["streams"] for s in self.r.samples if s["scenario"] == "throughput"})

    # Tables ------------------------------------------------------------------------------

    def side_by_side(self) -> str:
        """Every headline figure: ours_llama, llama-server, their ratio, and the ctransformers engine."""
        long = self.r._lengths()[1]
        rows: list[tuple[str, dict]] = [
            ("decode tok/s, 1 stream, p50 (client)", {t: self.decode_rate(t) for t in self.engines}),
        ]
        for streams in self.streams_seen():
            if streams > 1:
                rows.append(
                    (
                        f"aggregate tok/s, {streams} concurrent streams, median of repetitions",
                        {t: self.aggregate(t, streams) for t in self.engines},
                    )
                )
        rows += [
            (f"prompt tok/s, ~{long:,}-token prompt, p50 (server)", {t: self.prompt_rate(t) for t in self.engines}),
            ("time to first token, 1 stream, p50 ms (client)", {t: self.ttft(t) for t in self.engines}),
            (f"multi-turn TTFT, turn {TURNS} ÷ turn 1 (server)", {t: self.turn_ratio(t) for t in self.engines}),
        ]
        for scenario, title in (
            ("decode_after_token", "stop right after a token"),
            ("decode", "stop at a random phase of decode"),
            ("prefill_long", f"stop during a ~{long:,}-token prompt"),
            (DECODE_CONCURRENT, "stop 1 of 4 concurrent streams, random phase"),
        ):
            for key in ("p50", "p99"):
                rows.append((f"{title}, client {key} ms", {t: self.stop(scenario, t, key) for t in self.engines}))
        rows.append(
            (
                "tokens after cancel, max over every cancel",
                {t: self.tokens_after_cancel_max(t) for t in self.engines},
            )
        )
        header = ["", OURS_LLAMA, LLAMA, f"{LLAMA}/{OURS_LLAMA}"]
        if OURS in self.engines:
            header += [f"{OURS} (ctransformers, this run)"]
        table = []
        for what, values in rows:
            row = [
                what,
                _show(values.get(OURS_LLAMA)),
                _show(values.get(LLAMA)),
                fmt_ratio(values.get(LLAMA), values.get(OURS_LLAMA)),
            ]
            if OURS in self.engines:
                row.append(_show(values.get(OURS)))
            table.append(row)
        return _table(header, table)

    def server_side(self) -> str:
        """Our loop's own stop latency (cancel read → loop exited), which llama-server cannot report."""
        rows = []
        for scenario, title in (
            ("decode_after_token", "right after a token"),
            ("decode", "random phase"),
            ("prefill_long", "during the long prompt"),
            (DECODE_CONCURRENT, "1 of 4 concurrent streams, random phase"),
        ):
            for target in (t for t in (OURS_LLAMA, OURS) if t in self.engines):
                samples = self.r.of(scenario, target)
                server = summary(s["server_ms"] for s in samples)
                rows.append(
                    [title, target, str(len(samples))] + [fmt(_get(server, k)) for k in ("p50", "p90", "p99", "max")]
                )
        return _table(["stop", "engine", "n", "server p50 ms", "p90", "p99", "max"], rows)

    def targets(self) -> str:
        """The issue's targets for the llama.cpp engine, each against what bounds it."""
        native = self.results.get("llama_native") or {}
        nodes = native.get("nodes") or {}
        decode_node = max(nodes.get("longest_decode_node_ms") or [0.0]) or None
        prefill_node = max(nodes.get("longest_prefill_node_ms") or [0.0]) or None
        step = self.results["meta"]["targets"].get(OURS_LLAMA, {}).get("calibration", {}).get("step_ms")
        rows = []

        def check(ok: bool | None) -> str:
            return "–" if ok is None else "yes" if ok else "**no**"

        after = self.stop("decode_after_token", OURS_LLAMA, "p99", "server_ms")
        rows.append(
            [
                "stop right after a token: server p50 / p99 ms",
                f"{fmt(self.stop('decode_after_token', OURS_LLAMA, 'p50', 'server_ms'))} / {fmt(after)}",
                "below one decode step " + (f"({fmt(step)} ms)" if step else ""),
                check(after < step if after is not None and step else None),
            ]
        )
        random_p99 = self.stop("decode", OURS_LLAMA, "p99", "server_ms")
        rows.append(
            [
                "stop at a random phase: server p99 ms",
                fmt(random_p99),
                f"the longest decode node, {fmt(decode_node)} ms (in-process, max of the runs)",
                check(random_p99 <= decode_node * 1.5 if random_p99 is not None and decode_node else None),
            ]
        )
        prefill_p99 = self.stop("prefill_long", OURS_LLAMA, "p99")
        bound = step + PREFILL_STOP_MARGIN_MS if step else None
        rows.append(
            [
                "stop during the long prompt: client p99 ms",
                fmt(prefill_p99),
                f"1 decode step + {PREFILL_STOP_MARGIN_MS:.0f} ms = {fmt(bound)} ms "
                f"(longest prompt node {fmt(prefill_node)} ms)",
                check(prefill_p99 <= bound if prefill_p99 is not None and bound else None),
            ]
        )
        after_max = self.tokens_after_cancel_max(OURS_LLAMA)
        none_after = after_max == 0 if after_max is not None else None
        rows.append(["tokens after cancel: max", _show(after_max), "0", check(none_after)])
        one = self.stop("decode", OURS_LLAMA, "p50", "server_ms")
        four = self.stop(DECODE_CONCURRENT, OURS_LLAMA, "p50", "server_ms")
        one99 = self.stop("decode", OURS_LLAMA, "p99", "server_ms")
        four99 = self.stop(DECODE_CONCURRENT, OURS_LLAMA, "p99", "server_ms")
        rows.append(
            [
                "4 concurrent streams: the cancelled one's server p50 / p99 ms",
                f"{fmt(four)} / {fmt(four99)}",
                f"1 stream: {fmt(one)} / {fmt(one99)}",
                "–",
            ]
        )
        lost = self.lost_tokens(OURS_LLAMA)
        peer_lost = self.lost_tokens(LLAMA)
        rows.append(
            [
                "4 concurrent streams: tokens the other streams lost",
                f"{lost[0]} over {lost[1]} streams" if lost else "–",
                "0" + (f" (llama-server: {peer_lost[0]} over {peer_lost[1]} streams)" if peer_lost else ""),
                check(lost[0] == 0 if lost else None),
            ]
        )
        return _table(["target", OURS_LLAMA, "bound", "met"], rows)

    def storms(self) -> str | None:
        native = self.results.get("llama_native") or {}
        storms = native.get("storms")
        if not storms:
            return None
        rows = []
        for storm in storms:
            if storm.get("crashed"):
                rows.append(
                    [str(storm["streams"]), str(storm["cycles"]), f"**crashed** (exit {storm['returncode']})"]
                    + ["–"] * 7
                )
                continue
            ms = sorted(storm["cancel_to_exit_ms"])
            p50 = statistics.median(ms) if ms else None
            p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))] if ms else None
            rows.append(
                [
                    str(storm["streams"]),
                    str(storm["cycles"]),
                    "0",
                    str(storm["cancelled"]),
                    str(storm["done"]),
                    str(storm["hangs"]),
                    str(storm["kv_mismatches"]),
                    str(storm["mismatches"]),
                    str(storm["other"]),
                    f"{fmt(p50)} / {fmt(p99)}",
                ]
            )
        return _table(
            [
                "streams at once",
                "aborts",
                "crashes",
                "cancelled",
                "escaped (done)",
                "hangs",
                "KV positions ≠ n_held",
                "greedy tokens ≠ a fresh slot's",
                "other outcomes",
                "cancel→exit p50 / p99 (ms)",
            ],
            rows,
        )

    def nodes(self) -> str | None:
        nodes = (self.results.get("llama_native") or {}).get("nodes")
        if not nodes:
            return None
        return (
            f"Longest graph node between two abort checks, in-process, {len(nodes['longest_decode_node_ms'])} "
            f"runs of a {nodes['prompt_tokens']}-token prompt in {nodes['prefill_chunk']}-token chunks then "
            f"decode, 1 thread: decode {', '.join(fmt(v) for v in nodes['longest_decode_node_ms'])} ms; "
            f"prompt {', '.join(fmt(v) for v in nodes['longest_prefill_node_ms'])} ms "
            f"(prompt {fmt(nodes['prompt_tokens_per_s'])} tok/s in-process). The server reports neither "
            "(its frames and end-of-request log carry `cancel_latency_ms` but not the loop's longest nodes), "
            "so the random-phase bound is this in-process figure."
        )

    def greedy(self) -> str | None:
        greedy = (self.results.get("llama_native") or {}).get("greedy")
        if not greedy:
            return None
        rows = greedy["rows"]
        same = sum(1 for r in rows if "diverged_at" not in r and r["ours_n"] == r["theirs_n"])
        diverged = [r for r in rows if "diverged_at" in r]
        ties = [r for r in diverged if r.get("near_tie")]
        compared = sum(r["same"] + ("diverged_at" in r) for r in rows)
        words = (
            f"{len(rows)} prompts, greedy (temperature 0, repetition penalty 1.0), up to "
            f"{greedy['tokens_per_prompt']} tokens each, sent to both as the same token ids: {same} identical "
            f"token for token over their whole length; {len(diverged)} diverged, {len(ties)} of them at a "
            f"near-tie (the two likeliest tokens within {NEAR_TIE_LOGPROB} in log-probability on "
            f"llama-server); {compared} token positions compared up to the first divergence."
        )
        lengths = [r for r in rows if "diverged_at" not in r and r["ours_n"] != r["theirs_n"]]
        if lengths:
            words += f" {len(lengths)} agreed on every shared token but ended at different lengths."
        if diverged:
            first = diverged[0]
            words += (
                f" First divergence: token {first['diverged_at'] + 1}, ours {first['ours_piece']!r}, "
                f"llama-server {first['theirs_piece']!r}, log-probability gap "
                f"{fmt(first['logprob_gap'])}."
            )
        return words

    def load(self) -> str:
        """The machine's 1-minute load average over the scenarios: how shared the 2 cores were."""
        loads = [r["load_average"][0] for r in self.results["runs"] if r.get("load_average")]
        if not loads:
            return ""
        return (
            f"The machine's 1-minute load average, read as each scenario part started: "
            f"{min(loads):.2f} to {max(loads):.2f}, median {statistics.median(loads):.2f}, on 2 cores shared with "
            "other work. llama-server's threads meet at a barrier after every graph node, so a thread "
            "preempted by other work holds back its partners, spinning while they wait; "
            + (
                "so do ours while a generation runs alone on both cores. "
                if shared_threads(self.results["meta"])
                else "ours runs one thread per slot and has no barrier. "
            )
            + "Multi-threaded figures are therefore the ones most sensitive to this load."
        )

    def markdown(self) -> str | None:
        if OURS_LLAMA not in self.r.targets:
            return None
        parts = [
            self.load(),
            "#### Side by side",
            "Each figure of Stopline on its llama.cpp engine beside llama-server's from the same run "
            "(same GGUF, same cores, equal threads in all), and, where it ran, the ctransformers engine's. "
            "Stops on llama-server are the client closing the stream (it has no cancel request), timed to "
            "its slot's release line.",
            self.side_by_side(),
            "#### Our loop's own stop latency (server: cancel read → loop exited)",
            self.server_side(),
            "#### Targets",
            self.targets(),
        ]
        nodes = self.nodes()
        if nodes:
            parts.append(nodes)
        storms = self.storms()
        if storms:
            parts += [
                "#### Aborts at random moments (in-process, each storm in a child process)",
                "Greedy generations of 4 tokens on a 40-token prompt (16-token chunks), cancelled at random "
                "moments within a fresh or a cached run's length, on 1 thread; with 4 streams, the 4 sequences "
                "of one llama.cpp context do it at once, sharing its steps. After every generation the slot's KV "
                "cache must hold exactly the positions its record holds; every run that escaped its cancel, and "
                "a final one per slot, must give a fresh slot's tokens.",
                storms,
            ]
        greedy = self.greedy()
        if greedy:
            parts += ["#### Greedy output against llama-server", greedy]
        return "\n\n".join(parts)
