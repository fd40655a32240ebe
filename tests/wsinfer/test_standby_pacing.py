"""A loading standby engine is held (SIGSTOP) while the engine that serves is busy.

Real child processes stand in for the engine and its standby: the signals, the
process states in ``/proc`` and the parent-death rule are the kernel's own. The
engine's CPU time is scripted where the test decides busy or idle, and real
where the supervisor's wiring is checked.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from wsinfer.clock import ManualClock
from wsinfer.cpu_time import process_cpu_seconds
from wsinfer.standby_pacing import BUSY_CORES, IDLE_BEFORE_LOADING_S, StandbyPacing
from wsinfer.supervisor import EngineChild, EngineSupervisor

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")

SLEEPER = "import time; time.sleep(60)"
SPINNER = "while True: pass"
# A standby stand-in: its activation (SIGUSR1) ends it with status 7.
ACTIVATED = 7
ACTIVATABLE = (
    "import signal, sys, time; "
    f"signal.signal(signal.SIGUSR1, lambda *_: sys.exit({ACTIVATED})); "
    "print('ready', flush=True); time.sleep(60)"
)


def child(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)


def ready(process: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
    assert process.stdout is not None
    assert process.stdout.readline() == b"ready\n"  # its handlers are in place
    return process


def state(pid: int) -> str:
    """The process's state letter: T stopped, S sleeping, R running."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def ended(*processes: subprocess.Popen[bytes]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait(5)


class ScriptedCpu:
    """The engine's CPU seconds, as the test says it spent them."""

    def __init__(self) -> None:
        self.seconds: float | None = 0.0

    def __call__(self, pid: int) -> float | None:
        return self.seconds

    def spend(self, clock: ManualClock, cores: float, seconds: float) -> None:
        clock.advance(seconds)
        if self.seconds is not None:
            self.seconds += cores * seconds


Pair = tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]


@pytest.fixture
def pair() -> Iterator[Pair]:
    engine, standby = child(SLEEPER), child(SLEEPER)
    yield engine, standby
    ended(engine, standby)


def test_the_cpu_seconds_of_a_process_are_read_from_proc() -> None:
    before = process_cpu_seconds(os.getpid())
    assert before is not None
    spin_until = time.process_time() + 0.1
    while time.process_time() < spin_until:
        pass
    after = process_cpu_seconds(os.getpid())
    assert after is not None and after - before >= 0.05
    gone = child("pass")
    gone.wait()
    assert process_cpu_seconds(gone.pid) is None  # reaped: no /proc entry


def test_a_busy_engine_holds_the_standby_until_it_has_been_idle_a_second(pair: Pair) -> None:
    engine, standby = pair
    clock, cpu = ManualClock(), ScriptedCpu()
    pacing = StandbyPacing(cpu, clock)
    pacing.pace(engine, standby)  # a first look: nothing to compare yet
    cpu.spend(clock, 2.0, 0.2)  # both cores at work
    pacing.pace(engine, standby)
    assert until(lambda: state(standby.pid) == "T")
    assert pacing.held is standby
    cpu.spend(clock, 2.0, 0.2)  # still at work: held, no second SIGSTOP needed
    pacing.pace(engine, standby)
    # Idle, but not yet for a second: between two answers of a client's loop.
    for _ in range(int(IDLE_BEFORE_LOADING_S / 0.2) - 1):
        cpu.spend(clock, 0.0, 0.2)
        pacing.pace(engine, standby)
        assert pacing.held is standby
    cpu.spend(clock, 0.0, 0.25)  # a second and more
    pacing.pace(engine, standby)
    assert pacing.held is None
    assert until(lambda: state(standby.pid) != "T")
    # A heartbeat's worth of work is not work: the standby goes on loading.
    cpu.spend(clock, BUSY_CORES / 2, 0.2)
    pacing.pace(engine, standby)
    assert pacing.held is None


