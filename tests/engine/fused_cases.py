"""The fused kernels (engine/fused_triton.py) against the torch ops they stand for, and
each row's bits alone against the same row in a batch. Run as a script under Triton's
CPU interpreter (tests/engine/test_fused.py does):

    TRITON_INTERPRET=1 python -m tests.engine.fused_cases

(the variable must be set before triton is imported, hence a separate process). On a
CUDA machine, without the variable, the same checks run on the GPU
(benchmarks/gpu/run_on_device.sh fused).

The interpreter rounds fp32 to bf16 otherwise than a GPU (it truncates), so bf16
results are compared within bf16's tolerance, not bit for bit; batch invariance is
compared bit for bit everywhere.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from wsinfer.engine.fused_triton import add_rms_norm_triton, rope_cache_triton, silu_mul_triton
from wsinfer.engine.llama import rms_norm, rotary

DTYPES = (torch.float32, torch.bfloat16)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
Check = Callable[[torch.dtype, torch.Generator], list[str]]


# The interpreter truncates each of up to three roundings to bf16 (a GPU rounds to
# nearest): a few units in the last place of values of order 1. A wrong sign, partner
# or row is off by far more.
BF16_TOLERANCE = {"rtol": 2**-5, "atol": 2**-5}


def close(name: str, got: torch.Tensor, want: torch.Tensor) -> list[str]:
    """[] if ``got`` is within the dtype's tolerance of ``want`` (torch.testing's for
    fp32)."""
    tolerance = BF16_TOLERANCE if got.dtype == torch.bfloat16 else {}
    try:
        torch.testing.assert_close(got, want, **tolerance)  # type: ignore[arg-type]
    except AssertionError as error:
        return [f"{name} {got.dtype}: {str(error).splitlines()[1:4]}"]
    return []


def invariant(name: str, batched: torch.Tensor, rows: list[torch.Tensor]) -> list[str]:
    """[] if each row computed alone has the very bits of its row in the batch."""
    bad = [i for i, row in enumerate(rows) if not torch.equal(batched[i], row[0])]
    return [f"{name} {batched.dtype}: rows {bad} differ alone and in a batch"] if bad else []


def check_add_rms_norm(dtype: torch.dtype, gen: torch.Generator) -> list[str]:
    hidden = 96  # not a power of two: the tile's padded lanes must not count
    scale = 10.0 ** torch.randint(-3, 4, (7, 1), generator=gen)
    x = (torch.randn(7, hidden, generator=gen) * scale).to(DEVICE, dtype)
    res = torch.randn(7, hidden, generator=gen).to(DEVICE, dtype)
    weight = (1 + 0.3 * torch.randn(hidden, generator=gen)).to(DEVICE, dtype)
    total, out = add_rms_norm_triton(x, res, weight, 1e-5)
    problems = close("residual sum", total, x + res)
    problems += close("add + rms_norm", out, rms_norm(x + res, weight, 1e-5))
    alone, plain = add_rms_norm_triton(x, None, weight, 1e-5)
    if alone is not x:
        problems.append("rms_norm without a residual must hand x back as the sum")
    problems += close("rms_norm", plain, rms_norm(x, weight, 1e-5))
    rows = [add_rms_norm_triton(x[i : i + 1], res[i : i + 1], weight, 1e-5)[1] for i in range(7)]
    return problems + invariant("add + rms_norm", out, rows)


def check_silu_mul(dtype: torch.dtype, gen: torch.Generator) -> list[str]:
    width = 1500  # two programs per row, the second partly masked
    gate_up = (3 * torch.randn(5, 2 * width, generator=gen)).to(DEVICE, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    out = silu_mul_triton(gate_up)
    rows = [silu_mul_triton(gate_up[i : i + 1]) for i in range(5)]
    return close("silu * mul", out, F.silu(gate) * up) + invariant("silu * mul", out, rows)


def check_rope_cache(dtype: torch.dtype, gen: torch.Generator) -> list[str]:
    q_heads, kv_heads, dim, n = 6, 2, 32, 5
    qkv = torch.randn(n, (q_heads + 2 * kv_heads) * dim + 8, generator=gen).to(DEVICE, dtype)
    qkv = qkv[:, :-8]  # a row stride wider than the row
    cos = torch.randn(64, dim, generator=gen).to(DEVICE, dtype)
    sin = torch.randn(64, dim, generator=gen).to(DEVICE, dtype)
    positions = torch.tensor([3, 0, 17, 63, 5], device=DEVICE)
    slots = torch.tensor([1, 9, 30, 2, 14], device=DEVICE)
    pools = [torch.full((4, 8, kv_heads, dim), float("nan"), dtype=dtype, device=DEVICE)
             for _ in range(2)]  # fmt: skip
    q = rope_cache_triton(qkv, positions, cos, sin, slots, *pools, q_heads)
    heads = qkv[:, : (q_heads + kv_heads) * dim].view(n, -1, dim)
    want = rotary(heads, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    want_q, want_k = want.split([q_heads, kv_heads], 1)
    k, v = (pool.view(-1, kv_heads, dim) for pool in pools)
    problems = close("rotary q", q, want_q) + close("rotary k", k[slots], want_k)
    if not torch.equal(v[slots], qkv[:, (q_heads + kv_heads) * dim :].view(n, kv_heads, dim)):
        problems.append(f"rope + cache {dtype}: v is not stored as it came")
    if int(k.isnan().all(-1).all(-1).sum()) != k.shape[0] - n:
        problems.append(f"rope + cache {dtype}: slots other than the tokens' were written")
    rows = []
    for i in range(n):
        one = rope_cache_triton(qkv[i : i + 1], positions[i : i + 1], cos, sin, slots[i : i + 1],
                                *(p.clone() for p in pools), q_heads)  # fmt: skip
        rows.append(one)
    return problems + invariant("rotary q", q, rows)


CHECKS: list[Check] = [check_add_rms_norm, check_silu_mul, check_rope_cache]


def check_all() -> list[str]:
    problems = []
    for dtype in DTYPES:
        for check in CHECKS:
            problems += check(dtype, torch.Generator().manual_seed(0))
    return problems


if __name__ == "__main__":
    problems = check_all()
    print("\n".join(problems) or f"ok: {len(CHECKS) * len(DTYPES)} cases on {DEVICE}")
    sys.exit(1 if problems else 0)
