"""A model beyond the first --model: loaded on its first request, unloaded once idle for its keep_alive.

The first model is loaded at startup and stays loaded: it is what a request that names no model
(an API body, a WebSocket generate frame) and the server's readiness stand on. Every other model
is a :class:`LazyModel`. A request for it holds it (:meth:`LazyModel.hold`) from before its load
until its answer is done, so that a model is idle exactly when no request holds it; the keep_alive
clock starts then.

With a memory budget (--memory-budget), :class:`Residency` decides each load: a model loads once
the models in memory and it fit the budget, idle models unloading to make room, the least recently
used first. A held model is never unloaded for room; when the idle ones are not enough, the load
is refused with :class:`InsufficientMemory`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .observability import log
from .protocol.errors import InsufficientMemory
from .protocol.requests import Limits
from .protocol.vocabulary import ChatFormat
from .settings import MIB

if TYPE_CHECKING:
    from .api.openai_fields import ServedModels
    from .engine.loop import Engine
    from .scheduler import Scheduler
    from .services import Services


@dataclass(frozen=True)
class Loader:
    """How to load a model that is served lazily, and the name it is served under unless
    --served-model-name gives another."""

    name: str
    load: Callable[[], Engine]
    # What it takes in memory once loaded, estimated before its load (engine.loop.file_memory_bytes);
    # None: unknown, counted as nothing until it has loaded.
    memory_bytes: int | None = None


@dataclass(frozen=True)
class Running:
    """A loaded model: its engine, and its slots' scheduler and services, built by the server."""

    engine: Engine
    scheduler: Scheduler
    services: Services
    chat_format: ChatFormat
    # What it takes in memory (engine.loop.engine_memory_bytes); 0: not measured.
    memory_bytes: int = 0


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
        memory_bytes: int | None = None,
        residency: Residency | None = None,
    ):
        self.name = name
        self._load = load
        # What it takes in memory: estimated before its first load, measured (start's) once loaded.
        self.memory_bytes = memory_bytes or 0
        # Who decides whether it may load (a memory budget), if anyone does.
        self.residency = residency
        # When a request last held or released it (time.monotonic()): the least recently used
        # idle model is the first to unload for room.
        self.last_used = 0.0
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
        self.last_used = time.monotonic()
        self.expires_at = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def release(self) -> None:
        """A request is done with this model; the last one out starts its keep_alive."""
        self.holders -= 1
        self.last_used = time.monotonic()
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
                if self.residency is not None:
                    # Room is made (idle models unloaded) or refused before the load starts.
                    await self.residency.admit(self)
                    continue
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
        self.memory_bytes = running.memory_bytes or self.memory_bytes
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

    def start_load(self) -> None:
        """Start its load (the residency has made room for it)."""
        if self._loading is None and self.running is None:
            self._loading = asyncio.get_running_loop().create_task(self._load_now())

    @property
    def resident(self) -> bool:
        """In memory, or on its way in or out of it."""
        return self.running is not None or self._loading is not None or self._unloading is not None

    async def unloaded(self) -> None:
        """Wait for an unload under way, if one is."""
        if self._unloading is not None:
            await asyncio.shield(self._unloading)

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


class Residency:
    """Which models may be in memory together: those whose ``memory_bytes`` fit ``budget_bytes``,
    beside ``fixed_bytes`` of models loaded for good (the first --model's)."""

    def __init__(self, budget_bytes: int, fixed_bytes: int, models: list[LazyModel]):
        self.budget_bytes = budget_bytes
        self.fixed_bytes = fixed_bytes
        self.models = models
        # One decision at a time: two loads never count the same room.
        self._deciding = asyncio.Lock()

    def in_use(self, besides: LazyModel) -> int:
        return self.fixed_bytes + sum(m.memory_bytes for m in self.models if m is not besides and m.resident)

    async def admit(self, model: LazyModel) -> None:
        """Start ``model``'s load once it fits: idle models unload for it, the least recently used
        first. Raises InsufficientMemory when even then it does not fit."""
        async with self._deciding:
            if model.resident:
                # Another request's admission started it meanwhile.
                return
            while self.in_use(model) + model.memory_bytes > self.budget_bytes:
                leaving = [m for m in self.models if m is not model and m.resident and m.running is None]
                if leaving:
                    # Unloads under way free their room: wait for them before unloading another.
                    await asyncio.gather(*(m.unloaded() for m in leaving))
                    continue
                idle = [m for m in self.models if m is not model and m.running is not None and m.holders == 0]
                if not idle:
                    raise InsufficientMemory(self._refusal(model))
                await min(idle, key=lambda m: m.last_used).unload("memory_budget")
            model.start_load()

    def _refusal(self, model: LazyModel) -> str:
        busy = [m.name for m in self.models if m is not model and m.resident]
        held = f"; {', '.join(busy)} {'is' if len(busy) == 1 else 'are'} serving requests" if busy else ""
        free = max(self.budget_bytes - self.in_use(model), 0)
        return (
            f"model {model.name!r} needs {model.memory_bytes / MIB:.0f} MiB and the memory budget "
            f"(--memory-budget {self.budget_bytes / MIB:.0f}) has {free / MIB:.0f} MiB free{held}; "
            "try again once they are done"
        )


class Catalog:
    """Every model of the server by the names it is served under: what a request that names one
    runs on, whichever way it came (an API's ``model``, a WebSocket generate frame's)."""

    def __init__(
        self,
        first: Services,
        models: ServedModels,
        by_name: Mapping[str, Services] | None = None,
        lazy: Mapping[str, LazyModel] | None = None,
    ):
        # The first model's services; by_name, each served name's model's (several --model).
        self.first = first
        self.models = models
        self.by_name = dict(by_name or {})
        # The models loaded when first asked for, by name.
        self.lazy = dict(lazy or {})

    @property
    def names(self) -> tuple[str, ...]:
        return self.models.names

    def services_for(self, requested: object) -> Services:
        """The services of the model a request names (Ollama's ``NAME:latest`` is ``NAME``); the
        first model's for no name, or a name none is served under, which the request's own
        checks then answer (404 model_not_found, unless one model answers to any name). A model
        loaded when asked for has its services once loaded; until then, its bounds are the first
        model's, with the prompt checked against its own context once it is."""
        if isinstance(requested, str):
            found = self.by_name.get(requested) or self.by_name.get(requested.removesuffix(":latest"))
            if found is not None:
                return found
            lazy = self.lazy_for(requested)
            if lazy is not None:
                if lazy.running is not None:
                    return lazy.running.services
                if lazy.limits is not None:
                    return replace(self.first, model=lazy.name, limits=lazy.limits)
        return self.first

    def lazy_for(self, requested: object) -> LazyModel | None:
        """The model loaded when first asked for that ``requested`` names, if it names one."""
        if not isinstance(requested, str):
            return None
        return self.lazy.get(requested) or self.lazy.get(requested.removesuffix(":latest"))

    def limits_of(self, requested: str) -> Limits | None:
        """The bounds of a request for the model ``requested`` names, as the HTTP APIs check a
        body's; None when no model answers to that name (model_not_found)."""
        if self.models.answering(requested) is None:
            return None
        return self.services_for(requested).limits
