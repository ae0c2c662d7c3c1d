"""Request ids, cancel tokens and the registry, driven by plain calls: no sockets, no model."""

from __future__ import annotations

import asyncio
import json

import pytest

from stopline.protocol.connection import Connection, Send, Submit, Tokenize
from stopline.protocol.errors import InvalidCancelToken, UnknownRequest
from stopline.protocol.requests import Ending, Limits
from stopline.protocol.vocabulary import ErrorCode, Outcome, Reason
from stopline.registry import Registry


def fake_tokenize(prompt, messages):
    return list(range(len(prompt.split())))


def submitted(conn: Connection, **fields):
    [work] = conn.receive_text(json.dumps({"type": "generate", "prompt": "a b c", **fields}), 0)
    assert isinstance(work, Tokenize), work
    [action] = conn.tokenized(work.draft, conn.tokenize(work.draft))
    assert isinstance(action, Submit), action
    return action.request


@pytest.fixture
def conn() -> Connection:
    return Connection(Limits(context_length=16, vocab_size=100), fake_tokenize, now_ns=0)


def test_every_request_gets_a_global_id_and_its_own_secret(conn):
    a, b = submitted(conn, id="r1"), submitted(conn, id="r2")
    assert a.request_id != "r1" and len(a.request_id) == 36 and a.request_id != b.request_id
    assert a.cancel_token != b.cancel_token and len(a.cancel_token) >= 32
    # Without a client id, the server's id serves both purposes.
    c = submitted(conn)
    assert c.request_id == c.id


def test_user_is_kept_and_checked(conn):
    assert submitted(conn, id="r1", user="alice").user == "alice"
    for bad in (7, "x" * 257):
        [action] = conn.receive_text(json.dumps({"type": "generate", "id": "r2", "prompt": "a", "user": bad}), 0)
        frame = action.frame.json()
        assert isinstance(action, Send) and frame["code"] == ErrorCode.INVALID_FIELD and "user" in frame["message"]


def test_registry_authorizes_by_token_and_remembers_outcomes(conn):
    registry = Registry(remembered=2)
    requests = [submitted(conn, id=f"r{i}") for i in range(3)]
    for request in requests:
        registry.add(request, session=None)
    first = requests[0]
    with pytest.raises(UnknownRequest):
        registry.authorize("nope", first.cancel_token)
    for wrong in (None, "", requests[1].cancel_token, first.cancel_token[:-1]):
        with pytest.raises(InvalidCancelToken):
            registry.authorize(first.request_id, wrong)
    entry = registry.authorize(first.request_id, first.cancel_token)
    assert entry.status == "queued" and entry.ending is None
    registry.end(first, Ending(Outcome.DONE, str(Reason.EOS), tokens_generated=3))
    assert entry.ending is not None and entry.status == "finished" and entry.request is None
    assert entry.describe()["tokens_generated"] == 3
    registry.end(requests[1], Ending(Outcome.CANCELLED, str(Reason.USER_CANCELLED)))
    registry.end(requests[2], Ending(Outcome.TIMEOUT, str(Reason.TOTAL_TIMEOUT)))
    # Only the most recent ended ids are remembered.
    with pytest.raises(UnknownRequest):
        registry.authorize(first.request_id, first.cancel_token)
    assert registry.authorize(requests[2].request_id, requests[2].cancel_token).status == "timeout"


async def test_registry_wakes_whoever_waits_for_an_end(conn):
    registry = Registry()
    request = submitted(conn, id="r1")
    registry.add(request, session=None)
    entry = registry.get(request.request_id)
    assert entry is not None
    waiting = asyncio.get_running_loop().create_task(entry.wait_ended())
    await asyncio.sleep(0)
    assert not waiting.done()
    registry.end(request, Ending(Outcome.DONE, str(Reason.EOS)))
    await asyncio.wait_for(waiting, 5)
    # An ended entry answers at once, and keeps no event of its own.
    await asyncio.wait_for(entry.wait_ended(), 5)
    assert entry._ended is None


async def test_cancel_by_id_goes_through_the_owner_and_answers_with_the_outcome_that_won(conn):
    registry = Registry()

    class Owner:
        """Ends the request a step later, as the loop reports a stop."""

        def __init__(self):
            self.asked: list[tuple[str, Reason, int]] = []

        async def cancel(self, request, reason, now_ns):
            self.asked.append((request.request_id, reason, now_ns))
            loop = asyncio.get_running_loop()
            loop.call_soon(registry.end, request, Ending(Outcome.CANCELLED, str(reason)))

    owner = Owner()
    request, done = submitted(conn, id="r1"), submitted(conn, id="r2")
    registry.add(request, session=owner)
    registry.add(done, session=owner)
    registry.end(done, Ending(Outcome.DONE, str(Reason.EOS)))
    assert await asyncio.wait_for(registry.cancel(request.request_id), 5) == "cancelled"
    assert owner.asked[0][:2] == (request.request_id, Reason.USER_CANCELLED)
    # An ended request answers with its end, and nobody is asked again; one held elsewhere is not here.
    assert await registry.cancel(request.request_id) == "cancelled"
    assert await registry.cancel(done.request_id) == "finished"
    assert await registry.cancel("held-by-another-replica") is None
    assert len(owner.asked) == 1
