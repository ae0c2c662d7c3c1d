"""JSON Schema to GBNF: the grammar that makes llama.cpp's sampler write only JSON that validates.

:func:`schema_grammar` covers the keywords structured output uses in practice:
``type`` (one or a list), ``properties``/``required``/``additionalProperties``,
``items``/``minItems``/``maxItems``, ``minLength``/``maxLength``, ``pattern``
(a regular-expression subset, see :class:`_Regex`), ``format`` (date, time,
date-time, uuid, email, ipv4, uri), ``minimum``/``maximum``/
``exclusiveMinimum``/``exclusiveMaximum`` (integers; numbers with whole-number
bounds), ``enum``, ``const``, ``anyOf``, ``oneOf`` (branches that cannot both
match), ``allOf`` (parts that merge into one schema), and local ``$ref`` into
``$defs``/``definitions``. Annotations (``title``, ``description``, …) are
read past. Anything else is refused with :class:`SchemaError` naming the
keyword, since a grammar that ignored it could produce JSON that does not
validate. Where a keyword is met by a subset (a format's common spelling, a
pattern matched whole), every output still validates. :data:`JSON_OBJECT_GRAMMAR`
is any JSON object.

Every object's properties come in the schema's order, and whitespace is at
most one space between tokens: the output is compact JSON. Numbers have at
most 15 digits before and after the point. Where the schema leaves a value
free (json_object, a schema of ``{}``), it is bounded (see ``FREE_DEPTH``), so
that a model cannot write one string or one list until max_tokens. Pure
functions, no I/O.
"""

from __future__ import annotations

import json
import math
import re

from ..protocol.errors import StoplineError

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
        "oneOf",
        "allOf",
        "pattern",
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
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


class SchemaError(StoplineError):
    """The schema uses something the grammar cannot enforce; ``keyword`` names it."""

    def __init__(self, message: str, keyword: str | None = None):
        super().__init__(message)
        self.keyword = keyword


