"""The Stopline protocol without I/O: every decision about a request, and nothing else.

:class:`Connection` is one client's side of the protocol. The I/O layer
(:mod:`stopline.app` for the WebSocket, :mod:`stopline.http_api` for HTTP)
tells it what happened, in plain calls stamped with CLOCK_MONOTONIC ns:

- what the client did: sent a text or binary frame, asked to cancel, left;
- what the server saw: a prompt tokenized, a request accepted or refused by
  the scheduler, a request that took a slot, generated text, a native loop that
  exited (the engine's result), a request cancelled or expired while queued, a
  send that stalled, a shutdown.

Every such call returns a list of :data:`Action` for the I/O layer to carry out
in order: :class:`Send` a frame, :class:`Tokenize` a prompt off the event loop,
:class:`Submit` a request to the scheduler, :class:`Cancel` one, and record a
request that :class:`Ended` (the registry, the metrics and the end log line).

The protocol validates frames, enforces limits and rates, builds every frame
and every :class:`Ending`, remembers why and when a stop was asked for, and
guarantees that a request gets exactly one terminal message, whatever races
with what. The I/O layer only moves bytes and frames; the scheduler only owns
slots and the queue. This module imports only the standard library, the
vocabulary and the JSON Schema to grammar converter: no socket, thread, event loop or model, so it is tested with plain
function calls.

A request moves through this table, and nowhere else::

    QUEUED ──start──▶ PREFILL ──first token──▶ DECODING
       │                 │                        │
       └─────────────────┴──────── end ───────────┴──▶ ENDED (one terminal message)
"""

from __future__ import annotations

import json
import math
import secrets
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import ClassVar, TypeGuard

from .errors import StoplineError
from .json_grammar import JSON_OBJECT_GRAMMAR, SchemaError, schema_grammar
from .throttle import Throttle
from .tool_calls import ToolChoice, calls_grammar, is_tool
from .vocabulary import STATUS_BY_OUTCOME, ErrorCode, Outcome, QuotaLimit, Reason, Refusal, Status

PROTOCOL_VERSION = 1
# Any deadline beyond a day is a mistake, not a wish.
MAX_SECONDS = 86_400.0
MAX_USER_CHARS = 256


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
    seed: int | None = None
    # A GBNF grammar every generated token must follow (stopline.json_grammar writes them); llama.cpp only.
    grammar: str | None = None
    # Log probabilities with each token, and how many alternatives (0 to 20); None: none.
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
    # Whether the engine constrains sampling to a grammar (json_schema, json_object): llama.cpp's does.
    grammars: bool = False


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
        first = _first_deadline(self)
        return first[0] if first is not None else None


