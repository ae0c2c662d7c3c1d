"""API keys and quotas on one server: who may generate, as whom, and how much (docs/http.md#api-keys).

Real model, real servers on port 0, real WebSocket and HTTP clients. The
quotas across replicas, through nginx and Redis, are in test_auth_cluster.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import stat
import subprocess

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from bench.launch import run_stopline
from stopline.__main__ import main as stopline_main
from stopline.__main__ import parse_args, settings_from
from stopline.app import StoplineServer
from stopline.auth import (
    KeyFileError,
    Keyring,
    Quota,
    add_key,
    key_digest,
    read_keys_file,
    revoke_key,
    subprotocol_key,
)
from stopline.protocol.vocabulary import ErrorCode, KeyEvent, QuotaLimit, Refusal
from stopline.settings import Settings
from support import CHAT_FRANCE, LONG_ANSWER, UNIT, Client, http_get, metric_value, running_server, wait_for

METRICS_KEY = "metrics-key-0123456789"


class Keys:
    """A keys file with a few users, and the keys that `add_key` printed once."""

    def __init__(self, path):
        self.path = path
        self.keys: dict[str, str] = {}
        self.ids: dict[str, str] = {}

    def add(self, user: str, **limits) -> str:
        key, entry = add_key(self.path, user, Quota(**limits))
        self.keys[user], self.ids[user] = key, entry.key_id
        return key


@contextlib.asynccontextmanager
async def keyed_server(engine, tmp_path, **config):
    keys = Keys(tmp_path / "keys.jsonl")
    keys.add("alice")
    keys.add("bob")
    async with running_server(engine, api_keys_file=str(keys.path), metrics_key=METRICS_KEY, **config) as server:
        server.keys = keys
        yield server


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@contextlib.asynccontextmanager
async def ws_client(server, key: str | None = None, **kwargs):
    headers = bearer(key) if key is not None else None
    async with connect(server.ws_url, additional_headers=headers, **kwargs) as websocket:
        client = Client(websocket)
        client.hello = json.loads(await websocket.recv())
        yield client


def all_text(server, logs) -> str:
    return "\n".join(logs.lines) + server.metrics.render().decode()


# The keys file and the command ---------------------------------------------------------------


def test_keys_add_list_revoke(tmp_path, capsys):
    path = tmp_path / "keys.jsonl"
    code = stopline_main(["keys", "add", "alice", "--file", str(path), "--concurrent", "2", "--max-prompt-tokens", "9"])
    out, err = capsys.readouterr()
    key = out.strip()
    assert code == 0 and key.startswith("stopline_") and key not in err and "shown only this once" in err
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    text = path.read_text()
    assert key not in text and key_digest(key) in text
    [entry] = read_keys_file(path)
    assert entry.user == "alice" and entry.key_id.startswith("alice-")
    assert entry.quota == Quota(concurrent=2, max_prompt_tokens=9)
    assert Keyring(path=str(path)).lookup(key) == entry
    assert Keyring(path=str(path)).lookup(key + "x") is None and Keyring(path=str(path)).lookup(None) is None
    assert stopline_main(["keys", "add", "bob", "--file", str(path), "--id", "bob-1", "--priority", "-1"]) == 0
    bob = capsys.readouterr().out.strip()
    assert Keyring(path=str(path)).lookup(bob).priority == -1 and entry.priority == 0
    assert stopline_main(["keys", "list", "--file", str(path)]) == 0
    listed = capsys.readouterr().out
    assert f"{entry.key_id}\talice\tconcurrent=2, max_prompt_tokens=9" in listed
    assert "bob-1\tbob\tno limits, priority=-1" in listed
    assert key not in listed and bob not in listed
    assert stopline_main(["keys", "revoke", "bob-1", "--file", str(path)]) == 0
    assert [k.key_id for k in read_keys_file(path)] == [entry.key_id]
    assert stopline_main(["keys", "revoke", "bob-1", "--file", str(path)]) == 1
    assert stopline_main(["keys", "add", "carol", "--file", str(path), "--id", entry.key_id]) == 2
    assert "exists already" in capsys.readouterr().err


def test_keys_add_without_a_file_uses_the_config_folder_and_says_where(tmp_path):
    # A new user's first command: no --file, no STOPLINE_API_KEYS_FILE.
    environ = {k: v for k, v in os.environ.items() if k != "STOPLINE_API_KEYS_FILE"}
    environ["XDG_CONFIG_HOME"] = str(tmp_path / "config")

    def keys(*args: str) -> subprocess.CompletedProcess:
        return run_stopline("keys", *args, env=environ, inherit_env=False, timeout=60 * UNIT)

    added = keys("add", "alice")
    assert added.returncode == 0, added.stderr
    path = tmp_path / "config" / "stopline" / "keys.jsonl"
    key = added.stdout.strip()
    # Where the key went, and how to serve it.
    assert f"added to {path}." in added.stderr and f"--api-keys-file {path}" in added.stderr
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert Keyring(path=str(path)).lookup(key).user == "alice"
    assert keys("path").stdout.strip() == str(path)
    assert keys("list").stdout.startswith("alice-")
    # The server takes the same file from the command the docs give.
    args = parse_args(["--api-keys-file", keys("path").stdout.strip()])
    assert settings_from(args).api_keys_file == str(path)


@pytest.mark.parametrize(
    "line, error",
    [
        ("not json", "not a JSON object"),
        ('{"id": "a b", "user": "u", "sha256": "' + "0" * 64 + '"}', "id must be"),
        ('{"id": "a", "user": "u", "sha256": "abc"}', "sha256 must be"),
        (
            '{"id": "a", "user": "u", "sha256": "' + "0" * 64 + '", "limits": {"concurrent": 0}}',
            "limits.concurrent must be a positive",
        ),
        ('{"id": "a", "user": "u", "sha256": "' + "0" * 64 + '", "limits": {"bananas": 1}}', "limits may hold only"),
        ('{"id": "a", "user": "u", "sha256": "' + "0" * 64 + '", "priority": "high"}', "priority must be an integer"),
    ],
)
def test_a_bad_entry_is_named_with_its_line(tmp_path, line, error):
    path = tmp_path / "keys.jsonl"
    path.write_text("# keys\n\n" + line + "\n")
    with pytest.raises(KeyFileError, match=rf"keys.jsonl:3: {error}"):
        read_keys_file(path)


def test_a_browser_sends_its_key_as_a_subprotocol():
    assert subprotocol_key(["stopline, stopline.bearer.abc-DEF_123"]) == "abc-DEF_123"
    assert subprotocol_key(["stopline", "stopline.bearer.k"]) == "k"
    assert subprotocol_key(["stopline"]) is None and subprotocol_key([]) is None


def test_revoke_keeps_other_lines_and_is_atomic(tmp_path):
    path = tmp_path / "keys.jsonl"
    path.write_text("# ops team\n")
    first, a = add_key(path, "a", Quota())
    _, b = add_key(path, "b", Quota())
    assert revoke_key(path, a.key_id)
    assert path.read_text().startswith("# ops team\n") and [k.key_id for k in read_keys_file(path)] == [b.key_id]
    assert Keyring(path=str(path)).lookup(first) is None


# Where keys are checked -------------------------------------------------------------------------


async def test_the_websocket_asks_for_a_key(engine, tmp_path, logs):
    async with keyed_server(engine, tmp_path) as server:
        alice = server.keys.keys["alice"]
        # No key, and a wrong one: an error frame that says which, then close code 4401.
        for headers, says in ((None, "none was sent"), (bearer("stopline_not-a-key-at-all"), "not one of its keys")):
            async with connect(server.ws_url, additional_headers=headers) as websocket:
                frame = json.loads(await websocket.recv())
                assert frame["type"] == "error" and frame["code"] == ErrorCode.UNAUTHORIZED
                assert says in frame["message"], frame
                with pytest.raises(ConnectionClosed):
                    await websocket.recv()
                assert websocket.close_code == 4401
        # The Authorization header of the handshake.
        async with ws_client(server, alice) as client:
            assert client.hello["type"] == "hello"
            assert (await client.generate("r1", messages=CHAT_FRANCE, max_tokens=4))["type"] == "accepted"
            assert (await client.terminal("r1"))["type"] == "done"
        # A browser's subprotocols: the server selects "stopline" and never echoes the key.
        async with connect(server.ws_url, subprotocols=["stopline", f"stopline.bearer.{alice}"]) as websocket:
            assert websocket.subprotocol == "stopline"
            assert alice not in str(websocket.response.headers)
            assert json.loads(await websocket.recv())["type"] == "hello"
        async with connect(server.ws_url, subprotocols=["stopline", "stopline.bearer.wrong-key-0123456789"]) as ws:
            # A wrong key from a browser reads as a wrong key from any client.
            frame = json.loads(await ws.recv())
            assert frame["code"] == ErrorCode.UNAUTHORIZED and "not one of its keys" in frame["message"]
        metrics = server.metrics.render().decode()
        assert metric_value(metrics, "stopline_refused_connections_total", code=Refusal.UNAUTHORIZED) == 3
        assert logs.records(KeyEvent.REFUSED, where="/ws")
        assert alice not in all_text(server, logs)


async def test_healthz_stays_open_and_metrics_has_its_own_key(engine, tmp_path, logs):
    async with keyed_server(engine, tmp_path) as server:
        assert (await http_get(server, "/healthz"))[0] == 200
        assert (await http_get(server, "/"))[0] == 200
        for headers in (None, bearer(server.keys.keys["alice"]), bearer("metrics-key-0123456780")):
            status, body = await http_get(server, "/metrics", headers)
            assert status == 401 and body.startswith("unauthorized:"), (status, body)
        status, body = await http_get(server, "/metrics", bearer(METRICS_KEY))
        assert status == 200 and "stopline_requests_total" in body
        assert METRICS_KEY not in "\n".join(logs.lines)


async def test_the_http_api_asks_for_a_key_and_names_the_user(engine, tmp_path, logs, http):
    async with keyed_server(engine, tmp_path) as server:
        api, alice = server.http.base_url, server.keys.keys["alice"]
        body = {"messages": CHAT_FRANCE, "max_tokens": 4, "user": "alice-says-she-is-root"}
        # Each refusal says which it was (no key, a wrong one, no Bearer key), and nothing of the keys there are.
        told = {}
        for case, headers in (
            ("none", {}),
            ("wrong", bearer("wrong-key-0123456789")),
            ("other scheme", {"Authorization": f"Basic {alice}"}),
        ):
            for method, path in (("POST", "/chat/completions"), ("POST", "/generations"), ("GET", "/models")):
                async with http.request(method, api + path, json=body, headers=headers) as response:
                    assert response.status == 401, (method, path, headers)
                    assert response.headers["WWW-Authenticate"] == 'Bearer realm="stopline"'
                    error = (await response.json())["error"]
                    assert error["code"] == ErrorCode.UNAUTHORIZED and error["type"] == "authentication_error"
                    told.setdefault(case, set()).add(error["message"])
        assert all(len(messages) == 1 for messages in told.values())
        assert "none was sent" in next(iter(told["none"]))
        assert "not one of its keys" in next(iter(told["wrong"]))
        assert "Authorization header holds none" in next(iter(told["other scheme"]))
        # A key of the right shape, one revoked and one never made: the same words.
        async with http.get(api + "/models", headers=bearer("stopline_" + "x" * 43)) as response:
            assert (await response.json())["error"]["message"] in told["wrong"]
        async with http.post(api + "/chat/completions", json=body, headers=bearer(alice)) as response:
            assert response.status == 200
            request_id = (await response.json())["id"]
        # The key's user is user_id; what the client said is only a label.
        [accepted] = logs.records("generation_accepted", request_id=request_id)
        [end] = logs.records("generation_done", request_id=request_id)
        for record in (accepted, end):
            assert record["user_id"] == "alice" and record["key_id"] == server.keys.ids["alice"]
            assert record["user"] == "alice-says-she-is-root"
        metrics = server.metrics.render().decode()
        assert metric_value(metrics, "stopline_key_requests_total", key_id=server.keys.ids["alice"], outcome="done")
        assert metric_value(metrics, "stopline_key_tokens_generated_total", key_id=server.keys.ids["alice"]) >= 1
        assert alice not in all_text(server, logs)


async def test_a_delete_takes_the_cancel_token_or_the_key_that_started_it(engine, tmp_path, logs, http):
    async with keyed_server(engine, tmp_path) as server:
        api, alice, bob = server.http.base_url, server.keys.keys["alice"], server.keys.keys["bob"]
        async with ws_client(server, alice) as client:
            accepted = await client.generate("long", messages=LONG_ANSWER, max_tokens=1500)
            request_id = accepted["request_id"]
            await client.recv_until(lambda f: f["type"] == "token")
            # Another user's key is no credential for it, whatever it may start itself.
            async with http.delete(f"{api}/generations/{request_id}", headers=bearer(bob)) as response:
                assert response.status == 403 and (await response.json())["code"] == ErrorCode.INVALID_CANCEL_TOKEN
            async with http.get(f"{api}/generations/{request_id}", headers=bearer(alice)) as response:
                assert response.status == 200 and (await response.json())["status"] in ("prefill", "decoding")
            async with http.delete(f"{api}/generations/{request_id}", headers=bearer(alice)) as response:
                assert (response.status, (await response.json())["status"]) == (200, "cancelled")
            assert (await client.terminal("long"))["reason"] == "user_cancelled"
            # The cancel token works as before, with or without a key.
            async with http.delete(f"{api}/generations/{request_id}", headers=bearer(accepted["cancel_token"])) as r:
                assert (r.status, (await r.json())["status"]) == (200, "cancelled")


async def test_a_revoked_key_is_refused_on_an_open_connection_after_a_reload(engine, tmp_path, logs):
    async with keyed_server(engine, tmp_path) as server:
        alice = server.keys.keys["alice"]
        async with ws_client(server, alice) as client:
            assert (await client.generate("r1", messages=CHAT_FRANCE, max_tokens=2))["type"] == "accepted"
            await client.terminal("r1")
            assert revoke_key(server.keys.path, server.keys.ids["alice"])
            server.reload_keys()
            assert logs.records(KeyEvent.LOADED, keys=1)
            refused = await client.generate("r2", messages=CHAT_FRANCE, max_tokens=2)
            assert refused["type"] == "error" and refused["code"] == ErrorCode.UNAUTHORIZED
        # A file broken meanwhile keeps the keys in force.
        server.keys.path.write_text(server.keys.path.read_text() + "not json\n")
        server.reload_keys()
        assert logs.records(KeyEvent.RELOAD_FAILED, keys=1)
        async with ws_client(server, server.keys.keys["bob"]) as client:
            assert client.hello["type"] == "hello"


async def test_without_keys_nothing_is_asked_and_loopback_says_nothing(server, logs, http):
    async with http.get(f"{server.http.base_url}/models") as response:
        assert response.status == 200
    assert not logs.records(KeyEvent.NONE_CONFIGURED)


async def test_listening_beyond_loopback_without_keys_says_so_once(engine, logs):
    server = StoplineServer(engine, Settings.build(host="0.0.0.0", port=0, http_port=0))
    await server.start()
    await server.shutdown()
    [warning] = logs.records(KeyEvent.NONE_CONFIGURED)
    assert warning["host"] == "0.0.0.0" and "anyone" in warning["detail"]


# Keys and secrets on the command line and in the environment ----------------------------------------

FIRST, SECOND, THIRD = (f"{n}-simple-key-0123456789" for n in ("first", "second", "third"))


def simple_key_id(key: str) -> str:
    # As docs/http.md names a key given without a file: key-<the first 8 hex digits of its SHA-256>.
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


async def chat_as(http, server, key: str) -> tuple[int, dict, dict]:
    async with http.post(
        f"{server.http.base_url}/chat/completions",
        json={"messages": CHAT_FRANCE, "max_tokens": 1},
        headers=bearer(key),
    ) as response:
        return response.status, dict(response.headers), await response.json()


@pytest.mark.parametrize(
    "environment, flags, accepted, refused",
    [
        ("", [FIRST, SECOND], [FIRST, SECOND], [THIRD]),
        (f" {SECOND} ,, {THIRD}", [], [SECOND, THIRD], [FIRST]),
        # The flags add to the environment's keys; a key given in both is one key.
        (f"{THIRD},{FIRST}", [FIRST], [THIRD, FIRST], [SECOND]),
    ],
    ids=["flags", "environment", "both"],
)
async def test_keys_from_api_key_flags_and_stopline_api_keys(
    engine, logs, http, monkeypatch, environment, flags, accepted, refused
):
    monkeypatch.setenv("STOPLINE_API_KEYS", environment)
    args = parse_args([arg for key in flags for arg in ("--api-key", key)])
    async with running_server(engine, api_keys=settings_from(args).api_keys) as server:
        assert len(server.keyring) == len(accepted)
        for key in accepted:
            status, _, body = await chat_as(http, server, key)
            assert status == 200, body
            # Each key is its own user, named by its id in the request's log lines and in the metrics.
            for event in ("generation_accepted", "generation_done"):
                [record] = logs.records(event, request_id=body["id"])
                assert record["user_id"] == record["key_id"] == simple_key_id(key)
            metrics = server.metrics.render().decode()
            assert metric_value(metrics, "stopline_key_requests_total", key_id=simple_key_id(key), outcome="done") == 1
        for key in refused:
            status, headers, body = await chat_as(http, server, key)
            assert (status, body["error"]["code"]) == (401, ErrorCode.UNAUTHORIZED)
            assert headers["WWW-Authenticate"] == 'Bearer realm="stopline"'
        assert not [key for key in (FIRST, SECOND, THIRD) if key in all_text(server, logs)]


def stopline_process(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``python -m stopline`` as a real process, with no STOPLINE_ variable but those in ``env``."""
    environ = {name: value for name, value in os.environ.items() if not name.startswith("STOPLINE_")}
    return run_stopline(*args, env={**environ, **env}, inherit_env=False, timeout=60 * UNIT)


