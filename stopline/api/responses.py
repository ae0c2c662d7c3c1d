"""OpenAI's Responses API (``POST /v1/responses``): a request body checked into the one
generate frame, and how a generation's end reads as a Response's status. No I/O here.

:data:`FIELDS` names every field of the request body and what Stopline does with it, as
:mod:`.anthropic_messages` does for Anthropic's: honoured, or refused with 400
``unsupported_parameter`` naming it. Nothing is ignored in silence. The answer's events and
objects come from the same frames as every other API's (``stopline/responses_api.py``
writes them).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..protocol.errors import InvalidField, ModelNotFound, UnsupportedParameter
from ..protocol.frames import GenerateFrame
from ..protocol.requests import Ending, Limits
from ..protocol.validation import GRAMMARS_NEED_LLAMA_CPP, generate_frame
from ..protocol.vocabulary import Outcome, Reason
from .openai_fields import ServedModels, Treatment

# Every field of the request body, as OpenAI's API reference and its Python package list them.
FIELDS: dict[str, Treatment] = {
    "model": Treatment.HONOURED,
    "input": Treatment.HONOURED,
    "instructions": Treatment.HONOURED,
    "max_output_tokens": Treatment.HONOURED,
    "temperature": Treatment.HONOURED,
    "top_p": Treatment.HONOURED,
    "stream": Treatment.HONOURED,
    "metadata": Treatment.HONOURED,
    "text": Treatment.HONOURED,
    "background": Treatment.HONOURED,
    # Whether GET /v1/responses/{id} may answer for it later (the server keeps the last few).
    "store": Treatment.HONOURED,
    "user": Treatment.HONOURED,
    "safety_identifier": Treatment.HONOURED,
    # A prompt's prefix is reused from the KV cache whenever a slot holds it, asked or not.
    "prompt_cache_key": Treatment.HONOURED,
    # Stopline's own sampling fields, as on the other OpenAI endpoints (the package's extra_body).
    "seed": Treatment.HONOURED,
    "top_k": Treatment.HONOURED,
    "timeout_s": Treatment.HONOURED,
    "ttft_timeout_s": Treatment.HONOURED,
    "tools": Treatment.REFUSED,
    "tool_choice": Treatment.REFUSED,
    "parallel_tool_calls": Treatment.REFUSED,
    "max_tool_calls": Treatment.REFUSED,
    "previous_response_id": Treatment.REFUSED,
    "conversation": Treatment.REFUSED,
    "context_management": Treatment.REFUSED,
    "include": Treatment.REFUSED,
    "prompt": Treatment.REFUSED,
    "reasoning": Treatment.REFUSED,
    "service_tier": Treatment.REFUSED,
    "stream_options": Treatment.REFUSED,
    "top_logprobs": Treatment.REFUSED,
    "truncation": Treatment.REFUSED,
    "prompt_cache_retention": Treatment.REFUSED,
    "prompt_cache_options": Treatment.REFUSED,
    "background_options": Treatment.REFUSED,
    "moderation": Treatment.REFUSED,
    "image": Treatment.REFUSED,
    "access_programs": Treatment.REFUSED,
}

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
# The content part types whose text a message's content may join.
_TEXT_PARTS = ("input_text", "output_text")
# Sampling fields copied onto the generate frame as they are.
_SAMPLING = ("temperature", "top_p", "seed", "top_k", "timeout_s", "ttft_timeout_s")


@dataclass(frozen=True)
class ResponsesRequest:
    frame: GenerateFrame
    # The model name the answer reports.
    model: str
    instructions: str | None
    metadata: dict
    stream: bool
    background: bool
    store: bool
    # The request's own text.format, echoed in the Response's ``text``.
    text_format: dict


def response_status(ending: Ending) -> str:
    """A Response's status once its generation has ended; one map for every way it ends."""
    if ending.outcome is Outcome.DONE:
        return "incomplete" if ending.reason is Reason.MAX_TOKENS else "completed"
    if ending.outcome is Outcome.CANCELLED:
        return "cancelled"
    if ending.outcome is Outcome.TIMEOUT:
        return "incomplete"
    return "failed"


def incomplete_reason(ending: Ending) -> str | None:
    """``incomplete_details.reason`` of a Response that did not complete: max_output_tokens, as
    OpenAI names it, or a cancel's or a timeout's own reason (user_cancelled, total_timeout, ...)."""
    if response_status(ending) in ("completed", "failed"):
        return None
    return "max_output_tokens" if ending.reason is Reason.MAX_TOKENS else str(ending.reason)


