"""A compact Llama-family forward pass over a loaded transformers model's weights.

gpt-fast style: flat tensors, a handful of kernels per layer, nothing that
inspects data on the host, so a decode step can be captured as a CUDA graph.
Tokens come in flattened (``[N]`` ids and positions, any mix of rows), and
attention is delegated to a context object that owns the KV layout (the paged
pool) and knows which token belongs to which row.

Supported: the families of ``families.py`` (Llama, SmolLM2, Mistral, Qwen2/3,
OLMo-2, Phi-3, Gemma 2/3). Weights are shared with the transformers model, not copied: q/k/v
and gate/up are fused into one matrix each and the model's own parameters are
re-pointed at views of the fused ones.

The plain pre-norm families (``covers``) run through fused kernels instead
(``engine/fused.py``), chosen once when the model is built (``kernels_for``):
Triton's on CUDA, C++ ones on the CPU (``engine/native.py``, where they build).
This torch forward is the other families', the CPU's without a compiler, and
those kernels' reference.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .attention import soft_cap
from .families import FAMILIES, Family, UnsupportedModel, activation_of, family_of
from .fused import AttentionContext, Kernels, triton_kernels
from .native import native_kernels

SUPPORTED_MODEL_TYPES = frozenset(FAMILIES)
__all__ = ["FastLlama", "SUPPORTED_MODEL_TYPES", "UnsupportedModel", "fast_model_for"]


class Linear:
    """A linear layer in the layout its device multiplies fastest.

    CPU float32 keeps ``W^T`` contiguous ([in, out]): for the few rows of a decode
    step the CPU BLAS runs ``x @ W^T`` about 2x faster than ``F.linear``'s
    transposed read. Everything else keeps transformers' [out, in] layout.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> None:
        self.transposed = transposed
        self.weight = weight.t().contiguous() if transposed else weight.contiguous()
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.transposed:
            out = x @ self.weight
            return out + self.bias if self.bias is not None else out
        return F.linear(x, self.weight, self.bias)

    def part(self, start: int, end: int) -> torch.Tensor:
        """Rows ``start:end`` of the [out, in] weight, as a view."""
        return self.weight[:, start:end].t() if self.transposed else self.weight[start:end]

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[1 if self.transposed else 0])

    def matrix(self) -> torch.Tensor:
        """The whole [out, in] weight, as a view."""
        return self.part(0, self.out_features)


def _weight(module: Any) -> torch.Tensor:
    """[out, in] weight of an ``nn.Linear`` or of the engine's ``PackedLinear``."""
    if hasattr(module, "weight_t"):
        return module.weight_t.detach().t()
    return module.weight.detach()


def _bias(module: Any) -> torch.Tensor | None:
    bias = getattr(module, "bias", None)
    return bias.detach() if bias is not None else None


def _fused(modules: list[Any], transposed: bool) -> Linear:
    """One ``Linear`` for several that read the same input; the modules then view into it."""
    weight = torch.cat([_weight(m) for m in modules])
    biases = [_bias(m) for m in modules]
    bias = (
        torch.cat([b for b in biases if b is not None])
        if all(b is not None for b in biases)
        else None
    )
    fused = Linear(weight, bias, transposed)
    start = 0
    for module in modules:
        end = start + _weight(module).shape[0]
        _share(module, fused.part(start, end))
        start = end
    return fused


def _share(module: Any, weight: torch.Tensor) -> None:
    """Point ``module``'s weight at ``weight`` (a view): no second copy stays alive."""
    if hasattr(module, "weight_t"):
        module.weight_t.data = weight.t()
    else:
        module.weight.data = weight


