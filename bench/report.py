"""One report for every run, whichever servers took part: its tables (Markdown), the JSON
file, the stop-latency CDF chart, and the run's section of bench/RESULTS.md."""

from __future__ import annotations

import json
import shlex
import statistics
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from .inprocess.llama_native import NEAR_TIE_LOGPROB
from .scenarios import (
    BUSY_MAX_TOKENS,
    CANCEL_VIA_REPLICA,
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
    DECODE_CONCURRENT: "decode, 1 of 4 concurrent streams, random phase",
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
    (DECODE_CONCURRENT, "1 of 4 concurrent streams, random phase", "longest_decode_node_ms"),
    ("prefill_long", "during the long prompt", "longest_prefill_node_ms"),
)
SPREAD = ("p50", "p90", "p99", "max")


def summary(values) -> dict | None:
    v = np.array([x for x in values if x is not None], dtype=float)
    if not len(v):
        return None
    percentiles = {f"p{q}": float(np.percentile(v, q)) for q in (50, 90, 99)}
    return {"n": int(len(v)), **percentiles, "max": float(v.max()), "mean": float(v.mean())}


def stat(values, *keys: str) -> list[float | None]:
    """Those figures of ``values``' summary (None where there are no values)."""
    s = summary(values)
    return [None if s is None else s[k] for k in keys]


def figures(samples, *columns: tuple[str, ...]) -> list[float | None]:
    """For each column group (key, statistic, ...): those statistics of the samples' ``key``."""
    return [v for key, *keys in columns for v in stat((s.get(key) for s in samples), *keys)]


def present(*texts: str | None) -> list[str]:
    """A section's texts (heading, introduction, body), or none of them when it has no body, the last."""
    return [t for t in texts if t is not None] if texts[-1] is not None else []


def tokens_after_cancel(samples) -> list[int]:
    """The server's tokens after the cancel, of the samples that report it."""
    return [s["tokens_after_cancel"] for s in samples if s.get("tokens_after_cancel") is not None]


def fmt(x: float | None) -> str:
    if x is None:
        return "–"
    a = abs(x)
    return f"{x:.0f}" if a >= 100 else f"{x:.1f}" if a >= 10 else f"{x:.2f}" if a >= 1 else f"{x:.3f}"


def show(value) -> str:
    """A count as an integer, any other figure as the report writes figures."""
    return str(value) if isinstance(value, int) else fmt(value)


def fmt_ratio(base: float | None, ours: float | None) -> str:
    if base is None or ours is None or ours <= 0 or base < 0:
        return "–"
    r = base / ours
    return f"**{r:.0f}×**" if r >= 100 else f"**{r:.1f}×**" if r >= 10 else f"**{r:.2f}×**"


def table(header: str, rows: list[list[str]]) -> str:
    """A Markdown table; ``header``'s columns are separated by ``|``."""
    columns = header.split("|")
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


