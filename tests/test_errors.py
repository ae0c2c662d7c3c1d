"""One error root: every error Stopline raises on purpose is a StoplineError, and only that."""

from __future__ import annotations

from http import HTTPStatus

import pytest

from stopline import __main__ as cli
from stopline import errors
from stopline.auth import KeyFileError
from stopline.json_grammar import SchemaError
from stopline.llama_build import LlamaBuildError
from stopline.model import ModelFetchError
from stopline.model_check import ModelFileError
from stopline.openai_fields import Refused
from stopline.protocol import ProtocolError
from stopline.tokenizer import TokenizerError
from stopline.vocabulary import ErrorCode

RAISED_ON_PURPOSE = [
    errors.UsageError,
    errors.SettingError,
    errors.UnknownRequest,
    errors.InvalidCancelToken,
    errors.StoreUnavailable,
    errors.OwnerUnreachable,
    errors.Busy,
    errors.ServerUnreachable,
    KeyFileError,
    SchemaError,
    LlamaBuildError,
    ModelFetchError,
    ModelFileError,
    Refused,
    ProtocolError,
    TokenizerError,
]


@pytest.mark.parametrize("kind", RAISED_ON_PURPOSE, ids=lambda kind: kind.__name__)
def test_every_error_has_one_root(kind):
    assert issubclass(kind, errors.StoplineError)


@pytest.mark.parametrize("kind", [errors.StoreUnavailable, errors.OwnerUnreachable, errors.ServerUnreachable])
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