class LayerWeights:
    def __init__(
        self, layer: Any, eps: float, transposed: bool, family: Family | None = None
    ) -> None:
        family = family or FAMILIES["llama"]
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [attn.qkv_proj] if family.fused_weights else [attn.q_proj, attn.k_proj, attn.v_proj]
        self.qkv = _fused(qkv, transposed)
        self.o = Linear(_weight(attn.o_proj), _bias(attn.o_proj), transposed)
        _share(attn.o_proj, self.o.matrix())
        gate_up = [mlp.gate_up_proj] if family.fused_weights else [mlp.gate_proj, mlp.up_proj]
        self.gate_up = _fused(gate_up, transposed)
        self.down = Linear(_weight(mlp.down_proj), None, transposed)
        _share(mlp.down_proj, self.down.matrix())
        self.eps = eps
        self.family = family
        # The norm of attention's input and output, and of the MLP's (None: not normed).
        self.norm_attn_in, self.norm_attn_out, self.norm_mlp_in, self.norm_mlp_out = (
            _norm_weight(layer, name, family) if name else None
            for name in _NORM_SLOTS[family.norms]
        )
        self.q_norm = _norm_weight(attn, "q_norm", family)
        self.k_norm = _norm_weight(attn, "k_norm", family)

    def norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        if weight is None:
            return x
        return rms_norm(x, weight, self.eps, self.family.norm_scale_fp32)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [N, Hq, D] and k [N, Hkv, D], normed as the family does (Qwen3, OLMo-2, Gemma 3)."""
        if self.family.qk_norm == "head":
            return self.norm(q, self.q_norm), self.norm(k, self.k_norm)
        if self.family.qk_norm == "all":
            qn = self.norm(q.flatten(1), self.q_norm).view_as(q)
            return qn, self.norm(k.flatten(1), self.k_norm).view_as(k)
        return q, k


# The layer's norms on attention's input and output, then the MLP's: Llama norms
# the inputs, OLMo-2 the outputs, Gemma both.
_NORM_SLOTS: dict[str, tuple[str | None, ...]] = {
    "pre": ("input_layernorm", None, "post_attention_layernorm", None),
    "post": (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
    "sandwich": (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ),
}


def _norm_weight(module: Any, name: str, family: Family) -> torch.Tensor | None:
    """The scale of ``module``'s norm ``name`` as ``rms_norm`` applies it (Gemma's
    ``1 + weight``, in float32 as Gemma computes it); None if it has none."""
    norm = getattr(module, name, None)
    if norm is None:
        return None
    weight = norm.weight.detach()
    return 1.0 + weight.float() if family.norm_offset else weight


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, scale_fp32: bool = False
) -> torch.Tensor:
    # As transformers' LlamaRMSNorm: normalise in float32, scale in the model's dtype
    # (OLMo-2's and Gemma's scale in float32, then cast).
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # The same arithmetic (x * rsqrt(mean(x^2) + eps), times the weight) bit for bit
        # (tests/engine/test_llama_ops.py), as one call instead of six: at a decode step's
        # few rows each op costs its dispatch, not its arithmetic.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if scale_fp32:
        return (weight * xf).to(x.dtype)
    return weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding over the first ``cos.shape[-1]`` dims of each head (all of
    them but for Phi-3's partial rotary), as transformers' ``apply_rotary_pos_emb``."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    turned = x[..., :dim]
    return torch.cat([turned * cos + rotate_half(turned) * sin, x[..., dim:]], dim=-1)


def covers(model: FastLlama) -> bool:
    """Whether the fused forward (``engine/fused.py``) computes ``model``'s family
    exactly as the torch one."""
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


def kernels_for(model: FastLlama) -> Kernels | None:
    """The fused forward's kernels for ``model``, chosen once, when it is built:
    Triton's for a CUDA model, the C++ ones for a float32 CPU model where they build;
    None (the torch forward) elsewhere and for the families ``covers`` leaves out."""
    if not model.fusable:
        return None
    triton = triton_kernels(model.embed)
    return triton if triton is not None else native_kernels(model.embed)


class FastLlama:
    """The forward pass; ``forward`` is replaceable (tests inject faults through it)."""

    def __init__(self, model: Any, max_positions: int, transposed: bool) -> None:
        config = model.config.get_text_config()
        self.family = family_of(config)
        self.config = config
        self.num_layers = int(config.num_hidden_layers)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        )
        self.vocab_size = int(config.vocab_size)
        # Gemma scales by query_pre_attn_scalar, which need not be the head size.
        self.scale = float(getattr(config, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5
        # Gemma 2 soft-caps attention scores and logits: cap * tanh(x / cap).
        self.attn_softcap = _optional_float(config, "attn_logit_softcapping")
        self.logit_softcap = _optional_float(config, "final_logit_softcapping")
        self.activation = _ACTIVATIONS[activation_of(config)]
        inner = model.model
        self.embed = inner.embed_tokens.weight.detach()
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        # As Gemma's ScaledWordEmbedding: sqrt(hidden), rounded to the model's dtype.
        self.embed_scale = (
            torch.tensor(float(config.hidden_size) ** 0.5).to(self.device, self.dtype)
            if self.family.embed_scale
            else None
        )
        eps = float(config.rms_norm_eps)
        self.layers = [LayerWeights(layer, eps, transposed, self.family) for layer in inner.layers]
        norm = _norm_weight(inner, "norm", self.family)
        assert norm is not None, "a decoder without a final norm"
        self.norm = norm
        self.eps = eps
        # A Linear here; the quantized CPU path puts an int8 one in its place.
        self.lm_head: Callable[[torch.Tensor], torch.Tensor] = Linear(
            _weight(model.lm_head), None, transposed
        )
        # One rotary table per layer type (Gemma 3's sliding layers have their own base).
        self.rope_of_layer, self.tables = _rope_tables(
            inner, config, max_positions, self.dtype, self.device
        )
        self.cos, self.sin = self.tables[0]
        # Whether the fused kernels compute this family (engine/fused.py).
        self.fusable = covers(self)
        # The C++ layer stack (engine/native_layers.cpp) the quantized CPU core builds
        # when every linear layer multiplies GGUF blocks; the native forward runs it.
        self.layer_stack: Any = None
        # The fused forward's kernels, chosen here once (None: the torch forward).
        self.kernels: Kernels | None = kernels_for(self)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionContext
    ) -> torch.Tensor:
        """Final hidden states [N, hidden] of the flattened tokens."""
        kernels = self.kernels
        if kernels is not None and kernels.serves(attention):
            return kernels.forward(self, input_ids, positions, attention)
        x = F.embedding(input_ids, self.embed)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        ropes = [(c[positions].unsqueeze(1), s[positions].unsqueeze(1)) for c, s in self.tables]
        n = input_ids.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        for i, layer in enumerate(self.layers):
            cos, sin = ropes[self.rope_of_layer[i]]
            h = layer.norm(x, layer.norm_attn_in)
            qkv = layer.qkv(h)
            if self.family.qk_norm is None:
                # q's heads and k's lie side by side: one rotary over both (the same
                # bits as two, in half the calls).
                heads = qkv[:, : q_size + kv_size].view(n, -1, self.head_dim)
                q, k = rotary(heads, cos, sin).split([self.num_heads, self.num_kv_heads], 1)
            else:
                q = qkv[:, :q_size].view(n, self.num_heads, self.head_dim)
                k = qkv[:, q_size : q_size + kv_size].view(n, self.num_kv_heads, self.head_dim)
                q, k = layer.qk_norm(q, k)
                q, k = rotary(q, cos, sin), rotary(k, cos, sin)
            v = qkv[:, q_size + kv_size :].view(n, self.num_kv_heads, self.head_dim)
            out = attention(i, q, k, v)
            x = x + layer.norm(layer.o(out.reshape(n, q_size)), layer.norm_attn_out)
            h = layer.norm(x, layer.norm_mlp_in)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.norm(layer.down(self.activation(gate) * up), layer.norm_mlp_out)
        return rms_norm(x, self.norm, self.eps, self.family.norm_scale_fp32)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.logit_softcap is not None:
            logits = soft_cap(logits, self.logit_softcap)
        return logits

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """K and V of one token in every layer, in ``dtype`` (default: the model's)."""
        element = (dtype or self.dtype).itemsize
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}


