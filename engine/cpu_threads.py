"""The engine's CPU threads: as many as the cores that other work leaves it.

The compute threads of a step wait for each other at every operation (over a
hundred a token), so one of them that another process preempts stalls them
all. Measured on a 2-core AMD EPYC with a neighbour (a test run) using about a
core, one stream: 10-12 tok/s with 2 threads, 133-146 with 1; 8 streams 67-100
against 227-260. Through ``wsinfer serve`` the neighbour is also the frontend,
Redis and the client, which wake for every token.

So every half second the engine reads how busy its cores were (``/proc/stat``,
the cores it may run on) and how much of that was its own (``/proc/self/stat``),
and uses as many threads as the cores the others left free, rounded, from one
to the number it was given. The band between 0.4 and 0.6 of a core keeps it
from changing at every look. The kernels compute the same bits with any number
of threads (``native_cpu.cpp``), so a change mid-turn changes no token.
Where there is no ``/proc``, the threads stay as they were given.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

from wsinfer.cpu_time import busy_core_seconds, process_cpu_seconds

log = structlog.get_logger("wsinfer.engine")

LOOK_EVERY_S = 0.5
# Others' share of a core beyond which a thread is given up, and below which
# it is taken back: between them, the count stays.
GIVE_UP_AT = 0.6
TAKE_BACK_AT = 0.4


@dataclass(frozen=True)
class CpuTimes:
    """Seconds the cores were busy (everyone), and this process's own CPU seconds."""

    busy: float
    own: float


def read_cpu_times(cores: frozenset[int]) -> CpuTimes | None:
    """From ``/proc``: None where it cannot be read."""
    busy, own = busy_core_seconds(cores), process_cpu_seconds()
    return None if busy is None or own is None else CpuTimes(busy, own)


def allowed_cores() -> frozenset[int]:
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


class ThreadShare:
    """Sets torch's thread count to what the machine leaves this engine."""

    def __init__(
        self,
        limit: int | None = None,
        *,
        cores: frozenset[int] | None = None,
        read: Callable[[frozenset[int]], CpuTimes | None] = read_cpu_times,
        clock: Callable[[], float] = time.monotonic,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ) -> None:
        self.cores = cores if cores is not None else allowed_cores()
        self.limit = max(1, limit if limit is not None else torch.get_num_threads())
        self.threads = self.limit
        self._read, self._clock, self._set_threads = read, clock, set_threads
        self._last = read(self.cores)
        self._last_at = clock()

    def look(self) -> int:
        """Every ``LOOK_EVERY_S`` (cheap between): the threads to use, set if changed."""
        now = self._clock()
        if now - self._last_at < LOOK_EVERY_S:
            return self.threads
        times = self._read(self.cores)
        last, elapsed = self._last, now - self._last_at
        self._last, self._last_at = times, now
        if times is None or last is None:
            return self.threads
        others = max(0.0, (times.busy - last.busy) - (times.own - last.own)) / elapsed
        fitting = self._fitting(len(self.cores) - others)
        if fitting != self.threads:
            log.info(
                "engine threads", threads=fitting, before=self.threads, others=round(others, 2)
            )
            self._set_threads(fitting)
            self.threads = fitting
        return self.threads

    def _fitting(self, free: float) -> int:
        # Others on the cores this engine's threads run on, beyond those left unused.
        if self.threads - free >= GIVE_UP_AT:
            return max(1, min(self.threads - 1, math.floor(free + TAKE_BACK_AT)))
        if free - self.threads >= 1 - TAKE_BACK_AT:  # a core more, all but TAKE_BACK_AT free
            return min(self.limit, math.floor(free + TAKE_BACK_AT))
        return self.threads
