"""JSON logs (structlog) and Prometheus metrics, named from stopline/protocol/vocabulary.py."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .protocol.requests import Ending, Request
from .protocol.vocabulary import END_EVENTS, AbortMode, Outcome

if TYPE_CHECKING:
    from .engine.prompt_cache import PromptCache


def configure_logging(level: str = "info", log_format: str = "json", stream=None) -> str:
    """One line per event: a JSON object with an ISO 8601 UTC timestamp, or (``text``) a short
    sentence for people. ``auto`` is text on a terminal and JSON otherwise (a pipe, a file).
    Returns the format in force."""
    out = stream or sys.stdout
    if log_format == "auto":
        log_format = "text" if out.isatty() else "json"
    renderer: Any = ConsoleRenderer() if log_format == "text" else structlog.processors.JSONRenderer(ensure_ascii=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.WriteLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    return log_format


class ConsoleRenderer:
    """Each event as one short line for a person at a terminal: the time, a sentence for
    the events people look for, and the event name with its main fields for the rest."""

    # Fields every line has, or that only a machine reads.
    _QUIET = {"event", "level", "timestamp", "request_id", "user_id", "peer", "exception"}

    def __call__(self, logger, method_name: str, event: dict) -> str:
        clock = str(event.get("timestamp", ""))[11:19]
        level = event.get("level", "info")
        text = self._sentence(event) or self._fields(event)
        mark = "" if level in ("info", "debug") else f"{level.upper()}: "
        line = f"{clock} {mark}{text}"
        if event.get("exception"):
            line += "\n" + str(event["exception"])
        return line

    def _sentence(self, e: dict) -> str | None:
        name = e.get("event")
        if name == "server_started":
            return (
                f"Stopline is serving {e.get('model')} at {e.get('url')} (API: {e.get('http_api')}); "
                f"{e.get('workers')} slots, context {e.get('context_length')} tokens. Ctrl-C stops it."
            )
        if name == "generation_accepted":
            return f"request {e.get('id')} from {e.get('peer')}: {e.get('prompt_tokens')} prompt tokens"
        if name in END_EVENTS.values():
            took = e.get("duration_ms")
            seconds = f" in {took / 1000:.1f} s" if isinstance(took, int | float) else ""
            tokens = e.get("tokens_generated")
            # The ending's own figure (Ending.tokens_per_s), as the page shows it.
            rate = e.get("tokens_per_s")
            speed = f", {rate:.1f} tokens/s" if isinstance(rate, int | float) else ""
            latency = e.get("cancel_latency_ms")
            stop = f", stopped {latency:.1f} ms after the cancel" if isinstance(latency, int | float) else ""
            outcome = str(name).removeprefix("generation_")
            return f"request {e.get('id')} {outcome} ({e.get('reason')}): {tokens} tokens{seconds}{speed}{stop}"
        if name == "no_chat_template":
            return (
                f"{e.get('model')} has no chat template (a base model): a chat is completed as the plain text "
                "of its messages; --chat-template chatml, or a template file, gives it one"
            )
        if name == "server_stopping":
            return "stopping: cancelling every request"
        if name == "server_stopped":
            return "stopped"
        if name == "startup_failed":
            return f"could not start: {e.get('error')}"
        return None

    def _fields(self, e: dict) -> str:
        details = " ".join(f"{k}={v}" for k, v in e.items() if k not in self._QUIET and v is not None)
        return f"{str(e.get('event', '')).replace('_', ' ')}" + (f": {details}" if details else "")


log = structlog.get_logger("stopline")

# Stop latencies are in the low milliseconds (bench/RESULTS.md); the buckets start at 1 ms.
_LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _PromptCacheCollector(Collector):
    """The prompt cache's counts, as it keeps them (stopline/engine/prompt_cache.py)."""

    def __init__(self, cache: PromptCache):
        self.cache = cache

    def collect(self):
        stats = self.cache.stats
        counters = (
            ("stopline_prompt_cache_hits", "Prompts that took a prefix from the prompt cache.", stats.hits),
            (
                "stopline_prompt_cache_misses",
                "Prompts that looked in the prompt cache and took nothing from it.",
                stats.misses,
            ),
            (
                "stopline_prompt_tokens_cached",
                "Prompt tokens restored or shared from the prompt cache instead of evaluated (part of "
                "stopline_prompt_tokens_reused).",
                stats.tokens_restored,
            ),
            (
                "stopline_prompt_cache_live_hits",
                "Prompts that shared the cells of their prefix with another sequence of their context, "
                "running or idle, instead of a restore (part of stopline_prompt_cache_hits).",
                stats.live_hits,
            ),
            (
                "stopline_prompt_cache_live_tokens",
                "Prompt tokens shared from another sequence of their context instead of evaluated (part of "
                "stopline_prompt_tokens_cached).",
                stats.live_tokens,
            ),
            ("stopline_prompt_cache_saves", "KV states saved into the prompt cache.", stats.saves),
            (
                "stopline_prompt_cache_evictions",
                "KV states dropped from the prompt cache for room, least recently used first.",
                stats.evictions,
            ),
        )
        if self.cache.disk is not None:
            counters += (
                (
                    "stopline_prompt_cache_disk_hits",
                    "Prompts that took a prefix from the prompt cache's disk tier (part of "
                    "stopline_prompt_cache_hits).",
                    stats.disk_hits,
                ),
                (
                    "stopline_prompt_cache_disk_writes",
                    "KV states written to the prompt cache's disk tier.",
                    stats.disk_writes,
                ),
                (
                    "stopline_prompt_cache_disk_skipped",
                    "Files of the prompt cache's disk tier skipped and removed: corrupt, truncated, of another "
                    "format version or not what their name says.",
                    stats.disk_skipped,
                ),
                (
                    "stopline_prompt_cache_disk_evictions",
                    "KV states removed from the prompt cache's disk tier for room, least recently used first.",
                    stats.disk_evictions,
                ),
            )
        for name, documentation, value in counters:
            family = CounterMetricFamily(name, documentation)
            family.add_metric([], value)
            yield family
        gauges = (
            ("stopline_prompt_cache_bytes", "Bytes of KV states the prompt cache holds.", stats.bytes_held),
            ("stopline_prompt_cache_budget_bytes", "The most bytes the prompt cache holds.", stats.budget_bytes),
            ("stopline_prompt_cache_entries", "KV states the prompt cache holds.", stats.entries),
        )
        if self.cache.disk is not None:
            gauges += (
                (
                    "stopline_prompt_cache_disk_bytes",
                    "Bytes of the prompt cache's disk tier's files.",
                    stats.disk_bytes,
                ),
                (
                    "stopline_prompt_cache_disk_budget_bytes",
                    "The most bytes the prompt cache's disk tier holds.",
                    stats.disk_budget_bytes,
                ),
                (
                    "stopline_prompt_cache_disk_entries",
                    "KV states the prompt cache's disk tier holds.",
                    stats.disk_entries,
                ),
            )
        for name, documentation, value in gauges:
            yield GaugeMetricFamily(name, documentation, value=value)