def _optional_float(config: Any, name: str) -> float | None:
    value = getattr(config, name, None)
    return float(value) if value else None


def _rope_tables(
    inner: Any, config: Any, max_positions: int, dtype: torch.dtype, device: torch.device
) -> tuple[list[int], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each layer's index into the rotary tables, and the tables: cos/sin
    [max_positions, head_dim] from the model's own rotary module (rope scaling
    included), in the model's dtype as transformers applies them."""
    positions = torch.arange(max_positions, device=device).unsqueeze(0)
    probe = torch.empty((), dtype=dtype, device=device)
    rotary = inner.rotary_emb
    layer_types = list(getattr(config, "layer_types", None) or [])
    per_type = "layer_type" in inspect.signature(rotary.forward).parameters
    kinds = sorted(set(layer_types)) if per_type and layer_types else [None]
    tables = []
    with torch.inference_mode():
        for kind in kinds:
            cos, sin = rotary(probe, positions, kind) if kind else rotary(probe, positions)
            tables.append((cos[0].contiguous(), sin[0].contiguous()))
    num_layers = int(config.num_hidden_layers)
    if kinds == [None]:
        return [0] * num_layers, tables
    return [kinds.index(t) for t in layer_types[:num_layers]], tables


def fast_model_for(loaded_model: Any, max_positions: int, transposed: bool) -> FastLlama:
    """The ``FastLlama`` over ``loaded_model`` (built once: it re-points the model's
    weights; again only where the kernels it would choose now differ, as where a
    test turns the native ones off or on)."""
    cached = getattr(loaded_model, "_wsinfer_fast", None)
    if (
        cached is not None
        and cached.cos.shape[0] >= max_positions
        and _kernels_name(cached.kernels) == _kernels_name(kernels_for(cached))
    ):
        return cached  # type: ignore[no-any-return]
    with torch.inference_mode():
        fast = FastLlama(loaded_model, max_positions, transposed)
    loaded_model._wsinfer_fast = fast
    return fast


def _kernels_name(kernels: Kernels | None) -> str:
    return "torch" if kernels is None else kernels.name
