"""Anthropic's Messages API (``POST /v1/messages``, and ``/v1/messages/count_tokens``): a
request body checked into the one generate frame, and the shapes of its answer. No I/O here.

:data:`FIELDS` names every field of the request body and what Stopline does with it, as
:mod:`.openai_fields` does for OpenAI's: honoured, or refused with 400 naming it. Nothing
is ignored in silence. The answer's events and body come from the same frames as every
other API's (the reply in ``stopline/http_api.py`` writes them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..protocol.errors import InvalidField, ModelNotFound, UnsupportedParameter
from ..protocol.frames import GenerateFrame
from ..protocol.requests import Ending, Limits
from ..protocol.validation import generate_frame
from ..protocol.vocabulary import Outcome, Reason
from ..structured.tool_calls import ToolChoice, call_text
from ..structured.tool_calls import instructions as call_instructions
from .openai_fields import ServedModels, Treatment, _tool_call, _with_system

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
    # Custom tools, called as on chat completions (docs/protocol.md#tool-calls): tool_use blocks.
    "tools": Treatment.HONOURED,
    "tool_choice": Treatment.HONOURED,
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
    # Whether the answer may call the tools (AUTO) or must (REQUIRED); None: it is text.
    calls: ToolChoice | None = None

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
    call_names: dict[str, str] = {}
    chat = [_message(m, i, call_names) for i, m in enumerate(messages)]
    system = body.get("system")
    if system is not None:
        chat.insert(0, {"role": "system", "content": _text(system, "system")})
    frame: dict = {"max_tokens": body["max_tokens"]}
    choice, parallel = _chat_choice(body.get("tool_choice"))
    call = _tool_call(_chat_tools(body.get("tools")), choice, limits.grammars)
    if call is not None:
        chosen, kind = call
        frame.update(tools=chosen, tool_choice=str(kind), parallel_tool_calls=parallel)
        chat = _with_system(chat, call_instructions([t["function"] for t in chosen], kind, parallel))
    frame["messages"] = chat
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
    return MessagesRequest(generate_frame(frame, limits), model, None if call is None else call[1])


def _chat_tools(tools: object) -> list[dict] | None:
    """Anthropic's custom tools, ``{"name", "description", "input_schema"}``, in chat's shape."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidField("tools: a list of tools", param="tools")
    shown = []
    for i, tool in enumerate(tools):
        kind = tool.get("type", "custom") if isinstance(tool, dict) else None
        if kind != "custom":
            raise UnsupportedParameter(f"tools.{i}: only custom tools are supported (got {kind!r})", param="tools")
        assert isinstance(tool, dict)
        extra = set(tool) - {"type", "name", "description", "input_schema", "cache_control"}
        if extra:
            raise UnsupportedParameter(f"tools.{i}.{sorted(extra)[0]} is not supported", param="tools")
        function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        shown.append({"type": "function", "function": function})
    return shown


def _chat_choice(choice: object) -> tuple[object, bool]:
    """Anthropic's tool_choice as chat's, and whether several calls may come at once."""
    if choice is None:
        return None, True
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise InvalidField('tool_choice: {"type": "auto"|"any"|"tool"|"none"}', param="tool_choice")
    assert isinstance(choice, dict)
    parallel = choice.get("disable_parallel_tool_use") is not True
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def _message(message: object, index: int, call_names: dict[str, str]) -> dict:
    """A message as chat's: its text, an assistant's tool_use blocks as the text the model writes
    for a call, and a user's tool_result blocks as a text naming the tool, as Stopline's other
    APIs give a call's output. ``call_names`` gains each tool_use block's id."""
    where = f"messages.{index}"
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise InvalidField(f'{where}: a message is {{"role": "user"|"assistant", "content": ...}}', param="messages")
    extra = set(message) - {"role", "content"}
    if extra:
        raise InvalidField(f"{where}.{sorted(extra)[0]}: Extra inputs are not permitted", param="messages")
    role, content = message["role"], message.get("content")
    if not isinstance(content, list):
        return {"role": role, "content": _text(content, f"{where}.content")}
    pieces = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content.{i}"
        if kind == "tool_use" and role == "assistant":
            name, call_id = block.get("name"), block.get("id")
            if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(block.get("input"), dict):
                raise InvalidField(f'{at}: a tool_use block is {{"id", "name", "input": {{...}}}}', param="messages")
            call_names[call_id] = name
            pieces.append(call_text(name, block["input"]))
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise InvalidField(f"{at}.tool_use_id: the id of the tool_use block it answers", param="messages")
            name = call_names.get(block["tool_use_id"], "the tool")
            result = block.get("content", "")
            output = _text(result, f"{at}.content")
            pieces.append(f"{name} {'failed' if block.get('is_error') else 'returned'}: {output}")
        elif kind == "text" and isinstance(block.get("text"), str):
            pieces.append(block["text"])
        else:
            raise UnsupportedParameter(
                f"{at}: only text blocks, an assistant's tool_use and a user's tool_result are supported "
                f"(got {kind!r})",
                param="messages",
            )
    # Text blocks run on, as one text; beside a call or a result, each is a line of its own.
    joiner = "\n" if any(b.get("type") != "text" for b in content) else ""
    return {"role": role, "content": joiner.join(p for p in pieces if p)}


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


def tool_input(arguments: str) -> object:
    """A call's arguments as a tool_use block's ``input``: the object the grammar made them."""
    try:
        return json.loads(arguments)
    except ValueError:
        # Cut short by a stop: the text as far as it went.
        return {"partial_json": arguments}
