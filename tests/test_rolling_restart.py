"""A rolling restart loses nothing: every process of a 2-frontend x 2-engine
stack is restarted, one by one (SIGTERM, wait, start again), while 100
sessions stream through a load balancer with the Python client. Frontends
close WebSockets with 1012 and the clients resume on the other one; engines
finish what they can in their grace period and hand the rest over at once.
Every joined text must equal an uninterrupted greedy run of its prompt."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import AsyncIterator

import pytest
import redis

from tests.balancer import Balancer
from tests.ports import free_ports
from tests.stack import Stack
from wsinfer.clients import Client, connect

PROMPTS = [f"Story number {i}: once upon a time" for i in range(4)]
# Long enough that turns are still streaming when the last process restarts, on a
# quiet machine too: the paged engine finished 100 x 150 tokens between two restarts.
GREEDY = {"temperature": 0, "max_new_tokens": 400}
SESSIONS, PER_CLIENT = 100, 10
ENGINE_FLAGS = ("--max-batch-size", "4", "--drain-grace", "2", "--threads", "1")


@pytest.fixture
async def balancer() -> AsyncIterator[Balancer]:
    balancer = await Balancer(free_ports(2)).start()
    yield balancer
    await balancer.stop()


def stop(process: subprocess.Popen[bytes]) -> int:
    process.send_signal(signal.SIGTERM)
    return process.wait(60)


async def run_turn(client: Client, prompt: str) -> str:
    turn = await client.start(prompt=prompt, params=GREEDY)
    return await turn.wait()


async def test_restarting_every_process_loses_nothing(
    stack: Stack, balancer: Balancer, redis_client: redis.Redis
) -> None:
    frontends = [stack.start_frontend(port=port)[0] for port in balancer.upstreams]
    engines = [stack.start_engine(f"engine-{i}", *ENGINE_FLAGS) for i in range(2)]
    async with connect(balancer.url) as client:
        references = [await run_turn(client, prompt) for prompt in PROMPTS]

    clients = [await connect(balancer.url).__aenter__() for _ in range(SESSIONS // PER_CLIENT)]
    # Every turn accepted first: a generate whose answer is lost with its
    # connection fails by design (the client cannot know if it started).
    turns = await asyncio.gather(
        *(
            clients[i // PER_CLIENT].start(prompt=PROMPTS[i % len(PROMPTS)], params=GREEDY)
            for i in range(SESSIONS)
        )
    )
    jobs = [asyncio.create_task(turn.wait()) for turn in turns]
    unfinished_at_restart = []
    for i, port in enumerate(balancer.upstreams):
        unfinished_at_restart.append(sum(not job.done() for job in jobs))
        assert await asyncio.to_thread(stop, frontends[i]) == 0
        frontends[i] = stack.start_frontend(port=port)[0]
    for i in range(2):
        unfinished_at_restart.append(sum(not job.done() for job in jobs))
        assert await asyncio.to_thread(stop, engines[i]) == 0
        engines[i] = await asyncio.to_thread(stack.start_engine, f"engine-{i}-again", *ENGINE_FLAGS)
    texts = await asyncio.wait_for(asyncio.gather(*jobs), 600)
    for c in clients:
        await c.__aexit__(None, None, None)

    for i, text in enumerate(texts):
        assert text == references[i % len(PROMPTS)], f"session {i} differs"
    assert min(unfinished_at_restart) > 0, (
        f"turns ended before the restarts: {unfinished_at_restart}"
    )
    assert sum(c.reconnects for c in clients) >= len(clients), "clients should have reconnected"
    print("unfinished at each restart:", unfinished_at_restart)
