"""API keys: who may generate, as whom, and with which quota (docs/http.md#api-keys).

Keys come from ``--api-key`` (repeatable), ``STOPLINE_API_KEYS`` (comma-separated)
and ``--api-keys-file``, a JSON Lines file with one entry per key::

    {"id": "alice-3f2a", "user": "alice", "sha256": "<hex>", "created_at": "…",
     "limits": {"concurrent": 2, "requests_per_minute": 60, "tokens_per_minute": 20000, "max_prompt_tokens": 1500}}

The file holds only each key's SHA-256: a key is printed once, by
``stopline keys add``, and never stored, logged or echoed. Keys are random
(256 bits), so a plain SHA-256 is as good as a slow hash for them. A
presented key is hashed, and its digest compared in constant time.

No I/O beyond reading and appending the keys file; the server wires it in.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import os
import re
import secrets
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .protocol.errors import StoplineError
from .protocol.requests import MAX_PRIORITY
from .protocol.vocabulary import QuotaLimit

# Generated keys carry a prefix that secret scanners and people recognise.
KEY_PREFIX = "stopline_"
# A key must be usable as an HTTP header value and as a WebSocket subprotocol token.
KEY_PATTERN = re.compile(r"[A-Za-z0-9._~+-]{16,256}")
KEY_ID_PATTERN = re.compile(r"[A-Za-z0-9._@-]{1,64}")
USER_PATTERN = re.compile(r"[^\x00-\x1f\x7f]{1,256}")
# The subprotocols of a browser's WebSocket: the server selects SUBPROTOCOL, and reads the key
# from the other one, so the key is never echoed in the handshake's answer.
SUBPROTOCOL = "stopline"
BEARER_SUBPROTOCOL = "stopline.bearer."
# The challenge of every 401.
WWW_AUTHENTICATE = 'Bearer realm="stopline"'
# A refusal for a missing or wrong key is answered this much later: one connection can then try at most
# 20 keys a second, and a flood of wrong keys is spread out instead of taking the event loop in one burst.
FAILURE_DELAY_S = 0.05


class KeyFileError(StoplineError):
    """The keys file cannot be read, or an entry in it is invalid."""


@dataclass(frozen=True)
class Quota:
    """A key's limits; None: no limit of that kind."""

    concurrent: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_prompt_tokens: int | None = None

    @property
    def limited(self) -> bool:
        """Whether admitting a request needs any counting (the prompt limit needs none)."""
        return any(v is not None for v in (self.concurrent, self.requests_per_minute, self.tokens_per_minute))

    def as_dict(self) -> dict:
        return {str(limit): getattr(self, limit) for limit in QuotaLimit if getattr(self, limit) is not None}


@dataclass(frozen=True)
class ApiKey:
    """A key as the server knows it: never the key itself."""

    key_id: str
    user: str
    sha256: str
    quota: Quota = field(default_factory=Quota)
    # The priority of its requests that name none (lower first; docs/protocol.md#priority).
    priority: int = 0


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def check_key(key: str) -> str:
    if not KEY_PATTERN.fullmatch(key):
        raise ValueError("an API key must be 16 to 256 letters, digits or . _ ~ + -")
    return key


def simple_key(key: str) -> ApiKey:
    """A key given on the command line or in STOPLINE_API_KEYS: no limits; its id, also its user,
    is a prefix of its digest, which names it in logs and metrics without revealing it."""
    digest = key_digest(check_key(key))
    return ApiKey(f"key-{digest[:8]}", f"key-{digest[:8]}", digest)


def _limit(entry: dict, name: str, where: str) -> int | None:
    value = entry.get("limits", {}).get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise KeyFileError(f"{where}: limits.{name} must be a positive integer")
    return value