def _literal(value: object) -> str:
    """A GBNF literal matching exactly the compact JSON encoding of ``value``."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


# The keywords that only a value of one type reads, by that type: a schema without ``type``
# that uses them is written as that type (a subset of what it allows).
_STRING_KEYWORDS = ("minLength", "maxLength", "pattern", "format")
_NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_JSON_TYPES = frozenset({"object", "array", "string", "integer", "number", "boolean", "null"})


class _Writer:
    def __init__(self, root: dict):
        self.root = root
        self.rules: dict[str, str] = {}
        self.refs: dict[str, str] = {}
        self.formats: dict[str, str] = {}

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
        if "allOf" in schema:
            return self.value(self.merged(schema), depth + 1)
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
        for keyword in ("anyOf", "oneOf"):
            if keyword in schema:
                options = schema[keyword]
                if not isinstance(options, list) or not options:
                    raise SchemaError(f"{keyword} must be a non-empty list", keyword)
                if keyword == "oneOf":
                    self.check_exclusive(options)
                return "(" + " | ".join(self.value(option, depth + 1) for option in options) + ")"
        kind = schema.get("type")
        if kind is None:
            kind = (
                "object"
                if "properties" in schema
                else "array"
                if "items" in schema
                else "string"
                if any(k in schema for k in _STRING_KEYWORDS)
                else "number"
                if any(k in schema for k in _NUMBER_KEYWORDS)
                else None
            )
        if kind is None:
            return "value"
        if isinstance(kind, list):
            if not kind:
                raise SchemaError("type must not be an empty list", "type")
            return "(" + " | ".join(self.typed(schema, k, depth) for k in kind) + ")"
        return self.typed(schema, kind, depth)

    def resolve(self, schema: object) -> object:
        """``schema``, or the schema its ``$ref`` names."""
        if isinstance(schema, dict) and "$ref" in schema and not set(schema) - _ANNOTATIONS - {"$ref"}:
            return _target(self.root, schema["$ref"])
        return schema

    def merged(self, schema: dict) -> dict:
        """One schema that means what ``allOf`` and the keywords beside it mean together."""
        parts = schema["allOf"]
        if not isinstance(parts, list) or not parts:
            raise SchemaError("allOf must be a non-empty list", "allOf")
        result = {k: v for k, v in schema.items() if k != "allOf" and k not in _ANNOTATIONS}
        for part in parts:
            part = self.resolve(part)
            if part is True:
                continue
            if not isinstance(part, dict) or "allOf" in part:
                raise SchemaError("allOf parts must be schemas without allOf of their own", "allOf")
            for key, value in part.items():
                if key in _ANNOTATIONS:
                    continue
                result[key] = _merge_keyword(key, result[key], value) if key in result else value
        return result

    def check_exclusive(self, options: list) -> None:
        """oneOf is anyOf when no value can match two branches: here, when the branches' types,
        their constants, or one constant property of object branches, tell them apart."""
        resolved = [self.resolve(option) for option in options]
        types = [_types(option) for option in resolved]
        if all(a.isdisjoint(b) for i, a in enumerate(types) for b in types[i + 1 :]):
            return
        constants = [_constants(option) for option in resolved]
        if all(c is not None for c in constants) and _disjoint([c for c in constants if c is not None]):
            return
        objects = [o for o, kinds in zip(resolved, types, strict=True) if isinstance(o, dict) and kinds == {"object"}]
        if len(objects) == len(resolved):
            shared = set.intersection(*(set(o.get("properties", {})) & set(o.get("required", [])) for o in objects))
            for name in sorted(shared):
                tags = [_constants(o["properties"][name]) for o in objects]
                if all(t is not None for t in tags) and _disjoint([t for t in tags if t is not None]):
                    return
        raise SchemaError(
            "oneOf is supported when its branches cannot match the same value (different types, "
            "constants, or a required property with a different const or enum in each)",
            "oneOf",
        )

    def typed(self, schema: dict, kind: object, depth: int) -> str:
        if kind in ("integer", "number"):
            return self.number(schema, kind == "integer")
        if kind in ("boolean", "null"):
            return str(kind)
        if kind == "string":
            return self.string(schema)
        if kind == "array":
            return self.array(schema, depth)
        if kind == "object":
            return self.object_(schema, depth)
        raise SchemaError(f"type {kind!r} is not a JSON Schema type", "type")

    def number(self, schema: dict, integer: bool) -> str:
        bounds = {k: schema[k] for k in _NUMBER_KEYWORDS if k in schema}
        for key, bound in bounds.items():
            if isinstance(bound, bool) or not isinstance(bound, int | float) or not math.isfinite(bound):
                raise SchemaError(f"{key} must be a number", key)
        if not bounds:
            return "integer" if integer else "number"
        low, low_open = _tighter(bounds, "minimum", "exclusiveMinimum", max)
        high, high_open = _tighter(bounds, "maximum", "exclusiveMaximum", min)
        if integer:
            # The integers within the bounds, whatever kind of number the bounds are.
            lowest = None if low is None else math.floor(low) + 1 if low_open or low != math.floor(low) else int(low)
            highest = (
                None if high is None else math.ceil(high) - 1 if high_open or high != math.ceil(high) else int(high)
            )
            return self.add(_integer_range(lowest, highest, bounds), "integer")
        for key, bound in bounds.items():
            if bound != math.floor(bound):
                raise SchemaError(f"{key} on a number must be a whole number (or use type integer)", key)
        return self.add(_decimal_range(low, low_open, high, high_open, bounds), "number")

    def string(self, schema: dict) -> str:
        low, high = _bounds(schema, "minLength", "maxLength")
        for keyword in ("pattern", "format"):
            if keyword in schema:
                others = [k for k in _STRING_KEYWORDS if k in schema and k != keyword]
                if others:
                    raise SchemaError(f"{keyword} with {others[0]} beside it is not supported", others[0])
        if "pattern" in schema:
            pattern = schema["pattern"]
            if not isinstance(pattern, str):
                raise SchemaError("pattern must be a string", "pattern")
            return self.add(f'"\\"" {_Regex(pattern).expression()} "\\""', "pattern")
        if "format" in schema:
            name = schema["format"]
            if name not in _FORMATS:
                raise SchemaError(
                    f"format {name!r} is not supported; supported: {', '.join(_FORMATS)}",
                    "format",
                )
            if name not in self.formats:
                self.formats[name] = self.add(f'"\\"" {_FORMATS[name]} "\\""', f"format-{name}")
            return self.formats[name]
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
        target = _target(self.root, ref)
        # Named before it is written, so that a schema may refer to itself.
        name = self.add("", "ref")
        self.refs[ref] = name
        self.rules[name] = self.value(target, depth + 1)
        return name


def _target(root: dict, ref: object) -> object:
    """The schema a local ``$ref`` names."""
    if not isinstance(ref, str):
        raise SchemaError("$ref must be a string", "$ref")
    match = re.fullmatch(r"#/(\$defs|definitions)/([^/]+)", ref)
    if ref == "#":
        return root
    if match and isinstance(root.get(match[1]), dict) and match[2] in root[match[1]]:
        return root[match[1]][match[2]]
    raise SchemaError(f"$ref {ref!r} does not name a schema in this one's $defs", "$ref")


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


def _merge_keyword(key: str, first: object, second: object) -> object:
    """One keyword's value for a value that must meet both ``first`` and ``second`` (allOf)."""
    if first == second:
        return first
    if key == "required" and isinstance(first, list) and isinstance(second, list):
        return first + [name for name in second if name not in first]
    if key == "properties" and isinstance(first, dict) and isinstance(second, dict):
        for name in set(first) & set(second):
            if first[name] != second[name]:
                raise SchemaError(f"allOf parts give property {name!r} two different schemas", "allOf")
        return {**first, **second}
    if key == "type" and {first, second} == {"integer", "number"}:
        return "integer"
    if _numbers(first, second) and isinstance(first, int | float) and isinstance(second, int | float):
        if key in ("minimum", "exclusiveMinimum", "minLength", "minItems"):
            return max(first, second)
        if key in ("maximum", "exclusiveMaximum", "maxLength", "maxItems"):
            return min(first, second)
    raise SchemaError(f"allOf parts give {key!r} two different values, which cannot be merged", "allOf")


