"""Every generation by its server-global ``request_id``, whatever transport started it.

A live entry knows its session (the Sink that owns the request), so a DELETE
from anyone holding the cancel token, or the API key that started the
request, stops it exactly as the owner's own cancel would: cancel by id lives
here (:meth:`Entry.cancel`, :meth:`Registry.cancel`), whichever server or
replica asks. An ended entry keeps only the outcome and the counts, so a
repeated DELETE or GET gets the same answer after the request is gone.

With a shared store (``--redis-url``) a listener hears of every entry added
and ended, and copies it there for the other replicas (stopline/cluster.py).
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections import OrderedDict
from typing import Protocol

from .protocol.errors import InvalidCancelToken, UnknownRequest
from .protocol.requests import Ending, Phase, Request
from .protocol.vocabulary import STATUS_BY_OUTCOME, Reason, Status


class Owner(Protocol):
    """The session that owns a request: a stop asked for by anyone goes through it."""

    async def cancel(self, request: Request, reason: Reason, now_ns: int) -> None: ...


class Entry:
    # Thousands of ended entries are kept (Registry's bound): slots, and no Event of their own
    # unless someone waits for the end, keep each one small.
    __slots__ = (
        "request_id",
        "cancel_token",
        "user",
        "user_id",
        "key_id",
        "created",
        "request",
        "session",
        "ending",
        "_ended",
    )

    def __init__(self, request: Request, session: Owner | None):
        self.request_id = request.request_id
        self.cancel_token = request.cancel_token
        self.user = request.user
        self.user_id = request.user_id
        self.key_id = request.key_id
        self.created = time.time()
        self.request: Request | None = request
        self.session: Owner | None = session
        self.ending: Ending | None = None
        # Made by the first wait_ended before the end, let go of at the end.
        self._ended: asyncio.Event | None = None

    async def wait_ended(self) -> None:
        """Return once the request has ended."""
        if self.ending is not None:
            return
        if self._ended is None:
            self._ended = asyncio.Event()
        await self._ended.wait()

    async def cancel(self, now_ns: int) -> Status:
        """Stop the request as its owner's own cancel would (reason user_cancelled), and answer with the
        outcome that won, which the loop reports within one step; an ended one answers with its end."""
        if self.ending is None:
            assert self.request is not None and self.session is not None  # held until it has ended
            await self.session.cancel(self.request, Reason.USER_CANCELLED, now_ns)
            await self.wait_ended()
        return self.status

    def _end(self, ending: Ending) -> None:
        # Forget the prompt and the connection; keep what GET and DELETE answer with.
        self.ending, self.request, self.session = ending, None, None
        if self._ended is not None:
            self._ended.set()
            self._ended = None

    @property
    def status(self) -> Status:
        if self.ending is not None:
            return STATUS_BY_OUTCOME[self.ending.outcome]
        assert self.request is not None  # let go of only once it has ended
        return {Phase.QUEUED: Status.QUEUED, Phase.PREFILL: Status.PREFILL}.get(self.request.phase, Status.DECODING)

    def describe(self) -> dict:
        """The status and counts that GET reports."""
        answer: dict = {"request_id": self.request_id, "status": str(self.status)}
        if self.ending is None:
            assert self.request is not None
            answer.update(prompt_tokens=len(self.request.prompt_tokens), tokens_generated=self.request.next_index)
        else:
            ending = self.ending
            answer.update(
                reason=ending.reason,
                prompt_tokens=ending.prompt_tokens,
                tokens_generated=ending.tokens_generated,
                tokens_after_cancel=ending.tokens_after_cancel,
                tokens_wasted=ending.tokens_wasted,
                duration_ms=ending.duration_ms,
            )
        return answer


class Listener(Protocol):
    """Hears of entries as they come and go; called on the event loop, it must not wait."""

    def added(self, entry: Entry) -> None: ...
    def ended(self, entry: Entry) -> None: ...


class Registry:
    def __init__(self, remembered: int = 4096):
        self._live: dict[str, Entry] = {}
        self._ended: OrderedDict[str, Entry] = OrderedDict()
        self._remembered = remembered
        self.listener: Listener | None = None
        # Request ids HTTP clients chose, held while their requests are handled (claim).
        self._claimed: set[str] = set()

    def add(self, request: Request, session: Owner | None) -> None:
        entry = self._live[request.request_id] = Entry(request, session)
        if self.listener is not None:
            self.listener.added(entry)

    def end(self, request: Request, ending: Ending) -> None:
        entry = self._live.pop(request.request_id, None)
        if entry is None:
            return
        entry._end(ending)
        # A client may use its own id again once the request has ended: the newest is remembered.
        self._ended.pop(entry.request_id, None)
        self._ended[entry.request_id] = entry
        if len(self._ended) > self._remembered:
            self._ended.popitem(last=False)
        if self.listener is not None:
            self.listener.ended(entry)

    def claim(self, request_id: str) -> bool:
        """Hold ``request_id``, which an HTTP client chose, until :meth:`unclaim`: False if a generation
        running here, or another request still being handled, has it already."""
        if request_id in self._live or request_id in self._claimed:
            return False
        self._claimed.add(request_id)
        return True

    def unclaim(self, request_id: str) -> None:
        self._claimed.discard(request_id)

    def live(self) -> list[Entry]:
        return list(self._live.values())

    def get(self, request_id: str) -> Entry | None:
        """The entry for ``request_id``, unchecked: for code in this process, never for a client."""
        return self._live.get(request_id) or self._ended.get(request_id)

    async def cancel(self, request_id: str) -> Status | None:
        """Stop ``request_id`` for a caller that has authorized it elsewhere (another replica's DELETE,
        relayed by the shared store): its status once stopped; None if this process does not hold it."""
        entry = self.get(request_id)
        return None if entry is None else await entry.cancel(time.monotonic_ns())

    def authorize(self, request_id: str, cancel_token: str | None, key_id: str | None = None) -> Entry:
        """The entry, if ``cancel_token`` is its cancel token or ``key_id`` the id of the key that started it
        (the caller has checked the key)."""
        entry = self.get(request_id)
        if entry is None:
            raise UnknownRequest(request_id)
        # Constant time: the comparison must not reveal how much of a guess was right.
        by_token = cancel_token is not None and hmac.compare_digest(cancel_token.encode(), entry.cancel_token.encode())
        by_key = key_id is not None and key_id == entry.key_id
        if not (by_token or by_key):
            raise InvalidCancelToken(request_id)
        return entry
