"""A session's hash slot moves to another primary mid-turn, or its primary
hands over to its replica (``CLUSTER FAILOVER``) mid-turn: the client sees
exactly the text of an uninterrupted greedy run, each seq once, in order,
whether it stays connected or drops and resumes while the slot moves."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis

from tests.cluster import LocalCluster, needs_cluster_tools
from tests.stack import Client, joined, start_frontend
from tests.wsinfer.test_server_e2e import PROMPT
from wsinfer.server import Frontend
from wsinfer.sessions import keys

pytestmark = needs_cluster_tools
GREEDY = {"temperature": 0, "max_new_tokens": 300}
# Between keys of the slot: engine and frontend meet ASK and TRYAGAIN replies
# for about a second, longer than redis-py retries a TRYAGAIN by default (0.4 s).
KEY_PAUSE_S = 0.25


@pytest.fixture
async def frontend(redis_url: str, engine: object) -> AsyncIterator[Frontend]:
    frontend = await start_frontend(redis_url)
    yield frontend
    await frontend.stop()


async def reference_run(port: int) -> tuple[str, int]:
    client = await Client.open(port)
    await client.send(type="generate", messages=PROMPT, params=GREEDY)
    text, seq = joined(await client.until("done"))
    await client.close()
    return text, seq


async def start_turn(port: int) -> tuple[Client, dict[str, Any], list[dict[str, Any]]]:
    """A client with a turn that has streamed a few deltas: (client, session, messages)."""
    client = await Client.open(port)
    await client.send(type="generate", messages=PROMPT, params=GREEDY)
    session = await client.recv()
    assert session["type"] == "session", session
    return client, session, [await client.recv() for _ in range(3)]


def slot_and_move(cluster: LocalCluster, session: str) -> tuple[int, int, int]:
    """The session's slot, the primary that owns it and another primary."""
    client = cluster.admin(cluster.live_port())
    slot = int(client.execute_command("CLUSTER KEYSLOT", keys.meta(session)))
    source = cluster.primary_of(keys.meta(session))
    target = next(p for p in cluster.primaries_now() if p != source)
    return slot, source, target


def owner(cluster: LocalCluster, slot: int, port: int) -> int:
    """The primary that ``port`` says owns ``slot``."""
    for start, end, primary, *_ in cluster.admin(port).execute_command("CLUSTER SLOTS"):
        if start <= slot <= end:
            return int(primary[1])
    raise LookupError(slot)


async def until_done(client: Client) -> list[dict[str, Any]]:
    """Every message up to ``done``; a refusal fails at once (no retry here)."""
    out: list[dict[str, Any]] = []
    while not out or out[-1]["type"] != "done":
        out.append(await client.recv(timeout=120))
        assert out[-1]["type"] != "error", out[-1]
    return out


def assert_exact(messages: list[dict[str, Any]], reference: tuple[str, int]) -> None:
    text, seq = joined(messages)  # seq strictly grows: nothing repeated
    assert messages[-1]["type"] == "done" and messages[-1]["finish_reason"] == "length"
    assert (text, seq) == reference  # nothing lost


async def test_slot_migration_mid_turn_loses_and_repeats_nothing(
    frontend: Frontend, cluster: LocalCluster
) -> None:
    reference = await reference_run(frontend.port)
    client, session, head = await start_turn(frontend.port)
    slot, source, target = slot_and_move(cluster, session["session"])
    migration = asyncio.to_thread(cluster.migrate_slot, slot, source, target, KEY_PAUSE_S)
    rest, _ = await asyncio.gather(until_done(client), migration)
    await client.close()
    assert owner(cluster, slot, target) == target
    assert rest[-1]["seq"] > head[-1]["seq"] + 10, "the turn should stream through the move"
    assert_exact(head + rest, reference)


async def test_resume_while_the_slot_migrates(frontend: Frontend, cluster: LocalCluster) -> None:
    reference = await reference_run(frontend.port)
    client, session, head = await start_turn(frontend.port)
    slot, source, target = slot_and_move(cluster, session["session"])
    migration = asyncio.create_task(
        asyncio.to_thread(cluster.migrate_slot, slot, source, target, KEY_PAUSE_S)
    )
    await asyncio.sleep(KEY_PAUSE_S * 2)  # some keys moved, some not
    client.ws.transport.abort()  # the network drops; no close frame
    seen = head[-1]["seq"]
    client = await Client.open(frontend.port)
    ids = {"session": session["session"], "token": session["token"]}
    await client.send(type="resume", after=seen, **ids)
    rest = await until_done(client)
    await migration
    await client.close()
    assert owner(cluster, slot, target) == target
    text, seq = joined(rest, after=seen)
    assert (joined(head)[0] + text, seq) == reference


async def test_manual_failover_mid_turn_loses_and_repeats_nothing(
    frontend: Frontend, cluster: LocalCluster
) -> None:
    reference = await reference_run(frontend.port)
    client, session, head = await start_turn(frontend.port)
    primary = cluster.primary_of(keys.meta(session["session"]))
    failover = asyncio.to_thread(cluster.manual_failover, primary)
    rest, promoted = await asyncio.gather(until_done(client), failover)
    await client.close()
    assert cluster.primary_of(keys.meta(session["session"])) == promoted != primary
    assert_exact(head + rest, reference)


def test_slot_helpers_move_keys(cluster: LocalCluster, redis_url: str) -> None:
    """migrate_slot itself: every key of the slot ends on the target, readable there."""
    client = cluster.admin(cluster.live_port())
    slot = int(client.execute_command("CLUSTER KEYSLOT", "{probe}"))
    source = cluster.primary_of("{probe}")
    target = next(p for p in cluster.primaries_now() if p != source)
    cluster.admin(source).set("{probe}a", "1")
    cluster.admin(source).xadd("{probe}s", {"f": "v"})
    cluster.migrate_slot(slot, source, target)
    assert cluster.admin(target).get("{probe}a") == b"1"
    assert cluster.admin(target).xlen("{probe}s") == 1
    with pytest.raises(redis.exceptions.MovedError, match=f":{target}$"):
        cluster.admin(source).get("{probe}a")
