"""Paged decode attention: the torch path and the Triton kernels against a naive loop.

The pools of these cases hold NaN in every slot no row owns and out-of-range block
ids past each row's blocks (tests/engine/attention_cases.py), so reading anything
outside a row's tokens shows up as NaN or an index error.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.attention_cases import TOLERANCE, Case, make_case, naive, relative_error
from wsinfer.engine import attention
from wsinfer.engine.attention import decode_attention, decode_attention_torch, write_kv

ROOT = Path(__file__).resolve().parents[2]


def run(case: Case, **kwargs: Any) -> torch.Tensor:
    return decode_attention(
        case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale, **kwargs
    )


@pytest.mark.parametrize("fill", [0.0, math.nan], ids=["clean-pool", "nan-pool"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("lens", "q_heads", "kv_heads", "head_dim", "block_size"),
    [
        ([1, 17, 0, 40, 16], 4, 2, 64, 16),  # GQA 2, a padding row, a full last block
        ([100, 3], 9, 3, 64, 16),  # SmolLM2's 9 / 3 heads: a group of 3
        ([33, 64, 0], 8, 8, 128, 32),  # no GQA, head_dim 128, bigger blocks
        ([250], 32, 8, 64, 16),  # Llama 1B's heads at batch 1
        ([37, 37, 37], 4, 1, 64, 16),  # equal lengths: the unmasked path; MQA
    ],
)
def test_torch_path_matches_a_naive_loop(
    lens: list[int],
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    fill: float,
) -> None:
    case = make_case(lens, q_heads, kv_heads, head_dim, block_size, dtype, len(lens), fill=fill)
    got = run(case)
    assert got.dtype == dtype and got.shape == case.q.shape
    assert torch.isfinite(got).all()
    assert relative_error(got, naive(case)) < TOLERANCE[dtype]
    for row, n in enumerate(lens):
        if n == 0:
            assert not got[row].any(), "a padding row must come out as zeros"


def test_only_a_nan_in_the_pool_takes_the_masked_path(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    masked = attention.masked_attention

    def counted(*args: Any) -> torch.Tensor:
        calls.append(1)
        return masked(*args)

    monkeypatch.setattr(attention, "masked_attention", counted)
    clean = make_case([7, 40], fill=0.0)
    run(clean)
    assert not calls
    poisoned = make_case([7, 40])
    assert relative_error(run(poisoned), naive(poisoned)) < 1e-5
    assert calls == [1]


def test_max_len_hint_gives_the_same_result() -> None:
    case = make_case([20, 70, 5])
    assert torch.equal(run(case, max_len=70), run(case))
    # A generous hint (the table's whole width) reads no more than the rows own; only the
    # summation order (the matmul's blocking) may differ.
    assert torch.allclose(run(case, max_len=10_000), run(case), rtol=1e-5, atol=1e-6)


def test_out_is_written_in_place() -> None:
    case = make_case([9, 0, 31], dtype=torch.bfloat16)
    out = torch.full_like(case.q, math.nan)
    got = run(case, out=out)
    assert got is out and torch.isfinite(out).all()
    assert relative_error(out, naive(case)) < TOLERANCE[torch.bfloat16]


def test_all_rows_padding_gives_zeros() -> None:
    case = make_case([0, 0, 0])
    assert torch.equal(run(case), torch.zeros_like(case.q))


def test_the_poisoned_pool_shows_a_read_of_unwritten_slots() -> None:
    case = make_case([40])  # 3 blocks of 16: slots 40..47 hold NaN
    full = run(case)
    case.seq_lens[0] = 48  # now inside the row: the harness must see them
    assert torch.isnan(decode_attention_torch(*_args(case), case.scale)).any()
    assert torch.isfinite(full).all()


def _args(case: Case) -> tuple[torch.Tensor, ...]:
    return case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens


@pytest.mark.parametrize(
    ("q_shape", "pool_shape", "tables_shape", "match"),
    [
        ((2, 4, 64), (3, 16, 3, 64), (2, 2), "do not fit kv heads"),
        ((2, 4, 64), (3, 16, 2, 32), (2, 2), "do not fit kv heads"),
        ((2, 4, 64), (3, 16, 2, 64), (3, 2), "block_tables"),
        ((2, 4), (3, 16, 2, 64), (2, 2), "want q"),
    ],
)
def test_mismatched_shapes_are_refused(
    q_shape: tuple[int, ...], pool_shape: tuple[int, ...], tables_shape: tuple[int, int], match: str
) -> None:
    pool = torch.zeros(pool_shape)
    tables = torch.zeros(tables_shape, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        lens = torch.zeros(2, dtype=torch.int32)
        decode_attention(torch.zeros(q_shape), pool, pool, tables, lens, 1.0)


def test_out_of_the_wrong_shape_is_refused() -> None:
    case = make_case([3, 4])
    with pytest.raises(ValueError, match="out"):
        run(case, out=torch.empty(2, 4, 32))


def test_write_kv_stores_rows_at_their_slots_and_skips_negative_ones() -> None:
    k_pool = torch.zeros(3, 16, 2, 64, dtype=torch.bfloat16)
    v_pool = torch.zeros_like(k_pool)
    k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    write_kv(k_pool, v_pool, torch.tensor([5, -1, 47], dtype=torch.int32), k, v)
    assert torch.equal(k_pool[0, 5], k[0].bfloat16())
    assert torch.equal(v_pool[2, 15], v[2].bfloat16())
    assert k_pool.count_nonzero() == k[0].count_nonzero() + k[2].count_nonzero()
    with pytest.raises(ValueError, match="do not fit"):
        write_kv(k_pool, v_pool, torch.tensor([1]), k, v)


def test_written_kv_is_what_attention_reads() -> None:
    """write_kv and decode_attention agree on the slot layout: one token, one key."""
    k_pool = torch.zeros(4, 16, 1, 64)
    v_pool = torch.zeros_like(k_pool)
    value = torch.randn(1, 1, 64)
    write_kv(k_pool, v_pool, torch.tensor([2 * 16 + 0]), torch.randn(1, 1, 64), value)
    tables = torch.tensor([[2, 0]], dtype=torch.int32)
    out = decode_attention(torch.randn(1, 2, 64), k_pool, v_pool, tables, torch.tensor([1]), 0.1)
    assert torch.allclose(out, value.expand(1, 2, 64))  # softmax over one token is 1


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (the test extra installs it on linux x86_64 only)",
)
def test_triton_kernels_match_the_reference_under_the_interpreter() -> None:
    """The kernels the GPU runs, executed by Triton's CPU interpreter. bf16 dots there are
    widened to fp32 first (the interpreter multiplies bf16 bit patterns as integers)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "tests.engine.attention_cases"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok:")
