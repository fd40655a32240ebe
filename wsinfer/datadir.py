"""Where ``wsinfer serve`` keeps its sessions, and the lock that gives it to one server.

The private Redis writes its append-only file here, so sessions outlive the
server itself: a restart (Ctrl-C, ``kill -9``, a reboot, an upgrade) is one more
fault that the token log recovers from. Two servers on one directory would
write one append-only file from two Redis processes, so the directory is locked
with ``flock``: the kernel releases the lock when its last holder dies, so a
lock never outlives the server that took it, however that server ended.

The private Redis inherits the lock's descriptor: a server killed with -9
leaves its Redis to finish writing the file (it exits on its parent's death),
and the next server waits for that, instead of opening the file under it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path

from wsinfer.preflight import StartupError

LOCK_NAME = "serve.lock"
# A dead server's Redis writes its last second of the file and exits: a moment.
PREVIOUS_EXIT_WAIT_S = 15.0


def default_data_dir() -> Path:
    """``$WSINFER_DATA_DIR``, else ``$XDG_STATE_HOME/wsinfer``, else ``~/.local/state/wsinfer``."""
    chosen = os.environ.get("WSINFER_DATA_DIR")
    if chosen:
        return Path(chosen).expanduser()
    state = os.environ.get("XDG_STATE_HOME")
    base = Path(state) if state and os.path.isabs(state) else Path.home() / ".local" / "state"
    return base / "wsinfer"


class DataDirLock:
    """An exclusive ``flock`` on ``DIR/serve.lock``, holding the server's pid.

    ``fd`` is what a child must inherit to hold the lock with the server."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.fd: int | None = None

    def acquire(
        self, wait_s: float = PREVIOUS_EXIT_WAIT_S, on_wait: Callable[[int | None], None] = print
    ) -> None:
        """Take the lock, or raise ``StartupError`` at once when a live server holds it.

        Held, but by a server that is gone: its Redis is still exiting, which
        takes a moment; wait up to ``wait_s`` for that (``on_wait`` says so)."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise StartupError(f"cannot use the data directory {self.directory}: {exc}") from None
        try:
            self._lock(fd, wait_s, on_wait)
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def _lock(self, fd: int, wait_s: float, on_wait: Callable[[int | None], None]) -> None:
        if _try_lock(fd):
            return
        holder = _holder(fd)
        if holder is not None and _alive(holder):
            raise StartupError(
                f"another wsinfer serve (pid {holder}) is using the data directory "
                f"{self.directory}; stop it, or give this one another --data-dir"
            )
        on_wait(holder)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            time.sleep(0.05)
            if _try_lock(fd):
                return
        raise StartupError(
            f"the data directory {self.directory} is still locked by the processes of a "
            f"server that is gone (pid {holder}); see `fuser {self.directory / LOCK_NAME}`"
        )

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # the lock goes with the last descriptor (a child may hold one)
            self.fd = None


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _holder(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 32, 0).decode().strip())
    return None


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not): a server that holds the lock itself."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive, and not ours to judge
    with contextlib.suppress(OSError):
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    return True