SECRET = "hunter2-0123456789abcdef"


@pytest.mark.parametrize(
    "args, env, secret, named",
    [
        ((), {"STOPLINE_METRICS_KEY": SECRET[:12]}, SECRET[:12], "STOPLINE_METRICS_KEY: an API key must be"),
        # A '/' in a password ends the URL's host part: the URL parser's own message quotes what follows the ':'.
        (
            (),
            {"STOPLINE_REDIS_URL": f"redis://:{SECRET}/x@cache:6379/0"},
            SECRET,
            "STOPLINE_REDIS_URL: not a Redis URL",
        ),
        (("--redis-url", f"redis://:{SECRET}/x@cache:6379/0"), {}, SECRET, "argument --redis-url: not a Redis URL"),
        ((), {"STOPLINE_API_KEYS": f"good-key-0123456789,{SECRET}!"}, SECRET, "STOPLINE_API_KEYS: an API key must be"),
    ],
    ids=["metrics-key", "redis-url-environment", "redis-url-flag", "api-keys"],
)
def test_an_invalid_secret_stops_startup_without_showing_it(args, env, secret, named):
    result = stopline_process(*args, env=env)
    assert result.returncode == 2, result
    # It says which setting is wrong and why, as for any other.
    assert named in result.stderr, result.stderr
    assert secret not in result.stdout + result.stderr


