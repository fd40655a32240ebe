"""The fan-in's exactly-once rule, through generated interleavings on a real Redis.

A hypothesis state machine plays every part around the real fan-in (``FanIn``'s
hot and cold reads, and ``ClusterFanIn``'s pipelined read): an engine appending
a turn's entries and ending it; followers joining at any position (the start,
an entry, between entries, the end, past it), leaving, moving to another turn,
held by backpressure and let go; and the reads themselves. Each read is sent
with the positions of its moment, answered by Redis then or any number of steps
later, and handed back to the fan-in later still, or handed back empty: that is
all a blocking XREAD, a wake-up that comes early, late or never, and a block
that times out can do.

After every step:
- each follower has received a prefix of the log's entries after its position,
  in order, nothing twice, and nothing after it stopped following;
- a follower's position in the fan-in is where it started or the last entry it
  was handed (the invariant in docs/architecture.md, step 6).
At the end, with every hold let go and reads run until nothing is left, every
follower has received all of its entries.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from wsinfer.clock import ManualClock
from wsinfer.fanin import FanIn, _id_key, raw_xread_client
from wsinfer.fanin_cluster import ClusterFanIn
from wsinfer.sessions import keys
from wsinfer.sessions.schema import DeltaEvent, DoneEvent, TurnEvent, Usage, encode

STREAMS = [keys.turn_stream(f"s{i}", 1) for i in range(2)]
OWNERS = ["a", "b", "c", "d"]
WHERE = ["start", "entry", "between", "end", "past"]
EXAMPLES = 1000  # per fan-in kind; each a run of up to STEPS steps
STEPS = 40


@dataclass
class Explored:
    examples: int = 0
    steps: int = 0


EXPLORED: dict[str, Explored] = {}


@dataclass
class HeldRead:
    """One read the fan-in sent: its positions, Redis's answer once asked, the hand-back."""

    ask: Callable[[], Coroutine[Any, Any, Any]]
    empty: Any  # the reply when nothing came: a wake-up, or the block ran out
    future: asyncio.Future[Any]
    reply: Any = None
    answered: bool = False


