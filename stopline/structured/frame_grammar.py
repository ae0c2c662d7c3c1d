"""The grammar a generate frame asks for with ``json_schema``, ``json_object`` or ``tools``.

:func:`frame_grammar` is the compiler the settings hand the protocol's checks (as
``Limits.grammar_of``) when the engine constrains sampling to a grammar; a schema or a tool
list it cannot hold to is refused as the field's :class:`~stopline.protocol.errors.InvalidField`.
"""

from __future__ import annotations

from ..protocol.errors import InvalidField
from .json_grammar import JSON_OBJECT_GRAMMAR, SchemaError, schema_grammar
from .tool_calls import ToolChoice, calls_grammar, is_tool


def frame_grammar(frame: dict, asked: str, request_id: str | None) -> str:
    """The grammar of the one structured field ``asked`` (checked present and alone) of ``frame``."""
    try:
        if asked == "tools":
            return _tools_grammar(frame, request_id)
        schema = frame.get("json_schema")
        if schema is None:
            return JSON_OBJECT_GRAMMAR
        return schema_grammar(schema)
    except SchemaError as exc:
        raise InvalidField(f"{asked}: {exc}", request_id) from None


def checked_tools(tools: object, request_id: str | None = None, *, param: str | None = None) -> list[dict]:
    """``tools``, if it is a list of function tools, for a generate frame or an OpenAI body."""
    if not isinstance(tools, list) or not all(is_tool(t) for t in tools):
        raise InvalidField(
            'tools must be a list of {"type": "function", "function": {"name": ..., "parameters": {...}}}',
            request_id,
            param=param,
        )
    return tools


def _tools_grammar(frame: dict, request_id: str | None) -> str:
    """The grammar of an answer that calls ``tools`` (docs/protocol.md#tool-calls)."""
    tools = checked_tools(frame["tools"], request_id)
    choice, parallel = frame.get("tool_choice", "auto"), frame.get("parallel_tool_calls", True)
    if choice not in tuple(ToolChoice):
        raise InvalidField('tool_choice must be "auto" or "required"', request_id)
    if not isinstance(parallel, bool):
        raise InvalidField("parallel_tool_calls must be true or false", request_id)
    return calls_grammar([t["function"] for t in tools], ToolChoice(choice), parallel)