def test_release_lets_a_held_standby_go_on_and_an_ended_one_is_left_alone(pair: Pair) -> None:
    engine, standby = pair
    clock, cpu = ManualClock(), ScriptedCpu()
    pacing = StandbyPacing(cpu, clock)
    pacing.pace(engine, standby)
    cpu.spend(clock, 1.0, 0.2)
    pacing.pace(engine, standby)
    assert until(lambda: state(standby.pid) == "T")
    pacing.release()
    assert until(lambda: state(standby.pid) != "T")
    assert pacing.held is None
    # Held, then ended (killed, reaped): neither releasing nor pacing it fails.
    cpu.spend(clock, 1.0, 0.2)
    pacing.pace(engine, standby)
    standby.kill()
    standby.wait()
    pacing.release()
    pacing.pace(engine, standby)
    assert pacing.held is None


def test_without_proc_figures_the_standby_is_never_held(pair: Pair) -> None:
    engine, standby = pair
    clock, cpu = ManualClock(), ScriptedCpu()
    cpu.seconds = None
    pacing = StandbyPacing(cpu, clock)
    for _ in range(5):
        cpu.spend(clock, 2.0, 0.2)
        pacing.pace(engine, standby)
    assert pacing.held is None
    assert state(standby.pid) != "T"


def test_a_new_engine_is_looked_at_afresh(pair: Pair) -> None:
    """CPU seconds of the engine before a takeover say nothing of the one after."""
    engine, standby = pair
    clock = ManualClock()
    seconds = {engine.pid: 0.0, standby.pid: 100.0}  # the standby had loaded for long
    pacing = StandbyPacing(seconds.get, clock)
    pacing.pace(engine, standby)
    clock.advance(0.2)
    pacing.pace(standby, engine)  # the standby serves now: its seconds are not new work
    assert pacing.held is None


Held = tuple[EngineSupervisor, subprocess.Popen[bytes], subprocess.Popen[bytes]]


@pytest.fixture
async def held() -> AsyncIterator[Held]:
    """A supervisor whose spinning engine (real CPU time) has held its standby."""
    engine, standby = child(SPINNER), ready(child(ACTIVATABLE))
    supervisor = EngineSupervisor([], standby=True, seen=_never_seen)
    supervisor.current = EngineChild("serve-engine", engine)
    supervisor.standby = EngineChild("serve-standby", standby)
    try:
        for _ in range(5):
            assert await supervisor.check()
            time.sleep(0.2)
        assert state(standby.pid) == "T"
        yield supervisor, engine, standby
    finally:
        ended(engine, standby)


async def test_the_supervisor_holds_its_standby_and_activates_it_held(held: Held) -> None:
    """The engine's death reaches the standby's activation although it was held."""
    supervisor, engine, standby = held
    engine.kill()
    engine.wait()
    assert await supervisor.check()  # the standby takes over: let go, then activated
    assert standby.wait(5) == ACTIVATED
    assert supervisor.current is not None and supervisor.current.process is standby


async def test_stopping_the_supervisor_ends_a_held_standby_at_once(held: Held) -> None:
    supervisor, _, standby = held
    started = time.monotonic()
    supervisor.stop()
    assert standby.returncode == -signal.SIGTERM  # not killed after the grace time
    assert time.monotonic() - started < 5


async def _never_seen(engine_id: str) -> bool:
    return False  # no further standby is started


# A parent that starts a standby as serve does, holds it, and says its pid.
PARENT = """
import signal, subprocess, sys, time
from wsinfer.supervisor import _prepare_standby, _spawn
standby = _spawn([sys.executable, "-c", "import time; time.sleep(60)"], preexec=_prepare_standby)
standby.send_signal(signal.SIGSTOP)
print(standby.pid, flush=True)
time.sleep(60)
"""


def test_a_held_standby_dies_with_a_parent_killed_9() -> None:
    """A stopped process leaves SIGTERM pending: the standby's parent-death
    signal is SIGKILL, so a kill -9 of serve leaves no held standby behind."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert parent.stdout is not None
        standby = int(parent.stdout.readline())
        assert until(lambda: state(standby) == "T")
        parent.kill()
        parent.wait()
        assert until(lambda: not Path(f"/proc/{standby}").exists() or state(standby) == "Z")
    finally:
        ended(parent)
