"""Scale-out: real redis-server, real replicas (``python -m stopline`` processes), real nginx.

A DELETE or GET that lands on a replica that does not hold the generation is
answered through Redis; Redis going away never stops tokens or local cancels;
a replica that dies has its generations ended in the store by one survivor,
within its heartbeat TTL and a period, and answered owner_lost everywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time

import pytest
import redis.asyncio as aioredis
from websockets.asyncio.client import connect

from bench.servers import RedisServer, free_port
from stopline.auth import ApiKey, Quota
from stopline.cluster import (
    BEATS_PER_TTL,
    CANCELLATIONS,
    INCARNATIONS,
    PROGRESS_PERIOD_S,
    Cluster,
    StoreEvent,
    generation_key,
    generations_key,
    heartbeat_key,
)
from stopline.observability import Metrics
from stopline.protocol.requests import Ending, Request, SamplingParams
from stopline.protocol.vocabulary import TERMINAL_TYPES, ErrorCode, Outcome, Reason, Status, StoreState
from stopline.quota import Quotas
from stopline.registry import Registry
from stopline.settings import Settings
from stopline.tasks import stop_tasks
from support import LONG_ANSWER, UNIT, Client, metric_value, wait_for
from support.cluster import REPLICA_IDS, Nginx, Replica

# The default heartbeat, which the replicas here run with: a dead one is noticed within its TTL and a period.
HEARTBEAT_TTL_S = Settings().heartbeat_ttl_s
HEARTBEAT_PERIOD_S = HEARTBEAT_TTL_S / BEATS_PER_TTL


def store_client(redis_server: RedisServer) -> aioredis.Redis:
    return aioredis.from_url(redis_server.url, decode_responses=True)


class Deployment:
    def __init__(self, redis_server: RedisServer, replicas: list[Replica], nginx: Nginx):
        self.redis = redis_server
        self.replicas = replicas
        self.nginx = nginx
        self.by_id = {r.replica_id: r for r in replicas}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """redis-server, three replicas and nginx in front of them, as docs/deploy.md runs them."""
    directory = tmp_path_factory.mktemp("deploy")
    redis_server = RedisServer(directory / "redis").start(10 * UNIT)
    replicas: list[Replica] = []
    nginx = None
    try:
        replicas = [Replica(name, redis_server.url, directory) for name in REPLICA_IDS]
        for replica in replicas:
            replica.wait_started()
        nginx = Nginx(directory / "nginx", replicas)
        yield Deployment(redis_server, replicas, nginx)
    finally:
        if nginx is not None:
            nginx.stop()
        for replica in replicas:
            replica.stop()
        redis_server.kill()


@contextlib.asynccontextmanager
async def ws_client(url: str):
    async with connect(url) as websocket:
        client = Client(websocket)
        client.hello = json.loads(await websocket.recv())
        yield client


async def call(http, method: str, base: str, request_id: str, token: str | None) -> tuple[int, dict, str | None]:
    """GET or DELETE /v1/generations/{request_id}: (status, body, the replica that answered)."""
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with http.request(method, f"{base}/generations/{request_id}", headers=headers) as response:
        return response.status, await response.json(), response.headers.get("X-Stopline-Replica")


async def running_generation(client: Client, name: str, **fields) -> dict:
    """Start a long generation and wait until it streams; its accepted frame."""
    accepted = await client.generate(name, messages=LONG_ANSWER, max_tokens=1500, **fields)
    assert accepted["type"] == "accepted", accepted
    await client.recv_until(lambda f: f["type"] == "token" and f["id"] == name)
    return accepted


async def stream_records(store: aioredis.Redis, request_id: str) -> list[dict]:
    return [fields for _, fields in await store.xrange(CANCELLATIONS) if fields["request_id"] == request_id]


async def healthz(http, replica: Replica) -> dict:
    async with http.get(f"http://127.0.0.1:{replica.ws_port}/healthz") as response:
        return await response.json()


async def store_state(http, replica: Replica) -> str:
    return (await healthz(http, replica))["store"]["state"]


@pytest.mark.slow
async def test_delete_through_nginx_reaches_the_owner_from_every_replica(deployment, http):
    """WebSocket generations through nginx, each cancelled by a DELETE through nginx, until the DELETE has
    been answered by every replica, by the owner and by replicas that do not hold the generation."""
    store = store_client(deployment.redis)
    api = f"{deployment.nginx.http}/v1"
    answered_by: set[str] = set()
    relayed = 0
    try:
        for attempt in range(12):
            name, user = f"g{attempt}", f"user-{attempt}"
            async with ws_client(deployment.nginx.ws_url) as client:
                accepted = await running_generation(client, name, user=user)
                request_id, token = accepted["request_id"], accepted["cancel_token"]
                # Any replica reads its status (the GET also moves nginx's HTTP round robin along).
                status, body, _ = await call(http, "GET", api, request_id, token)
                assert status == 200 and body["status"] in (Status.PREFILL, Status.DECODING), body
                assert (await call(http, "DELETE", api, request_id, "not-the-token"))[:2] == (
                    403,
                    {
                        "type": "error",
                        "id": None,
                        "code": ErrorCode.INVALID_CANCEL_TOKEN,
                        "message": "send the generation's cancel token as 'Authorization: Bearer <token>'",
                    },
                )
                status, body, replica = await call(http, "DELETE", api, request_id, token)
                assert (status, body) == (200, {"request_id": request_id, "status": Status.CANCELLED})
                terminal = await client.terminal(name)
                assert terminal["type"] == Outcome.CANCELLED and terminal["reason"] == Reason.USER_CANCELLED
                # Exactly one terminal frame: a cancel frame now only gets an ack naming the outcome.
                await client.send({"type": "cancel", "id": name})
                ack = await client.recv_until(lambda f, name=name: f["id"] == name and f["type"] != "token")
                assert ack == {"type": "cancel_ack", "id": name, "status": "cancelled"}
                assert [f for f in client.frames if f["type"] in TERMINAL_TYPES] == [terminal]
            # A repeat from anywhere gets the same answer.
            assert (await call(http, "DELETE", api, request_id, token))[:2] == (200, body)
            record = await wait_for(lambda request_id=request_id: _ended_hash(store, request_id), timeout=10)
            assert record["status"] == Status.CANCELLED and record["user"] == user and record["user_id"] == ""
            assert record["owner"] in deployment.by_id and record["reason"] == Reason.USER_CANCELLED
            assert "token_sha256" in record and token not in record.values()
            [logged] = await wait_for(lambda request_id=request_id: stream_records(store, request_id), timeout=10)
            assert logged["event"] == "generation_cancelled" and logged["user"] == user
            assert logged["reason"] == Reason.USER_CANCELLED and int(logged["tokens_generated"]) >= 1
            assert (
                int(logged["tokens_wasted"]) >= int(logged["tokens_generated"])
                and float(logged["cancel_latency_ms"]) >= 0
            )
            answered_by.add(replica)
            relayed += replica != record["owner"]
            if answered_by == set(REPLICA_IDS) and relayed:
                break
        assert answered_by == set(REPLICA_IDS) and relayed, (answered_by, relayed)
        # The relayed ones were stopped by their owner, which logged who asked.
        remote = [
            r for replica in deployment.replicas for r in replica.records if r.get("event") == StoreEvent.REMOTE_CANCEL
        ]
        assert len(remote) == relayed and all(r["status"] == Status.CANCELLED for r in remote)
        status, body, _ = await call(http, "DELETE", api, "no-such-generation", "x")
        assert status == 404 and body["code"] == ErrorCode.UNKNOWN_REQUEST
    finally:
        await store.aclose()


async def _ended_hash(store: aioredis.Redis, request_id: str) -> dict | None:
    record = await store.hgetall(generation_key(request_id))
    return record if record.get("status") in (Status.CANCELLED, Status.FINISHED) else None


@pytest.mark.slow
async def test_redis_down_then_back(deployment, http):
    """Tokens and local cancels go on without Redis; a cross-replica DELETE gets 503 store_unavailable; once
    Redis is back (empty), every replica reconnects and registers its live generations again."""
    a, b = deployment.by_id["a"], deployment.by_id["b"]
    async with ws_client(a.ws_url) as client:
        first = await running_generation(client, "before")
        # Known in the store before it goes.
        store = store_client(deployment.redis)
        try:
            await wait_for(lambda: store.exists(generation_key(first["request_id"])), timeout=10)
        finally:
            await store.aclose()
        deployment.redis.kill()
        try:
            seen = len(client.tokens("before"))
            await client.recv_until(lambda f: f["type"] == "token" and f["index"] >= seen + 3)
            status, body, _ = await call(http, "DELETE", b.api_url, first["request_id"], first["cancel_token"])
            assert status == 503 and body["code"] == ErrorCode.STORE_UNAVAILABLE, body
            status, body, _ = await call(http, "GET", b.api_url, first["request_id"], first["cancel_token"])
            assert status == 503 and body["code"] == ErrorCode.STORE_UNAVAILABLE, body
            for replica in (a, b):
                await wait_for(lambda replica=replica: _is(store_state(http, replica), StoreState.DOWN), timeout=10)
            async with http.get(f"http://127.0.0.1:{a.ws_port}/metrics") as response:
                assert metric_value(await response.text(), "stopline_redis_up") == 0
            # A local DELETE needs no Redis.
            status, body, _ = await call(http, "DELETE", a.api_url, first["request_id"], first["cancel_token"])
            assert (status, body["status"]) == (200, Status.CANCELLED)
            assert (await client.terminal("before"))["type"] == Outcome.CANCELLED
            # A generation that starts while Redis is away.
            during = await running_generation(client, "during")
        finally:
            deployment.redis.start(10 * UNIT)
        for replica in deployment.replicas:
            await wait_for(lambda replica=replica: _is(store_state(http, replica), StoreState.UP), timeout=10)
        async with http.get(f"http://127.0.0.1:{a.ws_port}/metrics") as response:
            assert metric_value(await response.text(), "stopline_redis_up") == 1
        # Registered again: another replica finds it and stops it through its owner.
        status, body, _ = await call(http, "DELETE", b.api_url, during["request_id"], during["cancel_token"])
        assert (status, body) == (200, {"request_id": during["request_id"], "status": Status.CANCELLED})
        assert (await client.terminal("during"))["type"] == Outcome.CANCELLED
        # The writes queued while Redis was away reached it: the first generation's end, and its log record.
        status, body, _ = await wait_for(
            lambda: _answered(call(http, "GET", b.api_url, first["request_id"], first["cancel_token"])), timeout=10
        )
        assert body["status"] == Status.CANCELLED
        store = store_client(deployment.redis)
        try:
            assert len(await wait_for(lambda: stream_records(store, first["request_id"]), timeout=10)) == 1
        finally:
            await store.aclose()


async def _is(state, wanted) -> bool:
    return (await state) == wanted


async def _answered(response):
    answer = await response
    return answer if answer[0] == 200 else None


@pytest.mark.slow
async def test_a_dead_replicas_generations_end_everywhere_at_once(deployment, http, tmp_path):
    """A replica running generations is killed (SIGKILL): a DELETE through a survivor answers owner_lost once
    its heartbeat lapses, and within its TTL and a period every one of its generations reads owner_lost in
    Redis and through any survivor, with one cancellation-log record each, ended by one of the three
    survivors. Restarted under the same id, it revives nothing."""
    a, b = deployment.by_id["a"], deployment.by_id["b"]
    doomed = Replica("doomed", deployment.redis.url, tmp_path, ("--workers", "2")).wait_started()
    store = store_client(deployment.redis)
    accepted: list[dict] = []
    try:
        async with ws_client(doomed.ws_url) as client:
            # Two decoding, one waiting for a slot.
            accepted = [await running_generation(client, name) for name in ("g0", "g1")]
            third = await client.generate("g2", messages=LONG_ANSWER, max_tokens=1500)
            assert third["type"] == "accepted", third
            accepted.append(third)
            ids = [acc["request_id"] for acc in accepted]
            # Their progress reaches the store once a progress period.
            for acc in accepted[:2]:
                await wait_for(
                    lambda acc=acc: _decoding(call(http, "GET", a.api_url, acc["request_id"], acc["cancel_token"])),
                    timeout=3 * PROGRESS_PERIOD_S,
                )
            await wait_for(lambda: store.exists(generation_key(ids[2])), timeout=10)
            incarnation = (await store.hgetall(generation_key(ids[0])))["owner_incarnation"]
            doomed.stop(signal.SIGKILL)
            killed = time.monotonic()
            status, body, replica = await call(http, "DELETE", a.api_url, ids[0], accepted[0]["cancel_token"])
            answered = time.monotonic() - killed
            assert (status, body, replica) == (200, {"request_id": ids[0], "status": Status.OWNER_LOST}, "a")
            assert answered < (HEARTBEAT_TTL_S + HEARTBEAT_PERIOD_S) * UNIT, answered
            # Ended in the store, every one, by the watch of some survivor.
            ended = await wait_for(lambda: _all_lost(store, ids), timeout=10)
            ended_after = time.monotonic() - killed
        assert ended_after < (HEARTBEAT_TTL_S + 2 * HEARTBEAT_PERIOD_S) * UNIT, ended_after
        survivors = set(REPLICA_IDS)
        for record in ended:
            assert record["reason"] == Reason.OWNER_LOST and record["owner"] == "doomed" and "ended_at" in record
        for request_id in ids:
            assert 0 < await store.ttl(generation_key(request_id)) <= Settings().status_ttl_s
        # One cancellation-log record each, from one survivor or another.
        for request_id in ids:
            [logged] = await stream_records(store, request_id)
            assert logged["event"] == "generation_error" and logged["reason"] == Reason.OWNER_LOST
            assert logged["replica_id"] == "doomed" and logged["ended_by"] in survivors
        # One survivor claimed the dead incarnation, and it is no longer listed.
        lost = [
            (replica.replica_id, r)
            for replica in deployment.replicas
            for r in replica.records
            if r.get("event") == StoreEvent.REPLICA_LOST and r.get("incarnation") == incarnation
        ]
        assert len(lost) == 1 and lost[0][0] in survivors, lost
        assert not await store.hexists(INCARNATIONS, incarnation)
        assert not await store.exists(generations_key("doomed", incarnation))
        # GET and DELETE answer from the store, through any survivor.
        for acc in accepted:
            status, body, _ = await call(http, "GET", b.api_url, acc["request_id"], acc["cancel_token"])
            assert (status, body["status"], body["reason"]) == (200, Status.OWNER_LOST, Reason.OWNER_LOST)
            assert (await call(http, "DELETE", b.api_url, acc["request_id"], acc["cancel_token"]))[:2] == (
                200,
                {"request_id": acc["request_id"], "status": Status.OWNER_LOST},
            )
        # The same id again, a new process: nothing of the old life comes back or is ended twice.
        (tmp_path / "again").mkdir()
        doomed = Replica("doomed", deployment.redis.url, tmp_path / "again").wait_started()
        await asyncio.sleep(2 * HEARTBEAT_TTL_S * UNIT)
        for acc in accepted:
            status, body, _ = await call(http, "GET", doomed.api_url, acc["request_id"], acc["cancel_token"])
            assert (status, body["status"]) == (200, Status.OWNER_LOST)
            assert len(await stream_records(store, acc["request_id"])) == 1
        assert await _all_lost(store, ids)
    finally:
        doomed.stop(signal.SIGKILL)
        await store.aclose()


async def _all_lost(store: aioredis.Redis, request_ids: list[str]) -> list[dict] | None:
    records = [await store.hgetall(generation_key(request_id)) for request_id in request_ids]
    return records if all(r.get("status") == Status.OWNER_LOST for r in records) else None


async def _decoding(response):
    answer = await response
    return (
        answer
        if answer[0] == 200 and answer[1]["status"] == Status.DECODING and answer[1]["tokens_generated"]
        else None
    )


# The write queue, without the model: a Cluster over a registry, Redis absent and then present. -------------


def _request(number: int) -> Request:
    return Request(
        f"r{number}",
        [1, 2, 3],
        SamplingParams(),
        received_ns=0,
        user=f"label-{number}",
        user_id=f"user-{number}",
        key_id=f"key-{number}",
    )


async def test_writes_wait_for_redis_and_overflow_is_counted(tmp_path, logs):
    port = free_port()
    registry, metrics = Registry(), Metrics()
    cluster = Cluster(f"redis://127.0.0.1:{port}/0", registry, metrics, queue_limit=6)
    registry.listener = cluster
    await cluster.start("solo")
    redis_server = RedisServer(tmp_path, port)
    try:
        requests = [_request(n) for n in range(6)]
        for request in requests:
            registry.add(request, None)
        for request in requests[:3]:
            registry.end(
                request,
                Ending(
                    Outcome.CANCELLED,
                    str(Reason.USER_CANCELLED),
                    prompt_tokens=3,
                    prompt_tokens_evaluated=3,
                    tokens_generated=2,
                    cancel_latency_ms=0.5,
                ),
            )
        # 6 adds, then 3 ends (each its hash and its log record): 9 writes, 6 places.
        assert cluster.state is StoreState.DOWN
        assert metric_value(metrics.render().decode(), "stopline_store_writes_dropped_total") == 3
        assert metric_value(metrics.render().decode(), "stopline_redis_up") == 0
        assert logs.records(StoreEvent.WRITES_DROPPED, cause="queue_full")
        redis_server.start(10 * UNIT)
        await wait_for(lambda: cluster.state is StoreState.UP and not cluster.health()["queued_writes"], timeout=10)
        store = store_client(redis_server)
        try:
            # The ends (kept, the newest writes) and the live ones (registered again on connecting).
            for request in requests:
                record = await wait_for(
                    lambda request=request: store.hgetall(generation_key(request.request_id)), timeout=10
                )
                assert record["owner"] == "solo" and record["user_id"] == request.user_id
                assert record["key_id"] == request.key_id and record["user"] == request.user
                assert record["status"] == (Status.CANCELLED if request in requests[:3] else Status.QUEUED)
                assert 0 < await store.ttl(generation_key(request.request_id)) <= 86_400
            logged = [fields["request_id"] for _, fields in await store.xrange(CANCELLATIONS)]
            assert logged == [r.request_id for r in requests[:3]]
            assert await store.exists(heartbeat_key("solo"))
        finally:
            await store.aclose()
        assert metric_value(metrics.render().decode(), "stopline_redis_up") == 1
    finally:
        await cluster.close()
        redis_server.kill()
    assert metric_value(metrics.render().decode(), "stopline_store_writes_dropped_total") == 3


async def test_a_restarted_replica_does_not_own_its_previous_life(tmp_path):
    """Same replica id, new process: the generations of the old one read owner_lost, on it and elsewhere."""
    redis_server = RedisServer(tmp_path).start(10 * UNIT)
    clusters: list[Cluster] = []

    async def joined(replica_id: str) -> tuple[Cluster, Registry]:
        registry = Registry()
        cluster = Cluster(redis_server.url, registry, Metrics())
        registry.listener = cluster
        clusters.append(cluster)
        await cluster.start(replica_id)
        await wait_for(lambda: cluster.state is StoreState.UP, timeout=10)
        return cluster, registry

    try:
        old, registry = await joined("solo")
        request = _request(1)
        registry.add(request, None)
        other, _ = await joined("other")
        await wait_for(lambda: _answered_by(other.describe(request.request_id, request.cancel_token)), timeout=10)
        assert (await other.describe(request.request_id, request.cancel_token))["status"] == Status.QUEUED
        await old.close()  # the process is gone; its hash stays
        new, _ = await joined("solo")
        for cluster in (new, other):
            assert (await cluster.describe(request.request_id, request.cancel_token))["status"] == Status.OWNER_LOST
            assert await cluster.cancel(request.request_id, request.cancel_token) == Status.OWNER_LOST
    finally:
        for cluster in clusters:
            await cluster.close()
        redis_server.kill()


async def test_one_of_several_survivors_ends_a_dead_incarnations_generations(tmp_path, logs):
    """A replica stops beating without a word (its process gone): three survivors notice it at once, all
    of them try to end its generations, and so does a GET of one of them; each generation ends owner_lost
    once, with one log record; one that ended before the death keeps its ending. Back (it had only
    stalled), the replica writes no status over owner_lost, and no second record."""
    redis_server = RedisServer(tmp_path).start(10 * UNIT)
    ttl_s = 0.3
    clusters: list[Cluster] = []

    async def joined(replica_id: str) -> tuple[Cluster, Registry]:
        registry = Registry()
        cluster = Cluster(redis_server.url, registry, Metrics(), heartbeat_ttl_s=ttl_s)
        registry.listener = cluster
        clusters.append(cluster)
        await cluster.start(replica_id)
        await wait_for(lambda: cluster.state is StoreState.UP, timeout=10)
        return cluster, registry

    store = store_client(redis_server)
    try:
        dead, registry = await joined("dead")
        requests = [_request(n) for n in range(4)]
        for request in requests:
            registry.add(request, None)
        registry.end(requests[3], Ending(Outcome.DONE, str(Reason.EOS), tokens_generated=3))
        live = generations_key("dead", dead.incarnation)
        await wait_for(lambda: _members(store, live, 3), timeout=10)
        survivors = [(await joined(name))[0] for name in ("s1", "s2", "s3")]
        assert dead._supervisor is not None
        # Its tasks end, its heartbeat stays to lapse: as after SIGKILL.
        await stop_tasks([dead._supervisor])
        stopped = time.monotonic()
        # The moment it lapses, everyone at once: the survivors' own watch, each of them asked, and a GET.
        await wait_for(lambda: _gone(store, heartbeat_key("dead")), timeout=10, interval=0.001)
        answers = await asyncio.gather(
            *(survivor._end_lapsed() for survivor in survivors),
            survivors[1].describe(requests[0].request_id, requests[0].cancel_token),
        )
        assert answers[-1]["status"] == Status.OWNER_LOST and answers[-1]["reason"] == Reason.OWNER_LOST
        records = await wait_for(lambda: _all_lost(store, [r.request_id for r in requests[:3]]), timeout=10)
        # Within its TTL and a period, with room for a loaded machine.
        assert time.monotonic() - stopped < 2 * (ttl_s + ttl_s / BEATS_PER_TTL) * UNIT
        assert all(r["reason"] == Reason.OWNER_LOST for r in records)
        await asyncio.gather(*(survivor._end_lapsed() for survivor in survivors))
        logged = [fields for _, fields in await store.xrange(CANCELLATIONS)]
        assert sorted(r["request_id"] for r in logged) == sorted(r.request_id for r in requests[:3])
        assert {r["replica_id"] for r in logged} == {"dead"}
        assert {r["ended_by"] for r in logged} <= {"s1", "s2", "s3"}
        assert (await store.hgetall(generation_key(requests[3].request_id)))["status"] == Status.FINISHED
        assert len(logs.records(StoreEvent.REPLICA_LOST, incarnation=dead.incarnation)) == 1
        assert not await store.hexists(INCARNATIONS, dead.incarnation) and not await store.exists(live)
        # It had only stalled: its writes resume, and leave owner_lost as it is.
        dead._supervisor = asyncio.get_running_loop().create_task(dead._supervise())
        await wait_for(lambda: dead.state is StoreState.UP, timeout=10)
        registry.end(requests[0], Ending(Outcome.DONE, str(Reason.EOS), tokens_generated=9))
        registry.end(requests[1], Ending(Outcome.CANCELLED, str(Reason.USER_CANCELLED), tokens_generated=9))
        await wait_for(lambda: not dead.health()["queued_writes"] and not dead._sending, timeout=10)
        for request in requests[:2]:
            assert (await store.hgetall(generation_key(request.request_id)))["status"] == Status.OWNER_LOST
        assert len(await store.xrange(CANCELLATIONS)) == 3
    finally:
        await store.aclose()
        for cluster in clusters:
            await cluster.close()
        redis_server.kill()


async def _gone(store: aioredis.Redis, key: str) -> bool:
    return not await store.exists(key)


async def _members(store: aioredis.Redis, key: str, count: int) -> bool:
    return await store.scard(key) == count


async def test_a_task_using_redis_ends_even_if_a_cancel_is_lost(tmp_path):
    """Tasks that send nothing but commands, with the client the cluster makes, cancelled at many moments: a
    cancel alone may leave one running (on Python 3.11, stop_tasks says why); stop_tasks ends every one.
    A lost cancel costs stop_tasks many rounds on a loaded machine, and one is the case it is for."""
    redis_server = RedisServer(tmp_path).start(10 * UNIT)
    client = Cluster(redis_server.url, Registry(), Metrics()).client

    async def commands() -> None:
        while True:
            await client.set("key", "value")

    lost = 0
    try:
        for attempt in range(20):
            task = asyncio.create_task(commands())
            await asyncio.sleep(attempt * 0.0001)
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=0.01)
            lost += not done
            # A guard against a hang, not a bound: on a loaded machine most cancels of this loop are lost,
            # so stop_tasks may take dozens of rounds.
            async with asyncio.timeout(120 * UNIT):
                await stop_tasks([task])
            assert task.cancelled()
            if lost:
                break
    finally:
        await client.aclose()
        redis_server.kill()
    if sys.version_info < (3, 12):
        assert lost, "no cancel was lost: the test did not reach the case stop_tasks is for"


async def _answered_by(answer) -> bool:
    with contextlib.suppress(Exception):
        return bool(await answer)
    return False


async def test_without_redis_url_the_store_is_this_process(server, http):
    """No --redis-url: nothing of the shared store shows, and an unknown id is simply unknown."""
    async with http.get(f"{server.http_url}/healthz") as response:
        assert (await response.json())["store"] == {"type": "memory"}
    async with http.get(f"{server.http_url}/metrics") as response:
        text = await response.text()
    assert "stopline_redis_up" not in text and "stopline_store_writes" not in text
    status, body, replica = await call(http, "DELETE", server.http.base_url, "elsewhere", "token")
    assert (status, body["code"], replica) == (404, ErrorCode.UNKNOWN_REQUEST, None)


async def test_the_log_records_cancels_and_timeouts_not_finished_ones(tmp_path):
    redis_server = RedisServer(tmp_path).start(10 * UNIT)
    registry = Registry()
    cluster = Cluster(redis_server.url, registry, Metrics())
    registry.listener = cluster
    await cluster.start("solo")
    store = store_client(redis_server)
    try:
        await wait_for(lambda: cluster.state is StoreState.UP, timeout=10)
        endings = [
            Ending(Outcome.DONE, str(Reason.EOS), tokens_generated=5),
            Ending(Outcome.TIMEOUT, str(Reason.FIRST_TOKEN_TIMEOUT), prompt_tokens_evaluated=7),
            Ending(
                Outcome.CANCELLED,
                str(Reason.CLIENT_DISCONNECTED),
                prompt_tokens_evaluated=3,
                tokens_generated=2,
                cancel_latency_ms=1.5,
            ),
        ]
        requests = [_request(n) for n in range(len(endings))]
        for request, ending in zip(requests, endings):
            registry.add(request, None)
            registry.end(request, ending)
        records = await wait_for(lambda: _stream_of(store, 2), timeout=10)
        assert [(r["event"], r["request_id"], r["reason"], r["user_id"]) for r in records] == [
            ("generation_timeout", requests[1].request_id, Reason.FIRST_TOKEN_TIMEOUT, "user-1"),
            ("generation_cancelled", requests[2].request_id, Reason.CLIENT_DISCONNECTED, "user-2"),
        ]
        # A timeout has no cancel latency; a cancel has.
        assert "cancel_latency_ms" not in records[0] and float(records[1]["cancel_latency_ms"]) == 1.5
        assert [int(r["tokens_wasted"]) for r in records] == [7, 5]
        statuses = [(await store.hgetall(generation_key(r.request_id)))["status"] for r in requests]
        assert statuses == [Status.FINISHED, Status.TIMEOUT, Status.CANCELLED]
    finally:
        await store.aclose()
        await cluster.close()
        redis_server.kill()


async def _stream_of(store: aioredis.Redis, count: int) -> list[dict] | None:
    records = [fields for _, fields in await store.xrange(CANCELLATIONS)]
    return records if len(records) >= count else None


async def test_an_admission_cancelled_while_redis_is_asked_ends_cancelled(tmp_path):
    """A request whose client leaves while its quota is asked of Redis ends there, although the Redis
    client may lose the cancel (on Python 3.11; stop_tasks says why): it is never admitted after it."""
    redis_server = RedisServer(tmp_path).start(10 * UNIT)
    cluster = Cluster(redis_server.url, Registry(), Metrics())
    await cluster.start("solo")
    quotas = Quotas(Metrics(), cluster)
    key = ApiKey("k1", "alice", "0" * 64, Quota(requests_per_minute=1_000_000))
    cancelled_in_flight = 0
    try:
        await wait_for(lambda: cluster.state is StoreState.UP, timeout=10)
        for attempt in range(300):
            admission = asyncio.create_task(quotas.admit(key, f"r{attempt}", 5))
            await asyncio.sleep(attempt % 30 * 0.0001)
            if admission.cancel():
                cancelled_in_flight += 1
                await asyncio.wait([admission])
                assert admission.cancelled(), f"admission {attempt} went on after its cancel"
            quotas.release(f"r{attempt}", 0)
    finally:
        await quotas.close()
        await cluster.close()
        redis_server.kill()
    assert cancelled_in_flight, "no admission was cancelled in flight: the test did not reach its case"
