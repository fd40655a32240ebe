"""A loading standby engine held while the engine that serves is busy.

A standby (``engine/standby.py``) loads the model beside the engine that serves.
On a machine with few cores that load takes the cores the serving engine's
threads need: on 2 cores the first answers after every start ran 4-8x slower
while it loaded (about 20 tok/s instead of 85-100, with gaps of a second between
deltas). A lower priority does not help (nice 10 and 19 were measured): the
engine's threads wait for each other at every step, so whichever core runs the
standby for a moment stalls both.

So the supervisor stops the standby (SIGSTOP) whenever the engine used more
than a fifth of a core since the last look (every 50 ms), and lets it go on (SIGCONT) once
the engine has been idle for a second: the standby loads in the pauses between
answers, and an answer is never slowed by it. An engine busy without a pause
keeps its standby waiting, which costs only what having no standby costs: a
dead engine is restarted instead of taken over. Once loaded, a standby sleeps,
so holding it then changes nothing; it is let go before any signal that must
reach it (its activation, the stop).

The engine's CPU time comes from ``/proc``; where there is none, the standby is
never held and loads as it always did.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from collections.abc import Callable

import structlog

from wsinfer.cpu_time import process_cpu_seconds

log = structlog.get_logger("wsinfer.serve")

# More than this share of one core since the last look: the engine is at work.
BUSY_CORES = 0.2
# The engine idle this long: the standby may go on loading.
IDLE_BEFORE_LOADING_S = 1.0


class StandbyPacing:
    """Decides, at each look, whether the standby may use the cores now."""

    def __init__(
        self,
        cpu_seconds: Callable[[int], float | None] = process_cpu_seconds,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cpu_seconds = cpu_seconds
        self._clock = clock
        self._last: tuple[int, float, float] | None = None  # engine pid, its CPU, when
        self._busy_at = -float("inf")
        self.held: subprocess.Popen[bytes] | None = None

    def pace(self, engine: subprocess.Popen[bytes], standby: subprocess.Popen[bytes]) -> None:
        """Hold ``standby`` while ``engine`` works; let it go after a second idle."""
        if self._engine_busy(engine.pid):
            if self.held is not standby and _signal(standby, signal.SIGSTOP):
                self.held = standby
                log.debug("standby engine held while the engine works", pid=standby.pid)
        elif self.held is standby and self._clock() - self._busy_at >= IDLE_BEFORE_LOADING_S:
            self.release()

    def release(self) -> None:
        """The held standby goes on now (before a signal that must reach it)."""
        if self.held is not None:
            _signal(self.held, signal.SIGCONT)
            log.debug("standby engine goes on", pid=self.held.pid)
            self.held = None

    def _engine_busy(self, pid: int) -> bool:
        cpu, now = self._cpu_seconds(pid), self._clock()
        if cpu is None:
            self._last = None
            return False
        last, self._last = self._last, (pid, cpu, now)
        if last is None or last[0] != pid or now <= last[2]:
            return False  # a first look at this engine
        busy = (cpu - last[1]) / (now - last[2]) > BUSY_CORES
        if busy:
            self._busy_at = now
        return busy


def _signal(process: subprocess.Popen[bytes], sig: signal.Signals) -> bool:
    """Sent, unless the process has ended (poll() has reaped it, or it is gone)."""
    if process.poll() is not None:
        return False
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(sig)
        return True
    return False
