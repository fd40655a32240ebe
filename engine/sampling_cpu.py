"""The race of ``sampling.sample_tokens_torch`` over only the tokens that can win.

The race is ``argmax(scaled - noise)`` with noise = log(-log u). u comes from 23 bits
centred in their buckets, so the noise is never below a fixed ``lo`` (about -16.6),
and a token scores at most ``scaled - lo``. The row's leader (its largest scaled
logit) scores ``max - noise(leader)``, one hash; the winner scores at least that, so a
token whose scaled logit is below ``max - noise(leader) + lo`` can never win, nor tie.
On a CPU, hashing the whole 49k vocabulary per row is most of a draw's time (19 ms
at batch 8); here only the
candidates above that line are hashed, with the same float operations as the full
race (``sampling.noise_of``), so every draw is the full race's token, bit for bit.

A margin on the line absorbs the roundings of ``scaled - noise`` (relative to the
logit's size) and of the bounds themselves. Rows whose maximum is not finite (a row
of -inf, a NaN from a broken model) go through the full race.

Where the native kernels build, rows without top-k, top-p or a repetition penalty
race in C++ (``engine/native_sampling.cpp``): the same line and the same float
operations in two passes over each row, about 0.3 ms a step at one row where these
torch ops took 1 ms. Its noise is libm's ``logf`` of each candidate; torch's
vectorized log may round a last bit otherwise, which changes a draw only where two
candidates tie to that bit.
"""

from __future__ import annotations

import functools

import torch

from . import native
from .sampling import (
    SamplingTensors,
    Variant,
    filter_floor,
    race_inputs,
    row_keys,
    sample_tokens_torch,
    token_noise,
)


@functools.cache
def noise_low() -> float:
    """The least noise a token can draw (u in its top bucket), less a rounding margin."""
    top_bucket = torch.tensor([float((1 << 23) - 1)])
    return float(top_bucket.add_(0.5).mul_(1.0 / (1 << 23)).log_().neg_().log_()) - 0.01


def sample_tokens_cpu(
    logits: torch.Tensor,
    params: SamplingTensors,
    variant: Variant,
    seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sample_tokens_torch``'s tokens, hashing only each row's possible winners."""
    if variant is Variant.GREEDY:
        return logits.argmax(dim=-1)
    if seen is not None and not bool((params.penalty != 1.0).any()):
        seen = None  # a penalty of 1 changes no logit (x * 1 and x / 1 are x): skip its pass
    module = native.kernels()
    if variant is Variant.SAMPLE and seen is None and module is not None:
        # The same race in C++ (engine/native_sampling.cpp); None: a row without a
        # finite maximum, which the full race below handles.
        tokens = module.seeded_race(
            logits.float(), params.temperature, params.seed, params.index, noise_low()
        )
        if tokens is not None:
            return tokens  # type: ignore[no-any-return]
    greedy, scaled = race_inputs(logits, params, seen)
    top, leader = scaled.max(dim=-1)
    if not bool(torch.isfinite(top).all()):  # no bound to race within: the full race
        return sample_tokens_torch(logits, params, variant, seen)
    keys = row_keys(params.seed, params.index)
    # The leader's own score is a floor for the winner's: a tighter line than max - hi.
    floor = top - token_noise(keys, leader)
    cutoff = floor + noise_low() - (0.01 + 1e-3 * top.abs())
    if variant is Variant.FILTERED:
        cutoff = torch.maximum(cutoff, filter_floor(scaled, params))
    # Greedy rows take the argmax: none of their tokens needs a hash.
    cutoff = torch.where(params.temperature > 0, cutoff, float("inf"))
    raced = race(scaled, cutoff, keys)
    return torch.where(params.temperature > 0, raced, greedy)


def race(scaled: torch.Tensor, cutoff: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Per row, the lowest token id of the best ``scaled - noise`` among the tokens at or
    above ``cutoff`` (what ``argmax`` over the whole row returns when no other token can
    reach the best)."""
    batch, vocab = scaled.shape
    rows, tokens = (scaled >= cutoff.unsqueeze(1)).nonzero(as_tuple=True)
    score = scaled[rows, tokens] - token_noise(keys[rows], tokens)
    best = torch.full((batch,), float("-inf"))
    best.scatter_reduce_(0, rows, score, "amax")
    winners = score == best[rows]
    chosen = torch.full((batch,), vocab - 1, dtype=torch.long)
    return chosen.scatter_reduce_(0, rows[winners], tokens[winners], "amin")
