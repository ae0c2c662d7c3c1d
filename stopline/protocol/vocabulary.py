"""The names of outcomes, reasons and error codes.

Frames, JSON logs, Prometheus labels, docs and the native extension all use
these exact strings. Define a name here before using it anywhere else.
"""

from __future__ import annotations

from enum import StrEnum


class Outcome(StrEnum):
    """How a request ended: the ``type`` of its terminal message."""

    DONE = "done"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    ERROR = "error"


# The ``type`` of every frame that is a request's last: its terminal message, one per outcome.
TERMINAL_TYPES = frozenset(str(outcome) for outcome in Outcome)


class Reason(StrEnum):
    """Why it ended that way: the ``reason`` field and the ``reason`` label."""

    # done
    EOS = "eos"
    MAX_TOKENS = "max_tokens"
    STOP_SEQUENCE = "stop_sequence"
    # cancelled
    USER_CANCELLED = "user_cancelled"
    CLIENT_DISCONNECTED = "client_disconnected"
    SHUTDOWN = "shutdown"
    SLOW_CONSUMER = "slow_consumer"
    # timeout
    TOTAL_TIMEOUT = "total_timeout"
    FIRST_TOKEN_TIMEOUT = "first_token_timeout"
    # error: the replica running it died (--redis-url); a survivor ended it in the shared store.
    OWNER_LOST = "owner_lost"


REASONS_BY_OUTCOME = {
    Outcome.DONE: (Reason.EOS, Reason.MAX_TOKENS, Reason.STOP_SEQUENCE),
    Outcome.CANCELLED: (Reason.USER_CANCELLED, Reason.CLIENT_DISCONNECTED, Reason.SHUTDOWN, Reason.SLOW_CONSUMER),
    Outcome.TIMEOUT: (Reason.TOTAL_TIMEOUT, Reason.FIRST_TOKEN_TIMEOUT),
    Outcome.ERROR: (Reason.OWNER_LOST,),
}


class AbortMode(StrEnum):
    """How a running evaluation is stopped: ``/healthz``, the ``mode`` label, ``--abort-mode``."""

    # Between ggml graph nodes, inside an evaluation (the step hook is live).
    IN_STEP = "in_step"
    # Only between evaluations: before each prompt chunk and each token.
    BETWEEN_STEPS = "between_steps"


class Batching(StrEnum):
    """How the llama.cpp engine evaluates generations that run at once: ``--batching``."""

    # Each slot is a context of its own, and each generation's evaluations its own.
    PER_SLOT = "per_slot"
    # The slots are the sequences of one context, and every step is one batch
    # carrying each running generation's next tokens (continuous batching).
    SHARED = "shared"


class PromptSteps(StrEnum):
    """Which step a prompt's last chunk takes in shared steps: ``--prompt-steps``."""

    # The step of every running generation's next token, as any other chunk.
    MIXED = "mixed"
    # A step of its own, the running generations' tokens waiting for the next: the new
    # generation's first token then waits for no other generation's work.
    ALONE = "alone"


class EngineName(StrEnum):
    """Which engine computes the model: ``--engine``, ``/healthz``, the ``engine`` label."""

    # ctransformers 0.2.27 (a 2023 llama.cpp), the default.
    CTRANSFORMERS = "ctransformers"
    # Today's llama.cpp, through Stopline's own shim (ext/llama_abi.h).
    LLAMA_CPP = "llama.cpp"


class BuiltinTemplate(StrEnum):
    """The chat templates ``--chat-template`` names without a file (stopline/engine/tokenizer.py holds them)."""

    CHATML = "chatml"
    LLAMA2 = "llama2"
    ZEPHYR = "zephyr"


class ChatFormat(StrEnum):
    """How a chat's messages become the prompt: ``chat_format`` in ``/v1/models``, ``/healthz``
    and the ``server_started`` log line."""

    # The model file's own chat template.
    MODEL_TEMPLATE = "model_template"
    # The template --chat-template named.
    GIVEN_TEMPLATE = "given_template"
    # The file has none (a base model): the messages' text, completed as it is.
    PLAIN_TEXT = "plain_text"

    @classmethod
    def of(cls, model_template: str | None, given: str | None) -> ChatFormat:
        """The format in force: --chat-template's if given, else the file's template, else plain text."""
        if given is not None:
            return cls.GIVEN_TEMPLATE
        return cls.MODEL_TEMPLATE if model_template else cls.PLAIN_TEXT


class ModelNames(StrEnum):
    """Which model names an OpenAI request may send: ``--model-names``."""

    # Any name: the one model served answers, and reports its own name.
    ANY = "any"
    # Only the served names (``--served-model-name``); another gets 404 model_not_found.
    SERVED = "served"


