"""The asyncio service: WebSocket at /ws, the web client at /, /healthz and /metrics.
The HTTP API (/v1) is served from the same event loop by :mod:`stopline.http_api`.

This module owns the listening sockets, the slots and the shared state
(scheduler, registry, metrics, the optional Redis store) and the HTTP side of
the WebSocket port (the page, /healthz, /metrics), whose checks at the door
are :mod:`stopline.edge`'s, as the HTTP API's are.
Each WebSocket connection is a :class:`session.ClientSession` over a
:class:`session.WebSocketTransport`; the session hands its frames to
:class:`protocol.Connection` and carries out the actions returned, and sees
this server only through :class:`session.Services`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import mimetypes
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request as HTTPRequest
from websockets.http11 import Response
from websockets.typing import Subprotocol

from .api.openai_fields import ServedModels
from .auth import (
    SUBPROTOCOL,
    WWW_AUTHENTICATE,
    ApiKey,
    KeyFileError,
    Keyring,
    bearer,
    refusal_message,
    same_secret,
    subprotocol_key,
)
from .edge import Edge, host_rules, peer_name
from .embeddings_api import EmbeddingsApi
from .engine.loop import Engine, engine_memory_bytes
from .engine.prompt_cache import PromptCache
from .engine.tokenizer import load_chat_template
from .http_api import HttpApi
from .observability import Metrics, log
from .ollama_api import OllamaApi
from .protocol.connection import AddressQuota
from .protocol.frames import ErrorFrame, encode_frame
from .protocol.origin import LOOPBACK_NAMES
from .protocol.requests import Limits
from .protocol.vocabulary import ChatFormat, EngineName, ErrorCode, KeyEvent, ModelNames, Reason, Refusal
from .quota import Quotas
from .registry import Registry
from .residency import LazyModel, Loader, Residency, Running
from .responses_api import ResponsesApi
from .scheduler import Scheduler
from .services import OpenSession, Services
from .session import ClientSession, WebSocketTransport
from .settings import Settings, served_names

if TYPE_CHECKING:
    from .cluster import Cluster

WEB_ROOT = Path(__file__).resolve().parent / "web"


# The WebSocket close code for a missing or wrong key: 4000 + the HTTP status, as HTTP would answer.
CLOSE_UNAUTHORIZED = 4401


@dataclass(frozen=True)
class ServedModel:
    """One model of the server: its engine, its slots' scheduler, the names it answers to,
    and what a session that asks for it uses."""

    names: tuple[str, ...]
    engine: Engine
    scheduler: Scheduler
    limits: Limits
    services: Services
    # How a chat becomes this model's prompt.
    chat_format: ChatFormat

    @property
    def name(self) -> str:
        return self.names[0]


class StoplineServer:
    """The server, over ``engine`` and the ``others`` (several --model), each model with its own
    slots. ``engine`` is the first model: the one a request (an API body, a WebSocket generate
    frame) that names none runs on."""

    def __init__(self, engine: Engine, settings: Settings, others: Sequence[Engine | Loader] = ()):
        self.engine = engine
        self.settings = settings
        self.metrics = Metrics()
        # An engine given loaded is served as loaded for good; a Loader, only once asked for (LazyModel).
        lazy_others = [each for each in others if isinstance(each, Loader)]
        loaded_others = [each for each in others if not isinstance(each, Loader)]
        engines = [engine, *loaded_others]
        names = served_names(
            settings.served_model_names, [*(e.name for e in engines), *(each.name for each in lazy_others)]
        )
        lazy_names, names = names[len(engines) :], names[: len(engines)]
        # One prompt cache for the server, on the engines whose slots it fills (llama.cpp only); its
        # entries are keyed by model, so models never read one another's states.
        budget = settings.prompt_cache_bytes
        self.prompt_cache = (
            PromptCache(budget, disk_dir=settings.prompt_cache_path, disk_budget_bytes=settings.prompt_cache_disk_bytes)
            if budget and engine.kind is EngineName.LLAMA_CPP
            else None
        )
        for each in engines:
            each.prompt_cache = self.prompt_cache
        if self.prompt_cache is not None:
            self.metrics.add_prompt_cache_metrics(self.prompt_cache)
        schedulers = [
            Scheduler(
                each,
                settings.workers,
                settings.max_queue,
                window=settings.window,
                metrics=self.metrics.for_model(served[0]),
                threads=settings.threads,
                batching=settings.batching,
                prompt_steps=settings.prompt_steps,
            )
            for each, served in zip(engines, names, strict=True)
        ]
        self.scheduler = schedulers[0]
        self._eager_slots = sum(each.workers for each in schedulers)
        self.metrics.slots.set(self._eager_slots)
        self.metrics.set_abort_mode(engine.abort_mode)
        # The Host and Origin rules, and what clients are told to connect to (a wildcard address is not one).
        origin_policy, self.public_host = host_rules(settings.host, settings.allowed_origins, settings.allowed_hosts)
        self.limits = settings.limits_for(engine)
        self._server: Server  # set by start()
        self.address_quota = AddressQuota(settings.limits.requests_per_address)
        # WebSocket connections admitted by the handshake and not yet closed.
        self.websocket_connections = 0
        # Prompts are tokenized in worker threads, which release the GIL while they
        # work. Short prompts (milliseconds each) have a lane of their own, so they
        # never wait behind long ones; the long lane runs at a lower priority than
        # the token loops.
        self.tokenizer_lanes = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="stopline-tokenize-short"),
            ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="stopline-tokenize-long", initializer=_background_priority
            ),
        )
        self.registry = Registry()
        self.cluster: Cluster | None = None
        if settings.redis_url:
            from .cluster import Cluster

            self.cluster = Cluster(
                settings.redis_url,
                self.registry,
                self.metrics,
                status_ttl_s=settings.status_ttl_s,
                heartbeat_ttl_s=settings.heartbeat_ttl_s,
            )
            self.registry.listener = self.cluster
        # The names the models are served under, and whether a request may name any model: only
        # when one is served, for with several the name is what picks one.
        self.models = ServedModels(
            tuple(name for served in [*names, *lazy_names] for name in served),
            any_name=settings.model_names == ModelNames.ANY and len(engines) + len(lazy_others) == 1,
            chat_format=ChatFormat.of(engine.tokenizer.chat_template, settings.chat_template),
        )
        self.keyring = Keyring(settings.api_keys, settings.api_keys_file)
        self.quotas = Quotas(self.metrics, self.cluster)
        self.edge = Edge(origin_policy, self.metrics, socket_send_buffer=settings.socket_send_buffer)
        # What each client's session may use of this server: of the first model, and of each other.
        self.services = Services(
            model=self.models.primary,
            encode=_encoder(engine),
            limits=self.limits,
            scheduler=self.scheduler,
            registry=self.registry,
            metrics=self.metrics,
            quotas=self.quotas,
            keyring=self.keyring,
            address_quota=self.address_quota,
            tokenizer_lanes=self.tokenizer_lanes,
            slow_consumer_grace_s=settings.slow_consumer_grace_s,
        )
        self.served = [
            ServedModel(names[0], engine, self.scheduler, self.limits, self.services, self.models.chat_format)
        ]
        for each, served, scheduler in zip(loaded_others, names[1:], schedulers[1:], strict=True):
            limits = settings.limits_for(each)
            self.served.append(
                ServedModel(
                    served,
                    each,
                    scheduler,
                    limits,
                    replace(self.services, model=served[0], encode=_encoder(each), limits=limits, scheduler=scheduler),
                    ChatFormat.of(each.tokenizer.chat_template, settings.chat_template),
                )
            )
        # The models beyond the first given as Loaders: loaded when first asked for, unloaded once idle.
        self.lazy = [
            LazyModel(
                served[0], each.load, self._start_model, self._stop_model, settings.keep_alive_s, each.memory_bytes
            )
            for each, served in zip(lazy_others, lazy_names, strict=True)
        ]
        # With a memory budget, a model loads once it fits beside those in memory (residency.py).
        if settings.memory_budget_bytes:
            fixed = sum(engine_memory_bytes(each.engine, each.workers) for each in schedulers)
            residency = Residency(settings.memory_budget_bytes, fixed, self.lazy)
            for model in self.lazy:
                model.residency = residency
        self.http = HttpApi(
            self.services,
            settings,
            self.edge,
            self.cluster,
            self.models,
            {name: model.services for model in self.served for name in model.names},
            {name: model.chat_format for model in self.served for name in model.names},
            lazy={model.name: model for model in self.lazy},
        )
        # The other dialects build on the HTTP API's replies and routes.
        embeddings = None if settings.embedding_model == "none" else EmbeddingsApi(self.http, settings.embedding_model)
        self.http.app.add_routes([*ResponsesApi(self.http).routes(), *OllamaApi(self.http, embeddings).routes()])
        if embeddings is not None:
            self.http.app.add_routes(embeddings.routes())

    @property
    def sessions(self) -> set[OpenSession]:
        """Every open session: one a WebSocket connection, one an HTTP generation."""
        return self.services.sessions

    @property
    def active(self) -> int:
        """Generations running, on every model's slots."""
        return sum(scheduler.active for scheduler in self._schedulers())

    @property
    def queued(self) -> int:
        """Requests waiting for a slot, every model's."""
        return sum(scheduler.queue_depth for scheduler in self._schedulers())

    def _schedulers(self) -> list[Scheduler]:
        """Every loaded model's scheduler."""
        loaded = [model.running.scheduler for model in self.lazy if model.running is not None]
        return [model.scheduler for model in self.served] + loaded

    def _start_model(self, name: str, engine: Engine) -> Running:
        """The lazily served model ``name`` just loaded: its slots, and what a session that asks for it uses."""
        settings = self.settings
        if settings.chat_template is not None:
            engine.tokenizer = engine.tokenizer.with_chat_template(load_chat_template(settings.chat_template))
        if self.prompt_cache is not None and engine.kind is EngineName.LLAMA_CPP:
            engine.prompt_cache = self.prompt_cache
        scheduler = Scheduler(
            engine,
            settings.workers,
            settings.max_queue,
            window=settings.window,
            metrics=self.metrics.for_model(name),
            threads=settings.threads,
            batching=settings.batching,
            prompt_steps=settings.prompt_steps,
        )
        limits = settings.limits_for(engine)
        services = replace(self.services, model=name, encode=_encoder(engine), limits=limits, scheduler=scheduler)
        self.metrics.slots.set(self._eager_slots + self._lazy_slots() + scheduler.workers)
        chat_format = ChatFormat.of(engine.tokenizer.chat_template, settings.chat_template)
        if chat_format is ChatFormat.PLAIN_TEXT:
            _warn_no_chat_template(name)
        measured = engine_memory_bytes(engine, scheduler.workers) if settings.memory_budget_bytes else 0
        return Running(engine, scheduler, services, chat_format, measured)

    async def _stop_model(self, running: Running) -> None:
        """Unload a lazily served model: its slots end (no generation runs on them), then the native model."""
        engine = running.engine
        running.scheduler.close()
        await running.scheduler.shutdown(keep=engine.keep_in_prompt_cache if engine.prompt_cache else None)
        engine.prompt_cache = None
        await asyncio.to_thread(_free_engine, engine)
        self.metrics.slots.set(self._eager_slots + self._lazy_slots())

    def _lazy_slots(self) -> int:
        """The slots of the models beyond the first that are loaded now."""
        return sum(model.running.scheduler.workers for model in self.lazy if model.running is not None)

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        """The page's URL, as a client can use it."""
        return f"http://{self.public_host}:{self.port}/"

    async def start(self, sock: socket.socket | None = None, http_sock: socket.socket | None = None) -> None:
        """Listen on ``settings.host``/``settings.port`` and ``settings.http_port``, or on ``sock`` and
        ``http_sock`` if the caller has bound them already."""
        where = {"sock": sock} if sock is not None else {"host": self.settings.host, "port": self.settings.port}
        self._server = await serve(
            self._handle,
            **where,
            process_request=self._process_request,
            max_size=self.settings.max_frame_bytes,
            write_limit=self.settings.write_limit,
            server_header="Stopline",
            # websockets calls the class it is given; a factory binds this server to each connection.
            create_connection=self._create_connection,  # type: ignore[arg-type]
            # A browser sends its key as a second subprotocol (auth.BEARER_SUBPROTOCOL); only this one is echoed.
            select_subprotocol=_select_subprotocol,
            # The handshake deadline is enforced (and counted) by GuardedConnection; this is the backstop.
            open_timeout=self.settings.handshake_timeout_s + 5,
        )
        await self.http.start(
            self.settings.host, self.settings.http_port_or_default, sock=http_sock, public_host=self.public_host
        )
        self.http.websocket_url = f"ws://{self.public_host}:{self.port}/ws"
        if self.cluster is not None:
            await self.cluster.start(self.settings.replica_id or f"{socket.gethostname()}-{self.port}")
        self.quotas.start()
        if self.keyring.required:
            log.info(KeyEvent.LOADED, keys=len(self.keyring), file=self.settings.api_keys_file)
        elif self.settings.host not in LOOPBACK_NAMES:
            log.warning(
                KeyEvent.NONE_CONFIGURED,
                host=self.settings.host,
                detail="no API key is configured: anyone who can reach this port may generate "
                "(--api-key, --api-keys-file)",
            )
        for model in self.served:
            if model.chat_format is ChatFormat.PLAIN_TEXT:
                _warn_no_chat_template(model.name)
        # What was built to get here (the engine, the tokenizer, every module imported) lives as long
        # as the server. Frozen, it is left out of Python's full collections, which run on whichever
        # thread allocates when one falls due, holding the GIL, so that every stream and a stop read
        # meanwhile wait for them; docs/engine.md, "The stop a client sees", has the measurements.
        gc.freeze()
        log.info(
            "server_started",
            url=self.url,
            model=self.models.primary,
            chat_format=str(self.models.chat_format),
            engine=str(self.engine.kind),
            workers=self.scheduler.workers,
            batching=str(self.scheduler.batching),
            threads=self.engine.threads,
            context_length=self.engine.context_length,
            prefill_chunk=self.engine.prefill_chunk,
            abort_mode=str(self.engine.abort_mode),
            gpu=self.engine.gpu_device or "none",
            gpu_layers=self.engine.gpu_layers,
            http_api=self.http.base_url,
            **(
                {"models": [*(m.name for m in self.served), *(m.name for m in self.lazy)]}
                if len(self.served) + len(self.lazy) > 1
                else {}
            ),
        )

    async def shutdown(self) -> None:
        """Cancel every request with reason ``shutdown``, then close connections with 1001."""
        log.info("server_stopping", active=self.active, queued=self.queued)
        # Stop accepting connections, end every request (its terminal message goes
        # out on its still-open connection), then close connections with 1001.
        self._server.server.close()
        for scheduler in self._schedulers():
            scheduler.close()
        now = time.monotonic_ns()
        for session in list(self.sessions):
            await session.stop_all(Reason.SHUTDOWN, now)
        for model in self.served:
            engine = model.engine
            await model.scheduler.shutdown(keep=engine.keep_in_prompt_cache if self.prompt_cache else None)
            if engine.prompt_cache is self.prompt_cache:
                engine.prompt_cache = None
        for lazy in self.lazy:
            await lazy.close()
        if self.prompt_cache is not None:
            # What memory holds goes to disk on the cache's writer, waited for off the event loop.
            await asyncio.to_thread(self.prompt_cache.close)
        await self.quotas.close()
        if self.cluster is not None:
            await self.cluster.close()
        self._server.close(close_connections=True)
        await self._server.wait_closed()
        await self.http.close()
        for lane in self.tokenizer_lanes:
            await asyncio.get_running_loop().run_in_executor(None, lane.shutdown)
        gc.unfreeze()
        log.info("server_stopped")

    def reload_keys(self) -> None:
        """SIGHUP: read the keys file again. A key removed from it is refused from now on,
        on new connections and on the next request of an open one."""
        try:
            count = self.keyring.reload()
        except KeyFileError as exc:
            log.error(KeyEvent.RELOAD_FAILED, error=str(exc), keys=len(self.keyring))
            return
        log.info(KeyEvent.LOADED, keys=count, file=self.settings.api_keys_file)

    # HTTP ----------------------------------------------------------------------

    def _create_connection(self, *args, **kwargs) -> GuardedConnection:
        return GuardedConnection(self, *args, **kwargs)

    def _process_request(self, connection: ServerConnection, request: HTTPRequest) -> Response | None:
        path = urlsplit(request.path).path
        peer = peer_name(connection.remote_address)
        refused = self.edge.check(
            request.headers.get_all("Host"), request.headers.get_all("Origin") if path == "/ws" else None, peer
        )
        if refused is not None:
            return _response(refused.status, f"{refused.code}: {refused.message}\n".encode(), "text/plain")
        if path == "/ws":
            if self.websocket_connections >= self.settings.max_connections:
                self.edge.refused(Refusal.TOO_MANY_CONNECTIONS, peer)
                return _response(
                    HTTPStatus.SERVICE_UNAVAILABLE,
                    f"{Refusal.TOO_MANY_CONNECTIONS}: the server has its maximum of "
                    f"{self.settings.max_connections} connections\n".encode(),
                    "text/plain",
                )
            self.websocket_connections += 1
            assert isinstance(connection, GuardedConnection)
            connection.admitted = True
            if self.keyring.required:
                # The key from the Authorization header, or from the subprotocol a browser can set.
                authorization = request.headers.get("Authorization")
                presented = bearer(authorization) or subprotocol_key(request.headers.get_all("Sec-WebSocket-Protocol"))
                connection.api_key = self.keyring.lookup(presented)
                # Refused once it is a WebSocket, where a browser can read why.
                if connection.api_key is None:
                    connection.unauthorized = refusal_message(
                        authorization,
                        presented,
                        "send 'Authorization: Bearer <key>' with the handshake, "
                        f"or the subprotocols {SUBPROTOCOL!r} and '{SUBPROTOCOL}.bearer.<key>'",
                    )
            return None
        if path == "/healthz":
            body = json.dumps(
                {
                    "status": "ok",
                    "model": self.models.primary,
                    "chat_format": str(self.models.chat_format),
                    "engine": str(self.engine.kind),
                    "slots": sum(model.scheduler.workers for model in self.served),
                    "active": self.active,
                    "queued": self.queued,
                    "abort_mode": str(self.engine.abort_mode),
                    # The device the model's layers run on (None: the CPU), and how many do.
                    "gpu": self.engine.gpu_device,
                    "gpu_layers": self.engine.gpu_layers,
                    "http_api": self.http.base_url,
                    "store": self.cluster.health() if self.cluster is not None else {"type": "memory"},
                }
            )
            return _response(HTTPStatus.OK, body.encode(), "application/json")
        if path == "/metrics":
            key = self.settings.metrics_key
            if key is not None and not same_secret(bearer(request.headers.get("Authorization")), key):
                self.edge.unauthorized(peer, path)
                return _response(
                    HTTPStatus.UNAUTHORIZED,
                    f"{Refusal.UNAUTHORIZED}: /metrics needs its key as 'Authorization: Bearer <key>'\n".encode(),
                    "text/plain",
                    [("WWW-Authenticate", WWW_AUTHENTICATE)],
                )
            return _response(HTTPStatus.OK, self.metrics.render(), CONTENT_TYPE_LATEST)
        return _static(path)

    # WebSocket -------------------------------------------------------------------

    async def _handle(self, websocket: ServerConnection) -> None:
        self.edge.accepted(websocket.transport.get_extra_info("socket"))
        assert isinstance(websocket, GuardedConnection)
        if websocket.unauthorized:
            await self.edge.refuse_key(peer_name(websocket.remote_address), "/ws")
            with contextlib.suppress(ConnectionClosed):
                await websocket.send(encode_frame(ErrorFrame(ErrorCode.UNAUTHORIZED, websocket.unauthorized)))
                await websocket.close(CLOSE_UNAUTHORIZED, str(Refusal.UNAUTHORIZED))
            return
        transport = WebSocketTransport(websocket)
        # Each generate frame runs on the model it names, the first when it names none.
        session = ClientSession(
            self.services, transport, transport.address, key=websocket.api_key, catalog=self.http.catalog
        )
        self.sessions.add(session)
        self.metrics.connections.inc()
        try:
            await transport.run(session)
        finally:
            self.sessions.discard(session)
            self.metrics.connections.dec()


