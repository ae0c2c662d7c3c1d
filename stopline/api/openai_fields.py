"""What Stopline does with every field of OpenAI's request bodies, and the generate frame they ask for.

One table, :data:`FIELDS`, names every field of the chat-completions and
completions request bodies and its treatment: honoured, honoured only at its
default (any other value is refused), or refused. docs/http.md holds the same
table for readers, and a test checks that the two agree. Nothing is ignored in
silence: a field that is not honoured is refused with 400
``unsupported_parameter`` naming it, and so is a field that is not in the table.

No I/O here: :func:`openai_request` turns a parsed body into a checked
:class:`~.frames.GenerateFrame`, by the same checks as a WebSocket frame, and says
whether the answer may hold function calls for the reply to read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from enum import StrEnum

from ..protocol.errors import InvalidField, ModelNotFound, UnsupportedParameter
from ..protocol.frames import GenerateFrame
from ..protocol.requests import MAX_SEED, Limits
from ..protocol.validation import GRAMMARS_NEED_LLAMA_CPP, generate_frame
from ..protocol.vocabulary import ChatFormat
from ..structured.frame_grammar import checked_tools
from ..structured.tool_calls import ToolChoice, call_text, instructions


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
    Field("n", BOTH, Treatment.HONOURED, example=2),
    Field("best_of", COMPLETIONS, Treatment.DEFAULT_ONLY, neutral=(1,), example=2),
    Field("echo", COMPLETIONS, Treatment.DEFAULT_ONLY, neutral=(False,), example=True),
    Field("suffix", COMPLETIONS, Treatment.REFUSED, example="!"),
    Field("frequency_penalty", BOTH, Treatment.HONOURED, frame_name="frequency_penalty", example=0.5),
    Field("presence_penalty", BOTH, Treatment.HONOURED, frame_name="presence_penalty", example=0.5),
    Field("logit_bias", BOTH, Treatment.HONOURED, frame_name="logit_bias", example={"0": -100}),
    Field("logprobs", CHAT, Treatment.HONOURED, example=True),
    Field("logprobs", COMPLETIONS, Treatment.HONOURED, frame_name="logprobs", example=2),
    Field("top_logprobs", CHAT, Treatment.HONOURED, example=2),
    Field("response_format", CHAT, Treatment.HONOURED, example={"type": "json_object"}),
    Field("tools", CHAT, Treatment.HONOURED, example=[{"type": "function", "function": {"name": "f"}}]),
    Field("tool_choice", CHAT, Treatment.HONOURED, example="none"),
    Field("parallel_tool_calls", CHAT, Treatment.HONOURED, example=False),
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
    # llama-server's and vLLM's.
    Field("min_p", BOTH, Treatment.HONOURED, frame_name="min_p", example=0.05),
    Field("ignore_eos", BOTH, Treatment.HONOURED, frame_name="ignore_eos", example=True),
    Field("priority", BOTH, Treatment.HONOURED, frame_name="priority", example=-1),
    Field("timeout_s", BOTH, Treatment.HONOURED, frame_name="timeout_s", example=60),
    Field("ttft_timeout_s", BOTH, Treatment.HONOURED, frame_name="ttft_timeout_s", example=60),
)


def fields_of(endpoint: Endpoint) -> dict[str, Field]:
    return {f.name: f for f in FIELDS if endpoint in f.endpoints}


_BY_ENDPOINT = {endpoint: fields_of(endpoint) for endpoint in Endpoint}

_ROLES = {"developer": "system", "system": "system", "user": "user", "assistant": "assistant"}


def _same(value: object, neutral: object) -> bool:
    # 1 == True in Python; a JSON boolean is not a number.
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


def refuse_unless_taken(shown: str, value: object, treatment: Treatment, neutral: tuple) -> None:
    """Refuse ``value`` for the field named ``shown`` unless its treatment takes it: honoured,
    or default-only at one of its ``neutral`` values (null is always taken, as absent)."""
    if value is None or treatment is Treatment.HONOURED:
        return
    if treatment is Treatment.DEFAULT_ONLY and any(_same(value, n) for n in neutral):
        return
    accepted = " or ".join(repr(n) for n in neutral)
    raise UnsupportedParameter(f"{shown} is not supported" + (f" (only {accepted})" if accepted else ""), param=shown)


@dataclass(frozen=True)
class ServedModels:
    """The names this server answers to (``--served-model-name``; the first is the one it
    reports unasked), and whether a request may name any model (``--model-names any``)."""

    names: tuple[str, ...]
    any_name: bool = True
    # How a chat becomes the model's prompt, which /v1/models tells.
    chat_format: ChatFormat = ChatFormat.MODEL_TEMPLATE

    def __post_init__(self) -> None:
        if not self.names:
            raise ValueError("a server serves its model under at least one name")

    @property
    def primary(self) -> str:
        return self.names[0]

    def answering(self, requested: object) -> str | None:
        """The name an answer to a request for ``requested`` reports (None or absent: the
        primary), or None when the request is refused: a name not served, with any_name off.
        A name not served is answered as what really answers it, the primary name."""
        if requested is None:
            return self.primary
        if isinstance(requested, str) and requested in self.names:
            return requested
        return self.primary if self.any_name else None


@dataclass(frozen=True)
class OpenAIRequest:
    frame: GenerateFrame
    # The model name the answer reports.
    model: str
    # The answer may hold function calls (auto) or is only calls (required, a named function);
    # None: it is text.
    calls: ToolChoice | None = None
    # How many choices the answer has (n): each is a generation of its own.
    n: int = 1

    @property
    def frames(self) -> list[GenerateFrame]:
        """The generate frame of each choice. Several choices are told apart by their ids, their
        indices; a seed given is choice 0's, and choice i's is the seed plus i, so that the choices
        differ and the answer can be had again."""
        if self.n == 1:
            return [self.frame]
        seed = self.frame.params.seed
        return [
            replace(
                self.frame,
                id=str(i),
                params=replace(self.frame.params, seed=None if seed is None else (seed + i) % MAX_SEED),
            )
            for i in range(self.n)
        ]


def openai_request(body: dict, *, chat: bool, models: ServedModels, limits: Limits) -> OpenAIRequest:
    """The generate frame an OpenAI request body asks for, or the ProtocolError that refuses it.
    ``models`` are the names this server's one model is served under; ``limits``, what a
    request may ask of it (among them whether its engine can constrain output to a grammar)."""
    grammars = limits.grammars
    table = _BY_ENDPOINT[Endpoint.CHAT if chat else Endpoint.COMPLETIONS]
    for name, value in body.items():
        field = table.get(name)
        if field is None:
            raise UnsupportedParameter(f"{name} is not a parameter Stopline knows", param=name)
        refuse_unless_taken(name, value, field.treatment, field.neutral)
    requested = body.get("model")
    if requested is not None and not isinstance(requested, str):
        raise InvalidField("model must be a string", param="model")
    model = models.answering(requested)
    if model is None:
        raise ModelNotFound(
            f"the model {_shown_name(requested)} is not served here; this server serves "
            f"{', '.join(repr(n) for n in models.names)} (--model-names any answers to any name)",
            param="model",
        )
    frame: dict = {}
    call = None
    if chat:
        messages = body.get("messages")
        if isinstance(messages, list):
            messages = [_message(m, i, _call_names(messages)) for i, m in enumerate(messages)]
        call = _tool_call(body.get("tools"), body.get("tool_choice"), grammars)
        if call is not None:
            tools, choice = call
            parallel = body.get("parallel_tool_calls")
            frame.update(tools=tools, tool_choice=str(choice))
            if parallel is not None:
                frame["parallel_tool_calls"] = parallel
            if isinstance(messages, list):
                shown = instructions([t["function"] for t in tools], choice, parallel is not False)
                messages = _with_system(messages, shown)
        frame["messages"] = messages
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise InvalidField("prompt must be a string (or a list of one string)", param="prompt")
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
    if call is not None and body.get("response_format") not in (None, {"type": "text"}):
        raise InvalidField("give response_format or a tool_choice that calls, not both", param="tool_choice")
    n = body.get("n")
    # Each choice is a request of the client's, held to the same limit as any others.
    if n is not None and (
        isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= limits.requests_per_connection
    ):
        raise InvalidField(f"n must be an integer from 1 to {limits.requests_per_connection}", param="n")
    return OpenAIRequest(generate_frame(frame, limits), model, calls=None if call is None else call[1], n=n or 1)


def _shown_name(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "…"


def _tool_call(tools: object, choice: object, grammars: bool) -> tuple[list[dict], ToolChoice] | None:
    """The tools the answer may call and whether it must; None when the answer is text."""
    tools = [] if tools is None else checked_tools(tools, param="tools")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if choice in ("auto", "required"):
        chosen = tools
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        chosen = [t for t in tools if t["function"]["name"] == choice["function"].get("name")]
        if not chosen:
            raise InvalidField("tool_choice names a function that tools does not list", param="tool_choice")
    else:
        raise InvalidField(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if not chosen:
        raise InvalidField(f"tool_choice {choice} needs tools", param="tool_choice")
    if not grammars:
        # Unconstrained, a call's arguments would often not parse or not validate: refused, not guessed.
        default = " (the default when tools are given)" if choice == "auto" else ""
        raise UnsupportedParameter(
            f'tool_choice {json.dumps(choice)}{default}: {GRAMMARS_NEED_LLAMA_CPP}; tool_choice "none" answers in text',
            param="tool_choice",
        )
    return chosen, ToolChoice.AUTO if choice == "auto" else ToolChoice.REQUIRED


def _with_system(messages: list, instructions: str) -> list:
    """``messages`` with ``instructions`` added to their system message (one is put first if none)."""
    first = messages[0] if messages else None
    if isinstance(first, dict) and first.get("role") == "system" and isinstance(first.get("content"), str):
        return [{"role": "system", "content": f"{first['content']}\n\n{instructions}"}, *messages[1:]]
    return [{"role": "system", "content": instructions}, *messages]


def _call_names(messages: list) -> dict[str, str]:
    """The function name of every tool call id in the assistant messages."""
    names = {}
    for message in messages:
        if isinstance(message, dict) and isinstance(message.get("tool_calls"), list):
            for call in message["tool_calls"]:
                if isinstance(call, dict) and isinstance(call.get("function"), dict):
                    names[str(call.get("id"))] = str(call["function"].get("name"))
    return names


def _chat_logprobs(logprobs: object, top: object) -> dict:
    """The generate frame's ``logprobs`` (how many alternatives) for chat's two fields."""
    if logprobs is not None and not isinstance(logprobs, bool):
        raise InvalidField("logprobs must be true or false", param="logprobs")
    if not logprobs:
        if top not in (None, 0):
            raise InvalidField("top_logprobs needs logprobs: true", param="top_logprobs")
        return {}
    # The protocol checks the count (0 to MAX_TOP_LOGPROBS).
    return {"logprobs": 0 if top is None else top}


def _response_format(value: object, grammars: bool) -> dict:
    """The generate frame's fields for ``response_format``: none for text, else the JSON constraint."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return {}
    if kind not in ("json_object", "json_schema"):
        raise UnsupportedParameter(
            "response_format.type must be text, json_object or json_schema",
            param="response_format",
        )
    if not grammars:
        raise UnsupportedParameter(f"response_format {kind}: {GRAMMARS_NEED_LLAMA_CPP}", param="response_format")
    if kind == "json_object":
        return {"json_object": True}
    spec = value.get("json_schema") if isinstance(value, dict) else None
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise InvalidField("response_format.json_schema.schema must be an object", param="response_format")
    # strict or not, the schema is enforced.
    return {"json_schema": spec["schema"]}


