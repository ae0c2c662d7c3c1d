"""Ollama's API (``POST /api/chat``, ``POST /api/generate``): a request body checked into the
one generate frame, and the pieces of its answer. No I/O here.

:data:`CHAT_FIELDS`, :data:`GENERATE_FIELDS` and :data:`OPTIONS` name every field of the
request bodies and of their ``options`` and what Stopline does with each, as
:mod:`.openai_fields` does for OpenAI's: honoured, honoured only at its default, or refused
with 400 naming it. Nothing is ignored in silence. The answer's lines come from the same
frames as every other API's (the reply in ``stopline/ollama_api.py`` writes them).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..protocol.errors import InvalidField, ModelNotFound, UnsupportedParameter
from ..protocol.frames import GenerateFrame
from ..protocol.requests import Ending, Limits
from ..protocol.validation import GRAMMARS_NEED_LLAMA_CPP, generate_frame
from ..protocol.vocabulary import Outcome, Reason
from .openai_fields import ServedModels, Treatment, refuse_unless_taken

# The Ollama release whose API this speaks: clients read /api/version to decide what to send.
OLLAMA_VERSION = "0.12.0"


@dataclass(frozen=True)
class Field:
    treatment: Treatment
    # For DEFAULT_ONLY: the values accepted (null is always accepted, as absent).
    neutral: tuple = ()
    # The generate frame's field an honoured option becomes (None: read here).
    frame_name: str | None = None


_HONOURED = Field(Treatment.HONOURED)
_REFUSED = Field(Treatment.REFUSED)


def _default_only(*neutral: object) -> Field:
    return Field(Treatment.DEFAULT_ONLY, neutral)


# Every field of the two request bodies, as Ollama's API reference and its Python package list them.
_COMMON: dict[str, Field] = {
    "model": _HONOURED,
    "stream": _HONOURED,
    "format": _HONOURED,
    "options": _HONOURED,
    # A model beyond the first unloads once idle for it (docs/http.md, "Loading and keep_alive").
    "keep_alive": _HONOURED,
    "think": _default_only(False),
    "logprobs": _default_only(False),
    "top_logprobs": _default_only(0),
}
CHAT_FIELDS: dict[str, Field] = {
    **_COMMON,
    "messages": _HONOURED,
    # The ollama package sends an empty list when it is given no tools.
    "tools": _default_only([]),
}
GENERATE_FIELDS: dict[str, Field] = {
    **_COMMON,
    "prompt": _HONOURED,
    "system": _HONOURED,
    "raw": _HONOURED,
    "suffix": _default_only(""),
    "template": _default_only(""),
    "context": _default_only([]),
    "images": _default_only([]),
    "width": _REFUSED,
    "height": _REFUSED,
    "steps": _REFUSED,
}

# POST /api/embed, and the older POST /api/embeddings (one ``prompt``, one ``embedding``).
_EMBED_COMMON: dict[str, Field] = {
    "model": _HONOURED,
    # The embedding model stays loaded as long as the server runs, once loaded.
    "keep_alive": _HONOURED,
    # Options tune generation and how a model is loaded; none of them changes an embedding.
    "options": _default_only({}),
}
EMBED_FIELDS: dict[str, Field] = {
    **_EMBED_COMMON,
    "input": _HONOURED,
    # Every input is cut at the model's 256 tokens, as Ollama's default truncate does.
    "truncate": _default_only(True),
    # Honoured at the model's own size only, checked against it.
    "dimensions": _HONOURED,
}
EMBEDDINGS_FIELDS: dict[str, Field] = {**_EMBED_COMMON, "prompt": _HONOURED}

# Every field of ``options``. Those that size how a model is loaded are the server's settings.
OPTIONS: dict[str, Field] = {
    "temperature": Field(Treatment.HONOURED, frame_name="temperature"),
    "top_k": Field(Treatment.HONOURED, frame_name="top_k"),
    "top_p": Field(Treatment.HONOURED, frame_name="top_p"),
    "min_p": Field(Treatment.HONOURED, frame_name="min_p"),
    "seed": Field(Treatment.HONOURED, frame_name="seed"),
    "num_predict": Field(Treatment.HONOURED, frame_name="max_tokens"),
    "stop": Field(Treatment.HONOURED, frame_name="stop"),
    "repeat_penalty": Field(Treatment.HONOURED, frame_name="repetition_penalty"),
    "frequency_penalty": Field(Treatment.HONOURED, frame_name="frequency_penalty"),
    "presence_penalty": Field(Treatment.HONOURED, frame_name="presence_penalty"),
    # Up to the server's context length: every request fits in that context anyway.
    "num_ctx": _HONOURED,
    "mirostat": _default_only(0),
    "mirostat_tau": _default_only(5.0),
    "mirostat_eta": _default_only(0.1),
    "typical_p": _default_only(1.0),
    "tfs_z": _default_only(1.0),
    "repeat_last_n": _REFUSED,
    "num_keep": _REFUSED,
    "penalize_newline": _REFUSED,
    "num_batch": _REFUSED,
    "num_gpu": _REFUSED,
    "main_gpu": _REFUSED,
    "num_thread": _REFUSED,
    "numa": _REFUSED,
    "low_vram": _REFUSED,
    "f16_kv": _REFUSED,
    "logits_all": _REFUSED,
    "vocab_only": _REFUSED,
    "use_mmap": _REFUSED,
    "use_mlock": _REFUSED,
    "embedding_only": _REFUSED,
}

# Ollama's num_predict for "no limit" (-1) and "fill the context" (-2): the server's own limit then.
_UNLIMITED = (-1, -2)


@dataclass(frozen=True)
class OllamaRequest:
    # None: the request only asks that the model be loaded (no messages, or no prompt), which it is.
    frame: GenerateFrame | None
    # The model name the answer reports.
    model: str
    chat: bool
    stream: bool


@dataclass(frozen=True)
class OllamaEmbedRequest:
    # The ``input`` (or the older ``prompt``) as sent, for the embedding API's own checks; None
    # (or an empty list) only asks that the model be loaded, as with Ollama.
    input: object
    # The model name the answer reports.
    model: str


def ollama_embed_request(body: dict, *, served: str, dimensions: int, legacy: bool) -> OllamaEmbedRequest:
    """What an /api/embed body (``legacy``: /api/embeddings) asks for, or the ProtocolError that refuses it."""
    _check(body, EMBEDDINGS_FIELDS if legacy else EMBED_FIELDS, "")
    requested = body.get("model")
    if not isinstance(requested, str) or not requested:
        raise InvalidField("model is required", param="model")
    model = requested.removesuffix(":latest")
    if model != served:
        raise ModelNotFound(
            f"model {requested!r} does not serve embeddings here; this server embeds with {served!r}", param="model"
        )
    asked = body.get("dimensions")
    if asked is not None and (isinstance(asked, bool) or asked != dimensions):
        raise UnsupportedParameter(f"dimensions must be {dimensions}, this model's size, if given", param="dimensions")
    if legacy:
        prompt = body.get("prompt")
        if prompt is not None and not isinstance(prompt, str):
            raise InvalidField("prompt must be a string", param="prompt")
        return OllamaEmbedRequest(prompt or None, requested)
    return OllamaEmbedRequest(body.get("input"), requested)


def done_reason(ending: Ending) -> str:
    """How a generation's end reads as Ollama's done_reason, always one of Ollama's values;
    Stopline's own outcome and reason travel in the ``stopline`` field beside it. An error is
    answered as Ollama's error, never with a done reason."""
    if ending.outcome is Outcome.DONE and ending.reason is Reason.MAX_TOKENS:
        return "length"
    # A cancel or a timeout reads as "stop", as OpenAI's finish_reason does: the answer ended
    # where it ended, and "length" would tell the client the model ran out of room.
    return "stop"