def _first_deadline(request: Request) -> tuple[int, Reason] | None:
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
        """Every token computed for a request that did not finish with ``done``."""
        if self.outcome is Outcome.DONE:
            return 0
        return self.prompt_tokens_evaluated + self.tokens_generated


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
    (``stopline.engine`` copies them over); what they mean to a client is decided here."""

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


@dataclass(eq=False)
class Draft:
    """A validated generate frame whose prompt is still being tokenized."""

    id: str
    params: SamplingParams
    prompt: str | None
    messages: list[dict] | None
    received_ns: int
    size: int  # the prompt's UTF-8 bytes
    user: str | None = None
    id_chosen_by_server: bool = False
    # The room the prompt must leave in the context for the answer, in tokens.
    min_answer_tokens: int = 1
    # Cancel frames that arrived meanwhile, and when the first did.
    cancels: int = 0
    cancel_ns: int = 0


# Actions returned to the I/O layer: every call of a Connection returns a list of them.
@dataclass(frozen=True)
class Send:
    """Write ``frame`` to the client. ``request`` is the request whose output it
    is (a token frame): a send that stalls is reported with ``Connection.stalled(request)``."""

    frame: Frame
    request: Request | None = None


@dataclass(frozen=True)
class Tokenize:
    """Run ``Connection.tokenize(draft)`` off the event loop (it costs CPU in
    proportion to the prompt), then hand its result to ``Connection.tokenized``."""

    draft: Draft


@dataclass(frozen=True)
class Submit:
    """Hand ``request`` to the scheduler; report what it said with ``accepted``, ``busy`` or ``failed``."""

    request: Request


@dataclass(frozen=True)
class Cancel:
    """Stop ``request`` wherever it is, queued or on a slot. The request remembers why and when."""

    request: Request


@dataclass(frozen=True)
class Ended:
    """``request`` ended: record ``ending`` (the registry, the metrics, the end log line).
    It comes before the frames that tell the client."""

    request: Request
    ending: Ending


Action = Send | Tokenize | Submit | Cancel | Ended


class ProtocolError(StoplineError):
    """A frame or a request refused; each subclass names the error code its answer carries.
    ``request_id`` is the request it answers, where one is known; ``param`` is the field of
    an OpenAI request body it is about, where there is one."""

    def __init__(self, message: str, request_id: str | None = None, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.request_id = request_id
        self.param = param


class InvalidJson(ProtocolError):
    code = ErrorCode.INVALID_JSON


class InvalidFrame(ProtocolError):
    code = ErrorCode.INVALID_FRAME


class UnknownType(ProtocolError):
    code = ErrorCode.UNKNOWN_TYPE


class InvalidField(ProtocolError):
    code = ErrorCode.INVALID_FIELD


class DuplicateId(ProtocolError):
    code = ErrorCode.DUPLICATE_ID


class PromptTooLong(ProtocolError):
    code = ErrorCode.PROMPT_TOO_LONG


class TooManyRequests(ProtocolError):
    code = ErrorCode.TOO_MANY_REQUESTS


class TooManyRequestsFromAddress(ProtocolError):
    code = ErrorCode.TOO_MANY_REQUESTS_FROM_ADDRESS


class UnsupportedParameter(ProtocolError):
    """An OpenAI body field Stopline does not honour."""

    code = ErrorCode.UNSUPPORTED_PARAMETER


class ModelNotFound(ProtocolError):
    """An OpenAI request names a model this server does not serve."""

    code = ErrorCode.MODEL_NOT_FOUND


class PreparationFailed(ProtocolError):
    """The server could not prepare a request (a bug): it ends alone, with internal_error."""

    code = ErrorCode.INTERNAL_ERROR


# Frames: what the protocol sends, typed. They become JSON (``Frame.json()``, then
# ``encode_frame``) only at the transport, so a consumer reads attributes, and a
# renamed field is a type error rather than a KeyError in an adapter.


@dataclass(frozen=True)
class Hello:
    """The greeting, once per WebSocket connection: the model and what a request may ask for."""

    type: ClassVar[str] = "hello"
    model: str
    limits: Limits

    def json(self) -> dict:
        lim = self.limits
        return {
            "type": self.type,
            "protocol": PROTOCOL_VERSION,
            "model": self.model,
            "context_length": lim.context_length,
            "limits": {
                "max_tokens": lim.context_length,
                "timeout_s": lim.max_timeout_s,
                "ttft_timeout_s": lim.max_ttft_timeout_s,
                "requests_per_connection": lim.requests_per_connection,
            },
            # What a generate frame gets for a field it leaves out.
            "defaults": {name: getattr(DEFAULT_SAMPLING, name) for name in HELLO_DEFAULTS},
        }


@dataclass(frozen=True)
class Accepted:
    """The scheduler took a request: its place in the queue (0: it started), its id and cancel token."""

    type: ClassVar[str] = "accepted"
    id: str
    queue_position: int
    request_id: str
    cancel_token: str

    def json(self) -> dict:
        return {"type": self.type, **asdict(self)}


@dataclass(frozen=True)
class Token:
    """Generated text, with the log probabilities of its tokens when they were asked for."""

    type: ClassVar[str] = "token"
    id: str
    index: int
    text: str
    logprobs: list[dict] | None = None

    def json(self) -> dict:
        frame = {"type": self.type, "id": self.id, "index": self.index, "text": self.text}
        if self.logprobs is not None:
            frame["logprobs"] = self.logprobs
        return frame


@dataclass(frozen=True)
class ErrorFrame:
    """A frame or a request refused. A quota refusal names its limit, and when trying again may succeed."""

    type: ClassVar[str] = str(Outcome.ERROR)
    code: ErrorCode | Refusal
    message: str
    id: str | None = None
    limit: QuotaLimit | None = None
    retry_after_s: float | None = None

    def json(self) -> dict:
        frame: dict = {"type": self.type, "id": self.id, "code": str(self.code), "message": self.message}
        if self.limit is not None:
            frame.update(limit=str(self.limit), retry_after_s=self.retry_after_s)
        return frame


@dataclass(frozen=True)
class Terminal:
    """A request's one terminal message: how it ended (``ending``), and what that cost."""

    id: str
    ending: Ending

    @property
    def type(self) -> str:
        return str(self.ending.outcome)

    @property
    def error(self) -> ErrorFrame | None:
        """The error frame this is, when the request ended in an error."""
        ending = self.ending
        if ending.outcome is not Outcome.ERROR:
            return None
        return ErrorFrame(ErrorCode(ending.reason), ending.message, self.id, ending.limit, ending.retry_after_s)

    def json(self) -> dict:
        if (error := self.error) is not None:
            return error.json()
        ending = self.ending
        frame: dict = {"type": self.type, "id": self.id, "reason": str(ending.reason)}
        frame.update((name, getattr(ending, name)) for name in _TERMINAL_FIELDS[ending.outcome])
        return frame