class Report:
    def __init__(self, results: dict):
        self.results = results
        self.samples = results["samples"]
        self.targets = list(results["meta"]["targets"])
        # The engine every ratio is taken against.
        self.ref = next((t for t in (OURS, OURS_LLAMA) if t in self.targets), None)
        self.peers = [p for p in PEERS if p in self.targets and p != self.ref] if self.ref else []
        self.engines = [t for t in (OURS_LLAMA, LLAMA, OURS_LLAMA_UNEDITED, OURS) if t in self.targets]
        self.ours = [t for t in (OURS_LLAMA, OURS_LLAMA_SHARED, OURS_LLAMA_UNEDITED, OURS) if t in self.targets]

    def of(self, scenario: str, target: str, **match) -> list[dict]:
        return [
            s
            for s in self.samples
            if s["scenario"] == scenario and s["target"] == target and all(s.get(k) == v for k, v in match.items())
        ]

    def _rows_with_ratio(self, label: str, stats: dict[str, tuple[int, list]]) -> list[list[str]]:
        """One row per target, then <peer>/<reference> for every column and peer. ``stats[target]`` is
        (count, [values]); the count column gets no ratio."""
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
            rows += self._rows_with_ratio(SCENARIO_TITLES[scenario], stats)
        return rows

    def _lengths(self) -> tuple[int, int]:
        plan = self.results["meta"]["plan"]
        return plan["short_tokens"], plan["long_tokens"]

    # Sections -----------------------------------------------------------------------

    def calibration(self) -> str:
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

    def stop_latency(self) -> str:
        rows = self._spread_rows(REPORTED_STOPS, ("client_ms", *SPREAD), ("server_ms", *SPREAD))
        return table("scenario|engine|n|client p50|p90|p99|max|server p50|p90|p99|max", rows)

    def tokens_after_cancel(self) -> str:
        rows = []
        groups = [(SCENARIO_TITLES[scenario], (scenario,)) for scenario in REPORTED_STOPS]
        for title, scenarios in groups + [("**all cancels**", REPORTED_STOPS)]:
            for target in self.targets:
                samples = [s for s in self.samples if s["target"] == target and s["scenario"] in scenarios]
                after = tokens_after_cancel(samples)
                hist = " ".join(f"{k}: {v}" for k, v in sorted(Counter(after).items()))
                frames = max((s["frames_after_cancel"] for s in samples), default=None)
                first = target == self.targets[0]
                rows.append(
                    [title if first else "", target, str(len(after)), hist or "–"]
                    + [show(max(after, default=None)), show(frames)]
                )
        return table(
            "scenario|engine|n|tokens after cancel (server): histogram|max|"
            "token frames received after the cancel was sent: max",
            rows,
        )

    def tokens_wasted(self) -> str:
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
            rows += self._rows_with_ratio(SCENARIO_TITLES.get(scenario, scenario), stats)
        return table(
            "scenario|engine|n|tokens wasted per request: mean|max|prompt tokens evaluated: mean|"
            "tokens generated: mean",
            rows,
        )

    def throughput(self) -> str:
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

    def timeouts(self) -> str:
        landed_in_prefill = any(s["scenario"] == "timeout_total_prefill" for s in self.samples)
        rows = self._spread_rows(
            TIMEOUT_SCENARIOS + (("timeout_total_prefill",) if landed_in_prefill else ()),
            ("server_over_ms", *SPREAD),
            ("client_over_ms", *SPREAD),
        )
        return table("deadline|engine|n|server p50|p90|p99|max|client p50|p90|p99|max", rows)

    def disconnect(self) -> str:
        rows = self._spread_rows(
            [s for s in ("disconnect", DISCONNECT_BUSY, NONSTREAM) if any(x["scenario"] == s for x in self.samples)],
            ("client_ms", *SPREAD),
            ("server_ms", "p50", "max"),
        )
        return table("|engine|n|p50|p90|p99|max|server log p50|max", rows)

    def prompt_speed(self) -> str:
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

    def multi_turn(self) -> str:
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

    # Against llama-server ---------------------------------------------------------------

    def against_llama_server(self) -> str | None:
        """The headline figures side by side, and in plain words where llama-server is better."""
        if LLAMA not in self.targets or self.ref is None:
            return None
        ref, pair = self.ref, (self.ref, LLAMA)

        def stop(scenario, key="p50"):
            return [self.stop(scenario, t, key) for t in pair]

        def rate(key, streams, figure="p50"):
            return [figures(self.of("throughput", t, streams=streams), (key, figure))[0] for t in pair]

        streams = max(self.streams_seen(), default=1)
        long = self._lengths()[1]
        headlines = [
            (f"stop during a ~{long:,}-token prompt, p50 ms", *stop("prefill_long"), True),
            (f"stop during a ~{long:,}-token prompt, p99 ms", *stop("prefill_long", "p99"), True),
            ("disconnect while another client streams, p50 ms", *stop(DISCONNECT_BUSY), True),
            ("disconnect while another client streams, p99 ms", *stop(DISCONNECT_BUSY, "p99"), True),
            ("stop during decode, p50 ms", *stop("decode"), True),
            ("disconnect during decode, p50 ms", *stop("disconnect"), True),
            ("time to first token, one stream, p50 ms", *rate("ttft_client_ms", 1), True),
            ("decode tok/s, one stream, p50", *rate("tokens_per_s_client", 1), False),
        ]
        if streams > 1:
            what = f"decode tok/s, {streams} streams, aggregate"
            headlines.append((what, *rate("aggregate_tokens_per_s", streams, "mean"), False))
        headlines.append((f"prompt tok/s, {long:,}-token prompt", *map(self.prompt_rate, pair), False))
        rows, better = [], {LLAMA: [], ref: []}
        for what, ours, peer, lower_better in headlines:
            winner = "–"
            if ours is not None and peer is not None and ours > 0 and peer > 0:
                winner = LLAMA if (peer < ours if lower_better else peer > ours) else ref
                by = max(peer, ours) / min(peer, ours)
                better[winner].append(f"{what} ({by:.2f}×)" if by < 10 else f"{what} ({by:,.0f}×)")
            rows.append([what, fmt(ours), fmt(peer), fmt_ratio(peer, ours), winner])
        words = [
            f"llama-server is better at: {'; '.join(better[LLAMA])}."
            if better[LLAMA]
            else "llama-server is better at none of these."
        ]
        if better[ref]:
            words.append(f"{'Ours' if ref == OURS else ref} is better at: {'; '.join(better[ref])}.")
        if ran_to_end := sum(1 for s in self.samples if s["target"] == LLAMA and s.get("ran_to_end")):
            words.append(
                f"{ran_to_end} llama-server requests never noticed that their client had gone and "
                "generated every token they were asked for; their time is the time that took."
            )
        return table(f"|{ref}|{LLAMA}|llama-server/{ref}|better", rows) + "\n\n" + " ".join(words)

    # The llama.cpp engine's figures -------------------------------------------------------

    def stop(self, scenario: str, target: str, key: str, side: str = "client_ms", **match) -> float | None:
        return figures(self.of(scenario, target, **match), (side, key))[0]

    def aggregate(self, target: str, streams: int) -> float | None:
        samples = self.of("throughput", target, streams=streams)
        return stat({s["rep"]: s.get("aggregate_tokens_per_s") for s in samples}.values(), "p50")[0]

    def decode_rate(self, target: str) -> float | None:
        return figures(self.of("throughput", target, streams=1), ("tokens_per_s_client", "p50"))[0]

    def measured_prompt_rate(self, target: str) -> float | None:
        return self.stop("prefill_speed", target, "p50", "prompt_tokens_per_s")

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
        stops = [scenario for scenario, _, _ in STOPS]
        samples = [s for s in self.samples if s["target"] == target and s["scenario"] in stops]
        return max(tokens_after_cancel(samples), default=None)

    def lost_tokens(self, target: str) -> tuple[int, int] | None:
        samples = self.of(DECODE_CONCURRENT, target)
        return (sum(s.get("others_lost_tokens") or 0 for s in samples), 3 * len(samples)) if samples else None

    def streams_seen(self) -> list[int]:
        return sorted({s["streams"] for s in self.samples if s["scenario"] == "throughput"})

    def side_by_side(self) -> str:
        """Every headline figure: ours_llama, llama-server, their ratio, and the ctransformers engine."""
        long = self._lengths()[1]
        rows: list[tuple[str, Callable[[str], float | None]]] = [
            ("decode tok/s, 1 stream, p50 (client)", self.decode_rate)
        ]
        rows += [
            (f"aggregate tok/s, {n} concurrent streams, median of repetitions", partial(self.aggregate, streams=n))
            for n in self.streams_seen()
            if n > 1
        ]
        rows += [
            (f"prompt tok/s, ~{long:,}-token prompt, p50 (server)", self.measured_prompt_rate),
            (
                "time to first token, 1 stream, p50 ms (client)",
                partial(self.stop, "throughput", key="p50", side="ttft_client_ms", streams=1),
            ),
            (f"multi-turn TTFT, turn {TURNS} ÷ turn 1 (server)", self.turn_ratio),
        ]
        for scenario, title in (
            ("decode_after_token", "stop right after a token"),
            ("decode", "stop at a random phase of decode"),
            ("prefill_long", f"stop during a ~{long:,}-token prompt"),
            (DECODE_CONCURRENT, "stop 1 of 4 concurrent streams, random phase"),
        ):
            rows += [(f"{title}, client {key} ms", partial(self.stop, scenario, key=key)) for key in ("p50", "p99")]
        rows.append(("tokens after cancel, max over every cancel", self.tokens_after_cancel_max))
        header = f"|{OURS_LLAMA}|{LLAMA}|{LLAMA}/{OURS_LLAMA}"
        unedited, ours = OURS_LLAMA_UNEDITED in self.engines, OURS in self.engines
        header += f"|{OURS_LLAMA_UNEDITED}|{OURS_LLAMA_UNEDITED}/{OURS_LLAMA}" if unedited else ""
        header += f"|{OURS} (ctransformers, this run)" if ours else ""
        lines = []
        for what, figure in rows:
            values = {t: figure(t) for t in self.engines}
            row = [what, show(values.get(OURS_LLAMA)), show(values.get(LLAMA))]
            row.append(fmt_ratio(values.get(LLAMA), values.get(OURS_LLAMA)))
            if unedited:
                row += [
                    show(values[OURS_LLAMA_UNEDITED]),
                    fmt_ratio(values[OURS_LLAMA_UNEDITED], values.get(OURS_LLAMA)),
                ]
            lines.append(row + ([show(values[OURS])] if ours else []))
        return table(header, lines)

    def server_side(self) -> str:
        """Our loop's own stop latency (cancel read → loop exited), which llama-server cannot report,
        beside the longest stretch between two stop checks that the same requests' evaluations had."""
        rows = []
        for scenario, title, phase in STOPS:
            for target in self.ours:
                if samples := self.of(scenario, target):
                    figures = stat((s["server_ms"] for s in samples), *SPREAD)
                    stretch = self.longest_stretch(scenario, target, phase)
                    rows.append([title, target, str(len(samples))] + [fmt(v) for v in figures + [stretch]])
        return table("stop|engine|n|server p50 ms|p90|p99|max|longest stretch between checks, ms", rows)

    def llama_targets(self) -> str:
        """The stop and speed targets for the llama.cpp engine, each with what bounds it."""
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
        for scenario, title, phase in STOPS[1:]:
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
        ours, peer = self.measured_prompt_rate(OURS_LLAMA), self.measured_prompt_rate(LLAMA)
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
            "4 concurrent streams: tokens the other streams lost",
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
            ms = sorted(storm["cancel_to_exit_ms"])
            p50 = statistics.median(ms) if ms else None
            p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))] if ms else None
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

    def llama_load(self) -> str:
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

    def llama_markdown(self) -> str | None:
        if OURS_LLAMA not in self.targets:
            return None
        return "\n\n".join(
            [
                self.llama_load(),
                "#### Side by side",
                "Each figure of Stopline on its llama.cpp engine beside llama-server's from the same run "
                "(same GGUF, same cores, equal threads in all), and, where it ran, the ctransformers engine's. "
                "Stops on llama-server are the client closing the stream (it has no cancel request), timed to "
                "its slot's release line.",
                self.side_by_side(),
                "#### Our loop's own stop latency (server: cancel read → loop exited)",
                self.server_side(),
                "#### Targets",
                self.llama_targets(),
                *present(self.nodes()),
                *present(
                    "#### Aborts at random moments (in-process, each storm in a child process)",
                    "Greedy generations of 4 tokens on a 40-token prompt (16-token chunks), cancelled at random "
                    "moments within a fresh or a cached run's length, on 1 thread; with 4 streams, the 4 sequences "
                    "of one llama.cpp context do it at once, sharing its steps. After every generation the slot's "
                    "KV cache must hold exactly the positions its record holds; every run that escaped its cancel, "
                    "and a final one per slot, must give a fresh slot's tokens, or part from them only where the "
                    "two likeliest tokens were within a near-tie (4 streams evaluate a prompt chunk beside other "
                    "sequences' tokens, in kernels of another shape, which sum in another order).",
                    self.storms(),
                ),
                *present("#### Greedy output against llama-server", self.greedy()),
            ]
        )

    def markdown(self) -> str:
        if native := self.results.get("native"):
            from .inprocess.native import markdown as native_markdown
        parts = [
            *present("### Against llama-server", LLAMA_METHOD, self.against_llama_server()),
            "### Calibration",
            self.calibration(),
            *present(self.other_load()),
            "### Stop latency (ms)",
            "Client: cancel frame sent → terminal message received. Server: `cancel_latency_ms`, "
            "cancel frame read → token loop exited.",
            self.stop_latency(),
            "### Tokens after cancel",
            "Server: the terminal frame's `tokens_after_cancel`, tokens the loop produced after the cancel "
            "was requested. Client: token frames that arrived after the cancel frame was sent.",
            self.tokens_after_cancel(),
            "### Tokens wasted per request",
            "`tokens_wasted` = prompt tokens evaluated + tokens generated, for requests that did not end "
            "with `done`; from the server's end-of-request log when the benchmark started the server, else "
            "the `stopline_tokens_wasted_total` delta on `/metrics` divided by the requests sent. Requests are "
            "grouped by the scenario they were sent in (a prefill cancel that landed in decode stays with its prompt). "
            "The baseline's tokens generated include the one it computes and discards after a stop.",
            self.tokens_wasted(),
            "### Prompt speed",
            "A long prompt with `max_tokens` 1: the server's `ttft_ms`, and prompt tokens evaluated per second.",
            self.prompt_speed(),
            "### Multi-turn chat",
            "Six turns on one connection, about 80 tokens of new text each. TTFT p50 per turn (server), "
            "and the share of all prompt tokens taken from a slot's KV cache.",
            self.multi_turn(),
            "### Decode throughput and time to first token",
            "Client rate: tokens after the first / time between the first and last token frames. "
            "Server rate: from `duration_ms` − `ttft_ms` of the `done` frame. TTFT includes any queueing.",
            self.throughput(),
            *present(
                "### Event-loop lag under load (server process)",
                "A task on the server's event loop sleeps 10 ms over and over; this is how late it woke, "
                "over all the time the scenarios ran against that server.",
                self.event_loop_lag(),
            ),
            "### Timeout precision (ms after the deadline)",
            "Server: `duration_ms` − deadline. Client: generate sent → terminal received, − deadline. "
            "A total timeout meant for the decode phase that fired before any token (the prefill ran "
            "longer than calibrated) is shown on its own row.",
            self.timeouts(),
            "### Disconnect to stop (ms)",
            "Socket dropped (no close handshake) → `/metrics` shows `stopline_active_generations 0` "
            "(1 while another client streams); llama-server: → its slot's release line. "
            "Server log: the `client_disconnected` cancel's `cancel_latency_ms`.",
            self.disconnect(),
            *present(
                "### The native loop, in-process",
                "Prompt speed on a 512-token prompt by chunk size: the stock evaluation (no hook, logits "
                "for every token), the step hook with full logits, and the hook with the output projection "
                "for the last token only (the default); the longest graph node is the most a stop waits. "
                "Then the abort storm: one greedy generation cancelled at random moments, over and over, on "
                "one slot; every run that escaped its cancel, and a final one, is compared with a fresh "
                "slot's tokens.",
                native_markdown(native) if native else None,
            ),
            *present(
                "### Cancel via another replica (ms)",
                "redis-server on loopback and two replicas sharing it (`--redis-url`). A WebSocket generation "
                "on the first replica is cancelled after 1–8 token frames by `DELETE /v1/generations/{id}`, "
                "sent alternately to the owner and to the other replica, which finds the owner in Redis and "
                "relays the cancel over pub/sub; both over a warm keep-alive connection. DELETE answered: "
                "sent → its answer, naming the outcome. Cancelled frame: sent → the `cancelled` frame on the "
                "generation's WebSocket. Server: `cancel_latency_ms` on the owner, from the cancel's arrival "
                "there.",
                self.cancel_via_replica(),
            ),
            *present(
                "### The HTTP API next to the WebSocket (ms)",
                "Closed: the client closes the stream (the `openai` package's `stream.close()`) or drops the "
                "socket → `/metrics` shows no active generation; server: the `client_disconnected` cancel's "
                "`cancel_latency_ms`. DELETE: sent by a second client → `event: cancelled` received on the SSE "
                "stream; server: `cancel_latency_ms`. Cancel frame: as in the stop-latency table.",
                self.http_api(),
            ),
        ]
        return "\n\n".join(parts) + "\n"


