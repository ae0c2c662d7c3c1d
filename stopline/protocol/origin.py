"""Which Host and Origin headers may reach the service.

Two attacks are refused here, for every HTTP face of the service:

- **DNS rebinding.** A page on ``evil.example`` makes its own name resolve to
  127.0.0.1; the browser then treats the local server as ``evil.example`` and
  sends ``Host: evil.example:PORT`` (and an Origin to match). Only requests
  whose Host names this server are answered, as development servers such as
  Vite and webpack-dev-server do.
- **Cross-site WebSocket hijacking.** Browsers let any page open a WebSocket
  to any address, telling the server only the page's Origin. An Origin is
  accepted when it is the same origin as the request (same host *and* port),
  or listed with ``--allowed-origins``.

:func:`check_request` is the single entry point; it does no I/O.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import urlsplit

from .vocabulary import Refusal

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
# Addresses that listen on every interface.
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::"})
_DEFAULT_PORTS = {"http": 80, "https": 443}
_HOST_HEADER = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(:[0-9]{1,5})?")

HeaderValue = str | Sequence[str] | None


@dataclass(frozen=True)
class Refused:
    """Why a request was refused, as an HTTP status and a stable code."""

    status: HTTPStatus
    code: Refusal
    message: str


@dataclass(frozen=True)
class OriginPolicy:
    bind_host: str
    # Normalized ``scheme://host:port`` values from --allowed-origins.
    allowed_origins: frozenset[str] = frozenset()
    any_origin: bool = False
    # Extra names the server answers to (a LAN name when bound to 0.0.0.0, a proxy's name).
    allowed_hosts: frozenset[str] = frozenset()
    # The machine's own names, answered to when listening on every interface.
    own_names: frozenset[str] = frozenset()

    @classmethod
    def build(
        cls,
        bind_host: str,
        allowed_origins: Sequence[str] = (),
        allowed_hosts: Sequence[str] = (),
        own_names: Sequence[str] = (),
    ) -> OriginPolicy:
        """Validate the settings; raises ValueError naming the first bad entry."""
        origins = set()
        for entry in allowed_origins:
            if entry != "*":
                origins.add(normalize_origin(entry))
        hosts = set()
        for entry in allowed_hosts:
            name = _normal_host(entry)
            if not (re.fullmatch(r"[a-z0-9._-]+", name) or _is_ip(name)):
                raise ValueError(f"{entry!r} is not a host name (give it without scheme or port)")
            hosts.add(name)
        return cls(
            _normal_host(bind_host),
            frozenset(origins),
            "*" in allowed_origins,
            frozenset(hosts),
            frozenset(_normal_host(name) for name in own_names if name),
        )

    def serves(self, hostname: str) -> bool:
        """Whether ``hostname`` (from a Host header) names this server."""
        if hostname in self.allowed_hosts or hostname == self.bind_host:
            return True
        if hostname in LOOPBACK_NAMES:
            return self.bind_host in LOOPBACK_NAMES or self.bind_host in WILDCARD_HOSTS
        # Bound to every interface, the server answers to any of its addresses and to the
        # machine's own names: a bare IP address cannot be rebound, and the machine's
        # names are not an attacker's to point elsewhere.
        return self.bind_host in WILDCARD_HOSTS and (_is_ip(hostname) or hostname in self.own_names)


def check_request(host_header: HeaderValue, origin_header: HeaderValue, policy: OriginPolicy) -> Refused | None:
    """None if the request may proceed, else why not.

    Pass each header as its one value, as None when absent, or as the list of
    all its values (a header sent twice is refused). Pass ``origin_header=None``
    for requests that need no Origin check.
    """
    host_value = _single("Host", host_header)
    if isinstance(host_value, Refused):
        return host_value
    if host_value is None:
        return Refused(HTTPStatus.BAD_REQUEST, Refusal.INVALID_HEADER, "a Host header is required")
    host = _parse_host(host_value)
    if host is None:
        return Refused(HTTPStatus.BAD_REQUEST, Refusal.INVALID_HEADER, "the Host header is malformed")
    if not policy.serves(host[0]):
        return Refused(
            HTTPStatus.FORBIDDEN,
            Refusal.HOST_NOT_ALLOWED,
            f"this server does not answer to the host {host[0]!r}; to allow it, start the server with "
            f"--allowed-hosts {host[0]}",
        )
    origin_value = _single("Origin", origin_header)
    if isinstance(origin_value, Refused):
        return origin_value
    if origin_value is None or policy.any_origin:
        return None  # not a browser, or every origin is allowed
    try:
        origin = normalize_origin(origin_value)
    except ValueError:
        return Refused(HTTPStatus.FORBIDDEN, Refusal.ORIGIN_NOT_ALLOWED, "origin not allowed")
    if origin in policy.allowed_origins:
        return None
    parts = urlsplit(origin)
    same_host = parts.hostname == host[0] or (parts.hostname in LOOPBACK_NAMES and host[0] in LOOPBACK_NAMES)
    if same_host and parts.port == host[1]:
        return None
    return Refused(HTTPStatus.FORBIDDEN, Refusal.ORIGIN_NOT_ALLOWED, "origin not allowed")


def advertised_host(bind_host: str, own_name: Callable[[str], str]) -> str:
    """The host to put in a URL for clients: a wildcard address is no address to
    connect to, so the machine's own name or address, ``own_name(bind_host)``,
    stands for it (asked only then: finding it may take a name lookup)."""
    host = own_name(bind_host) if bind_host in WILDCARD_HOSTS else bind_host
    return f"[{host}]" if ":" in host else host


def normalize_origin(value: str) -> str:
    """``scheme://host:port`` with the port made explicit; ValueError unless ``value`` is an origin."""
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        raise ValueError(f"{value!r} is not an origin: give scheme://host[:port]") from None
    if (
        parts.scheme not in _DEFAULT_PORTS
        or not parts.hostname
        or parts.username is not None
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
        or "[" in parts.hostname
    ):
        raise ValueError(f"{value!r} is not an origin: give scheme://host[:port], e.g. https://example.com")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}:{port or _DEFAULT_PORTS[parts.scheme]}"


def _single(name: str, value: HeaderValue) -> str | None | Refused:
    if value is None or isinstance(value, str):
        return value
    values = list(value)
    if len(values) > 1:
        return Refused(HTTPStatus.BAD_REQUEST, Refusal.INVALID_HEADER, f"the {name} header was sent more than once")
    return values[0] if values else None


def _parse_host(value: str) -> tuple[str, int] | None:
    match = _HOST_HEADER.fullmatch(value.strip())
    if match is None:
        return None
    port = int(match.group(2)[1:]) if match.group(2) else 80
    if not 0 < port < 65536:
        return None
    return _normal_host(match.group(1)), port


def _normal_host(name: str) -> str:
    name = name.strip().lower()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    return name[:-1] if name.endswith(".") else name


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True
