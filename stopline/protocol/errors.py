"""Every error Stopline raises on purpose, under one root.

An ``except`` clause names a class from here, or :class:`StoplineError` for
all of them, and never catches a stranger by accident: a store failure is not
an :class:`OSError` that a socket handler might swallow. An error that answers
a client carries its protocol code (:attr:`StoplineError.code`) and HTTP status
(:attr:`StoplineError.status`) as class attributes; the message is its first
argument.

The engine's own errors (:class:`stopline.engine.errors.EngineError` and its
subclasses) live with the engine, which alone raises them, and share this root.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import ClassVar

from .vocabulary import ErrorCode


class StoplineError(Exception):
    """The root of Stopline's errors. ``str(error)`` is one line for the user."""

    # The error frame's code, and the HTTP status that answers it, where a client is told.
    code: ErrorCode = ErrorCode.INTERNAL_ERROR
    status: HTTPStatus = HTTPStatus.INTERNAL_SERVER_ERROR


class UsageError(StoplineError):
    """A setting that cannot work, found at startup: one line for the user."""


class SettingError(StoplineError, ValueError):
    """A setting the model cannot work with, found as it loads (a ValueError to callers of the engine too)."""


# Finding a generation by its request id -------------------------------------


class RequestLookupError(StoplineError):
    """A generation named by its request id cannot be answered for."""


class _RefusedId(RequestLookupError):
    """Refused for what the request id names (or does not): the message says so."""

    template: ClassVar[str]

    def __init__(self, request_id: str):
        super().__init__(self.template.format(request_id=request_id))
        self.request_id = request_id


class UnknownRequest(_RefusedId):
    """No live or remembered request has this id."""

    code = ErrorCode.UNKNOWN_REQUEST
    status = HTTPStatus.NOT_FOUND
    template = "no generation has id {request_id!r}"


class InvalidCancelToken(_RefusedId):
    """The token is missing or is not the request's."""

    code = ErrorCode.INVALID_CANCEL_TOKEN
    status = HTTPStatus.FORBIDDEN
    template = "the token is not the cancel token of {request_id!r}"


class StoreUnavailable(RequestLookupError):
    """The request is not on this replica, and the shared store that would find it cannot be reached."""

    code = ErrorCode.STORE_UNAVAILABLE
    status = HTTPStatus.SERVICE_UNAVAILABLE


class OwnerUnreachable(RequestLookupError):
    """The replica that runs the request did not answer in time, yet still sends heartbeats."""

    code = ErrorCode.OWNER_UNREACHABLE
    status = HTTPStatus.GATEWAY_TIMEOUT


# Running a generation ---------------------------------------------------------


class Busy(StoplineError):
    """Every slot is busy and the queue is full."""

    code = ErrorCode.BUSY
    status = HTTPStatus.SERVICE_UNAVAILABLE


# Refusing a request ------------------------------------------------------------


class ProtocolError(StoplineError):
    """A frame or a request refused; each subclass names the error code its answer carries.
    ``request_id`` is the request it answers, where one is known; ``param`` is the field of
    an OpenAI request body it is about, where there is one."""

    def __init__(self, message: str, request_id: str | None = None, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.request_id = request_id
        self.param = param


class InvalidJson(ProtocolError):
    code = ErrorCode.INVALID_JSON


class InvalidFrame(ProtocolError):
    code = ErrorCode.INVALID_FRAME


class UnknownType(ProtocolError):
    code = ErrorCode.UNKNOWN_TYPE


class InvalidField(ProtocolError):
    code = ErrorCode.INVALID_FIELD


class DuplicateId(ProtocolError):
    code = ErrorCode.DUPLICATE_ID


class PromptTooLong(ProtocolError):
    code = ErrorCode.PROMPT_TOO_LONG


class TooManyRequests(ProtocolError):
    code = ErrorCode.TOO_MANY_REQUESTS


class TooManyRequestsFromAddress(ProtocolError):
    code = ErrorCode.TOO_MANY_REQUESTS_FROM_ADDRESS


class UnsupportedParameter(ProtocolError):
    """An OpenAI body field Stopline does not honour."""

    code = ErrorCode.UNSUPPORTED_PARAMETER


class ModelNotFound(ProtocolError):
    """A request (an API's body, a WebSocket generate frame) names a model this server does not serve."""

    code = ErrorCode.MODEL_NOT_FOUND


class InsufficientMemory(ProtocolError):
    """A model cannot load: the memory budget has no room for it, even with every idle model unloaded."""

    code = ErrorCode.INSUFFICIENT_MEMORY
    status = HTTPStatus.SERVICE_UNAVAILABLE


class ResponseNotFound(ProtocolError):
    """A Responses request continues a response (previous_response_id) this server does not keep."""

    code = ErrorCode.NOT_FOUND


class PreparationFailed(ProtocolError):
    """The server could not prepare a request (a bug): it ends alone, with internal_error."""

    code = ErrorCode.INTERNAL_ERROR