def test_help_never_shows_a_secret_from_the_environment():
    env = {
        "STOPLINE_METRICS_KEY": SECRET,
        "STOPLINE_REDIS_URL": f"redis://:{SECRET}@cache:6379/0",
        "STOPLINE_PORT": "9000",
    }
    result = stopline_process("--help", env=env)
    assert result.returncode == 0, result
    # Other settings from the environment show as the defaults they become.
    assert "(default: 9000)" in result.stdout
    assert SECRET not in result.stdout + result.stderr


# Quotas --------------------------------------------------------------------------------------------


async def quota_refusal(client: Client, name: str, **fields) -> dict:
    frame = await client.generate(name, messages=CHAT_FRANCE, max_tokens=4, **fields)
    assert frame["type"] == "error" and frame["code"] == ErrorCode.QUOTA_EXCEEDED, frame
    return frame


async def test_concurrent_generations_per_key(engine, tmp_path, logs, http):
    async with keyed_server(engine, tmp_path) as server:
        key = server.keys.add("carol", concurrent=1)
        server.reload_keys()
        async with ws_client(server, key) as first, ws_client(server, key) as second:
            assert (await first.generate("a", messages=LONG_ANSWER, max_tokens=1500))["type"] == "accepted"
            refused = await quota_refusal(second, "b")
            assert refused["limit"] == QuotaLimit.CONCURRENT and refused["retry_after_s"] == 1
            async with http.post(
                f"{server.http.base_url}/chat/completions",
                json={"messages": CHAT_FRANCE, "max_tokens": 4},
                headers=bearer(key),
            ) as response:
                assert response.status == 429 and response.headers["Retry-After"] == "1"
                assert (await response.json())["error"]["code"] == ErrorCode.QUOTA_EXCEEDED
            # Another key is not held back.
            async with ws_client(server, server.keys.keys["bob"]) as other:
                assert (await other.generate("c", messages=CHAT_FRANCE, max_tokens=2))["type"] == "accepted"
            await first.send({"type": "cancel", "id": "a"})
            await first.terminal("a")
            assert (await second.generate("d", messages=CHAT_FRANCE, max_tokens=2))["type"] == "accepted"
            await second.terminal("d")
        metrics = server.metrics.render().decode()
        carol = server.keys.ids["carol"]
        assert metric_value(metrics, "stopline_quota_refusals_total", key_id=carol, limit="concurrent") == 2
        assert metric_value(metrics, "stopline_requests_total", outcome="error", reason="quota_exceeded") == 2
        [logged, _] = logs.records("generation_error", reason="quota_exceeded")
        assert logged["limit"] == "concurrent" and logged["user_id"] == "carol" and logged["key_id"] == carol
        assert key not in all_text(server, logs)


