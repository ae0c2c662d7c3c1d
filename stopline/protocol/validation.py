"""A client's frame checked into its type (:mod:`.frames`): each refusal is a
:class:`~stopline.protocol.errors.ProtocolError` that names its code, the request and what the
field must be. A WebSocket text frame comes through :func:`incoming_frame`; an HTTP body, which
is a generate frame without its ``type``, through :func:`generate_frame`."""

from __future__ import annotations

import json
import math
import re
from typing import Any, Protocol, TypeGuard

from .errors import InvalidField, InvalidFrame, InvalidJson, ModelNotFound, PromptTooLong, UnknownType
from .frames import CancelFrame, GenerateFrame, Incoming
from .requests import (
    DEFAULT_SAMPLING,
    MAX_LOGIT_BIAS,
    MAX_MODEL_CHARS,
    MAX_PRIORITY,
    MAX_SECONDS,
    MAX_SEED,
    MAX_TOP_LOGPROBS,
    MAX_USER_CHARS,
    Limits,
    SamplingParams,
)


def parse_json_object(data: str, what: str = "frame") -> dict:
    """``data`` as a JSON object (a frame, or an HTTP body), or the ProtocolError that refuses it."""
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        raise InvalidJson(f"the {what} is not valid JSON") from None
    if not isinstance(value, dict):
        raise InvalidFrame(f"the {what} must be a JSON object")
    return value


class ModelBounds(Protocol):
    """The models a generate frame may name, and what a request for each may ask."""

    @property
    def names(self) -> tuple[str, ...]:
        """The served names, the first model's first."""

    def limits_of(self, requested: str) -> Limits | None:
        """The bounds of a request for the model named ``requested``; None: no model answers to it."""


def incoming_frame(data: str, limits: Limits, models: ModelBounds | None = None) -> Incoming:
    """A WebSocket text frame, checked: a generate frame against the bounds of the model it names
    (``models``; without them, one model answers to any name, whose bounds are ``limits``)."""
    frame = parse_json_object(data)
    kind = frame.get("type")
    if not isinstance(kind, str):
        raise InvalidFrame("the frame needs a string field 'type'", _id_of(frame))
    if kind == "generate":
        return generate_frame(frame, model_limits(frame, limits, models))
    if kind == "cancel":
        request_id = frame.get("id")
        if not _is_id(request_id):
            raise InvalidField("cancel needs the id of a request: a string of 1 to 128 characters")
        return CancelFrame(request_id)
    raise UnknownType(f"unknown type {_shown(kind)}; expected 'generate' or 'cancel'", _id_of(frame))


def model_limits(frame: dict, limits: Limits, models: ModelBounds | None) -> Limits:
    """The bounds of a request for the model a generate frame names in ``model``: the first model's
    (``limits``) when it names none; a name no model answers to is model_not_found, as on every API."""
    requested = frame.get("model")
    if requested is None:
        return limits
    request_id = _id_of(frame)
    if not isinstance(requested, str) or not 1 <= len(requested) <= MAX_MODEL_CHARS or not _encodable(requested):
        raise InvalidField(f"model must be a string of 1 to {MAX_MODEL_CHARS} characters", request_id)
    if models is None:
        return limits
    found = models.limits_of(requested)
    if found is None:
        raise ModelNotFound(
            f"the model {_shown(requested)} is not served here; this server serves "
            f"{', '.join(repr(name) for name in models.names)}",
            request_id,
            param="model",
        )
    return found


# A request id an HTTP client chooses travels in headers and in the path of
# /v1/generations/{request_id}, so it keeps to characters that need no escaping in either.
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# A cancel token a client chooses is the secret that stops its generation: long enough not to be guessed.
_CLIENT_CANCEL_TOKEN = re.compile(r"[A-Za-z0-9_-]{16,128}")


def client_request_id(value: str) -> str:
    """An HTTP client's own request id (``X-Request-Id``), checked."""
    if _CLIENT_REQUEST_ID.fullmatch(value) is None:
        raise InvalidField("X-Request-Id must be 1 to 128 characters, each a letter, a digit or one of . _ : -")
    if value.startswith("resp_"):
        # /v1/generations/{request_id} reads resp_ as a Response's prefix, and would not find it.
        raise InvalidField("X-Request-Id must not begin with resp_, the prefix of a Response's id")
    return value


def client_cancel_token(value: str) -> str:
    """An HTTP client's own cancel token (``X-Cancel-Token``), checked."""
    if _CLIENT_CANCEL_TOKEN.fullmatch(value) is None:
        raise InvalidField("X-Cancel-Token must be 16 to 128 characters, each a letter, a digit, _ or -")
    return value


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


def _number_field(
    frame: dict, name: str, default, low, high, *, integer: bool, request_id: str | None, low_open: bool = False
):
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


