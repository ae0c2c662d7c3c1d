"""Function calls: the format a model writes them in, the grammar that holds it to it, and reading them back.

A call is written as ``<tool_call>{"name": "get_weather", "arguments": {...}}</tool_call>``;
several calls of one answer are separated by a newline. With ``tool_choice``
``"required"`` the answer is calls only. With ``"auto"`` it is prose, which may be
followed by calls: the prose may hold any text except the opening marker, and
the marker commits the model to a call whose arguments follow the function's
parameters. The grammar is an ordinary (eager) one: the prose part is a
small automaton that refuses the marker, so no text before a call is ever
replayed into the grammar, and no token can break it once accepted.

:class:`CallReader` reads an answer as it streams in, turning text into typed
events (prose, a call's start, a piece of its arguments). No I/O here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import StrEnum

from .json_grammar import SchemaError, grammar_with

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
# Between two calls of one answer.
CALL_SEPARATOR = "\n"
# Every call starts with exactly this, the name filled in; the arguments follow.
_HEAD = '{"name": "%s", "arguments": '
_HEAD_PATTERN = re.compile(r'\{"name": "([a-zA-Z0-9_-]{1,64})", "arguments": ')
FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


class ToolChoice(StrEnum):
    """Whether the answer may be prose (``auto``) or must be calls (``required``)."""

    AUTO = "auto"
    REQUIRED = "required"


def is_tool(tool: object) -> bool:
    """Whether ``tool`` is ``{"type": "function", "function": {"name": ..., "parameters": {...}}}``."""
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        return False
    function = tool["function"]
    name, parameters = function.get("name"), function.get("parameters")
    return (
        isinstance(name, str)
        and FUNCTION_NAME.fullmatch(name) is not None
        and (parameters is None or isinstance(parameters, dict))
        and set(function) <= {"name", "description", "parameters", "strict"}
    )


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object"}


def instructions(functions: list[dict], choice: ToolChoice, parallel: bool) -> str:
    """How the model is told about the functions (as a system message, through its chat template)."""
    shown = [{k: f[k] for k in ("name", "description", "parameters") if k in f} for f in functions]
    example = CALL_OPEN + _HEAD % "<the function's name>" + "<its arguments as JSON>}" + CALL_CLOSE
    how = "You may call these functions." if choice is ToolChoice.AUTO else "Call one of these functions."
    when = " If no function helps, answer in plain text instead." if choice is ToolChoice.AUTO else ""
    when += " You may make several calls, one a line." if parallel else " Make at most one call."
    listed = json.dumps(shown, ensure_ascii=False)
    return f"{how} To call one, write exactly:\n{example}\n{when.strip()}\nFunctions: {listed}"


def _literal(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _class(excluded: set[str]) -> str:
    """A GBNF class of every character but ``excluded``."""
    return "[^" + "".join("\\" + c if c in "]\\^-" else c for c in sorted(excluded)) + "]"


def _prose_rules(after_marker: str) -> list[str]:
    """Rules ``prose-0`` ..: any text that does not hold CALL_OPEN, which (once written whole)
    goes on as ``after_marker``. State i: the text ends with the marker's first i characters."""
    marker = CALL_OPEN

    def next_state(state: int, char: str) -> int:
        seen = marker[:state] + char
        return max(k for k in range(len(seen) + 1) if marker.startswith(seen[len(seen) - k :]))

    rules = []
    for state in range(len(marker)):
        options = ['""']
        chars = sorted(set(marker))
        for char in chars:
            target = next_state(state, char)
            options.append(f"{_literal(char)} " + (after_marker if target == len(marker) else f"prose-{target}"))
        options.append(f"{_class(set(chars))} prose-0")
        rules.append(f"prose-{state} ::= " + " | ".join(options))
    return rules


def calls_grammar(functions: list[dict], choice: ToolChoice, parallel: bool) -> str:
    """The GBNF grammar of an answer: calls of ``functions`` with valid arguments, after prose if
    ``choice`` is auto; one call at most unless ``parallel``. :class:`SchemaError` for parameters
    the grammar cannot enforce."""
    schemas: dict[str, object] = {f"arguments-{i}": _parameters(f) for i, f in enumerate(functions)}
    bodies = " | ".join(f"{_literal(_HEAD % f['name'])} arguments-{i} {_literal('}')}" for i, f in enumerate(functions))
    more = f" ({_literal(CALL_SEPARATOR)} calls)?" if parallel else ""
    rules = [
        f"calls ::= {_literal(CALL_OPEN)} call-body",
        f"call-body ::= ({bodies}) {_literal(CALL_CLOSE)}{more}",
    ]
    if choice is ToolChoice.AUTO:
        rules += _prose_rules("call-body")
    root = "prose-0" if choice is ToolChoice.AUTO else "calls"
    try:
        return grammar_with(root, schemas, "\n".join(rules))
    except SchemaError as exc:
        raise SchemaError(f"a function's parameters: {exc}", exc.keyword) from None


