"""Stopline: an LLM streaming service where Stop really stops."""

# The one source of the version: pyproject.toml reads it from here.
__version__ = "0.1.0"
