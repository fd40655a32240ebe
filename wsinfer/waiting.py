"""Waiting with a time limit (an ``asyncio.Event``, a queue's next item, any
awaitable), without losing a cancel.

``asyncio.wait_for`` on Python 3.10 and 3.11 returns the awaited result, and
drops a cancellation, when the cancel lands in the loop step between the
event being set and ``wait_for`` resuming. A connection task cancelled because
its client hung up then goes on following the session (CI saw an abandoned turn
run for 25 s instead of pausing). ``asyncio.wait`` has no such window: a cancel
of the waiting task always raises.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_set(event: asyncio.Event, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``event``; True if it is set."""
    if event.is_set():
        return True
    try:
        await within(event.wait(), timeout)
    except TimeoutError:
        return False
    return True


async def within(awaitable: Awaitable[T], timeout: float) -> T:
    """``awaitable``'s result if it comes within ``timeout`` seconds, else
    ``TimeoutError`` (the awaitable is cancelled): ``asyncio.wait_for`` without its
    lost cancel. A result that comes in the same loop step as the time limit is
    kept, not dropped: a queue's item taken then is returned, not lost."""
    task = asyncio.ensure_future(awaitable)
    try:
        await asyncio.wait((task,), timeout=max(0.0, timeout))
    finally:
        if not task.done():
            task.cancel()  # a queue's get cancelled before it ran takes no item
    if not task.done():
        raise TimeoutError
    return task.result()
