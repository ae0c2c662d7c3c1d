"""One report for every run, whichever servers took part: its tables (Markdown), the JSON
file, the stop-latency CDF chart, and the run's section of bench/RESULTS.md."""

from __future__ import annotations

import json
import re
import shlex
import statistics
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path

import jinja2
import numpy as np

from .inprocess.llama_native import NEAR_TIE_LOGPROB
from .scenarios import (
    BUSY_MAX_TOKENS,
    CANCEL_VIA_REPLICA,
    CONCURRENT_STREAMS,
    DECODE_CONCURRENT,
    DISCONNECT_BUSY,
    HTTP_SCENARIOS,
    NONSTREAM,
    STOP_SCENARIOS,
    TIMEOUT_SCENARIOS,
    TURNS,
    VIA_OTHER,
    VIA_OWNER,
)
from .tables import fmt, stat, table

BENCH_DIR = Path(__file__).resolve().parent
OURS, BASELINE, LLAMA, BETWEEN_STEPS = "ours", "baseline", "llama-server", "ours_between_steps"
OURS_LLAMA, OURS_LLAMA_BETWEEN_STEPS = "ours_llama", "ours_llama_between_steps"
OURS_LLAMA_SHARED, OURS_LLAMA_UNEDITED = "ours_llama_shared", "ours_llama_unedited"
# Engines compared with the reference engine (ours, or ours_llama where ctransformers cannot run the
# model), each in a "<peer>/<reference>" ratio row.
PEERS = (OURS_LLAMA, OURS_LLAMA_SHARED, OURS_LLAMA_UNEDITED, BETWEEN_STEPS, OURS_LLAMA_BETWEEN_STEPS, BASELINE, LLAMA)
COLORS = dict(zip(PEERS + (OURS,), ("red", "pink", "olive", "purple", "brown", "orange", "green", "blue"), strict=True))
# The stop scenarios in the stop-latency and tokens-after-cancel tables.
REPORTED_STOPS = STOP_SCENARIOS + (DECODE_CONCURRENT,)
SCENARIO_TITLES = {
    "queued": "queued",
    "prefill_short": "prefill, short prompt",
    "prefill_long": "prefill, long prompt",
    "decode": "decode, random phase",
    "decode_after_token": "decode, right after a token frame",
    DECODE_CONCURRENT: "decode, 1 of {streams} concurrent streams, random phase",
    "timeout_total": "total timeout (decode)",
    "timeout_ttft": "first-token timeout (long prefill)",
    "timeout_total_prefill": "total timeout that fell in the prefill",
    "disconnect": "socket dropped",
    DISCONNECT_BUSY: "socket dropped while another client streams",
    NONSTREAM: "non-streaming request, client gone",
}
# The extra cost of a DELETE relayed through Redis that the scale-out design allows, at p99.
RELAY_TARGET_MS = 5.0
# The HTTP API's stops, each next to the WebSocket stop it mirrors.
HTTP_COMPARISONS = (
    ("openai_stream_closed", "HTTP: OpenAI stream closed"),
    ("disconnect", "WebSocket: socket dropped"),
    ("delete_prefill", "HTTP: DELETE during the long prompt"),
    ("prefill_long", "WebSocket: cancel frame during the long prompt"),
    ("decode", "WebSocket: cancel frame during decode"),
)
# The llama.cpp engine's stop targets, in ms: the server's own stop at a random moment, and what a client sees.
SERVER_STOP_MS, CLIENT_STOP_MS = 1.0, 3.0
# A stop right after a token: how much a client may see beyond the server's own stop, at the median.
CLIENT_OVER_SERVER_MS = 0.5
# Our decode speed against the unedited build's, measured in the same run.
UNEDITED_SPEED = 0.99
# The stops, by scenario, and which phase's longest stretch between stop checks bounds each.
STOPS = (
    ("decode_after_token", "right after a token", "longest_decode_node_ms"),
    ("decode", "random phase of decode", "longest_decode_node_ms"),
    (DECODE_CONCURRENT, "1 of {streams} concurrent streams, random phase", "longest_decode_node_ms"),
    ("prefill_long", "during the long prompt", "longest_prefill_node_ms"),
)
SPREAD = ("p50", "p90", "p99", "max")


def figures(samples, *columns: tuple[str, ...]) -> list[float | None]:
    """For each column group (key, statistic, ...): those statistics of the samples' ``key``."""
    return [v for key, *keys in columns for v in stat((s.get(key) for s in samples), *keys)]


