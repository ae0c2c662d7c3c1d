"""Per-key quotas: concurrent generations, requests and generated tokens per minute, the longest prompt.

Every replica counts its own requests per key (:class:`LocalQuotas`). With
``--redis-url`` the count that decides is the one shared in Redis, kept by
Lua scripts that read and write in one atomic step, so N replicas enforce one
limit (docs/deploy.md#quotas-across-replicas):

- ``stopline:quota:{<key_id>}:concurrent``, a sorted set of request ids scored
  by when their lease expires. Each replica renews its leases every second; a
  replica that dies leaves leases that expire after ``LEASE_S``.
- ``stopline:quota:{<key_id>}:requests`` and ``…:tokens``, token buckets
  (``level``, ``at``) that refill at the limit per minute up to the limit. The
  tokens bucket is charged as generations end and may go below zero: a key
  in debt waits until it has refilled.

Only key ids go to Redis, never a key. The clock is Redis's own (``TIME``),
so replicas need not agree on the time.

Redis never stalls a request: an admission waits at most ``ADMIT_TIMEOUT_S``
for Redis, and while Redis is down or slow the local count decides alone.
Releases, token charges and lease renewals go through one ordered queue that
a background task sends.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from .auth import ApiKey, Quota
from .observability import Metrics, log
from .protocol.throttle import Throttle
from .protocol.vocabulary import KeyEvent, QuotaLimit, StoreState
from .tasks import stop_tasks

if TYPE_CHECKING:
    from .cluster import Cluster

# How long an admission may wait for Redis before this replica decides alone.
ADMIT_TIMEOUT_S = 0.25
# A lease on a concurrent place lives this long unless renewed (every RENEW_PERIOD_S).
LEASE_S = 5.0
RENEW_PERIOD_S = 1.0
# Buckets untouched this long are full again; Redis may forget them.
IDLE_EXPIRY_MS = 120_000
# What Retry-After says for a concurrent place: when one frees is not known in advance.
CONCURRENT_RETRY_S = 1.0
# Releases, charges and renewals waiting for Redis; beyond it the oldest go (leases expire by themselves).
QUEUE_LIMIT = 10_000


def quota_key(key_id: str, kind: str) -> str:
    # The key id in braces (a Redis Cluster hash tag): one script's keys share a slot.
    return f"stopline:quota:{{{key_id}}}:{kind}"


# Refill a bucket of capacity ``cap`` (per minute) to ``now`` (ms); a missing bucket is full.
_LEVEL = """
local function level(key, cap, now)
  local v = redis.call('HMGET', key, 'level', 'at')
  local l, at = tonumber(v[1]), tonumber(v[2])
  if l == nil or at == nil then return cap end
  l = l + (now - at) * cap / 60000
  if l > cap then l = cap end
  return l
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# KEYS: concurrent, requests, tokens. ARGV: request id, lease ms, concurrent, requests/min, tokens/min (0: none).
# Returns {limit, retry ms} for a refusal, {'ok', 0} for an admission.
ADMIT_SCRIPT = (
    _LEVEL
    + """
local conc, rpm, tpm = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  if redis.call('ZCARD', KEYS[1]) >= conc then return {'concurrent', 0} end
end
local r = 0
if rpm > 0 then
  r = level(KEYS[2], rpm, now)
  if r < 1 then return {'requests_per_minute', math.ceil((1 - r) * 60000 / rpm)} end
end
if tpm > 0 then
  local k = level(KEYS[3], tpm, now)
  if k <= 0 then return {'tokens_per_minute', math.ceil((1 - k) * 60000 / tpm)} end
end
if conc > 0 then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
end
if rpm > 0 then
  redis.call('HSET', KEYS[2], 'level', tostring(r - 1), 'at', now)
  redis.call('PEXPIRE', KEYS[2], IDLE_MS)
end
return {'ok', 0}
""".replace("IDLE_MS", str(IDLE_EXPIRY_MS))
)

# KEYS: concurrent, tokens. ARGV: request id, tokens generated, tokens/min (0: none).
RELEASE_SCRIPT = (
    _LEVEL
    + """
redis.call('ZREM', KEYS[1], ARGV[1])
local n, tpm = tonumber(ARGV[2]), tonumber(ARGV[3])
if tpm > 0 and n > 0 then
  redis.call('HSET', KEYS[2], 'level', tostring(level(KEYS[2], tpm, now) - n), 'at', now)
  redis.call('PEXPIRE', KEYS[2], IDLE_MS)
end
return 1
""".replace("IDLE_MS", str(IDLE_EXPIRY_MS))
)

# KEYS: concurrent. ARGV: lease ms, then the request ids this replica holds.
RENEW_SCRIPT = (
    _LEVEL
    + """
local lease = tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], now + lease, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], lease)
return #ARGV - 1
"""
)


@dataclass(frozen=True)
class QuotaRefusal:
    """A request refused by its key's quota: which limit, and when to try again (None: waiting won't help)."""

    limit: QuotaLimit
    retry_after_s: float | None
    message: str


