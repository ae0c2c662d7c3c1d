"""A model beyond the first --model: loaded on its first request, unloaded once idle for its keep_alive.

The first model is loaded at startup and stays loaded: it is what the WebSocket, a request that
names no model, and the server's readiness stand on. Every other model is a :class:`LazyModel`.
A request for it holds it (:meth:`LazyModel.hold`) from before its load until its answer is done,
so that a model is idle exactly when no request holds it; the keep_alive clock starts then.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .observability import log
from .protocol.requests import Limits
from .protocol.vocabulary import ChatFormat

if TYPE_CHECKING:
    from .engine.loop import Engine
    from .scheduler import Scheduler
    from .session import Services


@dataclass(frozen=True)
class Loader:
    """How to load a model that is served lazily, and the name it is served under unless
    --served-model-name gives another."""

    name: str
    load: Callable[[], Engine]


@dataclass(frozen=True)
class Running:
    """A loaded model: its engine, and its slots' scheduler and services, built by the server."""

    engine: Engine
    scheduler: Scheduler
    services: Services
    chat_format: ChatFormat


class LazyModel:
    """One model served under ``name``, loaded by ``load`` (in a thread) when a request first holds it.

    ``start`` builds the scheduler and services over a loaded engine; ``stop`` ends them (every
    generation has ended by then) and frees the native model. A load that fails is the failure of
    every request that waited for it; the next request tries again."""

    def __init__(
        self,
        name: str,
        load: Callable[[], Engine],
        start: Callable[[str, Engine], Running],
        stop: Callable[[Running], Awaitable[None]],
        keep_alive_s: float,
    ):
        self.name = name
        self._load = load
        self._start = start
        self._stop = stop
        # Seconds it stays loaded once idle: 0, unloaded as soon as idle; negative, never.
        self.keep_alive_s = keep_alive_s
        self.running: Running | None = None
        # The bounds of its requests, known once it has loaded: they stay the same across reloads.
        self.limits: Limits | None = None
        self.chat_format: ChatFormat | None = None
        # Requests holding it: from before their load to the end of their answer.
        self.holders = 0
        # When (time.time()) it unloads if no request holds it meanwhile; None: loaded for good, or not loaded.
        self.expires_at: float | None = None
        self._loading: asyncio.Task[Running] | None = None
        self._unloading: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None

    @property
    def loaded(self) -> bool:
        return self.running is not None

    def hold(self) -> None:
        """A request wants this model: it stays loaded (or is not unloaded) until :meth:`release`."""
        self.holders += 1
        self.expires_at = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def release(self) -> None:
        """A request is done with this model; the last one out starts its keep_alive."""
        self.holders -= 1
        if self.holders == 0:
            self._idle()

    async def ready(self) -> Services:
        """Its services, loading it first if need be (held: :meth:`hold`). Requests that arrive
        during a load share it; one that stops waiting (cancelled) leaves the load to go on, and
        a load nobody waits for any more ends with the model loaded and idle."""
        while self.running is None:
            if self._unloading is not None:
                await asyncio.shield(self._unloading)
                continue
            if self._loading is None:
                self._loading = asyncio.get_running_loop().create_task(self._load_now())
            await asyncio.shield(self._loading)
        return self.running.services

    async def _load_now(self) -> Running:
        started = time.monotonic()
        try:
            engine = await asyncio.to_thread(self._load)
            running = self._start(self.name, engine)
        except BaseException as exc:
            log.warning("model_load_failed", model=self.name, error=f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self._loading = None
        self.running = running
        self.limits = running.services.limits
        self.chat_format = running.chat_format
        log.info(
            "model_loaded",
            model=self.name,
            why="requested",
            load_ms=round((time.monotonic() - started) * 1000, 1),
            keep_alive_s=self.keep_alive_s,
        )
        if self.holders == 0:
            # Everyone who asked for it went away during the load.
            self._idle()
        return running

    def _idle(self) -> None:
        if self.running is None or self.keep_alive_s < 0:
            return
        loop = asyncio.get_running_loop()
        self.expires_at = time.time() + self.keep_alive_s
        self._timer = loop.call_later(self.keep_alive_s, self._expire)

    def _expire(self) -> None:
        self._timer = None
        if self.holders == 0 and self.running is not None and self._unloading is None:
            self._unloading = asyncio.get_running_loop().create_task(self.unload("keep_alive"))

    async def unload(self, why: str) -> None:
        """Free the model: its scheduler's slots, contexts and the native model. Unless the server is
        stopping, a request that has taken hold of it since the unload was decided keeps it loaded."""
        if why != "shutdown" and self.holders:
            if self._unloading is asyncio.current_task():
                self._unloading = None
            return
        running, self.running, self.expires_at = self.running, None, None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        try:
            if running is not None:
                await self._stop(running)
                log.info("model_unloaded", model=self.name, why=why, keep_alive_s=self.keep_alive_s)
        finally:
            if self._unloading is asyncio.current_task():
                self._unloading = None

    async def close(self) -> None:
        """The server is stopping: wait for a load under way, then unload."""
        if self._loading is not None:
            try:
                await asyncio.shield(self._loading)
            except Exception:
                pass
        if self._unloading is not None:
            await asyncio.shield(self._unloading)
        await self.unload("shutdown")