@dataclass(frozen=True)
class CancelAck:
    """The answer to a cancel that found nothing to stop: the request's outcome, or unknown.
    An ack says "finished" rather than "done", so it is never mistaken for a terminal message."""

    type: ClassVar[str] = "cancel_ack"
    id: str
    status: Status

    @classmethod
    def of(cls, request_id: str, outcome: Outcome | None) -> CancelAck:
        return cls(request_id, STATUS_BY_OUTCOME[outcome] if outcome is not None else Status.UNKNOWN)

    def json(self) -> dict:
        return {"type": self.type, "id": self.id, "status": str(self.status)}


Frame = Hello | Accepted | Token | ErrorFrame | Terminal | CancelAck


def as_error(frame: Frame) -> ErrorFrame | None:
    """The error ``frame`` is (a refusal, or a request that ended in an error), if it is one."""
    if isinstance(frame, ErrorFrame):
        return frame
    return frame.error if isinstance(frame, Terminal) else None


def ends_request(frame: Frame) -> bool:
    """Whether ``frame`` is the last a request gets: its terminal message, or the error that refused it."""
    return isinstance(frame, (Terminal, ErrorFrame))


def encode_frame(frame: Frame) -> str:
    return encode_json(frame.json())


def encode_json(value: dict) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    except UnicodeEncodeError:  # pragma: no cover - validation keeps lone surrogates out of frames
        return json.dumps(value, separators=(",", ":"))


def _ms(start_ns: int, end_ns: int) -> float:
    return round((end_ns - start_ns) / 1e6, 3)


class AddressQuota:
    """Live requests per client address, shared by all of that address's connections."""

    def __init__(self, limit: int):
        self.limit = limit
        self._used: dict[str, int] = {}

    def used(self, address: str) -> int:
        return self._used.get(address, 0)

    def take(self, address: str) -> None:
        self._used[address] = self._used.get(address, 0) + 1

    def give_back(self, address: str) -> None:
        left = self._used[address] - 1
        if left:
            self._used[address] = left
        else:
            del self._used[address]


TokenizeFn = Callable[[str | None, list | None], list]