class Metrics:
    """One registry per server, so several servers can live in one process (tests)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "stopline_requests", "Requests that ended, by outcome and reason.", ["outcome", "reason"], registry=r
        )
        self.cancel_latency = Histogram(
            "stopline_cancel_latency_seconds",
            "From the cancel's arrival to the native loop's exit.",
            ["reason"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens_generated = Counter("stopline_tokens_generated", "Tokens generated, all outcomes.", registry=r)
        self.tokens_wasted = Counter(
            "stopline_tokens_wasted",
            "Tokens computed (prompt and generated) for requests that did not finish.",
            ["outcome", "reason"],
            registry=r,
        )
        self.prompt_tokens_wasted = Counter(
            "stopline_prompt_tokens_wasted",
            "Prompt tokens of chunks a stop cut short, their work thrown away.",
            ["outcome", "reason"],
            registry=r,
        )
        self.wasted_eval = Counter(
            "stopline_wasted_eval_seconds",
            "Time the evaluations a stop cut short had run, their work thrown away.",
            ["outcome", "reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "stopline_ttft_seconds",
            "Time from the start of a generation to its first token.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("stopline_queue_depth", "Requests waiting for a slot.", registry=r)
        self.active = Gauge("stopline_active_generations", "Generations running on a slot.", registry=r)
        self.slots = Gauge("stopline_slots", "Generation slots.", registry=r)
        self.preemptions = Counter(
            "stopline_preemptions",
            "Running generations paused for a request of higher priority, their cache kept.",
            registry=r,
        )
        self.connections = Gauge("stopline_connections", "Open WebSocket connections.", registry=r)
        self.rejected = Counter(
            "stopline_rejected_frames", "Frames answered with an error, by code.", ["code"], registry=r
        )
        self.abort_mode = Gauge(
            "stopline_abort_mode", "1 for the way running evaluations are stopped.", ["mode"], registry=r
        )
        self.prompt_tokens_reused = Counter(
            "stopline_prompt_tokens_reused",
            "Prompt tokens served from a slot's KV cache instead of evaluated.",
            registry=r,
        )
        self.prompt_tokens_evaluated = Counter(
            "stopline_prompt_tokens_evaluated", "Prompt tokens evaluated, all outcomes.", registry=r
        )
        self.refused = Counter(
            "stopline_refused_connections",
            "HTTP and WebSocket connections refused before the handshake completed, by code.",
            ["code"],
            registry=r,
        )
        # Per API key: labelled by the key's id, never by the key.
        self.key_requests = Counter(
            "stopline_key_requests",
            "Requests that ended, by API key id and outcome.",
            ["key_id", "outcome"],
            registry=r,
        )
        self.key_tokens_generated = Counter(
            "stopline_key_tokens_generated", "Tokens generated, by API key id.", ["key_id"], registry=r
        )
        self.quota_refusals = Counter(
            "stopline_quota_refusals",
            "Requests refused with quota_exceeded, by API key id and the limit that refused them.",
            ["key_id", "limit"],
            registry=r,
        )

        # Per model, labelled by the name it is reported under: several may be served (--model).
        self.model_requests = Counter(
            "stopline_model_requests", "Requests that ended, by model and outcome.", ["model", "outcome"], registry=r
        )
        self.model_tokens_generated = Counter(
            "stopline_model_tokens_generated", "Tokens generated, by model.", ["model"], registry=r
        )
        self.model_queue_depth = Gauge(
            "stopline_model_queue_depth", "Requests waiting for one of a model's slots.", ["model"], registry=r
        )
        self.model_active = Gauge(
            "stopline_model_active_generations", "Generations running on a model's slots.", ["model"], registry=r
        )
        # Each model's scheduler's queue and running counts, which the unlabelled gauges sum.
        self._queued: dict[str, int] = {}
        self._running: dict[str, int] = {}

    def for_model(self, model: str) -> ModelMetrics:
        """What one model's scheduler updates: its own gauges, and the server's totals."""
        return ModelMetrics(self, model)

    def add_store_metrics(self) -> None:
        """The shared store's metrics, exported only when there is one (``--redis-url``)."""
        r = self.registry
        self.redis_up = Gauge("stopline_redis_up", "1 while Redis (the shared store) answers, else 0.", registry=r)
        self.store_writes_queued = Gauge(
            "stopline_store_writes_queued", "Status and cancellation-log writes waiting for Redis.", registry=r
        )
        self.store_writes_dropped = Counter(
            "stopline_store_writes_dropped",
            "Status and cancellation-log writes given up: the queue was full, "
            "Redis kept refusing them, or they were queued at shutdown.",
            registry=r,
        )
        self.quota_local_decisions = Counter(
            "stopline_quota_local_decisions",
            "Quota admissions decided by this replica alone because Redis was down or slow.",
            registry=r,
        )

    def add_prompt_cache_metrics(self, cache: PromptCache) -> None:
        """The prompt cache's metrics, read from it at each scrape, exported only when there is one."""
        self.registry.register(_PromptCacheCollector(cache))

    def set_abort_mode(self, mode: AbortMode) -> None:
        for each in AbortMode:
            self.abort_mode.labels(str(each)).set(1 if each is mode else 0)

    def record_end(self, ending: Ending, key_id: str | None = None, model: str | None = None) -> None:
        self.requests.labels(str(ending.outcome), ending.reason).inc()
        if model is not None:
            self.model_requests.labels(model, str(ending.outcome)).inc()
            self.model_tokens_generated.labels(model).inc(ending.tokens_generated)
        if key_id is not None:
            self.key_requests.labels(key_id, str(ending.outcome)).inc()
            self.key_tokens_generated.labels(key_id).inc(ending.tokens_generated)
        self.tokens_generated.inc(ending.tokens_generated)
        self.prompt_tokens_reused.inc(ending.prompt_tokens_reused)
        self.prompt_tokens_evaluated.inc(ending.prompt_tokens_evaluated)
        if ending.tokens_wasted:
            self.tokens_wasted.labels(str(ending.outcome), ending.reason).inc(ending.tokens_wasted)
        if ending.prompt_tokens_wasted:
            self.prompt_tokens_wasted.labels(str(ending.outcome), ending.reason).inc(ending.prompt_tokens_wasted)
        if ending.wasted_eval_ms:
            self.wasted_eval.labels(str(ending.outcome), ending.reason).inc(ending.wasted_eval_ms / 1000)
        if ending.cancel_latency_ms is not None:
            self.cancel_latency.labels(ending.reason).observe(ending.cancel_latency_ms / 1000)
        if ending.ttft_ms is not None:
            self.ttft.observe(ending.ttft_ms / 1000)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SummedGauge:
    """A model's gauge, whose value also counts towards the server's unlabelled one."""

    def __init__(self, own: Gauge, total: Gauge, parts: dict[str, int], model: str):
        self._own, self._total, self._parts, self._model = own.labels(model), total, parts, model

    def set(self, value: int) -> None:
        self._parts[self._model] = value
        self._own.set(value)
        self._total.set(sum(self._parts.values()))


