"""What a request is: its sampling parameters, the limits it is held to, its record while it
lives, and how it ended (:class:`Ending`, and what each way out of the native loop means)."""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from .vocabulary import ErrorCode, Outcome, QuotaLimit, Reason

# Any deadline beyond a day is a mistake, not a wish.
MAX_SECONDS = 86_400.0
MAX_USER_CHARS = 256
# The longest model name a generate frame may give (a served name may be OWNER/REPO:QUANT).
MAX_MODEL_CHARS = 256
# Priorities are -MAX_PRIORITY to MAX_PRIORITY (lower first).
MAX_PRIORITY = 2**31 - 1
# Seeds are 0 to MAX_SEED - 1.
MAX_SEED = 2**31
# The most alternatives a token's log probabilities list (OpenAI's top_logprobs limit).
MAX_TOP_LOGPROBS = 20
# The most tokens one logit_bias names: each adds work to every draw.
MAX_LOGIT_BIAS = 300
# How far (in tokens) a generation may run ahead of what its client has been sent: the loop
# waits there, so a client that stops reading stops the computing too (--window).
DEFAULT_WINDOW = 64


@dataclass(frozen=True)
class SamplingParams:
    """What a generation asks of the sampler, and its deadlines.

    These defaults are the only ones: a generate frame that leaves a field out
    gets the value here (the deadlines come from :class:`Limits` instead), on the
    WebSocket, over SSE and through the OpenAI endpoints alike. They are
    llama-server's, the peer that runs the same GGUF files on the same llama.cpp:
    no penalty unless one is asked for (vLLM and OpenAI apply none either), so
    ``temperature: 0`` draws the model's most likely token every time.
    """

    # The longest answer: long enough for a story. The terminal client and the page take
    # it from here (the page through the hello frame's defaults).
    max_tokens: int = 1024
    # llama-server's temperature, top-k and top-p; OpenAI and vLLM default to 1.0 with
    # neither cut-off, which lets a small model's long tail through.
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    # 1.0 is no penalty: llama-server's penalty_repeat, vLLM's repetition_penalty.
    repetition_penalty: float = 1.0
    # OpenAI's: subtracted from a token's logit per time it was generated, and once if it was.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # llama.cpp's min_p (0 to 1): a token less likely than min_p times the likeliest one is
    # never drawn. Off, as in vLLM; llama-server's default is 0.05.
    min_p: float = 0.0
    # OpenAI's logit_bias: (token id, bias) pairs, each bias added to its token's logit
    # before every draw (-100 to 100).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Draw until max_tokens: the end-of-generation tokens are never drawn (llama-server's
    # and vLLM's ignore_eos), as a benchmark asks for answers of one length.
    ignore_eos: bool = False
    seed: int | None = None
    # A GBNF grammar every generated token must follow (json_grammar writes them); llama.cpp only.
    grammar: str | None = None
    # Log probabilities with each token, and how many alternatives (0 to MAX_TOP_LOGPROBS); None: none.
    logprobs: int | None = None
    stop: tuple[str, ...] = ()
    # Seconds from the start time given to Engine.start (the server passes the
    # request's arrival); None means no deadline.
    timeout_s: float | None = None
    ttft_timeout_s: float | None = None


DEFAULT_SAMPLING = SamplingParams()


# The defaults the hello frame tells a client, so that it shows them rather than its own copies.
HELLO_DEFAULTS = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)


class Phase(Enum):
    QUEUED = "queued"
    PREFILL = "prefill"
    DECODING = "decoding"
    ENDED = "ended"


_TRANSITIONS = {
    Phase.QUEUED: {Phase.PREFILL, Phase.ENDED},
    Phase.PREFILL: {Phase.DECODING, Phase.ENDED},
    Phase.DECODING: {Phase.ENDED},
    Phase.ENDED: set(),
}


# (frame, the one structured field it asks for, its request id) -> the grammar, or a ProtocolError.
GrammarOf = Callable[[dict, str, "str | None"], str]


