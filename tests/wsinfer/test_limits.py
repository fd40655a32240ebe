"""The admission limits read time only through their clock: a manual one moved
past a threshold changes what they answer, with no sleep."""

from __future__ import annotations

from wsinfer.clock import ManualClock
from wsinfer.limits import CapacityGate, LogThrottle, TokenBucket
from wsinfer.sessions.store import QueueState


def test_a_token_bucket_refills_as_its_clock_advances() -> None:
    clock = ManualClock()
    bucket = TokenBucket(rate=1.0, burst=2.0, clock=clock)
    assert [bucket.take(), bucket.take()] == [0.0, 0.0]  # the burst
    assert bucket.take() == 1.0  # empty: one token a second
    clock.advance(0.5)
    assert bucket.take() == 0.5  # half a token back; the refused take cost nothing
    clock.advance(0.5)
    assert bucket.take() == 0.0


def test_a_log_throttle_opens_a_new_window_when_its_clock_says_so() -> None:
    clock = ManualClock()
    throttle = LogThrottle(per_window=1, window_s=10.0, clock=clock)
    assert [throttle.allow("k") for _ in range(3)] == [(True, 0), (False, 0), (False, 0)]
    clock.advance(9.9)
    assert throttle.allow("k") == (False, 0)  # still the first window
    clock.advance(0.1)
    assert throttle.allow("k") == (True, 3)  # a new one, reporting what the last dropped


async def test_the_capacity_snapshot_is_fetched_again_once_its_clock_passes_refresh_s() -> None:
    clock, fetches = ManualClock(), []

    async def fetch() -> QueueState:
        fetches.append(clock())
        return QueueState(frozenset({"engine-1"}), 0, 0, 0)

    gate = CapacityGate(fetch, max_queued=8, refresh_s=0.25, clock=clock)
    await gate.admit()
    clock.advance(0.2)
    await gate.admit()
    assert fetches == [1_000_000.0]  # one snapshot serves both
    clock.advance(0.05)
    await gate.admit()
    assert fetches == [1_000_000.0, 1_000_000.25]
