"""The frames, typed both ways. A frame the protocol sends becomes JSON (``Frame.json()``,
then :func:`encode_frame`) only at the transport, so a consumer reads attributes, and a
renamed field is a type error rather than a KeyError in an adapter. A frame a client
sends is checked into a :class:`GenerateFrame` or a :class:`CancelFrame` before the
protocol acts on it (:mod:`.validation`), whether it came as WebSocket text or as an
HTTP body."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import ClassVar

from .errors import ProtocolError
from .requests import DEFAULT_SAMPLING, HELLO_DEFAULTS, Ending, Limits, SamplingParams
from .vocabulary import STATUS_BY_OUTCOME, ErrorCode, Outcome, QuotaLimit, Refusal, Status

PROTOCOL_VERSION = 1


# Frames a client sends --------------------------------------------------------


@dataclass(frozen=True)
class GenerateFrame:
    """A generate frame whose every field has been checked: what a request asks for."""

    # The client's id for the request; None: the server chooses one.
    id: str | None
    params: SamplingParams
    # Exactly one of the two.
    prompt: str | None
    messages: list[dict] | None
    # The prompt's UTF-8 bytes.
    size: int
    user: str | None = None
    # The room the prompt must leave in the context for the answer, in tokens.
    min_answer_tokens: int = 1
    # vLLM's priority: a lower value is served first, and may preempt a higher one; None: the
    # API key's default (0 without one).
    priority: int | None = None
    # The server-global request id and cancel token an HTTP client chose for it (X-Request-Id,
    # X-Cancel-Token, checked by client_request_id and client_cancel_token); None: the server's.
    request_id: str | None = None
    cancel_token: str | None = None
    # The model the request names (a WebSocket frame's ``model``); None: the first model.
    model: str | None = None


@dataclass(frozen=True)
class CancelFrame:
    """Stop the request ``id``, wherever it is."""

    id: str


Incoming = GenerateFrame | CancelFrame


# Frames the server sends ------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """The greeting, once per WebSocket connection: the model a generate frame runs on when it
    names none, every model one may name, and what a request may ask for."""

    type: ClassVar[str] = "hello"
    model: str
    limits: Limits
    models: tuple[str, ...] = ()

    def json(self) -> dict:
        lim = self.limits
        return {
            "type": self.type,
            "protocol": PROTOCOL_VERSION,
            "model": self.model,
            "models": list(self.models or (self.model,)),
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
    """The scheduler took a request: its place in the queue (0: it started), its id and cancel
    token, its prompt's length in tokens, and the name of the model that serves it."""

    type: ClassVar[str] = "accepted"
    id: str
    queue_position: int
    request_id: str
    cancel_token: str
    prompt_tokens: int
    # None: a request that reached no model.
    model: str | None = None

    def json(self) -> dict:
        frame = {"type": self.type, **asdict(self)}
        if self.model is None:
            del frame["model"]
        return frame


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
class Preempted:
    """The request's generation was paused for a request of higher priority. What it evaluated
    stays in the KV cache: it goes on from there once ``resumed``, losing and repeating nothing."""

    type: ClassVar[str] = "preempted"
    id: str

    def json(self) -> dict:
        return {"type": self.type, "id": self.id}


@dataclass(frozen=True)
class Resumed:
    """A preempted generation goes on."""

    type: ClassVar[str] = "resumed"
    id: str

    def json(self) -> dict:
        return {"type": self.type, "id": self.id}


@dataclass(frozen=True)
class ErrorFrame:
    """A frame or a request refused. A quota refusal names its limit, and when trying again may succeed."""

    type: ClassVar[str] = str(Outcome.ERROR)
    code: ErrorCode | Refusal
    message: str
    id: str | None = None
    limit: QuotaLimit | None = None
    retry_after_s: float | None = None

    @classmethod
    def refusing(cls, error: ProtocolError) -> ErrorFrame:
        return cls(error.code, error.message, error.request_id)

    def json(self) -> dict:
        frame: dict = {"type": self.type, "id": self.id, "code": str(self.code), "message": self.message}
        if self.limit is not None:
            frame.update(limit=str(self.limit), retry_after_s=self.retry_after_s)
        return frame


@dataclass(frozen=True)
class Terminal:
    """A request's one terminal message: how it ended (``ending``), what that cost, and the name
    of the model that served it (None: a request that reached no model)."""

    id: str
    ending: Ending
    model: str | None = None

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
            frame = error.json()
        else:
            ending = self.ending
            frame = {"type": self.type, "id": self.id, "reason": str(ending.reason)}
            frame.update((name, getattr(ending, name)) for name in _TERMINAL_FIELDS[ending.outcome])
        if self.model is not None:
            frame["model"] = self.model
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


Frame = Hello | Accepted | Token | Preempted | Resumed | ErrorFrame | Terminal | CancelAck


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
        "prompt_tokens_wasted",
        "wasted_eval_ms",
        "prompt_tokens_reused",
        "tokens_per_s",
    ),
    Outcome.TIMEOUT: (
        "tokens_generated",
        "duration_ms",
        "tokens_wasted",
        "prompt_tokens_wasted",
        "wasted_eval_ms",
        "prompt_tokens_reused",
        "tokens_per_s",
    ),
}
