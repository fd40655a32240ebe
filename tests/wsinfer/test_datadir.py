"""The data directory's default, and its lock: one server at a time, never stale."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from wsinfer.datadir import LOCK_NAME, DataDirLock, default_data_dir
from wsinfer.preflight import StartupError

# Holds the lock as a server's Redis does: an inherited descriptor, with the pid of
# a process that may be gone written in the file.
HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0); os.write(fd, (sys.argv[2] + "\\n").encode())
print("locked", flush=True)
time.sleep(float(sys.argv[3]))
"""


def hold(directory: Path, pid: str, seconds: float) -> subprocess.Popen[str]:
    directory.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-c", HOLDER, str(directory / LOCK_NAME), pid, str(seconds)]
    holder = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
    return holder


def dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], text=True,
                          capture_output=True, check=True)  # fmt: skip
    return int(done.stdout)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"WSINFER_DATA_DIR": "/srv/wsinfer"}, "/srv/wsinfer"),
        ({"WSINFER_DATA_DIR": "/srv/w", "XDG_STATE_HOME": "/x"}, "/srv/w"),
        ({"XDG_STATE_HOME": "/x/state"}, "/x/state/wsinfer"),
        ({"XDG_STATE_HOME": "relative/ignored"}, "HOME/.local/state/wsinfer"),
        ({}, "HOME/.local/state/wsinfer"),
    ],
)
def test_the_default_data_dir(
    env: dict[str, str], expected: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ("WSINFER_DATA_DIR", "XDG_STATE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert default_data_dir() == Path(expected.replace("HOME", str(tmp_path)))


def test_the_lock_is_one_holder_at_a_time_and_records_its_pid(tmp_path: Path) -> None:
    lock = DataDirLock(tmp_path / "data")
    lock.acquire()
    assert (tmp_path / "data" / LOCK_NAME).read_text() == f"{os.getpid()}\n"
    other = DataDirLock(tmp_path / "data")
    with pytest.raises(StartupError, match=f"pid {os.getpid()}.*another --data-dir"):
        other.acquire()
    lock.release()
    other.acquire()  # let go: the next one takes it
    other.release()


def test_a_live_holder_is_refused_at_once(tmp_path: Path) -> None:
    holder = hold(tmp_path, "", 60)
    try:
        (tmp_path / LOCK_NAME).write_text(f"{holder.pid}\n")
        started = time.monotonic()
        with pytest.raises(StartupError, match=f"another wsinfer serve \\(pid {holder.pid}\\)"):
            DataDirLock(tmp_path).acquire()
        assert time.monotonic() - started < 1
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_dies_with_its_holder_even_after_kill_9(tmp_path: Path) -> None:
    holder = hold(tmp_path, "1", 60)
    holder.kill()
    holder.wait()
    lock = DataDirLock(tmp_path)
    lock.acquire(wait_s=0)
    lock.release()


def test_a_gone_server_s_redis_still_exiting_is_waited_for(tmp_path: Path) -> None:
    """The pid in the file is dead, but its child still holds the lock: wait, then take it."""
    holder = hold(tmp_path, str(dead_pid()), 1.0)
    waited: list[int | None] = []
    lock = DataDirLock(tmp_path)
    lock.acquire(wait_s=30, on_wait=waited.append)
    assert holder.wait(5) == 0 and len(waited) == 1
    lock.release()


def test_a_holder_that_never_lets_go_ends_the_wait_with_a_clear_error(tmp_path: Path) -> None:
    holder = hold(tmp_path, str(dead_pid()), 60)
    try:
        with pytest.raises(StartupError, match="still locked by the processes of a server"):
            DataDirLock(tmp_path).acquire(wait_s=0.3, on_wait=lambda _: None)
    finally:
        holder.kill()
        holder.wait()


def test_an_unusable_data_dir_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(StartupError, match="cannot use the data directory"):
        DataDirLock(tmp_path / "file" / "data").acquire()
