"""Ctrl-C at any point of `wsinfer serve`'s start-up: no traceback, nothing left
running, and the next start is not hindered (the data dir's lock went with it)."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.models import tiny_model_dir
from tests.stack import start_serve, stop_serve
from tests.wsinfer.test_serve import alive, children_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def descendants(pid: int) -> set[int]:
    found: set[int] = set()
    for child in children_of(pid):
        found |= {child, *descendants(child)}
    return found


@pytest.mark.parametrize("seed", range(6))
def test_ctrl_c_during_start_up(tmp_path: Path, seed: int) -> None:
    # From imports (the interpreter itself takes ~0.1 s to start; a Ctrl-C before it
    # runs any of our code is Python's) to after the engine serves.
    delay = [0.3, 1.0, 2.0][seed] if seed < 3 else random.Random(seed).uniform(0.3, 8.0)
    command = [sys.executable, "-m", "wsinfer", "serve", "--port", "0"]
    process = subprocess.Popen(
        [*command, "--model", str(tiny_model_dir()), "--data-dir", str(tmp_path / "data")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TMPDIR": str(tmp_path)},
    )
    seen: set[int] = set()
    deadline = time.monotonic() + delay
    while time.monotonic() < deadline:
        seen |= descendants(process.pid)
        time.sleep(0.02)
    process.send_signal(signal.SIGINT)  # as a terminal's Ctrl-C reaches it
    _, stderr = process.communicate(timeout=60)
    assert process.returncode in (0, 130), stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert len(stderr.strip().splitlines()) <= 12, stderr  # a few log lines, no dump
    assert [pid for pid in seen if alive(pid)] == []
    # The next start is not held up by anything this one left behind.
    again, _ = start_serve(tmp_path, "--model", "fake:100", "--data-dir", str(tmp_path / "data"))
    assert stop_serve(again) == 0
