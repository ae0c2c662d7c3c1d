"""JSON Schema to GBNF: the grammar that makes llama.cpp's sampler write only JSON that validates.

:func:`schema_grammar` covers the subset that structured output uses in
practice: ``type`` (one or a list), ``properties``/``required``/
``additionalProperties``, ``items``/``minItems``/``maxItems``,
``minLength``/``maxLength``, ``enum``, ``const``, ``anyOf``, and local ``$ref``
into ``$defs``/``definitions``. Annotations (``title``, ``description``, …)
are read past. Any other keyword is refused with :class:`SchemaError`
naming it, since a grammar that ignored it could produce JSON that does not
validate. :data:`JSON_OBJECT_GRAMMAR` is any JSON object.

Every object's properties come in the schema's order, and whitespace is at
most one space between tokens: the output is compact JSON. Numbers have at
most 15 digits before and after the point. Where the schema leaves a value
free (json_object, a schema of ``{}``), it is bounded (see ``FREE_DEPTH``), so
that a model cannot write one string or one list until max_tokens. Pure
functions, no I/O.
"""

from __future__ import annotations

import json
import re

# Keywords that describe a value without constraining it.
_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly", "writeOnly"}
)
_SUPPORTED = frozenset(
    {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "enum",
        "const",
        "anyOf",
        "$ref",
        "$defs",
        "definitions",
    }
)
MAX_DEPTH = 32
# llama.cpp refuses a grammar that repeats a rule more than 2,000 times; bounds stay well under.
MAX_REPEAT = 1000

_PRIMITIVES = r"""
ws ::= " "?
string ::= "\"" char* "\""
char ::= [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])
integer ::= "-"? ("0" | [1-9] [0-9]{0,14})
number ::= integer ("." [0-9]{1,15})? ([eE] [-+]? [0-9]{1,3})?
boolean ::= "true" | "false"
null ::= "null"
short-string ::= "\"" char{0,{FREE_STRING}} "\""
"""
# A free value (json_object, a schema of {}) nests at most this deep, with at most this many
# members or items per object or array, and strings of at most this many characters: a small
# model then cannot spend max_tokens inside one string or one list.
FREE_DEPTH = 2
FREE_ITEMS = 8
FREE_STRING = 48


def _free_values() -> str:
    """``value``, ``object`` and ``array``: any JSON value within the bounds above."""
    rules = []
    for depth in range(FREE_DEPTH):
        inner = f"value-{depth + 1}" if depth + 1 < FREE_DEPTH else "scalar"
        suffix = "" if depth == 0 else f"-{depth}"
        more = f"{{0,{FREE_ITEMS - 1}}}"
        member = f'short-string ws ":" ws {inner} ws'
        rules += [
            f"value{suffix} ::= object{suffix} | array{suffix} | scalar",
            f'object{suffix} ::= "{{" ws ({member} ("," ws {member}){more})? "}}" ws',
            f'array{suffix} ::= "[" ws ({inner} ws ("," ws {inner} ws){more})? "]" ws',
        ]
    rules.append("scalar ::= short-string | number | boolean | null")
    return "\n".join(rules) + "\n"


_PRIMITIVES = _PRIMITIVES.replace("{FREE_STRING}", str(FREE_STRING)) + _free_values()
JSON_OBJECT_GRAMMAR = "root ::= object\n" + _PRIMITIVES.strip() + "\n"


class SchemaError(ValueError):
    """The schema uses something the grammar cannot enforce; ``keyword`` names it."""

    def __init__(self, message: str, keyword: str | None = None):
        super().__init__(message)
        self.keyword = keyword


