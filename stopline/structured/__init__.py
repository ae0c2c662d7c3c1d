"""Structured output: the JSON-schema grammar compiler, the format of function calls and their
reader, and the grammar a generate frame's ``json_schema``, ``json_object`` or ``tools`` asks for.
It stands above the wire protocol (it raises the protocol's errors) and below the API dialects;
the protocol reaches it only through ``Limits.grammar_of``, which the settings fill in for an
engine that constrains sampling. No I/O."""