LLAMA_METHOD = (
    "llama-server (llama.cpp's HTTP server; `bench/drivers/llama_server.py`) is started by the benchmark on the same "
    "GGUF file, with the same context per slot, slots and sampling (temperature, top-k, top-p, repetition "
    "penalty; its extra min-p sampler off), as many compute threads in all as ours has over its slots, on the "
    "same cores, every prompt sent as the same token ids and evaluated whole (`cache_prompt` off, but in the "
    "multi-turn chat). It has no cancel request, so each stop is the client closing the connection: "
    "a closed stream for the stop scenarios (where ours gets a cancel frame), a reset connection for the "
    "disconnects. Ours counts as stopped when its terminal frame arrives (cancels) or when `/metrics` shows "
    "the generation gone (disconnects); llama-server counts as stopped when its log prints the release of "
    "the request's slot (each request is pinned to a slot with `id_slot`), stamped as the line arrives on "
    "the pipe from its stderr, and a `/slots` answer showing the slot idle follows. `/slots` is not polled "
    "in a loop to find the moment: each of its answers restarts the one-second wait after which llama-server's "
    "request handler checks whether its client is still connected, so a 1 ms poll would keep it from ever "
    "noticing a client that left while nothing was being written to it. That is the case the "
    '"disconnect while another client streams" rows measure: another client streams, and the measured '
    "client, non-streaming on llama-server (whose handler writes nothing until the end) and streaming on "
    "ours (the only mode of its protocol), goes away during decode. Tokens after the stop are derived from "
    "the slot's context size in the release line. Ratios are llama-server/ours: above 1, llama-server took "
    "longer to stop or reach its first token, or produced more tokens per second."
)


