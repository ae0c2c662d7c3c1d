"""The llama.cpp engine's tables: each figure of ``ours_llama`` next to llama-server's
(and, on SmolLM2, next to the ctransformers engine's in the same run), the stop
targets checked against what bounds them, the abort storms and greedy agreement."""

from __future__ import annotations

import statistics

from .llama_native import NEAR_TIE_LOGPROB
from .report import (
    LLAMA,
    OURS,
    OURS_LLAMA,
    OURS_LLAMA_SHARED,
    OURS_LLAMA_UNEDITED,
    Report,
    _get,
    _table,
    fmt,
    fmt_ratio,
    shared_threads,
    summary,
)
from .scenarios import DECODE_CONCURRENT, TURNS

# The stop targets, in ms: the server's own stop at a random moment, and what a client sees.
SERVER_STOP_MS = 1.0
CLIENT_STOP_MS = 3.0
# A stop right after a token: how much a client may see beyond the server's own stop, at the median.
CLIENT_OVER_SERVER_MS = 0.5
# Our decode speed against the unedited build's, measured in the same run.
UNEDITED_SPEED = 0.99
# The stops, by scenario, and which phase's longest stretch between stop checks bounds each.
STOPS = (
    ("decode_after_token", "right after a token", "longest_decode_node_ms"),
    ("decode", "random phase of decode", "longest_decode_node_ms"),
    (DECODE_CONCURRENT, "1 of 4 concurrent streams, random phase", "longest_decode_node_ms"),
    ("prefill_long", "during the long prompt", "longest_prefill_node_ms"),
)


def _show(value) -> str:
    """A count as an integer, any other figure as the report writes figures."""
    return str(value) if isinstance(value, int) else fmt(value)


def _p(values, key: str) -> float | None:
    return _get(summary(values), key)


