"""Until the engine serves, a stop request ends it at once and cleanly.

While the engine imports torch and loads its model it holds no turn, so there
is nothing to hand back: SIGINT (``wsinfer serve`` stops its engine with it; in
a terminal of its own, a Ctrl-C) and SIGTERM end the process there and then, as
a kill -9 would, which the service survives anyway. Python's default instead
raises ``KeyboardInterrupt`` wherever the main thread happens to be, and the
libraries it imports are not written to survive that halfway through an import:
in CI one swallowed it mid-``numpy``, and the engine went on, half-imported, to
die of a ``RecursionError`` with a long traceback.

The processes the start-up runs (the kernels' compilers) end with it: a stopped
engine leaves nothing running. This module imports nothing heavy: it is
installed before torch is.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

# The line a stop prints: a standby that is stopped while it loads (a serve
# stopped after a busy spell, which kept it waiting) says so, not that the
# engine which served never did.
_ENGINE_STOPPED = b"wsinfer: engine stopped before it served\n"
_STANDBY_STOPPED = b"wsinfer: standby engine stopped before it was needed\n"
_stopped_line = _ENGINE_STOPPED


def exit_on_stop_until_serving(*, standby: bool = False) -> None:
    """SIGINT or SIGTERM ends the process at once, from now until the engine's
    own handlers take over (``EngineProcess.run``, ``StandbyGate.wait``)."""
    global _stopped_line
    _stopped_line = _STANDBY_STOPPED if standby else _ENGINE_STOPPED
    for sig in STOP_SIGNALS:
        signal.signal(sig, _exit_now)


def _exit_now(signum: int, _frame: FrameType | None) -> None:
    kill_descendants()
    # os.write, not the logger: the handler may run while the main thread holds
    # the logger's lock, and a plain line is what main() prints for a Ctrl-C too.
    os.write(2, _stopped_line)
    # No atexit, no finalizers: every cache the start-up writes goes into place
    # by a rename, so none is left half-written (at most a stray .tmp- folder).
    os._exit(128 + signum)


def kill_descendants() -> None:
    """SIGKILL every process below this one. Each is stopped first, and the tree
    read again until nothing new appears: a stopped process forks no more, and
    one killed before its children would leave them to init, out of reach."""
    stopped: set[int] = set()
    while found := _descendants(os.getpid()) - stopped:
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        stopped |= found
    for pid in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found