# The keys a message of each role may have besides role and content.
_MESSAGE_KEYS = {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}


def _message(message, index: int, call_names: dict[str, str]):
    """A chat message in the protocol's shape: text parts are joined, developer means system. An
    assistant's tool calls become the JSON it would have written; a tool's result, a user message."""
    if not isinstance(message, dict):
        return message
    where = f"messages[{index}]"
    role = message.get("role")
    if role not in (*_ROLES, "tool"):
        raise UnsupportedParameter(
            f"{where}.role {role!r} is not supported; use system, developer, user, assistant or tool",
            param=f"{where}.role",
        )
    # Only these keys are read; any other key with a value is refused (null counts as absent).
    for key, value in message.items():
        if key not in ("role", "content", *_MESSAGE_KEYS.get(role, ())) and value is not None:
            raise UnsupportedParameter(f"{where}.{key} is not supported", param=f"{where}.{key}")
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise UnsupportedParameter("only text content parts are supported", param=f"{where}.content")
        content = "".join(p["text"] for p in content)
    if role == "tool":
        name = call_names.get(str(message.get("tool_call_id")), "the function")
        return {"role": "user", "content": f"{name} returned: {content}"}
    calls = message.get("tool_calls")
    if role == "assistant" and calls:
        if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
            for c in calls
        ):
            raise InvalidField(f"{where}.tool_calls must list function calls", param=f"{where}.tool_calls")
        written = [call_text(c["function"]["name"], c["function"].get("arguments")) for c in calls]
        content = "\n".join(([content] if isinstance(content, str) and content else []) + written)
    return {"role": _ROLES[role], "content": content}
