"""The CPU forward's small kernels in C++ (``native_cpu.cpp``), built at install time.

A one-row decode step of the torch forward on the default model is about 75 ops a
layer; apart from the four weight matmuls each costs its dispatch and a few
microseconds of bookkeeping, not its arithmetic (``benchmarks/profile_step.py``:
RMSNorm alone 26 us a call through ``F.rms_norm``). Here a layer is its four
matmuls and four calls: add + RMSNorm (twice), rotary + KV write, SiLU * mul, and
attention over the paged cache, as the GPU's fused kernels do
(``engine/fused.py`` runs the same layer program with either set; a float32 CPU
model gets this one, ``NativeKernels``, when it is built). Where every linear
layer multiplies GGUF blocks (the quantized default), the whole layer program is
one C++ call (``native_layers.cpp``): the same kernels in the same order, without
the interpreter between them.

A token's results depend on nothing but its own inputs, summed in an order the
C++ fixes: a row is the same bits alone or batched, and a prefill recomputes the
very KV its decode steps wrote (the takeover promise). They are not the torch
forward's bits: an engine runs one or the other for its whole life, and engines
that share turns must run the same (same binary on the same kind of CPU), as
they must run the same weights.

Built by ``wsinfer prepare`` at install time, one library per CPU variant (AVX-512
VNNI, AVX-512, AVX2, portable), and the best one this CPU runs loaded at start
(``engine/native_build.py``); a start builds only where no built variant fits this
CPU, and announces it first. Without a compiler and a built variant, or with
``WSINFER_NATIVE_CPU=0``, the engine keeps the torch forward.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import TypeGuard

import structlog
import torch
import torch.nn.functional as F

from .fused import AttentionContext, CachedAttention, ProgramModel, layer_program

log = structlog.get_logger("wsinfer.engine.native")


def enabled() -> bool:
    """Whether the native kernels may be used (``WSINFER_NATIVE_CPU=0`` turns them off)."""
    return os.environ.get("WSINFER_NATIVE_CPU", "1").strip().lower() not in ("0", "false", "no")


@functools.cache
def kernels() -> ModuleType | None:
    """The compiled kernels, or None where they cannot be built (said once, in the log)."""
    if not enabled():
        return None
    try:
        return _build()
    except Exception as exc:  # a missing compiler, a failed build: keep torch's
        log.warning("native CPU kernels unavailable, using the torch forward", error=str(exc))
        return None


def _build() -> ModuleType:
    from .model import INSTALL_HINT, default_cache_dir
    from .native_build import load_best

    return load_best(default_cache_dir(), hint=INSTALL_HINT)


def on_native_path(x: torch.Tensor) -> bool:
    """Whether ``x``'s forward takes the native kernels: float32 CPU tensors, built."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and kernels() is not None


# The KV pools the native attention reads (a float16 one widened as it is loaded).
NATIVE_KV_DTYPES = (torch.float32, torch.float16)


def native_attends(pool_k: torch.Tensor) -> bool:
    """Whether the native attention reads a pool like ``pool_k``: on the CPU, built."""
    return (
        pool_k.device.type == "cpu" and pool_k.dtype in NATIVE_KV_DTYPES and kernels() is not None
    )


class NativeKernels:
    """``Kernels`` and ``LayerKernels`` (``engine/fused.py``) of the C++."""

    name = "native"

    def __init__(self, module: ModuleType) -> None:
        self.add_rms_norm = module.add_rms_norm
        self.rope_cache = module.rope_cache
        self.silu_mul = module.silu_mul

    def serves(self, attention: AttentionContext) -> TypeGuard[CachedAttention]:
        """Only beside the native attention (a context that carries ``kernel_rows``,
        which only a ``CachedAttention`` has): the whole CPU forward is one or the
        other. Not ``isinstance`` of the protocol: that checks every member, twice a
        step, about 1% of a one-stream step."""
        return getattr(attention, "kernel_rows", None) is not None

    def forward(
        self,
        model: ProgramModel,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: CachedAttention,
    ) -> torch.Tensor:
        stack = model.layer_stack
        if stack is None:
            return layer_program(model, input_ids, positions, attention, self)
        # The same kernels in the same order, in one call (engine/native_layers.cpp).
        assert attention.kernel_rows is not None
        x = F.embedding(input_ids, model.embed)
        pool = attention.pool
        out = stack.forward(x, positions, attention.slots, pool.k, pool.v, *attention.kernel_rows)
        return out  # type: ignore[no-any-return]


def native_kernels(x: torch.Tensor) -> NativeKernels | None:
    """The C++ ``Kernels`` for a model whose tensors are like ``x``, where they run."""
    module = kernels() if x.device.type == "cpu" and x.dtype == torch.float32 else None
    return None if module is None else NativeKernels(module)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    rows: torch.Tensor,
    query_pos: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Token ``t`` of row ``rows[t]`` attends to that row's keys ``0..query_pos[t]``
    (a negative position: zeros). ``q`` [N, Hq, D] float32; caches ``[blocks,
    block_size, Hkv, D]``; ``block_tables`` [R, n] int64."""
    module = kernels()
    assert module is not None, "paged_attention without the native kernels"
    out = module.paged_attention(q, k_cache, v_cache, block_tables, rows, query_pos, scale)
    return out  # type: ignore[no-any-return]
