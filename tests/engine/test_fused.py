"""The fused kernels of the CUDA forward (engine/fused.py, engine/fused_triton.py), run by
Triton's CPU interpreter in a subprocess (Triton reads TRITON_INTERPRET at import)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (the test extra installs it on linux x86_64 only)",
)


def interpreted(module: str, *args: str) -> str:
    """stdout of ``python -m module args`` under the interpreter; fails the test if it fails."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@needs_triton
def test_fused_kernels_match_torch_and_do_not_depend_on_the_batch() -> None:
    assert interpreted("tests.engine.fused_cases").startswith("ok:")
