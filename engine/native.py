"""The CPU forward's small kernels in C++ (``native_cpu.cpp``), built on first use.

A one-row decode step of the torch forward on the default model is about 75 ops a
layer; apart from the four weight matmuls each costs its dispatch and a few
microseconds of bookkeeping, not its arithmetic (``benchmarks/profile_step.py``:
RMSNorm alone 26 us a call through ``F.rms_norm``). Here a layer is its four
matmuls and four calls: add + RMSNorm (twice), rotary + KV write, SiLU * mul, and
attention over the paged cache, as the GPU's fused kernels do
(``engine/fused.py`` runs the same layer program with either set). Where every
linear layer multiplies GGUF blocks (the quantized default), the whole layer
program is one C++ call (``native_layers.cpp``): the same kernels in the same
order, without the interpreter between them.

A token's results depend on nothing but its own inputs, summed in an order the
C++ fixes: a row is the same bits alone or batched, and a prefill recomputes the
very KV its decode steps wrote (the takeover promise). They are not the torch
forward's bits: an engine runs one or the other for its whole life, and engines
that share turns must run the same (same binary on the same kind of CPU), as
they must run the same weights.

Built with the machine's C++ compiler by ``torch.utils.cpp_extension`` (~30 s, once:
the library is kept under the wsinfer cache, keyed by the source, torch's version
and the CPU). Without a compiler, or with ``WSINFER_NATIVE_CPU=0``, the engine
keeps the torch forward.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import structlog
import torch

if TYPE_CHECKING:
    from .llama import CachedAttention, FastLlama

# The bindings live in the first; the quantized linear layers in the second; the
# layer stack over them in the third; the sampler's race in the fourth.
SOURCES = [
    Path(__file__).with_name(name)
    for name in ("native_cpu.cpp", "native_quant.cpp", "native_layers.cpp", "native_sampling.cpp")
]
log = structlog.get_logger("wsinfer.engine.native")
# -march=native: the library is built on, and kept for, this CPU (the cache key).
# -fopenmp: at::parallel_for is inline; without it the kernels run on one thread
# (the OpenMP runtime is torch's own, already loaded). -fno-trapping-math: GCC
# vectorizes no loop with a conditional float expression otherwise (the SiLU's
# exp ran one element at a time); it changes no result, only lets the compiler
# compute both sides of a select.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math"]


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
    except Exception as exc:  # a missing compiler or ninja, a failed build: keep torch's
        log.warning("native CPU kernels unavailable, using the torch forward", error=str(exc))
        return None


def _build() -> ModuleType:
    from torch.utils import cpp_extension

    from .model import default_cache_dir

    _put_ninja_on_path()
    source = b"".join(path.read_bytes() for path in SOURCES)
    built_with = [torch.__version__, _cpu_identity(), *CFLAGS]
    key = hashlib.sha256(source + "\n".join(built_with).encode()).hexdigest()[:16]
    directory = default_cache_dir() / "native" / key
    directory.mkdir(parents=True, exist_ok=True)
    module = cpp_extension.load(
        name=f"wsinfer_native_cpu_{key}",
        sources=[str(path) for path in SOURCES],
        extra_cflags=CFLAGS,
        build_directory=str(directory),
        verbose=False,
    )
    log.info("native CPU kernels loaded", directory=str(directory))
    return module


def _cpu_identity() -> str:
    """The CPU's model and flags: a library built with -march=native fits only it."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    return "\n".join(sorted({line for line in lines if line.startswith(wanted)}))


def _put_ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH: use the ``ninja`` package's binary,
    which a venv's scripts directory holds but a service's PATH may not."""
    try:
        import ninja  # type: ignore[import-untyped]
    except ImportError:
        return
    bin_dir = str(ninja.BIN_DIR)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def on_native_path(x: torch.Tensor) -> bool:
    """Whether ``x``'s forward takes the native kernels: float32 CPU tensors, built."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and kernels() is not None


class NativeKernels:
    """``LayerKernels`` (``engine/fused.py``) of the C++."""

    def __init__(self, module: ModuleType) -> None:
        self.add_rms_norm = module.add_rms_norm
        self.rope_cache = module.rope_cache
        self.silu_mul = module.silu_mul


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


def native_forward(
    model: FastLlama, input_ids: torch.Tensor, positions: torch.Tensor, attention: CachedAttention
) -> torch.Tensor:
    """``FastLlama.forward`` through the native kernels (a model ``fused.covers``)."""
    from .fused import layer_program

    module = kernels()
    assert module is not None, "native_forward without the native kernels"
    stack = model.layer_stack
    if stack is None:
        return layer_program(model, input_ids, positions, attention, NativeKernels(module))
    # The same kernels in the same order, in one call (engine/native_layers.cpp).
    assert attention.kernel_rows is not None
    x = torch.nn.functional.embedding(input_ids, model.embed)
    pool = attention.pool
    out = stack.forward(x, positions, attention.slots, pool.k, pool.v, *attention.kernel_rows)
    return out  # type: ignore[no-any-return]
