"""Tools the tool-calling tests offer the model, and what they check its calls against."""

from __future__ import annotations

# Seconds (times UNIT) the openai client waits for a completion: a grammar's sampling on one
# core is slower than free sampling, and a tool call's arguments are long.
GRAMMAR_TIMEOUT = 300

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Today's weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER_TOOL, ADD_TOOL]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


# A function whose arguments cannot end soon: at least 500 integers.
SLOW_TOOL = {
    "type": "function",
    "function": {
        "name": "store",
        "parameters": {
            "type": "object",
            "properties": {"values": {"type": "array", "items": {"type": "integer"}, "minItems": 500}},
            "required": ["values"],
            "additionalProperties": False,
        },
    },
}


async def stream_slow_call(client, model: str, **extra):
    """A streamed chat completion that must call SLOW_TOOL, whose arguments run long: what the tests
    that stop a model inside a call start (``extra``: more create() arguments, headers say)."""
    return await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Store many numbers."}],
        tools=[SLOW_TOOL],
        tool_choice="required",
        max_tokens=1500,
        stream=True,
        **extra,
    )