class GuardedConnection(ServerConnection):
    """A connection whose handshake has a byte budget and a deadline.

    websockets reads up to 128 header lines of 8 KiB each, and keeps what it
    has read for as long as the handshake lasts; both are cut short here.
    """

    def __init__(self, stopline: StoplineServer, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stopline = stopline
        self.admitted = False
        # The API key of the handshake; when a key was asked for and none of this server's came,
        # what the client is told about it (else None).
        self.api_key: ApiKey | None = None
        self.unauthorized: str | None = None
        self._refused = False
        self._handshake_bytes = 0
        self._handshake_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._handshake_timer = self.loop.call_later(
            self.stopline.settings.handshake_timeout_s, self._handshake_expired
        )

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # read and dropped, so that closing does not reset the connection before the answer is read
        if self.request is None:
            self._handshake_bytes += len(data)
            if self._handshake_bytes > self.stopline.settings.max_header_bytes:
                self._refuse(
                    HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                    Refusal.HEADERS_TOO_LARGE,
                    f"the handshake may carry at most {self.stopline.settings.max_header_bytes} bytes",
                )
                return
        super().data_received(data)
        if self.request is not None and self._handshake_timer is not None:
            self._handshake_timer.cancel()
            self._handshake_timer = None

    def connection_lost(self, exc) -> None:
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
        if self.admitted:
            self.admitted = False
            self.stopline.websocket_connections -= 1
        super().connection_lost(exc)

    def _handshake_expired(self) -> None:
        self._handshake_timer = None
        if self.request is None and not self.transport.is_closing():
            self._refuse(
                HTTPStatus.REQUEST_TIMEOUT,
                Refusal.HANDSHAKE_TIMEOUT,
                f"the handshake did not complete within {self.stopline.settings.handshake_timeout_s:g} s",
            )

    def _refuse(self, status: HTTPStatus, code: Refusal, message: str) -> None:
        self.stopline.edge.refused(code, peer_name(self.remote_address))
        body = f"{code}: {message}\n".encode()
        self._refused = True
        self.transport.write(
            f"HTTP/1.1 {status.value} {status.phrase}\r\nContent-Type: text/plain\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        # Half-close, and keep reading for a moment: closing a socket with unread
        # data resets it, and the client would never see the answer.
        self.transport.write_eof()
        self.loop.call_later(1.0, self.transport.close)


def _warn_no_chat_template(model: str) -> None:
    """Said of each model without a chat template: at startup, or as it loads when first asked for."""
    log.warning(
        "no_chat_template",
        model=model,
        chat_format=str(ChatFormat.PLAIN_TEXT),
        detail="the model file has no chat template (a base model): a chat is completed as the plain "
        "text of its messages; --chat-template chatml, or a template file, gives it one",
    )


def _free_engine(engine: Engine) -> None:
    """Close what an unloaded engine holds natively (its slots are closed already): its probe slot, if
    it never became one, and the model itself, so that its memory returns now rather than whenever
    the garbage collector gets to it."""
    probe = getattr(engine, "_probe", None)
    if probe is not None:
        probe.close()
        engine._probe = None  # type: ignore[attr-defined]
    model = getattr(engine, "model", None)
    if model is not None and hasattr(model, "close"):
        model.close()


def _encoder(engine: Engine) -> Callable[[str | None, list | None], list[int]]:
    return lambda prompt, messages: engine.encode(prompt=prompt, messages=messages)


def _select_subprotocol(_: ServerConnection, offered: Sequence[Subprotocol]) -> Subprotocol | None:
    return Subprotocol(SUBPROTOCOL) if SUBPROTOCOL in offered else None


def _background_priority() -> None:
    # Linux applies a nice value to the calling thread alone: ten steps below the
    # token loops gives it about a tenth of their share of a contended core.
    try:
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + 10))
    except (AttributeError, OSError):
        pass


