"""The errors the engine raises: the native loop (``stopline._core``) and the Python
API over it (:mod:`.loop`). They share Stopline's one root,
:class:`~stopline.protocol.errors.StoplineError`, and live here because nothing above
the engine raises them."""

from __future__ import annotations

from ..protocol.errors import StoplineError


class EngineError(StoplineError, RuntimeError):
    """A failure inside the native engine. ``errno`` is set when a system call failed."""

    errno: int | None = None


class ModelLoadError(EngineError):
    """The engine could not load the model."""


class ContextOverflowError(EngineError, ValueError):
    """The prompt does not fit in the context."""