def responses_request(body: dict, *, models: ServedModels, limits: Limits) -> ResponsesRequest:
    """The generate frame a Responses request body asks for, or the ProtocolError that refuses it."""
    for name, value in body.items():
        treatment = FIELDS.get(name)
        if treatment is None:
            raise UnsupportedParameter(f"{name} is not a parameter Stopline knows", param=name)
        if treatment is Treatment.REFUSED and value is not None:
            raise UnsupportedParameter(f"{name} is not supported by this server", param=name)
    requested = body.get("model")
    model = models.answering(requested)
    if model is None or (requested is not None and not isinstance(requested, str)):
        raise ModelNotFound(f"the model {requested!r} is not served here", param="model")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidField("instructions must be a string", param="instructions")
    chat = _input(body.get("input"))
    if instructions:
        chat.insert(0, {"role": "system", "content": instructions})
    frame: dict = {"messages": chat}
    if body.get("max_output_tokens") is not None:
        frame["max_tokens"] = body["max_output_tokens"]
    for name in _SAMPLING:
        if body.get(name) is not None:
            frame[name] = body[name]
    user = body.get("user") if body.get("user") is not None else body.get("safety_identifier")
    if user is not None:
        frame["user"] = user
    metadata = body.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise InvalidField("metadata must map strings to strings", param="metadata")
    text_format = _text_format(body.get("text"), limits.grammars, frame)
    for name in ("stream", "background", "store"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise InvalidField(f"{name} must be true or false", param=name)
    background = body.get("background") is True
    store = body.get("store") is not False
    if background and body.get("stream") is True:
        raise UnsupportedParameter("background with stream is not supported; stream, or poll", param="background")
    if background and not store:
        raise InvalidField("background needs store: a response run in the background is kept", param="store")
    return ResponsesRequest(
        generate_frame(frame, limits),
        model,
        instructions=instructions,
        metadata=metadata or {},
        stream=body.get("stream") is True,
        background=background,
        store=store,
        text_format=text_format,
    )


def _input(value: object) -> list[dict]:
    """The chat ``input`` asks for: a string is one user message; a list holds message items."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidField("input must be a string or a list of at least one message", param="input")
    return [_message(item, i) for i, item in enumerate(value)]


def _message(item: object, index: int) -> dict:
    where = f"input[{index}]"
    kind = item.get("type", "message") if isinstance(item, dict) else None
    if kind != "message":
        raise UnsupportedParameter(f"{where}: only message items are supported (got {kind!r})", param="input")
    assert isinstance(item, dict)
    role = item.get("role")
    if role not in _ROLES:
        raise InvalidField(f"{where}.role must be user, assistant, system or developer", param="input")
    for key, value in item.items():
        if key not in ("type", "role", "content", "id", "status") and value is not None:
            raise UnsupportedParameter(f"{where}.{key} is not supported", param="input")
    return {"role": _ROLES[role], "content": _content(item.get("content"), f"{where}.content")}


def _content(content: object, where: str) -> str:
    """A message's text: a string, or its text parts joined; any other part is refused by name."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidField(f"{where} must be a string or a list of content parts", param="input")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise UnsupportedParameter(f"{where}[{i}]: only text parts are supported (got {kind!r})", param="input")
        texts.append(part["text"])
    return "".join(texts)


def _text_format(text: object, grammars: bool, frame: dict) -> dict:
    """``text.format`` onto the generate frame's JSON constraint; the format the Response echoes."""
    if text is None:
        return {"type": "text"}
    if not isinstance(text, dict) or not set(text) <= {"format"}:
        raise UnsupportedParameter("text: only text.format is supported", param="text")
    shape = text.get("format") or {"type": "text"}
    kind = shape.get("type") if isinstance(shape, dict) else None
    if kind == "text":
        return shape
    if kind not in ("json_object", "json_schema"):
        raise UnsupportedParameter("text.format.type must be text, json_object or json_schema", param="text")
    if not grammars:
        raise UnsupportedParameter(f"text.format {kind}: {GRAMMARS_NEED_LLAMA_CPP}", param="text")
    if kind == "json_object":
        frame["json_object"] = True
    else:
        if not isinstance(shape.get("schema"), dict):
            raise InvalidField("text.format.schema must be an object", param="text")
        # strict or not, the schema is enforced.
        frame["json_schema"] = shape["schema"]
    return shape
