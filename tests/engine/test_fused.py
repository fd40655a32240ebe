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


# The fused forward's decode step: per layer its 4 matmuls, the paged attention, the
# rotary + KV write, two add + RMSNorms and SiLU * mul (the torch forward's: 32, the
# count before the kernels, from the same script); outside the layers the embedding,
# the first norm, the logits, the sampling and the step's own indexing.
MAX_KERNELS_PER_LAYER, MAX_KERNELS_OUTSIDE = 9, 11


@needs_triton
def test_a_decode_step_on_the_gpu_path_launches_few_kernels_and_never_syncs() -> None:
    """tests/engine/kernel_count.py runs the padded decode step (the CUDA graph's program)
    of tiny models with the GPU's kernels under the interpreter, counting the aten ops and
    Triton launches; it also checks the fused forward against the torch one."""
    lines = interpreted("tests.engine.kernel_count").splitlines()
    assert lines[-1] == "ok", lines
    counts = dict(line.split(": ") for line in lines[:-1])
    layer, outside = (int(part.split()[0]) for part in counts["fused"].split(" + "))
    assert layer <= MAX_KERNELS_PER_LAYER and outside <= MAX_KERNELS_OUTSIDE, counts
