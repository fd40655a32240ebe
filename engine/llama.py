"""A compact Llama-family forward pass over a loaded transformers model's weights.

gpt-fast style: flat tensors, a handful of kernels per layer, nothing that
inspects data on the host, so a decode step can be captured as a CUDA graph.
Tokens come in flattened (``[N]`` ids and positions, any mix of rows), and
attention is delegated to a context object that owns the KV layout (the paged
pool) and knows which token belongs to which row.

Supported: the families of ``families.py`` (Llama, SmolLM2, Mistral, Qwen2/3,
OLMo-2, Phi-3). Weights are shared with the transformers model, not copied: q/k/v
and gate/up are fused into one matrix each and the model's own parameters are
re-pointed at views of the fused ones.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F

from .families import FAMILIES, Family, UnsupportedModel, family_of

SUPPORTED_MODEL_TYPES = frozenset(FAMILIES)
__all__ = ["FastLlama", "SUPPORTED_MODEL_TYPES", "UnsupportedModel", "fast_model_for"]


class AttentionContext(Protocol):
    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Store ``k``/``v`` [N, Hkv, D] in the cache; attention output for ``q`` [N, Hq, D]."""
        ...


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
        _share(attn.o_proj, self.o.part(0, self.o.weight.shape[1 if transposed else 0]))
        gate_up = [mlp.gate_up_proj] if family.fused_weights else [mlp.gate_proj, mlp.up_proj]
        self.gate_up = _fused(gate_up, transposed)
        self.down = Linear(_weight(mlp.down_proj), None, transposed)
        _share(mlp.down_proj, self.down.part(0, self.down.weight.shape[1 if transposed else 0]))
        self.eps = eps
        self.family = family
        # Pre-norm families norm the inputs of attention and MLP; OLMo-2 their outputs.
        self.norm_in = _norm_weight(layer, "input_layernorm")
        self.norm_post = _norm_weight(layer, "post_attention_layernorm")
        self.norm_mlp_out = _norm_weight(layer, "post_feedforward_layernorm")
        self.q_norm = _norm_weight(attn, "q_norm")
        self.k_norm = _norm_weight(attn, "k_norm")

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.eps, self.family.norm_scale_fp32)

    def attention_input(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.family.post_norms else rms_norm(x, self.norm_in, self.eps)

    def attention_output(self, out: torch.Tensor) -> torch.Tensor:
        return self.norm(out, self.norm_post) if self.family.post_norms else out

    def mlp_input(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.family.post_norms else rms_norm(x, self.norm_post, self.eps)

    def mlp_output(self, out: torch.Tensor) -> torch.Tensor:
        return self.norm(out, self.norm_mlp_out) if self.family.post_norms else out

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [N, Hq, D] and k [N, Hkv, D], normed as the family does (Qwen3, OLMo-2)."""
        if self.family.qk_norm == "head":
            return self.norm(q, self.q_norm), self.norm(k, self.k_norm)
        if self.family.qk_norm == "all":
            qn = self.norm(q.flatten(1), self.q_norm).view_as(q)
            return qn, self.norm(k.flatten(1), self.k_norm).view_as(k)
        return q, k


def _norm_weight(module: Any, name: str) -> torch.Tensor:
    norm = getattr(module, name, None)
    return norm.weight.detach() if norm is not None else torch.empty(0)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, scale_fp32: bool = False
) -> torch.Tensor:
    # As transformers' LlamaRMSNorm: normalise in float32, scale in the model's dtype
    # (OLMo-2's scales in float32, then casts).
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
        self.scale = self.head_dim**-0.5
        inner = model.model
        self.embed = inner.embed_tokens.weight.detach()
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        eps = float(config.rms_norm_eps)
        self.layers = [LayerWeights(layer, eps, transposed, self.family) for layer in inner.layers]
        self.norm = inner.norm.weight.detach()
        self.eps = eps
        self.lm_head = Linear(_weight(model.lm_head), None, transposed)
        self.cos, self.sin = _rope_tables(inner.rotary_emb, max_positions, self.dtype, self.device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionContext
    ) -> torch.Tensor:
        """Final hidden states [N, hidden] of the flattened tokens."""
        x = F.embedding(input_ids, self.embed)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        n = input_ids.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        for i, layer in enumerate(self.layers):
            h = layer.attention_input(x)
            q, k, v = layer.qkv(h).split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(n, self.num_heads, self.head_dim)
            k = k.view(n, self.num_kv_heads, self.head_dim)
            q, k = layer.qk_norm(q, k)
            q, k = rotary(q, cos, sin), rotary(k, cos, sin)
            out = attention(i, q, k, v.view(n, self.num_kv_heads, self.head_dim))
            x = x + layer.attention_output(layer.o(out.reshape(n, q_size)))
            h = layer.mlp_input(x)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.mlp_output(layer.down(F.silu(gate) * up))
        return rms_norm(x, self.norm, self.eps, self.family.norm_scale_fp32)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def kv_bytes_per_token(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element


def _rope_tables(
    rotary: Any, max_positions: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_positions, head_dim] from the model's own rotary module (rope scaling
    included), in the model's dtype as transformers applies them."""
    positions = torch.arange(max_positions, device=device).unsqueeze(0)
    probe = torch.empty((), dtype=dtype, device=device)
    with torch.inference_mode():
        cos, sin = rotary(probe, positions)
    return cos[0].contiguous(), sin[0].contiguous()


def fast_model_for(loaded_model: Any, max_positions: int, transposed: bool) -> FastLlama:
    """The ``FastLlama`` over ``loaded_model`` (built once: it re-points the model's weights)."""
    cached = getattr(loaded_model, "_wsinfer_fast", None)
    if cached is not None and cached.cos.shape[0] >= max_positions:
        return cached  # type: ignore[no-any-return]
    with torch.inference_mode():
        fast = FastLlama(loaded_model, max_positions, transposed)
    loaded_model._wsinfer_fast = fast
    return fast
