"""A compact Llama-family forward pass over a loaded transformers model's weights.

gpt-fast style: flat tensors, a handful of kernels per layer, nothing that
inspects data on the host, so a decode step can be captured as a CUDA graph.
Tokens come in flattened (``[N]`` ids and positions, any mix of rows), and
attention is delegated to a context object that owns the KV layout (the paged
pool) and knows which token belongs to which row.

Supported: ``LlamaForCausalLM`` (SmolLM2, Llama 2/3.x) and ``Qwen2ForCausalLM``
(q/k/v bias). Weights are shared with the transformers model, not copied: q/k/v
and gate/up are fused into one matrix each and the model's own parameters are
re-pointed at views of the fused ones.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2"})


class UnsupportedModel(ValueError):
    """The model is not of a family the fast runner implements."""


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
    def __init__(self, layer: Any, eps: float, transposed: bool) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = _fused([attn.q_proj, attn.k_proj, attn.v_proj], transposed)
        self.o = Linear(_weight(attn.o_proj), _bias(attn.o_proj), transposed)
        _share(attn.o_proj, self.o.part(0, self.o.weight.shape[1 if transposed else 0]))
        self.gate_up = _fused([mlp.gate_proj, mlp.up_proj], transposed)
        self.down = Linear(_weight(mlp.down_proj), None, transposed)
        _share(mlp.down_proj, self.down.part(0, self.down.weight.shape[1 if transposed else 0]))
        self.norm_in = layer.input_layernorm.weight.detach()
        self.norm_post = layer.post_attention_layernorm.weight.detach()
        self.eps = eps


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers' LlamaRMSNorm: normalise in float32, scale in the model's dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class FastLlama:
    """The forward pass; ``forward`` is replaceable (tests inject faults through it)."""

    def __init__(self, model: Any, max_positions: int, transposed: bool) -> None:
        config = model.config.get_text_config()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModel(f"no fast runner for model type {config.model_type!r}")
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
        self.layers = [LayerWeights(layer, eps, transposed) for layer in inner.layers]
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
            h = rms_norm(x, layer.norm_in, layer.eps)
            q, k, v = layer.qkv(h).split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(n, self.num_heads, self.head_dim)
            k = k.view(n, self.num_kv_heads, self.head_dim)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            out = attention(i, q, k, v.view(n, self.num_kv_heads, self.head_dim))
            x = x + layer.o(out.reshape(n, q_size))
            h = rms_norm(x, layer.norm_post, layer.eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        return rms_norm(x, self.norm, self.eps)

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
