"""Batched token sampling with per-row parameters, in tensor ops only.

Everything a draw needs (temperature, top-k, top-p, repetition penalty, seed
and token index) is a per-row tensor, so a whole batch samples in a fixed
sequence of kernels: no host loop over rows, no host sync, and nothing that a
CUDA graph cannot capture. OpenAI's presence and frequency penalties and
typical_p shape the logits before the race (``shape_logits``), from counts of
the turn's generated tokens that are rebuilt from its token ids wherever the
row joins a batch; steps with them run outside the captured graphs.

Seeded draws are reproducible per token, not per stream: token ``i`` of a
request races the vocabulary with uniform numbers ``hash(seed, i, token id)``
(the exponential race, argmax p / -log u, a Gumbel-max draw). Generating
tokens 0..N in one go, or 0..k, then rebuilding the request on another engine
and generating k+1..N, draws the same numbers. The hash is integer arithmetic
(SplitMix64), identical on every device. The race, unlike inverse-CDF
sampling, only flips when two candidates are nearly tied, so the last-bit
differences between a prefill's and a decode's logits do not change the text.

The race runs in log space, ``argmax(logits / T - log(-log u))``, which is
``argmax(softmax(logits / T) / -log u)`` without the softmax; top-k / top-p rows
race only the tokens whose scaled logit reaches the row's ``floor`` (the smallest
one in the kept set). On CUDA with Triton, ``engine/sampling_triton.py`` runs the
whole race in one pass over the logits, with the same float operations; the torch
path here is the reference it is tested against, and the CPU's program.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np
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
    """log(-log(u)) [B, V] with u uniform in (0, 1) from ``hash(row key, token id)``:
    the race subtracts it from the scaled logits (log of the exponential noise)."""
    tokens = torch.arange(1, vocab + 1, device=keys.device) * _signed(_GOLDEN)
    return noise_of(keys.unsqueeze(1) + tokens.unsqueeze(0))


def token_noise(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``race_noise(keys, V)[i, tokens[i]]`` for each i, without the rest of the rows."""
    return noise_of(keys + (tokens + 1) * _signed(_GOLDEN))


def noise_of(z: torch.Tensor) -> torch.Tensor:
    """The noise of hash inputs ``z`` (row key + token offset); the same ops for a whole
    vocabulary or a few candidates, so both give the same floats."""
    z = (z ^ _shr(z, 30)).mul_(_signed(_MIX1))
    z = (z ^ _shr(z, 27)).mul_(_signed(_MIX2))
    # The top 23 bits (the output mix's last xor-shift leaves them alone), centred in
    # their bucket: u is never exactly 0 or 1. (With 24 bits, h + 0.5 is not a float32
    # above 2**23, and the top value rounds to u = 1: zero noise, a certain win.)
    uniform = _shr(z, 41).float().add_(0.5).mul_(1.0 / (1 << 23))
    return uniform.log_().neg_().log_()


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
    # int64 [B]: no end-of-sequence token is drawn while index < min_tokens (None: 0)
    min_tokens: torch.Tensor | None = None
    # float32 [B], OpenAI's penalties on the turn's generated tokens (None: no row has
    # them); they need the counts of those tokens (``generated_counts``).
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    typical: torch.Tensor | None = None  # float32 [B], typical_p (None: every row 1, off)

    def rows(self, n: int) -> SamplingTensors:
        return self._map(lambda t: t[:n])

    def to(self, device: torch.device) -> SamplingTensors:
        return self._map(lambda t: t.to(device))

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> SamplingTensors:
        """Each tensor through ``fn`` (an absent optional one stays absent)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        mapped = {k: None if t is None else fn(t) for k, t in values.items()}
        return SamplingTensors(**mapped)  # type: ignore[arg-type]

    @property
    def shaped(self) -> bool:
        """Some row's logits are shaped before the race (``shape_logits``)."""
        return self.presence is not None or self.typical is not None


@dataclass(frozen=True)
class RowSampling:
    """What one row needs to draw its next token."""

    params: GenerationParams
    seed: int  # the request's seed, or a fresh one for unseeded requests
    index: int  # which token of the turn this draw produces


