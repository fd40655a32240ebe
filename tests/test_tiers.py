"""The test tiers (tests/conftest.py): what is marked slow, and the fast tier's guard."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SLOW_MODULES

ROOT = Path(__file__).resolve().parents[1]


def test_every_listed_slow_module_exists() -> None:
    """A misspelt entry would leave its module in the fast tier without a word."""
    assert [m for m in sorted(SLOW_MODULES) if not (ROOT / m).is_file()] == []


def test_a_fast_test_cannot_start_a_wsinfer_process() -> None:
    with pytest.raises(RuntimeError, match="mark it @pytest.mark.slow"):
        subprocess.Popen([sys.executable, "-m", "wsinfer", "--help"])


def test_a_fast_test_may_start_other_processes() -> None:
    done = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True)
    assert done.stdout.strip() == "42"


@pytest.mark.slow
def test_a_slow_test_may_start_a_wsinfer_process() -> None:
    done = subprocess.run([sys.executable, "-m", "wsinfer", "--help"], capture_output=True)
    assert done.returncode == 0 and b"serve" in done.stdout