def tokens_after_cancel(samples) -> list[int]:
    """The server's tokens after the cancel, of the samples that report it."""
    return [s["tokens_after_cancel"] for s in samples if s.get("tokens_after_cancel") is not None]


def show(value) -> str:
    """A count as an integer, any other figure as the report writes figures."""
    return str(value) if isinstance(value, int) else fmt(value)


def fmt_ratio(base: float | None, ours: float | None) -> str:
    if base is None or ours is None or ours <= 0 or base < 0:
        return "–"
    r = base / ours
    return f"**{r:.0f}×**" if r >= 100 else f"**{r:.1f}×**" if r >= 10 else f"**{r:.2f}×**"


class Report:
    def __init__(self, results: dict):
        self.results = results
        self.samples = results["samples"]
        self.targets = list(results["meta"]["targets"])
        # The engine every ratio is taken against.
        self.ref = next((t for t in (OURS, OURS_LLAMA) if t in self.targets), None)
        self.peers = [p for p in PEERS if p in self.targets and p != self.ref] if self.ref else []
        self.ours = [t for t in (OURS_LLAMA, OURS_LLAMA_SHARED, OURS_LLAMA_UNEDITED, OURS) if t in self.targets]
        # The streams decode_concurrent ran (one per slot of the servers it ran on), in its titles.
        concurrent = [s["streams"] for s in self.samples if s["scenario"] == DECODE_CONCURRENT]
        self.streams = streams = max(concurrent, default=CONCURRENT_STREAMS)
        self.titles = {scenario: title.format(streams=streams) for scenario, title in SCENARIO_TITLES.items()}
        self.stops = tuple((scenario, title.format(streams=streams), phase) for scenario, title, phase in STOPS)

    def of(self, scenario: str, target: str, **match) -> list[dict]:
        return [
            s
            for s in self.samples
            if s["scenario"] == scenario and s["target"] == target and all(s.get(k) == v for k, v in match.items())
        ]

    def _rows_with_ratio(self, label: str, stats: dict[str, tuple[int, list]]) -> list[list[str]]:
        """One row per target, then <peer>/<reference> for every column and peer. ``stats[target]`` is
        (count, [values]); the count column gets no ratio."""
        if not any(count for count, _ in stats.values()):
            return []
        rows = []
        for target in self.targets:
            count, values = stats[target]
            rows.append([label if not rows else "", target, str(count)] + [fmt(v) for v in values])
        for peer in self.peers:
            ratios = [fmt_ratio(p, o) for p, o in zip(stats[peer][1], stats[self.ref][1])]
            rows.append(["", f"{peer}/{self.ref}", ""] + ratios)
        return rows

    def _spread_rows(self, scenarios, *columns: tuple[str, ...]) -> list[list[str]]:
        """For each scenario: its samples' count and ``columns``' figures per target, with the ratio rows."""
        rows = []
        for scenario in scenarios:
            stats = {t: (len(ss), figures(ss, *columns)) for t in self.targets for ss in [self.of(scenario, t)]}
            rows += self._rows_with_ratio(self.titles[scenario], stats)
        return rows

    def _lengths(self) -> tuple[int, int]:
        plan = self.results["meta"]["plan"]
        return plan["short_tokens"], plan["long_tokens"]

    # Sections -----------------------------------------------------------------------

    def calibration(self) -> str | None:
        rows = []
        for target in self.targets:
            info = self.results["meta"]["targets"][target]
            threads = info.get("threads")
            # llama-server's threads serve all its slots at once.
            threads = "–" if threads is None else f"{threads} in all" if target == LLAMA else str(threads)
            rows.append(
                [target, str(info.get("prefill_chunk", "–")), threads, str(info.get("slots", "–"))]
                + [fmt(self.prefill_ms(target, tokens)) for tokens in self._lengths()]
                + [fmt(info.get("calibration", {}).get("step_ms")), fmt(self.prompt_rate(target))]
            )
        short, long = self._lengths()
        return table(
            f"engine|prompt tokens per uninterruptible step|threads per slot|slots|prefill, {short}-token prompt (ms)|"
            f"prefill, {long}-token prompt (ms)|decode step (ms)|prompt tok/s ({long}-token prompt)",
            rows,
        )

    def prefill_ms(self, target: str, tokens: int) -> float | None:
        """The calibrated prefill of a ``tokens``-long prompt (keyed by a string once read from JSON)."""
        prefill = self.results["meta"]["targets"][target].get("calibration", {}).get("prefill_ms", {})
        return prefill.get(str(tokens), prefill.get(tokens))

    def prompt_rate(self, target: str) -> float | None:
        """Prompt tokens per second over the calibrated long prefill."""
        long = self._lengths()[1]
        return long / (ms / 1000) if (ms := self.prefill_ms(target, long)) else None

    def stop_latency(self) -> str | None:
        rows = self._spread_rows(REPORTED_STOPS, ("client_ms", *SPREAD), ("server_ms", *SPREAD))
        return table("scenario|engine|n|client p50|p90|p99|max|server p50|p90|p99|max", rows)

    def tokens_after_cancel(self) -> str | None:
        rows = []
        groups = [(self.titles[scenario], (scenario,)) for scenario in REPORTED_STOPS]
        for title, scenarios in groups + [("**all cancels**", REPORTED_STOPS)]:
            group = len(rows)
            for target in self.targets:
                samples = [s for s in self.samples if s["target"] == target and s["scenario"] in scenarios]
                if not samples:
                    continue
                after = tokens_after_cancel(samples)
                hist = " ".join(f"{k}: {v}" for k, v in sorted(Counter(after).items()))
                frames = max((s["frames_after_cancel"] for s in samples), default=None)
                rows.append(
                    [title if len(rows) == group else "", target, str(len(after)), hist or "–"]
                    + [show(max(after, default=None)), show(frames)]
                )
        return table(
            "scenario|engine|n|tokens after cancel (server): histogram|max|"
            "token frames received after the cancel was sent: max",
            rows,
        )

    def tokens_wasted(self) -> str | None:
        rows = []
        runs = {(r["scenario"], r["target"]): r for r in self.results["runs"]}
        columns = (
            ("tokens_wasted", "mean", "max"),
            ("prompt_tokens_evaluated", "mean"),
            ("log_tokens_generated", "mean"),
        )
        for scenario in STOP_SCENARIOS + TIMEOUT_SCENARIOS + ("disconnect",):
            stats = {}
            for target in self.targets:
                # By the scenario the request was sent in: its prompt length is what it can waste.
                samples = [
                    s
                    for s in self.samples
                    if s["target"] == target
                    and s.get("tokens_wasted") is not None
                    and s.get("measured_as", s["scenario"]) == scenario
                ]
                if samples:
                    stats[target] = (len(samples), figures(samples, *columns))
                else:
                    # No server log (an already running server): the /metrics delta over the requests sent.
                    run = runs.get((scenario, target))
                    delta = run.get("tokens_wasted_delta") if run else None
                    mean = delta / run["requests"] if delta is not None and run and run["requests"] else None
                    stats[target] = (run["requests"] if run else 0, [mean, None, None, None])
            rows += self._rows_with_ratio(self.titles.get(scenario, scenario), stats)
        return table(
            "scenario|engine|n|tokens wasted per request: mean|max|prompt tokens evaluated: mean|"
            "tokens generated: mean",
            rows,
        )

    def throughput(self) -> str | None:
        rows = []
        for streams in self.streams_seen():
            stats = {}
            for target in self.targets:
                samples = self.of("throughput", target, streams=streams)
                stats[target] = (
                    len(samples),
                    figures(samples, ("tokens_per_s_client", "p50"), ("tokens_per_s_server", "p50"))
                    # One aggregate per repetition.
                    + stat({s["rep"]: s.get("aggregate_tokens_per_s") for s in samples}.values(), "mean")
                    + figures(samples, ("ttft_client_ms", "p50", "p99"), ("ttft_server_ms", "p50")),
                )
            rows += self._rows_with_ratio(f"{streams} stream{'s' if streams > 1 else ''}", stats)
        return table(
            "streams|engine|n|decode tok/s per stream p50 (client)|(server)|aggregate tok/s|TTFT p50 ms (client)|"
            "TTFT p99|TTFT p50 (server)",
            rows,
        )

    def event_loop_lag(self) -> str | None:
        lag = self.results.get("lag", {})
        if not lag:
            return None
        stats = {}
        for target in self.targets:
            over = lag.get(target, {}).get("under_load_ms", [])
            stats[target] = (len(over), stat(over, "p50", "p99", "max"))
        return table("|engine|n|p50 ms|p99 ms|max ms", self._rows_with_ratio("10 ms sleep overshoot", stats))

    def timeouts(self) -> str | None:
        landed_in_prefill = any(s["scenario"] == "timeout_total_prefill" for s in self.samples)
        rows = self._spread_rows(
            TIMEOUT_SCENARIOS + (("timeout_total_prefill",) if landed_in_prefill else ()),
            ("server_over_ms", *SPREAD),
            ("client_over_ms", *SPREAD),
        )
        return table("deadline|engine|n|server p50|p90|p99|max|client p50|p90|p99|max", rows)

    def disconnect(self) -> str | None:
        rows = self._spread_rows(
            [s for s in ("disconnect", DISCONNECT_BUSY, NONSTREAM) if any(x["scenario"] == s for x in self.samples)],
            ("client_ms", *SPREAD),
            ("server_ms", "p50", "max"),
        )
        return table("|engine|n|p50|p90|p99|max|server log p50|max", rows)

    def prompt_speed(self) -> str | None:
        stats = {}
        for target in self.targets:
            samples = self.of("prefill_speed", target)
            stats[target] = (
                len(samples),
                figures(samples, ("ttft_server_ms", "p50", "p99"), ("prompt_tokens_per_s", "p50")),
            )
        return table(
            "|engine|n|TTFT p50 (ms)|TTFT p99 (ms)|prompt tok/s p50",
            self._rows_with_ratio(f"{self._lengths()[1]}-token prompt", stats),
        )

    def multi_turn(self) -> str | None:
        rows = []
        for target in self.targets:
            samples = self.of("multi_turn", target)
            if not samples:
                continue
            ttft = [self.turn_ttft(target, turn) for turn in range(1, TURNS + 1)]
            prompt = sum(s["prompt_tokens"] for s in samples)
            reused = sum(s["prompt_tokens_reused"] for s in samples)
            chats = sum(s["turn"] == TURNS for s in samples)
            rows.append(
                [target, str(chats)]
                + [fmt(v) for v in ttft]
                + [fmt(self.turn_ratio(target)), f"{reused / prompt:.0%}" if prompt else "–"]
            )
        turns = "|".join(f"turn {t} TTFT p50 (ms)" for t in range(1, TURNS + 1))
        return table(f"engine|chats|{turns}|turn {TURNS} / turn 1|prompt tokens reused", rows)

    def other_load(self) -> str | None:
        """How much CPU other processes took while the scenarios ran: context for every number here."""
        runs = [r for r in self.results["runs"] if r.get("cpu")]
        if not runs:
            return None
        weights = [r["cpu"]["wall_s"] for r in runs]
        mean = sum(r["cpu"]["other_cores"] * w for r, w in zip(runs, weights)) / sum(weights)
        worst = max(runs, key=lambda r: r["cpu"]["other_cores"])
        return (
            f"Other processes on the machine used {mean:.2f} cores on average while the scenarios ran "
            f"(most: {worst['cpu']['other_cores']:.2f} cores, during {worst['scenario']} on {worst['target']})."
        )

    def server_errors(self) -> str | None:
        """Requests a server ended with an error: the scenarios discard them, so only this says so."""
        if not (errors := self.results.get("server_errors")):
            return None
        counts = ", ".join(f"{target} {n}" for target, n in errors.items())
        return f"**Requests the servers ended with an error** ({counts}): no figure here counts them."

    def http_api(self) -> str | None:
        if not any(s["scenario"] in HTTP_SCENARIOS for s in self.samples):
            return None
        rows = []
        for scenario, label in HTTP_COMPARISONS:
            for target in self.targets:
                if samples := self.of(scenario, target):
                    after = tokens_after_cancel(samples)
                    values = figures(samples, ("client_ms", "p50", "p99"), ("server_ms", "p50", "p99"))
                    rows.append(
                        [label, target, str(len(samples))] + [fmt(v) for v in values] + [show(max(after, default=None))]
                    )
        return table("stop|engine|n|client p50|p99|server p50|p99|tokens after cancel, max", rows)

    def cancel_via_replica(self) -> str | None:
        """DELETE on the owner against DELETE on another replica (relayed through Redis), and the difference."""
        samples = [s for s in self.samples if s["scenario"] == CANCEL_VIA_REPLICA]
        if not samples:
            return None
        stats = {}
        for via in (VIA_OWNER, VIA_OTHER):
            mine = [s for s in samples if s["via"] == via]
            keys = ("delete_ms", "client_ms", "server_ms")
            stats[via] = (len(mine), figures(mine, *((key, "p50", "p99") for key in keys)))
        rows = [[f"DELETE on the {via}", str(n)] + [fmt(v) for v in values] for via, (n, values) in stats.items()]
        extra = [
            None if other is None or owner is None else other - owner
            for other, owner in zip(stats[VIA_OTHER][1], stats[VIA_OWNER][1])
        ]
        rows.append(["extra cost of the relay", ""] + [fmt(x) for x in extra])
        text = table(
            "|n|DELETE answered p50|p99|cancelled frame p50|p99|server (cancel read → loop exit) p50|p99", rows
        )
        if extra[1] is None or extra[3] is None:
            return text
        worst = max(extra[1], extra[3])
        return text + (
            f"\n\nCancelling via another replica instead of the owner costs {extra[1]:+.2f} ms at p99 "
            f"until the DELETE is answered and {extra[3]:+.2f} ms until the `cancelled` frame: "
            f"{'within' if worst <= RELAY_TARGET_MS else 'over'} the {RELAY_TARGET_MS:g} ms target. "
            "With few samples, p99 is close to the slowest sample of each side."
        )

    # The llama.cpp engine's figures -------------------------------------------------------

    def stop(self, scenario: str, target: str, key: str, side: str = "client_ms", **match) -> float | None:
        return figures(self.of(scenario, target, **match), (side, key))[0]

    def aggregate(self, target: str, streams: int) -> float | None:
        samples = self.of("throughput", target, streams=streams)
        return stat({s["rep"]: s.get("aggregate_tokens_per_s") for s in samples}.values(), "p50")[0]

    def decode_rate(self, target: str) -> float | None:
        return figures(self.of("throughput", target, streams=1), ("tokens_per_s_client", "p50"))[0]

    def turn_ttft(self, target: str, turn: int) -> float | None:
        return self.stop("multi_turn", target, "p50", "ttft_server_ms", turn=turn)

    def turn_ratio(self, target: str) -> float | None:
        first, last = self.turn_ttft(target, 1), self.turn_ttft(target, TURNS)
        return last / first if first and last else None

    def longest_stretch(self, scenario: str, target: str, phase: str) -> float | None:
        """The longest stretch between two stop checks, in ``phase``, over the scenario's requests
        (from the server's end-of-request log)."""
        return max((s[phase] for s in self.of(scenario, target) if s.get(phase)), default=None)

    def tokens_after_cancel_max(self, target: str) -> int | None:
        stops = [scenario for scenario, _, _ in self.stops]
        samples = [s for s in self.samples if s["target"] == target and s["scenario"] in stops]
        return max(tokens_after_cancel(samples), default=None)

    def lost_tokens(self, target: str) -> tuple[int, int] | None:
        samples = self.of(DECODE_CONCURRENT, target)
        others = sum(s["streams"] - 1 for s in samples)
        return (sum(s.get("others_lost_tokens") or 0 for s in samples), others) if samples else None

    def streams_seen(self) -> list[int]:
        return sorted({s["streams"] for s in self.samples if s["scenario"] == "throughput"})

    def prompt_tokens_per_s(self, target: str) -> float | None:
        """Measured on the long prompt where the run has it, else from the calibration."""
        return self.stop("prefill_speed", target, "p50", "prompt_tokens_per_s") or self.prompt_rate(target)

    def side_by_side(self) -> str | None:
        """Every headline figure of every engine beside the reference engine's, and their ratio; then,
        in words, where llama-server is better and where the reference is."""
        if LLAMA not in self.targets or self.ref is None:
            return None
        long, ref = self._lengths()[1], self.ref
        ttft = partial(self.stop, "throughput", key="p50", side="ttft_client_ms", streams=1)
        # (what, its figure for an engine, whether lower is better)
        rows: list[tuple[str, Callable[[str], float | None], bool]] = [
            ("decode tok/s, 1 stream, p50 (client)", self.decode_rate, False),
            *(
                (f"aggregate tok/s, {n} streams", partial(self.aggregate, streams=n), False)
                for n in self.streams_seen()
                if n > 1
            ),
            (f"prompt tok/s, ~{long:,}-token prompt", self.prompt_tokens_per_s, False),
            ("time to first token, 1 stream, p50 ms (client)", ttft, True),
            (f"multi-turn TTFT, turn {TURNS} ÷ turn 1 (server)", self.turn_ratio, True),
        ]
        for scenario, title in (
            ("decode_after_token", "stop right after a token"),
            ("decode", "stop at a random phase of decode"),
            ("prefill_long", f"stop during a ~{long:,}-token prompt"),
            (DECODE_CONCURRENT, f"stop 1 of {self.streams} concurrent streams, random phase"),
            ("disconnect", "disconnect during decode"),
            (DISCONNECT_BUSY, "disconnect while another client streams"),
        ):
            rows += [
                (f"{title}, client {key} ms", partial(self.stop, scenario, key=key), True) for key in ("p50", "p99")
            ]
        rows.append(("tokens after cancel, max over every cancel", self.tokens_after_cancel_max, True))
        others = [LLAMA] + [t for t in self.peers if t != LLAMA]
        lines, better = [], {LLAMA: [], ref: []}
        for what, figure, lower_better in rows:
            values = {t: figure(t) for t in [ref, *others]}
            if any(v is not None for v in values.values()):
                ratios = [x for t in others for x in (show(values[t]), fmt_ratio(values[t], values[ref]))]
                lines.append([what, show(values[ref]), *ratios])
            ours, peer = values[ref], values[LLAMA]
            if ours and peer and ours > 0 and peer > 0 and ours != peer:
                by = max(peer, ours) / min(peer, ours)
                winner = LLAMA if (peer < ours) == lower_better else ref
                better[winner].append(f"{what} ({by:.2f}×)" if by < 10 else f"{what} ({by:,.0f}×)")
        words = [f"{who} is better at: {'; '.join(what)}." for who, what in better.items() if what]
        if ran_to_end := sum(1 for s in self.samples if s["target"] == LLAMA and s.get("ran_to_end")):
            words.append(
                f"{ran_to_end} llama-server requests never noticed that their client had gone and "
                "generated every token they were asked for; their time is the time that took."
            )
        header = f"|{ref}" + "".join(f"|{t}|{t}/{ref}" for t in others)
        return f"{table(header, lines)}\n\n{' '.join(words)}"

    def server_side(self) -> str | None:
        """Our loop's own stop latency (cancel read → loop exited), which llama-server cannot report,
        beside the longest stretch between two stop checks that the same requests' evaluations had."""
        rows = []
        for scenario, title, phase in self.stops:
            for target in self.ours:
                if samples := self.of(scenario, target):
                    figures = stat((s["server_ms"] for s in samples), *SPREAD)
                    stretch = self.longest_stretch(scenario, target, phase)
                    rows.append([title, target, str(len(samples))] + [fmt(v) for v in figures + [stretch]])
        return table("stop|engine|n|server p50 ms|p90|p99|max|longest stretch between checks, ms", rows)

    def llama_targets(self) -> str | None:
        """The stop and speed targets for the llama.cpp engine, each with what bounds it."""
        if OURS_LLAMA not in self.targets:
            return None
        rows = []

        def target(what: str, figure: str, bound: str, met: bool | None) -> None:
            rows.append([what, figure, bound, "–" if met is None else "yes" if met else "**no**"])

        def at_most(value: float | None, bound: float | None) -> bool | None:
            return None if value is None or bound is None else value <= bound

        server50 = self.stop("decode_after_token", OURS_LLAMA, "p50", "server_ms")
        client50, client99 = (self.stop("decode_after_token", OURS_LLAMA, k) for k in ("p50", "p99"))
        bound50 = server50 + CLIENT_OVER_SERVER_MS if server50 is not None else None
        what = "stop right after a token: client"
        target(
            f"{what} p50 ms",
            fmt(client50),
            f"server p50 + {CLIENT_OVER_SERVER_MS} = {fmt(bound50)}",
            at_most(client50, bound50),
        )
        target(f"{what} p99 ms", fmt(client99), fmt(CLIENT_STOP_MS), at_most(client99, CLIENT_STOP_MS))
        for scenario, title, phase in self.stops[1:]:
            for engine in (OURS_LLAMA, OURS_LLAMA_SHARED) if scenario == DECODE_CONCURRENT else (OURS_LLAMA,):
                if not self.of(scenario, engine):
                    continue
                server, client = self.stop(scenario, engine, "p99", "server_ms"), self.stop(scenario, engine, "p99")
                stretch = self.longest_stretch(scenario, engine, phase)
                target(
                    f"stop, {title}, {engine}: server / client p99 ms",
                    f"{fmt(server)} / {fmt(client)} (longest stretch {fmt(stretch)})",
                    f"{fmt(SERVER_STOP_MS)} / {fmt(CLIENT_STOP_MS)}",
                    None if server is None or client is None else server <= SERVER_STOP_MS and client <= CLIENT_STOP_MS,
                )
        ours, peer = self.prompt_tokens_per_s(OURS_LLAMA), self.prompt_tokens_per_s(LLAMA)
        ratio = f"{fmt_ratio(ours, peer)} ({fmt(ours)} vs {fmt(peer)})"
        target("prompt tok/s, ours ÷ llama-server", ratio, "≥ 1.0×", None if not ours or not peer else ours >= peer)
        for streams in self.streams_seen():
            rate = self.decode_rate if streams == 1 else partial(self.aggregate, streams=streams)
            ours, peer, unedited = (rate(t) for t in (OURS_LLAMA, LLAMA, OURS_LLAMA_UNEDITED))
            ok = None if not ours or not peer else ours >= peer
            if ok is not None and unedited:
                ok = ok and ours >= UNEDITED_SPEED * unedited
            target(
                f"decode tok/s, {streams} stream{'s' if streams > 1 else ''}: ours ÷ llama-server, ours ÷ unedited",
                f"{fmt_ratio(ours, peer)} ({fmt(ours)} vs {fmt(peer)}), "
                f"{fmt_ratio(ours, unedited)} (vs {fmt(unedited)})",
                f"≥ 1.0×, ≥ {UNEDITED_SPEED}×",
                ok,
            )
        after_max = self.tokens_after_cancel_max(OURS_LLAMA)
        target("tokens after cancel: max", show(after_max), "0", at_most(after_max, 0))
        lost, peer_lost = self.lost_tokens(OURS_LLAMA), self.lost_tokens(LLAMA)
        target(
            f"{self.streams} concurrent streams: tokens the other streams lost",
            f"{lost[0]} over {lost[1]} streams" if lost else "–",
            "0" + (f" (llama-server: {peer_lost[0]} over {peer_lost[1]} streams)" if peer_lost else ""),
            lost[0] == 0 if lost else None,
        )
        return table(f"target|{OURS_LLAMA}|bound|met", rows)

    def storms(self) -> str | None:
        storms = (self.results.get("llama_native") or {}).get("storms")
        if not storms:
            return None
        rows = []
        for storm in storms:
            head = [str(storm["streams"]), str(storm["cycles"])]
            if storm.get("crashed"):
                rows.append(head + [f"**crashed** (exit {storm['returncode']})"] + ["–"] * 8)
                continue
            p50, p99 = stat(storm["cancel_to_exit_ms"], "p50", "p99")
            counts = ("cancelled", "done", "hangs", "kv_mismatches", "mismatches", "near_ties", "other")
            rows.append(head + ["0"] + [str(storm.get(k, "–")) for k in counts] + [f"{fmt(p50)} / {fmt(p99)}"])
        return table(
            "streams at once|aborts|crashes|cancelled|escaped (done)|hangs|KV positions ≠ n_held|"
            f"greedy tokens ≠ a fresh slot's|… parting at a near-tie (≤ {NEAR_TIE_LOGPROB})|other outcomes|"
            "cancel→exit p50 / p99 (ms)",
            rows,
        )

    def nodes(self) -> str | None:
        nodes = (self.results.get("llama_native") or {}).get("nodes")
        if not nodes:
            return None
        # Runs before the count was recorded said nothing of it.
        threads = f", {nodes['threads']} compute threads" if "threads" in nodes else ""
        return (
            f"Longest stretch between two stop checks, in-process, {len(nodes['longest_decode_node_ms'])} "
            f"runs of a {nodes['prompt_tokens']}-token prompt in {nodes['prefill_chunk']}-token chunks then "
            f"decode{threads}: decode {', '.join(fmt(v) for v in nodes['longest_decode_node_ms'])} ms; "
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
        if lengths := [r for r in rows if "diverged_at" not in r and r["ours_n"] != r["theirs_n"]]:
            words += f" {len(lengths)} agreed on every shared token but ended at different lengths."
        if diverged:
            first = diverged[0]
            words += (
                f" First divergence: token {first['diverged_at'] + 1}, ours {first['ours_piece']!r}, "
                f"llama-server {first['theirs_piece']!r}, log-probability gap "
                f"{fmt(first['logprob_gap'])}."
            )
        return words

    def native_loop(self) -> str | None:
        if not (native := self.results.get("native")):
            return None
        from .inprocess.native import markdown

        return markdown(native)

    @property
    def loads(self) -> list[float]:
        """The machine's 1-minute load average as each scenario part started."""
        return [r["load_average"][0] for r in self.results["runs"] if r.get("load_average")]

    @property
    def shared_threads(self) -> bool:
        """Whether ours ran with its default threads: generations share the cores (``--shared-threads``)."""
        return "--shared-threads" in self.results["meta"]["command"]

    def markdown(self) -> str:
        """The run's tables, each with what it measures."""
        return render("report.md.j2", r=self)

    def results_section(self, tables: str, chart: str) -> str:
        """The run's section of RESULTS.md: how it was measured, then ``tables`` and the chart."""
        return render("results.md.j2", r=self, tables=tables, chart=chart, busy_max_tokens=BUSY_MAX_TOKENS)

    def in_process_section(self) -> str | None:
        """The section of RESULTS.md for what the run measured in-process on the llama.cpp engine."""
        return render("inprocess.md.j2", r=self) if self.results.get("llama_native") else None


TEMPLATES = jinja2.Environment(
    loader=jinja2.FileSystemLoader(BENCH_DIR),
    undefined=jinja2.ChainableUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
)
TEMPLATES.filters |= {
    "loads": lambda values, between=" / ": between.join(f"{v:.2f}" for v in values),
    "count": lambda value: "unlimited (time-boxed)" if value is None else str(value),
    "shell": shlex.join,
    "median": statistics.median,
}


def render(template: str, **values) -> str:
    """A template of bench/ filled in, with one blank line at most between its parts."""
    return re.sub(r"\n{3,}", "\n\n", TEMPLATES.get_template(template).render(**values)).strip("\n") + "\n"


def write_json(results: dict, path: Path) -> None:
    path.write_text(json.dumps(results, indent=1))


def plot_stop_latency_cdf(results: dict, path: Path) -> None:
    """One panel per stop scenario: the CDF of stop latency, ours against the baseline, log time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    report = Report(results)

    # One shared time axis, so the panels can be compared at a glance.
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), sharex=True, sharey=True)
    for ax, scenario in zip(axes.flat, REPORTED_STOPS):
        for target in report.targets:
            samples = report.of(scenario, target)
            for key, style, label in (("client_ms", "-", "client"), ("server_ms", "--", "server")):
                values = np.sort([s[key] for s in samples if s.get(key) is not None])
                if not len(values):
                    continue
                # Log axis: a latency below the clock's resolution is drawn at 1 µs.
                values = np.maximum(values, 1e-3)
                # Start each curve at 0 so that its first step is visible.
                x = np.concatenate([[values[0]], values])
                cdf = np.concatenate([[0.0], np.arange(1, len(values) + 1) / len(values)])
                color = f"tab:{COLORS.get(target, 'green')}"
                ax.step(x, cdf, style, where="post", color=color, label=f"{target} ({label}), n={len(values)}")
        ax.set_xscale("log")
        ax.set_ylim(0, 1.02)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(report.titles[scenario])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    for ax in axes.flat[len(REPORTED_STOPS) :]:
        ax.set_visible(False)
    for ax in axes[-1, :]:
        ax.set_xlabel("stop latency (ms, log scale)")
    for ax in axes[:, 0]:
        ax.set_ylabel("fraction of cancels")
    fig.suptitle(
        f"Stop latency, {results['meta']['model']}: "
        + ", ".join(report.targets)
        + " (ours: Stopline on ctransformers; ours_llama: Stopline on llama.cpp)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# Every section of RESULTS.md follows this header; the file holds one section per model.
RESULTS_HEADER = "# Stopline benchmark results\n"


def results_key(meta: dict) -> str:
    """A run's section of RESULTS.md: one per model, and one more for runs whose generations share the cores."""
    return f"{meta['model_choice']}-shared-cores" if "--shared-threads" in meta["command"] else meta["model_choice"]


def write_results_section(path: Path, key: str, section: str, after: str | None = None) -> None:
    """Put ``section`` between its key's markers in RESULTS.md, keeping the other sections; a new
    section goes right after section ``after`` where there is one, else at the end."""
    begin, end = f"<!-- results:{key} -->", f"<!-- /results:{key} -->"
    text = path.read_text() if path.is_file() else ""
    if "<!-- results:" not in text:
        text = RESULTS_HEADER
    block = f"{begin}\n{section}{end}\n"
    anchor = f"<!-- /results:{after} -->\n"
    if begin in text and end in text:
        before, rest = text.split(begin, 1)
        rest = rest.split(end, 1)[1].lstrip("\n")
    elif after is not None and anchor in text:
        before, rest = text.split(anchor, 1)
        before += anchor + "\n"
        rest = rest.lstrip("\n")
    else:
        before, rest = text.rstrip("\n") + "\n\n", ""
    path.write_text(before + block + ("\n" + rest if rest else ""))
