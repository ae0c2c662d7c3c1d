"""The protocol state machine, driven by plain calls: no sockets, no model."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from dataclasses import fields, replace
from types import SimpleNamespace

import pytest

from stopline.protocol.connection import AddressQuota, Cancel, Connection, Ended, Send, StopDraft, Submit, Tokenize
from stopline.protocol.errors import InvalidField
from stopline.protocol.frames import CancelFrame, GenerateFrame, Token, encode_frame
from stopline.protocol.requests import DEFAULT_SAMPLING, EXIT_OUTCOMES, Ending, GenerationResult, Limits, Phase
from stopline.protocol.validation import generate_frame, incoming_frame
from stopline.protocol.vocabulary import REASONS_BY_OUTCOME, ErrorCode, Outcome, Reason
from stopline.settings import MAX_PREFILL_CHUNK
from stopline.structured.frame_grammar import frame_grammar

MS = 1_000_000


def fake_tokenize(prompt, messages):
    text = prompt if prompt is not None else " ".join(m["content"] for m in messages)
    return list(range(len(text.split())))


def connection(**limits) -> Connection:
    return Connection(Limits(context_length=16, vocab_size=100, **limits), fake_tokenize, now_ns=0)


def prepare(conn: Connection, actions):
    """Do what the I/O layer does with a Tokenize action (there, off the event loop)."""
    if len(actions) == 1 and isinstance(actions[0], Tokenize):
        return conn.tokenized(actions[0].draft, conn.tokenize(actions[0].draft))
    return actions


def generate(conn: Connection, request_id="r1", now_ns=0, **fields):
    frame = {"type": "generate", "id": request_id, "prompt": "a b c", **fields}
    return prepare(conn, conn.receive_text(json.dumps(frame), now_ns))


def frames(actions) -> list[dict]:
    """The frames among ``actions``, in order; every other action must be an Ended."""
    assert all(isinstance(a, (Send, Ended)) for a in actions), actions
    return [a.frame.json() for a in actions if isinstance(a, Send)]


def loop_result(outcome, reason=None, *, end_ns=0, first_token_ns=0, **counts):
    """What the engine reports when a loop exits (the fields the protocol reads): the way
    out that means ``outcome`` and ``reason`` (a cancel's reason is the request's)."""
    from stopline._core import ExitKind

    [exit, *_] = [
        ExitKind[name]
        for name, (kind, why) in EXIT_OUTCOMES.items()
        if kind == outcome and (why is None or reason is None or str(why) == str(reason))
    ]
    fields = dict(
        prompt_tokens=3,
        prompt_tokens_reused=0,
        prompt_tokens_evaluated=3,
        tokens_generated=0,
        tokens_after_cancel=0,
        longest_prefill_node_ns=0,
        longest_decode_node_ns=0,
        prompt_tokens_wasted=0,
        wasted_eval_ns=0,
        preemptions=0,
        preempted_ns=0,
    )
    return SimpleNamespace(exit=exit, end_ns=end_ns, first_token_ns=first_token_ns, **{**fields, **counts})


def test_a_request_takes_its_priority_else_its_keys():
    conn = Connection(Limits(context_length=16, vocab_size=100), fake_tokenize, now_ns=0, priority=-2)
    [submit] = generate(conn)
    assert submit.request.priority == -2
    [submit] = generate(conn, "r2", priority=3)
    assert submit.request.priority == 3
    [error] = frames(generate(conn, "r3", priority=1.5))
    assert error["code"] == "invalid_field" and "priority must be an integer" in error["message"]
    [submit] = generate(connection())
    assert submit.request.priority == 0


def test_generate_submits_a_queued_request():
    conn = connection()
    [submit] = generate(conn)
    assert isinstance(submit, Submit)
    assert submit.request.phase is Phase.QUEUED and submit.request.prompt_tokens == [0, 1, 2]
    assert conn.live == {"r1": submit.request}
    # A field left out gets the one default there is; the deadlines are the server's.
    limits = conn.limits
    assert submit.request.params == replace(
        DEFAULT_SAMPLING, timeout_s=limits.default_timeout_s, ttft_timeout_s=limits.default_ttft_timeout_s
    )


def test_a_websocket_frame_and_an_http_body_are_checked_into_one_type():
    limits = Limits(context_length=16, vocab_size=100)
    fields = {"id": "r1", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.5, "user": "u"}
    frame = incoming_frame(json.dumps({"type": "generate", **fields}), limits)
    assert isinstance(frame, GenerateFrame) and frame == generate_frame(fields, limits)
    assert (frame.prompt, frame.size, frame.user, frame.params.temperature) == (None, 2, "u", 0.5)
    assert incoming_frame('{"type": "cancel", "id": "r1"}', limits) == CancelFrame("r1")
    # A body is refused by the same checks, with the same words.
    with pytest.raises(InvalidField, match="temperature must be in"):
        generate_frame({**fields, "temperature": 9}, limits)


def test_a_checked_frame_takes_the_websocket_frames_path_and_shares_its_limits():
    """An HTTP body reaches the protocol as a GenerateFrame: no JSON again, and the live
    requests of its address and connection bound it as they bind a WebSocket frame."""
    conn = connection(requests_per_connection=2)
    body = generate_frame({"prompt": "a b c"}, conn.limits)
    [tokenize] = conn.generate(body, 0)
    [submit] = prepare(conn, [tokenize])
    assert isinstance(submit, Submit) and submit.request.prompt_tokens == [0, 1, 2]
    # The server chose the id, and it is the request id too.
    assert submit.request.id == submit.request.request_id and len(submit.request.id) == 36
    generate(conn, "r2")
    [refused] = conn.generate(body, 0)
    assert refused.frame.json()["code"] == ErrorCode.TOO_MANY_REQUESTS
    assert conn.cancel(CancelFrame(submit.request.id), 1) == [Cancel(submit.request)]


def test_the_transition_table_is_enforced():
    conn = connection()
    [submit] = generate(conn)
    request = submit.request
    with pytest.raises(RuntimeError):
        request.advance(Phase.DECODING)
    assert conn.started(request, 1) == []
    [sent] = conn.token(request, "hi", 2)
    assert sent == Send(Token("r1", 0, "hi"), request)
    assert sent.frame.json() == {"type": "token", "id": "r1", "index": 0, "text": "hi"}
    assert request.phase is Phase.DECODING and request.first_token_ns == 2
    assert frames(conn.token(request, " there", 3))[0]["index"] == 1
    ended, done = conn.end(request, Ending(Outcome.DONE, Reason.EOS, tokens_generated=2))
    # The ending is recorded before the client hears of it.
    assert isinstance(ended, Ended) and ended.ending.outcome is Outcome.DONE and done.frame.json()["type"] == "done"
    # Exactly one terminal message, and nothing after it.
    assert conn.end(request, Ending(Outcome.CANCELLED, Reason.USER_CANCELLED)) == []
    assert conn.token(request, "late", 4) == []
    with pytest.raises(RuntimeError):
        conn.started(request, 5)


def test_cancel_is_idempotent_and_acknowledged_with_the_final_state():
    conn = connection()
    [submit] = generate(conn)
    [cancel] = conn.receive_text('{"type": "cancel", "id": "r1"}', 10 * MS)
    assert cancel == Cancel(submit.request) and submit.request.cancel_reason is Reason.USER_CANCELLED
    assert submit.request.cancel_requested_ns == 10 * MS
    assert conn.receive_text('{"type": "cancel", "id": "r1"}', 11 * MS) == []
    sent = frames(conn.end(submit.request, Ending(Outcome.CANCELLED, Reason.USER_CANCELLED)))
    assert sent[1:] == [{"type": "cancel_ack", "id": "r1", "status": "cancelled"}]
    [late] = conn.receive_text('{"type": "cancel", "id": "r1"}', 12 * MS)
    assert late.frame.json()["status"] == "cancelled"
    [unknown] = conn.receive_text('{"type": "cancel", "id": "nope"}', 13 * MS)
    assert unknown.frame.json()["status"] == "unknown"


def test_a_cancel_that_loses_to_a_finish_is_acknowledged_after_the_terminal():
    conn = connection()
    [submit] = generate(conn)
    conn.receive_text('{"type": "cancel", "id": "r1"}', 1)
    sent = frames(conn.end(submit.request, Ending(Outcome.DONE, Reason.MAX_TOKENS)))
    assert [f["type"] for f in sent] == ["done", "cancel_ack"]
    # The documented word for a request that ended with done.
    assert sent[1]["status"] == "finished"
    [late] = conn.receive_text('{"type": "cancel", "id": "r1"}', 2)
    assert late.frame.json() == {"type": "cancel_ack", "id": "r1", "status": "finished"}


@pytest.mark.parametrize(
    "outcome, reason, status",
    [
        (Outcome.DONE, Reason.EOS, "finished"),
        (Outcome.TIMEOUT, Reason.TOTAL_TIMEOUT, "timeout"),
        (Outcome.CANCELLED, Reason.USER_CANCELLED, "cancelled"),
    ],
)
def test_every_cancel_racing_an_ending_is_acknowledged_with_the_outcome_that_won(outcome, reason, status):
    conn = connection()
    [submit] = generate(conn)
    assert len(conn.receive_text('{"type": "cancel", "id": "r1"}', 1)) == 1
    # The second cancel finds the request stopping, not stopped: no answer may claim an outcome yet.
    assert conn.receive_text('{"type": "cancel", "id": "r1"}', 2) == []
    sent = frames(conn.end(submit.request, Ending(outcome, reason)))
    assert sent[0]["type"] == str(outcome)
    acks = sent[1:]
    # The terminal message answers the first cancel only when the cancel won.
    assert acks == [{"type": "cancel_ack", "id": "r1", "status": status}] * (1 if outcome is Outcome.CANCELLED else 2)


def test_only_the_first_stop_reason_counts():
    conn = connection()
    [submit] = generate(conn)
    assert conn.request_cancel(submit.request, Reason.SLOW_CONSUMER, 1)
    assert conn.request_cancel(submit.request, Reason.SHUTDOWN, 2) == []
    assert submit.request.cancel_reason is Reason.SLOW_CONSUMER
    # A stop of the whole connection skips requests already stopping.
    [other] = generate(conn, "r2")
    actions = conn.stop_all(Reason.CLIENT_DISCONNECTED, 3)
    assert actions == [Cancel(other.request)] and other.request.cancel_reason is Reason.CLIENT_DISCONNECTED


def test_prompt_too_long_is_measured_in_tokens():
    conn = connection()
    [error] = generate(conn, prompt=" ".join(["w"] * 16))
    assert error.frame.json()["code"] == ErrorCode.PROMPT_TOO_LONG and error.frame.json()["id"] == "r1"
    # It names the setting that would let the prompt in.
    assert (
        "the context holds 16" in error.frame.json()["message"] and "--context-length" in error.frame.json()["message"]
    )
    assert conn.live == {}


def test_a_prompt_must_leave_the_room_asked_for_the_answer():
    conn = connection()
    words = " ".join(["w"] * 12)  # 12 tokens of a 16-token context: room for 4
    [submit] = generate(conn, "four", prompt=words, min_answer_tokens=4)
    assert isinstance(submit, Submit) and len(submit.request.prompt_tokens) == 12
    [error] = generate(conn, "five", prompt=words, min_answer_tokens=5)
    assert error.frame.json()["code"] == ErrorCode.PROMPT_TOO_LONG
    assert "min_answer_tokens" in error.frame.json()["message"]
    # Without it, a prompt needs room for one generated token only.
    [submit] = generate(conn, "fifteen", prompt=" ".join(["w"] * 15))
    assert isinstance(submit, Submit)
    for bad in (0, 17, 2.5, "4"):
        [error] = generate(conn, "bad", prompt=words, min_answer_tokens=bad)
        assert (
            error.frame.json()["code"] == ErrorCode.INVALID_FIELD
            and "min_answer_tokens" in error.frame.json()["message"]
        )


def test_deadlines_are_capped_by_the_server():
    conn = connection(max_timeout_s=5, max_ttft_timeout_s=2)
    [submit] = generate(conn, timeout_s=1000, ttft_timeout_s=1.5)
    assert submit.request.params.timeout_s == 5 and submit.request.params.ttft_timeout_s == 1.5


def test_rate_limit_refills_with_time_and_reports_once_a_second():
    conn = connection(frames_per_second=10, frame_burst=3)
    answers = [conn.receive_text('{"type": "cancel", "id": "x"}', 0) for _ in range(6)]
    assert [len(a) for a in answers] == [1, 1, 1, 1, 0, 0]
    assert answers[3][0].frame.json()["code"] == ErrorCode.RATE_LIMITED
    # 100 ms later one frame's worth has refilled.
    assert conn.receive_text('{"type": "cancel", "id": "x"}', 100 * MS)[0].frame.json()["type"] == "cancel_ack"


def test_every_reason_belongs_to_one_outcome():
    owners = [outcome for outcome, reasons in REASONS_BY_OUTCOME.items() for reason in Reason if reason in reasons]
    assert len(owners) == len(Reason)


def test_tokens_wasted_counts_only_unfinished_work():
    assert Ending(Outcome.DONE, Reason.EOS, prompt_tokens_evaluated=10, tokens_generated=5).tokens_wasted == 0
    assert (
        Ending(Outcome.CANCELLED, Reason.USER_CANCELLED, prompt_tokens_evaluated=10, tokens_generated=5).tokens_wasted
        == 15
    )
    # A prompt chunk a stop cut short was computed too.
    cut_short = Ending(
        Outcome.TIMEOUT, Reason.FIRST_TOKEN_TIMEOUT, prompt_tokens_evaluated=512, prompt_tokens_wasted=512
    )
    assert cut_short.tokens_wasted == 1024


def test_the_engines_report_has_the_native_loops_fields_one_for_one():
    from stopline._core import LoopResult

    # The native result's fields are the readonly attributes of the built extension type,
    # so a field added, dropped or renamed on either side fails here.
    native = [name for name, value in vars(LoopResult).items() if inspect.isgetsetdescriptor(value)]
    assert [f.name for f in fields(GenerationResult)] == native


def test_the_prefill_chunk_limit_is_the_native_loops():
    from stopline import _core
    from stopline.engine.loop import DEFAULT_PREFILL_CHUNK

    # settings.py cannot import the engine, so it writes the limit again; here the copies meet.
    assert MAX_PREFILL_CHUNK == _core.MAX_PREFILL_CHUNK == _core.LLAMA_MAX_CHUNK
    for by_mode in DEFAULT_PREFILL_CHUNK.values():
        assert all(1 <= chunk <= MAX_PREFILL_CHUNK for chunk in by_mode.values())


def test_every_way_out_of_the_native_loop_has_an_outcome():
    from stopline._core import ExitKind

    # Every exit kind but "has not ended" is mapped, and to vocabulary values only.
    assert set(EXIT_OUTCOMES) == {kind.name for kind in ExitKind} - {ExitKind.NONE.name}
    for outcome, reason in EXIT_OUTCOMES.values():
        assert isinstance(outcome, Outcome)
        if outcome is Outcome.CANCELLED:
            assert reason is None  # the request that asked for the stop supplies it
        elif outcome is Outcome.ERROR:
            assert isinstance(reason, ErrorCode)
        else:
            assert reason in REASONS_BY_OUTCOME[outcome]


SURROGATE_FRAMES = [
    '{"type": "generate", "id": "p1", "prompt": "hi \\ud800", "max_tokens": 4}',
    '{"type": "generate", "id": "p1", "messages": [{"role": "user", "content": "\\udfff"}]}',
    '{"type": "generate", "id": "p1", "prompt": "hi", "stop": ["\\ud83d"]}',
    '{"type": "generate", "id": "\\ud800", "prompt": "hi"}',
    '{"type": "cancel", "id": "\\ud800"}',
    '{"type": "bogus", "id": "\\ud800"}',
    '{"type": "\\ud800"}',
]


@pytest.mark.parametrize("raw", SURROGATE_FRAMES)
def test_lone_surrogates_are_refused_and_never_echoed(raw):
    conn = connection()
    [answer] = conn.receive_text(raw, 0)
    assert answer.frame.json()["type"] == "error" and answer.frame.json()["code"] in (
        ErrorCode.INVALID_FIELD,
        ErrorCode.UNKNOWN_TYPE,
    )
    # Whatever is sent back is UTF-8 text.
    encode_frame(answer.frame).encode("utf-8")
    assert conn.live == {}


@pytest.mark.parametrize(
    "field",
    [
        "max_tokens",
        "temperature",
        "top_k",
        "top_p",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
        "min_p",
        "seed",
        "timeout_s",
        "ttft_timeout_s",
    ],
)
@pytest.mark.parametrize("number", ["1" + "0" * 400, "-1" + "0" * 400, "1e400", "-1e400"])
def test_numbers_of_any_magnitude_are_range_checked(field, number):
    conn = connection()
    raw = f'{{"type": "generate", "id": "n", "prompt": "a", "{field}": {number}}}'
    [answer] = conn.receive_text(raw, 0)
    assert answer.frame.json()["code"] == ErrorCode.INVALID_FIELD and answer.frame.json()["id"] == "n"
    assert len(answer.frame.json()["message"]) < 200


@pytest.mark.parametrize(
    "fields",
    [
        {"logit_bias": [[1, 5]]},
        {"logit_bias": {"x": 5}},
        {"logit_bias": {"-1": 5}},
        {"logit_bias": {"1.0": 5}},
        {"logit_bias": {"١": 5}},
        {"logit_bias": {"100": 5}},
        {"logit_bias": {"99999999999999999999": 5}},
        {"logit_bias": {"1": 101}},
        {"logit_bias": {"1": "5"}},
        {"logit_bias": {"1": True}},
        {"logit_bias": {str(i): 1 for i in range(301)}},
        {"min_p": 1.5},
        {"min_p": -0.1},
        {"ignore_eos": 1},
        {"ignore_eos": True, "json_object": True},
    ],
)
def test_bad_sampling_fields_are_refused_by_name(fields):
    limits = Limits(context_length=16, vocab_size=100, grammar_of=frame_grammar)
    with pytest.raises(InvalidField) as refused:
        generate_frame({"id": "s", "prompt": "a", **fields}, limits)
    name = next(iter(fields))
    assert name in str(refused.value) and refused.value.request_id == "s"


def test_sampling_fields_become_the_samplers_parameters():
    limits = Limits(context_length=16, vocab_size=400)
    params = generate_frame(
        {"prompt": "a", "logit_bias": {"7": -100, "3": 2.5}, "min_p": 0.1, "ignore_eos": True}, limits
    ).params
    assert params.logit_bias == ((7, -100.0), (3, 2.5))
    assert params.min_p == 0.1 and params.ignore_eos is True
    params = generate_frame({"prompt": "a", "logit_bias": None, "ignore_eos": None}, limits).params
    assert params.logit_bias == DEFAULT_SAMPLING.logit_bias == () and params.ignore_eos is False
    # Every id of the vocabulary may be biased, the most a request may name included.
    many = {str(i): 1 for i in range(300)}
    assert len(generate_frame({"prompt": "a", "logit_bias": many}, limits).params.logit_bias) == 300


def test_prompt_past_the_byte_bound_is_refused_without_tokenizing():
    calls = []

    def counting_tokenize(prompt, messages):
        calls.append(prompt)
        return fake_tokenize(prompt, messages)

    conn = Connection(Limits(context_length=16, vocab_size=100, max_prompt_bytes=64), counting_tokenize, now_ns=0)
    [error] = conn.receive_text(json.dumps({"type": "generate", "id": "big", "prompt": "é" * 33}), 0)
    assert error.frame.json()["code"] == ErrorCode.PROMPT_TOO_LONG and calls == []
    [work] = conn.receive_text(json.dumps({"type": "generate", "id": "ok", "prompt": "é" * 32}), 0)
    assert isinstance(work, Tokenize) and calls == []


def test_frame_bytes_have_a_per_connection_budget():
    conn = connection(byte_burst=200, bytes_per_second=100)
    big = json.dumps({"type": "generate", "id": "a", "prompt": "x" * 150})
    assert isinstance(prepare(conn, conn.receive_text(big, 0))[0], Submit)
    # The bucket holds less than the next frame: it is dropped, with one rate_limited error.
    [limited] = conn.receive_text(big.replace('"a"', '"b"'), 0)
    assert limited.frame.json()["code"] == ErrorCode.RATE_LIMITED
    assert conn.receive_text(big.replace('"a"', '"c"'), 0) == []
    # Two seconds refill the bucket.
    assert isinstance(prepare(conn, conn.receive_text(big.replace('"a"', '"b"'), 2000 * MS))[0], Submit)


def test_live_requests_are_capped_per_client_address_across_connections():
    quota = AddressQuota(3)
    limits = Limits(context_length=16, vocab_size=100)
    first = Connection(limits, fake_tokenize, 0, address="10.0.0.1", quota=quota)
    second = Connection(limits, fake_tokenize, 0, address="10.0.0.1", quota=quota)
    other = Connection(limits, fake_tokenize, 0, address="10.0.0.2", quota=quota)
    [a] = generate(first, "a")
    generate(first, "b")
    generate(second, "c")
    [refused] = generate(second, "d")
    assert (
        refused.frame.json()["code"] == ErrorCode.TOO_MANY_REQUESTS_FROM_ADDRESS and refused.frame.json()["id"] == "d"
    )
    assert isinstance(generate(other, "e")[0], Submit)
    # An ended request gives its place back.
    first.end(a.request, Ending(Outcome.DONE, Reason.EOS))
    assert isinstance(generate(second, "d")[0], Submit)
    assert quota.used("10.0.0.1") == 3


def test_a_cancel_while_the_prompt_is_tokenized_stops_the_request_once_it_exists():
    conn = connection()
    [work] = conn.receive_text('{"type": "generate", "id": "r1", "prompt": "a b"}', 0)
    assert isinstance(work, Tokenize) and conn.pending == {"r1": work.draft}
    # Still counted: the id is taken and the request counts towards the caps.
    [dup] = conn.receive_text('{"type": "generate", "id": "r1", "prompt": "a"}', 1)
    assert dup.frame.json()["code"] == ErrorCode.DUPLICATE_ID
    assert conn.receive_text('{"type": "cancel", "id": "r1"}', 5 * MS) == [StopDraft(work.draft)]
    assert conn.receive_text('{"type": "cancel", "id": "r1"}', 6 * MS) == [StopDraft(work.draft)]
    submit, cancel = conn.tokenized(work.draft, conn.tokenize(work.draft))
    assert isinstance(submit, Submit) and cancel == Cancel(submit.request)
    assert submit.request.cancel_requested_ns == 5 * MS
    sent = frames(conn.end(submit.request, Ending(Outcome.CANCELLED, Reason.USER_CANCELLED)))
    assert [f["type"] for f in sent] == ["cancelled", "cancel_ack"]


def test_a_client_that_leaves_while_its_prompt_is_tokenized_gives_its_place_back():
    quota = AddressQuota(1)
    conn = Connection(Limits(context_length=16, vocab_size=100), fake_tokenize, 0, address="a", quota=quota)
    [work] = conn.receive_text('{"type": "generate", "id": "r1", "prompt": "a b"}', 0)
    assert quota.used("a") == 1
    conn.stop_all(Reason.CLIENT_DISCONNECTED, 1)
    assert quota.used("a") == 0 and conn.tokenized(work.draft, conn.tokenize(work.draft)) == []
    assert conn.live == {}


def test_importing_the_pure_layer_loads_only_the_standard_library_and_itself():
    # tests/test_layers.py reads the imports from the source; this loads every module and looks.
    code = (
        "import json, pkgutil, sys, importlib\n"
        "before = set(sys.modules)\n"
        "import stopline.protocol as pure\n"
        "for info in pkgutil.iter_modules(pure.__path__, 'stopline.protocol.'):\n"
        "    importlib.import_module(info.name)\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = json.loads(out)
    ours = {name for name in loaded if name == "stopline" or name.startswith("stopline.")}
    assert {"stopline.protocol.connection", "stopline.protocol.validation", "stopline.protocol.origin"} <= ours
    assert {name for name in ours if not name.startswith("stopline.protocol")} == {"stopline"}, ours
    others = {name for name in loaded if name not in ours and name.split(".")[0] not in sys.stdlib_module_names}
    assert others == set(), f"third-party or native modules: {sorted(others)}"


def started_request(conn: Connection, request_id="r1", now_ns=0, **fields):
    [submit] = generate(conn, request_id, now_ns, **fields)
    conn.started(submit.request, now_ns + 1 * MS)
    return submit.request


def test_a_cancelled_loop_ends_with_the_reason_the_protocol_asked_for():
    conn = connection()
    request = started_request(conn)
    conn.stalled(request, 10 * MS)
    # The native side knows only that it was asked to stop; whatever it says about why is not read.
    result = loop_result(
        Outcome.CANCELLED,
        "user_cancelled",
        end_ns=12 * MS,
        first_token_ns=5 * MS,
        tokens_generated=4,
        tokens_after_cancel=1,
        wasted_eval_ns=MS // 2,
    )
    ended, terminal = conn.finished(request, result)
    assert ended.ending.reason is Reason.SLOW_CONSUMER
    assert terminal.frame.json() == {
        "type": "cancelled",
        "id": "r1",
        "reason": "slow_consumer",
        "tokens_generated": 4,
        "tokens_after_cancel": 1,
        "cancel_latency_ms": 2.0,
        "tokens_wasted": 7,
        # The decode step under way when the stop came, cut short.
        "prompt_tokens_wasted": 0,
        "wasted_eval_ms": 0.5,
        "prompt_tokens_reused": 0,
        # Three tokens after the first, in the 7 ms from the first token to the loop's exit.
        "tokens_per_s": 428.6,
    }
    assert ended.ending.queue_ms == 1.0 and ended.ending.ttft_ms == 5.0 and ended.ending.duration_ms == 12.0


@pytest.mark.parametrize(
    "outcome, reason",
    [(Outcome.DONE, Reason.EOS), (Outcome.DONE, Reason.STOP_SEQUENCE), (Outcome.TIMEOUT, Reason.FIRST_TOKEN_TIMEOUT)],
)
def test_done_and_timeout_take_the_reason_the_loop_reports(outcome, reason):
    conn = connection()
    request = started_request(conn)
    sent = frames(conn.finished(request, loop_result(outcome, str(reason), end_ns=30 * MS, tokens_generated=2)))
    assert [(f["type"], f["reason"], f["duration_ms"]) for f in sent] == [(str(outcome), str(reason), 30.0)]
    # One name for one thing: a timeout's time is its duration, as for done.
    assert "elapsed_ms" not in sent[0]


def test_a_failed_evaluation_ends_with_internal_error():
    conn = connection()
    request = started_request(conn)
    [terminal] = frames(conn.finished(request, loop_result(Outcome.ERROR, "internal_error", end_ns=3 * MS)))
    assert terminal["type"] == "error" and terminal["code"] == ErrorCode.INTERNAL_ERROR


def test_a_loop_that_stopped_unasked_is_an_internal_error():
    conn = connection()
    request = started_request(conn)
    [terminal] = frames(conn.finished(request, loop_result(Outcome.CANCELLED, end_ns=3 * MS)))
    assert terminal["code"] == ErrorCode.INTERNAL_ERROR and conn.live == {}


def test_a_request_cancelled_while_queued_ends_without_a_slot():
    conn = connection()
    [submit] = generate(conn, now_ns=0)
    [cancel] = conn.receive_text('{"type": "cancel", "id": "r1"}', 4 * MS)
    assert cancel == Cancel(submit.request)
    ended, terminal = conn.cancelled_in_queue(submit.request, 5 * MS)
    assert ended.ending.outcome is Outcome.CANCELLED and ended.ending.queue_ms == 5.0
    assert terminal.frame.json()["reason"] == "user_cancelled" and terminal.frame.json()["cancel_latency_ms"] == 1.0
    assert terminal.frame.json()["tokens_wasted"] == 0 and conn.live == {}


@pytest.mark.parametrize(
    "timeout_s, ttft_timeout_s, reason", [(5, 2, Reason.FIRST_TOKEN_TIMEOUT), (1, 2, Reason.TOTAL_TIMEOUT)]
)
def test_a_queued_request_times_out_at_its_earlier_deadline(timeout_s, ttft_timeout_s, reason):
    conn = connection()
    [submit] = generate(conn, now_ns=7 * MS, timeout_s=timeout_s, ttft_timeout_s=ttft_timeout_s)
    request = submit.request
    assert request.queue_deadline_ns == 7 * MS + min(timeout_s, ttft_timeout_s) * 1000 * MS
    ended, terminal = conn.expired_in_queue(request, request.queue_deadline_ns)
    assert terminal.frame.json()["type"] == "timeout" and terminal.frame.json()["reason"] == str(reason)
    assert terminal.frame.json()["duration_ms"] == min(timeout_s, ttft_timeout_s) * 1000.0
    assert ended.ending.tokens_wasted == 0


def test_a_stop_asked_for_before_there_was_a_slot_is_asked_for_again_at_the_start():
    conn = connection()
    [submit] = generate(conn)
    conn.request_cancel(submit.request, Reason.SHUTDOWN, 1)
    assert conn.started(submit.request, 2) == [Cancel(submit.request)]


def test_a_client_that_stops_reading_gets_no_more_tokens():
    conn = connection()
    slow = started_request(conn, "slow")
    other = started_request(conn, "other")
    assert conn.token(slow, "a", 1) != []
    # A stalled token frame stops its own request only.
    assert conn.stalled(slow, 2) == [Cancel(slow)]
    assert conn.token(slow, "b", 3) == [] and slow.next_index == 2
    assert frames(conn.token(other, "c", 4)) == [{"type": "token", "id": "other", "index": 0, "text": "c"}]
    # A stalled frame of no one request stops every request not already stopping.
    assert conn.stalled(None, 5) == [Cancel(other)] and other.cancel_reason is Reason.SLOW_CONSUMER


def test_the_scheduler_refusing_or_failing_a_request_ends_it_with_its_code():
    quota = AddressQuota(2)
    conn = Connection(Limits(context_length=16, vocab_size=100), fake_tokenize, 0, address="a", quota=quota)
    [busy] = generate(conn, "busy")
    [broken] = generate(conn, "broken")
    ended, terminal = conn.busy(busy.request, "all 2 slots are busy")
    assert ended.ending.outcome is Outcome.ERROR
    assert terminal.frame.json() == {"type": "error", "id": "busy", "code": "busy", "message": "all 2 slots are busy"}
    [terminal] = frames(conn.failed(broken.request, "RuntimeError: boom"))
    assert terminal["code"] == ErrorCode.INTERNAL_ERROR and terminal["message"] == "RuntimeError: boom"
    assert conn.live == {} and quota.used("a") == 0


def test_accepted_names_the_global_id_and_the_cancel_token():
    conn = connection()
    [submit] = generate(conn)
    request = submit.request
    [accepted] = conn.accepted(request, 3)
    assert isinstance(accepted, Send) and accepted.request is None
    assert accepted.frame.json() == {
        "type": "accepted",
        "id": "r1",
        "queue_position": 3,
        "request_id": request.request_id,
        "cancel_token": request.cancel_token,
        # "a b c", one token a word.
        "prompt_tokens": 3,
    }


def test_the_greeting_and_a_failed_frame_are_actions_too():
    conn = connection()
    [hello] = frames(conn.hello("m"))
    assert hello["type"] == "hello" and hello["limits"]["max_tokens"] == 16
    assert hello["model"] == "m" and hello["models"] == ["m"]
    assert frames(conn.hello("m", ("m", "other")))[0]["models"] == ["m", "other"]
    # The defaults a client shows are the ones a frame that leaves a field out gets.
    assert hello["defaults"]["max_tokens"] == DEFAULT_SAMPLING.max_tokens == 1024
    assert hello["defaults"] == {name: getattr(DEFAULT_SAMPLING, name) for name in hello["defaults"]}
    assert set(hello["defaults"]) >= {"max_tokens", "temperature", "top_k", "top_p", "repetition_penalty"}
    [error] = frames(conn.frame_failed())
    assert error == {
        "type": "error",
        "id": None,
        "code": "internal_error",
        "message": "the server failed to handle this frame",
    }


def test_the_speed_is_the_decode_speed_and_needs_two_tokens():
    ending = Ending(Outcome.DONE, Reason.EOS, tokens_generated=11, ttft_ms=900.0, duration_ms=1100.0)
    # Ten tokens in the 0.2 s after the first: not 11 tokens over 1.1 s.
    assert ending.tokens_per_s == 50.0
    assert Ending(Outcome.DONE, Reason.EOS, tokens_generated=1, ttft_ms=900.0, duration_ms=900.0).tokens_per_s is None
    assert Ending(Outcome.TIMEOUT, Reason.FIRST_TOKEN_TIMEOUT, duration_ms=900.0).tokens_per_s is None


class TwoModels:
    """Two served models, the second with a context of its own."""

    names = ("smol", "gemma")

    def limits_of(self, requested: str) -> Limits | None:
        return {
            "smol": Limits(context_length=16, vocab_size=100),
            "gemma": Limits(context_length=64, vocab_size=1000),
        }.get(requested)


def two_models() -> Connection:
    return Connection(Limits(context_length=16, vocab_size=100), fake_tokenize, 0, models=TwoModels())


def test_a_generate_frame_names_its_model_and_is_checked_against_its_bounds():
    conn = two_models()
    [work] = conn.receive_text('{"type": "generate", "id": "r1", "prompt": "a", "model": "gemma"}', 0)
    assert isinstance(work, Tokenize) and work.draft.frame.model == "gemma"
    # Bounds are the named model's: a max_tokens or top_k beyond the first model's is allowed.
    [work] = conn.receive_text(
        '{"type": "generate", "id": "r2", "prompt": "a", "model": "gemma", "max_tokens": 60, "top_k": 500}', 0
    )
    assert work.draft.frame.params.max_tokens == 60
    [refused] = frames(conn.receive_text('{"type": "generate", "id": "r3", "prompt": "a", "max_tokens": 60}', 0))
    assert refused["code"] == ErrorCode.INVALID_FIELD
    # No model: the first, as before.
    [work] = conn.receive_text('{"type": "generate", "id": "r4", "prompt": "a"}', 0)
    assert work.draft.frame.model is None


@pytest.mark.parametrize(
    ("model", "code", "named"),
    [
        ('"gpt-4o"', ErrorCode.MODEL_NOT_FOUND, "'smol', 'gemma'"),
        ("7", ErrorCode.INVALID_FIELD, "model must be a string"),
        ('""', ErrorCode.INVALID_FIELD, "model must be a string"),
        ('"' + "m" * 257 + '"', ErrorCode.INVALID_FIELD, "model must be a string"),
        ('"\\ud800"', ErrorCode.INVALID_FIELD, "model must be a string"),
    ],
)
def test_a_model_not_served_or_not_a_name_is_refused(model, code, named):
    conn = two_models()
    [refused] = frames(conn.receive_text(f'{{"type": "generate", "id": "r1", "prompt": "a", "model": {model}}}', 0))
    assert refused["code"] == code and refused["id"] == "r1" and named in refused["message"]
    # Nothing is left live: the id is free again.
    assert not conn.pending and not conn.live


def test_a_stop_while_the_model_loads_ends_the_request_with_no_tokens():
    conn = two_models()
    [work] = conn.receive_text('{"type": "generate", "id": "r1", "prompt": "a", "model": "gemma"}', 0)
    work.draft.model = "gemma"
    assert conn.receive_text('{"type": "cancel", "id": "r1"}', 5 * MS) == [StopDraft(work.draft)]
    conn.receive_text('{"type": "cancel", "id": "r1"}', 6 * MS)
    actions = conn.stopped_in_load(work.draft, Reason.USER_CANCELLED, 7 * MS)
    [ended] = [a for a in actions if isinstance(a, Ended)]
    assert ended.ending.tokens_generated == 0 and ended.ending.cancel_latency_ms == 2.0
    sent = frames(actions)
    assert [f["type"] for f in sent] == ["accepted", "cancelled", "cancel_ack"]
    assert sent[0]["model"] == sent[1]["model"] == "gemma"
    assert sent[1]["reason"] == Reason.USER_CANCELLED and sent[1]["tokens_after_cancel"] == 0
    assert not conn.pending and not conn.live
    # Once ended, a late tokenizing or a second stop finds nothing.
    assert conn.stopped_in_load(work.draft, Reason.CLIENT_DISCONNECTED, 8 * MS) == []
