"""The fused forward: one layer program, run with Triton's kernels on CUDA
(``engine/fused_triton.py``) or the C++ ones on the CPU (``engine/native.py``).

A decode step of the torch forward launches some twenty kernels per layer for the
norms, the rotary and the MLP's gate alone; at a few rows each costs its launch,
not its arithmetic. Here a layer is its four matmuls, attention, and four fused
kernels: rotary + KV-cache write, add + RMSNorm (twice), SiLU * mul. Each
residual add rides with the norm that follows it, the last with the final norm.

Which ``Kernels`` a model runs is chosen once, when it is built
(``llama.kernels_for``): Triton's for a CUDA model with Triton (``on_fused_path``),
the C++ ones for a float32 CPU model where they build, otherwise none, and the
model keeps the torch forward bit for bit. Only the plain pre-norm decoder with a
full rotary and SiLU (``llama.covers``: Llama, SmolLM2, Mistral, Qwen2, Phi-3
without partial rotary) gets any; the rest (Gemma's offset norms scaled in fp32,
OLMo-2's output norms, q/k norms, partial rotary, GELU) keep the torch forward on
every device, which is also the kernels' test oracle.

This module reads the model and its attention context through the protocols
below, so that it imports neither ``llama`` (which builds models and picks their
kernels) nor ``native`` (whose kernels run this program).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeGuard, runtime_checkable

import torch
import torch.nn.functional as F

from .attention import triton_available


class AttentionContext(Protocol):
    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Store ``k``/``v`` [N, Hkv, D] in the cache; attention output for ``q`` [N, Hq, D]."""
        ...


class KVPoolLayers(Protocol):
    k: torch.Tensor  # [layers, blocks, block_size, kv_heads, head_dim]
    v: torch.Tensor


@runtime_checkable
class CachedAttention(AttentionContext, Protocol):
    """An attention context that lets the caller store k/v itself (the fused rotary
    kernel writes them straight into ``pool`` at ``slots``), then attends."""

    pool: KVPoolLayers
    slots: torch.Tensor  # [N] flat slot of each token
    # Where the native kernel attends (block tables, each token's row, its position);
    # None off the native path.
    kernel_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention output for ``q`` [N, Hq, D] over the cache, k/v already stored."""
        ...


class ProgramLayer(Protocol):
    """What the layer program reads of a layer (``llama.LayerWeights``)."""

    @property
    def qkv(self) -> Callable[[torch.Tensor], torch.Tensor]: ...
    @property
    def o(self) -> Callable[[torch.Tensor], torch.Tensor]: ...
    @property
    def gate_up(self) -> Callable[[torch.Tensor], torch.Tensor]: ...
    @property
    def down(self) -> Callable[[torch.Tensor], torch.Tensor]: ...
    @property
    def norm_attn_in(self) -> torch.Tensor | None: ...
    @property
    def norm_mlp_in(self) -> torch.Tensor | None: ...


class ProgramModel(Protocol):
    """What the fused forward reads of a model (``llama.FastLlama``)."""

    @property
    def layers(self) -> Sequence[ProgramLayer]: ...
    @property
    def embed(self) -> torch.Tensor: ...
    @property
    def norm(self) -> torch.Tensor: ...
    @property
    def eps(self) -> float: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def tables(self) -> Sequence[tuple[torch.Tensor, torch.Tensor]]: ...
    @property
    def rope_of_layer(self) -> Sequence[int]: ...
    @property
    def layer_stack(self) -> Any:
        """The C++ layer stack over the layers (``quant.layer_stack``), or None."""
        ...


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


class Kernels(Protocol):
    """A model's fused forward, chosen when the model is built and held by it
    (``FastLlama.kernels``)."""

    name: str  # "triton", "native"

    def serves(self, attention: AttentionContext) -> TypeGuard[CachedAttention]:
        """Whether this step's attention context can run beside the fused forward
        (else the step takes the torch forward)."""
        ...

    def forward(
        self,
        model: ProgramModel,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: CachedAttention,
    ) -> torch.Tensor:
        """``FastLlama.forward``: the final hidden states [N, hidden]."""
        ...


def on_fused_path(x: torch.Tensor) -> bool:
    """Whether a model whose tensors are like ``x`` runs Triton's kernels: CUDA, with Triton."""
    return x.is_cuda and triton_available()


class TritonKernels:
    """``Kernels`` and ``LayerKernels`` of ``engine/fused_triton.py``."""

    name = "triton"

    def __init__(self) -> None:
        from .fused_triton import add_rms_norm_triton, rope_cache_triton, silu_mul_triton

        self.add_rms_norm = add_rms_norm_triton
        self.rope_cache = rope_cache_triton
        self.silu_mul = silu_mul_triton

    def serves(self, attention: AttentionContext) -> TypeGuard[CachedAttention]:
        return isinstance(attention, CachedAttention)

    def forward(
        self,
        model: ProgramModel,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: CachedAttention,
    ) -> torch.Tensor:
        return layer_program(model, input_ids, positions, attention, self)


def triton_kernels(x: torch.Tensor) -> TritonKernels | None:
    """Triton's ``Kernels`` for a model whose tensors are like ``x``, where they run."""
    return TritonKernels() if on_fused_path(x) else None


def layer_program(
    model: ProgramModel,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    attention: CachedAttention,
    kernels: LayerKernels,
) -> torch.Tensor:
    """The forward of a model ``llama.covers`` accepts: per layer four matmuls,
    attention, and ``kernels``' rotary + KV write, two add + RMSNorms and SiLU * mul."""
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