class LlamaReport:
    def __init__(self, report: Report):
        self.r = report
        self.results = report.results
        self.engines = [t for t in (OURS_LLAMA, LLAMA, OURS_LLAMA_UNEDITED, OURS) if t in report.targets]
        self.ours = [t for t in (OURS_LLAMA, OURS_LLAMA_SHARED, OURS_LLAMA_UNEDITED, OURS) if t in report.targets]

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

    def longest_stretch(self, scenario: str, target: str, phase: str) -> float | None:
        """The longest stretch between two stop checks, in ``phase``, over the scenario's requests
        (from the server's end-of-request log)."""
        stretches = [s[phase] for s in self.r.of(scenario, target) if s.get(phase)]
        return max(stretches) if stretches else None

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
        if OURS_LLAMA_UNEDITED in self.engines:
            header += [OURS_LLAMA_UNEDITED, f"{OURS_LLAMA_UNEDITED}/{OURS_LLAMA}"]
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
            if OURS_LLAMA_UNEDITED in self.engines:
                row += [
                    _show(values.get(OURS_LLAMA_UNEDITED)),
                    fmt_ratio(values.get(OURS_LLAMA_UNEDITED), values.get(OURS_LLAMA)),
                ]
            if OURS in self.engines:
                row.append(_show(values.get(OURS)))
            table.append(row)
        return _table(header, table)

    def server_side(self) -> str:
        """Our loop's own stop latency (cancel read → loop exited), which llama-server cannot report,
        beside the longest stretch between two stop checks that the same requests' evaluations had."""
        rows = []
        for scenario, title, phase in STOPS:
            for target in self.ours:
                samples = self.r.of(scenario, target)
                if not samples:
                    continue
                server = summary(s["server_ms"] for s in samples)
                rows.append(
                    [title, target, str(len(samples))]
                    + [fmt(_get(server, k)) for k in ("p50", "p90", "p99", "max")]
                    + [fmt(self.longest_stretch(scenario, target, phase))]
                )
        return _table(
            ["stop", "engine", "n", "server p50 ms", "p90", "p99", "max", "longest stretch between checks, ms"],
            rows,
        )

    def targets(self) -> str:
        """The stop and speed targets for the llama.cpp engine, each with what bounds it."""
        rows = []

        def check(ok: bool | None) -> str:
            return "–" if ok is None else "yes" if ok else "**no**"

        def at_most(value: float | None, bound: float | None) -> bool | None:
            return None if value is None or bound is None else value <= bound

        server50 = self.stop("decode_after_token", OURS_LLAMA, "p50", "server_ms")
        client50 = self.stop("decode_after_token", OURS_LLAMA, "p50")
        client99 = self.stop("decode_after_token", OURS_LLAMA, "p99")
        bound50 = server50 + CLIENT_OVER_SERVER_MS if server50 is not None else None
        rows.append(
            [
                "stop right after a token: client p50 ms",
                fmt(client50),
                f"server p50 + {CLIENT_OVER_SERVER_MS} = {fmt(bound50)}",
                check(at_most(client50, bound50)),
            ]
        )
        rows.append(
            [
                "stop right after a token: client p99 ms",
                fmt(client99),
                fmt(CLIENT_STOP_MS),
                check(at_most(client99, CLIENT_STOP_MS)),
            ]
        )
        for scenario, title, phase in STOPS[1:]:
            for target in (OURS_LLAMA, OURS_LLAMA_SHARED) if scenario == DECODE_CONCURRENT else (OURS_LLAMA,):
                if not self.r.of(scenario, target):
                    continue
                server = self.stop(scenario, target, "p99", "server_ms")
                client = self.stop(scenario, target, "p99")
                stretch = self.longest_stretch(scenario, target, phase)
                rows.append(
                    [
                        f"stop, {title}, {target}: server / client p99 ms",
                        f"{fmt(server)} / {fmt(client)} (longest stretch {fmt(stretch)})",
                        f"{fmt(SERVER_STOP_MS)} / {fmt(CLIENT_STOP_MS)}",
                        check(
                            None
                            if server is None or client is None
                            else server <= SERVER_STOP_MS and client <= CLIENT_STOP_MS
                        ),
                    ]
                )
        ours, peer = self.prompt_rate(OURS_LLAMA), self.prompt_rate(LLAMA)
        rows.append(
            [
                "prompt tok/s, ours ÷ llama-server",
                f"{fmt_ratio(ours, peer)} ({fmt(ours)} vs {fmt(peer)})",
                "≥ 1.0×",
                check(None if not ours or not peer else ours >= peer),
            ]
        )
        for streams in self.streams_seen():
            if streams == 1:
                ours, peer, unedited = (self.decode_rate(t) for t in (OURS_LLAMA, LLAMA, OURS_LLAMA_UNEDITED))
            else:
                ours, peer, unedited = (self.aggregate(t, streams) for t in (OURS_LLAMA, LLAMA, OURS_LLAMA_UNEDITED))
            ok = None if not ours or not peer else ours >= peer
            if ok is not None and unedited:
                ok = ok and ours >= UNEDITED_SPEED * unedited
            rows.append(
                [
                    f"decode tok/s, {streams} stream{'s' if streams > 1 else ''}: ours ÷ llama-server, ours ÷ unedited",
                    f"{fmt_ratio(ours, peer)} ({fmt(ours)} vs {fmt(peer)}), "
                    f"{fmt_ratio(ours, unedited)} (vs {fmt(unedited)})",
                    f"≥ 1.0×, ≥ {UNEDITED_SPEED}×",
                    check(ok),
                ]
            )
        after_max = self.tokens_after_cancel_max(OURS_LLAMA)
        rows.append(["tokens after cancel: max", _show(after_max), "0", check(at_most(after_max, 0))])
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
            f"Longest stretch between two stop checks, in-process, {len(nodes['longest_decode_node_ms'])} "
            f"runs of a {nodes['prompt_tokens']}-token prompt in {nodes['prefill_chunk']}-token chunks then "
            f"decode, 1 thread: decode {', '.join(fmt(v) for v in nodes['longest_decode_node_ms'])} ms; "
            f"prompt {', '.join(fmt(v) for v in nodes['longest_prefill_node_ms'])} ms "
            f"(prompt {fmt(nodes['prompt_tokens_per_s'])} tok/s in-process)."
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