class Connection:
    """One client's protocol state. ``now_ns`` is always CLOCK_MONOTONIC ns."""

    def __init__(
        self,
        limits: Limits,
        tokenize: TokenizeFn,
        now_ns: int,
        *,
        address: str = "",
        quota: AddressQuota | None = None,
        user_id: str | None = None,
        key_id: str | None = None,
    ):
        self.limits = limits
        # The API key this client authenticated with (None without keys): every request is theirs.
        self.user_id = user_id
        self.key_id = key_id
        self._tokenize = tokenize
        self.address = address
        self.quota = quota if quota is not None else AddressQuota(limits.requests_per_address)
        self.live: dict[str, Request] = {}
        # Generate frames whose prompts are being tokenized; they count as live for every limit.
        self.pending: dict[str, Draft] = {}
        self._ended: OrderedDict[str, Outcome] = OrderedDict()
        self._tokens = float(limits.frame_burst)
        self._tokens_at = now_ns
        self._rate_limited_report = Throttle()
        self._bytes = float(limits.byte_burst)

    def hello(self, model: str) -> list[Action]:
        """The greeting, sent once as the connection opens."""
        return [Send(Hello(model, self.limits))]

    # Incoming frames ------------------------------------------------------

    def receive_binary(self, now_ns: int, size: int = 0) -> list[Action]:
        if not self._admit(now_ns, size):
            return self._rate_limited(now_ns)
        return [Send(ErrorFrame(ErrorCode.BINARY_FRAME, "frames must be JSON text frames, not binary"))]

    def receive_text(self, data: str, now_ns: int) -> list[Action]:
        # Characters, not bytes: counting bytes would cost as much as the parse it guards.
        if not self._admit(now_ns, len(data)):
            return self._rate_limited(now_ns)
        try:
            frame = _parse(data)
            kind = frame["type"]
            if kind == "generate":
                return self._generate(frame, now_ns)
            if kind == "cancel":
                return self._cancel(frame, now_ns)
            raise UnknownType(f"unknown type {_shown(kind)}; expected 'generate' or 'cancel'", _id_of(frame))
        except ProtocolError as exc:
            return [Send(ErrorFrame(exc.code, exc.message, exc.request_id))]

    def frame_failed(self) -> list[Action]:
        """Handling a frame raised (a bug): that frame is answered, and the connection lives on."""
        return [Send(ErrorFrame(ErrorCode.INTERNAL_ERROR, "the server failed to handle this frame"))]

    def _generate(self, frame: dict, now_ns: int) -> list[Action]:
        client_id = frame.get("id")
        chosen_by_server = client_id is None
        if chosen_by_server:
            request_id = str(uuid.uuid4())
        elif _is_id(client_id):
            request_id = client_id
        else:
            raise InvalidField("id must be a string of 1 to 128 characters")
        self._check_room(request_id)
        params, prompt, messages, size = _validate_generate(frame, self.limits, request_id)
        user = frame.get("user")
        if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_CHARS):
            raise InvalidField(f"user must be a string of at most {MAX_USER_CHARS} characters", request_id)
        if user is not None:
            _text_bytes(user, "user", request_id)
        min_answer_tokens = _number(
            frame, "min_answer_tokens", 1, 1, self.limits.context_length, integer=True, request_id=request_id
        )
        draft = Draft(
            request_id,
            params,
            prompt,
            messages,
            received_ns=now_ns,
            size=size,
            user=user,
            id_chosen_by_server=chosen_by_server,
            min_answer_tokens=min_answer_tokens,
        )
        self.pending[request_id] = draft
        self.quota.take(self.address)
        return [Tokenize(draft)]

    def tokenize(self, draft: Draft) -> list[int] | ProtocolError:
        """The prompt's tokens, or the error that refuses it. Safe to call from any thread."""
        try:
            tokens = self._tokenize(draft.prompt, draft.messages)
        except ValueError as exc:  # the tokenizer or the chat template refused the text
            return InvalidField(str(exc), draft.id)
        if not tokens:
            return InvalidField("the prompt is empty", draft.id)
        if len(tokens) + draft.min_answer_tokens > self.limits.context_length:
            answer = (
                "at least one generated token"
                if draft.min_answer_tokens == 1
                else f"the {draft.min_answer_tokens} generated tokens min_answer_tokens asks room for"
            )
            return PromptTooLong(
                f"the prompt has {len(tokens)} tokens; the context holds "
                f"{self.limits.context_length}, including {answer}",
                draft.id,
            )
        return tokens

    def tokenized(self, draft: Draft, tokens: list[int] | ProtocolError) -> list[Action]:
        """Turn a tokenized draft into a live request (or its error). A cancel
        that arrived while it was tokenized stops the request at once."""
        if self.pending.pop(draft.id, None) is not draft:
            return []  # the client left meanwhile
        if isinstance(tokens, ProtocolError):
            self.quota.give_back(self.address)
            refusal: list[Action] = [Send(ErrorFrame(tokens.code, tokens.message, tokens.request_id))]
            return refusal + [Send(CancelAck.of(draft.id, Outcome.ERROR))] * draft.cancels
        request = Request(
            draft.id,
            tokens,
            draft.params,
            received_ns=draft.received_ns,
            user=draft.user,
            user_id=self.user_id,
            key_id=self.key_id,
        )
        if draft.id_chosen_by_server:
            request.request_id = draft.id  # one id is enough when the client gave none
        self.live[draft.id] = request
        actions: list[Action] = [Submit(request)]
        if draft.cancels:
            request.unanswered_cancels = draft.cancels - 1
            actions += self.request_cancel(request, Reason.USER_CANCELLED, draft.cancel_ns)
        return actions

    def preparation_failed(self, draft: Draft, message: str) -> list[Action]:
        """The server could not prepare ``draft`` (a bug): it ends with internal_error, alone."""
        return self.tokenized(draft, PreparationFailed(message, draft.id))

    def _check_room(self, request_id: str) -> None:
        if request_id in self.live or request_id in self.pending:
            raise DuplicateId(f"request {request_id!r} is still live on this connection", request_id)
        count = len(self.live) + len(self.pending)
        if count >= self.limits.requests_per_connection:
            raise TooManyRequests(
                f"this connection already has {count} live requests "
                f"(the limit is {self.limits.requests_per_connection})",
                request_id,
            )
        if self.quota.used(self.address) >= self.quota.limit:
            raise TooManyRequestsFromAddress(
                f"this client address already has {self.quota.used(self.address)} live requests "
                f"(the limit is {self.quota.limit})",
                request_id,
            )

    def _cancel(self, frame: dict, now_ns: int) -> list[Action]:
        request_id = frame.get("id")
        if not _is_id(request_id):
            raise InvalidField("cancel needs the id of a request: a string of 1 to 128 characters")
        draft = self.pending.get(request_id)
        if draft is not None:
            draft.cancels += 1
            draft.cancel_ns = draft.cancel_ns or now_ns
            return []
        request = self.live.get(request_id)
        if request is None:
            return [Send(CancelAck.of(request_id, self._ended.get(request_id)))]
        if request.cancel_reason is not None:
            # Already stopping, but a finish may still win: answer once the outcome is known.
            request.unanswered_cancels += 1
            return []
        return self.request_cancel(request, Reason.USER_CANCELLED, now_ns)

    # Stops ----------------------------------------------------------------

    def request_cancel(self, request: Request, reason: Reason, now_ns: int) -> list[Action]:
        """Ask for a stop for ``reason``; only the first reason for a request counts."""
        if request.ended or request.cancel_reason is not None:
            return []
        request.cancel_reason = reason
        request.cancel_requested_ns = now_ns
        return [Cancel(request)]

    def stalled(self, request: Request | None, now_ns: int) -> list[Action]:
        """A send waited past the slow-consumer grace period: the client stopped reading.
        ``request`` is the request whose output the frame was; a frame of no one
        request (accepted, a terminal message) stops every live request."""
        targets = [request] if request is not None else list(self.live.values())
        actions: list[Action] = []
        for target in targets:
            actions += self.request_cancel(target, Reason.SLOW_CONSUMER, now_ns)
        return actions

    def stop_all(self, reason: Reason, now_ns: int) -> list[Action]:
        """Stop every live request of this connection: the client left, or the server is shutting down."""
        if reason is Reason.CLIENT_DISCONNECTED:
            # Prompts still being tokenized are dropped: nobody is left to answer.
            for _ in self.pending:
                self.quota.give_back(self.address)
            self.pending.clear()
        actions: list[Action] = []
        for request in list(self.live.values()):
            actions += self.request_cancel(request, reason, now_ns)
        return actions

    # What the scheduler and the engine report ------------------------------

    def accepted(self, request: Request, queue_position: int) -> list[Action]:
        """The scheduler took ``request``: 0 if it started at once, else its place in the queue."""
        return [Send(Accepted(request.id, queue_position, request.request_id, request.cancel_token))]

    def busy(self, request: Request, message: str) -> list[Action]:
        """The scheduler refused ``request``: every slot is busy and the queue is full."""
        return self.end(request, Ending(Outcome.ERROR, ErrorCode.BUSY, message=message))

    def over_quota(
        self, request: Request, limit: QuotaLimit, retry_after_s: float | None, message: str
    ) -> list[Action]:
        """The key's quota refused ``request`` before it reached the scheduler."""
        return self.end(
            request,
            Ending(
                Outcome.ERROR,
                ErrorCode.QUOTA_EXCEEDED,
                message=message,
                prompt_tokens=len(request.prompt_tokens),
                limit=limit,
                retry_after_s=retry_after_s,
            ),
        )

    def unauthorized(self, request: Request, message: str) -> list[Action]:
        """The key that opened this connection was revoked since: its new requests are refused."""
        return self.end(request, Ending(Outcome.ERROR, ErrorCode.UNAUTHORIZED, message=message))

    def failed(self, request: Request, message: str) -> list[Action]:
        """Submitting, starting or running ``request`` raised (a bug): it ends with internal_error."""
        return self.end(
            request,
            Ending(Outcome.ERROR, ErrorCode.INTERNAL_ERROR, message=message, prompt_tokens=len(request.prompt_tokens)),
        )

    def started(self, request: Request, now_ns: int) -> list[Action]:
        """``request`` took a slot. A stop asked for before there was a slot to stop is asked for again."""
        request.advance(Phase.PREFILL)
        request.started_ns = now_ns
        return [Cancel(request)] if request.cancel_reason is not None else []

    def token(self, request: Request, text: str, now_ns: int, logprobs: list[dict] | None = None) -> list[Action]:
        """Newly generated text: its token frame (none once the request has ended), with the
        log probabilities of the tokens it was read with, when they were asked for."""
        if request.ended:
            return []
        if request.phase is Phase.PREFILL:
            request.advance(Phase.DECODING)
            request.first_token_ns = now_ns
        frame = Token(request.id, request.next_index, text, logprobs)
        request.next_index += 1
        # A client that stopped reading gets no more tokens; everyone else gets every token generated.
        if request.cancel_reason is Reason.SLOW_CONSUMER:
            return []
        return [Send(frame, request)]

    def finished(self, request: Request, result: GenerationResult) -> list[Action]:
        """The native loop of ``request`` exited, and ``result`` is what it reported.

        This is the one place a loop's way out becomes an outcome and a reason. A
        cancelled loop ends with the reason this protocol asked for the stop: the
        native side knows only that a stop was asked for."""
        outcome, exit_reason = exit_outcome(result.exit)
        duration_ms = _ms(request.received_ns, result.end_ns)
        if outcome is Outcome.ERROR:
            return self.end(
                request,
                Ending(
                    outcome,
                    ErrorCode.INTERNAL_ERROR,
                    prompt_tokens=result.prompt_tokens,
                    prompt_tokens_evaluated=result.prompt_tokens_evaluated,
                    tokens_generated=result.tokens_generated,
                    message="the model failed to evaluate a batch",
                    duration_ms=duration_ms,
                ),
            )
        cancelled = outcome is Outcome.CANCELLED
        if not cancelled:
            reason = Reason(str(exit_reason))
        elif request.cancel_reason is not None:
            reason = request.cancel_reason
        else:
            return self.failed(request, "the generation stopped although no stop was asked for")
        return self.end(
            request,
            Ending(
                outcome,
                reason,
                prompt_tokens=result.prompt_tokens,
                prompt_tokens_reused=result.prompt_tokens_reused,
                prompt_tokens_evaluated=result.prompt_tokens_evaluated,
                tokens_generated=result.tokens_generated,
                tokens_after_cancel=result.tokens_after_cancel,
                queue_ms=_ms(request.received_ns, request.started_ns),
                ttft_ms=_ms(request.received_ns, result.first_token_ns) if result.first_token_ns else None,
                duration_ms=duration_ms,
                cancel_latency_ms=_ms(request.cancel_requested_ns, result.end_ns) if cancelled else None,
                longest_prefill_node_ms=result.longest_prefill_node_ns / 1e6,
                longest_decode_node_ms=result.longest_decode_node_ns / 1e6,
            ),
        )

    def cancelled_in_queue(self, request: Request, now_ns: int) -> list[Action]:
        """The scheduler took ``request``, stopped by a Cancel, out of its queue: it never reached a slot."""
        if request.cancel_reason is None:
            return self.failed(request, "the request left the queue although no stop was asked for")
        return self._ended_in_queue(request, Outcome.CANCELLED, request.cancel_reason, now_ns)

    def expired_in_queue(self, request: Request, now_ns: int) -> list[Action]:
        """``request`` was still queued at its ``queue_deadline_ns``: it times out without a slot."""
        first = _first_deadline(request)
        reason = first[1] if first is not None else Reason.TOTAL_TIMEOUT
        return self._ended_in_queue(request, Outcome.TIMEOUT, reason, now_ns)

    def _ended_in_queue(self, request: Request, outcome: Outcome, reason: Reason, now_ns: int) -> list[Action]:
        # Nothing was computed for it.
        waited_ms = _ms(request.received_ns, now_ns)
        return self.end(
            request,
            Ending(
                outcome,
                reason,
                prompt_tokens=len(request.prompt_tokens),
                queue_ms=waited_ms,
                duration_ms=waited_ms,
                cancel_latency_ms=_ms(request.cancel_requested_ns, now_ns) if outcome is Outcome.CANCELLED else None,
            ),
        )

    def end(self, request: Request, ending: Ending) -> list[Action]:
        """The one ending of ``request``: Ended, then its terminal frame (nothing if it already had one).

        Cancel frames not answered by the terminal frame itself (every one
        after the first, or all of them when another ending won the race) are
        answered here, after it, with a cancel_ack naming the outcome that won.
        """
        if request.ended:
            return []
        request.advance(Phase.ENDED)
        del self.live[request.id]
        self.quota.give_back(self.address)
        self._ended[request.id] = ending.outcome
        if len(self._ended) > self.limits.remembered_ids:
            self._ended.popitem(last=False)
        actions: list[Action] = [Ended(request, ending), Send(Terminal(request.id, ending))]
        acks = request.unanswered_cancels
        if request.cancel_reason is Reason.USER_CANCELLED and ending.outcome is not Outcome.CANCELLED:
            acks += 1
        actions += [Send(CancelAck.of(request.id, ending.outcome))] * acks
        return actions

    # Flood control ----------------------------------------------------------

    def _admit(self, now_ns: int, size: int) -> bool:
        lim = self.limits
        elapsed = (now_ns - self._tokens_at) / 1e9
        self._tokens_at = now_ns
        self._tokens = min(float(lim.frame_burst), self._tokens + elapsed * lim.frames_per_second)
        self._bytes = min(float(lim.byte_burst), self._bytes + elapsed * lim.bytes_per_second)
        if self._tokens < 1.0 or self._bytes < size:
            return False
        self._tokens -= 1.0
        self._bytes -= size
        return True

    def _rate_limited(self, now_ns: int) -> list[Action]:
        if not self._rate_limited_report.due(now_ns / 1e9):
            return []
        return [
            Send(
                ErrorFrame(
                    ErrorCode.RATE_LIMITED,
                    f"too many frames; the limits are {self.limits.frames_per_second:g} frames and "
                    f"{self.limits.bytes_per_second:g} bytes a second, excess frames are dropped",
                )
            )
        ]


