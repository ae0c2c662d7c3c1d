"""What a session needs of the server for one model: the model's encoder, limits and scheduler,
and what every model shares (the registry, the metrics, the quotas, the keys). Below both the
sessions that use it and the residency that builds one for each model it loads."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Protocol

from .auth import Keyring
from .observability import Metrics
from .protocol.connection import AddressQuota
from .protocol.requests import Limits
from .protocol.vocabulary import Reason
from .quota import Quotas
from .registry import Registry
from .scheduler import Scheduler


class OpenSession(Protocol):
    """A session as a shutdown sees it: one that can stop everything it has started."""

    async def stop_all(self, reason: Reason, now_ns: int) -> None: ...


@dataclass
class Services:
    """What a session needs of the server, and nothing more: of one model's, when several are
    served (each has its own; they share everything but the model, its encoder, limits and scheduler)."""

    # The name the model is reported under, in the greeting, the end line and the metrics.
    model: str
    encode: Callable[[str | None, list | None], list[int]]
    limits: Limits
    scheduler: Scheduler
    registry: Registry
    metrics: Metrics
    quotas: Quotas
    keyring: Keyring
    address_quota: AddressQuota
    # Prompts are tokenized here: a lane for short prompts, and one for long ones.
    tokenizer_lanes: tuple[Executor, Executor]
    # How long a send may wait for a client that stopped reading before its request is cancelled.
    slow_consumer_grace_s: float
    # Every open session, so that a shutdown can stop what each has started.
    sessions: set[OpenSession] = field(default_factory=set)
