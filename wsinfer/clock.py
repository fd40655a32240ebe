"""The clock the timed parts read, and a manual one that tests move.

The session store, the engine's worker, the admission limits and the fan-in
each take ``clock=`` (the real clock by default) and read time only through it,
so a test advances a ``ManualClock`` past a threshold (an engine's heartbeat
going stale, a lease or a resend period running out, a stream going quiet, a
rate refilling) instead of sleeping until the real one gets there.

Which real clock: ``time.time`` where the value is written to Redis and
compared by other processes (heartbeats, ``seen_at``, claim times),
``time.monotonic`` where it never leaves the process.

A leaf: it imports nothing of ours, so every package may import it.
"""

from __future__ import annotations

from collections.abc import Callable

# Seconds, as ``time.time`` or ``time.monotonic`` returns them.
Clock = Callable[[], float]


class ManualClock:
    """A clock that stands still until ``advance`` moves it; call it as a ``Clock``."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move the clock on by ``seconds`` (never back); returns the new time."""
        if seconds < 0:
            raise ValueError(f"a clock does not go back ({seconds} s)")
        self.now += seconds
        return self.now


__all__ = ["Clock", "ManualClock"]
