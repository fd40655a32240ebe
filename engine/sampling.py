"""Batched token sampling with per-row parameters.

Seeded draws are reproducible per token, not per stream: the random numbers
for token ``i`` of a request come from a generator seeded with ``mix(seed, i)``.
Generating tokens 0..N in one go, or 0..k, then rebuilding the request on
another engine and generating k+1..N, draws the same numbers.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from wsinfer.sessions.schema import GenerationParams

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, index: int) -> int:
    """SplitMix64 of (seed, index): well-spread generator seeds for neighbouring tokens."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def fresh_seed() -> int:
    return secrets.randbits(63)


@dataclass(frozen=True)
class RowSampling:
    """What one row needs to draw its next token."""

    params: GenerationParams
    seed: int  # the request's seed, or a fresh one for unseeded requests
    index: int  # which token of the turn this draw produces


def sample(
    logits: torch.Tensor,
    rows: list[RowSampling],
    seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next token per row of ``logits`` [B, V]; stays on the device (no sync).

    ``seen`` [B, V] bool marks each row's context tokens, for repetition_penalty.
    """
    logits = logits.float()
    if seen is not None and any(r.params.repetition_penalty != 1.0 for r in rows):
        logits = apply_repetition_penalty(logits, rows, seen)
    if all(r.params.greedy for r in rows):
        return logits.argmax(dim=-1)
    drawn = _draw(_filtered_probs(logits, rows), rows)
    if not any(r.params.greedy for r in rows):
        return drawn
    greedy = logits.argmax(dim=-1)
    is_greedy = to_device([r.params.greedy for r in rows], logits.device, torch.bool)
    return torch.where(is_greedy, greedy, drawn)


def apply_repetition_penalty(
    logits: torch.Tensor, rows: list[RowSampling], seen: torch.Tensor
) -> torch.Tensor:
    # CTRL-style, as in transformers: shrink the score of every token already in the context.
    penalty = _column(rows, lambda r: r.params.repetition_penalty, logits)
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def _column(
    rows: list[RowSampling], get: Callable[[RowSampling], float], like: torch.Tensor
) -> torch.Tensor:
    return to_device([get(r) for r in rows], like.device, like.dtype).unsqueeze(1)


def to_device(data: Any, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A tensor of host data on ``device`` without a device sync.

    ``torch.tensor(data, device="cuda")`` copies from pageable memory and waits for
    the GPU to drain its queue; a pinned staging copy with non_blocking does not.
    """
    tensor = torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def _filtered_probs(logits: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """Softmax at each row's temperature, restricted to its top_k / top_p set."""
    temps = _column(rows, lambda r: r.params.temperature or 1.0, logits)
    scaled = logits / temps
    if not any(r.params.top_k > 0 or r.params.top_p < 1.0 for r in rows):
        return torch.softmax(scaled, dim=-1)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    top_k = _column(rows, lambda r: r.params.top_k if r.params.top_k > 0 else vocab, logits)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    top_p = _column(rows, lambda r: r.params.top_p, logits)
    # Drop a token when the more likely ones already cover top_p; the first always stays.
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    return torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)


def _draw(probs: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """One categorical draw per row via the exponential race (argmax p / E, E ~ Exp(1))."""
    noise = torch.empty_like(probs)
    generator = torch.Generator(device=probs.device)
    for i, row in enumerate(rows):
        if row.params.greedy:
            noise[i].fill_(0.5)
            continue
        generator.manual_seed(mix_seed(row.seed, row.index))
        noise[i].uniform_(generator=generator)
    # -log(U) ~ Exp(1); uniform_ + log is several times cheaper than exponential_ on CPU.
    return (probs / noise.log_().neg_()).argmax(dim=-1)
