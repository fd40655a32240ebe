"""The model families the fast core (``llama.FastLlama``) runs, as one table.

Each family is the Llama forward pass with a few switches, read off its
transformers implementation:

- Llama, SmolLM2, Mistral: the plain pre-norm decoder (Qwen2 adds q/k/v biases,
  which the weights carry).
- Qwen3: an RMSNorm over each head of q and k, before the rotary embedding.
- OLMo-2: an RMSNorm over all of q and over all of k; the layer norms sit on the
  outputs of attention and MLP (none on their inputs), and scale in float32.
- Phi-3: q/k/v and gate/up already fused into one matrix each; a rotary
  embedding over part of each head where the config says so.
- Gemma 2 and 3: embeddings scaled by sqrt(hidden); RMSNorms that scale by
  ``1 + weight`` in float32; four norms per layer (the inputs and the outputs of
  both attention and MLP); a tanh GELU; attention scaled by
  ``query_pre_attn_scalar``. Gemma 2 soft-caps the attention scores and the
  logits (tanh); Gemma 3 norms each head of q and k, and its sliding-window
  layers have a rotary base of their own.

A model outside the table, or inside it with a feature the fast core does not
compute exactly (another activation, rotary scaling that depends on the
sequence length), is refused with a ``UnsupportedModel`` that says why; the
engine then serves it with the eager core and logs that reason.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


class UnsupportedModel(ValueError):
    """The model is not of a family the fast runner implements."""


@dataclass(frozen=True)
class Family:
    qk_norm: str | None = None  # "head": per head (Qwen3); "all": over all heads (OLMo-2)
    # Which of attention's and the MLP's inputs and outputs are normed: "pre" the
    # inputs (Llama), "post" the outputs (OLMo-2), "sandwich" both (Gemma).
    norms: str = "pre"
    norm_scale_fp32: bool = False  # OLMo-2, Gemma: weight * x in float32, then cast
    norm_offset: bool = False  # Gemma: the norms scale by 1 + weight
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    fused_weights: bool = False  # Phi-3: qkv_proj and gate_up_proj


_GEMMA = Family(norms="sandwich", norm_scale_fp32=True, norm_offset=True, embed_scale=True)


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(),
    "qwen3": Family(qk_norm="head"),
    "olmo2": Family(qk_norm="all", norms="post", norm_scale_fp32=True),
    "phi3": Family(fused_weights=True),
    "gemma2": _GEMMA,
    "gemma3_text": replace(_GEMMA, qk_norm="head"),
}

# The activations of the MLP's gate the fast core computes, by transformers' names.
ACTIVATIONS = frozenset({"silu", "gelu_pytorch_tanh"})

# Rotary scalings whose frequencies change with the sequence's length: one table
# for every position cannot reproduce them.
_LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


def family_of(config: Any) -> Family:
    """The family of ``config`` (a text config), or ``UnsupportedModel`` saying why not."""
    model_type = str(config.model_type)
    family = FAMILIES.get(model_type)
    if family is None:
        raise UnsupportedModel(
            f"model type {model_type!r} is not one of the fast core's families "
            f"({', '.join(sorted(FAMILIES))})"
        )
    activation = activation_of(config)
    if activation not in ACTIVATIONS:
        raise UnsupportedModel(
            f"{model_type} with activation {activation!r} "
            f"(the fast core: {', '.join(sorted(ACTIVATIONS))})"
        )
    for rope_type in _rope_types(config):
        if rope_type in _LENGTH_DEPENDENT_ROPE:
            raise UnsupportedModel(f"{model_type} with {rope_type!r} rotary scaling")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModel(f"{model_type} with bidirectional attention")
    return family


def activation_of(config: Any) -> str:
    """The MLP gate's activation (Gemma names it ``hidden_activation``)."""
    return str(
        getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or "silu"
    )


def _rope_types(config: Any) -> list[str | None]:
    """The rotary type of each set of rotary parameters (Gemma 3 has one per layer type)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(rope, dict):
        return []
    sets = [v for v in rope.values() if isinstance(v, dict)] or [rope]
    return [r.get("rope_type", r.get("type")) for r in sets]


def sliding_window(config: Any) -> int | None:
    """The attention window, where the model has one that is in force; neither core
    masks by it, so the context is capped to it and stays exact."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)