def _numbers(*values: object) -> bool:
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)


def _types(schema: object) -> frozenset[str]:
    """The JSON types a value valid against ``schema`` may have (integer counts as number too)."""
    if not isinstance(schema, dict):
        return _JSON_TYPES
    constants = _constants(schema)
    if constants is not None:
        kinds = {_type_of(value) for value in constants}
    elif "type" in schema:
        kinds = set(schema["type"]) if isinstance(schema["type"], list) else {schema["type"]}
    else:
        return _JSON_TYPES
    if kinds & {"integer", "number"}:
        kinds |= {"integer", "number"}
    return frozenset(str(k) for k in kinds)


def _type_of(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _constants(schema: object) -> list | None:
    """The values a schema allows when it lists them (const, enum); None otherwise."""
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return [schema["const"]]
    if isinstance(schema.get("enum"), list):
        return list(schema["enum"])
    return None


def _disjoint(groups: list[list]) -> bool:
    seen: list[str] = []
    for group in groups:
        encoded = {json.dumps(v, sort_keys=True) for v in group}
        if encoded & set(seen):
            return False
        seen += encoded
    return True


def _tighter(bounds: dict, inclusive: str, exclusive: str, pick) -> tuple[float | None, bool]:
    """The tighter of an inclusive and an exclusive bound: (the bound, whether it is exclusive)."""
    if inclusive in bounds and exclusive in bounds:
        if pick(bounds[inclusive], bounds[exclusive]) == bounds[inclusive] and bounds[inclusive] != bounds[exclusive]:
            return bounds[inclusive], False
        return bounds[exclusive], True
    if exclusive in bounds:
        return bounds[exclusive], True
    return bounds.get(inclusive), False


# The integer rule's own limit: 15 digits.
_LARGEST = 10**15 - 1


def _integer_range(low: int | None, high: int | None, bounds: dict) -> str:
    """The integers from ``low`` to ``high`` (None: no bound, within 15 digits), as JSON writes them."""
    lowest = -_LARGEST if low is None else max(low, -_LARGEST)
    highest = _LARGEST if high is None else min(high, _LARGEST)
    if lowest > highest:
        raise SchemaError(f"no integer of at most 15 digits meets {json.dumps(bounds)}", next(iter(bounds)))
    options = []
    if highest >= 0:
        options.append(_naturals(max(lowest, 0), highest))
    if lowest < 0:
        options.append('"-" ' + _naturals(max(-highest, 1), -lowest))
    return " | ".join(options)


def _decimal_range(low: float | None, low_open: bool, high: float | None, high_open: bool, bounds: dict) -> str:
    """The numbers between whole-number bounds, written without an exponent."""
    options = []
    if high is None or high > 0 or (high == 0 and not high_open):
        # Zero and above: the magnitude is the value.
        floor = 0 if low is None or low < 0 else int(low)
        options.append(_magnitudes(floor, low_open and low is not None and low >= 0, high, high_open))
    if low is None or low < 0:
        # Below zero: the magnitude is above -high (or zero), up to -low.
        least = 0 if high is None or high >= 0 else int(-high)
        options.append('"-" ' + _magnitudes(least, high is None or high >= 0 or high_open, _neg(low), low_open))
    if not options:
        raise SchemaError(f"no number meets {json.dumps(bounds)}", next(iter(bounds)))
    return " | ".join(f"({option})" for option in options)


def _neg(value: float | None) -> float | None:
    return None if value is None else -value


_FRACTION = '("." [0-9]{1,15})'
_NONZERO_FRACTION = '"." [0-9]{0,14} [1-9]'


def _magnitudes(low: int, low_open: bool, high: float | None, high_open: bool) -> str:
    """Non-negative decimals n(.f) from ``low`` up to ``high`` (whole numbers; open: excluded)."""
    options = []
    # The whole part may take any fraction strictly between the bounds' whole numbers.
    first = low + 1 if low_open else low
    last = _LARGEST if high is None else int(high) - 1
    if first <= last:
        options.append(f"{_naturals(first, last)} {_FRACTION}?")
    if low_open and (high is None or low < high):
        options.append(f'"{low}" {_NONZERO_FRACTION}')
    if high is not None and not high_open and (high > low or (high == low and not low_open)):
        options.append(f'"{int(high)}"')
    if not options:
        raise SchemaError("no number lies between these bounds", "minimum")
    return " | ".join(f"({option})" for option in options)


def _naturals(low: int, high: int) -> str:
    """The whole numbers from ``low`` to ``high`` (0 <= low <= high), without leading zeros."""
    options = []
    for digits in range(len(str(low)), len(str(high)) + 1):
        start = max(low, 10 ** (digits - 1) if digits > 1 else 0)
        end = min(high, 10**digits - 1)
        if start <= end:
            options.append(_same_length(str(start), str(end)))
    return "(" + " | ".join(options) + ")"


def _same_length(low: str, high: str) -> str:
    """The digit strings from ``low`` to ``high``, both of the same length."""
    if low == high:
        return f'"{low}"'
    if low[0] == high[0]:
        return f'"{low[0]}" ' + _same_length(low[1:], high[1:])
    rest = len(low) - 1
    tail = f" [0-9]{{{rest}}}" if rest else ""
    options = []
    first, last = int(low[0]), int(high[0])
    if low[1:] != "0" * rest:
        options.append(f'"{low[0]}" ' + _same_length(low[1:], "9" * rest))
        first += 1
    if high[1:] != "9" * rest:
        options.append(f'"{high[0]}" ' + _same_length("0" * rest, high[1:]))
        last -= 1
    if first <= last:
        options.append(f"[{first}-{last}]{tail}")
    return "(" + " | ".join(options) + ")"


_HOUR = '([01] [0-9] | "2" [0-3])'
_SIXTY = "[0-5] [0-9]"
_DATE = (
    '[12] [0-9]{3} "-" (("0" [13578] | "1" [02]) "-" ("0" [1-9] | [12] [0-9] | "3" [01])'
    ' | ("0" [469] | "11") "-" ("0" [1-9] | [12] [0-9] | "30")'
    ' | "02" "-" ("0" [1-9] | "1" [0-9] | "2" [0-8]))'
)
_TIME = f'{_HOUR} ":" {_SIXTY} ":" {_SIXTY} ("Z" | [+-] {_HOUR} ":" {_SIXTY})'
_OCTET = '("25" [0-5] | "2" [0-4] [0-9] | "1" [0-9] [0-9] | [1-9] [0-9] | [0-9])'
_LABEL = "[a-zA-Z0-9] [a-zA-Z0-9-]{0,30}"
# What each supported format's strings look like: a common, strict spelling of each (February has
# 28 days, years run 1000 to 2999, seconds have no fraction), so that every one validates.
_FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f'{_DATE} "T" {_TIME}',
    "uuid": '[0-9a-f]{8} "-" [0-9a-f]{4} "-" [0-9a-f]{4} "-" [0-9a-f]{4} "-" [0-9a-f]{12}',
    "email": f'[a-zA-Z0-9_+-]{{1,32}} ("." [a-zA-Z0-9_+-]{{1,32}}){{0,3}} "@" {_LABEL} ("." {_LABEL}){{0,3}}'
    ' "." [a-zA-Z]{2,12}',
    "ipv4": f'{_OCTET} "." {_OCTET} "." {_OCTET} "." {_OCTET}',
    "uri": f'[a-z] [a-z0-9+.-]{{0,15}} "://" {_LABEL} ("." {_LABEL}){{0,4}}'
    ' ("/" [a-zA-Z0-9._~!$&\'()*+,;=:@-]{0,32}){0,8}',
}