async def test_requests_tokens_and_prompt_length_per_key(engine, tmp_path, logs, http):
    async with keyed_server(engine, tmp_path) as server:
        rpm = server.keys.add("dave", requests_per_minute=2)
        tpm = server.keys.add("erin", tokens_per_minute=6)
        short = server.keys.add("fay", max_prompt_tokens=10)
        server.reload_keys()
        async with ws_client(server, rpm) as client:
            for name in ("a", "b"):
                assert (await client.generate(name, messages=CHAT_FRANCE, max_tokens=1))["type"] == "accepted"
                await client.terminal(name)
            refused = await quota_refusal(client, "c")
            # One request comes back every 30 s; the two were taken within a few seconds.
            assert refused["limit"] == QuotaLimit.REQUESTS_PER_MINUTE and 20 <= refused["retry_after_s"] <= 30
        async with ws_client(server, tpm) as client:
            assert (await client.generate("a", messages=LONG_ANSWER, max_tokens=10))["type"] == "accepted"
            assert (await client.terminal("a"))["tokens_generated"] == 10
            # 10 generated of 6 a minute: in debt until 4 + 1 have come back, 10 tokens a minute.
            refused = await quota_refusal(client, "b")
            assert refused["limit"] == QuotaLimit.TOKENS_PER_MINUTE and 40 <= refused["retry_after_s"] <= 50
        async with http.post(
            f"{server.http.base_url}/chat/completions",
            json={"messages": LONG_ANSWER, "max_tokens": 4},
            headers=bearer(short),
        ) as response:
            assert response.status == 429 and "Retry-After" not in response.headers
            # Waiting will not help: the openai package does not retry such an answer.
            assert response.headers["X-Should-Retry"] == "false"
            error = (await response.json())["error"]
            assert error["code"] == ErrorCode.QUOTA_EXCEEDED and "at most 10" in error["message"]
        async with ws_client(server, short) as client:
            assert (await client.generate("ok", prompt="Hi", max_tokens=1))["type"] == "accepted"
        for key in (rpm, tpm, short):
            assert key not in all_text(server, logs)


