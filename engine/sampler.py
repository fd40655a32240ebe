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
    sample_tokens_torch,
    sample_tokens_triton,
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
) -> torch.Tensor:
    """Next token per row of ``logits`` [B, V]; stays on the device (no sync).

    ``seen`` [B, V] bool marks each row's context tokens, for repetition_penalty;
    ``ends`` the end-of-sequence ids that ``min_tokens`` holds back.
    """
    variant = variant_of([r.params for r in rows])
    return sample_tokens(logits, tensors_for(rows, logits.device), variant, seen, ends)


def sample_tokens(
    logits: torch.Tensor,
    params: SamplingTensors,
    variant: Variant,
    seen: torch.Tensor | None = None,
    ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """The sampling program for ``variant``: fixed kernels, capturable in a CUDA graph.

    Greedy rows (temperature 0) take the argmax of the penalized logits; the others
    race ``scaled - race_noise`` with scaled = penalized logits / temperature.
    ``ends``: the model's end-of-sequence token ids, which a row cannot draw before
    its ``min_tokens``-th token (their logits become -inf in place, before anything).
    """
    if ends is not None and params.min_tokens is not None and ends.numel():
        ban_ends(logits, params.index < params.min_tokens, ends)
    if logits.is_cuda and triton_available():
        return sample_tokens_triton(logits, params, variant, seen)
    if logits.device.type == "cpu":
        return sample_tokens_cpu(logits, params, variant, seen)
    return sample_tokens_torch(logits, params, variant, seen)