def shared_threads(meta: dict) -> bool:
    """Whether ours ran with its default threads: generations share the cores (``--shared-threads``)."""
    return "--shared-threads" in meta["command"]


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
        ax.set_title(SCENARIO_TITLES[scenario])
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
    return f"{meta['model_choice']}-shared-cores" if shared_threads(meta) else meta["model_choice"]


def results_section(results: dict, tables: str, chart: str) -> str:
    """One model's section of RESULTS.md: how it was measured, then its tables."""
    meta = results["meta"]
    m = meta["machine"]
    targets = meta["targets"]
    slots = next(iter(targets.values()))["slots"] if targets else "?"
    threads = targets.get("ours", targets.get("ours_llama", {})).get("threads", "?")
    load_start, load_end = meta["load_average_start"], meta["load_average_end"]
    skipped = meta.get("skipped_engines") or []
    wide = meta.get("wide_workers") or 0
    peer_threads = targets.get(LLAMA, {}).get("threads")
    llama_section = ""
    if llama := Report(results).llama_markdown():
        llama_section = f"### The llama.cpp engine against llama-server\n\n{llama}\n\n"
    heading = meta["model"]
    if shared_threads(meta):
        heading += (
            ", the llama.cpp engine on shared cores\n\nThe llama.cpp engine with its default threads (the running "
            "generations share the cores), against llama-server with as many threads in all."
        )
    return f"""## {heading}

- Command: `{meta["command"]}` ({meta["started_at"]})
- Machine: {m["cpu"]}{" (virtual machine)" if m.get("virtual") else ""}, {m["cores"]} cores
  ({m["cores_available"]} available to the benchmark), shared with other work; Python {m["python"]};
  load average (1 / 5 / 15 min) {_load(load_start)} at the start and {_load(load_end)} at the end; each
  scenario's own is in the JSON file
- Model: {meta["model"]} GGUF, context 2048 per slot; engines: {", ".join(targets)}{
        f" ({', '.join(skipped)} skipped: ctransformers cannot load this model)" if skipped else ""
    }
- Equal resources: every server is confined to the same cores ({",".join(map(str, meta["cpus"]))}, by
  `sched_setaffinity` in the child before it starts); ours: {_ours_threads(meta, slots, threads)};
  llama-server: one process, `--parallel {slots}`, `--threads {peer_threads or "–"}` (as many in
  all){_wide_note(wide, threads, shared_threads(meta))}
- Interleaving: each scenario's samples are taken in {meta["rounds"]} parts, the engines taking turns
  part by part, in alternating order; while one engine is measured (or calibrated) the other servers
  are paused (SIGSTOP), because an idle server's wake-ups (its event loop's timers) preempt a thread of
  a multi-threaded server, whose other threads then spin at ggml's barrier until it runs again
- Servers: one process each (`python -m bench serve`, or llama-server), on 127.0.0.1, started by the benchmark
- Prompts: about {meta["plan"]["short_tokens"]} tokens (short) and {meta["plan"]["long_tokens"]} tokens (long),
  each different, each asking for a long story; sampling at temperature 0.7
- Samples: {_count(meta["plan"]["requests"])} per scenario per engine, {_count(meta["plan"]["long_requests"])} for the
  long-prompt scenarios; one request at a time unless a scenario needs more

How the cancels are placed:

- **queued**: every slot runs a long generation; one more request is queued and cancelled 0–100 ms after
  its `accepted` frame (discarded if a slot freed up first).
- **prefill**: cancelled after a random delay shorter than the prompt's prefill time, measured beforehand
  (the calibration table). A request that had already received a token counts as a decode sample.
- **decode, random phase**: cancelled after 1–32 token frames plus a random fraction of a decode step.
- **decode, right after a token frame**: cancelled the moment the 1st–32nd token frame arrives, when the
  next decode step has just begun.
- **decode, 1 of 4 concurrent streams**: 4 streams decode at once (one per slot); the first is cancelled
  as in the random-phase case, the other 3 run on to their 96 tokens; tokens they fell short of are lost.
- **prompt speed**: a long prompt with `max_tokens` 1; the server's time to first token.
- **multi-turn**: a six-turn chat on one connection, about 80 tokens of new text per turn, 48-token answers;
  llama-server keeps the chat on one slot with `cache_prompt: true`, so it reuses its cache as ours does.
- **timeouts**: `timeout_s` = 1.25 × the short prompt's prefill + 100–600 ms; `ttft_timeout_s` = 5–25 % of
  the long prompt's prefill.
- **disconnect**: the socket is dropped after 1–32 token frames; `/metrics` is polled every ~1 ms until
  `stopline_active_generations` is 0 (the time is the arrival of the answer that showed it).
{_peer_method(results)}
{llama_section}{tables}
![Stop latency CDF per scenario, {meta["model"]}]({chart})

Every sample is in the JSON file the run wrote (`{meta["results_json"]}`).
"""


