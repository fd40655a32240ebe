"""Waiting on an ``asyncio.Event`` with a time limit, without losing a cancel.

``asyncio.wait_for`` on Python 3.10 and 3.11 returns the awaited result, and
drops a cancellation, when the cancel lands in the loop step between the
event being set and ``wait_for`` resuming. A connection task cancelled because
its client hung up then goes on following the session (CI saw an abandoned turn
run for 25 s instead of pausing). ``asyncio.wait`` has no such window: a cancel
of the waiting task always raises.
"""

from __future__ import annotations

import asyncio


async def wait_set(event: asyncio.Event, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``event``; True if it is set."""
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        done, _ = await asyncio.wait((waiter,), timeout=max(0.0, timeout))
    finally:
        waiter.cancel()
    return bool(done)
