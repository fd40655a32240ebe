"""The fused kernels of the CUDA forward (engine/fused.py, engine/fused_triton.py), run by
Triton's CPU interpreter in a subprocess (Triton reads TRITON_INTERPRET at import)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from wsinfer.engine import fused
from wsinfer.engine.kvpool import KVPool
from wsinfer.engine.llama import FastLlama
from wsinfer.engine.runner import DecodeContext

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


@pytest.mark.parametrize(
    ("name", "fusable"),
    [
        ("mistral", True),
        ("qwen2", True),  # q/k/v biases: the matmuls add them, the kernels follow
        ("phi3", True),
        ("qwen3", False),  # q/k norms
        ("olmo2", False),  # norms on the outputs, scaled in fp32
        ("gemma2", False),  # 1 + weight norms, GELU, scaled embeddings
        ("gemma3", False),
        ("phi3-partial-rotary", False),
    ],
)
def test_the_fused_forward_covers_the_plain_pre_norm_families_only(
    name: str, fusable: bool
) -> None:
    from tests.engine.test_families import CONFIGS

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name](256)).eval()
    assert FastLlama(model, 64, transposed=False).fusable is fusable


def test_cpu_tensors_keep_the_torch_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even for a model the kernels cover: the CPU's bits stay the torch forward's."""
    from tests.engine.kernel_count import tiny_model

    def refuse(*args: object) -> None:
        raise AssertionError("the CPU took the fused forward")

    monkeypatch.setattr(fused.TritonKernels, "forward", refuse)
    model = tiny_model(1, torch.float32)
    assert model.fusable
    pool = KVPool(1, 2, 16, model.num_kv_heads, model.head_dim, torch.float32, torch.device("cpu"))
    context = DecodeContext(
        pool, torch.tensor([16]), torch.tensor([[1]], dtype=torch.int32),
        torch.tensor([1], dtype=torch.int32), model.scale, None,
    )  # fmt: skip
    with torch.inference_mode():
        assert model.forward(torch.tensor([3]), torch.tensor([0]), context).isfinite().all()
