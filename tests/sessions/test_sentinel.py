"""Redis Sentinel through ``redis+sentinel://``: a primary, a replica and one
Sentinel on localhost; after a failover the same clients find the new primary
and the session (replicated) is still there."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.cluster import free_ports
from wsinfer.sessions.connect import async_client, sync_client
from wsinfer.sessions.schema import GenerationParams
from wsinfer.sessions.store import SessionStore, TurnInput

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
TEXT = TurnInput("text", None, "Once upon", GenerationParams(temperature=0))


def _start(command: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait(port: int) -> None:
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)
    for _ in range(100):
        with contextlib.suppress(redis.ConnectionError):
            if client.ping():
                return
        time.sleep(0.05)
    raise TimeoutError(port)


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[tuple[str, list[int]]]:
    primary, replica, sentinel_port = free_ports(3)
    # No diskless-sync delay (5 s by default): the replica is in sync, and a
    # candidate for Sentinel, as soon as it connects. The replica writes the
    # synced RDB to its --dir, so that is the test's own, not the checkout.
    base = [
        "redis-server", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--repl-diskless-sync-delay", "0", "--dir", str(tmp_path),
    ]  # fmt: skip
    processes = [
        _start([*base, "--port", str(primary)]),
        _start([*base, "--port", str(replica), "--replicaof", "127.0.0.1", str(primary)]),
    ]
    config = tmp_path / "sentinel.conf"
    config.write_text(
        f"port {sentinel_port}\nbind 127.0.0.1\n"
        f"sentinel monitor wsinfer 127.0.0.1 {primary} 1\n"
        "sentinel down-after-milliseconds wsinfer 1000\n"
        "sentinel failover-timeout wsinfer 5000\n"
    )
    processes.append(_start(["redis-server", str(config), "--sentinel"]))
    try:
        for port in (primary, replica, sentinel_port):
            _wait(port)
        yield (
            f"redis+sentinel://127.0.0.1:{sentinel_port}/wsinfer",
            [primary, replica, sentinel_port],
        )
    finally:
        for process in processes:
            process.kill()
            process.wait()


def _state(sentinel_client: redis.Redis, replica: int) -> str:
    """What Sentinel and the replica say, for a failover that did not happen."""
    parts = []
    for name, ask in (
        ("sentinel", lambda: sentinel_client.execute_command("SENTINEL", "MASTER", "wsinfer")),
        ("replicas", lambda: sentinel_client.execute_command("SENTINEL", "REPLICAS", "wsinfer")),
        ("replica", lambda: redis.Redis(port=replica).info("replication")),
    ):
        try:
            parts.append(f"{name}: {ask()!r}")
        except redis.RedisError as exc:
            parts.append(f"{name}: {exc!r}")
    return "; ".join(parts)


def _failed_over(sentinel_client: redis.Redis, replica: int) -> bool:
    """True once the replica is the primary; until then each call asks Sentinel for a
    failover (INPROG while one is under way; NOGOODSLAVE until Sentinel has learnt of
    the replica from the primary's INFO, every 10 s)."""
    with contextlib.suppress(redis.RedisError):
        if redis.Redis(host="127.0.0.1", port=replica).execute_command("ROLE")[0] == b"master":
            return True
    try:
        sentinel_client.execute_command("SENTINEL", "FAILOVER", "wsinfer")
    except redis.ResponseError as exc:
        # INPROG: one is under way (Sentinel may start one itself: a slow PING on a
        # loaded machine reads as a primary down for 1 s).
        if "INPROG" not in str(exc) and "NOGOODSLAVE" not in str(exc):
            raise
    return False


async def test_sessions_survive_a_sentinel_failover(sentinel: tuple[str, list[int]]) -> None:
    url, (primary, replica, sentinel_port) = sentinel
    store = SessionStore(async_client(url), ttl_s=60)
    session, token = await store.create(TEXT)
    engine_side = sync_client(url)
    assert engine_side.hget(f"wsinfer:{{{session}}}:meta", "status") == b"queued"
    sentinel_client = redis.Redis(host="127.0.0.1", port=sentinel_port)
    # A failover asked for with SENTINEL FAILOVER is tried once: one that times out
    # (5 s; a loaded machine was seen to) leaves the primary as it was, and Sentinel
    # does not try again while the primary answers. So ask until the replica leads.
    deadline = time.monotonic() + 90
    while not _failed_over(sentinel_client, replica):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no failover: {_state(sentinel_client, replica)}")
        time.sleep(0.2)
    for _ in range(50):  # the old primary's connections are dropped; the clients ask again
        with contextlib.suppress(redis.RedisError):
            info = await store.info(session, token)
            break
        time.sleep(0.2)
    assert info.status == "queued"
    second, _ = await store.create(TEXT)  # writes go to the new primary
    assert engine_side.exists(f"wsinfer:{{{second}}}:meta") == 1
    await store.redis.aclose()