class ErrorCode(StrEnum):
    """The ``code`` of an ``error`` frame; also its ``reason`` label in metrics."""

    INVALID_JSON = "invalid_json"
    INVALID_FRAME = "invalid_frame"
    UNKNOWN_TYPE = "unknown_type"
    INVALID_FIELD = "invalid_field"
    BINARY_FRAME = "binary_frame"
    DUPLICATE_ID = "duplicate_id"
    PROMPT_TOO_LONG = "prompt_too_long"
    TOO_MANY_REQUESTS = "too_many_requests"
    TOO_MANY_REQUESTS_FROM_ADDRESS = "too_many_requests_from_address"
    BUSY = "busy"
    RATE_LIMITED = "rate_limited"
    INTERNAL_ERROR = "internal_error"
    # HTTP API only (docs/http.md)
    UNKNOWN_REQUEST = "unknown_request"
    INVALID_CANCEL_TOKEN = "invalid_cancel_token"
    NOT_FOUND = "not_found"
    # OpenAI endpoints only: a body field Stopline does not honour, a model it does not serve.
    UNSUPPORTED_PARAMETER = "unsupported_parameter"
    MODEL_NOT_FOUND = "model_not_found"
    # A model beyond the first cannot load: the memory budget (--memory-budget) has no room for it
    # beside the models that are serving requests.
    INSUFFICIENT_MEMORY = "insufficient_memory"
    # POST /v1/embeddings only: more inputs than one request may embed.
    TOO_MANY_INPUTS = "too_many_inputs"
    # Cross-replica GET/DELETE with --redis-url (docs/deploy.md)
    STORE_UNAVAILABLE = "store_unavailable"
    OWNER_UNREACHABLE = "owner_unreachable"
    # API keys and their quotas (docs/http.md#api-keys): HTTP 401 and 429
    UNAUTHORIZED = "unauthorized"
    QUOTA_EXCEEDED = "quota_exceeded"


class Status(StrEnum):
    """Where a request stands, as ``GET``/``DELETE /v1/generations/{request_id}`` report it;
    ``cancel_ack`` names the outcome of an ended request by the same words."""

    QUEUED = "queued"
    PREFILL = "prefill"
    DECODING = "decoding"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    ERROR = "error"
    # cancel_ack only: no live or recent request on this connection has that id.
    UNKNOWN = "unknown"
    # Another replica ran it and has stopped sending heartbeats: it ended with that replica.
    OWNER_LOST = "owner_lost"


STATUS_BY_OUTCOME = {
    Outcome.DONE: Status.FINISHED,
    Outcome.CANCELLED: Status.CANCELLED,
    Outcome.TIMEOUT: Status.TIMEOUT,
    Outcome.ERROR: Status.ERROR,
}


class Refusal(StrEnum):
    """Why a connection was refused before it became a WebSocket: the body of the
    HTTP answer and the ``code`` label of ``stopline_refused_connections_total``."""

    HOST_NOT_ALLOWED = "host_not_allowed"
    ORIGIN_NOT_ALLOWED = "origin_not_allowed"
    INVALID_HEADER = "invalid_header"
    TOO_MANY_CONNECTIONS = "too_many_connections"
    HEADERS_TOO_LARGE = "headers_too_large"
    HANDSHAKE_TIMEOUT = "handshake_timeout"
    # No API key, or not one of this server's (also ErrorCode.UNAUTHORIZED, the same word).
    UNAUTHORIZED = "unauthorized"


class QuotaLimit(StrEnum):
    """Which of a key's limits refused a request: the ``limit`` of a ``quota_exceeded`` error,
    the ``limit`` label of ``stopline_quota_refusals_total``, and a field of a keys-file entry."""

    CONCURRENT = "concurrent"
    REQUESTS_PER_MINUTE = "requests_per_minute"
    TOKENS_PER_MINUTE = "tokens_per_minute"
    MAX_PROMPT_TOKENS = "max_prompt_tokens"


# The ``event`` of a request's end log line, and of its record in the cancellation log.
END_EVENTS = {outcome: f"generation_{outcome}" for outcome in Outcome}


class StoreState(StrEnum):
    """Whether the shared store (``--redis-url``) can be reached: ``/healthz`` and ``stopline_redis_up``."""

    UP = "up"
    DOWN = "down"


class KeyEvent(StrEnum):
    """The log events of API keys (``--api-key``, ``--api-keys-file``)."""

    # Startup, and every SIGHUP: how many keys are in force (never a key).
    LOADED = "keys_loaded"
    # A SIGHUP found the keys file unreadable or invalid: the keys already in force stay.
    RELOAD_FAILED = "keys_reload_failed"
    # Listening beyond loopback with no key: anyone who reaches the port may generate.
    NONE_CONFIGURED = "no_api_keys"
    # Requests and connections refused for a missing or wrong key, at most one line a second.
    REFUSED = "unauthorized"
    # With --redis-url, a quota decision was taken by this replica alone: Redis was down or slow.
    QUOTA_LOCAL = "quota_decided_locally"