@dataclass(frozen=True)
class Limits:
    """What one connection may ask for, and how fast. The defaults here are the server's
    (``settings.Settings`` holds these limits, and the command line takes its defaults from them)."""

    # The loaded engine's context and vocabulary (Settings.limits_for sets them); 0: no engine yet.
    context_length: int = 0
    vocab_size: int = 0
    default_timeout_s: float = 300.0
    max_timeout_s: float = 600.0
    default_ttft_timeout_s: float = 120.0
    max_ttft_timeout_s: float = 600.0
    requests_per_connection: int = 8
    # Live requests (queued or running) of all connections from one client address.
    requests_per_address: int = 16
    # A cheap bound checked before any tokenizing: the server sets it to the
    # context length times the longest token's bytes, so a prompt past it can
    # only be too long.
    max_prompt_bytes: int = 400_000
    max_messages: int = 512
    max_stop_sequences: int = 4
    max_stop_bytes: int = 64
    # Token buckets for incoming frames: their number, and their bytes. Parsing
    # and tokenizing cost CPU in proportion to the bytes; a burst holds one largest frame.
    frames_per_second: float = 50.0
    frame_burst: int = 100
    bytes_per_second: float = 256 * 1024
    byte_burst: int = 1 << 20
    # How many ended request ids each connection remembers for cancel_ack.
    remembered_ids: int = 1024
    # The grammar compiler for json_schema, json_object and tools, where the engine constrains
    # sampling to a grammar (llama.cpp's does): structured output stands above this package, and
    # the settings hand it in. None: such a request is refused.
    grammar_of: GrammarOf | None = None

    @property
    def grammars(self) -> bool:
        """Whether the engine constrains sampling to a grammar."""
        return self.grammar_of is not None


@dataclass(eq=False)
class Request:
    id: str
    prompt_tokens: list[int]
    params: SamplingParams
    received_ns: int
    phase: Phase = Phase.QUEUED
    started_ns: int = 0
    first_token_ns: int = 0
    # Why and when a stop was asked for: only the first reason counts. Read by the protocol alone.
    cancel_reason: Reason | None = None
    cancel_requested_ns: int = 0
    next_index: int = 0
    # The server-global id (any transport may cancel by it) and the secret that authorizes doing so.
    request_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    cancel_token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    # The optional ``user`` field of the request (the OpenAI name): the client's own label, untrusted.
    user: str | None = None
    # Who the request is for: the user and the id of the API key that started it (None without keys).
    user_id: str | None = None
    key_id: str | None = None
    # Cancel frames still owed an answer; it names the outcome once the request has ended.
    unanswered_cancels: int = 0
    # vLLM's: a lower value is served first, and preempts a running request of a higher one.
    priority: int = 0
    # The name of the model that serves it, as the frames, the end line and the metrics report it.
    model: str = ""

    def advance(self, phase: Phase) -> None:
        if phase not in _TRANSITIONS[self.phase]:
            raise RuntimeError(f"request {self.id}: {self.phase.value} cannot become {phase.value}")
        self.phase = phase

    @property
    def ended(self) -> bool:
        return self.phase is Phase.ENDED

    @property
    def queue_deadline_ns(self) -> int | None:
        """When the request times out if it is still waiting for a slot (None: never)."""
        first = first_deadline(self)
        return first[0] if first is not None else None


def first_deadline(request: Request) -> tuple[int, Reason] | None:
    """The request's earlier deadline and the reason it ends with: both count from the arrival."""
    params = request.params
    deadlines = [
        (request.received_ns + int(seconds * 1e9), reason)
        for seconds, reason in (
            (params.timeout_s, Reason.TOTAL_TIMEOUT),
            (params.ttft_timeout_s, Reason.FIRST_TOKEN_TIMEOUT),
        )
        if seconds
    ]
    return min(deadlines) if deadlines else None


