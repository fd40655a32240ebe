"""Clients that misbehave, and what they must not do to the service: real Redis,
real frontends (in-process or a real process where memory or logs are
measured), real sockets. Each test failed before its fix."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from tests.stack import Client, Stack, port_from_banner, start_frontend
from tests.wsinfer.test_load import rss_kib
from tests.wsinfer.test_server_e2e import http_get
from wsinfer.protocol import MAX_FOLLOWED_PER_CONNECTION
from wsinfer.server import Frontend
from wsinfer.sessions.schema import DeltaEvent, GenerationParams
from wsinfer.sessions.store import SessionStore, TurnInput
from wsinfer.sessions.worker import Publish, WorkerStore

PROMPT = TurnInput("text", None, "Once upon a time", GenerationParams(temperature=0))


@pytest.fixture
async def frontend(redis_url: str) -> AsyncIterator[Frontend]:
    """A frontend with no engine: sessions are made directly in Redis and stay queued."""
    frontend = await start_frontend(redis_url)
    yield frontend
    await frontend.stop()


async def queued_sessions(aredis: aioredis.Redis, n: int) -> list[tuple[str, str]]:
    store = SessionStore(aredis)
    return [await store.create(PROMPT) for _ in range(n)]


def spawn_frontend(
    redis_url: str, log_path: Path, *extra: str
) -> tuple[subprocess.Popen[bytes], int]:
    """A real frontend process whose log (stderr) goes to ``log_path``."""
    process = subprocess.Popen(
        [sys.executable, "-m", "wsinfer", "frontend", "--port", "0", "--redis-url", redis_url]
        + ["--log-level", "info", *extra],
        stdout=subprocess.PIPE,
        stderr=log_path.open("wb"),
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stdout is not None
    return process, port_from_banner(process.stdout.readline(), "frontend")


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# --- item 5: log flooding ----------------------------------------------------------


async def test_client_mistakes_and_outages_log_a_few_lines_and_no_tracebacks(
    redis_url: str, tmp_path: Path
) -> None:
    log_path = tmp_path / "frontend.log"
    process, port = spawn_frontend(redis_url, log_path, "--request-rate", "100000")
    try:
        client = await Client.open(port)
        for i in range(2000):
            await client.send(type="stop", id=i, session="nope", token="t")
        codes = Counter([(await client.recv())["code"] for _ in range(2000)])
        assert codes == {"not_found": 2000}
        await client.close()
        await asyncio.sleep(0.5)
        lines = log_path.read_text().splitlines()
        refused = [line for line in lines if "request refused" in line]
        assert 1 <= len(refused) <= 10, lines[-20:]
        assert "Traceback" not in log_path.read_text()
    finally:
        stop(process)


async def test_a_redis_outage_logs_a_few_lines_and_no_tracebacks(tmp_path: Path) -> None:
    from wsinfer.supervisor import EmbeddedRedis

    server = EmbeddedRedis(tmp_path / "redis")
    (tmp_path / "redis").mkdir()
    server.start()
    log_path = tmp_path / "frontend.log"
    process, port = spawn_frontend(server.url, log_path, "--request-rate", "100000")
    try:
        client = await Client.open(port)
        server.stop()
        deadline = time.monotonic() + 5
        codes: Counter[str] = Counter()
        while time.monotonic() < deadline:  # clients keep trying through the outage
            await client.send(type="generate", prompt="hi")
            codes[(await client.recv())["code"]] += 1
        assert set(codes) == {"engine_unavailable"} and codes["engine_unavailable"] > 20
        await client.close()
        text = log_path.read_text()
        assert "Traceback" not in text and len(text.splitlines()) <= 20, text[-3000:]
    finally:
        stop(process)


# --- item 6: memory of a client that does not read; request rates --------------------


async def test_a_client_that_never_reads_cannot_grow_the_frontends_memory(
    redis_url: str, aredis: aioredis.Redis, tmp_path: Path
) -> None:
    # One finished turn with a long text, replayed by every resume.
    ((session, token),) = await queued_sessions(aredis, 1)
    worker = WorkerStore(redis.Redis.from_url(redis_url), "engine-x")
    worker.ensure_group()
    claimed = worker.claim(worker.read_work(1, None)[0].request, takeover=False)
    assert claimed is not None
    text = "lorem ipsum " * 8
    steps = [
        Publish(session, 1, claimed.epoch, i, [DeltaEvent(i, text, [1])]) for i in range(1, 2001)
    ]
    for start in range(0, len(steps), 200):
        worker.publish_many(steps[start : start + 200])
    process, port = spawn_frontend(redis_url, tmp_path / "log", "--request-rate", "100000")
    try:
        base = rss_kib(process.pid)
        hog = await Client.open(port, max_queue=4)
        frame = json.dumps({"type": "resume", "session": session, "token": token})
        sent = 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # until the frontend stops reading us
            try:
                await asyncio.wait_for(hog.ws.send(frame), 2)
            except TimeoutError:
                break
            sent += 1
        grown = rss_kib(process.pid) - base
        # A bystander is served at once.
        bystander = await Client.open(port)
        await bystander.send(type="resume", session=session, token=token, after=1999)
        replay = await bystander.until("delta", timeout=10)
        assert replay[-1]["seq"] == 2000
        await bystander.close()
        hog.ws.transport.abort()
        print(
            f"\n{sent} resumes sent by a client that never reads (each replays ~200 KB): "
            f"frontend RSS grew {grown} KiB"
        )
        assert sent > 10 and grown < 64 * 1024
    finally:
        stop(process)


async def test_requests_beyond_the_rate_get_overloaded_with_retry_after(
    redis_url: str,
) -> None:
    frontend = await start_frontend(redis_url, request_rate=20.0)
    try:
        client = await Client.open(frontend.port)
        for i in range(200):
            await client.send(type="stop", id=i, session="nope", token="t")
        answers = [await client.recv() for _ in range(200)]
        codes = Counter(a["code"] for a in answers)
        assert codes["not_found"] >= 40 and codes["overloaded"] >= 100, codes
        limited = [a for a in answers if a["code"] == "overloaded"]
        assert all(0 < a["retry_after"] <= 1 and "id" in a for a in limited)
        await asyncio.sleep(limited[-1]["retry_after"] + 0.1)
        await client.send(type="stop", session="nope", token="t")
        assert (await client.recv())["code"] == "not_found"  # served again
        await client.close()
    finally:
        await frontend.stop()


# --- items 7 and 8: following sessions ------------------------------------------------


async def test_resume_counts_against_the_sessions_per_connection_limit(
    frontend: Frontend, aredis: aioredis.Redis
) -> None:
    sessions = await queued_sessions(aredis, MAX_FOLLOWED_PER_CONNECTION + 1)
    client = await Client.open(frontend.port)
    for i, (session, token) in enumerate(sessions):
        await client.send(type="resume", id=i, session=session, token=token)
    # Queued turns replay nothing: the answers are `session`s, then one refusal.
    answers = await client.until("error", timeout=10)
    assert [a["id"] for a in answers[:-1]] == list(range(MAX_FOLLOWED_PER_CONNECTION))
    refused = answers[-1]
    assert (refused["code"], refused["id"]) == ("overloaded", MAX_FOLLOWED_PER_CONNECTION)
    (session, token) = sessions[0]
    await client.send(type="resume", id="again", session=session, token=token)  # already followed
    await client.send(type="pause", id="p", session=sessions[-1][0], token=sessions[-1][1])
    again, refused = await client.recv(timeout=10), await client.recv(timeout=10)
    assert (again["type"], again["id"]) == ("session", "again")
    assert (refused["code"], refused["id"]) == ("overloaded", "p")
    await client.close()


async def test_a_follower_of_a_session_closed_elsewhere_gets_done(
    frontend: Frontend, aredis: aioredis.Redis
) -> None:
    ((session, token),) = await queued_sessions(aredis, 1)
    owner, follower = await Client.open(frontend.port), await Client.open(frontend.port)
    await follower.send(type="resume", session=session, token=token)
    assert (await follower.recv(timeout=10))["type"] == "session"
    await asyncio.sleep(0.3)
    await owner.send(type="close", session=session, token=token)
    done = await follower.recv(timeout=10)
    assert (done["type"], done["finish_reason"], done["session"]) == ("done", "cancelled", session)
    await owner.close()
    await follower.close()


async def test_a_follower_of_a_session_that_vanished_is_told(
    frontend: Frontend, aredis: aioredis.Redis
) -> None:
    ((session, token),) = await queued_sessions(aredis, 1)
    follower = await Client.open(frontend.port)
    await follower.send(type="resume", session=session, token=token)
    assert (await follower.recv(timeout=10))["type"] == "session"
    await asyncio.sleep(0.3)
    await aredis.flushall()  # what a Redis restarted without persistence looks like
    done = await follower.recv(timeout=10)
    assert done["type"] == "done" and done["error"]["code"] == "not_found"
    await follower.close()


# --- item 9: a short idle limit ------------------------------------------------------------


@pytest.mark.timeout(240)
async def test_a_watched_turn_is_not_paused_under_a_short_idle_limit(stack: Stack) -> None:
    # 3 s: the frontend touches every 0.75 s, so a loaded machine may stall it
    # for two seconds without the engine taking the turn for unwatched. A paced
    # engine (300 tokens/s) makes the turn outlast the watch on any machine.
    stack.start_engine("engine-1", "--idle-pause", "3", "--model", "fake:300")
    _, port = stack.start_frontend("--idle-pause", "3")
    client = await Client.open(port)
    params = {"temperature": 0, "max_new_tokens": 4000}
    await client.send(type="generate", prompt="Once", params=params)
    session = await client.recv()
    messages = []
    watch_until = time.monotonic() + 7  # watched for over two idle limits
    while time.monotonic() < watch_until:
        messages.append(await client.recv(timeout=30))
        assert messages[-1]["type"] == "delta", f"the watched turn stopped: {messages[-1]}"
    await client.send(type="stop", session=session["session"], token=session["token"])
    messages += await client.until("done", timeout=60)
    assert messages[-1]["finish_reason"] == "cancelled"
    await client.close()


# --- item 11: /healthz, origins ------------------------------------------------------------


async def test_healthz_does_not_reveal_where_redis_is(tmp_path: Path) -> None:
    from wsinfer.supervisor import EmbeddedRedis

    server = EmbeddedRedis(tmp_path)
    server.start()
    frontend = await start_frontend(server.url)
    try:
        server.stop()
        status, body = await http_get(frontend.port, "/healthz")
        assert status == 503 and body == "redis unavailable\n"
    finally:
        await frontend.stop()


@pytest.mark.parametrize(
    ("origin", "allowed", "ok"),
    [
        (None, frozenset(), True),  # not a browser
        ("http://localhost:5173", frozenset(), True),
        ("http://127.0.0.1:9", frozenset(), True),
        ("https://evil.example", frozenset(), False),
        ("null", frozenset(), False),
        ("https://app.example", frozenset({"https://app.example"}), True),
        ("https://evil.example", frozenset({"*"}), True),
    ],
)
async def test_web_origins_are_checked_at_the_handshake(
    redis_url: str, origin: str | None, allowed: frozenset[str], ok: bool
) -> None:
    frontend = await start_frontend(redis_url, allowed_origins=allowed)
    url = f"ws://127.0.0.1:{frontend.port}/v1/ws"
    headers = {"Origin": origin} if origin else {}
    try:
        if ok:
            async with connect(url, additional_headers=headers):
                pass
        else:
            with pytest.raises(InvalidStatus) as refused:
                await connect(url, additional_headers=headers)
            assert refused.value.response.status_code == 403
    finally:
        await frontend.stop()


async def test_the_servers_own_page_may_connect(redis_url: str) -> None:
    frontend = await start_frontend(redis_url, host="127.0.0.2")
    own = f"http://127.0.0.2:{frontend.port}"
    try:
        async with connect(f"ws://127.0.0.2:{frontend.port}/v1/ws", origin=own):  # type: ignore[arg-type]
            pass
    finally:
        await frontend.stop()
