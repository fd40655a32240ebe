"""The fan-in against a real Redis: hot and cold reads, exactly-once delivery."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from tests.stack import until
from wsinfer import fanin as fanin_module
from wsinfer.clock import ManualClock
from wsinfer.fanin import FanIn
from wsinfer.sessions import keys
from wsinfer.sessions.schema import DeltaEvent, TurnEvent, encode

QUIET_S = 0.5  # how long a stream stays hot without entries, in these tests


class Recorder:
    """Every XREAD the fan-in sends: which streams it named."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.calls: list[set[str]] = []
        self._xread = redis.xread
        redis.xread = self.xread  # type: ignore[method-assign]

    async def xread(self, streams: dict[Any, Any], **kwargs: Any) -> Any:
        self.calls.append({str(s) for s in streams})
        return await self._xread(streams, **kwargs)

    def naming(self, stream: str) -> int:
        return sum(stream in call for call in self.calls)


@pytest.fixture
def clock() -> ManualClock:
    """The fan-in's: a stream turns cold when a test says the time has passed."""
    return ManualClock()


@pytest.fixture
async def fanin(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, clock: ManualClock
) -> AsyncIterator[FanIn]:
    monkeypatch.setattr(fanin_module, "COLD_AFTER_S", QUIET_S)
    monkeypatch.setattr(fanin_module, "DEMOTE_EVERY_S", 0.0)
    client = aioredis.from_url(redis_url)
    fan = FanIn(client, "f-test", block_ms=1000, clock=clock)
    task = asyncio.create_task(fan.run())
    yield fan
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await fan.close()
    await client.aclose()


def collector() -> tuple[list[int], Any]:
    seqs: list[int] = []

    def deliver(events: list[TurnEvent]) -> None:
        seqs.extend(e.seq for e in events)

    return seqs, deliver


async def publish(fan: FanIn, stream: str, seq: int) -> None:
    await fan.redis.xadd(stream, encode(DeltaEvent(seq, f"t{seq}")))


def stay_quiet(fan: FanIn, clock: ManualClock) -> None:
    """Let more than QUIET_S pass, and end the hot XREAD's block: the round
    after it looks for quiet streams."""
    clock.advance(QUIET_S + 0.01)
    fan._request_wake()


async def test_a_quiet_stream_turns_cold_and_back_hot_without_losing_entries(
    fanin: FanIn, clock: ManualClock
) -> None:
    stream = keys.turn_stream("s1", 1)
    seqs, deliver = collector()
    fanin.subscribe(stream, ("c", "s1"), "0-0", deliver)
    await publish(fanin, stream, 1)
    await until(lambda: seqs == [1])
    assert stream in fanin.hot
    stay_quiet(fanin, clock)
    await until(lambda: stream in fanin.cold)  # quiet for QUIET_S
    for seq in (2, 3, 4):
        await publish(fanin, stream, seq)
    await until(lambda: seqs == [1, 2, 3, 4])
    await until(lambda: stream in fanin.hot)
    await publish(fanin, stream, 5)
    await until(lambda: len(seqs) == 5)
    assert seqs == [1, 2, 3, 4, 5]  # each once, in order, across both moves


async def test_hot_rounds_do_not_name_a_cold_stream(fanin: FanIn, clock: ManualClock) -> None:
    recorder = Recorder(fanin.reader)
    busy, idle = keys.turn_stream("busy", 1), keys.turn_stream("idle", 1)
    busy_seqs, deliver_busy = collector()
    fanin.subscribe(idle, ("c", "idle"), "0-0", collector()[1])
    stay_quiet(fanin, clock)
    await until(lambda: idle in fanin.cold)
    named_when_cold = recorder.naming(idle)
    fanin.subscribe(busy, ("c", "busy"), "0-0", deliver_busy)
    for seq in range(1, 51):  # 50 rounds of the hot XREAD, or close to it
        await publish(fanin, busy, seq)
        await until(lambda seq=seq: busy_seqs[-1:] == [seq])
    # The cold XREAD is re-sent when its set changes (the busy stream may turn
    # cold and back on a loaded machine), not on each of the 50 hot rounds.
    assert recorder.naming(idle) - named_when_cold < 10
    assert len(recorder.calls) - named_when_cold > 50


