"""Paged decode attention: one new query token per row against a block-paged KV pool.

The pool of one layer is ``[num_blocks, block_size, kv_heads, head_dim]``; row
``b``'s token ``t`` lives at ``pool[block_tables[b, t // block_size], t % block_size]``.
Entries of a block table past the row's length are never read (they may hold
anything), and rows of length 0 (CUDA-graph padding) come out as zeros.

Two implementations behind ``decode_attention``:

- on CUDA with Triton, a flash-decoding kernel (``engine/attention_triton.py``):
  grid sizes from shapes only, no host sync, so it can be captured in a CUDA graph;
- otherwise a torch path for CPU (and eager CUDA without Triton): gather the rows'
  blocks once, one batched matmul per side, a length mask. CI and CPU serving run
  every decode step through it, so it has no Python loop over rows.

``write_kv`` scatters a step's new keys and values into their slots.
"""

from __future__ import annotations

import functools
import importlib.util
import math

import torch
import torch.nn.functional as F


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_len: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of each row's newest query over its first ``seq_lens[b]`` cached tokens.

    q ``[B, Hq, D]``; k_cache, v_cache ``[num_blocks, block_size, Hkv, D]``;
    block_tables ``[B, max_blocks]`` int32; seq_lens ``[B]`` int32 (the newest token's
    KV already written). Query head ``h`` reads kv head ``h // (Hq // Hkv)``.
    ``out``: an optional ``[B, Hq, D]`` tensor to write into (and return).
    ``max_len``: a host-side bound on ``seq_lens`` for the torch path on CUDA (without
    Triton), which cannot read ``seq_lens`` without a sync; the CPU reads them itself.
    ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before the softmax
    (Gemma 2); the torch path computes them, on every device.
    Returns ``[B, Hq, D]`` in q's dtype.
    """
    check_shapes(q, k_cache, v_cache, block_tables, seq_lens, out)
    if on_triton(q) and softcap is None:
        from wsinfer.engine.attention_triton import decode_attention_triton

        return decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, out)
    return decode_attention_torch(
        q, k_cache, v_cache, block_tables, seq_lens, scale, out, max_len=max_len, softcap=softcap
    )


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def on_triton(t: torch.Tensor) -> bool:
    """Whether ``t``'s attention runs the Triton kernels: CUDA tensors, with Triton.
    (One switch, which tests turn on to run the GPU's program under the interpreter.)"""
    return t.is_cuda and triton_available()


def check_shapes(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    """Shape checks only (never values): safe inside a CUDA-graph capture."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"want q [B, Hq, D] and pools [blocks, block_size, Hkv, D]; got q "
            f"{tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}"
        )
    batch, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or q_heads % kv_heads:
        raise ValueError(f"q heads {q_heads} x {head_dim} do not fit kv heads {kv_heads}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(
            f"want block_tables [{batch}, max_blocks] and seq_lens [{batch}]; got "
            f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}"
        )
    if out is not None and out.shape != q.shape:
        raise ValueError(f"out {tuple(out.shape)} is not q's shape {tuple(q.shape)}")


# --- torch path ---------------------------------------------------------------------


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_len: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Gather the rows' blocks, then one SDPA call with a length mask.

    A kv head's query heads go in as that head's query *positions* ([B, Hkv, G, D]), so
    GQA needs no repeated keys; the gathered keys are read through a strided view. When
    every row has the same length (batch 1 always) there is nothing to mask: on one
    thread that halves the SDPA's time and skips the mask's own ops. SDPA cannot
    soft-cap scores: with ``softcap`` the scores are computed explicitly.
    """
    batch, q_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    capacity = block_tables.shape[1] * block_size
    if q.is_cuda or not batch:  # no sync on CUDA: the hint or the table's whole width
        max_len, uniform = min(max_len or capacity, capacity), False
    else:  # CPU: reading seq_lens is free (and a hint would only be a bound)
        shortest, longest = (int(x) for x in torch.aminmax(seq_lens))
        max_len, uniform = min(longest, capacity), shortest == longest
    query = q.reshape(batch, kv_heads, q_heads // kv_heads, head_dim)
    if softcap is not None:
        keys, values, valid = gather_rows(k_cache, v_cache, block_tables, seq_lens, max_len)
        result = masked_attention(query, keys, values, valid, seq_lens, scale, softcap)
    elif uniform:
        result = uniform_attention(query, k_cache, v_cache, block_tables, max_len, scale)
    else:
        result = ragged_attention(query, k_cache, v_cache, block_tables, seq_lens, max_len, scale)
    result = result.reshape(batch, q_heads, head_dim)
    if out is None:
        return result.to(q.dtype)
    return out.copy_(result)


def uniform_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    length: int,
    scale: float,
) -> torch.Tensor:
    """Every row holds ``length`` tokens: no mask, no slot past a row's end is read."""
    if length == 0:  # all rows are padding
        return torch.zeros_like(query)
    batch = block_tables.shape[0]
    num_blocks = -(-length // k_cache.shape[1])
    tables = block_tables[:, :num_blocks].long().flatten()
    shape = (batch, num_blocks * k_cache.shape[1], *k_cache.shape[2:])
    keys = k_cache.index_select(0, tables).view(shape)[:, :length]
    values = v_cache.index_select(0, tables).view(shape)[:, :length]
    return F.scaled_dot_product_attention(
        query, keys.transpose(1, 2), values.transpose(1, 2), scale=scale
    )


def ragged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
    scale: float,
) -> torch.Tensor:
    """Rows of different lengths: gathered up to the longest, the rest masked."""
    keys, values, valid = gather_rows(k_cache, v_cache, block_tables, seq_lens, max_len)
    result = F.scaled_dot_product_attention(
        query,
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=valid[:, None, None, :],
        scale=scale,
    )
    result.masked_fill_((seq_lens == 0)[:, None, None, None], 0.0)  # older torch: NaN there
    if not query.is_cuda and bool(result.isnan().any()):
        # Masked slots still reach probs @ values, and 0 * NaN = NaN: unwritten slots of
        # a pool allocated with torch.empty can hold NaN bits. Rare; mask them and redo.
        result = masked_attention(query, keys, values, valid, seq_lens, scale)
    return result


def masked_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention that never lets a masked slot's content through, NaN included."""
    compute = query.dtype if query.dtype == torch.float64 else torch.float32
    values = values.masked_fill(~valid[:, :, None, None], 0.0).to(compute)
    scores = torch.einsum("bhgd,blhd->bhgl", query.to(compute), keys.to(compute)) * scale
    if softcap is not None:
        scores = soft_cap(scores, softcap)
    scores.masked_fill_(~valid[:, None, None, :], -math.inf)
    probs = torch.softmax(scores, dim=-1)
    probs.masked_fill_((seq_lens == 0)[:, None, None, None], 0.0)  # all -inf gave NaN
    return torch.einsum("bhgl,blhd->bhgd", probs, values).to(query.dtype)


def prefill_softcapped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """SDPA's result with the scores soft-capped first (Gemma 2), as transformers' eager
    attention computes it: in the model's dtype, the softmax in float32. The prefill's
    layout ([R, H, W, D] queries, a boolean visibility mask); ``masked_attention`` is
    the decode step's."""
    scores = soft_cap((q @ k.transpose(-2, -1)) * scale, softcap)
    scores = scores.masked_fill(~mask, -math.inf)
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)``: Gemma 2's cap on attention scores and on logits."""
    return torch.tanh(x / cap) * cap


def gather_rows(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's first ``max_len`` tokens ``[B, L, Hkv, D]`` and the mask of its valid
    positions ``[B, L]``. Positions past a row's length hold whatever their slot holds."""
    batch = block_tables.shape[0]
    block_size = k_cache.shape[1]
    num_blocks = -(-max_len // block_size)
    lens = seq_lens[:, None].long()
    valid = torch.arange(max_len, device=seq_lens.device)[None, :] < lens
    # Table entries past a row's length may be anything: read block 0 there instead.
    in_row = torch.arange(num_blocks, device=seq_lens.device)[None, :] * block_size < lens
    tables = torch.where(in_row, block_tables[:, :num_blocks].long(), 0).flatten()
    shape = (batch, num_blocks * block_size, *k_cache.shape[2:])
    keys = k_cache.index_select(0, tables).view(shape)[:, :max_len]
    values = v_cache.index_select(0, tables).view(shape)[:, :max_len]
    return keys, values, valid


# --- writing the KV pool ---------------------------------------------------------------


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Store ``k``, ``v`` ``[N, Hkv, D]`` at flat slots ``[N]`` (``block * block_size + offset``).

    A negative slot skips its row (CUDA-graph padding). On CUDA with Triton a kernel
    does it without a host sync; elsewhere the skipped rows are filtered on the host.
    """
    if k.shape != v.shape or k.shape[0] != slots.shape[0] or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"k {tuple(k.shape)}, v {tuple(v.shape)}, slots {tuple(slots.shape)} do not fit "
            f"the pool {tuple(k_cache.shape)}"
        )
    if on_triton(k):
        from wsinfer.engine.attention_triton import write_kv_triton

        write_kv_triton(k_cache, v_cache, slots, k, v)
        return
    keep = slots >= 0
    index = slots[keep].long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, index, k[keep].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, index, v[keep].to(v_cache.dtype))