def _response(status: HTTPStatus, body: bytes, content_type: str, extra_headers=()) -> Response:
    headers = Headers(
        [
            ("Content-Type", content_type),
            ("Content-Length", str(len(body))),
            ("Cache-Control", "no-store"),
            ("X-Content-Type-Options", "nosniff"),
            *extra_headers,
        ]
    )
    return Response(status.value, status.phrase, headers, body)


# The page renders model output: nothing inline, nothing from elsewhere may run or load.
PAGE_SECURITY_POLICY = (
    "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'"
)


def _static(path: str) -> Response:
    name = "index.html" if path == "/" else path.lstrip("/")
    # Serve only files that sit directly in web/ or web/vendor/: no traversal, no other directories.
    target = WEB_ROOT / name
    folder, _, leaf = name.rpartition("/")
    if folder not in ("", "vendor") or not leaf or leaf.startswith(".") or not target.is_file():
        return _response(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")
    content_type = mimetypes.guess_type(name)[0] or "application/octet-stream"
    if content_type.startswith("text/") or content_type.endswith("javascript"):
        content_type += "; charset=utf-8"
    extra = [("Content-Security-Policy", PAGE_SECURITY_POLICY)] if name.endswith(".html") else []
    return _response(HTTPStatus.OK, target.read_bytes(), content_type, extra)