def counts(ending: Ending) -> dict:
    """The final object's counts and durations (nanoseconds), as Ollama reports them."""
    ttft_ms = ending.ttft_ms or 0.0
    return {
        "total_duration": round(ending.duration_ms * 1e6),
        # The model is loaded before the server listens.
        "load_duration": 0,
        "prompt_eval_count": ending.prompt_tokens,
        "prompt_eval_duration": round(max(0.0, ttft_ms - ending.queue_ms) * 1e6),
        "eval_count": ending.tokens_generated,
        "eval_duration": round(max(0.0, ending.duration_ms - ttft_ms) * 1e6),
    }


def ollama_request(body: dict, *, chat: bool, models: ServedModels, limits: Limits) -> OllamaRequest:
    """The generate frame an /api/chat or /api/generate body asks for, or the ProtocolError that refuses it."""
    _check(body, CHAT_FIELDS if chat else GENERATE_FIELDS, "")
    model = _model(body.get("model"), models)
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise InvalidField("stream must be true or false", param="stream")
    frame: dict = {}
    if chat:
        messages = body.get("messages")
        if messages is not None and not isinstance(messages, list):
            raise InvalidField("messages must be a list of messages", param="messages")
        if not messages:
            return OllamaRequest(None, model, chat, stream)
        frame["messages"] = [_message(m, i) for i, m in enumerate(messages)]
    else:
        prompt, system, raw = body.get("prompt"), body.get("system"), body.get("raw")
        if prompt is not None and not isinstance(prompt, str):
            raise InvalidField("prompt must be a string", param="prompt")
        if system is not None and not isinstance(system, str):
            raise InvalidField("system must be a string", param="system")
        if raw is not None and not isinstance(raw, bool):
            raise InvalidField("raw must be true or false", param="raw")
        if not prompt:
            return OllamaRequest(None, model, chat, stream)
        if raw:
            if system:
                raise InvalidField("system cannot be combined with raw: the raw prompt is the whole prompt")
            frame["prompt"] = prompt
        else:
            # As Ollama does, the prompt becomes the model's chat, with the system prompt first.
            frame["messages"] = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}
            ]
    frame.update(_format(body.get("format"), limits))
    frame.update(_options(body.get("options"), limits))
    return OllamaRequest(generate_frame(frame, limits), model, chat, stream)