# What each terminal frame reports besides its reason, in frame order.
_TERMINAL_FIELDS = {
    Outcome.DONE: (
        "tokens_generated",
        "prompt_tokens",
        "prompt_tokens_reused",
        "ttft_ms",
        "duration_ms",
        "tokens_per_s",
    ),
    Outcome.CANCELLED: (
        "tokens_generated",
        "tokens_after_cancel",
        "cancel_latency_ms",
        "tokens_wasted",
        "prompt_tokens_reused",
        "tokens_per_s",
    ),
    Outcome.TIMEOUT: ("tokens_generated", "duration_ms", "tokens_wasted", "prompt_tokens_reused", "tokens_per_s"),
}


# Validation ---------------------------------------------------------------


def parse_json_object(data: str, what: str = "frame") -> dict:
    """``data`` as a JSON object (a frame, or an HTTP body), or the ProtocolError that refuses it."""
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        raise InvalidJson(f"the {what} is not valid JSON") from None
    if not isinstance(value, dict):
        raise InvalidFrame(f"the {what} must be a JSON object")
    return value


def _parse(data: str) -> dict:
    frame = parse_json_object(data)
    if not isinstance(frame.get("type"), str):
        raise InvalidFrame("the frame needs a string field 'type'", _id_of(frame))
    return frame


