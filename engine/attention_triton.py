"""Triton kernels for ``engine/attention.py``: flash-decoding over a paged KV pool.

Decode attention reads every cached key and value once and does two flops per byte:
it is bound by memory bandwidth, and the job is to keep enough loads in flight on
every SM. At batch 1 there are only ``kv_heads`` (row, kv head) pairs, far fewer
than the 132 SMs of an H100, so each row's sequence is cut into ``num_splits``
chunks handled by separate programs (flash-decoding); a second, small kernel
merges the chunks' partial softmaxes. One program serves all the query heads of
its kv head (GQA), so each key and value is read from memory once per group.

CUDA-graph rules: the grids and ``num_splits`` come from shapes only; lengths and
block ids are read inside the kernels, and programs past a row's length exit
after writing an empty partial, so a replay with other lengths stays correct.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# Tokens per inner iteration (several pages per load, so more bytes are in flight).
BLOCK_N = 64
# SMs to fill when a device reports none (Triton's CPU interpreter): an H100's.
DEFAULT_SMS = 132
MAX_SPLITS = 32
# Below this many tokens per split, another split costs more in merging than it gains.
MIN_TOKENS_PER_SPLIT = 256
# Triton reads the variable once, at import; so do we.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, DOT_FP32: tl.constexpr):
    """a @ b accumulated in fp32. ``IEEE``: exact fp32 products for fp32 inputs (Triton's
    default would be tf32). ``DOT_FP32``: widen bf16 operands first (exact, so the same
    result), for Triton's CPU interpreter, which multiplies bf16 as raw integers."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr,
    acc_ptr, ml_ptr, out_ptr,
    scale_log2,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_tb,
    stride_ob, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + row)
    # Each row cuts its own length into NUM_SPLITS chunks of whole BLOCK_N tiles.
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM)
    head_ok = heads < GROUP
    q_heads = kv_head * GROUP + heads
    q = tl.load(
        q_ptr + row * stride_qb + q_heads[:, None] * stride_qh + dims[None, :],
        mask=head_ok[:, None],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for tile in range(start, end, BLOCK_N):
        tokens = tile + offs_n
        ok = tokens < end
        # Only the table entries of this row's own tokens are read.
        page = tl.load(tables_ptr + row * stride_tb + tokens // BLOCK_SIZE, mask=ok, other=0)
        slot = page.to(tl.int64) * stride_kb + (tokens % BLOCK_SIZE) * stride_ks
        k = tl.load(
            k_ptr + slot[:, None] + kv_head * stride_kh + dims[None, :],
            mask=ok[:, None],
            other=0.0,
        )
        scores = _dot(q, tl.trans(k), IEEE, DOT_FP32)
        scores = tl.where(ok[None, :], scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))  # finite: every tile has a valid token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vslot = page.to(tl.int64) * stride_vb + (tokens % BLOCK_SIZE) * stride_vs
        v = tl.load(
            v_ptr + vslot[:, None] + kv_head * stride_vh + dims[None, :],
            mask=ok[:, None],
            other=0.0,
        )
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE, DOT_FP32)
        m_i = m_new

    if NUM_SPLITS == 1:
        # Nothing to merge: normalise and write the output here (0 for empty rows).
        result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + row * stride_ob + q_heads[:, None] * stride_oh + dims[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=head_ok[:, None],
        )
    else:
        # Partials of [B, Hq, NUM_SPLITS]: an empty split writes m = -inf, l = 0, acc = 0.
        part = (row * GROUP * tl.num_programs(1) + q_heads) * NUM_SPLITS + split
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=head_ok[:, None])
        tl.store(ml_ptr + part * 2, m_i, mask=head_ok)
        tl.store(ml_ptr + part * 2 + 1, l_i, mask=head_ok)


