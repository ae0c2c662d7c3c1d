"""One error root: every error Stopline raises on purpose is a StoplineError, and only that."""

from __future__ import annotations

import importlib
import pkgutil
from http import HTTPStatus

import pytest

import stopline
from stopline import __main__ as cli
from stopline.client import ServerUnreachable
from stopline.engine import errors as engine_errors
from stopline.protocol import errors
from stopline.protocol.vocabulary import ErrorCode


def _exceptions_defined_in_the_package() -> list[type[BaseException]]:
    found = []
    for module_info in pkgutil.walk_packages(stopline.__path__, "stopline."):
        module = importlib.import_module(module_info.name)
        found += [
            value
            for value in vars(module).values()
            if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == module.__name__
        ]
    return found


DEFINED = _exceptions_defined_in_the_package()


def test_the_walk_finds_the_errors_of_every_layer():
    names = {kind.__qualname__ for kind in DEFINED}
    # The pure protocol, the engine's native errors, the model checks, the build, the keys.
    assert {"InvalidField", "EngineError", "ContextOverflowError", "ModelFileError", "LlamaBuildError"} <= names
    assert {"KeyFileError", "SchemaError", "TokenizerError", "HubError"} <= names


@pytest.mark.parametrize("kind", DEFINED, ids=lambda kind: f"{kind.__module__}.{kind.__qualname__}")
def test_every_error_has_one_root_and_its_code_on_the_class(kind):
    assert issubclass(kind, errors.StoplineError)
    assert isinstance(kind.code, ErrorCode)


def test_each_refusal_of_a_request_names_its_own_code():
    refusals = errors.ProtocolError.__subclasses__()
    assert len({kind.code for kind in refusals}) == len(refusals)
    refused = errors.UnsupportedParameter("n is not supported (only 1)", param="n")
    assert (refused.code, refused.message, refused.param, refused.request_id) == (
        ErrorCode.UNSUPPORTED_PARAMETER,
        "n is not supported (only 1)",
        "n",
        None,
    )
    assert "code" not in vars(refused)


def test_an_engine_failure_is_a_stopline_error_that_a_caller_of_the_engine_also_knows():
    assert issubclass(engine_errors.ContextOverflowError, ValueError)
    assert issubclass(engine_errors.ModelLoadError, engine_errors.EngineError)
    assert issubclass(engine_errors.EngineError, RuntimeError)
    assert issubclass(engine_errors.EngineError, errors.StoplineError)


@pytest.mark.parametrize("kind", [errors.StoreUnavailable, errors.OwnerUnreachable, ServerUnreachable])
def test_no_socket_handler_catches_a_store_or_client_failure(kind):
    # `except ConnectionError` (a send to a closed client) or `except TimeoutError` must not swallow these.
    assert not issubclass(kind, (OSError, TimeoutError))


def test_an_error_that_answers_a_client_carries_its_code_and_status_as_attributes():
    unknown = errors.UnknownRequest("r1")
    assert (unknown.code, unknown.status) == (ErrorCode.UNKNOWN_REQUEST, HTTPStatus.NOT_FOUND)
    assert unknown.args == ("no generation has id 'r1'",) and unknown.request_id == "r1"
    assert (errors.InvalidCancelToken.code, errors.InvalidCancelToken.status) == (
        ErrorCode.INVALID_CANCEL_TOKEN,
        HTTPStatus.FORBIDDEN,
    )
    assert errors.StoreUnavailable.status == HTTPStatus.SERVICE_UNAVAILABLE
    assert errors.OwnerUnreachable.status == HTTPStatus.GATEWAY_TIMEOUT
    assert (errors.Busy.code, errors.Busy.status) == (ErrorCode.BUSY, HTTPStatus.SERVICE_UNAVAILABLE)


def _fail_while_serving(monkeypatch, error: BaseException) -> None:
    # The logs go to the tests' own capture (configured once for the session), not to stdout.
    monkeypatch.setattr(cli, "configure_logging", lambda level, log_format: "json")
    monkeypatch.setattr(cli, "bind_ports", lambda settings: (None, None))

    async def serve(settings, sock, http_sock):
        raise error

    monkeypatch.setattr(cli, "serve", serve)


def test_a_startup_bug_shows_its_traceback(monkeypatch, logs):
    _fail_while_serving(monkeypatch, ValueError("a bug, not a setting"))
    assert cli.main(["--port", "0"]) == 1
    [record] = logs.records("startup_failed")
    assert record["error"] == "ValueError: a bug, not a setting"
    assert "Traceback" in record["exception"]


def test_an_expected_startup_error_is_one_line_without_a_traceback(monkeypatch, logs):
    _fail_while_serving(monkeypatch, errors.SettingError("context_length 9999 exceeds the model's limit of 2048"))
    assert cli.main(["--port", "0"]) == 1
    [record] = logs.records("startup_failed")
    assert record["error"] == "context_length 9999 exceeds the model's limit of 2048"
    assert "exception" not in record
