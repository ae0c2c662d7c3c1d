"""Anthropic's Messages API (``POST /v1/messages``, and ``/v1/messages/count_tokens``): a
request body checked into the one generate frame, and the shapes of its answer. No I/O here.

:data:`FIELDS` names every field of the request body and what Stopline does with it, as
:mod:`.openai_fields` does for OpenAI's: honoured, or refused with 400 naming it. Nothing
is ignored in silence. The answer's events and body come from the same frames as every
other API's (the reply in ``stopline/http_api.py`` writes them).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..protocol.errors import InvalidField, ModelNotFound, UnsupportedParameter
from ..protocol.frames import GenerateFrame
from ..protocol.requests import Ending, Limits
from ..protocol.validation import generate_frame
from ..protocol.vocabulary import Outcome, Reason
from .openai_fields import ServedModels, Treatment

# Every field of the request body, as Anthropic's API reference and its Python package list
# them (temperature, top_p and top_k through the package's extra_body).
FIELDS: dict[str, Treatment] = {
    "model": Treatment.HONOURED,
    "messages": Treatment.HONOURED,
    "max_tokens": Treatment.HONOURED,
    "system": Treatment.HONOURED,
    "stop_sequences": Treatment.HONOURED,
    "stream": Treatment.HONOURED,
    "temperature": Treatment.HONOURED,
    "top_p": Treatment.HONOURED,
    "top_k": Treatment.HONOURED,
    "metadata": Treatment.HONOURED,
    # A prompt's prefix is reused from the KV cache whenever a slot holds it, asked or not.
    "cache_control": Treatment.HONOURED,
    "tools": Treatment.REFUSED,
    "tool_choice": Treatment.REFUSED,
    "thinking": Treatment.REFUSED,
    "output_config": Treatment.REFUSED,
    "service_tier": Treatment.REFUSED,
    "speed": Treatment.REFUSED,
    "container": Treatment.REFUSED,
    "mcp_servers": Treatment.REFUSED,
    "diagnostics": Treatment.REFUSED,
    "inference_geo": Treatment.REFUSED,
    "user_profile_id": Treatment.REFUSED,
    "workspace_id": Treatment.REFUSED,
}

# The fields of a count_tokens body (POST /v1/messages/count_tokens): a message's less what
# shapes the answer, each treated as in a message.
COUNT_TOKENS_FIELDS = frozenset(FIELDS) - {"max_tokens", "stop_sequences", "stream", "temperature", "top_p", "top_k"}

# How a done request's reason reads as Anthropic's stop_reason (MessagesRequest.stop_reason).
_STOP_REASON: dict[str, str] = {
    Reason.EOS: "end_turn",
    Reason.MAX_TOKENS: "max_tokens",
    Reason.STOP_SEQUENCE: "stop_sequence",
}

# Anthropic's error type for each HTTP status it uses.
ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "api_error",
}


@dataclass(frozen=True)
class MessagesRequest:
    frame: GenerateFrame
    # The model name the answer reports.
    model: str

    def stop_reason(self, ending: Ending) -> str:
        """How a generation's end reads as Anthropic's stop_reason, always one of Anthropic's
        values; Stopline's own outcome and reason travel in the ``stopline`` field beside it.
        An error is answered as Anthropic's error, never with a stop reason."""
        if ending.outcome is Outcome.DONE:
            return _STOP_REASON[ending.reason]
        # A cancel or a timeout reads as "end_turn": the turn is over as it stands, where
        # "pause_turn" asks the client to send the turn again to continue it and "refusal"
        # tells it the model declined.
        return "end_turn"

    def stop_sequence(self, ending: Ending) -> str | None:
        """The stop sequence that ended the answer: known when the request gave one."""
        stops = self.frame.params.stop
        return stops[0] if ending.reason is Reason.STOP_SEQUENCE and len(stops) == 1 else None


def count_tokens_request(body: dict, *, models: ServedModels, limits: Limits) -> MessagesRequest:
    """The prompt a count_tokens body would give a message: its generate frame's, with the
    checks a message's fields get; or the ProtocolError that refuses it."""
    for name in body:
        if name not in COUNT_TOKENS_FIELDS:
            raise UnsupportedParameter(f"{name}: Extra inputs are not permitted", param=name)
    # One token to generate: the frame's prompt is what is counted.
    return messages_request({**body, "max_tokens": 1}, models=models, limits=limits)


def messages_request(body: dict, *, models: ServedModels, limits: Limits) -> MessagesRequest:
    """The generate frame a Messages request body asks for, or the ProtocolError that refuses it."""
    for name, value in body.items():
        treatment = FIELDS.get(name)
        if treatment is None:
            raise UnsupportedParameter(f"{name}: Extra inputs are not permitted", param=name)
        if treatment is Treatment.REFUSED and value is not None:
            raise UnsupportedParameter(f"{name} is not supported by this server", param=name)
    model = models.answering(body.get("model"))
    if model is None or not isinstance(body.get("model"), str):
        raise ModelNotFound(f"model: {body.get('model')!r} is not served here", param="model")
    if body.get("max_tokens") is None:
        raise InvalidField("max_tokens: Field required", param="max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidField("messages: a list of at least one message is required", param="messages")
    chat = [_message(m, i) for i, m in enumerate(messages)]
    system = body.get("system")
    if system is not None:
        chat.insert(0, {"role": "system", "content": _text(system, "system")})
    frame: dict = {"messages": chat, "max_tokens": body["max_tokens"]}
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            frame[name] = body[name]
    stops = body.get("stop_sequences")
    if stops is not None:
        frame["stop"] = stops
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict) or not set(metadata) <= {"user_id"}:
            raise InvalidField('metadata must be {"user_id": string}', param="metadata")
        if metadata.get("user_id") is not None:
            frame["user"] = metadata["user_id"]
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise InvalidField("stream must be true or false", param="stream")
    return MessagesRequest(generate_frame(frame, limits), model)


def _message(message: object, index: int) -> dict:
    where = f"messages.{index}"
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise InvalidField(f'{where}: a message is {{"role": "user"|"assistant", "content": ...}}', param="messages")
    extra = set(message) - {"role", "content"}
    if extra:
        raise InvalidField(f"{where}.{sorted(extra)[0]}: Extra inputs are not permitted", param="messages")
    return {"role": message["role"], "content": _text(message.get("content"), f"{where}.content")}


def _text(content: object, where: str) -> str:
    """A content's text: a string, or text blocks joined; any other block is refused by name."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidField(f"{where}: a string or a list of content blocks", param="messages")
    texts = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise UnsupportedParameter(f"{where}.{i}: only text blocks are supported (got {kind!r})", param="messages")
        texts.append(block["text"])
    return "".join(texts)