def _encodable(text: str) -> bool:
    """False for text holding a lone surrogate (a JSON escape such as \\ud800), which no UTF-8 frame can carry."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _is_id(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and 1 <= len(value) <= 128 and _encodable(value)


def _id_of(frame: dict) -> str | None:
    """The frame's id if it can be echoed back in an error frame."""
    value = frame.get("id")
    return value if _is_id(value) else None


def _shown(value, limit: int = 40) -> str:
    """A short repr of a client's value for an error message."""
    text = (
        repr(value)
        if not isinstance(value, int) or abs(value) < 10**limit
        else f"an integer of {len(str(abs(value)))} digits"
    )
    return text if len(text) <= limit else text[:limit] + "…"


def _number(frame: dict, name: str, default, low, high, *, integer: bool, request_id: str, low_open: bool = False):
    value = frame.get(name)
    if value is None:
        return default
    kind = "an integer" if integer else "a number"
    # bool is an int in Python, but true is not a number in JSON.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise InvalidField(f"{name} must be {kind}", request_id)
    # Integers are compared as integers: a 400-digit one does not fit a float.
    if (
        (isinstance(value, float) and not math.isfinite(value))
        or value < low
        or value > high
        or (low_open and value == low)
    ):
        bound = f"({low:g}" if low_open else f"[{low:g}"
        raise InvalidField(f"{name} must be in {bound}, {high:g}]; got {_shown(value)}", request_id)
    return value