def _check(body: dict, table: dict[str, Field], where: str) -> None:
    """Refuse by name every field ``table`` does not honour (at the value given)."""
    for name, value in body.items():
        field = table.get(name)
        if field is None:
            raise UnsupportedParameter(f"{where}{name} is not a field Stopline knows", param=f"{where}{name}")
        refuse_unless_taken(f"{where}{name}", value, field.treatment, field.neutral)


def _model(requested: object, models: ServedModels) -> str:
    if not isinstance(requested, str) or not requested:
        raise InvalidField("model is required", param="model")
    # Ollama's names carry a tag, ":latest" when none is given.
    if requested not in models.names and requested.endswith(":latest"):
        requested = requested.removesuffix(":latest")
    model = models.answering(requested)
    if model is None:
        raise ModelNotFound(
            f"model {requested!r} not found; this server serves {', '.join(repr(n) for n in models.names)}",
            param="model",
        )
    return model


def _message(message: object, index: int) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant"):
        raise UnsupportedParameter(
            f'{where}: a message is {{"role": "system"|"user"|"assistant", "content": string}}', param="messages"
        )
    for key, value in message.items():
        # Images, tool calls and thinking are refused; empty, they are absent.
        if key not in ("role", "content") and value not in (None, "", []):
            raise UnsupportedParameter(f"{where}.{key} is not supported", param=f"{where}.{key}")
    content = message.get("content")
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise InvalidField(f"{where}.content must be a string", param="messages")
    return {"role": message["role"], "content": content}


def _format(value: object, limits: Limits) -> dict:
    """The generate frame's fields for ``format``: none for text, else the JSON constraint."""
    if value in (None, ""):
        return {}
    if value != "json" and not isinstance(value, dict):
        raise InvalidField('format must be "json" or a JSON schema', param="format")
    if not limits.grammars:
        raise UnsupportedParameter(f"format: {GRAMMARS_NEED_LLAMA_CPP}", param="format")
    return {"json_object": True} if value == "json" else {"json_schema": value}


def _options(options: object, limits: Limits) -> dict:
    """The generate frame's sampling fields for ``options``."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise InvalidField("options must be an object", param="options")
    _check(options, OPTIONS, "options.")
    num_ctx = options.get("num_ctx")
    if num_ctx is not None:
        if isinstance(num_ctx, bool) or not isinstance(num_ctx, int) or num_ctx < 1:
            raise InvalidField("options.num_ctx must be a positive integer", param="options.num_ctx")
        if num_ctx > limits.context_length:
            raise UnsupportedParameter(
                f"options.num_ctx {num_ctx} is over this server's context of {limits.context_length} tokens "
                "(the server's --context-length sets it)",
                param="options.num_ctx",
            )
    frame = {}
    for name, field in OPTIONS.items():
        value = options.get(name)
        if field.frame_name is None or value is None:
            continue
        if name == "num_predict" and value in _UNLIMITED and not isinstance(value, bool):
            continue
        frame[field.frame_name] = value
    return frame
