"""Settings that depend on the device: ``--device cuda`` is all a GPU user needs."""

from __future__ import annotations

import torch

# A GPU decode step costs about the same for 1 row as for hundreds (it streams the
# weights once either way); a CPU step grows with every row.
GPU_MAX_BATCH = 256
CPU_MAX_BATCH = 16


def resolve_device(device: str) -> str:
    """``auto`` made concrete; a CUDA device this torch cannot use is refused in
    one line (ValueError), before anything is loaded onto it."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        why = "this torch is a CPU build" if torch.version.cuda is None else "no GPU is visible"
        raise ValueError(f"--device {device}: {why} (torch {torch.__version__}); use --device cpu")
    return device


def is_gpu(device: str) -> bool:
    """Whether ``device`` names a GPU (whether this torch can use it or not)."""
    if device == "auto":
        return torch.cuda.is_available()
    return device.startswith("cuda")


def default_dtype(device: str, dtype: str) -> str:
    """``auto``: bfloat16 on a GPU (half the bytes per step), float32 on CPU."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if is_gpu(device) else "float32"


def default_max_batch(device: str, max_batch: int | None) -> int:
    if max_batch is not None:
        return max_batch
    return GPU_MAX_BATCH if is_gpu(device) else CPU_MAX_BATCH
