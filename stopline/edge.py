"""The door of both servers: what is decided about a request before it reaches the protocol.

Stopline listens with two HTTP stacks on one event loop. websockets serves the
WebSocket port (``/ws``, and beside it the page, ``/healthz`` and ``/metrics``),
because its connection is the design's: a send waits on the socket's
``write_limit``, which is the backpressure that turns a client that stops
reading into a ``slow_consumer`` stop. aiohttp serves ``/v1``: routing, SSE,
and a handler cancelled the moment its connection is lost, which is how a
closed HTTP stream stops its generation. Serving the WebSocket from aiohttp too
would trade that send path for aiohttp's, so both stay, and each keeps only its
own wire format; every rule they share is here, written once:

- the Host and Origin rules, and a refusal counted and logged under its code;
- a missing or wrong API key, counted and logged at most once a second, and
  answered only after :data:`~stopline.auth.FAILURE_DELAY_S`;
- the send buffer of an accepted socket;
- how a peer is named in the logs;
- which host names are this server's, and which one its clients are told to use.
"""

from __future__ import annotations

import asyncio
import socket
import time

from .auth import FAILURE_DELAY_S
from .observability import Metrics, log
from .protocol.origin import WILDCARD_HOSTS, HeaderValue, OriginPolicy, Refused, advertised_host, check_request
from .protocol.throttle import Throttle
from .protocol.vocabulary import KeyEvent, Refusal


def host_rules(host: str, allowed_origins: tuple[str, ...], allowed_hosts: tuple[str, ...]) -> tuple[OriginPolicy, str]:
    """The Host and Origin rules of a server listening on ``host``, and the host its clients
    are told to use. A server on every interface answers to the machine's own names too."""
    own_names = _own_names() if host in WILDCARD_HOSTS else ()
    policy = OriginPolicy.build(host, allowed_origins, allowed_hosts, own_names)
    return policy, advertised_host(host, _reachable_own_name)


def peer_name(address: tuple | None) -> str:
    """A peer as the logs name it: ``host:port`` of its socket address."""
    return f"{address[0]}:{address[1]}" if address else "unknown"


class Edge:
    def __init__(self, origin_policy: OriginPolicy, metrics: Metrics, *, socket_send_buffer: int):
        self.origin_policy = origin_policy
        self.metrics = metrics
        self.socket_send_buffer = socket_send_buffer
        self._unauthorized = 0
        self._unauthorized_log = Throttle()

    def check(self, host: HeaderValue, origin: HeaderValue, peer: str) -> Refused | None:
        """None if a request with these Host and Origin headers may proceed (``origin=None``: a
        request that needs no Origin check), else why not, counted and logged."""
        refused = check_request(host, origin, self.origin_policy)
        if refused is not None:
            # Header values are the client's; a few of them are logged, shortened.
            self.refused(refused.code, peer, host=_shown(host), origin=_shown(origin))
        return refused

    def refused(self, code: Refusal, peer: str, **details) -> None:
        """Count and log a request refused at the door."""
        self.metrics.refused.labels(str(code)).inc()
        log.warning("request_refused", code=str(code), peer=peer, **details)

    def unauthorized(self, peer: str, where: str) -> None:
        """Count a request or connection refused for its key, and log it at most once a second."""
        self.metrics.refused.labels(str(Refusal.UNAUTHORIZED)).inc()
        self._unauthorized += 1
        if self._unauthorized_log.due(time.monotonic()):
            log.warning(KeyEvent.REFUSED, peer=peer, where=where, refused_total=self._unauthorized)

    async def refuse_key(self, peer: str, where: str) -> None:
        """:meth:`unauthorized`, then the wait before the answer, which makes guessing keys slow."""
        self.unauthorized(peer, where)
        await asyncio.sleep(FAILURE_DELAY_S)

    def accepted(self, sock: socket.socket | None) -> None:
        """Size the send buffer of a socket that will stream tokens (``--socket-send-buffer``): a
        smaller one makes a client that stops reading show up as a stalled send sooner."""
        if sock is not None and self.socket_send_buffer:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.socket_send_buffer)


def _shown(header: HeaderValue) -> str | list[str] | None:
    return header if header is None or isinstance(header, str) else list(header[:2])


def _own_names() -> list[str]:
    """The machine's host names: its short name and its fully qualified one."""
    name = socket.gethostname()
    return [name, name.split(".")[0], socket.getfqdn()]


# Documentation addresses (RFC 5737, RFC 3849): routed like any other address, never reached.
_ROUTE_PROBES = {socket.AF_INET: "192.0.2.1", socket.AF_INET6: "2001:db8::1"}


def _reachable_own_name(wildcard: str) -> str:
    """How clients can reach a server listening on ``wildcard`` (0.0.0.0 or ::): the
    machine's host name if every address it resolves to is this machine's, else the
    address of the interface its outbound route leaves by, else loopback. A name that
    does not resolve, or resolves elsewhere, would advertise a URL nobody can open."""
    family = socket.AF_INET6 if ":" in wildcard else socket.AF_INET
    name = socket.gethostname()
    if _resolves_here(name, family):
        return name
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            # Connecting a UDP socket picks the route and its source address; it sends nothing.
            probe.connect((_ROUTE_PROBES[family], 9))
            return probe.getsockname()[0]
        except OSError:
            return "::1" if family == socket.AF_INET6 else "127.0.0.1"


def _resolves_here(name: str, family: socket.AddressFamily) -> bool:
    """Whether ``name`` resolves, and only to addresses of this machine (the ones a socket can bind)."""
    try:
        addresses = {info[4] for info in socket.getaddrinfo(name, 0, family, socket.SOCK_DGRAM)}
    except (OSError, UnicodeError):  # socket.gaierror is an OSError
        return False
    for address in addresses:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.bind(address)
            except OSError:
                return False
    return bool(addresses)
