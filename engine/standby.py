"""A standby engine: loaded and waiting, so that a dead engine's turns go on at once.

``wsinfer serve`` keeps one beside its engine (``--standby``): it loads the model
and builds its core as any engine does, then waits without touching Redis. So
that it does not slow the engine that serves, it loads at a lower CPU priority,
and the supervisor holds it (SIGSTOP) whenever that engine is busy
(``wsinfer/standby_pacing.py``): it loads in the pauses between answers. When the
engine dies, the supervisor ends that engine's leases and sends SIGUSR1 here;
this process takes its priority back and becomes the engine, and its first
takeover scan continues every turn from the token log: a second, where loading
a new engine would take many. Held, it is killed by its parent's death (the
kernel's SIGKILL: a stopped process leaves SIGTERM pending); once it serves,
that death sends SIGTERM again, as for any engine, so that it hands its turns back.

The supervisor starts a standby with SIGUSR1 blocked (the mask survives exec),
so an activation sent while this process is still starting waits for
``StandbyGate`` instead of killing it (SIGUSR1's default action); it does not
import this module, which would load the engine's package into the supervisor.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import structlog

from wsinfer.parent_death import set_parent_death_signal

from .early_stop import exit_on_stop_until_serving

log = structlog.get_logger("wsinfer.engine.standby")

ACTIVATE = signal.SIGUSR1
# Loading at this priority leaves the cores to the engine that serves.
STANDBY_NICENESS = 10


class StandbyGate:
    """Catches the activation from the moment it exists, and waits for it."""

    def __init__(self) -> None:
        self.activated = threading.Event()
        self.stopped = threading.Event()
        self._niceness = os.getpriority(os.PRIO_PROCESS, 0)
        signal.signal(ACTIVATE, self._activate)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {ACTIVATE})
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, self._niceness + STANDBY_NICENESS)

    def _activate(self, *_: Any) -> None:
        self.activated.set()

    def _stop(self, *_: Any) -> None:
        self.stopped.set()

    def wait(self, orphaned: Callable[[], bool]) -> bool:
        """Until activated (True), or told to stop or left by its parent (False)."""
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        log.info("standby engine ready: it takes over at once if the engine dies")
        while not self.activated.wait(0.2):
            if self.stopped.is_set() or orphaned():
                return False
        exit_on_stop_until_serving()  # until EngineProcess.run takes the signals
        set_parent_death_signal(signal.SIGTERM)
        restore_priority(self._niceness)
        log.info("standby engine activated")
        return True


def restore_priority(niceness: int) -> None:
    """Every thread's priority back to ``niceness`` (Linux keeps one per thread:
    the compute threads started while loading inherited the standby's)."""
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except PermissionError:  # lowering niceness needs CAP_SYS_NICE: stay nicer
            log.warning("standby engine keeps its lower CPU priority", niceness=niceness)
            return
        except OSError:  # a thread that ended meanwhile
            continue