def parse_entry(line: str, where: str) -> ApiKey:
    try:
        entry = json.loads(line)
    except ValueError:
        raise KeyFileError(f"{where}: not a JSON object") from None
    if not isinstance(entry, dict):
        raise KeyFileError(f"{where}: not a JSON object")
    key_id, user, digest = entry.get("id"), entry.get("user"), entry.get("sha256")
    if not isinstance(key_id, str) or not KEY_ID_PATTERN.fullmatch(key_id):
        raise KeyFileError(f"{where}: id must be 1 to 64 letters, digits or . _ @ -")
    if not isinstance(user, str) or not USER_PATTERN.fullmatch(user):
        raise KeyFileError(f"{where}: user must be 1 to 256 printable characters")
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise KeyFileError(f"{where}: sha256 must be the key's SHA-256 in 64 lowercase hex digits")
    limits = entry.get("limits", {})
    if not isinstance(limits, dict) or set(limits) - {str(limit) for limit in QuotaLimit}:
        raise KeyFileError(f"{where}: limits may hold only {', '.join(QuotaLimit)}")
    quota = Quota(**{str(limit): _limit(entry, limit, where) for limit in QuotaLimit})
    priority = entry.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) > MAX_PRIORITY:
        raise KeyFileError(f"{where}: priority must be an integer from {-MAX_PRIORITY} to {MAX_PRIORITY}")
    return ApiKey(key_id, user, digest, quota, priority)