def refusal(limit: QuotaLimit, quota: Quota, retry_after_s: float | None, prompt_tokens: int = 0) -> QuotaRefusal:
    if limit is QuotaLimit.MAX_PROMPT_TOKENS:
        message = f"the prompt has {prompt_tokens} tokens; this key allows at most {quota.max_prompt_tokens}"
    elif limit is QuotaLimit.CONCURRENT:
        message = f"this key has its {quota.concurrent} concurrent generations running"
    elif limit is QuotaLimit.REQUESTS_PER_MINUTE:
        message = f"this key has used its {quota.requests_per_minute} requests per minute"
    else:
        message = f"this key has used its {quota.tokens_per_minute} generated tokens per minute"
    if retry_after_s is not None:
        retry_after_s = max(1.0, float(math.ceil(retry_after_s)))
        message += f"; try again in {retry_after_s:g} s"
    return QuotaRefusal(limit, retry_after_s, message)


@dataclass
class Bucket:
    """A token bucket holding up to ``per_minute``, refilled at ``per_minute`` a minute; may go below 0."""

    per_minute: int
    level: float
    at: float

    def refill(self, now: float) -> float:
        self.level = min(float(self.per_minute), self.level + (now - self.at) * self.per_minute / 60)
        self.at = now
        return self.level

    def wait_for(self, need: float) -> float:
        """Seconds until the bucket holds ``need`` (after a refill)."""
        return max(0.0, (need - self.level) * 60 / self.per_minute)


@dataclass
class KeyCount:
    held: set[str] = field(default_factory=set)
    requests: Bucket | None = None
    tokens: Bucket | None = None


class LocalQuotas:
    """This process's own count per key: the whole count without Redis, the fallback with it."""

    def __init__(self) -> None:
        self._counts: dict[str, KeyCount] = {}

    def _count(self, key: ApiKey, now: float) -> KeyCount:
        count = self._counts.setdefault(key.key_id, KeyCount())
        quota = key.quota
        # A reload may have changed the limits: buckets follow them.
        if quota.requests_per_minute is None:
            count.requests = None
        elif count.requests is None or count.requests.per_minute != quota.requests_per_minute:
            count.requests = Bucket(quota.requests_per_minute, float(quota.requests_per_minute), now)
        if quota.tokens_per_minute is None:
            count.tokens = None
        elif count.tokens is None or count.tokens.per_minute != quota.tokens_per_minute:
            count.tokens = Bucket(quota.tokens_per_minute, float(quota.tokens_per_minute), now)
        return count

    def take(self, key: ApiKey, request_id: str, now: float) -> QuotaRefusal | None:
        """Admit and count ``request_id``, or say which limit refuses it."""
        count, quota = self._count(key, now), key.quota
        if quota.concurrent is not None and len(count.held) >= quota.concurrent:
            return refusal(QuotaLimit.CONCURRENT, quota, CONCURRENT_RETRY_S)
        if count.requests is not None and count.requests.refill(now) < 1:
            return refusal(QuotaLimit.REQUESTS_PER_MINUTE, quota, count.requests.wait_for(1))
        if count.tokens is not None and count.tokens.refill(now) <= 0:
            return refusal(QuotaLimit.TOKENS_PER_MINUTE, quota, count.tokens.wait_for(1))
        count.held.add(request_id)
        if count.requests is not None:
            count.requests.level -= 1
        return None

    def undo(self, key: ApiKey, request_id: str) -> None:
        """Take back an admission that the shared count refused."""
        count = self._counts.get(key.key_id)
        if count is not None and request_id in count.held:
            count.held.discard(request_id)
            if count.requests is not None:
                count.requests.level += 1

    def release(self, key: ApiKey, request_id: str, tokens_generated: int, now: float) -> None:
        count = self._count(key, now)
        count.held.discard(request_id)
        if count.tokens is not None:
            count.tokens.refill(now)
            count.tokens.level -= tokens_generated

    def held(self) -> dict[str, list[str]]:
        return {key_id: sorted(count.held) for key_id, count in self._counts.items() if count.held}


