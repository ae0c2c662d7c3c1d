"""Turn the samples into tables (Markdown), a JSON file and the stop-latency CDF chart."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np

from .llama_server import DISCONNECT_BUSY, NONSTREAM
from .scenarios import (
    CANCEL_VIA_REPLICA,
    DECODE_CONCURRENT,
    HTTP_SCENARIOS,
    STOP_SCENARIOS,
    TIMEOUT_SCENARIOS,
    VIA_OTHER,
    VIA_OWNER,
)

OURS, BASELINE, LLAMA, BETWEEN_STEPS = "ours", "baseline", "llama-server", "ours_between_steps"
OURS_LLAMA, OURS_LLAMA_BETWEEN_STEPS = "ours_llama", "ours_llama_between_steps"
OURS_LLAMA_SHARED = "ours_llama_shared"
OURS_LLAMA_UNEDITED = "ours_llama_unedited"
# Engines compared with the reference engine (ours, or ours_llama where ctransformers cannot run the
# model), each in a "<peer>/<reference>" ratio row: Stopline's loop on llama.cpp (a context per slot,
# and all slots sharing each step), the same loops stopping between steps only, the usual Python
# pattern, and llama.cpp's server.
PEERS = (
    OURS_LLAMA,
    OURS_LLAMA_SHARED,
    OURS_LLAMA_UNEDITED,
    BETWEEN_STEPS,
    OURS_LLAMA_BETWEEN_STEPS,
    BASELINE,
    LLAMA,
)
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


def summary(values) -> dict | None:
    v = np.array([x for x in values if x is not None], dtype=float)
    if not len(v):
        return None
    return {
        "n": int(len(v)),
        "p50": float(np.percentile(v, 50)),
        "p90": float(np.percentile(v, 90)),
        "p99": float(np.percentile(v, 99)),
        "max": float(v.max()),
        "mean": float(v.mean()),
    }


def fmt(x: float | None) -> str:
    if x is None:
        return "–"
    a = abs(x)
    if a >= 100:
        return f"{x:.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def fmt_ratio(base: float | None, ours: float | None) -> str:
    if base is None or ours is None or ours <= 0 or base < 0:
        return "–"
    r = base / ours
    return f"**{r:.0f}×**" if r >= 100 else f"**{r:.1f}×**" if r >= 10 else f"**{r:.2f}×**"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


class Report:
    def __init__(self, results: dict):
        self.results = results
        self.samples = results["samples"]
        self.targets = list(results["meta"]["targets"])
        # The engine every ratio is taken against.
        self.ref = next((t for t in (OURS, OURS_LLAMA) if t in self.targets), None)
        self.peers = [p for p in PEERS if p in self.targets and p != self.ref] if self.ref else []

    def of(self, scenario: str, target: str, **match) -> list[dict]:
        return [
            s
            for s in self.samples
            if s["scenario"] == scenario and s["target"] == target and all(s.get(k) == v for k, v in match.items())
        ]

    def _rows_with_ratio(self, label: str, stats: dict[str, list], extra=None) -> list[list[str]]:
        """One row per target, then <peer>/ours for every column and peer. ``stats[target]`` is a list of
        (count, [values]) cells; the count column gets no ratio."""
        rows = []
        for target in self.targets:
            count, values = stats[target]
            rows.append([label if not rows else "", target, str(count)] + [fmt(v) for v in values])
        for peer in self.peers:
            rows.append(
                ["", f"{peer}/{self.ref}", ""] + [fmt_ratio(p, o) for p, o in zip(stats[peer][1], stats[self.ref][1])]
            )
        return rows

    # Sections -----------------------------------------------------------------------

    def calibration(self) -> str:
        rows = []
        for target in self.targets:
            info = self.results["meta"]["targets"][target]
            cal = info.get("calibration", {})
            prefill = cal.get("prefill_ms", {})
            rows.append(
                [
                    target,
                    str(info.get("prefill_chunk", "–")),
                    _threads(target, info),
                    str(info.get("slots", "–")),
                ]
                + [fmt(prefill.get(str(k), prefill.get(k))) for k in self._lengths()]
                + [fmt(cal.get("step_ms")), fmt(self.prompt_rate(target))]
            )
        short, long = self._lengths()
        return _table(
            [
                "engine",
                "prompt tokens per uninterruptible step",
                "threads per slot",
                "slots",
                f"prefill, {short}-token prompt (ms)",
                f"prefill, {long}-token prompt (ms)",
                "decode step (ms)",
                f"prompt tok/s ({long}-token prompt)",
            ],
            rows,
        )

    def prompt_rate(self, target: str) -> float | None:
        """Prompt tokens per second over the calibrated long prefill."""
        prefill = self.results["meta"]["targets"][target].get("calibration", {}).get("prefill_ms", {})
        long = self._lengths()[1]
        ms = prefill.get(str(long), prefill.get(long))
        return long / (ms / 1000) if ms else None

    def _lengths(self) -> tuple[int, int]:
        plan = self.results["meta"]["plan"]
        return plan["short_tokens"], plan["long_tokens"]

    def stop_latency(self) -> str:
        rows = []
        for scenario in REPORTED_STOPS:
            stats = {}
            for target in self.targets:
                samples = self.of(scenario, target)
                client = summary(s["client_ms"] for s in samples)
                server = summary(s["server_ms"] for s in samples)
                stats[target] = (
                    len(samples),
                    [_get(client, k) for k in ("p50", "p90", "p99", "max")]
                    + [_get(server, k) for k in ("p50", "p90", "p99", "max")],
                )
            rows += self._rows_with_ratio(SCENARIO_TITLES[scenario], stats)
        return _table(
            ["scenario", "engine", "n", "client p50", "p90", "p99", "max", "server p50", "p90", "p99", "max"], rows
        )

    def tokens_after_cancel(self) -> str:
        rows = []
        for scenario in REPORTED_STOPS + ("all",):
            for target in self.targets:
                samples = [
                    s
                    for s in self.samples
                    if s["target"] == target
                    and s["scenario"] in REPORTED_STOPS
                    and (scenario == "all" or s["scenario"] == scenario)
                ]
                after = [s["tokens_after_cancel"] for s in samples if s.get("tokens_after_cancel") is not None]
                frames = [s["frames_after_cancel"] for s in samples]
                hist = " ".join(f"{k}: {v}" for k, v in sorted(Counter(after).items()))
                rows.append(
                    [
                        SCENARIO_TITLES.get(scenario, "**all cancels**") if target == self.targets[0] else "",
                        target,
                        str(len(after)),
                        hist or "–",
                        str(max(after)) if after else "–",
                        str(max(frames)) if frames else "–",
                    ]
                )
        return _table(
            [
                "scenario",
                "engine",
                "n",
                "tokens after cancel (server): histogram",
                "max",
                "token frames received after the cancel was sent: max",
            ],
            rows,
        )

    def tokens_wasted(self) -> str:
        rows = []
        runs = {(r["scenario"], r["target"]): r for r in self.results["runs"]}
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
                    wasted = summary(s["tokens_wasted"] for s in samples)
                    prompt = summary(s["prompt_tokens_evaluated"] for s in samples)
                    generated = summary(s["log_tokens_generated"] for s in samples)
                    stats[target] = (
                        len(samples),
                        [_get(wasted, "mean"), _get(wasted, "max"), _get(prompt, "mean"), _get(generated, "mean")],
                    )
                else:
                    # No server log (an already running server): the /metrics delta over the requests sent.
                    run = runs.get((scenario, target))
                    delta = run.get("tokens_wasted_delta") if run else None
                    mean = delta / run["requests"] if delta is not None and run["requests"] else None
                    stats[target] = (run["requests"] if run else 0, [mean, None, None, None])
            rows += self._rows_with_ratio(SCENARIO_TITLES.get(scenario, scenario), stats)
        return _table(
            [
                "scenario",
                "engine",
                "n",
                "tokens wasted per request: mean",
                "max",
                "prompt tokens evaluated: mean",
                "tokens generated: mean",
            ],
            rows,
        )

    def throughput(self) -> str:
        rows = []
        streams_seen = sorted({s["streams"] for s in self.samples if s["scenario"] == "throughput"})
        for streams in streams_seen:
            stats = {}
            for target in self.targets:
                samples = self.of("throughput", target, streams=streams)
                rate = summary(s["tokens_per_s_client"] for s in samples)
                rate_server = summary(s["tokens_per_s_server"] for s in samples)
                # One aggregate per repetition.
                aggregate = summary({s["rep"]: s.get("aggregate_tokens_per_s") for s in samples}.values())
                ttft = summary(s["ttft_client_ms"] for s in samples)
                ttft_server = summary(s["ttft_server_ms"] for s in samples)
                stats[target] = (
                    len(samples),
                    [
                        _get(rate, "p50"),
                        _get(rate_server, "p50"),
                        _get(aggregate, "mean"),
                        _get(ttft, "p50"),
                        _get(ttft, "p99"),
                        _get(ttft_server, "p50"),
                    ],
                )
            rows += self._rows_with_ratio(f"{streams} stream{'s' if streams > 1 else ''}", stats)
        return _table(
            [
                "streams",
                "engine",
                "n",
                "decode tok/s per stream p50 (client)",
                "(server)",
                "aggregate tok/s",
                "TTFT p50 ms (client)",
                "TTFT p99",
                "TTFT p50 (server)",
            ],
            rows,
        )

    def event_loop_lag(self) -> str | None:
        lag = self.results.get("lag", {})
        if not lag:
            return None
        stats = {}
        for target in self.targets:
            over = lag.get(target, {}).get("under_load_ms", [])
            s = summary(over)
            stats[target] = (len(over), [_get(s, "p50"), _get(s, "p99"), _get(s, "max")])
        return _table(
            ["", "engine", "n", "p50 ms", "p99 ms", "max ms"], self._rows_with_ratio("10 ms sleep overshoot", stats)
        )

    def timeouts(self) -> str:
        rows = []
        landed_in_prefill = any(s["scenario"] == "timeout_total_prefill" for s in self.samples)
        for scenario in TIMEOUT_SCENARIOS + (("timeout_total_prefill",) if landed_in_prefill else ()):
            stats = {}
            for target in self.targets:
                samples = self.of(scenario, target)
                server = summary(s["server_over_ms"] for s in samples)
                client = summary(s["client_over_ms"] for s in samples)
                stats[target] = (
                    len(samples),
                    [_get(server, k) for k in ("p50", "p90", "p99", "max")]
                    + [_get(client, k) for k in ("p50", "p90", "p99", "max")],
                )
            rows += self._rows_with_ratio(SCENARIO_TITLES[scenario], stats)
        return _table(
            ["deadline", "engine", "n", "server p50", "p90", "p99", "max", "client p50", "p90", "p99", "max"], rows
        )

    def disconnect(self) -> str:
        rows = []
        for scenario in ("disconnect", DISCONNECT_BUSY, NONSTREAM):
            if not any(s["scenario"] == scenario for s in self.samples):
                continue
            stats = {}
            for target in self.targets:
                samples = self.of(scenario, target)
                client = summary(s["client_ms"] for s in samples)
                server = summary(s.get("server_ms") for s in samples)
                stats[target] = (
                    len(samples),
                    [_get(client, k) for k in ("p50", "p90", "p99", "max")]
                    + [_get(server, "p50"), _get(server, "max")],
                )
            rows += self._rows_with_ratio(SCENARIO_TITLES[scenario], stats)
        return _table(["", "engine", "n", "p50", "p90", "p99", "max", "server log p50", "max"], rows)

    # Against llama-server ---------------------------------------------------------------

    def _headlines(self) -> list[tuple[str, float | None, float | None, bool]]:
        """(what, ours, llama-server, lower is better) for the figures a reader compares first."""

        def stop(scenario, key="p50"):
            return [_get(summary(s["client_ms"] for s in self.of(scenario, t)), key) for t in (self.ref, LLAMA)]

        def rate(key, streams, stat="p50"):
            return [
                _get(summary(s.get(key) for s in self.of("throughput", t, streams=streams)), stat)
                for t in (self.ref, LLAMA)
            ]

        streams = max((s["streams"] for s in self.samples if s["scenario"] == "throughput"), default=1)
        long = self._lengths()[1]
        rows = [
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
            rows.append(
                (f"decode tok/s, {streams} streams, aggregate", *rate("aggregate_tokens_per_s", streams, "mean"), False)
            )
        rows.append(
            (f"prompt tok/s, {long:,}-token prompt", self.prompt_rate(self.ref), self.prompt_rate(LLAMA), False)
        )
        return rows

    def against_llama_server(self) -> str | None:
        """The headline figures side by side, and in plain words where llama-server is better."""
        if LLAMA not in self.targets or self.ref is None:
            return None
        ref = self.ref
        rows, better = [], {LLAMA: [], ref: []}
        for what, ours, peer, lower_better in self._headlines():
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
        ran_to_end = sum(1 for s in self.samples if s["target"] == LLAMA and s.get("ran_to_end"))
        if ran_to_end:
            words.append(
                f"{ran_to_end} llama-server requests never noticed that their client had gone and "
                "generated every token they were asked for; their time is the time that took."
            )
        return _table(["", ref, LLAMA, f"llama-server/{ref}", "better"], rows) + "\n\n" + " ".join(words)

    def http_api(self) -> str | None:
        if not any(s["scenario"] in HTTP_SCENARIOS for s in self.samples):
            return None
        rows = []
        for scenario, label in HTTP_COMPARISONS:
            for target in self.targets:
                samples = self.of(scenario, target)
                if not samples:
                    continue
                client = summary(s["client_ms"] for s in samples)
                server = summary(s.get("server_ms") for s in samples)
                after = [s["tokens_after_cancel"] for s in samples if s.get("tokens_after_cancel") is not None]
                rows.append(
                    [
                        label,
                        target,
                        str(len(samples)),
                        fmt(_get(client, "p50")),
                        fmt(_get(client, "p99")),
                        fmt(_get(server, "p50")),
                        fmt(_get(server, "p99")),
                        str(max(after)) if after else "–",
                    ]
                )
        return _table(
            ["stop", "engine", "n", "client p50", "p99", "server p50", "p99", "tokens after cancel, max"], rows
        )

    def cancel_via_replica(self) -> str | None:
        """DELETE on the owner against DELETE on another replica (relayed through Redis), and the difference."""
        samples = [s for s in self.samples if s["scenario"] == CANCEL_VIA_REPLICA]
        if not samples:
            return None
        stats = {}
        for via in (VIA_OWNER, VIA_OTHER):
            mine = [s for s in samples if s["via"] == via]
            stats[via] = (
                len(mine),
                summary(s["delete_ms"] for s in mine),
                summary(s["client_ms"] for s in mine),
                summary(s["server_ms"] for s in mine),
            )
        rows = []
        for via in (VIA_OWNER, VIA_OTHER):
            count, delete, frame, server = stats[via]
            rows.append(
                [f"DELETE on the {via}", str(count)]
                + [fmt(_get(x, k)) for x in (delete, frame, server) for k in ("p50", "p99")]
            )
        extra = [
            None
            if _get(stats[VIA_OTHER][i], k) is None or _get(stats[VIA_OWNER][i], k) is None
            else _get(stats[VIA_OTHER][i], k) - _get(stats[VIA_OWNER][i], k)
            for i in (1, 2, 3)
            for k in ("p50", "p99")
        ]
        rows.append(["extra cost of the relay", ""] + [fmt(x) for x in extra])
        table = _table(
            [
                "",
                "n",
                "DELETE answered p50",
                "p99",
                "cancelled frame p50",
                "p99",
                "server (cancel read → loop exit) p50",
                "p99",
            ],
            rows,
        )
        if extra[1] is None or extra[3] is None:
            return table
        worst = max(extra[1], extra[3])
        return table + (
            f"\n\nCancelling via another replica instead of the owner costs {extra[1]:+.2f} ms at p99 "
            f"until the DELETE is answered and {extra[3]:+.2f} ms until the `cancelled` frame: "
            f"{'within' if worst <= RELAY_TARGET_MS else 'over'} the {RELAY_TARGET_MS:g} ms target. "
            "With few samples, p99 is close to the slowest sample of each side."
        )

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

    def prompt_speed(self) -> str:
        stats = {}
        for target in self.targets:
            samples = self.of("prefill_speed", target)
            ttft = summary(s["ttft_server_ms"] for s in samples)
            rate = summary(s["prompt_tokens_per_s"] for s in samples)
            stats[target] = (len(samples), [_get(ttft, "p50"), _get(ttft, "p99"), _get(rate, "p50")])
        return _table(
            ["", "engine", "n", "TTFT p50 (ms)", "TTFT p99 (ms)", "prompt tok/s p50"],
            self._rows_with_ratio(f"{self._lengths()[1]}-token prompt", stats),
        )

    def multi_turn(self) -> str:
        from .scenarios import TURNS

        rows = []
        for target in self.targets:
            samples = self.of("multi_turn", target)
            if not samples:
                continue
            by_turn = {t: [s for s in samples if s["turn"] == t] for t in range(1, TURNS + 1)}
            ttft = [_get(summary(s["ttft_server_ms"] for s in by_turn[t]), "p50") for t in by_turn]
            prompt = sum(s["prompt_tokens"] for s in samples)
            reused = sum(s["prompt_tokens_reused"] for s in samples)
            ratio = ttft[-1] / ttft[0] if ttft[0] and ttft[-1] else None
            rows.append(
                [target, str(len(by_turn[TURNS]))]
                + [fmt(v) for v in ttft]
                + [fmt(ratio), f"{reused / prompt:.0%}" if prompt else "–"]
            )
        return _table(
            ["engine", "chats"]
            + [f"turn {t} TTFT p50 (ms)" for t in range(1, TURNS + 1)]
            + [f"turn {TURNS} / turn 1", "prompt tokens reused"],
            rows,
        )

    def markdown(self) -> str:
        parts = []
        peer = self.against_llama_server()
        if peer:
            parts += ["### Against llama-server", LLAMA_METHOD, peer]
        parts += ["### Calibration", self.calibration()]
        load = self.other_load()
        if load:
            parts.append(load)
        parts += [
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
        ]
        lag = self.event_loop_lag()
        if lag:
            parts += [
                "### Event-loop lag under load (server process)",
                "A task on the server's event loop sleeps 10 ms over and over; this is how late it woke, "
                "over all the time the scenarios ran against that server.",
                lag,
            ]
        parts += [
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
        ]
        if self.results.get("native"):
            from .native import markdown as native_markdown

            parts += [
                "### The native loop, in-process",
                "Prompt speed on a 512-token prompt by chunk size: the stock evaluation (no hook, logits "
                "for every token), the step hook with full logits, and the hook with the output projection "
                "for the last token only (the default); the longest graph node is the most a stop waits. "
                "Then the abort storm: one greedy generation cancelled at random moments, over and over, on "
                "one slot; every run that escaped its cancel, and a final one, is compared with a fresh "
                "slot's tokens.",
                native_markdown(self.results["native"]),
            ]
        relay = self.cancel_via_replica()
        if relay:
            parts += [
                "### Cancel via another replica (ms)",
                "redis-server on loopback and two replicas sharing it (`--redis-url`). A WebSocket generation "
                "on the first replica is cancelled after 1–8 token frames by `DELETE /v1/generations/{id}`, "
                "sent alternately to the owner and to the other replica, which finds the owner in Redis and "
                "relays the cancel over pub/sub; both over a warm keep-alive connection. DELETE answered: "
                "sent → its answer, naming the outcome. Cancelled frame: sent → the `cancelled` frame on the "
                "generation's WebSocket. Server: `cancel_latency_ms` on the owner, from the cancel's arrival "
                "there.",
                relay,
            ]
        http = self.http_api()
        if http:
            parts += [
                "### The HTTP API next to the WebSocket (ms)",
                "Closed: the client closes the stream (the `openai` package's `stream.close()`) or drops the "
                "socket → `/metrics` shows no active generation; server: the `client_disconnected` cancel's "
                "`cancel_latency_ms`. DELETE: sent by a second client → `event: cancelled` received on the SSE "
                "stream; server: `cancel_latency_ms`. Cancel frame: as in the stop-latency table.",
                http,
            ]
        return "\n\n".join(parts) + "\n"


LLAMA_METHOD = (
    "llama-server (llama.cpp's HTTP server; `bench/llama_server.py`) is started by the benchmark on the same "
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


def _get(stats: dict | None, key: str) -> float | None:
    return None if stats is None else stats[key]


def write_json(results: dict, path: Path) -> None:
    path.write_text(json.dumps(results, indent=1))


def plot_stop_latency_cdf(results: dict, path: Path) -> None:
    """One panel per stop scenario: the CDF of stop latency, ours against the baseline, log time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = Report(results)
    colors = {
        OURS: "tab:blue",
        BASELINE: "tab:orange",
        LLAMA: "tab:green",
        BETWEEN_STEPS: "tab:purple",
        OURS_LLAMA: "tab:red",
        OURS_LLAMA_BETWEEN_STEPS: "tab:brown",
        OURS_LLAMA_SHARED: "tab:pink",
        OURS_LLAMA_UNEDITED: "tab:olive",
        "server": "tab:blue",
    }
    from matplotlib.ticker import FuncFormatter, NullFormatter

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
                ax.step(
                    x,
                    cdf,
                    style,
                    where="post",
                    color=colors.get(target, "tab:green"),
                    label=f"{target} ({label}), n={len(values)}",
                )
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


def _threads(target: str, info: dict) -> str:
    """Threads per slot; llama-server's threads serve all its slots at once."""
    threads = info.get("threads")
    if threads is None:
        return "–"
    return f"{threads} in all" if target == LLAMA else str(threads)
