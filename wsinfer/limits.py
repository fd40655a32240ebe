"""Admission limits of one frontend: engine capacity, request rates, log repeats.

Each is a small policy object with no I/O of its own, so the rules are
testable without a socket; the server consults them on every request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from wsinfer.errors import EngineUnavailable, Overloaded

Snapshot = tuple[frozenset[str], int]  # engines alive, turns waiting for one


class CapacityGate:
    """Whether a new turn may be queued: an engine is alive, the queue is not full.

    Asking Redis on every ``generate`` cost two round trips per request; a
    snapshot shared by all requests for ``refresh_s`` (one fetch in flight at a
    time) costs one per interval, and turns accepted since the snapshot are
    counted locally so a burst cannot overshoot the queue limit.
    """

    def __init__(
        self, fetch: Callable[[], Awaitable[Snapshot]], max_queued: int, refresh_s: float = 0.25
    ) -> None:
        self._fetch = fetch
        self.max_queued = max_queued
        self.refresh_s = refresh_s
        self._snapshot: Snapshot = (frozenset(), 0)
        self._taken_at = float("-inf")
        self._since = 0  # turns this frontend queued since the snapshot
        self._inflight: asyncio.Future[Snapshot] | None = None

    async def admit(self) -> frozenset[str]:
        """Raise unless a turn may be queued now; returns the engines alive."""
        alive, depth = await self._current()
        if not alive:
            raise EngineUnavailable("no engine is running", retry_after=5.0)
        if depth + self._since >= self.max_queued:
            raise Overloaded("too many turns are waiting for an engine", retry_after=1.0)
        self._since += 1
        return alive

    async def _current(self) -> Snapshot:
        if time.monotonic() - self._taken_at < self.refresh_s:
            return self._snapshot
        if self._inflight is None:
            self._inflight = asyncio.ensure_future(self._refresh())
        return await asyncio.shield(self._inflight)

    async def _refresh(self) -> Snapshot:
        try:
            snapshot = await self._fetch()
            self._snapshot, self._taken_at, self._since = snapshot, time.monotonic(), 0
            return snapshot
        finally:
            self._inflight = None


@dataclass
class TokenBucket:
    """Requests per connection: ``rate`` per second on average, bursts of ``burst``."""

    rate: float
    burst: float
    tokens: float = field(default=-1.0)
    stamp: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.tokens < 0:
            self.tokens = self.burst

    def take(self) -> float:
        """0.0 if a request may go now, else the seconds until one may."""
        now = time.monotonic()
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

    def __init__(self, per_window: int = 5, window_s: float = 10.0) -> None:
        self.per_window = per_window
        self.window_s = window_s
        self._seen: dict[str, tuple[float, int]] = {}  # key -> (window start, count)

    def allow(self, key: str) -> tuple[bool, int]:
        """(log this one?, how many of this key were suppressed in the last window)."""
        now = time.monotonic()
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
