"""Before the engine serves, SIGINT and SIGTERM end it at once, with one line and
no traceback, wherever its main thread is (here: inside an import, over and over)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.wsinfer.test_serve import alive
from wsinfer.engine.early_stop import _descendants

# Imports a fresh module again and again, as the engine's start does for seconds.
BUSY_IMPORTING = """
import importlib, sys
from wsinfer.engine.early_stop import exit_on_stop_until_serving
assert "torch" not in sys.modules  # installed before anything heavy is imported
exit_on_stop_until_serving(standby=sys.argv[1:] == ["standby"])
if sys.argv[1:] == ["compile"]:  # a compiler driver with a child of its own, as c++ runs cc1plus
    import subprocess
    subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60"])
print("ready", flush=True)
while True:
    sys.modules.pop("json.decoder", None)
    sys.modules.pop("json", None)
    importlib.import_module("json")
"""


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stop_signal_ends_the_start_up_at_once(sig: signal.Signals, code: int) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", BUSY_IMPORTING],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    assert process.stdout.readline() == "ready\n"
    process.send_signal(sig)
    _, stderr = process.communicate(timeout=10)
    assert process.returncode == code
    assert stderr == "wsinfer: engine stopped before it served\n"


def test_a_standby_stopped_while_it_loads_says_so() -> None:
    """Not that the engine never served: serve's engine did; its standby, kept
    waiting by a busy engine, was just not needed."""
    process = subprocess.Popen(
        [sys.executable, "-c", BUSY_IMPORTING, "standby"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    assert process.stdout.readline() == "ready\n"
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=10)
    assert process.returncode == 143
    assert stderr == "wsinfer: standby engine stopped before it was needed\n"


def test_what_the_start_up_runs_ends_with_it() -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", BUSY_IMPORTING, "compile"], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    assert process.stdout.readline() == "ready\n"
    deadline = time.monotonic() + 10
    while len(tree := _descendants(process.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)  # sh, and the two sleeps it starts
    assert len(tree) == 3
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=10) == 130
    deadline = time.monotonic() + 5  # SIGKILL is not instant, but nearly
    while [pid for pid in tree if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [pid for pid in tree if alive(pid)] == []