def read_keys_file(path: str | os.PathLike) -> list[ApiKey]:
    """Every entry of a keys file; blank lines and lines starting with # are skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"{path}: cannot read it: {getattr(exc, 'strerror', None) or exc}") from None
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#"):
            keys.append(parse_entry(line, f"{path}:{number}"))
    return keys


def entry_line(key: ApiKey) -> str:
    created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    entry: dict = {"id": key.key_id, "user": key.user, "sha256": key.sha256, "created_at": created}
    if key.quota.as_dict():
        entry["limits"] = key.quota.as_dict()
    if key.priority:
        entry["priority"] = key.priority
    return json.dumps(entry, ensure_ascii=False)


def add_key(
    path: str | os.PathLike, user: str, quota: Quota, key_id: str | None = None, priority: int = 0
) -> tuple[str, ApiKey]:
    """Make a key for ``user`` and append its entry to the keys file (created 0600 if absent).
    Returns the key, which exists nowhere else from then on, and its entry."""
    if not USER_PATTERN.fullmatch(user):
        raise KeyFileError("the user must be 1 to 256 printable characters")
    existing = read_keys_file(path) if Path(path).exists() else []
    if key_id is None:
        key_id = f"{re.sub(r'[^A-Za-z0-9._@-]', '-', user)[:55]}-{secrets.token_hex(4)}"
    if not KEY_ID_PATTERN.fullmatch(key_id):
        raise KeyFileError("the key id must be 1 to 64 letters, digits or . _ @ -")
    if any(k.key_id == key_id for k in existing):
        raise KeyFileError(f"{path}: a key with id {key_id!r} exists already")
    key = new_key()
    if abs(priority) > MAX_PRIORITY:
        raise KeyFileError(f"the priority must be an integer from {-MAX_PRIORITY} to {MAX_PRIORITY}")
    entry = ApiKey(key_id, user, key_digest(key), quota, priority)
    # One write of one whole line, appended: a server reading the file meanwhile sees it or not at all.
    previous = Path(path).read_bytes() if Path(path).exists() else b""
    line = ("\n" if previous and not previous.endswith(b"\n") else "") + entry_line(entry) + "\n"
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(descriptor, line.encode())
    finally:
        os.close(descriptor)
    return key, entry


def revoke_key(path: str | os.PathLike, key_id: str) -> bool:
    """Remove the entry of ``key_id`` from the keys file, atomically. False: no such entry."""
    source = Path(path)
    lines = source.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [
        line
        for number, line in enumerate(lines, 1)
        if not line.strip() or line.lstrip().startswith("#") or parse_entry(line, f"{path}:{number}").key_id != key_id
    ]
    if len(kept) == len(lines):
        return False
    handle, temporary = tempfile.mkstemp(dir=source.parent, prefix=f".{source.name}.")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.writelines(kept)
        os.chmod(temporary, source.stat().st_mode & 0o777)
        os.replace(temporary, source)
    except BaseException:
        os.unlink(temporary)
        raise
    return True


class Keyring:
    """The keys in force. Empty: no key is asked for, as before keys existed."""

    def __init__(self, keys: tuple[str, ...] | list[str] = (), path: str | None = None):
        self.path = path
        # A key given twice (on the command line and in STOPLINE_API_KEYS) is one key.
        self._simple = [simple_key(key) for key in dict.fromkeys(keys)]
        self._by_digest: dict[str, ApiKey] = {}
        self._by_id: dict[str, ApiKey] = {}
        self.reload()

    def reload(self) -> int:
        """Read the keys file again (SIGHUP); on any error the keys in force stay. Returns the key count."""
        keys = list(self._simple)
        if self.path is not None:
            keys += read_keys_file(self.path)
        by_digest: dict[str, ApiKey] = {}
        by_id: dict[str, ApiKey] = {}
        for key in keys:
            if key.key_id in by_id:
                raise KeyFileError(f"{self.path}: two keys have the id {key.key_id!r}")
            if key.sha256 in by_digest:
                raise KeyFileError(f"{self.path}: key {key.key_id!r} is also key {by_digest[key.sha256].key_id!r}")
            by_digest[key.sha256], by_id[key.key_id] = key, key
        self._by_digest, self._by_id = by_digest, by_id
        return len(by_id)

    @property
    def required(self) -> bool:
        return bool(self._by_id) or self.path is not None

    def __len__(self) -> int:
        return len(self._by_id)

    def lookup(self, presented: str | None) -> ApiKey | None:
        """The key ``presented`` is, or None. The comparison is of digests, in constant time: the
        dictionary finds a candidate by the digest, which tells a guesser nothing about any key."""
        if not presented:
            return None
        digest = key_digest(presented)
        found = self._by_digest.get(digest)
        if found is None or not hmac.compare_digest(digest, found.sha256):
            return None
        return found

    def current(self, key: ApiKey) -> ApiKey | None:
        """``key`` as it is now, with its limits as last read; None if a reload has revoked it since."""
        now = self._by_id.get(key.key_id)
        return now if now is not None and now.sha256 == key.sha256 else None


def refusal_message(authorization: str | None, presented: str | None, how: str) -> str:
    """What a client refused for its key is told: whether a key came, and whether it was sent
    as a key at all (``how``: the way to send one), and nothing about the keys there are; a key
    that never existed and one revoked since read the same."""
    if presented:
        return (
            "this server needs an API key, and the one sent is not one of its keys (or has been revoked): check the key"
        )
    if authorization:
        return f"this server needs an API key, and the Authorization header holds none: {how}"
    return f"this server needs an API key, and none was sent: {how}"


def bearer(header: str | None) -> str | None:
    """The credential of an ``Authorization: Bearer <credential>`` header."""
    scheme, _, credential = (header or "").partition(" ")
    return credential.strip() or None if scheme.lower() == "bearer" else None


def subprotocol_key(headers: list[str]) -> str | None:
    """The key a browser sends as the WebSocket subprotocol ``stopline.bearer.<key>``."""
    for header in headers:
        for offered in header.split(","):
            offered = offered.strip()
            if offered.startswith(BEARER_SUBPROTOCOL):
                return offered[len(BEARER_SUBPROTOCOL) :]
    return None


def same_secret(presented: str | None, secret: str) -> bool:
    """``presented`` is ``secret``, compared in constant time (on digests, so lengths do not show)."""
    return presented is not None and hmac.compare_digest(key_digest(presented), key_digest(secret))