def variant_of(params: list[GenerationParams]) -> Variant:
    if any(p.top_k > 0 or p.top_p < 1.0 or p.typical_p < 1.0 for p in params if not p.greedy):
        return Variant.FILTERED
    plain = all(p.repetition_penalty == 1.0 and not p.counts_tokens for p in params)
    if all(p.greedy for p in params) and plain:
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
        params.min_tokens,
        params.presence_penalty,
        params.frequency_penalty,
        params.typical_p,
    )


_FIELDS = [f.name for f in dataclasses.fields(SamplingTensors)]
_FLOAT_COLUMNS = (0, 2, 3, 7, 8, 9)
_PENALTY_COLUMNS = (7, 8)
_TYPICAL_COLUMN = 9


def tensors_for(rows: list[RowSampling], device: torch.device) -> SamplingTensors:
    """The rows' parameters on ``device``; the penalties and typical_p only where some row
    has them (else None: the race runs as it did before them)."""
    values = list(zip(*(row_values(r.params, r.seed, r.index) for r in rows), strict=True))
    counts = any(r.params.counts_tokens for r in rows)
    typical = any(r.params.typical_p < 1.0 for r in rows)
    columns: dict[str, torch.Tensor | None] = {}
    for i, (field, col) in enumerate(zip(_FIELDS, values, strict=True)):
        if (i in _PENALTY_COLUMNS and not counts) or (i == _TYPICAL_COLUMN and not typical):
            columns[field] = None
            continue
        dtype = torch.float32 if i in _FLOAT_COLUMNS else torch.long
        columns[field] = to_device(list(col), device, dtype)
    return SamplingTensors(**columns)  # type: ignore[arg-type]


def generated_counts(generated: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """float32 [B, V]: how often each token appears in each row's ``generated`` tokens
    (the turn's, rebuilt from its token ids: a turn taken over counts as it would have)."""
    counts = torch.zeros(len(generated), vocab)
    for row, tokens in enumerate(generated):
        ids = torch.tensor([t for t in tokens if 0 <= t < vocab], dtype=torch.long)
        counts[row].index_add_(0, ids, torch.ones(len(ids)))
    return upload(counts, device)


def shape_logits(
    logits: torch.Tensor,
    params: SamplingTensors,
    seen: torch.Tensor | None,
    counts: torch.Tensor | None,
) -> torch.Tensor:
    """float32 logits with every penalty applied (repetition first, then OpenAI's, as
    vLLM orders them) and, for sampled rows with typical_p, every token outside the row's
    top-k / top-p / typical set at -inf (transformers' order: temperature, top-k, top-p,
    typical). The race then runs over them as a SAMPLE race without ``seen``: its winners
    are the FILTERED race's, since a -inf logit never wins."""
    logits = logits.float()
    if seen is not None:
        logits = apply_repetition_penalty(logits, params.penalty, seen)
    if counts is not None and params.presence is not None and params.frequency is not None:
        present = (counts > 0).float()
        logits = logits - params.frequency.unsqueeze(1) * counts
        logits = logits - params.presence.unsqueeze(1) * present
    if params.typical is None:
        return logits
    scaled = logits / _divisor(params.temperature).unsqueeze(1)
    kept = scaled >= filter_floor(scaled, params).unsqueeze(1)
    drop = ~kept | atypical(scaled, kept, params.typical)
    drop &= (params.temperature > 0).unsqueeze(1)
    return logits.masked_fill(drop, float("-inf"))


def atypical(scaled: torch.Tensor, kept: torch.Tensor, typical: torch.Tensor) -> torch.Tensor:
    """bool [B, V]: the tokens of the ``kept`` set that transformers' TypicalLogitsWarper
    removes: those whose surprise (-log p) is further from the set's entropy than the
    closest ones that together cover ``typical`` of its probability (rows at 1: none)."""
    masked = scaled.masked_fill(~kept, float("-inf"))
    logp = torch.log_softmax(masked, dim=-1)
    entropy = -(logp * logp.exp()).nansum(dim=-1, keepdim=True)
    shifted = (-logp - entropy).abs()
    order_scores, order = shifted.sort(dim=-1)
    cumulative = masked.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < typical.unsqueeze(1)).sum(dim=1).clamp(max=scaled.shape[-1] - 1)
    threshold = order_scores.gather(1, last.unsqueeze(1))
    return (shifted > threshold) & (typical < 1.0).unsqueeze(1)