@triton.jit
def _merge_kernel(
    acc_ptr, ml_ptr, out_ptr,
    stride_ob, stride_oh,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    part = (row * tl.num_programs(1) + head) * NUM_SPLITS + splits
    m = tl.load(ml_ptr + part * 2)
    l_split = tl.load(ml_ptr + part * 2 + 1)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # a row of length 0
    weight = tl.exp2(m - m_max)  # 0 for empty splits
    denom = tl.sum(weight * l_split, 0)
    acc = tl.load(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :])
    total = tl.sum(acc * weight[:, None], 0)
    result = total / tl.where(denom > 0, denom, 1.0)
    tl.store(
        out_ptr + row * stride_ob + head * stride_oh + dims,
        result.to(out_ptr.dtype.element_ty),
    )


def choose_splits(batch: int, kv_heads: int, max_tokens: int, sms: int) -> int:
    """Splits per row, a power of two, from shapes only: enough programs for two waves
    over the SMs, but no split shorter than ``MIN_TOKENS_PER_SPLIT`` at full length."""
    want = max(1, -(-2 * sms // max(1, batch * kv_heads)))
    useful = max(1, max_tokens // MIN_TOKENS_PER_SPLIT)
    splits = min(want, useful, MAX_SPLITS)
    return 1 << (splits.bit_length() - 1)


@functools.cache
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """See ``engine.attention.decode_attention``; ``num_splits`` overrides the choice
    (a power of two), for tests."""
    batch, q_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if head_dim & (head_dim - 1) or block_size & (block_size - 1):
        raise ValueError(f"head_dim {head_dim} and block_size {block_size}: powers of two only")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last dimension")
    if out is None:
        out = torch.empty_like(q)
    elif out.stride(2) != 1:
        raise ValueError("out needs a contiguous last dimension")
    if batch == 0:
        return out
    group = q_heads // kv_heads
    splits = num_splits or choose_splits(
        batch, kv_heads, block_tables.shape[1] * block_size, sm_count(q.device)
    )
    # Allocated per call: inside a captured graph these come from the graph's own pool.
    acc = torch.empty((batch, q_heads, splits, head_dim), dtype=torch.float32, device=q.device)
    ml = torch.empty((batch, q_heads, splits, 2), dtype=torch.float32, device=q.device)
    _split_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, acc, ml, out,
        scale * 1.4426950408889634,  # log2(e): the kernels use exp2
        q.stride(0), q.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, NUM_SPLITS=splits,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=BLOCK_N,
        IEEE=q.dtype == torch.float32,
        DOT_FP32=INTERPRETED and q.dtype == torch.bfloat16,
        num_warps=4, num_stages=2,
    )  # fmt: skip
    if splits > 1:
        _merge_kernel[(batch, q_heads)](
            acc, ml, out, out.stride(0), out.stride(1),
            NUM_SPLITS=splits, HEAD_DIM=head_dim, num_warps=4,
        )  # fmt: skip
    return out


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, slots_ptr, kc_ptr, vc_ptr,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_cb, stride_cs, stride_ch, stride_db, stride_ds, stride_dh,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    if slot >= 0:  # negative: a padding row, nothing to store
        dims = tl.arange(0, HEAD_DIM)
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        k = tl.load(k_ptr + n * stride_kn + head * stride_kh + dims)
        v = tl.load(v_ptr + n * stride_vn + head * stride_vh + dims)
        kc = kc_ptr + block * stride_cb + offset * stride_cs + head * stride_ch + dims
        vc = vc_ptr + block * stride_db + offset * stride_ds + head * stride_dh + dims
        tl.store(kc, k.to(kc_ptr.dtype.element_ty))
        tl.store(vc, v.to(vc_ptr.dtype.element_ty))


def write_kv_triton(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """See ``engine.attention.write_kv``: one program per (token, kv head)."""
    tokens, kv_heads, head_dim = k.shape
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim {head_dim}: powers of two only")
    if k.stride(2) != 1 or v.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("k, v and the pools need a contiguous last dimension")
    if tokens == 0:
        return
    _write_kv_kernel[(tokens, kv_heads)](
        k, v, slots, k_cache, v_cache,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, num_warps=1,
    )  # fmt: skip
