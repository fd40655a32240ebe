"""Redis killed with -9 mid-turn and started again: real engine and frontend
processes, real sockets. Before, both engines exited on the first connection
error and clients on open connections never heard anything again.

With persistence on, the interrupted turn finishes with exactly the text it
would have had; with it off, the client is told its session is gone. Either
way no process is restarted by hand, and requests during the outage get
``engine_unavailable``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.models import tiny_model_dir
from tests.stack import Client, Stack, joined
from wsinfer.supervisor import EmbeddedRedis

PROMPT = "The lighthouse keeper wrote in his log"
LONG = {"temperature": 0, "max_new_tokens": 400}


@pytest.fixture(scope="module")
def tiny_model() -> str:
    return str(tiny_model_dir())


@pytest.fixture(params=["persistent", "volatile"])
def own_redis(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EmbeddedRedis]:
    state = Path(tmp_path_factory.mktemp("redis", numbered=True))
    server = EmbeddedRedis(state, appendfsync="always" if request.param == "persistent" else None)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def stack(own_redis: EmbeddedRedis, tiny_model: str) -> Iterator[Stack]:
    stack = Stack(own_redis.url, tiny_model)
    yield stack
    stack.stop()


def kill_and_restart_later(server: EmbeddedRedis, down_s: float) -> None:
    assert server.process is not None
    server.process.kill()
    server.process.wait()
    time.sleep(down_s)


async def turn(port: int, params: dict[str, Any] = LONG) -> list[dict[str, Any]]:
    """One turn; retried while the answer is `engine_unavailable` (for 60 s), as
    a client would: right after Redis returns, engines take a heartbeat to re-register."""
    deadline = time.monotonic() + 60
    client = await Client.open(port)
    try:
        while True:
            await client.send(type="generate", prompt=PROMPT, params=params)
            first = await client.recv()
            if first["type"] == "session":
                return [first, *await client.until("done")]
            assert first["code"] == "engine_unavailable" and time.monotonic() < deadline, first
            await asyncio.sleep(min(first["retry_after"], 0.5))
    finally:
        await client.close()


@pytest.mark.timeout(300)
async def test_a_redis_restart_mid_turn(stack: Stack, own_redis: EmbeddedRedis) -> None:
    persistent = own_redis.appendfsync is not None
    engine = stack.start_engine("engine-1")
    frontend, port = stack.start_frontend("--idle-pause", "4")  # touches every second
    reference = joined(await turn(port))[0]

    client = await Client.open(port)
    await client.send(type="generate", prompt=PROMPT, params=LONG)
    before = await client.until("delta")
    kill_and_restart_later(own_redis, 0)
    # During the outage: a clear answer, not `internal`, not silence.
    bystander = await Client.open(port)
    await bystander.send(type="generate", id=1, prompt=PROMPT, params=LONG)
    refused = await bystander.recv(timeout=30)
    assert (refused["type"], refused["code"], refused["id"]) == ("error", "engine_unavailable", 1)
    assert refused["retry_after"] > 0
    await asyncio.sleep(2.0)
    own_redis.start()

    after = await client.until("done", timeout=120)
    done = after[-1]
    if persistent:
        text, seq = joined(before + after)
        assert text == reference and done["finish_reason"] == "length" and done["seq"] == seq
    else:
        assert done["finish_reason"] == "error" and done["error"]["code"] == "not_found", done
    await client.close()
    await bystander.close()

    # Nobody was restarted: the same processes serve the next turn.
    assert engine.poll() is None and frontend.poll() is None
    again = await turn(port, {"temperature": 0, "max_new_tokens": 20})
    assert again[-1]["finish_reason"] == "length"
    assert engine.poll() is None and frontend.poll() is None
