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

A model outside the table, or inside it with a feature the fast core does not
compute exactly (another activation, rotary scaling that depends on the
sequence length), is refused with a ``UnsupportedModel`` that says why; the
engine then serves it with the eager core and logs that reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class UnsupportedModel(ValueError):
    """The model is not of a family the fast runner implements."""


@dataclass(frozen=True)
class Family:
    qk_norm: str | None = None  # "head": per head (Qwen3); "all": over all heads (OLMo-2)
    post_norms: bool = False  # OLMo-2: norm the attention and MLP outputs, not inputs
    norm_scale_fp32: bool = False  # OLMo-2: weight * x in float32, then cast
    fused_weights: bool = False  # Phi-3: qkv_proj and gate_up_proj


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(),
    "qwen3": Family(qk_norm="head"),
    "olmo2": Family(qk_norm="all", post_norms=True, norm_scale_fp32=True),
    "phi3": Family(fused_weights=True),
}

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
    activation = getattr(config, "hidden_act", "silu")
    if activation != "silu":
        raise UnsupportedModel(f"{model_type} with activation {activation!r} (the fast core: silu)")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if rope_type in _LENGTH_DEPENDENT_ROPE:
        raise UnsupportedModel(f"{model_type} with {rope_type!r} rotary scaling")
    return family


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
