"""The fast forward's one-call norm and joint rotary give the very bits of the
transformers ops they stand for (engine/llama.py): the float32 path stays
transformers-exact while a decode step dispatches fewer ops."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from wsinfer.engine.llama import rms_norm, rotary


def _inputs(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random values across many magnitudes, row by row (rounding shows up there)."""
    gen = torch.Generator().manual_seed(seed)
    scale = 10.0 ** torch.randint(-4, 5, (*shape[:-1], 1), generator=gen)
    return torch.randn(shape, generator=gen) * scale


@pytest.mark.parametrize("shape", [(1, 576), (7, 576), (64, 960), (5, 9, 64)])
def test_rms_norm_is_transformers_llama_rms_norm_bit_for_bit(shape: tuple[int, ...]) -> None:
    norm = LlamaRMSNorm(shape[-1], eps=1e-5)
    for seed in range(20):
        with torch.no_grad():
            norm.weight.copy_(_inputs((shape[-1],), 1000 + seed))
            x = _inputs(shape, seed)
            assert torch.equal(rms_norm(x, norm.weight, 1e-5), norm(x)), seed


def test_a_bfloat16_model_keeps_transformers_order_of_rounding() -> None:
    norm = LlamaRMSNorm(576, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(_inputs((576,), 3))
    x = _inputs((4, 576), 4).to(torch.bfloat16)
    assert torch.equal(rms_norm(x, norm.weight, 1e-6), norm(x))


def test_one_rotary_over_q_and_k_side_by_side_is_two_rotaries() -> None:
    gen = torch.Generator().manual_seed(5)
    n, q_heads, kv_heads, dim = 6, 9, 3, 64
    qkv = torch.randn(n, (q_heads + 2 * kv_heads) * dim, generator=gen)
    cos = torch.randn(n, 1, dim, generator=gen)
    sin = torch.randn(n, 1, dim, generator=gen)
    heads = qkv[:, : (q_heads + kv_heads) * dim].view(n, -1, dim)
    q, k = rotary(heads, cos, sin).split([q_heads, kv_heads], 1)
    q_ref = qkv[:, : q_heads * dim].view(n, q_heads, dim)
    k_ref = qkv[:, q_heads * dim : (q_heads + kv_heads) * dim].view(n, kv_heads, dim)
    # transformers' own, on [batch, heads, seq, dim] with cos/sin [batch, seq, dim]
    q_hf, k_hf = apply_rotary_pos_emb(
        q_ref.transpose(0, 1)[None], k_ref.transpose(0, 1)[None], cos[:, 0][None], sin[:, 0][None]
    )
    assert torch.equal(q, q_hf[0].transpose(0, 1))
    assert torch.equal(k, k_hf[0].transpose(0, 1))
