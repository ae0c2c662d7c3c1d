"""The shared store of many replicas behind a load balancer (``--redis-url``).

Every replica copies its generations into Redis, so that any replica can
answer ``GET`` and ``DELETE /v1/generations/{request_id}`` for any of them:

- ``stopline:generation:<request_id>``, a hash per generation: its owner
  replica, status, ``user_id`` and ``key_id`` (of its API key), ``user`` (the
  client's label), token counts, reason, timestamps and the
  SHA-256 of its cancel token (the token itself never leaves the owner); it
  expires ``--status-ttl`` seconds after its last write.
- ``stopline:cancellations``, a stream capped with ``MAXLEN ~``: one record
  per cancel and per timeout.
- ``stopline:replica:{<id>}:heartbeat``, a key each replica sets three
  times per ``--heartbeat-ttl`` to its incarnation (one per process),
  expiring after that TTL: a replica whose key is gone is dead or cut off,
  and one whose key names another incarnation has restarted and lost its
  generations.
- ``stopline:incarnations``, a hash of every incarnation that wrote
  generations (incarnation -> replica id), and
  ``stopline:replica:{<id>}:<incarnation>:generations``, a set of that
  incarnation's live generations. Every replica looks, once a heartbeat
  period, for an incarnation whose heartbeat has lapsed; the one that wins
  ``stopline:replica:{<id>}:<incarnation>:swept`` (SET NX) ends its live
  generations as ``owner_lost``, each by a script that writes the terminal
  status and the cancellation-log record only if the hash is not ended yet,
  so each ends once, whoever else tries. A status ``owner_lost`` is never
  written over, and its owner logs no record of its own for it: a
  generation's ending and its record are one script too.
- ``stopline:replica:{<id>}:inbox``, a pub/sub channel per replica: a DELETE
  that lands on a replica that does not hold the request is published to the
  owner's inbox; the owner stops it and publishes the outcome that won to the
  asking replica's inbox.

Redis trouble never stalls tokens: the registry's hooks only append to a
bounded queue that one writer task drains, in order, in pipelines. While
Redis is down the queue waits (and drops its oldest writes when full,
counted and logged); the writer, the heartbeat and the inbox reconnect by
themselves, and a reconnected replica writes every live generation again, so
a Redis that restarted empty learns them back. Local cancels never touch
Redis.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import hmac
import json
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from .observability import Metrics, log
from .protocol.errors import InvalidCancelToken, OwnerUnreachable, StoreUnavailable, UnknownRequest
from .protocol.throttle import Throttle
from .protocol.vocabulary import (
    END_EVENTS,
    STATUS_BY_OUTCOME,
    Outcome,
    Reason,
    Status,
    StoreState,
)
from .registry import Entry, Registry
from .tasks import stop_tasks

CANCELLATIONS = "stopline:cancellations"
# The stream keeps about this many records (MAXLEN ~ trims whole nodes, cheaply).
CANCELLATIONS_MAXLEN = 100_000
INCARNATIONS = "stopline:incarnations"
# A replica missing this many heartbeats in a row (its --heartbeat-ttl) is taken for dead.
BEATS_PER_TTL = 3
# Live generations' progress reaches the store once this period, however often the heartbeat goes.
PROGRESS_PERIOD_S = 1.0
# How long a DELETE waits for a live owner's answer; it answers within one step of its token loop.
REPLY_TIMEOUT_S = 3.0
# A survivor that claimed a dead incarnation and died before ending its generations is relieved after this.
SWEEP_LEASE_S = 10.0
# Every command gives up after this long, so that a Redis that hangs is found down instead of waited on.
COMMAND_TIMEOUT_S = 2.0
WRITE_QUEUE_LIMIT = 10_000
WRITE_BATCH = 256
# A batch that fails this many times (Redis answers, but with an error) is given up.
WRITE_ATTEMPTS = 5
RECONNECT_DELAYS_S = (0.05, 0.1, 0.2, 0.5, 1.0)
# After shutdown's last writes: how long to wait for them to reach Redis.
FLUSH_TIMEOUT_S = 2.0

ENDED_STATUSES = frozenset(str(status) for status in (*STATUS_BY_OUTCOME.values(), Status.OWNER_LOST))
LOGGED_OUTCOMES = (Outcome.CANCELLED, Outcome.TIMEOUT)


def generation_key(request_id: str) -> str:
    return f"stopline:generation:{request_id}"


# The replica id sits in braces, a Redis Cluster hash tag: its heartbeat key and
# its inbox channel map to the same slot (docs/deploy.md).
def heartbeat_key(replica_id: str) -> str:
    return f"stopline:replica:{{{replica_id}}}:heartbeat"


def inbox_channel(replica_id: str) -> str:
    return f"stopline:replica:{{{replica_id}}}:inbox"


def generations_key(replica_id: str, incarnation: str) -> str:
    return f"stopline:replica:{{{replica_id}}}:{incarnation}:generations"


def sweep_key(replica_id: str, incarnation: str) -> str:
    return f"stopline:replica:{{{replica_id}}}:{incarnation}:swept"


# A generation's hash as its owner writes it, with its cancellation-log record when it ends so: never
# over owner_lost (its owner was taken for dead and its generation ended there, record and all), and
# kept in the owner's set of live generations while it runs.
# KEYS: the hash, the owner's set, the cancellation log. ARGV: TTL, "1" live or "0" ended, request id,
# the log's length, the hash's field count n, then n fields and values, then the record's.
WRITE_SCRIPT = f"""
if redis.call('HGET', KEYS[1], 'status') == '{Status.OWNER_LOST}' then return 0 end
local n = tonumber(ARGV[5])
redis.call('HSET', KEYS[1], unpack(ARGV, 6, 5 + 2 * n))
redis.call('EXPIRE', KEYS[1], ARGV[1])
if ARGV[2] == '1' then redis.call('SADD', KEYS[2], ARGV[3]) else redis.call('SREM', KEYS[2], ARGV[3]) end
redis.call('EXPIRE', KEYS[2], ARGV[1])
if #ARGV > 5 + 2 * n then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', unpack(ARGV, 6 + 2 * n))
end
return 1
"""

# Ends one generation of a dead incarnation: its terminal status and its one cancellation-log record, in
# one step, and only while the hash is that incarnation's and not ended: whoever runs it again, it ends once.
# KEYS: the hash, the cancellation log. ARGV: the incarnation, TTL, log length, now (ISO), the ending replica.
END_LOST_SCRIPT = (
    "local ended = {"
    + ", ".join(f"['{status}'] = true" for status in sorted(ENDED_STATUSES))
    + f"""}}
