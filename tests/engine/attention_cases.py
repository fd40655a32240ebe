"""Paged-attention test cases and a naive reference, shared by the torch-path tests and
the Triton check, which runs this module as a script under Triton's CPU interpreter:

    TRITON_INTERPRET=1 python -m tests.engine.attention_cases

(the variable must be set before triton is imported, hence a separate process).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

# A table entry past a row's length: out of the pool's range, so reading it would fail.
GARBAGE_BLOCK = 1_000_000


@dataclass
class Case:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    scale: float


def make_case(
    lens: list[int],
    q_heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 3,
    fill: float = math.nan,
) -> Case:
    """Rows of the given lengths on shuffled, non-contiguous pool blocks. Every slot no
    row owns holds ``fill`` (NaN: a read of one shows), and table entries past a row's
    blocks point outside the pool (a read of one fails)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    width = max([*need, 1]) + 1
    num_blocks = sum(need) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, fill, dtype=dtype)
    v_cache = torch.full(shape, fill, dtype=dtype)
    tables = torch.full((len(lens), width), GARBAGE_BLOCK, dtype=torch.int32)
    for row, n in enumerate(lens):
        blocks = [order.pop() for _ in range(need[row])]
        tables[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        for t in range(n):
            slot = (blocks[t // block_size], t % block_size)
            k_cache[slot] = torch.randn((kv_heads, head_dim), generator=gen).to(dtype)
            v_cache[slot] = torch.randn((kv_heads, head_dim), generator=gen).to(dtype)
    q = torch.randn((len(lens), q_heads, head_dim), generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return Case(q, k_cache, v_cache, tables, seq_lens, 1 / math.sqrt(head_dim))


def naive(case: Case) -> torch.Tensor:
    """One row, one head at a time, in float64; zeros for a row of length 0."""
    batch, q_heads, head_dim = case.q.shape
    block_size, kv_heads = case.k_cache.shape[1], case.k_cache.shape[2]
    out = torch.zeros((batch, q_heads, head_dim), dtype=torch.float64)
    for row in range(batch):
        n = int(case.seq_lens[row])
        if n == 0:
            continue
        tokens = [(int(case.block_tables[row, t // block_size]), t % block_size) for t in range(n)]
        for head in range(q_heads):
            kv = head // (q_heads // kv_heads)
            keys = torch.stack([case.k_cache[b, s, kv] for b, s in tokens]).double()
            values = torch.stack([case.v_cache[b, s, kv] for b, s in tokens]).double()
            probs = torch.softmax(keys @ case.q[row, head].double() * case.scale, dim=0)
            out[row, head] = probs @ values
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


# fp32 is computed in fp32; bf16/fp16 read rounded inputs and round the output.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}

# (lens, q_heads, kv_heads, head_dim, block_size, dtype, num_splits or None = auto)
TRITON_CASES: list[tuple[list[int], int, int, int, int, torch.dtype, int | None]] = [
    ([5, 0, 37, 16], 4, 2, 64, 16, torch.float32, 1),
    ([5, 0, 37, 16], 4, 2, 64, 16, torch.float32, 4),
    ([130, 1, 0, 64], 8, 2, 128, 16, torch.bfloat16, 2),
    ([200, 33], 6, 2, 64, 32, torch.float16, 8),
    ([300, 7, 0], 2, 2, 64, 16, torch.bfloat16, None),
    ([0, 0], 4, 1, 64, 16, torch.float32, 2),
]


def check_triton() -> list[str]:
    """Every Triton case against the naive reference; a line per failure."""
    from wsinfer.engine.attention_triton import decode_attention_triton

    failures = []
    for i, (lens, hq, hkv, d, bs, dtype, splits) in enumerate(TRITON_CASES):
        case = make_case(lens, hq, hkv, d, bs, dtype, seed=i)
        out = torch.full_like(case.q, math.nan)  # every element must be written
        args = (case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
        got = decode_attention_triton(*args, case.scale, out, num_splits=splits)
        err = relative_error(got, naive(case)) if any(lens) else float(got.abs().max())
        if got is not out or not torch.isfinite(got).all() or err > TOLERANCE[dtype]:
            failures.append(f"case {i} {lens} {dtype} splits={splits}: error {err:.2e}")
    return failures + check_write_kv_triton()


def check_write_kv_triton() -> list[str]:
    from wsinfer.engine.attention_triton import write_kv_triton

    pool = torch.zeros((4, 16, 2, 64), dtype=torch.bfloat16)
    k_pool, v_pool = pool.clone(), pool.clone()
    # In the pool's dtype: the interpreter rounds fp32 -> bf16 differently from a GPU.
    k, v = torch.randn(3, 2, 64).to(pool.dtype), torch.randn(3, 2, 64).to(pool.dtype)
    write_kv_triton(k_pool, v_pool, torch.tensor([17, -1, 63], dtype=torch.int32), k, v)
    want_k, want_v = pool.clone(), pool.clone()
    for (b, s), i in (((1, 1), 0), ((3, 15), 2)):
        want_k[b, s], want_v[b, s] = k[i], v[i]
    if torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v):
        return []
    return ["write_kv_triton stored the wrong slots"]


if __name__ == "__main__":
    problems = check_triton()
    print("\n".join(problems) or f"ok: {len(TRITON_CASES)} cases")
    sys.exit(1 if problems else 0)