class Gate:
    """Holds every read until the test answers it and hands it back."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.sent: list[HeldRead] = []

    async def hold(self, ask: Callable[[], Coroutine[Any, Any, Any]], empty: Any) -> Any:
        held = HeldRead(ask, empty, self.loop.create_future())
        self.sent.append(held)
        return await held.future


class GatedReader:
    """``FanIn.reader``: its XREADs wait at the gate; Redis answers them without blocking."""

    def __init__(self, gate: Gate, raw: aioredis.Redis) -> None:
        self.gate, self.raw = gate, raw

    async def xread(self, streams: dict[Any, Any], **_: Any) -> Any:
        positions = dict(streams)
        return await self.gate.hold(lambda: self.raw.xread(positions), [])


class GatedCluster:
    """``ClusterFanIn.cluster``: its pipelined XREADs wait at the gate as one."""

    def __init__(self, gate: Gate, redis: aioredis.Redis) -> None:
        self.gate, self.redis = gate, redis

    def pipeline(self) -> GatedPipeline:
        return GatedPipeline(self)


class GatedPipeline:
    def __init__(self, cluster: GatedCluster) -> None:
        self.cluster = cluster
        self.reads: list[dict[Any, Any]] = []

    def xread(self, streams: dict[Any, Any]) -> None:
        self.reads.append(dict(streams))

    async def execute(self) -> list[Any]:
        async def ask() -> list[Any]:
            return [await self.cluster.redis.xread(read) for read in self.reads]

        return await self.cluster.gate.hold(ask, [None] * len(self.reads))


@dataclass
class History:
    """One subscription of one follower: where it started and what it was handed."""

    stream: str
    start: str
    received: list[int] = field(default_factory=list)
    following: bool = True
    done: bool = False


class FanInMachine(RuleBasedStateMachine):
    kind = "single"
    redis_url = ""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.redis = aioredis.from_url(self.redis_url)
        self.run(self.redis.flushdb())
        self.gate = Gate(self.loop)
        self.clock = ManualClock()  # time passes only when the model says so
        self.fan = self._make_fanin()
        self.log: dict[str, list[int]] = {s: [] for s in STREAMS}  # entry n has id "n-0"
        self.ended: set[str] = set()
        self.current: dict[str, History] = {}
        self.histories: list[History] = []
        self.held: set[str] = set()
        self.reads: dict[str, tuple[asyncio.Task[Any], HeldRead]] = {}
        EXPLORED.setdefault(self.kind, Explored()).examples += 1

    def _make_fanin(self) -> FanIn:
        if self.kind == "cluster":
            fan: FanIn = ClusterFanIn(self.redis, "f-model", clock=self.clock)
            fan.cluster = GatedCluster(self.gate, self.redis)  # type: ignore[attr-defined]
        else:
            fan = FanIn(self.redis, "f-model", clock=self.clock)
            fan.reader = GatedReader(self.gate, raw_xread_client(self.redis))  # type: ignore[assignment]
            fan.cold_reader = GatedReader(self.gate, raw_xread_client(self.redis))  # type: ignore[assignment]
        # Wake-ups only make a blocked read return early: here the test decides when.
        fan._hot_waker.request = lambda: None  # type: ignore[method-assign]
        fan._cold_waker.request = lambda: None  # type: ignore[method-assign]
        return fan

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return self.loop.run_until_complete(coro)

    def settle(self) -> None:
        """Let the fan-in's tasks run until each waits at the gate or has ended."""
        for _ in range(4):
            self.run(asyncio.sleep(0))

    def teardown(self) -> None:
        try:
            self._drain()
        finally:
            for task, held in self.reads.values():
                task.cancel()
                if not held.future.done():
                    held.future.cancel()
            self.settle()
            self.run(self.redis.aclose())
            self.loop.close()

    # --- the engine -----------------------------------------------------------------

    @rule(stream=st.sampled_from(STREAMS), count=st.integers(1, 3))
    def publish(self, stream: str, count: int) -> None:
        if stream in self.ended:
            return
        for _ in range(count):
            seq = len(self.log[stream]) + 1
            self.run(self.redis.xadd(stream, encode(DeltaEvent(seq, f"t{seq}")), id=f"{seq}-0"))
            self.log[stream].append(seq)
        EXPLORED[self.kind].steps += 1

    @rule(stream=st.sampled_from(STREAMS))
    def finish(self, stream: str) -> None:
        if stream in self.ended:
            return
        seq = len(self.log[stream]) + 1
        event = DoneEvent(seq, "stop", Usage(completion_tokens=seq - 1))  # type: ignore[arg-type]
        self.run(self.redis.xadd(stream, encode(event), id=f"{seq}-0"))
        self.log[stream].append(seq)
        self.ended.add(stream)
        EXPLORED[self.kind].steps += 1

    # --- the followers ----------------------------------------------------------------

    @rule(
        owner=st.sampled_from(OWNERS),
        stream=st.sampled_from(STREAMS),
        where=st.sampled_from(WHERE),
        pick=st.integers(0, 1000),
    )
    def subscribe(
        self, owner: str, stream: str, where: str, pick: int, position: str | None = None
    ) -> None:
        position = position or self._position(stream, where, pick)
        self._stop_following(owner)
        history = History(stream, position)
        self.histories.append(history)
        self.current[owner] = history
        self.held.discard(owner)
        self.fan.subscribe(stream, owner, position, self._deliver_to(history))
        EXPLORED[self.kind].steps += 1

    @rule(owner=st.sampled_from(OWNERS), pick=st.integers(0, 1000))
    def join_behind(self, owner: str, pick: int) -> None:
        """A second follower of a stream joins behind one that follows it already (the
        reconnect the issue saw lose deltas): more often than chance would have it."""
        ahead = [h for o, h in self.current.items() if o != owner and self._reached(h) > 0]
        if not ahead:
            return
        leader = ahead[pick % len(ahead)]
        self.subscribe(owner, leader.stream, "at", 0, position=f"{pick % self._reached(leader)}-0")

    def _reached(self, history: History) -> int:
        """The entry a follower has reached: the last handed to it, or where it started."""
        return history.received[-1] if history.received else _id_key(history.start)[0]

    def _position(self, stream: str, where: str, pick: int) -> str:
        size = len(self.log[stream])
        if where == "start" or size == 0 and where in ("entry", "between"):
            return "0-0"
        if where == "entry":
            return f"{pick % size + 1}-0"
        if where == "between":  # after entry n, before entry n + 1
            return f"{pick % size + 1}-1"
        if where == "end":
            return f"{size}-0" if size else "0-0"
        return f"{size + 1 + pick % 3}-0"  # past the end: entries up to it are not its

    def _deliver_to(self, history: History) -> Callable[[list[TurnEvent]], None]:
        def deliver(events: list[TurnEvent]) -> None:
            assert history.following, "delivered to a follower that had stopped following"
            for event in events:
                assert not history.done, "delivered past the turn's end"
                history.received.append(event.seq)
                history.done = isinstance(event, DoneEvent)

        return deliver

    @rule(owner=st.sampled_from(OWNERS))
    def unsubscribe(self, owner: str) -> None:
        self._stop_following(owner)
        self.fan.unsubscribe(owner)
        EXPLORED[self.kind].steps += 1

    def _stop_following(self, owner: str) -> None:
        history = self.current.pop(owner, None)
        if history is not None:
            history.following = False
        self.held.discard(owner)

    @rule(owner=st.sampled_from(OWNERS))
    def hold(self, owner: str) -> None:
        """Backpressure: the follower's client is not reading."""
        self.fan.hold(owner)
        if owner in self.current:
            self.held.add(owner)
        EXPLORED[self.kind].steps += 1

    @rule(owner=st.sampled_from(OWNERS))
    def let_go(self, owner: str) -> None:
        self.fan.let_go(owner)
        self.held.discard(owner)
        EXPLORED[self.kind].steps += 1

    # --- the reads --------------------------------------------------------------------

    def _readers(self) -> list[str]:
        return ["cluster"] if self.kind == "cluster" else ["hot", "cold"]

    @rule(data=st.data())
    def send_read(self, data: st.DataObject) -> None:
        reader = data.draw(st.sampled_from(self._readers()))
        if reader in self.reads:
            return
        sent = len(self.gate.sent)
        task = self.loop.create_task(self._read(reader))
        self.settle()
        if len(self.gate.sent) > sent:
            self.reads[reader] = (task, self.gate.sent[-1])
        else:  # nothing to read (every follower held): it returned at once
            self.run(task)
        EXPLORED[self.kind].steps += 1

    def _read(self, reader: str) -> Coroutine[Any, Any, Any]:
        if reader == "hot":
            return self.fan._read_once()
        if reader == "cold":
            return self.fan._read_cold()
        return self.fan._read(list(self.fan.streams))  # type: ignore[attr-defined]

    @rule(data=st.data())
    def redis_answers(self, data: st.DataObject) -> None:
        """Redis computes the reply now; it reaches the fan-in later."""
        held = self._held(data)
        if held is not None and not held.answered:
            held.reply, held.answered = self.run(held.ask()), True
        EXPLORED[self.kind].steps += 1

    @rule(data=st.data(), empty=st.booleans())
    def reply_arrives(self, data: st.DataObject, empty: bool) -> None:
        """The reply reaches the fan-in: Redis's answer, or nothing (a wake-up or a
        block that timed out)."""
        reader = data.draw(st.sampled_from(self._readers()))
        if reader not in self.reads:
            return
        self._hand_back(reader, empty=empty)
        EXPLORED[self.kind].steps += 1

    def _held(self, data: st.DataObject) -> HeldRead | None:
        reader = data.draw(st.sampled_from(self._readers()))
        entry = self.reads.get(reader)
        return entry[1] if entry is not None else None

    def _hand_back(self, reader: str, *, empty: bool = False) -> None:
        task, held = self.reads.pop(reader)
        if empty:
            reply = held.empty
        elif held.answered:
            reply = held.reply
        else:
            reply = self.run(held.ask())
        held.future.set_result(reply)
        self.settle()
        assert task.done()
        task.result()

    @precondition(lambda self: self.kind != "cluster")
    @rule()
    def time_passes(self) -> None:
        """Every hot stream has been quiet long enough to turn cold."""
        self.fan._demote(self.clock.advance(3600))
        EXPLORED[self.kind].steps += 1

    # --- the checks -------------------------------------------------------------------

    @invariant()
    def each_follower_has_a_prefix_of_its_entries(self) -> None:
        for history in self.histories:
            owed = self._owed(history)
            assert history.received == owed[: len(history.received)], (history, owed)

    def _owed(self, history: History) -> list[int]:
        after = _id_key(history.start)
        return [seq for seq in self.log[history.stream] if (seq, 0) > after]

    @invariant()
    def positions_move_only_over_entries_handed_over(self) -> None:
        for owner, history in self.current.items():
            sub = self.fan._subscriber(owner)
            if sub is None:  # unsubscribed by the fan-in at the turn's end
                assert history.done
                continue
            expected = f"{history.received[-1]}-0" if history.received else history.start
            assert sub.position == expected, (owner, sub.position, history)

    def _drain(self) -> None:
        """Let every hold go and read until no follower is owed anything."""
        for owner in list(self.held):
            self.let_go(owner)
        for reader in list(self.reads):
            self._hand_back(reader)
        for _ in range(8):
            if all(h.received == self._owed(h) for h in self.current.values()):
                break
            for reader in self._readers():
                task = self.loop.create_task(self._read(reader))
                self.settle()
                if not task.done():
                    self.reads[reader] = (task, self.gate.sent[-1])
                    self._hand_back(reader)
        for owner, history in self.current.items():
            assert history.received == self._owed(history), ("owed at the end", owner, history)


def _explore(kind: str, redis_url: str) -> None:
    machine = type(f"FanInMachine_{kind}", (FanInMachine,), {"kind": kind, "redis_url": redis_url})
    started = time.monotonic()
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    explored = EXPLORED.get(kind, Explored())
    print(
        f"fan-in model ({kind}): {explored.examples} interleavings, {explored.steps} steps, "
        f"{time.monotonic() - started:.1f} s"
    )


@pytest.mark.parametrize("kind", ["single", "cluster"])
def test_every_follower_gets_its_entries_exactly_once(kind: str, redis_url: str) -> None:
    _explore(kind, redis_url)
