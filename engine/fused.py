"""The forward pass through the fused kernels of ``engine/fused_triton.py``.

A decode step of the torch forward launches some twenty kernels per layer for the
norms, the rotary and the MLP's gate alone; at a few rows each costs its launch,
not its arithmetic. Here a layer is its four matmuls, attention, and four fused
kernels: rotary + KV-cache write, add + RMSNorm (twice), SiLU * mul. Each
residual add rides with the norm that follows it, the last with the final norm.

Only on CUDA, with Triton (``on_fused_path``): the CPU keeps the torch forward
bit for bit. Only for the plain pre-norm decoder with a full rotary and SiLU
(``covers``: Llama, SmolLM2, Mistral, Qwen2, Phi-3 without partial rotary); the
rest (Gemma's offset norms scaled in fp32, OLMo-2's output norms, q/k norms,
partial rotary, GELU) keep the torch forward on every device, which is also the
kernels' test oracle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from .attention import triton_available

if TYPE_CHECKING:
    from .llama import CachedAttention, FastLlama


def on_fused_path(x: torch.Tensor) -> bool:
    """Whether ``x``'s forward takes the fused kernels: CUDA tensors, with Triton."""
    return x.is_cuda and triton_available()


def covers(model: FastLlama) -> bool:
    """Whether the fused forward computes ``model``'s family exactly as the torch one."""
    family = model.family
    return (
        family.norms == "pre"
        and family.qk_norm is None
        and not family.norm_offset
        and not family.norm_scale_fp32
        and model.embed_scale is None
        and model.activation is F.silu
        and all(cos.shape[-1] == model.head_dim for cos, _ in model.tables)
        and model.head_dim & (model.head_dim - 1) == 0
    )


class LayerKernels(Protocol):
    """The three fused steps of the layer program: Triton's on CUDA
    (``engine/fused_triton.py``), the C++ ones on the CPU (``engine/native.py``)."""

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(``x + residual``, its RMSNorm times ``weight``); no residual: ``x`` itself."""
        ...

    def rope_cache(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        q_heads: int,
    ) -> torch.Tensor:
        """q rotated [N, Hq, D]; k rotated and v stored in the caches at ``slots``."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``[N, 2 I]`` (gate first)."""
        ...


class TritonKernels:
    """``LayerKernels`` of ``engine/fused_triton.py``."""

    def __init__(self) -> None:
        from .fused_triton import add_rms_norm_triton, rope_cache_triton, silu_mul_triton

        self.add_rms_norm = add_rms_norm_triton
        self.rope_cache = rope_cache_triton
        self.silu_mul = silu_mul_triton


def fused_forward(
    model: FastLlama, input_ids: torch.Tensor, positions: torch.Tensor, attention: CachedAttention
) -> torch.Tensor:
    """``FastLlama.forward`` of a model ``covers`` accepts, through the fused kernels."""
    return layer_program(model, input_ids, positions, attention, TritonKernels())


def layer_program(
    model: FastLlama,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    attention: CachedAttention,
    kernels: LayerKernels,
) -> torch.Tensor:
    """The forward of a model ``covers`` accepts: per layer four matmuls, attention,
    and ``kernels``' rotary + KV write, two add + RMSNorms and SiLU * mul."""
    layers, eps = model.layers, model.eps
    x = F.embedding(input_ids, model.embed)
    n, q_size = x.shape[0], model.num_heads * model.head_dim
    # The residual stream and the next norm's output, which feeds the next matmul.
    residual, h = kernels.add_rms_norm(x, None, _weight(layers[0].norm_attn_in), eps)
    for i, layer in enumerate(layers):
        cos, sin = model.tables[model.rope_of_layer[i]]
        pool_k, pool_v = attention.pool.k[i], attention.pool.v[i]
        qkv = layer.qkv(h)
        q = kernels.rope_cache(
            qkv, positions, cos, sin, attention.slots, pool_k, pool_v, model.num_heads
        )
        out = layer.o(attention.attend(i, q).reshape(n, q_size))
        residual, h = kernels.add_rms_norm(out, residual, _weight(layer.norm_mlp_in), eps)
        down = layer.down(kernels.silu_mul(layer.gate_up(h)))
        following = layers[i + 1].norm_attn_in if i + 1 < len(layers) else model.norm
        residual, h = kernels.add_rms_norm(down, residual, _weight(following), eps)
    return h


def _weight(norm: torch.Tensor | None) -> torch.Tensor:
    assert norm is not None, "covers() admits pre-norm layers only"
    return norm
