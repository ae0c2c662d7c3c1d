"""The Stopline protocol without I/O: every decision about a request, and nothing else.

:class:`Connection` is one client's side of the protocol. The I/O layer
(:mod:`stopline.app` for the WebSocket, :mod:`stopline.http_api` for HTTP)
tells it what happened, in plain calls stamped with CLOCK_MONOTONIC ns:

- what the client did: sent a text or binary frame (or an HTTP body, checked
  into a :class:`~.frames.GenerateFrame`), asked to cancel, left;
- what the server saw: a prompt tokenized, a request accepted or refused by
  the scheduler, a request that took a slot, generated text, a native loop that
  exited (the engine's result), a request cancelled or expired while queued, a
  send that stalled, a shutdown.

Every such call returns a list of :data:`Action` for the I/O layer to carry out
in order: :class:`Send` a frame, :class:`Tokenize` a prompt off the event loop,
:class:`Submit` a request to the scheduler, :class:`Cancel` one, and record a
request that :class:`Ended` (the registry, the metrics and the end log line).

The protocol validates frames, enforces limits and rates, builds every frame
and every :class:`Ending`, remembers why and when a stop was asked for, and
guarantees that a request gets exactly one terminal message, whatever races
with what. The I/O layer only moves bytes and frames; the scheduler only owns
slots and the queue. Like every module of :mod:`stopline.protocol`, it imports
only the standard library and its neighbours there: no socket, thread, event
loop or model, so it is tested with plain function calls. Its neighbours hold
what a request is (:mod:`.requests`), the frames (:mod:`.frames`), the checks of
a generate frame (:mod:`.validation`) and the refusals (:mod:`.errors`).

A request moves through this table, and nowhere else::

    QUEUED ──start──▶ PREFILL ──first token──▶ DECODING
       │                 │                        │
       └─────────────────┴──────── end ───────────┴──▶ ENDED (one terminal message)
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from .errors import (
    DuplicateId,
    InvalidField,
    PreparationFailed,
    PromptTooLong,
    ProtocolError,
    TooManyRequests,
    TooManyRequestsFromAddress,
)
from .frames import (
    Accepted,
    CancelAck,
    CancelFrame,
    ErrorFrame,
    Frame,
    GenerateFrame,
    Hello,
    Preempted,
    Resumed,
    Terminal,
    Token,
)
from .requests import (
    Ending,
    GenerationResult,
    Limits,
    Phase,
    Request,
    exit_outcome,
    first_deadline,
)
from .throttle import Throttle
from .validation import ModelBounds, incoming_frame
from .vocabulary import ErrorCode, Outcome, QuotaLimit, Reason


@dataclass(eq=False)
class Draft:
    """A generate frame whose prompt is still being tokenized, under the id its request will have."""

    id: str
    frame: GenerateFrame
    received_ns: int
    # Cancel frames that arrived meanwhile, and when the first did.
    cancels: int = 0
    cancel_ns: int = 0
    # The name of the model that serves it, once the server has found that model (and loaded it).
    model: str = ""


# Actions returned to the I/O layer: every call of a Connection returns a list of them.
@dataclass(frozen=True)
class Send:
    """Write ``frame`` to the client. ``request`` is the request whose output it
    is (a token frame): a send that stalls is reported with ``Connection.stalled(request)``."""

    frame: Frame
    request: Request | None = None


@dataclass(frozen=True)
class Tokenize:
    """Run ``Connection.tokenize(draft)`` off the event loop (it costs CPU in
    proportion to the prompt), then hand its result to ``Connection.tokenized``."""

    draft: Draft


@dataclass(frozen=True)
class Submit:
    """Hand ``request`` to the scheduler; report what it said with ``accepted``, ``busy`` or ``failed``."""

    request: Request


@dataclass(frozen=True)
class Cancel:
    """Stop ``request`` wherever it is, queued or on a slot. The request remembers why and when."""

    request: Request


@dataclass(frozen=True)
class StopDraft:
    """A cancel frame reached ``draft`` before its request exists. A draft that waits for its
    model to load stops waiting: the I/O layer ends it with ``Connection.stopped_in_load``. One
    being tokenized is stopped by ``Connection.tokenized``, and needs nothing more."""

    draft: Draft


@dataclass(frozen=True)
class Ended:
    """``request`` ended: record ``ending`` (the registry, the metrics, the end log line).
    It comes before the frames that tell the client."""

    request: Request
    ending: Ending


Action = Send | Tokenize | Submit | Cancel | StopDraft | Ended


def _ms(start_ns: int, end_ns: int) -> float:
    return round((end_ns - start_ns) / 1e6, 3)


def ending_before_start(
    outcome: Outcome, reason: Reason, prompt_tokens: int, received_ns: int, cancel_ns: int, now_ns: int
) -> Ending:
    """How a request that never reached a slot ends (stopped or expired in the queue, or while its
    model loaded): nothing was computed for it, and all its time was waiting."""
    waited_ms = _ms(received_ns, now_ns)
    return Ending(
        outcome,
        reason,
        prompt_tokens=prompt_tokens,
        queue_ms=waited_ms,
        duration_ms=waited_ms,
        cancel_latency_ms=_ms(cancel_ns, now_ns) if outcome is Outcome.CANCELLED else None,
    )


class AddressQuota:
    """Live requests per client address, shared by all of that address's connections."""

    def __init__(self, limit: int):
        self.limit = limit
        self._used: dict[str, int] = {}

    def used(self, address: str) -> int:
        return self._used.get(address, 0)

    def take(self, address: str) -> None:
        self._used[address] = self._used.get(address, 0) + 1

    def give_back(self, address: str) -> None:
        left = self._used[address] - 1
        if left:
            self._used[address] = left
        else:
            del self._used[address]