async def test_a_client_that_leaves_frees_its_place(engine, tmp_path, logs, http):
    """concurrent=1: each HTTP client that goes away mid-generation lets the next one in."""
    async with keyed_server(engine, tmp_path) as server:
        key = server.keys.add("gus", concurrent=1)
        server.reload_keys()
        for attempt in range(3):
            task = asyncio.create_task(
                http.post(
                    f"{server.http.base_url}/chat/completions",
                    json={"messages": LONG_ANSWER, "max_tokens": 1500},
                    headers=bearer(key),
                )
            )
            await wait_for(lambda: len(logs.records("generation_accepted", user_id="gus")) > attempt, timeout=60)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await wait_for(lambda: len(logs.records("generation_cancelled", user_id="gus")) > attempt, timeout=60)
        assert not logs.records("generation_error", reason="quota_exceeded")
        assert not server.quotas.local.held()


async def test_a_reload_that_changes_a_keys_limits_applies_to_open_connections(engine, tmp_path, logs):
    async with keyed_server(engine, tmp_path) as server:
        key = server.keys.add("hana", concurrent=1)
        server.reload_keys()
        async with ws_client(server, key) as client:
            assert (await client.generate("a", messages=LONG_ANSWER, max_tokens=1500))["type"] == "accepted"
            assert (await quota_refusal(client, "b"))["limit"] == QuotaLimit.CONCURRENT
            path = server.keys.path
            path.write_text(path.read_text().replace('"limits": {"concurrent": 1}', '"limits": {"concurrent": 2}'))
            server.reload_keys()
            # The same key, now allowed two: the connection opened before the reload may start a second.
            assert (await client.generate("c", messages=CHAT_FRANCE, max_tokens=2))["type"] == "accepted"
            await client.send({"type": "cancel", "id": "a"})
            await client.terminal("a")


@pytest.mark.slow
async def test_the_terminal_client_sends_stopline_api_key(engine, tmp_path, logs):
    async with keyed_server(engine, tmp_path) as server:

        async def client(**extra) -> tuple[int, str, str]:
            environ = {k: v for k, v in os.environ.items() if not k.startswith("STOPLINE_")}
            args = ("--url", server.ws_url, "--max-tokens", "4", "What is the capital of France?")
            result = await asyncio.to_thread(
                run_stopline,
                *args,
                module="stopline.client",
                env={**environ, **extra},
                inherit_env=False,
                timeout=60 * UNIT,
            )
            return result.returncode, result.stdout, result.stderr

        code, _, err = await client()
        assert code == 1 and "the server needs an API key: set STOPLINE_API_KEY" in err
        code, _, err = await client(STOPLINE_API_KEY="stopline_wrong-0123456789")
        assert code == 1 and "the server refused the key in STOPLINE_API_KEY" in err
        code, out, err = await client(STOPLINE_API_KEY=server.keys.keys["bob"])
        assert code == 0 and out.strip() and "[done" in err
        assert logs.records("generation_done", user_id="bob")