def _literal(value: object) -> str:
    """A GBNF literal matching exactly the compact JSON encoding of ``value``."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


class _Writer:
    def __init__(self, root: dict):
        self.root = root
        self.rules: dict[str, str] = {}
        self.refs: dict[str, str] = {}

    def add(self, body: str, hint: str = "r") -> str:
        # "-r<n>": never the name of one of the fixed rules (value-1, array-2, ...).
        name = f"{re.sub(r'[^a-zA-Z0-9]+', '-', hint).strip('-') or 'rule'}-r{len(self.rules)}"
        self.rules[name] = body
        return name

    def value(self, schema, depth: int) -> str:
        """A GBNF expression for one JSON value valid against ``schema``."""
        if depth > MAX_DEPTH:
            raise SchemaError(f"the schema nests deeper than {MAX_DEPTH} levels")
        if schema is True or schema == {}:
            return "value"
        if not isinstance(schema, dict):
            raise SchemaError("a schema must be an object (or true)")
        for key in schema:
            if key not in _SUPPORTED and key not in _ANNOTATIONS:
                raise SchemaError(f"the JSON Schema keyword {key!r} is not supported", key)
        if "$ref" in schema:
            if len(set(schema) - _ANNOTATIONS) > 1:
                raise SchemaError("$ref with other keywords beside it is not supported", "$ref")
            return self.ref(schema["$ref"], depth)
        if "const" in schema:
            return _literal(schema["const"])
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise SchemaError("enum must be a non-empty list", "enum")
            return "(" + " | ".join(_literal(v) for v in values) + ")"
        if "anyOf" in schema:
            options = schema["anyOf"]
            if not isinstance(options, list) or not options:
                raise SchemaError("anyOf must be a non-empty list", "anyOf")
            return "(" + " | ".join(self.value(option, depth + 1) for option in options) + ")"
        kind = schema.get("type")
        if kind is None:
            kind = "object" if "properties" in schema else "array" if "items" in schema else None
        if kind is None:
            return "value"
        if isinstance(kind, list):
            if not kind:
                raise SchemaError("type must not be an empty list", "type")
            return "(" + " | ".join(self.typed(schema, k, depth) for k in kind) + ")"
        return self.typed(schema, kind, depth)

    def typed(self, schema: dict, kind: object, depth: int) -> str:
        if kind in ("integer", "number", "boolean", "null"):
            return str(kind)
        if kind == "string":
            return self.string(schema)
        if kind == "array":
            return self.array(schema, depth)
        if kind == "object":
            return self.object_(schema, depth)
        raise SchemaError(f"type {kind!r} is not a JSON Schema type", "type")

    def string(self, schema: dict) -> str:
        low, high = _bounds(schema, "minLength", "maxLength")
        if low == 0 and high is None:
            return "string"
        return self.add(f'"\\"" char{{{low},{"" if high is None else high}}} "\\""', "string")

    def array(self, schema: dict, depth: int) -> str:
        item = self.value(schema.get("items", True), depth + 1)
        low, high = _bounds(schema, "minItems", "maxItems")
        if high == 0:
            return '"[" ws "]"'
        rest_high = "" if high is None else str(high - 1)
        items = f'{item} ws ("," ws {item} ws){{{max(low - 1, 0)},{rest_high}}}'
        body = f'"[" ws {items} "]"' if low > 0 else f'"[" ws ({items})? "]"'
        return self.add(body, "array")

    def object_(self, schema: dict, depth: int) -> str:
        properties = schema.get("properties", {})
        required = schema.get("required", [])
        extra = schema.get("additionalProperties", True)
        if not isinstance(properties, dict) or not isinstance(required, list):
            raise SchemaError("properties must be an object and required a list", "properties")
        missing = [name for name in required if name not in properties]
        if missing:
            raise SchemaError(f"required names {missing[0]!r}, which properties does not define", "required")
        if not properties:
            if extra is True:
                return "object"
            if extra is False:
                return '"{" ws "}"'
            value = self.value(extra, depth + 1)
            member = f'string ws ":" ws {value} ws'
            return self.add(f'"{{" ws ({member} ("," ws {member})*)? "}}"', "map")
        # Only the declared properties are written: valid whatever additionalProperties says.
        names = list(properties)
        members = [f'{_literal(name)} ws ":" ws {self.value(properties[name], depth + 1)} ws' for name in names]
        # after[k]: properties k.. once one was written (each needs a comma); first[k]: none written yet.
        after, first = ["" for _ in range(len(names) + 1)], ["" for _ in range(len(names) + 1)]
        for k in range(len(names) - 1, -1, -1):
            tail = after[k + 1]
            if names[k] in required:
                after[k] = self.add(f'"," ws {members[k]} {tail}'.strip(), "after")
                first[k] = self.add(f"{members[k]} {tail}".strip(), "first")
            else:
                after[k] = self.add(f'("," ws {members[k]})? {tail}'.strip(), "after")
                written, rest = f"{members[k]} {tail}".strip(), first[k + 1]
                first[k] = self.add(f"{written} | {rest}" if rest else f"({written})?", "first")
        return self.add(f'"{{" ws {first[0]} "}}"', "object")

    def ref(self, ref: object, depth: int) -> str:
        if not isinstance(ref, str):
            raise SchemaError("$ref must be a string", "$ref")
        if ref in self.refs:
            return self.refs[ref]
        match = re.fullmatch(r"#/(\$defs|definitions)/([^/]+)", ref)
        if ref == "#":
            target = self.root
        elif match and isinstance(self.root.get(match[1]), dict) and match[2] in self.root[match[1]]:
            target = self.root[match[1]][match[2]]
        else:
            raise SchemaError(f"$ref {ref!r} does not name a schema in this one's $defs", "$ref")
        # Named before it is written, so that a schema may refer to itself.
        name = self.add("", "ref")
        self.refs[ref] = name
        self.rules[name] = self.value(target, depth + 1)
        return name


def _bounds(schema: dict, low_key: str, high_key: str) -> tuple[int, int | None]:
    low, high = schema.get(low_key, 0), schema.get(high_key)
    for key, value in ((low_key, low), (high_key, high)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_REPEAT
        ):
            raise SchemaError(f"{key} must be an integer from 0 to {MAX_REPEAT}", key)
    if high is not None and high < low:
        raise SchemaError(f"{high_key} is below {low_key}", high_key)
    return low, high


def schema_grammar(schema: object) -> str:
    """The GBNF grammar (root rule ``root``) of the JSON values that validate against ``schema``."""
    writer = _Writer(schema if isinstance(schema, dict) else {})
    root = writer.value(schema, 0)
    lines = [f"root ::= {root}"]
    lines += [f"{name} ::= {body}" for name, body in writer.rules.items()]
    return "\n".join(lines) + _PRIMITIVES