def _text_bytes(value: str, name: str, request_id: str | None) -> int:
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


def _grammar(frame: dict, limits: Limits, request_id: str | None) -> str | None:
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
    if limits.grammar_of is None:
        raise InvalidField(f"{asked[0]}: {GRAMMARS_NEED_LLAMA_CPP}", request_id)
    return limits.grammar_of(frame, asked[0], request_id)


def _sampling_numbers(limits: Limits) -> tuple[tuple[str, float, float, bool, bool], ...]:
    """The generate frame's numeric sampling fields: (name, lowest, highest, integer, lowest excluded)."""
    return (
        ("max_tokens", 1, limits.context_length, True, False),
        ("temperature", 0, 5, False, False),
        ("top_k", 0, limits.vocab_size, True, False),
        ("top_p", 0, 1, False, True),
        ("min_p", 0, 1, False, False),
        ("repetition_penalty", 0.5, 2, False, False),
        ("frequency_penalty", -2, 2, False, False),
        ("presence_penalty", -2, 2, False, False),
        ("seed", 0, MAX_SEED - 1, True, False),
        ("logprobs", 0, MAX_TOP_LOGPROBS, True, False),
    )


def _deadline(frame: dict, name: str, default: float, cap: float, request_id: str | None) -> float:
    """A request's deadline in seconds: its own, at most ``cap``, or the server's ``default``."""
    value = _number_field(frame, name, default, 0, MAX_SECONDS, integer=False, low_open=True, request_id=request_id)
    return min(cap, float(value))


def _logit_bias(frame: dict, limits: Limits, request_id: str | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: an object from token ids (strings, as JSON's keys are) to biases."""
    value = frame.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise InvalidField(
            f"logit_bias must be an object of at most {MAX_LOGIT_BIAS} token ids, each to a number from -100 to 100",
            request_id,
        )
    bias = []
    for key, amount in value.items():
        key = str(key)
        token = int(key) if key.isascii() and key.isdigit() and len(key) <= 10 else -1
        if not 0 <= token < limits.vocab_size:
            raise InvalidField(
                f"logit_bias: {_shown(key)} is not a token id of the model (0 to {limits.vocab_size - 1})", request_id
            )
        name = f"logit_bias[{token}]"
        bias.append(
            (token, float(_number_field({name: amount}, name, 0, -100, 100, integer=False, request_id=request_id)))
        )
    return tuple(bias)


def generate_frame(frame: dict, limits: Limits) -> GenerateFrame:
    """A generate frame's fields, checked (its ``type``, if any, is not read)."""
    client_id = frame.get("id")
    if client_id is not None and not _is_id(client_id):
        raise InvalidField("id must be a string of 1 to 128 characters")
    # Refusals echo the client's id; a request whose id the server would choose has none yet.
    request_id = client_id
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
    ignore_eos = frame.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise InvalidField("ignore_eos must be true or false", request_id)
    if ignore_eos and grammar is not None:
        # A grammar's answer ends with the end-of-generation token that ignore_eos forbids.
        raise InvalidField("ignore_eos cannot be combined with json_schema, json_object or tools", request_id)
    numbers: dict[str, Any] = {}
    for name, low, high, integer, low_open in _sampling_numbers(limits):
        value = _number_field(
            frame,
            name,
            getattr(DEFAULT_SAMPLING, name),
            low,
            high,
            integer=integer,
            low_open=low_open,
            request_id=request_id,
        )
        numbers[name] = value if integer or value is None else float(value)
    params = SamplingParams(
        **numbers,
        stop=tuple(stop),
        grammar=grammar,
        logit_bias=_logit_bias(frame, limits, request_id),
        ignore_eos=bool(ignore_eos),
        # Requests may shorten the server's deadlines; longer ones are capped at its maximum.
        timeout_s=_deadline(frame, "timeout_s", limits.default_timeout_s, limits.max_timeout_s, request_id),
        ttft_timeout_s=_deadline(
            frame, "ttft_timeout_s", limits.default_ttft_timeout_s, limits.max_ttft_timeout_s, request_id
        ),
    )
    user = frame.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_CHARS):
        raise InvalidField(f"user must be a string of at most {MAX_USER_CHARS} characters", request_id)
    if user is not None:
        _text_bytes(user, "user", request_id)
    min_answer_tokens = _number_field(
        frame, "min_answer_tokens", 1, 1, limits.context_length, integer=True, request_id=request_id
    )
    priority = _number_field(frame, "priority", None, -MAX_PRIORITY, MAX_PRIORITY, integer=True, request_id=request_id)
    model = frame.get("model")

    return GenerateFrame(
        client_id,
        params,
        prompt,
        messages,
        size,
        user,
        min_answer_tokens,
        priority,
        model=model if isinstance(model, str) else None,
    )
