"""The sampler: which implementation draws a step's tokens, for a batch's logits.

The math of the draws (the seeded race, penalties, filters) is ``sampling.py``'s;
this picks the implementation by where the logits are (Triton on a CUDA device
with Triton, the C++ race on the CPU, torch ops elsewhere), and is the one
module that imports them all, so none of them imports another.
"""

from __future__ import annotations

import torch

from .sampling import (
    RowSampling,
    SamplingTensors,
    Variant,
    ban_ends,
    generated_counts,
    sample_tokens_torch,
    sample_tokens_triton,
    shape_logits,
    tensors_for,
    triton_available,
    variant_of,
)
from .sampling_cpu import sample_tokens_cpu


def sample(
    logits: torch.Tensor,
    rows: list[RowSampling],
    seen: torch.Tensor | None = None,
    ends: torch.Tensor | None = None,
    generated: list[list[int]] | None = None,
) -> torch.Tensor:
    """Next token per row of ``logits`` [B, V]; stays on the device (no sync).

    ``seen`` [B, V] bool marks each row's context tokens, for repetition_penalty;
    ``ends`` the end-of-sequence ids that ``min_tokens`` holds back; ``generated`` each
    row's tokens of this turn so far, for presence_penalty and frequency_penalty.
    """
    variant = variant_of([r.params for r in rows])
    params = tensors_for(rows, logits.device)
    counts = None
    if generated is not None and params.presence is not None:
        counts = generated_counts(generated, logits.shape[-1], logits.device)
    return sample_tokens(logits, params, variant, seen, ends, counts)


def sample_tokens(
    logits: torch.Tensor,
    params: SamplingTensors,
    variant: Variant,
    seen: torch.Tensor | None = None,
    ends: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The sampling program for ``variant``: fixed kernels, capturable in a CUDA graph.

    Greedy rows (temperature 0) take the argmax of the penalized logits; the others
    race ``scaled - race_noise`` with scaled = penalized logits / temperature.
    ``ends``: the model's end-of-sequence token ids, which a row cannot draw before
    its ``min_tokens``-th token (their logits become -inf in place, before anything).
    ``counts`` [B, V]: the turn's generated tokens per row, for ``params.presence`` and
    ``params.frequency``. Rows with those or typical_p have their logits shaped first
    (``shape_logits``), and the race runs over the result as over any logits.
    """
    if ends is not None and params.min_tokens is not None and ends.numel():
        ban_ends(logits, params.index < params.min_tokens, ends)
    if params.shaped:
        logits, seen = shape_logits(logits, params, seen, counts), None
        if params.typical is not None:
            variant = Variant.SAMPLE  # the filters are in the logits now
    if logits.is_cuda and triton_available():
        return sample_tokens_triton(logits, params, variant, seen)
    if logits.device.type == "cpu":
        return sample_tokens_cpu(logits, params, variant, seen)
    return sample_tokens_torch(logits, params, variant, seen)
