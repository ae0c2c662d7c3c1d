"""What the benchmark asks of a server it measures, whichever server it is.

A :class:`Driver` starts its server (or attaches to a running one), hands out
:class:`Lane` s (a client's connection, or a slot the server keeps for it), and
says which scenarios it can take part in. A lane sends a :class:`Request` and
returns a :class:`Stream`: its token times as they arrive, a cancel, a dropped
connection, and its :class:`End`, what the client and the server saw of it.
The scenarios (``bench/scenarios.py``) are written once over these classes.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from stopline.protocol.requests import DEFAULT_SAMPLING

# What a driver can do beyond streaming a generation, stopping it and dropping its connection.
QUEUE = "queue"  # an accepted frame with the request's queue position
DEADLINES = "deadlines"  # the server's own total and first-token deadlines
OPENAI = "openai"  # an OpenAI-compatible chat stream
DELETE = "delete"  # a generation over SSE, cancelled by a DELETE from another client
NONSTREAM = "nonstream"  # a request answered whole, at its end
# A lane whose requests go to the slot the server picks (llama-server's pick by prompt similarity),
# not to one slot of the lane's own; Stopline always picks its slots.
ANY_SLOT = "any_slot"


@dataclass
class Request:
    messages: list[dict]
    max_tokens: int
    seed: int
    temperature: float = DEFAULT_SAMPLING.temperature
    timeout_s: float | None = None
    ttft_timeout_s: float | None = None
    stream: bool = True
    # Keep the previous turn of a chat in the lane's cache; any other prompt is evaluated whole.
    cache_prompt: bool = False


@dataclass
class End:
    """How a request ended. ``stop_ns`` is when the client saw it end; every other figure is the server's."""

    outcome: str
    reason: str | None
    stop_ns: int
    tokens_generated: int | None = None
    tokens_after_cancel: int | None = None
    # Cancel read -> the token loop exited, where the server reports it.
    server_ms: float | None = None
    prompt_tokens: int | None = None
    prompt_tokens_reused: int = 0
    ttft_server_ms: float | None = None
    duration_ms: float | None = None
    step_ms: float | None = None  # decode time per token
    decode_tokens_per_s_server: float | None = None
    prompt_tokens_per_s_server: float | None = None
    # What only one kind of server says of its stops, kept in the sample as it is.
    extra: dict = field(default_factory=dict)


class Stream(ABC):
    """One request, its events stamped with ``time.monotonic_ns()`` as they arrive."""

    def __init__(self, request: Request):
        self.request = request
        self.id: str | None = None
        self.sent_ns = 0
        self.accepted: dict | None = None
        self.accepted_ns = 0
        self.tokens: list[tuple[int, str]] = []
        self.end: End | None = None
        self.closed = False  # the connection is gone, whatever its end
        self._changed = asyncio.Event()

    def _token(self, now_ns: int, text: str) -> None:
        self.tokens.append((now_ns, text))
        self._changed.set()

    def _finish(self, end: End) -> None:
        self.end = end
        self._changed.set()

    def _close(self) -> None:
        """The connection is gone: whoever waits on this stream stops waiting."""
        self.closed = True
        self._changed.set()

    @property
    def ended(self) -> bool:
        return self.end is not None or self.closed

    @property
    def text(self) -> str:
        return "".join(text for _, text in self.tokens)

    async def wait_for(self, predicate, timeout: float = 300.0) -> None:
        """Until ``predicate(self)`` holds or the request has ended."""
        async with asyncio.timeout(timeout):
            while not (predicate(self) or self.ended):
                self._changed.clear()
                await self._changed.wait()

    async def wait_tokens(self, count: int) -> None:
        await self.wait_for(lambda s: len(s.tokens) >= count)

    async def wait_accepted(self) -> None:
        await self.wait_for(lambda s: s.accepted is not None, 60)

    async def wait_end(self) -> End | None:
        await self.wait_for(lambda s: False)
        return self.end

    @abstractmethod
    async def cancel(self) -> int:
        """Ask the server to stop it, as its clients do (a cancel, a DELETE, a closed stream); when, in ns."""

    @abstractmethod
    def drop(self) -> int:
        """Drop the connection without a word, as a vanished client does; when, in ns."""

    @abstractmethod
    async def stopped(self, others: int = 0) -> End:
        """Its end after a cancel or a drop, as soon as the client can know it (``others``: the
        generations of other clients still running then)."""


class Lane(ABC):
    """A client's connection to the server, or a slot of its own: requests on one lane run one at a time."""

    @abstractmethod
    async def generate(self, request: Request) -> Stream: ...

    async def close(self) -> None:
        return None

    async def __aenter__(self) -> Lane:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()


class Driver(ABC):
    """A server under measurement, and what the benchmark learns about it on the way."""

    capabilities: frozenset[str] = frozenset()

    def __init__(self, name: str, slots: int):
        self.name = name
        self.slots = slots
        # What the report shows of the server: threads, prompt chunk, its command line.
        self.info: dict = {}
        self.pid: int | None = None
        # Calibration: prefill time (ms) by prompt length in tokens, and the decode step (ms).
        self.prefill_ms: dict[int, float] = {}
        self.step_ms = 15.0
        # (scenario, start ns, end ns): when each scenario ran against this server.
        self.windows: list[tuple[str, int, int]] = []

    def supports(self, needs: frozenset[str]) -> bool:
        return needs <= self.capabilities

    @abstractmethod
    async def lane(self, index: int = 0, transport: str = "") -> Lane:
        """A lane; ``index`` tells lanes used at once apart, ``transport`` names one of the capabilities."""

    @abstractmethod
    async def wait_idle(self) -> None:
        """Until no generation runs or waits."""

    async def metrics(self) -> dict[str, float] | None:
        """The server's counters, where it keeps them."""
        return None

    async def start(self) -> Driver:
        return self

    async def stop(self) -> None:
        return None

    def pause(self, paused: bool) -> None:
        """Stop (SIGSTOP) or continue a server the benchmark started, while another is measured."""
        return None

    def request_log(self) -> dict[str, dict]:
        """What the server logged at each request's end, by request id."""
        return {}

    def lag_samples(self) -> list[tuple[int, int]]:
        """(start ns, overshoot ns) of the server's event-loop probe, where it has one."""
        return []
