"""OpenAI's Responses API (``POST /v1/responses``): a request body checked into the one
generate frame, and how a generation's end reads as a Response's status. No I/O here.

:data:`FIELDS` names every field of the request body and what Stopline does with it, as
:mod:`.anthropic_messages` does for Anthropic's: honoured, or refused with 400
``unsupported_parameter`` naming it. Nothing is ignored in silence. The answer's events and
objects come from the same frames as every other API's (``stopline/responses_api.py``
writes them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..protocol.errors import InvalidField, ModelNotFound, ResponseNotFound, UnsupportedParameter
from ..protocol.frames import GenerateFrame
from ..protocol.requests import Ending, Limits
from ..protocol.validation import GRAMMARS_NEED_LLAMA_CPP, generate_frame
from ..protocol.vocabulary import Outcome, Reason
from ..structured.tool_calls import ToolChoice, call_text
from ..structured.tool_calls import instructions as call_instructions
from .openai_fields import ServedModels, Treatment, _tool_call, _with_system

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
    # An earlier response this server keeps (store: true, among the last it remembers): its
    # conversation and its answer come before this input.
    "previous_response_id": Treatment.HONOURED,
    # Function tools, called as on chat completions (docs/protocol.md#tool-calls); answered in one body.
    "tools": Treatment.HONOURED,
    "tool_choice": Treatment.HONOURED,
    "parallel_tool_calls": Treatment.HONOURED,
    "max_tool_calls": Treatment.REFUSED,
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
    # The chat without the instructions: the earlier responses' turns, then this input. A later
    # response that names this one continues it (instructions are not carried over, as with OpenAI).
    conversation: tuple[dict, ...] = ()
    previous_response_id: str | None = None
    # The function name of each call id in the conversation, for the calls' outputs.
    call_names: dict[str, str] = field(default_factory=dict)
    # How the answer is read: None, text; else whether it may be prose before its calls.
    calls: ToolChoice | None = None
    # Echoed in the Response as asked (Responses' own shapes).
    tools: list = field(default_factory=list)
    tool_choice: object = "none"
    parallel_tool_calls: bool = True


# What a previous_response_id continues: the turns before the new input, and its calls' names.
Earlier = tuple[tuple[dict, ...], dict[str, str]]


def _no_earlier(response_id: str) -> Earlier:
    raise ResponseNotFound(f"no response with id {response_id!r} is kept here", param="previous_response_id")


def response_status(ending: Ending) -> str:
    """A Response's status once its generation has ended, always one of OpenAI's; Stopline's own
    outcome and reason travel in the ``stopline`` field beside it."""
    if ending.outcome is Outcome.DONE:
        return "incomplete" if ending.reason is Reason.MAX_TOKENS else "completed"
    if ending.outcome is Outcome.CANCELLED:
        return "cancelled"
    if ending.outcome is Outcome.TIMEOUT:
        # Cut short, as max_output_tokens cuts a Response short, but by no limit OpenAI names.
        return "incomplete"
    return "failed"


def incomplete_reason(ending: Ending) -> str | None:
    """``incomplete_details.reason`` of a Response: max_output_tokens, the one of OpenAI's
    reasons a generation's end can be. A cancelled Response has none, as OpenAI's has none, and
    neither has a timeout, which no reason of OpenAI's names (its reason is in ``stopline``)."""
    return "max_output_tokens" if ending.outcome is Outcome.DONE and ending.reason is Reason.MAX_TOKENS else None


def responses_request(
    body: dict,
    *,
    models: ServedModels,
    limits: Limits,
    earlier: Callable[[str], Earlier] = _no_earlier,
) -> ResponsesRequest:
    """The generate frame a Responses request body asks for, or the ProtocolError that refuses it.
    ``earlier`` gives the conversation a ``previous_response_id`` continues (its turns and its
    answer), or raises the ProtocolError that refuses the id."""
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
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise InvalidField("previous_response_id must be a response's id", param="previous_response_id")
    turns, call_names = earlier(previous) if previous else ((), {})
    call_names = dict(call_names)
    conversation = (*turns, *_input(body.get("input"), call_names))
    chat = list(conversation)
    if instructions:
        chat.insert(0, {"role": "system", "content": instructions})
    frame: dict = {}
    tools = body.get("tools")
    choice = body.get("tool_choice")
    call = _tool_call(_chat_tools(tools), _chat_choice(choice), limits.grammars)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidField("parallel_tool_calls must be true or false", param="parallel_tool_calls")
    if call is not None:
        chosen, kind = call
        frame.update(tools=chosen, tool_choice=str(kind), parallel_tool_calls=parallel is not False)
        shown = call_instructions([t["function"] for t in chosen], kind, parallel is not False)
        chat = _with_system(chat, shown)
    frame["messages"] = chat
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
    if call is not None and text_format.get("type") != "text":
        raise InvalidField("give text.format or a tool_choice that calls, not both", param="tool_choice")
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
        conversation=conversation,
        previous_response_id=previous,
        call_names=call_names,
        calls=None if call is None else call[1],
        tools=tools or [],
        tool_choice=choice if choice is not None else ("auto" if tools else "none"),
        parallel_tool_calls=parallel is not False,
    )


def _chat_tools(tools: object) -> list[dict] | None:
    """Responses' function tools, ``{"type": "function", "name", "parameters", ...}``, in chat's shape."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidField("tools must be a list of function tools", param="tools")
    shown = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise UnsupportedParameter(f"tools[{i}]: only function tools are supported (got {kind!r})", param="tools")
        assert isinstance(tool, dict)
        function = {k: v for k, v in tool.items() if k != "type"}
        # strict or not, the parameters are enforced; null fields count as absent.
        function = {k: v for k, v in function.items() if v is not None}
        shown.append({"type": "function", "function": function})
    return shown


def _chat_choice(choice: object) -> object:
    """Responses' ``{"type": "function", "name": ...}`` in chat's shape; the strings as they are."""
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) <= {"type", "name"}:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _input(value: object, call_names: dict[str, str]) -> list[dict]:
    """The chat ``input`` asks for: a string is one user message; a list holds message items,
    and function calls and their outputs. A call becomes the text the model would have written
    for it, in the assistant's turn; its output, a user message naming the function, as on chat
    completions. ``call_names`` gains each call's id."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidField("input must be a string or a list of at least one message", param="input")
    chat: list[dict] = []
    for i, item in enumerate(value):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "function_call":
            name, call_id = _call_field(item, i, "name"), _call_field(item, i, "call_id")
            call_names[call_id] = name
            written = call_text(name, _call_field(item, i, "arguments"))
            last = chat[-1] if chat else None
            if last is not None and last["role"] == "assistant":
                chat[-1] = {"role": "assistant", "content": "\n".join(t for t in (last["content"], written) if t)}
            else:
                chat.append({"role": "assistant", "content": written})
        elif kind == "function_call_output":
            name = call_names.get(_call_field(item, i, "call_id"), "the function")
            output = _content(item.get("output"), f"input[{i}].output")
            chat.append({"role": "user", "content": f"{name} returned: {output}"})
        else:
            chat.append(_message(item, i))
    return chat


def _call_field(item: dict, index: int, name: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise InvalidField(f"input[{index}].{name} must be a string", param="input")
    return value


def _message(item: object, index: int) -> dict:
    where = f"input[{index}]"
    kind = item.get("type", "message") if isinstance(item, dict) else None
    if kind != "message":
        supported = "message, function_call and function_call_output"
        raise UnsupportedParameter(f"{where}: only {supported} items are supported (got {kind!r})", param="input")
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