def call_text(name: str, arguments: object) -> str:
    """A call as the model writes one (for an assistant's earlier calls in the conversation)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    written = json.dumps(arguments, ensure_ascii=False)
    return f"{CALL_OPEN}{_HEAD % name}{written}}}{CALL_CLOSE}"


# What the reader turns an answer into.
@dataclass(frozen=True)
class Prose:
    text: str


@dataclass(frozen=True)
class CallStarted:
    index: int
    name: str


@dataclass(frozen=True)
class ArgumentsPiece:
    index: int
    text: str


Event = Prose | CallStarted | ArgumentsPiece


class _State(StrEnum):
    PROSE = "prose"
    HEAD = "head"
    ARGUMENTS = "arguments"
    CLOSE = "close"
    BETWEEN = "between"


@dataclass
class CallReader:
    """Reads an answer in the format above as its text arrives: :meth:`feed` returns the events
    the new text completes. Prose that could still be the start of a call is held back until it
    cannot; whitespace right before a call is dropped."""

    prose: bool
    state: _State = _State.PROSE
    # Calls started, and those whose closing marker was read.
    started: int = 0
    closed: int = 0
    _pending: str = ""
    # Inside the arguments: the nesting depth (the call's own object counts 1) and string state.
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False

    def __post_init__(self) -> None:
        if not self.prose:
            self.state = _State.BETWEEN

    @property
    def complete(self) -> bool:
        """At least one call, and every call written whole."""
        return self.closed > 0 and self.closed == self.started and self.state is _State.BETWEEN

    def feed(self, text: str) -> list[Event]:
        self._pending += text
        out: list[Event] = []
        while self._step(out):
            pass
        return _merged(out)

    def finish(self) -> list[Event]:
        """The events of what is left once the answer has ended (prose held back, if any)."""
        if self.state is _State.PROSE and self._pending:
            text, self._pending = self._pending, ""
            return [Prose(text)]
        return []

    def _step(self, out: list[Event]) -> bool:
        """Consume what can be read now; True if it should be called again."""
        pending = self._pending
        if self.state is _State.PROSE:
            at = pending.find(CALL_OPEN)
            if at >= 0:
                if pending[:at].rstrip():
                    out.append(Prose(pending[:at].rstrip()))
                self._pending = pending[at + len(CALL_OPEN) :]
                self.state = _State.HEAD
                return True
            keep = _held_back(pending)
            if len(pending) > keep:
                out.append(Prose(pending[: len(pending) - keep]))
                self._pending = pending[len(pending) - keep :]
            return False
        if self.state is _State.BETWEEN:
            opening = ("" if self.started == 0 else CALL_SEPARATOR) + CALL_OPEN
            if pending.startswith(opening):
                self._pending = pending[len(opening) :]
                self.state = _State.HEAD
                return True
            return False
        if self.state is _State.HEAD:
            match = _HEAD_PATTERN.match(pending)
            if match is None:
                return False
            out.append(CallStarted(self.started, match[1]))
            self.started += 1
            self._pending = pending[match.end() :]
            self.state, self._depth, self._in_string, self._escaped = _State.ARGUMENTS, 1, False, False
            return True
        if self.state is _State.ARGUMENTS:
            end = self._scan(pending)
            piece = pending if end is None else pending[:end]
            if piece:
                out.append(ArgumentsPiece(self.started - 1, piece))
            self._pending = "" if end is None else pending[end + 1 :]
            if end is not None:
                self.state = _State.CLOSE
            return end is not None
        # CLOSE
        if pending.startswith(CALL_CLOSE):
            self._pending = pending[len(CALL_CLOSE) :]
            self.closed += 1
            self.state = _State.BETWEEN
            return True
        return False

    def _scan(self, text: str) -> int | None:
        """Where in ``text`` the call's own closing brace is (its arguments end before it), if there."""
        for i, char in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i
        return None


def _held_back(text: str) -> int:
    """How many characters at the end of prose might yet be whitespace before a call, or its marker."""
    for start in range(len(text)):
        tail = text[start:]
        stripped = tail.lstrip()
        if CALL_OPEN.startswith(stripped) and (stripped or tail.isspace()):
            return len(tail)
    return 0


def _merged(events: list[Event]) -> list[Event]:
    """Neighbouring pieces of the same kind as one."""
    merged: list[Event] = []
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, Prose) and isinstance(last, Prose):
            merged[-1] = Prose(last.text + event.text)
        elif isinstance(event, ArgumentsPiece) and isinstance(last, ArgumentsPiece) and last.index == event.index:
            merged[-1] = ArgumentsPiece(event.index, last.text + event.text)
        else:
            merged.append(event)
    return merged
