"""Admission limits of one frontend: engine capacity, request rates, log repeats.

Each is a small policy object with no I/O of its own, so the rules are
testable without a socket; the server consults them on every request.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from itertools import pairwise

from wsinfer.clock import Clock
from wsinfer.errors import EngineUnavailable, Overloaded
from wsinfer.sessions.store import QueueState

Fetch = Callable[[], Awaitable[QueueState]]

# An ``overloaded`` answer's retry_after (seconds): never "at once", never absurd.
MIN_RETRY_AFTER_S = 0.1
MAX_RETRY_AFTER_S = 600.0
# Each wait is stretched by up to this fraction at random: frontends that share a
# queue, and clients told the same slot, do not come back in step.
RETRY_JITTER = 0.2
# Promises of room this frontend keeps at most, in queues' worth: a client that
# retries without waiting must not push every later client's turn into the future.
MAX_PROMISED_QUEUES = 4


class CapacityGate:
    """Whether a new turn may be queued: an engine is alive, the queue is not full.

    Asking Redis on every ``generate`` cost two round trips per request; a
    snapshot shared by all requests for ``refresh_s`` (one fetch in flight at a
    time) costs one per interval, and turns accepted since the snapshot are
    counted locally so a burst cannot overshoot the queue limit. A refusal
    costs no round trip: its ``retry_after`` comes from the snapshot.
    """

    def __init__(
        self,
        fetch: Fetch,
        max_queued: int,
        refresh_s: float = 0.25,
        clock: Clock = time.monotonic,
    ) -> None:
        self._fetch = fetch
        self._clock = clock
        self.max_queued = max_queued
        self.refresh_s = refresh_s
        self._state = QueueState(frozenset(), 0, None, 0)
        self._taken_at = float("-inf")
        self._since = 0  # turns this frontend queued since the snapshot
        self._inflight: asyncio.Future[QueueState] | None = None
        self.drain = DrainRate()
        self.line = RetryLine()

    async def admit(self) -> frozenset[str]:
        """Raise unless a turn may be queued now; returns the engines alive."""
        state = await self._current()
        if not state.alive:
            raise EngineUnavailable("no engine is running", retry_after=5.0)
        waiting = state.waiting + self._since
        if waiting >= self.max_queued:
            now = self._clock()
            rate = self.drain.rate(now, state.running)
            wait = self.line.promise(now, waiting - self.max_queued + 1, rate, self.max_queued)
            raise Overloaded("too many turns are waiting for an engine", retry_after=wait)
        self._since += 1
        return state.alive

    async def _current(self) -> QueueState:
        if self._clock() - self._taken_at < self.refresh_s:
            return self._state
        if self._inflight is None:
            self._inflight = asyncio.ensure_future(self._refresh())
        return await asyncio.shield(self._inflight)

    async def _refresh(self) -> QueueState:
        try:
            state = await self._fetch()
            self._state, self._taken_at, self._since = state, self._clock(), 0
            self.drain.observe(self._taken_at, state)
            if state.waiting == 0:
                self.line.reset()  # nothing waits: whoever comes gets in, promised or not
            return state
        finally:
            self._inflight = None


class DrainRate:
    """Turns per second the engines finish while turns wait for them: how fast
    the queue drains when it is full.

    Measured from the queue's own counters in successive snapshots: turns
    finished = turns taken - change in turns running (a batch filling up takes
    turns without finishing any). Only intervals that began with turns waiting
    count (an idle engine's rate says nothing), over the last ``window_s``, up
    to the last finish: turns of one length finish in lumps, and the time
    since the last lump is not yet a slower rate. Until a first finish is seen
    (a fresh server, a new burst), and whenever none has been seen for a while,
    the turns running bound it: none of them finished in ``stalled`` seconds.
    """

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, QueueState]] = deque()
        self._known: float | None = None  # the last measurement, kept through idle times
        self._stalled = 0.0  # seconds waited for a finish with turns waiting, at the last sample

    def observe(self, now: float, state: QueueState) -> None:
        """A new snapshot: measure again (once per snapshot, not per refusal)."""
        self._samples.append((now, state))
        while now - self._samples[0][0] > self.window_s:
            self._samples.popleft()
        busy = measured_span = 0.0
        finished = 0
        for (t0, a), (t1, b) in pairwise(self._samples):
            if a.waiting <= 0 or a.taken is None or b.taken is None:
                continue
            busy += t1 - t0
            done = (b.taken - a.taken) - (b.running - a.running)
            if done > 0:
                finished += done
                measured_span = busy
        if finished:
            self._known = finished / measured_span
        self._stalled = busy - measured_span if state.waiting > 0 else 0.0

    def rate(self, now: float, running: int) -> float | None:
        """Turns per second, as of ``now`` (``running``: turns the engines hold);
        None before anything says (no finish seen, no turn running yet)."""
        stalled = self._stalled + max(0.0, now - self._samples[-1][0]) if self._samples else 0.0
        bound = running / max(stalled, 1.0) if running else None
        if self._known is None or bound is None:
            return self._known or bound
        return min(self._known, bound)


class RetryLine:
    """When each refused client should come back: the queue has room for the
    k-th client waiting once ``excess + k`` turns have drained at ``rate``. Each
    refusal takes the next slot of that line (so clients come back spread out,
    not all at once), jittered."""

    def __init__(self) -> None:
        self._next = float("-inf")  # the first free slot (monotonic time)

    def reset(self) -> None:
        self._next = float("-inf")

    def promise(self, now: float, excess: int, rate: float | None, max_queued: int) -> float:
        if rate is None:  # nothing measured yet: come back soon, when something will be
            return round(random.uniform(1.0, 1.0 + RETRY_JITTER), 3)
        gap = 1.0 / rate
        last = now + (excess + MAX_PROMISED_QUEUES * max_queued) * gap
        slot = min(max(now + excess * gap, self._next), last)
        self._next = slot + gap
        wait = (slot - now) * random.uniform(1.0, 1.0 + RETRY_JITTER)
        return round(min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, wait)), 3)


@dataclass
class TokenBucket:
    """Requests per connection: ``rate`` per second on average, bursts of ``burst``."""

    rate: float
    burst: float
    tokens: float = field(default=-1.0)
    stamp: float = field(default=float("-inf"))  # -inf: the clock's time at creation
    clock: Clock = field(default=time.monotonic, kw_only=True, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.tokens < 0:
            self.tokens = self.burst
        if self.stamp == float("-inf"):
            self.stamp = self.clock()

    def take(self) -> float:
        """0.0 if a request may go now, else the seconds until one may."""
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class LogThrottle:
    """At most ``per_window`` log lines per key per window; reports what it dropped.

    A client that repeats a mistake 20,000 times, or a Redis outage that fails
    every request, must not turn the log into the bottleneck.
    """

    def __init__(
        self, per_window: int = 5, window_s: float = 10.0, *, clock: Clock = time.monotonic
    ) -> None:
        self.per_window = per_window
        self.window_s = window_s
        self._clock = clock
        self._seen: dict[str, tuple[float, int]] = {}  # key -> (window start, count)

    def allow(self, key: str) -> tuple[bool, int]:
        """(log this one?, how many of this key were suppressed in the last window)."""
        now = self._clock()
        start, count = self._seen.get(key, (now, 0))
        suppressed = 0
        if now - start >= self.window_s:
            suppressed = max(0, count - self.per_window)
            start, count = now, 0
        count += 1
        if len(self._seen) > 10_000:  # keys are few; this only guards against a leak
            self._seen.clear()
        self._seen[key] = (start, count)
        return count <= self.per_window, suppressed