class Quotas:
    """Admits requests under their key's quota: locally, and with a cluster through Redis too."""

    def __init__(self, metrics: Metrics, cluster: Cluster | None = None):
        self.metrics = metrics
        self.cluster = cluster
        self.local = LocalQuotas()
        # Requests admitted and not yet released, with the key that admitted them.
        self._admitted: dict[str, ApiKey] = {}
        # Releases (and their token charges) waiting to be sent, in order.
        self._queue: deque[tuple[list[str], list[str | int]]] = deque()
        self._wake = asyncio.Event()
        self._sender: asyncio.Task | None = None
        self._local_log = Throttle()
        self._local_decisions = 0
        if cluster is not None:
            client = cluster.client
            self._admit = client.register_script(ADMIT_SCRIPT)
            self._release = client.register_script(RELEASE_SCRIPT)
            self._renew = client.register_script(RENEW_SCRIPT)

    def start(self) -> None:
        if self.cluster is not None:
            self._sender = asyncio.get_running_loop().create_task(self._send())

    async def close(self) -> None:
        if self._sender is not None:
            # A cancel alone may not end a task that uses Redis (stop_tasks says why).
            await stop_tasks([self._sender])

    async def admit(self, key: ApiKey, request_id: str, prompt_tokens: int) -> QuotaRefusal | None:
        """Admit ``request_id`` under ``key``'s quota, or say which limit refuses it."""
        quota = key.quota
        if quota.max_prompt_tokens is not None and prompt_tokens > quota.max_prompt_tokens:
            return self._refused(key, refusal(QuotaLimit.MAX_PROMPT_TOKENS, quota, None, prompt_tokens))
        if not quota.limited:
            return None
        # The local count first: it never waits, and it is at most the shared one.
        refused = self.local.take(key, request_id, time.monotonic())
        if refused is not None:
            return self._refused(key, refused)
        self._admitted[request_id] = key
        refused = await self._admit_shared(key, request_id)
        if refused is not None:
            self.local.undo(key, request_id)
            del self._admitted[request_id]
            return self._refused(key, refused)
        return None

    def release(self, request_id: str, tokens_generated: int) -> None:
        """``request_id`` ended: free its place and charge its tokens (nothing if it was not admitted here)."""
        key = self._admitted.pop(request_id, None)
        if key is None:
            return
        self.local.release(key, request_id, tokens_generated, time.monotonic())
        if self.cluster is not None:
            self._enqueue(
                [quota_key(key.key_id, "concurrent"), quota_key(key.key_id, "tokens")],
                [request_id, tokens_generated, key.quota.tokens_per_minute or 0],
            )

    def _refused(self, key: ApiKey, refused: QuotaRefusal) -> QuotaRefusal:
        self.metrics.quota_refusals.labels(key.key_id, str(refused.limit)).inc()
        return refused

    async def _admit_shared(self, key: ApiKey, request_id: str) -> QuotaRefusal | None:
        if self.cluster is None:
            return None
        if self.cluster.state is not StoreState.UP:
            self._decided_locally("store_down")
            return None
        quota = key.quota
        try:
            async with asyncio.timeout(ADMIT_TIMEOUT_S):
                limit, retry_ms = await self._admit(
                    keys=[quota_key(key.key_id, kind) for kind in ("concurrent", "requests", "tokens")],
                    args=[
                        request_id,
                        int(LEASE_S * 1000),
                        quota.concurrent or 0,
                        quota.requests_per_minute or 0,
                        quota.tokens_per_minute or 0,
                    ],
                )
        except (RedisError, OSError, TimeoutError) as exc:
            self._decided_locally(type(exc).__name__)
            return None
        # The Redis client can lose a cancel that lands as its command completes (tasks.stop_tasks
        # says why), but the task still counts it: a request whose client left ends here, not admitted.
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise asyncio.CancelledError
        if limit == "ok":
            return None
        limit = QuotaLimit(limit)
        retry_s = CONCURRENT_RETRY_S if limit is QuotaLimit.CONCURRENT else int(retry_ms) / 1000
        return refusal(limit, quota, retry_s)

    def _decided_locally(self, cause: str) -> None:
        self._local_decisions += 1
        self.metrics.quota_local_decisions.inc()
        if self._local_log.due(time.monotonic()):
            log.warning(KeyEvent.QUOTA_LOCAL, cause=cause, decisions_total=self._local_decisions)

    # The ordered queue to Redis --------------------------------------------------------

    def _enqueue(self, keys: list[str], args: list[str | int]) -> None:
        self._queue.append((keys, args))
        if len(self._queue) > QUEUE_LIMIT:
            self._queue.popleft()
        self._wake.set()

    async def _send(self) -> None:
        """Send releases and charges as they come, and renew this replica's leases every period."""
        assert self.cluster is not None
        renewed_at = 0.0
        while True:
            try:
                async with asyncio.timeout(RENEW_PERIOD_S):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            if self.cluster.state is not StoreState.UP:
                continue
            batch = list(self._queue)
            self._queue.clear()
            # The leases held now, read after the releases above were queued: a released request
            # is never renewed after its release.
            renew = time.monotonic() - renewed_at >= RENEW_PERIOD_S
            held = self.local.held() if renew else {}
            if not batch and not held:
                renewed_at = time.monotonic() if renew else renewed_at
                continue
            pipe = self.cluster.client.pipeline(transaction=False)
            for keys, args in batch:
                await self._release(keys=keys, args=args, client=pipe)
            for key_id, request_ids in held.items():
                lease: list[str | int] = [int(LEASE_S * 1000), *request_ids]
                await self._renew(keys=[quota_key(key_id, "concurrent")], args=lease, client=pipe)
            try:
                await pipe.execute(raise_on_error=False)
            except (RedisError, OSError):
                # Lost: a lease not released expires by itself; a charge is forgotten.
                pass
            if renew:
                renewed_at = time.monotonic()