def write_results_section(path: Path, model: str, section: str) -> None:
    """Put ``section`` between this model's markers in RESULTS.md, keeping the other models' sections."""
    begin, end = f"<!-- results:{model} -->", f"<!-- /results:{model} -->"
    text = path.read_text() if path.is_file() else ""
    if "<!-- results:" not in text:
        text = RESULTS_HEADER
    block = f"{begin}\n{section}{end}\n"
    if begin in text and end in text:
        before, rest = text.split(begin, 1)
        after = rest.split(end, 1)[1].lstrip("\n")
        text = before + block + ("\n" + after if after else "")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text)


def _ours_threads(meta: dict, slots, threads) -> str:
    if shared_threads(meta):
        return (
            f"{slots} slots sharing {threads} compute threads (its default: a generation alone takes them "
            f"all, generations together divide them)"
        )
    return f"{slots} slots × {threads} compute thread per slot"


def _wide_note(wide: int, threads, shared: bool = False) -> str:
    if not wide:
        return ""
    total = threads if shared else wide * threads if isinstance(threads, int) else "?"
    return (
        f"; for the 4-stream figures every engine is restarted with {wide} slots "
        f"(llama-server `--parallel {wide}`, `--threads {total}`)"
    )


def _load(values) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


def _peer_method(results: dict) -> str:
    """The method bullets for the scenarios added for llama-server, when it took part."""
    meta = results["meta"]
    if LLAMA not in meta["targets"]:
        return ""
    peer = meta["targets"][LLAMA]
    return f"""- **disconnect while another client streams**: one client streams without pause on one slot; on the
  other, the measured client goes away during decode (ours: the WebSocket dropped after 1–32 token frames,
  `/metrics` polled until only the other generation is active; llama-server: a non-streaming request reset
  after its calibrated prefill plus 1–32 decode steps). A llama-server request that generated all its
  {BUSY_MAX_TOKENS} tokens never noticed; its time is the time that took.
- **non-streaming request, client gone** (llama-server only; ours streams every request): the same, with
  no other traffic.
- **llama-server** ({peer.get("source", "llama.cpp")}; `{shlex.join(peer.get("command", []))}`): every stop is
  the client closing the connection (it has no cancel request); it counts as stopped when its log prints
  the release of the request's slot, stamped as the line arrives; see "Against llama-server" below.
"""


def _count(value) -> str:
    return "unlimited (time-boxed)" if value is None else str(value)