async def test_a_new_subscription_to_a_cold_stream_reads_it_hot(
    fanin: FanIn, clock: ManualClock
) -> None:
    stream = keys.turn_stream("s2", 1)
    first, deliver_first = collector()
    fanin.subscribe(stream, ("a", "s2"), "0-0", deliver_first)
    await publish(fanin, stream, 1)
    await until(lambda: first == [1])
    stay_quiet(fanin, clock)
    await until(lambda: stream in fanin.cold)
    second, deliver_second = collector()
    fanin.subscribe(stream, ("b", "s2"), "0-0", deliver_second)  # replays from the start
    assert stream in fanin.hot
    await until(lambda: second == [1])
    assert first == [1]


async def test_quiet_is_measured_by_the_fan_in_s_clock(
    fanin: FanIn, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An hour's quiet, in no time: a fan-in that read ``time.monotonic`` would
    keep the stream hot."""
    monkeypatch.setattr(fanin_module, "COLD_AFTER_S", 3600.0)
    stream = keys.turn_stream("s3", 1)
    seqs, deliver = collector()
    fanin.subscribe(stream, ("c", "s3"), "0-0", deliver)
    await publish(fanin, stream, 1)
    await until(lambda: seqs == [1])
    clock.advance(3600.5)
    fanin._request_wake()
    await until(lambda: stream in fanin.cold)
    await publish(fanin, stream, 2)
    await until(lambda: seqs == [1, 2] and stream in fanin.hot)


@pytest.mark.parametrize("protocol", [2, 3])
async def test_raw_replies_are_read_in_either_resp_version(redis_url: str, protocol: int) -> None:
    """The fan-in parses XREAD replies itself: RESP2's list and RESP3's map."""
    client = aioredis.from_url(redis_url, protocol=protocol)
    fan = FanIn(client, f"f-resp{protocol}", block_ms=1000)
    task = asyncio.create_task(fan.run())
    try:
        streams = [keys.turn_stream(f"resp{protocol}-{i}", 1) for i in range(2)]
        got = [collector() for _ in streams]
        for stream, (_, deliver) in zip(streams, got, strict=True):
            fan.subscribe(stream, stream, "0-0", deliver)
        for seq in (1, 2, 3):
            for stream in streams:
                await publish(fan, stream, seq)
        await until(lambda: all(seqs == [1, 2, 3] for seqs, _ in got))
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await fan.close()
        await client.delete(*streams)
        await client.aclose()


async def test_subscribers_at_different_positions_each_get_only_what_they_have_not_seen(
    redis_url: str,
) -> None:
    """One batch of a stream, three followers: from before it, from inside it
    (a resume racing the live read), and from its end."""
    client = aioredis.from_url(redis_url)
    fan = FanIn(client, "f-test")
    stream = keys.turn_stream("s", 1)
    ids = [await client.xadd(stream, encode(DeltaEvent(seq, f"t{seq}"))) for seq in (1, 2, 3)]
    entries = [(i.decode(), f[b"m"]) for i, f in await client.xrange(stream)]
    got: dict[str, list[int]] = {}
    for owner, position in (
        ("before", "0-0"),
        ("inside", ids[0].decode()),
        ("end", ids[2].decode()),
    ):
        got[owner], deliver = collector()
        fan.subscribe(stream, owner, position, deliver)
    fan._dispatch(stream, "0-0", entries)
    assert got == {"before": [1, 2, 3], "inside": [2, 3], "end": []}
    fan._dispatch(stream, "0-0", entries)  # the same entries again (a re-read): nothing twice
    assert got == {"before": [1, 2, 3], "inside": [2, 3], "end": []}
    await client.aclose()
