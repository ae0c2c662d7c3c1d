"""The protocol state machine, driven by plain calls: no sockets, no model."""

from __future__ import annotations

import json

import pytest

from server.protocol import Cancel, Connection, Ending, Limits, Phase, Send, Submit
from server.vocabulary import REASONS_BY_OUTCOME, ErrorCode, Outcome, Reason

MS = 1_000_000


def fake_tokenize(prompt, messages):
    text = prompt if prompt is not None else " ".join(m["content"] for m in messages)
    return list(range(len(text.split())))


def connection(**limits) -> Connection:
    return Connection(Limits(context_length=16, vocab_size=100, **limits), fake_tokenize, now_ns=0)


def generate(conn: Connection, request_id="r1", now_ns=0, **fields):
    frame = {"type": "generate", "id": request_id, "prompt": "a b c", **fields}
    return conn.receive_text(json.dumps(frame), now_ns)


def test_generate_submits_a_queued_request():
    conn = connection()
    [submit] = generate(conn)
    assert isinstance(submit, Submit)
    assert submit.request.phase is Phase.QUEUED and submit.request.prompt_tokens == [0, 1, 2]
    assert submit.request.params.max_tokens == 256 and conn.live == {"r1": submit.request}


def test_the_transition_table_is_enforced():
    conn = connection()
    [submit] = generate(conn)
    request = submit.request
    with pytest.raises(RuntimeError):
        request.advance(Phase.DECODING)
    conn.started(request, 1)
    assert conn.token(request, "hi", 2) == {"type": "token", "id": "r1", "index": 0, "text": "hi"}
    assert request.phase is Phase.DECODING and request.first_token_ns == 2
    assert conn.token(request, " there", 3)["index"] == 1
    frames = conn.end(request, Ending(Outcome.DONE, Reason.EOS, tokens_generated=2))
    assert [f["type"] for f in frames] == ["done"]
    # Exactly one terminal message, and nothing after it.
    assert conn.end(request, Ending(Outcome.CANCELLED, Reason.USER_CANCELLED)) == []
    assert conn.token(request, "late", 4) is None
    with pytest.raises(RuntimeError):
        conn.started(request, 5)


def test_cancel_is_idempotent_and_acknowledged_with_the_final_state():
    conn = connection()
    [submit] = generate(conn)
    [cancel] = conn.receive_text('{"type": "cancel", "id": "r1"}', 10 * MS)
    assert isinstance(cancel, Cancel) and cancel.reason is Reason.USER_CANCELLED
    assert submit.request.cancel_requested_ns == 10 * MS
    [again] = conn.receive_text('{"type": "cancel", "id": "r1"}', 11 * MS)
    assert again == Send({"type": "cancel_ack", "id": "r1", "status": "cancelled"})
    conn.end(submit.request, Ending(Outcome.CANCELLED, Reason.USER_CANCELLED))
    [late] = conn.receive_text('{"type": "cancel", "id": "r1"}', 12 * MS)
    assert late.frame["status"] == "cancelled"
    [unknown] = conn.receive_text('{"type": "cancel", "id": "nope"}', 13 * MS)
    assert unknown.frame["status"] == "unknown"


def test_a_cancel_that_loses_to_a_finish_is_acknowledged_after_the_terminal():
    conn = connection()
    [submit] = generate(conn)
    conn.receive_text('{"type": "cancel", "id": "r1"}', 1)
    frames = conn.end(submit.request, Ending(Outcome.DONE, Reason.MAX_TOKENS))
    assert [f["type"] for f in frames] == ["done", "cancel_ack"]
    assert frames[1]["status"] == "done"


def test_only_the_first_stop_reason_counts():
    conn = connection()
    [submit] = generate(conn)
    assert conn.request_cancel(submit.request, Reason.SLOW_CONSUMER, 1)
    assert conn.request_cancel(submit.request, Reason.SHUTDOWN, 2) == []
    assert submit.request.cancel_reason is Reason.SLOW_CONSUMER
    # A stop of the whole connection skips requests already stopping.
    [other] = generate(conn, "r2")
    actions = conn.stop_all(Reason.CLIENT_DISCONNECTED, 3)
    assert actions == [Cancel(other.request, Reason.CLIENT_DISCONNECTED)]


def test_prompt_too_long_is_measured_in_tokens():
    conn = connection()
    [error] = generate(conn, prompt=" ".join(["w"] * 16))
    assert error.frame["code"] == ErrorCode.PROMPT_TOO_LONG and error.frame["id"] == "r1"
    assert conn.live == {}


def test_deadlines_are_capped_by_the_server():
    conn = connection(max_timeout_s=5, max_ttft_timeout_s=2)
    [submit] = generate(conn, timeout_s=1000, ttft_timeout_s=1.5)
    assert submit.request.params.timeout_s == 5 and submit.request.params.ttft_timeout_s == 1.5


def test_rate_limit_refills_with_time_and_reports_once_a_second():
    conn = connection(frames_per_second=10, frame_burst=3)
    answers = [conn.receive_text('{"type": "cancel", "id": "x"}', 0) for _ in range(6)]
    assert [len(a) for a in answers] == [1, 1, 1, 1, 0, 0]
    assert answers[3][0].frame["code"] == ErrorCode.RATE_LIMITED
    # 100 ms later one frame's worth has refilled.
    assert conn.receive_text('{"type": "cancel", "id": "x"}', 100 * MS)[0].frame["type"] == "cancel_ack"


def test_every_reason_belongs_to_one_outcome():
    owners = [outcome for outcome, reasons in REASONS_BY_OUTCOME.items() for reason in Reason if reason in reasons]
    assert len(owners) == len(Reason)


def test_tokens_wasted_counts_only_unfinished_work():
    assert Ending(Outcome.DONE, Reason.EOS, prompt_tokens_evaluated=10, tokens_generated=5).tokens_wasted == 0
    assert Ending(Outcome.CANCELLED, Reason.USER_CANCELLED, prompt_tokens_evaluated=10,
                  tokens_generated=5).tokens_wasted == 15


def test_the_native_loop_speaks_the_same_vocabulary():
    import stopline_core
    from server.vocabulary import ErrorCode
    names = set(Reason) | set(ErrorCode)
    for outcome, reason in stopline_core._EXIT_NAMES.values():
        assert outcome in set(Outcome)
        assert reason is None or reason in names, reason
