"""SIGINT and SIGTERM as an asyncio event, caught from before the event loop exists.

``loop.add_signal_handler`` alone leaves a window at start-up where a signal is
lost: ``asyncio.run`` first installs a SIGINT handler of its own, and a signal
that its C-level handler records before ``add_signal_handler`` has set the
loop's wakeup fd, but that Python runs only after, runs the loop's no-op
handler; nothing reaches the loop. A Ctrl-C 0.37 s into ``wsinfer serve`` left
it serving, here. A plain Python handler installed before the loop, which hands
the signal to the loop with ``call_soon_threadsafe`` once there is one, has no
such window: Python runs it between two bytecodes of the main thread, and the
signal interrupts a ``select`` the loop may be blocked in.
"""

from __future__ import annotations

import asyncio
import signal
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Catches SIGINT and SIGTERM from ``__init__`` until ``restore``."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self._previous: dict[int, Any] = {
            sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS
        }

    def event(self) -> asyncio.Event:
        """An event of the running loop, set by the first stop signal (at once if
        one came already)."""
        self._event = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        if self.received is not None:  # after the loop is set: neither order misses one
            self._event.set()
        return self._event

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.received = signum
        loop, event = self._loop, self._event
        if loop is not None and event is not None and not loop.is_closed():
            loop.call_soon_threadsafe(event.set)