def ban_ends(logits: torch.Tensor, banned: torch.Tensor, ends: torch.Tensor) -> None:
    """Set the ``ends`` columns of the ``banned`` rows to -inf: the race and the argmax
    then never pick them, and every other token keeps its own noise (same draws as
    without the end tokens). Fixed kernels, no sync."""
    columns = logits.index_select(1, ends)
    logits.index_copy_(1, ends, columns.masked_fill_(banned.unsqueeze(1), float("-inf")))


def sample_tokens_torch(
    logits: torch.Tensor,
    params: SamplingTensors,
    variant: Variant,
    seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sampler.sample_tokens`` in torch ops: the CPU's program and the Triton race's reference."""
    if variant is Variant.GREEDY:
        return logits.argmax(dim=-1)  # no penalty here; bf16 -> fp32 keeps the order
    greedy, scaled = race_inputs(logits, params, seen)
    score = scaled - race_noise(row_keys(params.seed, params.index), scaled.shape[-1])
    if variant is Variant.FILTERED:
        score.masked_fill_(scaled < filter_floor(scaled, params).unsqueeze(1), float("-inf"))
    return torch.where(params.temperature > 0, score.argmax(dim=-1), greedy)


def race_inputs(
    logits: torch.Tensor, params: SamplingTensors, seen: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """What every race starts from: the penalized logits' argmax (a greedy row's
    token) and the penalized logits over each row's temperature."""
    logits = logits.float()
    if seen is not None:
        logits = apply_repetition_penalty(logits, params.penalty, seen)
    return logits.argmax(dim=-1), logits / _divisor(params.temperature).unsqueeze(1)


def sample_tokens_triton(
    logits: torch.Tensor, params: SamplingTensors, variant: Variant, seen: torch.Tensor | None
) -> torch.Tensor:
    """``sampler.sample_tokens``'s SAMPLE / FILTERED programs as the Triton race (one pass over
    the logits); the sort of FILTERED rows, which finds their floors, stays in torch."""
    from wsinfer.engine.sampling_triton import race_triton

    if variant is Variant.GREEDY:
        return logits.argmax(dim=-1)
    floor = None
    if variant is Variant.FILTERED:
        penalized = logits.float()
        if seen is not None:
            penalized = apply_repetition_penalty(penalized, params.penalty, seen)
        floor = filter_floor(penalized / _divisor(params.temperature).unsqueeze(1), params)
    return race_triton(
        logits, params.temperature, params.penalty, params.seed, params.index, seen, floor
    )


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _divisor(temperature: torch.Tensor) -> torch.Tensor:
    return torch.where(temperature > 0, temperature, torch.ones_like(temperature))


def apply_repetition_penalty(
    logits: torch.Tensor, penalty: torch.Tensor, seen: torch.Tensor
) -> torch.Tensor:
    # CTRL-style, as in transformers: shrink the score of every token already in the context.
    column = penalty.unsqueeze(1)
    penalized = torch.where(logits < 0, logits * column, logits / column)
    return torch.where(seen, penalized, logits)


def filter_floor(scaled: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """float32 [B]: the smallest scaled logit in each row's top-k / top-p set (-inf for
    rows without filters). Every token at or above it races (a tie at the edge of the
    set races too: a set by value does not depend on how the sort orders ties)."""
    sorted_logits = scaled.sort(dim=-1, descending=True).values
    vocab = scaled.shape[-1]
    top_k = torch.where(params.top_k > 0, params.top_k, torch.full_like(params.top_k, vocab))
    ranks = torch.arange(vocab, device=scaled.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the more likely ones already cover top_p; the first always stays.
    before = probs.cumsum(dim=-1) - probs
    kept = ((before < params.top_p.unsqueeze(1)) & (ranks < top_k.unsqueeze(1))).sum(dim=-1)
    floor = sorted_logits.gather(1, (kept.clamp(min=1) - 1).unsqueeze(1)).squeeze(1)
    filtered = (params.top_k > 0) | (params.top_p < 1.0)
    return torch.where(filtered, floor, torch.full_like(floor, float("-inf")))


def to_device(data: Any, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A tensor of host data on ``device`` without a device sync.

    ``torch.tensor(data, device="cuda")`` copies from pageable memory and waits for
    the GPU to drain its queue; a pinned staging copy with non_blocking does not.
    """
    return upload(torch.tensor(data, dtype=dtype), device)


def upload(data: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host array or tensor on ``device`` without a sync (see ``to_device``)."""
    tensor = torch.from_numpy(data) if isinstance(data, np.ndarray) else data
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