@dataclass(frozen=True)
class Ending:
    """Everything known about how a request ended: the terminal frame and the end log line come from it."""

    outcome: Outcome
    reason: Reason | ErrorCode  # an ErrorCode for errors
    prompt_tokens: int = 0
    prompt_tokens_reused: int = 0  # served from the slot's KV cache
    prompt_tokens_evaluated: int = 0  # computed for this request
    tokens_generated: int = 0
    tokens_after_cancel: int = 0
    queue_ms: float = 0.0
    ttft_ms: float | None = None
    duration_ms: float = 0.0
    cancel_latency_ms: float | None = None
    # The longest stretch of an evaluation between two stop checks (a graph node in
    # step), which bounds how long a stop can wait: in the prompt, and in decode.
    longest_prefill_node_ms: float = 0.0
    longest_decode_node_ms: float = 0.0
    # What a stop threw away: the prompt chunk it cut short (the chunks before it stay in the
    # KV cache for a resend), and how long the evaluation it cut short had run.
    prompt_tokens_wasted: int = 0
    wasted_eval_ms: float = 0.0
    # How often it was paused for a request of higher priority, and for how long in all.
    preemptions: int = 0
    preempted_ms: float = 0.0
    message: str = ""
    # A quota refusal: which limit, and when trying again may succeed (None: it will not).
    limit: QuotaLimit | None = None
    retry_after_s: float | None = None

    @property
    def tokens_per_s(self) -> float | None:
        """Decode speed: the tokens after the first, over the time from the first token to the
        last. The page, the console and the logs show this one figure; the prompt's time is
        ``ttft_ms``. None with fewer than two tokens, which give no interval to measure."""
        if self.ttft_ms is None or self.tokens_generated < 2 or self.duration_ms <= self.ttft_ms:
            return None
        return round((self.tokens_generated - 1) / ((self.duration_ms - self.ttft_ms) / 1000), 1)

    @property
    def tokens_wasted(self) -> int:
        """Every token computed for a request that did not finish with ``done``, those of a
        prompt chunk a stop cut short included."""
        if self.outcome is Outcome.DONE:
            return 0
        return self.prompt_tokens_evaluated + self.prompt_tokens_wasted + self.tokens_generated


# What each way out of the native loop (``_core.ExitKind``, by name) means to a
# client: its outcome, and its reason. A cancel's reason is not the loop's to
# know: the request remembers why its stop was asked for.
EXIT_OUTCOMES: dict[str, tuple[Outcome, Reason | ErrorCode | None]] = {
    "EOS": (Outcome.DONE, Reason.EOS),
    "MAX_TOKENS": (Outcome.DONE, Reason.MAX_TOKENS),
    # The request's max_tokens, capped by the context: the same limit to a client.
    "CONTEXT_FULL": (Outcome.DONE, Reason.MAX_TOKENS),
    "STOP_SEQUENCE": (Outcome.DONE, Reason.STOP_SEQUENCE),
    "CANCELLED": (Outcome.CANCELLED, None),
    "TOTAL_DEADLINE": (Outcome.TIMEOUT, Reason.TOTAL_TIMEOUT),
    "FIRST_TOKEN_DEADLINE": (Outcome.TIMEOUT, Reason.FIRST_TOKEN_TIMEOUT),
    "EVAL_FAILED": (Outcome.ERROR, ErrorCode.INTERNAL_ERROR),
}


def exit_outcome(exit: Enum) -> tuple[Outcome, Reason | ErrorCode | None]:
    """The outcome and reason of a way out of the native loop (None: a cancel, whose reason the request holds)."""
    return EXIT_OUTCOMES[exit.name]


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """What the engine reports once a generation's native loop has exited: which way
    out it took (``exit``, a ``_core.ExitKind``), its counts, and its CLOCK_MONOTONIC
    timestamps in ns (0: never). The fields are the native ``LoopResult``'s, one for one
    (``stopline.engine.loop`` copies them over); what they mean to a client is decided here."""

    exit: Enum
    prompt_tokens: int
    prompt_tokens_reused: int
    prompt_tokens_evaluated: int
    tokens_generated: int
    tokens_after_cancel: int
    start_ns: int
    first_token_ns: int
    cancel_observed_ns: int
    end_ns: int
    text_kept_bytes: int
    longest_prefill_node_ns: int
    longest_decode_node_ns: int
    prompt_tokens_wasted: int
    wasted_eval_ns: int
    # How often a request of higher priority paused it, and for how long in all.
    preemptions: int = 0
    preempted_ns: int = 0
