"""Batched token sampling with per-row parameters, in tensor ops only.

Everything a draw needs (temperature, top-k, top-p, repetition penalty, seed
and token index) is a per-row tensor, so a whole batch samples in a fixed
sequence of kernels: no host loop over rows, no host sync, and nothing that a
CUDA graph cannot capture.

Seeded draws are reproducible per token, not per stream: token ``i`` of a
request races the vocabulary with uniform numbers ``hash(seed, i, token id)``
(the exponential race, argmax p / -log u, a Gumbel-max draw). Generating
tokens 0..N in one go, or 0..k, then rebuilding the request on another engine
and generating k+1..N, draws the same numbers. The hash is integer arithmetic
(SplitMix64), identical on every device. The race, unlike inverse-CDF
sampling, only flips when two candidates are nearly tied, so the last-bit
differences between a prefill's and a decode's logits do not change the text.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from wsinfer.sessions.schema import GenerationParams

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def mix_seed(seed: int, index: int) -> int:
    """SplitMix64 of (seed, index) as a non-negative int63 (host reference of ``_hash``)."""
    z = (seed * _GOLDEN + (index + 1) * _MIX1) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def fresh_seed() -> int:
    return secrets.randbits(63)


def _signed(value: int) -> int:
    """A 64-bit constant as the int64 that has its bits (torch has no uint64 arithmetic)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bits (``>>`` is arithmetic on signed tensors)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _finish(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output mix; int64 multiplication wraps on every torch backend,
    which is exactly the modular arithmetic it needs."""
    z = (z ^ _shr(z, 30)) * _signed(_MIX1)
    z = (z ^ _shr(z, 27)) * _signed(_MIX2)
    return z ^ _shr(z, 31)


def row_keys(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``mix_seed(seed, index)`` per row, on the device."""
    z = seed * _signed(_GOLDEN) + (index + 1) * _signed(_MIX1)
    return _finish(z) & ((1 << 63) - 1)


def race_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """-log(u) [B, V] with u uniform in (0, 1) from ``hash(row key, token id)``."""
    tokens = torch.arange(1, vocab + 1, device=keys.device) * _signed(_GOLDEN)
    z = _finish(keys.unsqueeze(1) + tokens.unsqueeze(0))
    # The top 24 bits, centred in their bucket: never exactly 0 or 1.
    uniform = (_shr(z, 40).float() + 0.5) * (1.0 / (1 << 24))
    return uniform.log_().neg_()


class Variant(Enum):
    """Which sampling program a batch needs (each is a separate CUDA graph)."""

    GREEDY = 0  # every row greedy, no repetition penalty: argmax only
    SAMPLE = 1  # temperature and penalty, no top-k/top-p: no sort over the vocabulary
    FILTERED = 2  # some row uses top-k or top-p


@dataclass
class SamplingTensors:
    """Per-row sampling parameters as device tensors (views of persistent buffers)."""

    temperature: torch.Tensor  # float32 [B]; 0 = greedy
    top_k: torch.Tensor  # int64 [B]; 0 = off
    top_p: torch.Tensor  # float32 [B]
    penalty: torch.Tensor  # float32 [B]; 1 = off
    seed: torch.Tensor  # int64 [B]
    index: torch.Tensor  # int64 [B]: which token of the turn the draw produces

    def rows(self, n: int) -> SamplingTensors:
        return SamplingTensors(*(t[:n] for t in self.__dict__.values()))


@dataclass(frozen=True)
class RowSampling:
    """What one row needs to draw its next token."""

    params: GenerationParams
    seed: int  # the request's seed, or a fresh one for unseeded requests
    index: int  # which token of the turn this draw produces


def variant_of(params: list[GenerationParams]) -> Variant:
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params if not p.greedy):
        return Variant.FILTERED
    if all(p.greedy for p in params) and all(p.repetition_penalty == 1.0 for p in params):
        return Variant.GREEDY
    return Variant.SAMPLE


def row_values(params: GenerationParams, seed: int, index: int) -> tuple[Any, ...]:
    """One row of ``SamplingTensors``, in field order."""
    return (
        params.temperature,
        params.top_k,
        params.top_p,
        params.repetition_penalty,
        _signed(seed & _MASK64),
        index,
    )


def tensors_for(rows: list[RowSampling], device: torch.device) -> SamplingTensors:
    values = list(zip(*(row_values(r.params, r.seed, r.index) for r in rows), strict=True))
    floats = (0, 2, 3)
    return SamplingTensors(
        *(
            to_device(list(col), device, torch.float32 if i in floats else torch.long)
            for i, col in enumerate(values)
        )
    )


def sample(
    logits: torch.Tensor,
    rows: list[RowSampling],
    seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next token per row of ``logits`` [B, V]; stays on the device (no sync).

    ``seen`` [B, V] bool marks each row's context tokens, for repetition_penalty.
    """
    variant = variant_of([r.params for r in rows])
    return sample_tokens(logits, tensors_for(rows, logits.device), variant, seen)


def sample_tokens(
    logits: torch.Tensor,
    params: SamplingTensors,
    variant: Variant,
    seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """The sampling program for ``variant``: fixed kernels, capturable in a CUDA graph."""
    logits = logits.float()
    if variant is not Variant.GREEDY and seen is not None:
        logits = apply_repetition_penalty(logits, params.penalty, seen)
    greedy = logits.argmax(dim=-1)
    if variant is Variant.GREEDY:
        return greedy
    temperature = params.temperature.unsqueeze(1)
    scaled = logits / torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    probs = torch.softmax(scaled, dim=-1)
    if variant is Variant.FILTERED:
        # Rows without filters keep the plain distribution, computed exactly as in SAMPLE,
        # so a row draws the same token whatever its neighbours need.
        filtered = (params.top_k > 0) | (params.top_p < 1.0)
        probs = torch.where(filtered.unsqueeze(1), _filtered_probs(scaled, params), probs)
    noise = race_noise(row_keys(params.seed, params.index), probs.shape[-1])
    return torch.where(params.temperature > 0, (probs / noise).argmax(dim=-1), greedy)


def apply_repetition_penalty(
    logits: torch.Tensor, penalty: torch.Tensor, seen: torch.Tensor
) -> torch.Tensor:
    # CTRL-style, as in transformers: shrink the score of every token already in the context.
    column = penalty.unsqueeze(1)
    penalized = torch.where(logits < 0, logits * column, logits / column)
    return torch.where(seen, penalized, logits)


def _filtered_probs(scaled: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """Each row's distribution restricted to its top-k / top-p set, in vocabulary order."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    vocab = scaled.shape[-1]
    top_k = torch.where(params.top_k > 0, params.top_k, torch.full_like(params.top_k, vocab))
    ranks = torch.arange(vocab, device=scaled.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the more likely ones already cover top_p; the first always stays.
    before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(before >= params.top_p.unsqueeze(1), 0.0)
    return torch.zeros_like(probs).scatter_(1, order, probs)


def to_device(data: Any, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A tensor of host data on ``device`` without a device sync.

    ``torch.tensor(data, device="cuda")`` copies from pageable memory and waits for
    the GPU to drain its queue; a pinned staging copy with non_blocking does not.
    """
    tensor = torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