# Code points a JSON string cannot hold as they are; each of these that the grammar may write
# is written escaped (the rest are left out: a subset still matches).
_UNWRITTEN = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x7F)]
_ESCAPED = {0x22: '"\\\\\\""', 0x5C: '"\\\\\\\\"', 0x0A: '"\\\\n"', 0x09: '"\\\\t"', 0x0D: '"\\\\r"'}
_MAX_CODE_POINT = 0x10FFFF
_DIGITS = [(0x30, 0x39)]
_WORD = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SPACE = [(0x09, 0x0D), (0x20, 0x20)]
_ASCII = [(0x00, 0x7F)]


def _normal(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for low, high in sorted(ranges):
        if merged and low <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], high))
        else:
            merged.append((low, high))
    return merged


def _complement(ranges: list[tuple[int, int]], within: list[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
    """The code points of ``within`` (all of them: None) that are not in ``ranges``."""
    out, at = [], 0
    for low, high in _normal(ranges):
        if low > at:
            out.append((at, low - 1))
        at = high + 1
    if at <= _MAX_CODE_POINT:
        out.append((at, _MAX_CODE_POINT))
    if within is None:
        return out
    return [(max(a, c), min(b, d)) for a, b in out for c, d in within if max(a, c) <= min(b, d)]


def _class_char(code: int) -> str:
    char = chr(code)
    if code < 0x20 or code == 0x7F or char in "]\\^-[":
        return f"\\x{code:02X}" if code < 0x100 else f"\\u{code:04X}"
    return char


def _written(ranges: list[tuple[int, int]]) -> str | None:
    """A GBNF expression for one character of ``ranges`` as a JSON string holds it; None if none can be."""
    ranges = _normal(ranges)
    plain = _complement(_UNWRITTEN + _complement(ranges))
    options = []
    if plain:
        if len(plain) == 1 and plain[0][0] == plain[0][1] and chr(plain[0][0]) not in '"\\':
            options.append(_literal_text(chr(plain[0][0])))
        else:
            spans = "".join(_class_char(a) if a == b else f"{_class_char(a)}-{_class_char(b)}" for a, b in plain)
            options.append(f"[{spans}]")
    for code, escaped in _ESCAPED.items():
        if any(a <= code <= b for a, b in ranges):
            options.append(escaped)
    if not options:
        return None
    return options[0] if len(options) == 1 else "(" + " | ".join(options) + ")"


def _literal_text(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


class _Regex:
    """A regular expression as GBNF over the characters of a JSON string: literals, classes
    (``[...]``, ``.``, ``\\d\\w\\s`` and their negations), groups, alternation, ``? * + {m,n}``,
    and ``^``/``$`` at the ends. The grammar writes whole matches, which a search also finds.
    Anything else (lookaround, backreferences, ``\\b``, flags) is refused by name."""

    def __init__(self, pattern: str):
        self.pattern = pattern
        self.at = 0

    def refuse(self, what: str) -> SchemaError:
        return SchemaError(f"pattern {self.pattern!r}: {what} is not supported", "pattern")

    def peek(self, ahead: int = 0) -> str:
        at = self.at + ahead
        return self.pattern[at] if at < len(self.pattern) else ""

    def expression(self) -> str:
        expression = self.alternation(top=True)
        if self.at < len(self.pattern):
            raise self.refuse("an unbalanced ')'")
        return expression

    def alternation(self, top: bool) -> str:
        branches = [self.sequence(top)]
        while self.peek() == "|":
            self.at += 1
            branches.append(self.sequence(top))
        return branches[0] if len(branches) == 1 else "(" + " | ".join(branches) + ")"

    def sequence(self, top: bool) -> str:
        items = []
        if top and self.peek() == "^":
            self.at += 1
        while self.peek() not in ("", "|", ")"):
            if top and self.peek() == "$" and self.peek(1) in ("", "|"):
                self.at += 1
                continue
            items.append(self.quantified(self.atom()))
        return " ".join(items) if items else '""'

    def atom(self) -> str:
        char = self.peek()
        self.at += 1
        if char == "(":
            if self.peek() == "?":
                if self.peek(1) == ":":
                    self.at += 2
                elif self.pattern.startswith(("?P<", "?<"), self.at) and self.peek(2) not in ("=", "!"):
                    self.at = self.pattern.index(">", self.at) + 1
                else:
                    raise self.refuse(f"the group '(?{self.peek(1)}'")
            inner = self.alternation(top=False)
            if self.peek() != ")":
                raise self.refuse("an unclosed '('")
            self.at += 1
            return f"({inner})"
        if char == "[":
            return self.characters(self.char_class())
        if char == ".":
            return self.characters(_complement([(0x0A, 0x0A)]))
        if char == "\\":
            return self.characters(self.escape(in_class=False))
        if char in "^$":
            raise self.refuse(f"'{char}' anywhere but at an end")
        if char in "*+?{":
            raise self.refuse(f"'{char}' with nothing to repeat")
        return self.characters([(ord(char), ord(char))])

    def characters(self, ranges: list[tuple[int, int]]) -> str:
        written = _written(ranges)
        if written is None:
            raise self.refuse("a class of characters no JSON string can hold")
        return written

    def quantified(self, atom: str) -> str:
        char = self.peek()
        if char in ("*", "+", "?"):
            self.at += 1
            suffix = char
        elif char == "{":
            match = re.compile(r"\{(\d+)(,(\d*))?\}").match(self.pattern, self.at)
            if match is None:
                raise self.refuse("a '{' that is not a repeat count")
            self.at = match.end()
            low = int(match[1])
            high = low if match[2] is None else None if match[3] == "" else int(match[3])
            if low > MAX_REPEAT or (high is not None and (high > MAX_REPEAT or high < low)):
                raise self.refuse(f"the repeat {match[0]} (at most {MAX_REPEAT}, and min <= max)")
            suffix = f"{{{low}}}" if high == low else f"{{{low},{'' if high is None else high}}}"
        else:
            return atom
        if self.peek() == "?":
            self.at += 1  # lazy: the same strings match as a whole
        elif self.peek() == "+":
            raise self.refuse("a possessive repeat")
        return f"({atom}){suffix}"

    def escape(self, in_class: bool) -> list[tuple[int, int]]:
        char = self.peek()
        self.at += 1
        classes = {
            "d": _DIGITS,
            "w": _WORD,
            "s": _SPACE,
            # Python's \D, \W, \S are Unicode-aware: their ASCII part is a subset that surely matches.
            "D": _complement(_DIGITS, _ASCII),
            "W": _complement(_WORD, _ASCII),
            "S": _complement(_SPACE, _ASCII),
        }
        if char in classes:
            return classes[char]
        controls = {"n": 0x0A, "t": 0x09, "r": 0x0D, "f": 0x0C, "v": 0x0B}
        if char in controls:
            return [(controls[char], controls[char])]
        for prefix, size in (("x", 2), ("u", 4)):
            if char == prefix:
                digits = self.pattern[self.at : self.at + size]
                if len(digits) != size or not all(c in "0123456789abcdefABCDEF" for c in digits):
                    raise self.refuse(f"the escape '\\{prefix}{digits}'")
                self.at += size
                return [(int(digits, 16), int(digits, 16))]
        if char and not char.isalnum():
            return [(ord(char), ord(char))]
        raise self.refuse(f"the escape '\\{char}'")

    def char_class(self) -> list[tuple[int, int]]:
        negated = self.peek() == "^"
        if negated:
            self.at += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            char = self.peek()
            if char == "":
                raise self.refuse("an unclosed '['")
            if char == "]" and not first:
                self.at += 1
                break
            first = False
            self.at += 1
            if char == "\\":
                members = self.escape(in_class=True)
            else:
                members = [(ord(char), ord(char))]
            if (
                len(members) == 1
                and members[0][0] == members[0][1]
                and self.peek() == "-"
                and self.peek(1) not in ("]", "")
            ):
                self.at += 1
                end = self.peek()
                self.at += 1
                if end == "\\":
                    end_members = self.escape(in_class=True)
                    if len(end_members) != 1 or end_members[0][0] != end_members[0][1]:
                        raise self.refuse("a range that ends in a class")
                    high = end_members[0][0]
                else:
                    high = ord(end)
                if high < members[0][0]:
                    raise self.refuse("a range whose end is below its start")
                members = [(members[0][0], high)]
            ranges += members
        return _complement(ranges) if negated else _normal(ranges)


def schema_grammar(schema: object) -> str:
    """The GBNF grammar (root rule ``root``) of the JSON values that validate against ``schema``."""
    return grammar_with("schema", {"schema": schema})


def grammar_with(root: str, schemas: dict[str, object], rules: str = "") -> str:
    """A grammar whose root is the GBNF expression ``root``, with a rule for each of ``schemas``
    (named by its key) matching the JSON valid against it, and the caller's own ``rules``."""
    writer = _Writer({})
    lines = [f"root ::= {root}"]
    for name, schema in schemas.items():
        writer.root, writer.refs = (schema if isinstance(schema, dict) else {}), {}
        lines.append(f"{name} ::= {writer.value(schema, 0)}")
    lines += [f"{name} ::= {body}" for name, body in writer.rules.items()]
    return "\n".join(lines) + ("\n" + rules.strip() if rules.strip() else "") + _PRIMITIVES
