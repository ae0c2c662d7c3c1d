"""What Stopline does with every field of OpenAI's request bodies, and the generate frame they ask for.

One table, :data:`FIELDS`, names every field of the chat-completions and
completions request bodies and its treatment: honoured, honoured only at its
default (any other value is refused), or refused. docs/http.md holds the same
table for readers, and a test checks that the two agree. Nothing is ignored in
silence: a field that is not honoured is refused with 400
``unsupported_parameter`` naming it, and so is a field that is not in the table.

No I/O here: :func:`openai_generate_frame` turns a parsed body into a
``generate`` frame, which the protocol then validates like any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from .protocol import GRAMMARS_NEED_LLAMA_CPP
from .vocabulary import ErrorCode


class Treatment(StrEnum):
    """What Stopline does with a field; the words of the docs table."""

    HONOURED = "honoured"
    # Accepted at the values in ``Field.neutral`` (its default), refused at any other.
    DEFAULT_ONLY = "default only"
    REFUSED = "refused"


class Endpoint(StrEnum):
    CHAT = "chat"
    COMPLETIONS = "completions"


BOTH = frozenset(Endpoint)
CHAT = frozenset({Endpoint.CHAT})
COMPLETIONS = frozenset({Endpoint.COMPLETIONS})


@dataclass(frozen=True)
class Field:
    name: str
    endpoints: frozenset[Endpoint]
    treatment: Treatment
    # For DEFAULT_ONLY: the values accepted (null is always accepted, as absent).
    neutral: tuple = ()
    # The generate frame's field it becomes, when honoured (None: read by the API itself).
    frame_name: str | None = None
    # A value the table-vs-server test sends; for a refused field, one that is refused.
    example: object = None


# Every field of the two request bodies, as OpenAI's API reference lists them,
# and Stopline's own sampling fields (passed with the openai package's extra_body).
FIELDS: tuple[Field, ...] = (
    Field("messages", CHAT, Treatment.HONOURED),
    Field("prompt", COMPLETIONS, Treatment.HONOURED),
    Field("model", BOTH, Treatment.HONOURED),
    Field("max_tokens", BOTH, Treatment.HONOURED, frame_name="max_tokens", example=2),
    Field("max_completion_tokens", CHAT, Treatment.HONOURED, frame_name="max_tokens", example=2),
    Field("temperature", BOTH, Treatment.HONOURED, frame_name="temperature", example=0),
    Field("top_p", BOTH, Treatment.HONOURED, frame_name="top_p", example=0.5),
    Field("seed", BOTH, Treatment.HONOURED, frame_name="seed", example=7),
    Field("stop", BOTH, Treatment.HONOURED, frame_name="stop", example=["\n"]),
    Field("user", BOTH, Treatment.HONOURED, frame_name="user", example="alice"),
    Field("safety_identifier", CHAT, Treatment.HONOURED, frame_name="user", example="alice"),
    Field("stream", BOTH, Treatment.HONOURED, example=False),
    Field("stream_options", BOTH, Treatment.HONOURED, example={"include_usage": True}),
    Field("n", BOTH, Treatment.DEFAULT_ONLY, neutral=(1,), example=2),
    Field("best_of", COMPLETIONS, Treatment.DEFAULT_ONLY, neutral=(1,), example=2),
    Field("echo", COMPLETIONS, Treatment.DEFAULT_ONLY, neutral=(False,), example=True),
    Field("suffix", COMPLETIONS, Treatment.REFUSED, example="!"),
    Field("frequency_penalty", BOTH, Treatment.HONOURED, frame_name="frequency_penalty", example=0.5),
    Field("presence_penalty", BOTH, Treatment.HONOURED, frame_name="presence_penalty", example=0.5),
    Field("logit_bias", BOTH, Treatment.DEFAULT_ONLY, neutral=({},), example={"50256": -100}),
    Field("logprobs", CHAT, Treatment.HONOURED, example=True),
    Field("logprobs", COMPLETIONS, Treatment.HONOURED, frame_name="logprobs", example=2),
    Field("top_logprobs", CHAT, Treatment.HONOURED, example=2),
    Field("response_format", CHAT, Treatment.HONOURED, example={"type": "json_object"}),
    Field(
        "tools", CHAT, Treatment.DEFAULT_ONLY, neutral=([],), example=[{"type": "function", "function": {"name": "f"}}]
    ),
    Field("tool_choice", CHAT, Treatment.DEFAULT_ONLY, neutral=("none",), example="required"),
    Field("parallel_tool_calls", CHAT, Treatment.REFUSED, example=False),
    Field("functions", CHAT, Treatment.DEFAULT_ONLY, neutral=([],), example=[{"name": "f"}]),
    Field("function_call", CHAT, Treatment.DEFAULT_ONLY, neutral=("none",), example="auto"),
    Field("modalities", CHAT, Treatment.DEFAULT_ONLY, neutral=(["text"],), example=["text", "audio"]),
    Field("audio", CHAT, Treatment.REFUSED, example={"voice": "alloy", "format": "wav"}),
    Field("prediction", CHAT, Treatment.REFUSED, example={"type": "content", "content": "x"}),
    Field("reasoning_effort", CHAT, Treatment.REFUSED, example="low"),
    Field("verbosity", CHAT, Treatment.REFUSED, example="low"),
    Field("web_search_options", CHAT, Treatment.REFUSED, example={}),
    Field("service_tier", CHAT, Treatment.DEFAULT_ONLY, neutral=("auto", "default"), example="flex"),
    Field("store", CHAT, Treatment.DEFAULT_ONLY, neutral=(False,), example=True),
    Field("metadata", CHAT, Treatment.REFUSED, example={"k": "v"}),
    Field("prompt_cache_key", CHAT, Treatment.REFUSED, example="k"),
    Field("prompt_cache_retention", CHAT, Treatment.REFUSED, example="24h"),
    # Stopline's own (docs/protocol.md#generate).
    Field("top_k", BOTH, Treatment.HONOURED, frame_name="top_k", example=5),
    Field("repetition_penalty", BOTH, Treatment.HONOURED, frame_name="repetition_penalty", example=1.2),
    Field("timeout_s", BOTH, Treatment.HONOURED, frame_name="timeout_s", example=60),
    Field("ttft_timeout_s", BOTH, Treatment.HONOURED, frame_name="ttft_timeout_s", example=60),
)


def fields_of(endpoint: Endpoint) -> dict[str, Field]:
    return {f.name: f for f in FIELDS if endpoint in f.endpoints}


_BY_ENDPOINT = {endpoint: fields_of(endpoint) for endpoint in Endpoint}

_ROLES = {"developer": "system", "system": "system", "user": "user", "assistant": "assistant"}


class Refused(ValueError):
    """A body Stopline will not run: its error code, message and the field it names (``param``)."""

    def __init__(self, code: ErrorCode, message: str, param: str | None = None):
        super().__init__(code, message)
        self.code = code
        self.message = message
        self.param = param


def _same(value: object, neutral: object) -> bool:
    # 1 == True in Python; a JSON boolean is not a number.
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


def openai_generate_frame(body: dict, *, chat: bool, model: str, grammars: bool) -> dict:
    """The generate frame an OpenAI request body asks for, or :class:`Refused`.
    ``model`` is the one model this server serves; ``grammars``, whether its engine
    can constrain output to a grammar (``Limits.grammars``)."""
    table = _BY_ENDPOINT[Endpoint.CHAT if chat else Endpoint.COMPLETIONS]
    for name, value in body.items():
        field = table.get(name)
        if field is None:
            raise Refused(ErrorCode.UNSUPPORTED_PARAMETER, f"{name} is not a parameter Stopline knows", name)
        if value is None or field.treatment is Treatment.HONOURED:
            continue
        if field.treatment is Treatment.DEFAULT_ONLY and any(_same(value, n) for n in field.neutral):
            continue
        accepted = " or ".join(repr(n) for n in field.neutral)
        raise Refused(
            ErrorCode.UNSUPPORTED_PARAMETER,
            f"{name} is not supported" + (f" (only {accepted})" if accepted else ""),
            name,
        )
    requested = body.get("model")
    if requested is not None and requested != model:
        raise Refused(
            ErrorCode.MODEL_NOT_FOUND,
            f"the model {requested!r} is not served here; this server runs {model!r}",
            "model",
        )
    frame: dict = {"type": "generate"}
    if chat:
        messages = body.get("messages")
        if isinstance(messages, list):
            messages = [_message(m, i) for i, m in enumerate(messages)]
        frame["messages"] = messages
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise Refused(ErrorCode.INVALID_FIELD, "prompt must be a string (or a list of one string)", "prompt")
        frame["prompt"] = prompt
    if body.get("response_format") is not None:
        frame.update(_response_format(body["response_format"], grammars))
    if chat:
        frame.update(_chat_logprobs(body.get("logprobs"), body.get("top_logprobs")))
    # max_completion_tokens (OpenAI's newer name) wins over max_tokens, safety_identifier yields to user.
    preferred = ("max_completion_tokens", "user")
    for name in (*preferred, *table):
        field = table[name] if name in table else None
        if field is not None and field.frame_name is not None and body.get(name) is not None:
            frame.setdefault(field.frame_name, body[name])
    return frame


def _chat_logprobs(logprobs: object, top: object) -> dict:
    """The generate frame's ``logprobs`` (how many alternatives) for chat's two fields."""
    if logprobs is not None and not isinstance(logprobs, bool):
        raise Refused(ErrorCode.INVALID_FIELD, "logprobs must be true or false", "logprobs")
    if not logprobs:
        if top not in (None, 0):
            raise Refused(ErrorCode.INVALID_FIELD, "top_logprobs needs logprobs: true", "top_logprobs")
        return {}
    # The protocol checks the count (0 to 20).
    return {"logprobs": 0 if top is None else top}


def _response_format(value: object, grammars: bool) -> dict:
    """The generate frame's fields for ``response_format``: none for text, else the JSON constraint."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return {}
    if kind not in ("json_object", "json_schema"):
        raise Refused(
            ErrorCode.UNSUPPORTED_PARAMETER,
            "response_format.type must be text, json_object or json_schema",
            "response_format",
        )
    if not grammars:
        raise Refused(
            ErrorCode.UNSUPPORTED_PARAMETER, f"response_format {kind}: {GRAMMARS_NEED_LLAMA_CPP}", "response_format"
        )
    if kind == "json_object":
        return {"json_object": True}
    spec = value.get("json_schema") if isinstance(value, dict) else None
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise Refused(
            ErrorCode.INVALID_FIELD, "response_format.json_schema.schema must be an object", "response_format"
        )
    # strict or not, the schema is enforced.
    return {"json_schema": spec["schema"]}


def _message(message, index: int):
    """A chat message in the protocol's shape: text parts are joined, developer means system."""
    if not isinstance(message, dict):
        return message
    where = f"messages[{index}]"
    role = message.get("role")
    # Only role and content are read; any other key with a value is refused (null counts as absent).
    for key, value in message.items():
        if key not in ("role", "content") and value is not None:
            raise Refused(ErrorCode.UNSUPPORTED_PARAMETER, f"{where}.{key} is not supported", f"{where}.{key}")
    if role not in _ROLES:
        raise Refused(
            ErrorCode.UNSUPPORTED_PARAMETER,
            f"{where}.role {role!r} is not supported; use system, developer, user or assistant",
            f"{where}.role",
        )
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise Refused(ErrorCode.UNSUPPORTED_PARAMETER, "only text content parts are supported", f"{where}.content")
        content = "".join(p["text"] for p in content)
    return {"role": _ROLES[role], "content": content}