local h = redis.call('HMGET', KEYS[1], 'status', 'owner_incarnation', 'request_id', 'user_id', 'key_id', 'user',
  'prompt_tokens', 'tokens_generated', 'owner')
if not h[1] or h[2] ~= ARGV[1] or ended[h[1]] then return 0 end
redis.call('HSET', KEYS[1], 'status', '{Status.OWNER_LOST}', 'reason', '{Reason.OWNER_LOST}',
  'updated_at', ARGV[4], 'ended_at', ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[2])
local generated = tonumber(h[8]) or 0
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'event', '{END_EVENTS[Outcome.ERROR]}',
  'request_id', h[3] or '', 'user_id', h[4] or '', 'key_id', h[5] or '', 'user', h[6] or '',
  'reason', '{Reason.OWNER_LOST}', 'tokens_generated', generated,
  'tokens_wasted', (tonumber(h[7]) or 0) + generated, 'timestamp', ARGV[4], 'replica_id', h[9] or '',
  'ended_by', ARGV[5])
return 1
"""
)


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _iso(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat(timespec="milliseconds")


class StoreEvent(StrEnum):
    """The log events of the shared store."""

    UP = "store_up"
    DOWN = "store_down"
    WRITES_DROPPED = "store_writes_dropped"
    REMOTE_CANCEL = "remote_cancel"
    SESSION_FAILED = "store_session_failed"
    MESSAGE_INVALID = "store_message_invalid"
    # A replica's heartbeat lapsed: this replica ended its generations in the store (owner_lost).
    REPLICA_LOST = "replica_lost"


class DropCause(StrEnum):
    """Why a write to the shared store was given up: the ``cause`` of a ``store_writes_dropped`` line."""

    # The queue of writes waiting for Redis was full: the oldest went.
    QUEUE_FULL = "queue_full"
    # Redis answered it with an error, every time it was tried.
    REJECTED = "rejected"
    # The replica shut down with it still queued (Redis was away, or slower than the flush allows).
    SHUTDOWN = "shutdown"


@dataclass
class Write:
    """One queued write, one command: a generation's whole hash, its place in its owner's set of live
    generations, and, for a cancel or a timeout, its cancellation-log record."""

    key: str
    fields: dict[str, str | int | float]
    # Its owner's set of live generations, and whether it is in it.
    live_set: str
    live: bool
    record: dict[str, str | int | float] | None = None
    attempts: int = field(default=0)

    def add_to(self, pipe, ttl_s: int, write_script) -> None:
        pipe.scripts.add(write_script)
        pairs = [item for pair in self.fields.items() for item in pair]
        logged = [item for pair in (self.record or {}).items() for item in pair]
        args = (ttl_s, int(self.live), self.fields.get("request_id", ""), CANCELLATIONS_MAXLEN, len(self.fields))
        pipe.evalsha(write_script.sha, 3, self.key, self.live_set, CANCELLATIONS, *args, *pairs, *logged)


class Cluster:
    """This replica's side of the shared store. Hooked into the registry as its listener."""

    def __init__(
        self,
        url: str,
        registry: Registry,
        metrics: Metrics,
        *,
        status_ttl_s: int = 86_400,
        heartbeat_ttl_s: float = 0.6,
        queue_limit: int = WRITE_QUEUE_LIMIT,
    ):
        self.url = url
        self.registry = registry
        self.metrics = metrics
        metrics.add_store_metrics()
        metrics.redis_up.set(0)
        self.status_ttl_s = status_ttl_s
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.heartbeat_period_s = heartbeat_ttl_s / BEATS_PER_TTL
        self.queue_limit = queue_limit
        self.replica_id = ""
        # This process's life: a replica restarted under the same id is not the owner of its
        # previous life's generations, which its heartbeat then says.
        self.incarnation = uuid.uuid4().hex
        self.state = StoreState.DOWN
        # No retries inside the client: a failed command marks the store down at once,
        # and the supervisor below reconnects.
        self._client = redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=COMMAND_TIMEOUT_S,
            socket_connect_timeout=COMMAND_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        self._write_script = self._client.register_script(WRITE_SCRIPT)
        self._end_lost_script = self._client.register_script(END_LOST_SCRIPT)
        self._queue: deque[Write] = deque()
        self._queued = asyncio.Event()
        # Writes taken off the queue whose pipeline has not come back yet.
        self._sending = 0
        self._dropped = 0
        self._drops_log = Throttle()
        # Live generations' (status, tokens) as last written, so a heartbeat writes only what changed.
        self._synced: dict[str, tuple[str, int]] = {}
        self._replies: dict[str, asyncio.Future] = {}
        self._served: set[asyncio.Task] = set()
        self._supervisor: asyncio.Task | None = None
        # Sessions with Redis that got as far as registering.
        self._sessions = 0

    # Lifecycle -------------------------------------------------------------------

    async def start(self, replica_id: str) -> None:
        """Connect in the background: the replica serves at once, with the store down until Redis answers."""
        self.replica_id = replica_id
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise())

    async def close(self) -> None:
        """Flush the last writes (briefly), leave the cluster at once, and close every connection."""
        if self.state is StoreState.UP:
            deadline = time.monotonic() + FLUSH_TIMEOUT_S
            while (self._queue or self._sending) and self.state is StoreState.UP and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        if self._supervisor is not None:
            await stop_tasks([self._supervisor])
        await stop_tasks(list(self._served))
        if self.state is StoreState.UP:
            try:
                # The other replicas see this one gone now rather than when its heartbeat expires.
                await self._client.delete(heartbeat_key(self.replica_id))
            except (RedisError, OSError):
                pass
        self._set_state(StoreState.DOWN, reason="shutdown")
        if self._queue:
            self._drop(len(self._queue), DropCause.SHUTDOWN)
            self._queue.clear()
        await self._client.aclose()

    @property
    def client(self) -> redis.Redis:
        return self._client

    def health(self) -> dict:
        return {
            "type": "redis",
            "state": str(self.state),
            "replica_id": self.replica_id,
            "queued_writes": len(self._queue),
            "dropped_writes": self._dropped,
        }

    async def _supervise(self) -> None:
        failures = 0
        while True:
            sessions = self._sessions
            try:
                await self._connected()
            except (RedisError, OSError) as exc:
                self._set_state(StoreState.DOWN, reason=f"{type(exc).__name__}: {exc}")
            except Exception as exc:  # noqa: BLE001 - logged with its traceback
                # A bug in a session must not end the reconnecting: log it, and start over.
                log.exception(StoreEvent.SESSION_FAILED, replica_id=self.replica_id)
                self._set_state(StoreState.DOWN, reason=f"{type(exc).__name__}: {exc}")
            # Back off while Redis stays away; try again at once after a session that worked.
            failures = 0 if self._sessions != sessions else failures + 1
            await asyncio.sleep(RECONNECT_DELAYS_S[min(failures, len(RECONNECT_DELAYS_S) - 1)])

    async def _connected(self) -> None:
        """One session with Redis: subscribe, register, then heartbeat, listen and write until something fails."""
        pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        tasks: list[asyncio.Task] = []
        try:
            await pubsub.subscribe(inbox_channel(self.replica_id))
            await self._beat()
            self._register_live()
            self._set_state(StoreState.UP)
            loop = asyncio.get_running_loop()
            tasks = [
                loop.create_task(self._listen(pubsub)),
                loop.create_task(self._heartbeats()),
                loop.create_task(self._drain()),
                loop.create_task(self._watch()),
            ]
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()  # raises what ended the session
        finally:
            # A DELETE waiting for an owner's answer on this connection will not get it.
            for future in self._replies.values():
                if not future.done():
                    future.set_exception(StoreUnavailable("the connection to Redis was lost"))
            await stop_tasks(tasks)
            try:
                await pubsub.aclose()
            except (RedisError, OSError):
                pass

    def _set_state(self, state: StoreState, reason: str | None = None) -> None:
        if state is self.state:
            return
        self.state = state
        self.metrics.redis_up.set(1 if state is StoreState.UP else 0)
        if state is StoreState.UP:
            self._sessions += 1
            log.info(StoreEvent.UP, replica_id=self.replica_id, queued_writes=len(self._queue))
        else:
            log.warning(StoreEvent.DOWN, replica_id=self.replica_id, reason=reason, queued_writes=len(self._queue))

    # The registry's hooks: called on the event loop, they only queue ----------------------

    def added(self, entry: Entry) -> None:
        self._write(self._hash(entry))

    def ended(self, entry: Entry) -> None:
        self._synced.pop(entry.request_id, None)
        write = self._hash(entry)
        ending = entry.ending
        if ending is not None and ending.outcome in LOGGED_OUTCOMES:
            write.record = _without_none(
                {
                    "event": END_EVENTS[ending.outcome],
                    "request_id": entry.request_id,
                    "user_id": entry.user_id or "",
                    "key_id": entry.key_id or "",
                    "user": entry.user or "",
                    "reason": ending.reason,
                    "tokens_generated": ending.tokens_generated,
                    "tokens_wasted": ending.tokens_wasted,
                    "cancel_latency_ms": ending.cancel_latency_ms,
                    "timestamp": _iso(time.time()),
                    "replica_id": self.replica_id,
                }
            )
        self._write(write)

    def _hash(self, entry: Entry) -> Write:
        described = entry.describe()
        fields = {
            **described,
            "owner": self.replica_id,
            "owner_incarnation": self.incarnation,
            "user_id": entry.user_id or "",
            "key_id": entry.key_id or "",
            "user": entry.user or "",
            "token_sha256": token_digest(entry.cancel_token),
            "created_at": _iso(entry.created),
            "updated_at": _iso(time.time()),
        }
        if entry.ending is not None:
            fields["ended_at"] = fields["updated_at"]
        return Write(
            generation_key(entry.request_id),
            _without_none(fields),
            live_set=generations_key(self.replica_id, self.incarnation),
            live=entry.ending is None,
        )

    def _write(self, write: Write) -> None:
        self._queue.append(write)
        if len(self._queue) > self.queue_limit:
            # The oldest goes: a newer write of the same hash carries everything it had.
            self._queue.popleft()
            self._drop(1, DropCause.QUEUE_FULL)
        self.metrics.store_writes_queued.set(len(self._queue))
        self._queued.set()

    def _drop(self, count: int, cause: DropCause) -> None:
        self._dropped += count
        self.metrics.store_writes_dropped.inc(count)
        if self._drops_log.due(time.monotonic(), always=cause is DropCause.SHUTDOWN):
            log.warning(
                StoreEvent.WRITES_DROPPED, cause=cause, dropped_total=self._dropped, queue_limit=self.queue_limit
            )

    def _register_live(self) -> None:
        """Write every live generation again: Redis may have come back empty. These writes go
        after everything queued (they are the newest) and are never dropped: there are only
        as many as slots and queue places."""
        self._synced.clear()
        self._queue.extend(self._hash(entry) for entry in self.registry.live())
        self.metrics.store_writes_queued.set(len(self._queue))
        self._queued.set()

    # Background work while connected -----------------------------------------------------------

    async def _beat(self) -> None:
        # Listed among the incarnations at every beat, so that a replica once taken for dead (stalled, or cut
        # off from Redis) and back is looked after again.
        pipe = self._client.pipeline(transaction=True)
        pipe.set(heartbeat_key(self.replica_id), self.incarnation, px=int(self.heartbeat_ttl_s * 1000))
        pipe.hset(INCARNATIONS, self.incarnation, self.replica_id)
        await pipe.execute()

    async def _heartbeats(self) -> None:
        progress_due = time.monotonic() + PROGRESS_PERIOD_S
        while True:
            await asyncio.sleep(self.heartbeat_period_s)
            await self._beat()
            if time.monotonic() < progress_due:
                continue
            progress_due = time.monotonic() + PROGRESS_PERIOD_S
            # Live generations' progress (queued, prefill, decoding; tokens so far), once a period.
            for entry in self.registry.live():
                progress = (str(entry.status), entry.request.next_index if entry.request else 0)
                if self._synced.get(entry.request_id) != progress:
                    self._synced[entry.request_id] = progress
                    self._write(self._hash(entry))

    async def _drain(self) -> None:
        """Send queued writes in order, a pipeline at a time."""
        while True:
            if not self._queue:
                self._queued.clear()
                await self._queued.wait()
            batch = [self._queue.popleft() for _ in range(min(WRITE_BATCH, len(self._queue)))]
            pipe = self._client.pipeline(transaction=False)
            for write in batch:
                write.add_to(pipe, self.status_ttl_s, self._write_script)
            self._sending = len(batch)
            try:
                results = await pipe.execute(raise_on_error=False)
            except BaseException:
                # Not sent, or not known to be: put the batch back in front, and let the session end.
                self._queue.extendleft(reversed(batch))
                while len(self._queue) > self.queue_limit:
                    self._queue.popleft()
                    self._drop(1, DropCause.QUEUE_FULL)
                raise
            finally:
                self._sending = 0
                self.metrics.store_writes_queued.set(len(self._queue))
            failed = _failed_writes(batch, results)
            for write in failed:
                write.attempts += 1
            retry = [write for write in failed if write.attempts < WRITE_ATTEMPTS]
            if len(failed) > len(retry):
                self._drop(len(failed) - len(retry), DropCause.REJECTED)
            self._queue.extendleft(reversed(retry))

    async def _listen(self, pubsub) -> None:
        while True:
            message = await pubsub.get_message(timeout=self.heartbeat_period_s)
            if message is None or message.get("type") != "message":
                continue
            try:
                body = json.loads(message["data"])
                op = body["op"]
            except (ValueError, TypeError, KeyError):
                log.warning(StoreEvent.MESSAGE_INVALID, replica_id=self.replica_id)
                continue
            if op == "cancel":
                task = asyncio.get_running_loop().create_task(self._serve_cancel(body))
                self._served.add(task)
                task.add_done_callback(self._served.discard)
            elif op == "reply":
                future = self._replies.get(body.get("nonce"))
                if future is not None and not future.done():
                    future.set_result(body.get("status"))

    async def _watch(self) -> None:
        """Once a heartbeat period: end the generations of every incarnation whose heartbeat has lapsed."""
        while True:
            await asyncio.sleep(self.heartbeat_period_s)
            await self._end_lapsed()

    async def _end_lapsed(self) -> None:
        listed = await self._client.hgetall(INCARNATIONS)
        others = [(str(incarnation), str(owner)) for incarnation, owner in listed.items()]
        others = [(incarnation, owner) for incarnation, owner in others if incarnation != self.incarnation]
        if not others:
            return
        owners = sorted({owner for _, owner in others})
        beating = dict(zip(owners, await self._client.mget([heartbeat_key(owner) for owner in owners])))
        for incarnation, owner in others:
            if beating[owner] != incarnation:
                await self._end_lost(owner, incarnation)

    async def _end_lost(self, owner: str, incarnation: str) -> None:
        """End a dead incarnation's live generations, if this replica is the one that claims it."""
        if not await self._client.set(
            sweep_key(owner, incarnation), self.replica_id, nx=True, px=int(SWEEP_LEASE_S * 1000)
        ):
            return  # another replica has it (or had it, within the lease)
        live = generations_key(owner, incarnation)
        request_ids = sorted(str(request_id) for request_id in await self._client.smembers(live))
        ended = await self._end_lost_generations(incarnation, request_ids)
        pipe = self._client.pipeline(transaction=True)
        pipe.hdel(INCARNATIONS, incarnation)
        pipe.delete(live)
        await pipe.execute()
        log.warning(
            StoreEvent.REPLICA_LOST,
            replica_id=owner,
            incarnation=incarnation,
            generations_ended=ended,
            ended_by=self.replica_id,
        )

    async def _end_lost_generations(self, incarnation: str, request_ids: list[str]) -> int:
        """Each one's terminal status and log record, unless it has ended already; how many were ended here."""
        if not request_ids:
            return 0
        now = _iso(time.time())
        pipe = self._client.pipeline(transaction=False)
        for request_id in request_ids:
            await self._end_lost_script(
                keys=[generation_key(request_id), CANCELLATIONS],
                args=[incarnation, self.status_ttl_s, CANCELLATIONS_MAXLEN, now, self.replica_id],
                client=pipe,
            )
        return sum(int(result) for result in await pipe.execute())

    async def _serve_cancel(self, body: dict) -> None:
        """Another replica's DELETE of a request held here: stop it, answer with the outcome that won."""
        request_id = body.get("request_id")
        # Authorized by the asking replica; None: not held here.
        status = await self.registry.cancel(request_id) if isinstance(request_id, str) else None
        log.info(
            StoreEvent.REMOTE_CANCEL,
            request_id=request_id,
            asked_by=body.get("from"),
            status=str(status) if status else None,
        )
        reply = {"op": "reply", "nonce": body.get("nonce"), "status": str(status or Status.OWNER_LOST)}
        try:
            await self._client.publish(body["reply_to"], json.dumps(reply))
        except (RedisError, OSError, KeyError):
            pass  # the asker times out and says so

    # Requests held by other replicas ------------------------------------------------------------

    async def describe(self, request_id: str, cancel_token: str | None, key_id: str | None = None) -> dict:
        """GET for a request this replica does not hold: from its hash, as of the owner's last heartbeat."""
        record = await self._authorized(request_id, cancel_token, key_id)
        if record["status"] not in ENDED_STATUSES and not await self._owner_alive(record):
            record = await self._ended_with_owner(request_id, record)
        status = record["status"]
        answer: dict = {
            "request_id": request_id,
            "status": status,
            "prompt_tokens": int(record.get("prompt_tokens", 0)),
            "tokens_generated": int(record.get("tokens_generated", 0)),
        }
        if record["status"] in ENDED_STATUSES:
            answer["reason"] = record.get("reason")
            for name, kind in (("tokens_after_cancel", int), ("tokens_wasted", int), ("duration_ms", float)):
                if name in record:
                    answer[name] = kind(record[name])
        return answer

    async def cancel(self, request_id: str, cancel_token: str | None, key_id: str | None = None) -> str:
        """DELETE for a request this replica does not hold: its owner stops it and names the outcome that won."""
        record = await self._authorized(request_id, cancel_token, key_id)
        if record["status"] in ENDED_STATUSES:
            return record["status"]
        owner = record["owner"]
        if owner == self.replica_id:
            # Not in the registry: written by this replica's previous life, or just ended here.
            if record.get("owner_incarnation") != self.incarnation:
                return (await self._ended_with_owner(request_id, record))["status"]
            return str(Status.OWNER_LOST)
        nonce = uuid.uuid4().hex
        future = asyncio.get_running_loop().create_future()
        self._replies[nonce] = future
        message = json.dumps(
            {
                "op": "cancel",
                "request_id": request_id,
                "nonce": nonce,
                "from": self.replica_id,
                "reply_to": inbox_channel(self.replica_id),
            }
        )
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        try:
            while True:
                async with self._store():
                    pipe = self._client.pipeline(transaction=False)
                    pipe.get(heartbeat_key(owner))
                    pipe.publish(inbox_channel(owner), message)
                    beating, receivers = await pipe.execute()
                if beating != record.get("owner_incarnation"):
                    return (await self._ended_with_owner(request_id, record))["status"]
                if receivers:
                    break
                # Alive but not listening: reconnecting to Redis, or just killed. Either it listens
                # again or its heartbeat expires, within one heartbeat lifetime.
                if time.monotonic() > deadline:
                    raise OwnerUnreachable(f"replica {owner} did not listen within {REPLY_TIMEOUT_S:g} s")
                await asyncio.sleep(self.heartbeat_period_s / 10)
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    return await future
            except TimeoutError:
                if not await self._owner_alive(record):
                    return (await self._ended_with_owner(request_id, record))["status"]
                raise OwnerUnreachable(f"replica {owner} did not answer within {REPLY_TIMEOUT_S:g} s") from None
        finally:
            self._replies.pop(nonce, None)

    async def _authorized(self, request_id: str, cancel_token: str | None, key_id: str | None) -> dict:
        """The generation's hash, if ``cancel_token`` is its cancel token or ``key_id`` the id of the API key
        that started it (the caller has checked the key: every replica reads the same keys)."""
        async with self._store():
            record = await self._client.hgetall(generation_key(request_id))
        if not record or "owner" not in record:
            raise UnknownRequest(request_id)
        # As the registry does: compared in constant time, and here on digests, so the token is never stored.
        by_token = cancel_token is not None and hmac.compare_digest(
            token_digest(cancel_token), str(record.get("token_sha256", ""))
        )
        by_key = key_id is not None and key_id == record.get("key_id")
        if not (by_token or by_key):
            raise InvalidCancelToken(request_id)
        return record

    async def _ended_with_owner(self, request_id: str, record: dict) -> dict:
        """The hash of a generation whose owner is dead, once ended in the store: by this replica now, or
        by whichever got there first (the owner's own ending, written just before it died, stays)."""
        async with self._store():
            await self._end_lost_generations(str(record.get("owner_incarnation", "")), [request_id])
            ended = await self._client.hgetall(generation_key(request_id))
        if ended.get("status") in ENDED_STATUSES:
            return ended
        # Gone meanwhile (its TTL), or not this incarnation's any more: it ended with its owner all the same.
        return {**record, "status": str(Status.OWNER_LOST), "reason": str(Reason.OWNER_LOST)}

    async def _owner_alive(self, record: dict) -> bool:
        """The owner's heartbeat has not expired, and is still from the process that ran this generation."""
        owner = record["owner"]
        if owner == self.replica_id:
            return record.get("owner_incarnation") == self.incarnation
        async with self._store():
            beating = await self._client.get(heartbeat_key(owner))
        return beating == record.get("owner_incarnation")

    def _store(self):
        return _StoreCall(self)


class _StoreCall:
    """Around one command for a client: refused at once while the store is down, and any failure is a 503."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster

    async def __aenter__(self) -> None:
        if self.cluster.state is not StoreState.UP:
            raise StoreUnavailable("Redis cannot be reached")

    async def __aexit__(self, kind, exc, tb) -> bool:
        if isinstance(exc, (RedisError, OSError)):
            raise StoreUnavailable(f"Redis failed: {type(exc).__name__}") from exc
        return False


def _failed_writes(batch: list[Write], results: list) -> list[Write]:
    """The writes whose command Redis answered with an error."""
    return [write for write, result in zip(batch, results) if isinstance(result, Exception)]


def _without_none(fields: dict) -> dict:
    return {k: v for k, v in fields.items() if v is not None}