TokenizeFn = Callable[[str | None, list | None], list]


class Connection:
    """One client's protocol state. ``now_ns`` is always CLOCK_MONOTONIC ns."""

    def __init__(
        self,
        limits: Limits,
        tokenize: TokenizeFn,
        now_ns: int,
        *,
        address: str = "",
        quota: AddressQuota | None = None,
        user_id: str | None = None,
        key_id: str | None = None,
        priority: int = 0,
        models: ModelBounds | None = None,
    ):
        self.limits = limits
        # The models a generate frame may name (None: one model, whose bounds are ``limits``).
        self.models = models
        # The API key this client authenticated with (None without keys): every request is theirs,
        # of its priority unless the request names one.
        self.user_id = user_id
        self.key_id = key_id
        self.priority = priority
        self._tokenize = tokenize
        self.address = address
        self.quota = quota if quota is not None else AddressQuota(limits.requests_per_address)
        self.live: dict[str, Request] = {}
        # Generate frames whose prompts are being tokenized; they count as live for every limit.
        self.pending: dict[str, Draft] = {}
        self._ended: OrderedDict[str, Outcome] = OrderedDict()
        self._tokens = float(limits.frame_burst)
        self._tokens_at = now_ns
        self._rate_limited_report = Throttle()
        self._bytes = float(limits.byte_burst)

    def hello(self, model: str, models: tuple[str, ...] = ()) -> list[Action]:
        """The greeting, sent once as the connection opens: ``model`` is the one a generate frame
        that names none runs on, ``models`` every one it may name (none given: ``model`` alone)."""
        return [Send(Hello(model, self.limits, models))]

    # Incoming frames ------------------------------------------------------

    def receive_binary(self, now_ns: int, size: int = 0) -> list[Action]:
        if not self._admit(now_ns, size):
            return self._rate_limited(now_ns)
        return [Send(ErrorFrame(ErrorCode.BINARY_FRAME, "frames must be JSON text frames, not binary"))]

    def receive_text(self, data: str, now_ns: int) -> list[Action]:
        """A WebSocket text frame."""
        # Characters, not bytes: counting bytes would cost as much as the parse it guards.
        if not self._admit(now_ns, len(data)):
            return self._rate_limited(now_ns)
        try:
            frame = incoming_frame(data, self.limits, self.models)
        except ProtocolError as exc:
            return [Send(ErrorFrame.refusing(exc))]
        if isinstance(frame, CancelFrame):
            return self.cancel(frame, now_ns)
        return self.generate(frame, now_ns)

    def frame_failed(self) -> list[Action]:
        """Handling a frame raised (a bug): that frame is answered, and the connection lives on."""
        return [Send(ErrorFrame(ErrorCode.INTERNAL_ERROR, "the server failed to handle this frame"))]

    def generate(self, frame: GenerateFrame, now_ns: int) -> list[Action]:
        """Start the request ``frame`` asks for, from a WebSocket frame or an HTTP body.
        An HTTP request is one frame on a connection of its own, so the rates that bound a
        WebSocket's flood of frames (:meth:`receive_text`) do not apply to it; the live
        requests of its address do."""
        request_id = frame.id if frame.id is not None else frame.request_id or str(uuid.uuid4())
        refusal = self._room_refusal(request_id)
        if refusal is not None:
            return [Send(ErrorFrame.refusing(refusal))]
        draft = Draft(request_id, frame, received_ns=now_ns)
        self.pending[request_id] = draft
        self.quota.take(self.address)
        return [Tokenize(draft)]

    def tokenize(
        self, draft: Draft, tokenize: TokenizeFn | None = None, limits: Limits | None = None
    ) -> list[int] | ProtocolError:
        """The prompt's tokens, or the error that refuses it, by the model that serves it (its
        ``tokenize`` and ``limits``; by default, this connection's). Safe to call from any thread."""
        frame = draft.frame
        limits = limits or self.limits
        try:
            tokens = (tokenize or self._tokenize)(frame.prompt, frame.messages)
        except ValueError as exc:  # the tokenizer or the chat template refused the text
            return InvalidField(str(exc), draft.id)
        if not tokens:
            return InvalidField("the prompt is empty", draft.id)
        if len(tokens) + frame.min_answer_tokens > limits.context_length:
            answer = (
                "at least one generated token"
                if frame.min_answer_tokens == 1
                else f"the {frame.min_answer_tokens} generated tokens min_answer_tokens asks room for"
            )
            # The server's operator can give a longer one, up to the model's own limit.
            return PromptTooLong(
                f"the prompt has {len(tokens)} tokens; the context holds "
                f"{limits.context_length}, including {answer} (the server's --context-length)",
                draft.id,
            )
        return tokens

    def tokenized(self, draft: Draft, tokens: list[int] | ProtocolError) -> list[Action]:
        """Turn a tokenized draft into a live request (or its error). A cancel
        that arrived while it was tokenized stops the request at once."""
        if self.pending.pop(draft.id, None) is not draft:
            return []  # the client left meanwhile
        if isinstance(tokens, ProtocolError):
            self.quota.give_back(self.address)
            refusal: list[Action] = [Send(ErrorFrame.refusing(tokens))]
            return refusal + [Send(CancelAck.of(draft.id, Outcome.ERROR))] * draft.cancels
        request = self._live_request(draft, tokens)
        actions: list[Action] = [Submit(request)]
        if draft.cancels:
            request.unanswered_cancels = draft.cancels - 1
            actions += self.request_cancel(request, Reason.USER_CANCELLED, draft.cancel_ns)
        return actions

    def stopped_in_load(self, draft: Draft, reason: Reason, now_ns: int) -> list[Action]:
        """A stop ended ``draft``'s wait for its model to load: a cancel frame (``StopDraft``), the
        client's leaving or a shutdown. Its request ends now, cancelled with 0 tokens, as one
        stopped in the queue: accepted, then its terminal message."""
        if self.pending.pop(draft.id, None) is not draft:
            return []  # ended already
        request = self._live_request(draft, [])
        request.cancel_reason = reason
        request.cancel_requested_ns = draft.cancel_ns if reason is Reason.USER_CANCELLED and draft.cancels else now_ns
        request.unanswered_cancels = max(draft.cancels - 1, 0)
        return self.accepted(request, 0) + self._ended_in_queue(request, Outcome.CANCELLED, reason, now_ns)

    def _live_request(self, draft: Draft, tokens: list[int]) -> Request:
        """The request ``draft`` becomes, live from now on."""
        request = Request(
            draft.id,
            tokens,
            draft.frame.params,
            received_ns=draft.received_ns,
            user=draft.frame.user,
            user_id=self.user_id,
            key_id=self.key_id,
            priority=self.priority if draft.frame.priority is None else draft.frame.priority,
            model=draft.model,
        )
        if draft.frame.request_id is not None:
            request.request_id = draft.frame.request_id
        elif draft.frame.id is None:
            request.request_id = draft.id  # one id is enough when the client gave none
        if draft.frame.cancel_token is not None:
            request.cancel_token = draft.frame.cancel_token
        self.live[draft.id] = request
        return request

    def preparation_failed(self, draft: Draft, message: str) -> list[Action]:
        """The server could not prepare ``draft`` (a bug): it ends with internal_error, alone."""
        return self.tokenized(draft, PreparationFailed(message, draft.id))

    def _room_refusal(self, request_id: str) -> ProtocolError | None:
        """Why this connection, or its address, has no room for another request, if it has none."""
        if request_id in self.live or request_id in self.pending:
            return DuplicateId(f"request {request_id!r} is still live on this connection", request_id)
        count = len(self.live) + len(self.pending)
        if count >= self.limits.requests_per_connection:
            return TooManyRequests(
                f"this connection already has {count} live requests "
                f"(the limit is {self.limits.requests_per_connection})",
                request_id,
            )
        if self.quota.used(self.address) >= self.quota.limit:
            return TooManyRequestsFromAddress(
                f"this client address already has {self.quota.used(self.address)} live requests "
                f"(the limit is {self.quota.limit})",
                request_id,
            )
        return None

    def cancel(self, frame: CancelFrame, now_ns: int) -> list[Action]:
        """Stop the request ``frame`` names: a pending prompt once it is tokenized, a live
        request now; a request that has ended is answered with its outcome."""
        request_id = frame.id
        draft = self.pending.get(request_id)
        if draft is not None:
            draft.cancels += 1
            draft.cancel_ns = draft.cancel_ns or now_ns
            return [StopDraft(draft)]
        request = self.live.get(request_id)
        if request is None:
            return [Send(CancelAck.of(request_id, self._ended.get(request_id)))]
        if request.cancel_reason is not None:
            # Already stopping, but a finish may still win: answer once the outcome is known.
            request.unanswered_cancels += 1
            return []
        return self.request_cancel(request, Reason.USER_CANCELLED, now_ns)

    # Stops ----------------------------------------------------------------

    def request_cancel(self, request: Request, reason: Reason, now_ns: int) -> list[Action]:
        """Ask for a stop for ``reason``; only the first reason for a request counts."""
        if request.ended or request.cancel_reason is not None:
            return []
        request.cancel_reason = reason
        request.cancel_requested_ns = now_ns
        return [Cancel(request)]

    def stalled(self, request: Request | None, now_ns: int) -> list[Action]:
        """A send waited past the slow-consumer grace period: the client stopped reading.
        ``request`` is the request whose output the frame was; a frame of no one
        request (accepted, a terminal message) stops every live request."""
        targets = [request] if request is not None else list(self.live.values())
        actions: list[Action] = []
        for target in targets:
            actions += self.request_cancel(target, Reason.SLOW_CONSUMER, now_ns)
        return actions

    def stop_all(self, reason: Reason, now_ns: int) -> list[Action]:
        """Stop every live request of this connection: the client left, or the server is shutting down."""
        if reason is Reason.CLIENT_DISCONNECTED:
            # Prompts still being tokenized are dropped: nobody is left to answer.
            for _ in self.pending:
                self.quota.give_back(self.address)
            self.pending.clear()
        actions: list[Action] = []
        for request in list(self.live.values()):
            actions += self.request_cancel(request, reason, now_ns)
        return actions

    # What the scheduler and the engine report ------------------------------

    def accepted(self, request: Request, queue_position: int) -> list[Action]:
        """The scheduler took ``request``: 0 if it started at once, else its place in the queue."""
        accepted = Accepted(
            request.id,
            queue_position,
            request.request_id,
            request.cancel_token,
            len(request.prompt_tokens),
            request.model or None,
        )
        return [Send(accepted)]

    def busy(self, request: Request, message: str) -> list[Action]:
        """The scheduler refused ``request``: every slot is busy and the queue is full."""
        return self.end(request, Ending(Outcome.ERROR, ErrorCode.BUSY, message=message))

    def over_quota(
        self, request: Request, limit: QuotaLimit, retry_after_s: float | None, message: str
    ) -> list[Action]:
        """The key's quota refused ``request`` before it reached the scheduler."""
        return self.end(
            request,
            Ending(
                Outcome.ERROR,
                ErrorCode.QUOTA_EXCEEDED,
                message=message,
                prompt_tokens=len(request.prompt_tokens),
                limit=limit,
                retry_after_s=retry_after_s,
            ),
        )

    def unauthorized(self, request: Request, message: str) -> list[Action]:
        """The key that opened this connection was revoked since: its new requests are refused."""
        return self.end(request, Ending(Outcome.ERROR, ErrorCode.UNAUTHORIZED, message=message))

    def failed(self, request: Request, message: str) -> list[Action]:
        """Submitting, starting or running ``request`` raised (a bug): it ends with internal_error."""
        return self.end(
            request,
            Ending(Outcome.ERROR, ErrorCode.INTERNAL_ERROR, message=message, prompt_tokens=len(request.prompt_tokens)),
        )

    def started(self, request: Request, now_ns: int) -> list[Action]:
        """``request`` took a slot. A stop asked for before there was a slot to stop is asked for again."""
        request.advance(Phase.PREFILL)
        request.started_ns = now_ns
        return [Cancel(request)] if request.cancel_reason is not None else []

    def preempted(self, request: Request) -> list[Action]:
        """``request``'s generation was paused for one of higher priority: its client is told."""
        return [] if request.ended else [Send(Preempted(request.id), request)]

    def resumed(self, request: Request) -> list[Action]:
        """``request``'s preempted generation goes on."""
        return [] if request.ended else [Send(Resumed(request.id), request)]

    def token(self, request: Request, text: str, now_ns: int, logprobs: list[dict] | None = None) -> list[Action]:
        """Newly generated text: its token frame (none once the request has ended), with the
        log probabilities of the tokens it was read with, when they were asked for."""
        if request.ended:
            return []
        if request.phase is Phase.PREFILL:
            request.advance(Phase.DECODING)
            request.first_token_ns = now_ns
        frame = Token(request.id, request.next_index, text, logprobs)
        request.next_index += 1
        # A client that stopped reading gets no more tokens; everyone else gets every token generated.
        if request.cancel_reason is Reason.SLOW_CONSUMER:
            return []
        return [Send(frame, request)]

    def finished(self, request: Request, result: GenerationResult) -> list[Action]:
        """The native loop of ``request`` exited, and ``result`` is what it reported.

        This is the one place a loop's way out becomes an outcome and a reason. A
        cancelled loop ends with the reason this protocol asked for the stop: the
        native side knows only that a stop was asked for."""
        outcome, exit_reason = exit_outcome(result.exit)
        duration_ms = _ms(request.received_ns, result.end_ns)
        if outcome is Outcome.ERROR:
            return self.end(
                request,
                Ending(
                    outcome,
                    ErrorCode.INTERNAL_ERROR,
                    prompt_tokens=result.prompt_tokens,
                    prompt_tokens_evaluated=result.prompt_tokens_evaluated,
                    prompt_tokens_wasted=result.prompt_tokens_wasted,
                    wasted_eval_ms=result.wasted_eval_ns / 1e6,
                    tokens_generated=result.tokens_generated,
                    message="the model failed to evaluate a batch",
                    duration_ms=duration_ms,
                ),
            )
        cancelled = outcome is Outcome.CANCELLED
        if not cancelled:
            reason = Reason(str(exit_reason))
        elif request.cancel_reason is not None:
            reason = request.cancel_reason
        else:
            return self.failed(request, "the generation stopped although no stop was asked for")
        return self.end(
            request,
            Ending(
                outcome,
                reason,
                prompt_tokens=result.prompt_tokens,
                prompt_tokens_reused=result.prompt_tokens_reused,
                prompt_tokens_evaluated=result.prompt_tokens_evaluated,
                tokens_generated=result.tokens_generated,
                tokens_after_cancel=result.tokens_after_cancel,
                queue_ms=_ms(request.received_ns, request.started_ns),
                ttft_ms=_ms(request.received_ns, result.first_token_ns) if result.first_token_ns else None,
                duration_ms=duration_ms,
                cancel_latency_ms=_ms(request.cancel_requested_ns, result.end_ns) if cancelled else None,
                longest_prefill_node_ms=result.longest_prefill_node_ns / 1e6,
                longest_decode_node_ms=result.longest_decode_node_ns / 1e6,
                prompt_tokens_wasted=result.prompt_tokens_wasted,
                wasted_eval_ms=result.wasted_eval_ns / 1e6,
                preemptions=result.preemptions,
                preempted_ms=result.preempted_ns / 1e6,
            ),
        )

    def cancelled_in_queue(self, request: Request, now_ns: int) -> list[Action]:
        """The scheduler took ``request``, stopped by a Cancel, out of its queue: it never reached a slot."""
        if request.cancel_reason is None:
            return self.failed(request, "the request left the queue although no stop was asked for")
        return self._ended_in_queue(request, Outcome.CANCELLED, request.cancel_reason, now_ns)

    def expired_in_queue(self, request: Request, now_ns: int) -> list[Action]:
        """``request`` was still queued at its ``queue_deadline_ns``: it times out without a slot."""
        first = first_deadline(request)
        reason = first[1] if first is not None else Reason.TOTAL_TIMEOUT
        return self._ended_in_queue(request, Outcome.TIMEOUT, reason, now_ns)

    def _ended_in_queue(self, request: Request, outcome: Outcome, reason: Reason, now_ns: int) -> list[Action]:
        return self.end(
            request,
            ending_before_start(
                outcome, reason, len(request.prompt_tokens), request.received_ns, request.cancel_requested_ns, now_ns
            ),
        )

    def end(self, request: Request, ending: Ending) -> list[Action]:
        """The one ending of ``request``: Ended, then its terminal frame (nothing if it already had one).

        Cancel frames not answered by the terminal frame itself (every one
        after the first, or all of them when another ending won the race) are
        answered here, after it, with a cancel_ack naming the outcome that won.
        """
        if request.ended:
            return []
        request.advance(Phase.ENDED)
        del self.live[request.id]
        self.quota.give_back(self.address)
        self._ended[request.id] = ending.outcome
        if len(self._ended) > self.limits.remembered_ids:
            self._ended.popitem(last=False)
        actions: list[Action] = [Ended(request, ending), Send(Terminal(request.id, ending, request.model or None))]
        acks = request.unanswered_cancels
        if request.cancel_reason is Reason.USER_CANCELLED and ending.outcome is not Outcome.CANCELLED:
            acks += 1
        actions += [Send(CancelAck.of(request.id, ending.outcome))] * acks
        return actions

    # Flood control ----------------------------------------------------------

    def _admit(self, now_ns: int, size: int) -> bool:
        lim = self.limits
        elapsed = (now_ns - self._tokens_at) / 1e9
        self._tokens_at = now_ns
        self._tokens = min(float(lim.frame_burst), self._tokens + elapsed * lim.frames_per_second)
        self._bytes = min(float(lim.byte_burst), self._bytes + elapsed * lim.bytes_per_second)
        if self._tokens < 1.0 or self._bytes < size:
            return False
        self._tokens -= 1.0
        self._bytes -= size
        return True

    def _rate_limited(self, now_ns: int) -> list[Action]:
        if not self._rate_limited_report.due(now_ns / 1e9):
            return []
        return [
            Send(
                ErrorFrame(
                    ErrorCode.RATE_LIMITED,
                    f"too many frames; the limits are {self.limits.frames_per_second:g} frames and "
                    f"{self.limits.bytes_per_second:g} bytes a second, excess frames are dropped",
                )
            )
        ]
