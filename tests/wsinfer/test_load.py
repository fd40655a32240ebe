"""Many clients at once on one frontend process: real Redis, a real engine,
real sockets. Before the bounded Redis pool, request 101 in flight got
``internal`` (redis-py's asyncio pool refused a 101st connection)."""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from typing import Any

import pytest

from tests.stack import Client, Stack

SESSIONS = int(os.environ.get("WSINFER_LOAD_SESSIONS", "1000"))
# Short turns keep CI time sane; the point is the number in flight at once.
PARAMS = {"temperature": 0, "max_new_tokens": 2}


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


async def one_turn(client: Client, index: int, accepted: asyncio.Event, counts: Counter[str]):  # type: ignore[no-untyped-def]
    await client.send(type="generate", id=index, prompt=f"Hello number {index}", params=PARAMS)
    first = await client.recv(timeout=300)
    counts[first["type"] if first["type"] != "error" else f"error:{first['code']}"] += 1
    if counts["session"] == SESSIONS:
        accepted.set()
    if first["type"] != "session":
        return first
    return (await client.until("done", timeout=300))[-1]


@pytest.mark.timeout(600)
async def test_a_thousand_concurrent_sessions_on_one_frontend_get_no_errors(
    stack: Stack,
) -> None:
    stack.start_engine("engine-1", "--max-batch-size", "64")
    frontend, port = stack.start_frontend("--max-queued-turns", str(SESSIONS * 2))
    base = rss_kib(frontend.pid)
    clients = await asyncio.gather(*(Client.open(port) for _ in range(SESSIONS)))
    await asyncio.sleep(1.0)
    idle = rss_kib(frontend.pid)
    accepted, counts = asyncio.Event(), Counter[str]()
    started = time.monotonic()
    turns = asyncio.gather(*(one_turn(c, i, accepted, counts) for i, c in enumerate(clients)))
    with_sessions = idle
    try:
        await asyncio.wait_for(accepted.wait(), 300)
        with_sessions = rss_kib(frontend.pid)
    except TimeoutError:
        pass  # the assertion below says what went wrong
    dones = await turns
    elapsed = time.monotonic() - started
    await asyncio.gather(*(c.close() for c in clients))
    reasons = Counter[Any](d.get("finish_reason", d.get("code")) for d in dones)
    print(
        f"\n{SESSIONS} sessions in {elapsed:.1f}s; first answers {dict(counts)}; "
        f"ends {dict(reasons)}; frontend RSS {base} KiB idle-process, "
        f"{(idle - base) / SESSIONS:.1f} KiB per open idle connection, "
        f"{(with_sessions - idle) / SESSIONS:.1f} KiB per accepted session"
    )
    assert counts == {"session": SESSIONS}
    assert all(d["type"] == "done" and d["finish_reason"] in ("stop", "length") for d in dones)


async def test_a_generate_costs_few_redis_round_trips(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: ZCOUNT, XINFO GROUPS, SCRIPT EXISTS + EVALSHA, HGET, XADD, a wake-up
    XADD and the fan-in's XREAD again: eight per generate. Now the request's own
    path is one (script and work item pipelined; capacity from a shared
    snapshot); the fan-in's wake-up and re-read, off that path, are shared by
    requests that arrive together."""
    import redis.asyncio as aioredis
    from redis.asyncio.connection import AbstractConnection

    from tests.wsinfer.test_server_e2e import start_frontend
    from wsinfer.sessions import keys

    sends = Counter[str]()
    original = AbstractConnection.send_packed_command

    async def counted(self: Any, command: Any, check_health: bool = True) -> None:
        sends["round trips"] += 1
        await original(self, command, check_health)

    probe = aioredis.from_url(redis_url)
    await probe.zadd(keys.ENGINES, {"engine-x": time.time() + 3600})  # "alive"
    # No touch ticks during the count: they are per followed session, not per request.
    frontend = await start_frontend(redis_url, request_rate=1e6)
    frontend.config.touch_interval_s = 3600
    try:
        clients = [await Client.open(frontend.port) for _ in range(4)]
        await clients[0].send(type="generate", prompt="warm-up")
        await clients[0].recv()
        monkeypatch.setattr(AbstractConnection, "send_packed_command", counted)
        n = 100  # 25 per connection: under its 64 sessions
        for i in range(n):
            await clients[i % 4].send(type="generate", id=i, prompt="hi")
        for i in range(n):
            answer = await clients[i % 4].recv()
            assert answer["type"] == "session", answer
        monkeypatch.undo()
        for client in clients:
            await client.close()
    finally:
        await frontend.stop()
        await probe.aclose()
    per = sends["round trips"] / n
    print(f"\n{per:.2f} Redis round trips per generate (fan-in and capacity checks included)")
    assert per < 2.5