def _text_bytes(value: str, name: str, request_id: str) -> int:
    """The UTF-8 size of a client's text; text that has none (a lone surrogate) is refused."""
    try:
        return len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidField(
            f"{name} holds a lone surrogate (an unpaired \\ud800-\\udfff escape), which is not text",
            request_id,
        ) from None


# What a client is told when the engine cannot constrain its output.
GRAMMARS_NEED_LLAMA_CPP = (
    "structured output needs the llama.cpp engine (--engine llama.cpp, the default); this server runs ctransformers"
)


def _grammar(frame: dict, limits: Limits, request_id: str) -> str | None:
    """The grammar that ``json_schema``, ``json_object`` or ``tools`` asks for, if any does."""
    schema, json_object, tools = frame.get("json_schema"), frame.get("json_object"), frame.get("tools")
    if json_object is not None and not isinstance(json_object, bool):
        raise InvalidField("json_object must be true or false", request_id)
    asked = [
        name
        for name, given in (("json_schema", schema is not None), ("json_object", json_object), ("tools", tools))
        if given
    ]
    if len(asked) > 1:
        raise InvalidField(f"give {asked[0]} or {asked[1]}, not both", request_id)
    if not asked:
        return None
    if not limits.grammars:
        raise InvalidField(f"{asked[0]}: {GRAMMARS_NEED_LLAMA_CPP}", request_id)
    try:
        if tools:
            return _tools_grammar(frame, request_id)
        if schema is None:
            return JSON_OBJECT_GRAMMAR
        return schema_grammar(schema)
    except SchemaError as exc:
        raise InvalidField(f"{asked[0]}: {exc}", request_id) from None


def checked_tools(tools: object, request_id: str | None = None, *, param: str | None = None) -> list[dict]:
    """``tools``, if it is a list of function tools, for a generate frame or an OpenAI body."""
    if not isinstance(tools, list) or not all(is_tool(t) for t in tools):
        raise InvalidField(
            'tools must be a list of {"type": "function", "function": {"name": ..., "parameters": {...}}}',
            request_id,
            param=param,
        )
    return tools