class ModelMetrics:
    """The metrics one model's scheduler updates (Scheduler's ``metrics``)."""

    def __init__(self, metrics: Metrics, model: str):
        self.preemptions = metrics.preemptions
        self.queue_depth = _SummedGauge(metrics.model_queue_depth, metrics.queue_depth, metrics._queued, model)
        self.active = _SummedGauge(metrics.model_active, metrics.active, metrics._running, model)


def log_accepted(request: Request, peer: str, queue_position: int) -> None:
    log.info(
        "generation_accepted",
        request_id=request.request_id,
        id=request.id,
        user_id=request.user_id,
        key_id=request.key_id,
        user=request.user,
        peer=peer,
        prompt_tokens=len(request.prompt_tokens),
        max_tokens=request.params.max_tokens,
        queue_position=queue_position,
    )


def log_end(request: Request, ending: Ending, peer: str, model: str | None = None) -> None:
    """The end line: the fields of the classic cancellation record, and then some."""
    level = "warning" if ending.outcome is Outcome.ERROR else "info"
    getattr(log, level)(
        END_EVENTS[ending.outcome],
        request_id=request.request_id,
        **({"model": model} if model is not None else {}),
        id=request.id,
        user_id=request.user_id,
        key_id=request.key_id,
        user=request.user,
        reason=ending.reason,
        peer=peer,
        tokens_generated=ending.tokens_generated,
        tokens_wasted=ending.tokens_wasted,
        cancel_latency_ms=ending.cancel_latency_ms,
        tokens_after_cancel=ending.tokens_after_cancel,
        prompt_tokens=ending.prompt_tokens,
        prompt_tokens_reused=ending.prompt_tokens_reused,
        prompt_tokens_evaluated=ending.prompt_tokens_evaluated,
        prompt_tokens_wasted=ending.prompt_tokens_wasted,
        wasted_eval_ms=ending.wasted_eval_ms,
        queue_ms=ending.queue_ms,
        ttft_ms=ending.ttft_ms,
        duration_ms=ending.duration_ms,
        tokens_per_s=ending.tokens_per_s,
        longest_prefill_node_ms=ending.longest_prefill_node_ms,
        longest_decode_node_ms=ending.longest_decode_node_ms,
        **({"preemptions": ending.preemptions, "preempted_ms": ending.preempted_ms} if ending.preemptions else {}),
        **({"message": ending.message} if ending.message else {}),
        **({"limit": str(ending.limit), "retry_after_s": ending.retry_after_s} if ending.limit else {}),
    )
