"""SIGINT and SIGTERM as an asyncio event, caught from before serve's imports and
its event loop.

Plain Python handlers, installed first thing in ``run_serve``: a stop request
during the supervisor's imports or before its loop runs is kept (``received``)
and set on the loop's event once there is one, instead of a KeyboardInterrupt
raised in the middle of an import, which a library may swallow (torch's import
of numpy did, and serve went on serving; the supervisor no longer imports
torch, but nothing here relies on that). A signal while the loop runs is handed
to it with ``call_soon_threadsafe``, which also wakes a loop blocked in select.
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