def _tools_grammar(frame: dict, request_id: str) -> str:
    """The grammar of an answer that calls ``tools`` (docs/protocol.md#tool-calls)."""
    tools = checked_tools(frame["tools"], request_id)
    choice, parallel = frame.get("tool_choice", "auto"), frame.get("parallel_tool_calls", True)
    if choice not in tuple(ToolChoice):
        raise InvalidField('tool_choice must be "auto" or "required"', request_id)
    if not isinstance(parallel, bool):
        raise InvalidField("parallel_tool_calls must be true or false", request_id)
    return calls_grammar([t["function"] for t in tools], ToolChoice(choice), parallel)


def _validate_generate(frame: dict, limits: Limits, request_id: str):
    prompt, messages = frame.get("prompt"), frame.get("messages")
    if (prompt is None) == (messages is None):
        raise InvalidField("give exactly one of 'prompt' or 'messages'", request_id)
    if prompt is not None:
        if not isinstance(prompt, str):
            raise InvalidField("prompt must be a string", request_id)
        size = _text_bytes(prompt, "prompt", request_id)
    else:
        if not isinstance(messages, list) or not messages or len(messages) > limits.max_messages:
            raise InvalidField(f"messages must be a list of 1 to {limits.max_messages} messages", request_id)
        size = 0
        for message in messages:
            if (
                not isinstance(message, dict)
                or message.get("role") not in ("system", "user", "assistant")
                or not isinstance(message.get("content"), str)
            ):
                raise InvalidField(
                    'each message must be {"role": "system"|"user"|"assistant", "content": string}',
                    request_id,
                )
            size += _text_bytes(message["content"], "a message's content", request_id)
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    if size > limits.max_prompt_bytes:
        raise PromptTooLong(
            f"the prompt has {size} bytes; no prompt over {limits.max_prompt_bytes} bytes fits "
            f"the context of {limits.context_length} tokens",
            request_id,
        )

    stop = frame.get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if (
        not isinstance(stop, list)
        or len(stop) > limits.max_stop_sequences
        or not all(
            isinstance(s, str) and 1 <= _text_bytes(s, "stop", request_id) <= limits.max_stop_bytes for s in stop
        )
    ):
        raise InvalidField(
            f"stop must be a list of at most {limits.max_stop_sequences} strings of 1 to {limits.max_stop_bytes} bytes",
            request_id,
        )

    grammar = _grammar(frame, limits, request_id)
    d = DEFAULT_SAMPLING
    params = SamplingParams(
        max_tokens=_number(
            frame, "max_tokens", d.max_tokens, 1, limits.context_length, integer=True, request_id=request_id
        ),
        temperature=float(_number(frame, "temperature", d.temperature, 0, 5, integer=False, request_id=request_id)),
        top_k=_number(frame, "top_k", d.top_k, 0, limits.vocab_size, integer=True, request_id=request_id),
        top_p=float(_number(frame, "top_p", d.top_p, 0, 1, integer=False, low_open=True, request_id=request_id)),
        repetition_penalty=float(
            _number(frame, "repetition_penalty", d.repetition_penalty, 0.5, 2, integer=False, request_id=request_id)
        ),
        frequency_penalty=float(
            _number(frame, "frequency_penalty", d.frequency_penalty, -2, 2, integer=False, request_id=request_id)
        ),
        presence_penalty=float(
            _number(frame, "presence_penalty", d.presence_penalty, -2, 2, integer=False, request_id=request_id)
        ),
        seed=_number(frame, "seed", d.seed, 0, 2**31 - 1, integer=True, request_id=request_id),
        stop=tuple(stop),
        grammar=grammar,
        logprobs=_number(frame, "logprobs", d.logprobs, 0, 20, integer=True, request_id=request_id),
        # Requests may shorten the server's deadlines; longer ones are capped at its maximum.
        timeout_s=min(
            limits.max_timeout_s,
            float(
                _number(
                    frame,
                    "timeout_s",
                    limits.default_timeout_s,
                    0,
                    MAX_SECONDS,
                    integer=False,
                    low_open=True,
                    request_id=request_id,
                )
            ),
        ),
        ttft_timeout_s=min(
            limits.max_ttft_timeout_s,
            float(
                _number(
                    frame,
                    "ttft_timeout_s",
                    limits.default_ttft_timeout_s,
                    0,
                    MAX_SECONDS,
                    integer=False,
                    low_open=True,
                    request_id=request_id,
                )
            ),
        ),
    )
    return params, prompt, messages, size
