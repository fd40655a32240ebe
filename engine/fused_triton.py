"""Triton kernels that fuse a decoder layer's small ops (``engine/fused.py`` decides
when they run): add + RMSNorm, rotary + KV-cache write, and SiLU(gate) * up.

At a decode step's few rows each torch op costs its launch, not its arithmetic:
the torch RMSNorm of a bf16 model is eight kernels, the rotary ten. Each kernel
here is one launch doing the same float operations in the same order, rounding to
the model's dtype wherever torch's op-by-op reference rounds, so the results stay
within rounding of it (bit for bit in bf16 wherever the GPU's arithmetic agrees).

Batch invariance: a row's result never depends on its neighbours. Every program
owns whole rows (RMSNorm: one row, summed over one fixed-width tile, so the
reduction order depends on the hidden size only) or single elements, and prefill
and decode call the very same kernels.

CUDA-graph rules: grids from shapes only; positions and slots are read on the
device; outputs are allocated by shape (a graph's own pool serves them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements per program of the elementwise SiLU * mul.
BLOCK_MUL = 1024


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, eps,
    stride_x, stride_r, stride_o, stride_s,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if ADD:
        # The residual sum in the model's dtype, as torch's ``x + y`` rounds it.
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=ok)
    xf = x.to(tl.float32)
    # One tile per row, padded lanes zero: the sum's order is fixed by BLOCK alone.
    mean = tl.sum(xf * xf, axis=0) / HIDDEN
    normed = (xf * tl.math.rsqrt(mean + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (or ``x`` alone), and ``rms_norm(s, weight, eps)``, as
    ``engine.llama.rms_norm`` computes them (normalise in fp32, scale in x's dtype)."""
    rows, hidden = x.shape
    if x.stride(1) != 1 or weight.stride(0) != 1:
        raise ValueError("x and the weight need a contiguous last dimension")
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else x
    res = residual if residual is not None else x
    if rows == 0:
        return total, out
    block = triton.next_power_of_2(hidden)
    _add_rms_norm_kernel[(rows,)](
        x, res, weight, out, total, eps,
        x.stride(0), res.stride(0), out.stride(0), total.stride(0),
        HIDDEN=hidden, BLOCK=block, ADD=residual is not None,
        num_warps=min(16, max(1, block // 256)),
    )  # fmt: skip
    return total, out


@triton.jit
def _rope_cache_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, slots_ptr, q_ptr, kc_ptr, vc_ptr,
    stride_qkv, stride_cos, stride_sin, stride_qn, stride_qh,
    stride_cb, stride_cs, stride_ch, stride_db, stride_ds, stride_dh,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # q's heads, then k's
    elt = q_ptr.dtype.element_ty
    dims = tl.arange(0, HEAD_DIM)
    half = HEAD_DIM // 2
    # rotate_half: the first half takes -x[d + half], the second x[d - half].
    partner = (dims + half) % HEAD_DIM
    sign = tl.where(dims < half, -1.0, 1.0)
    pos = tl.load(pos_ptr + n).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cos + dims).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sin + dims).to(tl.float32)
    row = qkv_ptr + n * stride_qkv + head * HEAD_DIM
    x = tl.load(row + dims).to(tl.float32)
    turned = tl.load(row + partner).to(tl.float32) * sign
    # x * cos + rotate_half(x) * sin, each product rounded as torch rounds it.
    rotated = ((x * cos).to(elt).to(tl.float32) + (turned * sin).to(elt).to(tl.float32)).to(elt)
    if head < Q_HEADS:
        tl.store(q_ptr + n * stride_qn + head * stride_qh + dims, rotated)
    else:
        kv = head - Q_HEADS
        slot = tl.load(slots_ptr + n).to(tl.int64)
        block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        kc = kc_ptr + block * stride_cb + offset * stride_cs + kv * stride_ch
        tl.store(kc + dims, rotated.to(kc_ptr.dtype.element_ty))
        v = tl.load(qkv_ptr + n * stride_qkv + (Q_HEADS + KV_HEADS + kv) * HEAD_DIM + dims)
        vc = vc_ptr + block * stride_db + offset * stride_ds + kv * stride_dh
        tl.store(vc + dims, v.to(vc_ptr.dtype.element_ty))


def rope_cache_triton(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_heads: int,
) -> torch.Tensor:
    """The rotary embedding of q and k in ``qkv`` [N, (Hq + 2 Hkv) * D] at ``positions``
    (rows of the ``cos``/``sin`` tables [max_positions, D]); k and v stored at flat
    ``slots`` of the pools [blocks, block_size, Hkv, D]. Returns q [N, Hq, D]."""
    tokens = qkv.shape[0]
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    if head_dim & (head_dim - 1) or cos.shape[-1] != head_dim:
        raise ValueError(f"head_dim {head_dim}: powers of two, rotary over all of it only")
    if qkv.stride(1) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("qkv and the pools need a contiguous last dimension")
    if positions.stride(0) != 1 or slots.stride(0) != 1:  # the kernel reads them densely
        raise ValueError("positions and slots need to be contiguous")
    q = torch.empty((tokens, q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    _rope_cache_kernel[(tokens, q_heads + kv_heads)](
        qkv, positions, cos, sin, slots, q, k_cache, v_cache,
        qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), q.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        Q_HEADS=q_heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        num_warps=1,
    )  # fmt: skip
    return q


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr, out_ptr, stride_in, stride_out, WIDTH: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < WIDTH
    elt = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + WIDTH + cols, mask=ok, other=0.0)
    # silu in fp32, rounded to the model's dtype, then the product: torch's two ops.
    silu = (gate / (1.0 + tl.exp(-gate))).to(elt).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up.to(tl.float32)).to(elt), mask=ok)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` [N, 2 I] (gate first, as ``chunk(2)`` splits it)."""
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    if gate_up.stride(1) != 1:
        raise ValueError("gate_up needs a contiguous last dimension")
    out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    _silu_mul_kernel[(rows, triton.cdiv(width, BLOCK_MUL))](
        gate_up, out, gate_up.stride(0), out.stride(0), WIDTH=width, BLOCK=BLOCK_MUL, num_warps=4
    )
    return out
