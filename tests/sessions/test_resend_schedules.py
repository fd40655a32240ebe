"""Random schedules of a turn's life with its work items lost, against a real Redis:
every queued turn that a frontend follows is run, and never twice.

A script queues a turn and its work item follows in another command, so a process
that dies between the two loses the item (``sessions/scripts.py`` TOUCH). Here
items are lost at every point where that can happen (a start, a next turn, a
resume), while two frontends touch the followed turn, time passes, and an engine
reads, claims and finishes turns, in random order. Checked at every step: a turn
is claimed at most once for each time it was queued (duplicate items are refused).
Checked at the end: once frontends keep touching and time passes, the turn does not
stay queued.
"""

from __future__ import annotations

import random

import pytest
import redis
import redis.asyncio as aioredis

from wsinfer.clock import ManualClock
from wsinfer.sessions import keys
from wsinfer.sessions.schema import DoneEvent, GenerationParams, TurnInput, as_str
from wsinfer.sessions.store import SessionStore
from wsinfer.sessions.worker import ClaimedTurn, Publish, WorkerStore

pytestmark = pytest.mark.slow

CHAT = TurnInput("chat", [{"role": "user", "content": "hi"}], None, GenerationParams())
RESEND_AFTER_S = 10.0
SCHEDULES = 300
STEPS = 40


class Schedule:
    def __init__(
        self,
        rng: random.Random,
        frontends: list[SessionStore],
        engine: WorkerStore,
        redis_client: redis.Redis,
        clock: ManualClock,  # the frontends' (TOUCH compares the times they send)
    ) -> None:
        self.rng, self.frontends, self.engine = rng, frontends, engine
        self.redis, self.clock = redis_client, clock
        self.session, self.token = "", ""
        self.turn = 1
        self.episode = 0  # bumped each time the turn is queued
        self.claims: dict[int, int] = {}  # episode -> successful claims
        self.running: ClaimedTurn | None = None
        self.trace: list[str] = []
        self.resent = 0  # work items the frontends sent again

    def status(self) -> str:
        return as_str(self.redis.hget(keys.meta(self.session), "status"))

    def maybe_lose_items(self) -> None:
        if self.rng.random() < 0.6:
            self.redis.xtrim(keys.REQUESTS, maxlen=0)
            self.trace.append("lost")

    def queued(self) -> None:
        self.episode += 1
        self.maybe_lose_items()

    async def start(self) -> None:
        self.session, self.token = await self.frontends[0].create(CHAT)
        self.queued()

    async def step(self) -> None:
        op = self.rng.choice(["touch", "touch", "tick", "read", "finish", "next", "pause"])
        if op == "pause" and self.status() == "paused":
            op = "resume"
        self.trace.append(op)
        await getattr(self, op)()

    async def touch(self) -> None:
        frontend = self.rng.choice(self.frontends)
        touched = await frontend.touch({self.session: self.turn}, resend_after_s=RESEND_AFTER_S)
        self.resent += len(touched.resent)

    async def tick(self) -> None:
        self.clock.advance(self.rng.choice([1.0, 3.0, 6.0, RESEND_AFTER_S + 1]))

    async def read(self) -> None:
        """The engine reads the queue and claims what it may."""
        for item in self.engine.read_work(10, None):
            before = self.status()
            claimed = self.engine.claim(item.request, takeover=False)
            self.engine.ack(item)
            if claimed is None:
                continue
            assert (claimed.session, claimed.turn) == (self.session, self.turn), self.trace
            assert before == "queued", self.trace
            self.claims[self.episode] = self.claims.get(self.episode, 0) + 1
            assert self.claims[self.episode] == 1, f"claimed twice: {self.trace}"
            self.running = claimed

    async def finish(self) -> None:
        if self.running is None or self.status() != "running":
            return
        done = Publish(self.session, self.turn, self.running.epoch, 0, [DoneEvent(0, "stop")])
        assert self.engine.publish_many([done])[0].outcome == "ok", self.trace
        self.running = None

    async def next(self) -> None:
        if self.status() == "done":
            self.turn = await self.frontends[0].add_turn(self.session, self.token, CHAT)
            self.queued()

    async def pause(self) -> None:
        if self.status() == "queued":
            await self.rng.choice(self.frontends).control(
                self.session, self.token, self.turn, "pause"
            )

    async def resume(self) -> None:
        await self.rng.choice(self.frontends).control(self.session, self.token, self.turn, "resume")
        self.queued()

    async def settle(self) -> None:
        """Frontends keep touching, time passes, the engine reads: the turn gets run."""
        for _ in range(3):
            await self.touch()
            self.clock.advance(RESEND_AFTER_S + 1)
            await self.touch()
            await self.read()
            if self.status() != "queued":
                return
        raise AssertionError(f"turn {self.turn} stayed queued: {self.trace}")


async def test_every_followed_queued_turn_runs_once_whatever_is_lost(
    aredis: aioredis.Redis,
    redis_client: redis.Redis,
) -> None:
    clock = ManualClock()  # moved by the schedule
    frontends = [SessionStore(aredis, ttl_s=600, clock=clock) for _ in range(2)]
    engine = WorkerStore(redis_client, "engine-a", ttl_s=600)
    engine.ensure_group()
    resent = 0
    for seed in range(SCHEDULES):
        schedule = Schedule(random.Random(seed), frontends, engine, redis_client, clock)
        await schedule.start()
        for _ in range(STEPS):
            await schedule.step()
        await schedule.settle()
        resent += schedule.resent
    assert resent > SCHEDULES // 2  # the schedules did lose items and re-send them
