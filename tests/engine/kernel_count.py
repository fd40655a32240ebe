"""How many kernels a decode step on the GPU path launches, counted on the CPU.

Run as a script under Triton's CPU interpreter (tests/engine/test_fused.py does):

    TRITON_INTERPRET=1 python -m tests.engine.kernel_count

It builds tiny random-weight bf16 Llamas, switches on the GPU's program (the Triton
paged attention, the fused forward where asked) and runs the padded decode step a
CUDA graph captures, ``ModelRunner._decode``, once. A ``TorchDispatchMode`` counts
each aten op that is not a view nor an ``empty`` (an allocation, no kernel), and
each Triton launch counts one. The count is an estimate of the GPU's (a CPU op may
decompose otherwise than its CUDA kernel), but a deterministic one, taken the same
way before and after a change. A sync (``.item()`` and the like) is recorded too:
a captured step may have none.

Also checks the fused forward against the torch forward (fp32, a prefill then a
decode step), so the counted program is known to compute the right thing.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM
from triton.runtime.interpreter import InterpretedFunction

from wsinfer.engine import attention, runner
from wsinfer.engine.batch import PrefillPiece
from wsinfer.engine.fused import TritonKernels
from wsinfer.engine.kvpool import KVPool
from wsinfer.engine.llama import FastLlama
from wsinfer.engine.runner import DecodeContext, ModelRunner, PrefillContext
from wsinfer.engine.sampling import Variant

ROWS, BLOCK_SIZE = 4, 16
SYNCS = frozenset({"_local_scalar_dense", "item", "nonzero", "is_nonzero"})


def tiny_model(layers: int, dtype: torch.dtype) -> FastLlama:
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval().to(dtype)
    with torch.inference_mode():
        for name, weight in model.named_parameters():
            if "norm" in name:  # not all ones: a norm applied in the wrong place shows
                weight.normal_(1.0, 0.3)
        return FastLlama(model, 256, transposed=False)


@contextlib.contextmanager
def gpu_program(model: FastLlama, fused: bool) -> Iterator[None]:
    """CPU tensors take the GPU's program: Triton attention (engine/attention.py's and
    engine/runner.py's switches), and ``model`` the kernels a CUDA model is built with:
    Triton's fused forward if ``fused``, else none (the torch forward)."""
    saved = attention.on_triton, runner.use_invariant_attention, model.kernels
    attention.on_triton = lambda t: True
    runner.use_invariant_attention = lambda pool, softcap: False
    model.kernels = TritonKernels() if fused else None
    try:
        yield
    finally:
        attention.on_triton, runner.use_invariant_attention, model.kernels = saved


class KernelCounter(TorchDispatchMode):
    """Non-view, non-allocating aten ops and Triton launches, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels: Counter[str] = Counter()
        self.in_triton = False  # the interpreter's own tensor work is not the GPU's

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not self.in_triton and not name.startswith("empty") and not _aliases(func, args, out):
            self.kernels[name] += 1
        return out

    @contextlib.contextmanager
    def counting_triton(self) -> Iterator[None]:
        run = InterpretedFunction.run

        def counted(fn: InterpretedFunction, *args: Any, **kwargs: Any) -> Any:
            self.kernels[f"triton:{fn.__name__}"] += 1
            self.in_triton = True
            try:
                return run(fn, *args, **kwargs)
            finally:
                self.in_triton = False

        InterpretedFunction.run = counted  # type: ignore[method-assign]
        try:
            yield
        finally:
            InterpretedFunction.run = run  # type: ignore[method-assign]


def _aliases(func: Any, args: Any, out: Any) -> bool:
    """Whether ``func`` returned a view of its input (no kernel). Ops that may alias
    (``to``, ``reshape``) count when they copied."""
    if not func.is_view:
        return False
    if not isinstance(out, torch.Tensor) or not isinstance(args[0], torch.Tensor):
        return True
    return bool(out.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr())


def decode_step_kernels(layers: int, fused: bool) -> Counter[str]:
    """The kernels of one padded decode step (what a CUDA graph captures), by name."""
    model = tiny_model(layers, torch.bfloat16)
    pool = KVPool(layers, 8, BLOCK_SIZE, model.num_kv_heads, model.head_dim,
                  model.dtype, torch.device("cpu"))  # fmt: skip
    pool.k.zero_(), pool.v.zero_()  # as on a GPU: no garbage for the interpreter to warn of
    with gpu_program(model, fused):
        step = ModelRunner(model, pool, ROWS, 4, ROWS, (1, 2, ROWS), ends=[1])
        step.padded = True
        step.step_ints[1, :ROWS] = torch.tensor([5, 17, 0, 30])  # lengths; 0: a padding row
        step.step_ints[0, :ROWS] = (step.step_ints[1, :ROWS] - 1).clamp(min=0)
        counter = KernelCounter()
        with torch.inference_mode(), counter.counting_triton(), counter:
            step._decode(ROWS, Variant.GREEDY)
    return counter.kernels


def per_layer(one: Counter[str], two: Counter[str]) -> tuple[int, int]:
    """(kernels per layer, kernels outside the layers), from the steps of 1 and 2 layers."""
    layer = sum(two.values()) - sum(one.values())
    return layer, sum(one.values()) - layer


def fused_forward_problems() -> list[str]:
    """The fused forward against the torch one (fp32): a prefill of two rows, then a
    decode step of both, hidden states and the KV they store."""
    model = tiny_model(2, torch.float32)
    pieces = [PrefillPiece(None, list(range(3, 24)), [1, 2], 0, 21),
              PrefillPiece(None, [7, 8, 9], [3], 0, 3)]  # fmt: skip
    results = []
    for fused in (False, True):
        pool = KVPool(2, 5, BLOCK_SIZE, 2, 16, torch.float32, torch.device("cpu"))
        pool.k.zero_(), pool.v.zero_()
        with gpu_program(model, fused), torch.inference_mode():
            prefill = PrefillContext(pool, pieces, model.scale)
            ids = torch.tensor([t for p in pieces for t in p.tokens])
            hidden = [model.forward(ids, prefill.positions, prefill)]
            tables = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
            slots, lens = torch.tensor([37, 51]), torch.tensor([22, 4], dtype=torch.int32)
            decode = DecodeContext(pool, slots, tables, lens, model.scale, None)
            hidden.append(model.forward(torch.tensor([11, 12]), lens.long() - 1, decode))
        results.append([*hidden, pool.k, pool.v])
    problems = []
    for name, unfused, fused_out in zip(["prefill", "decode", "k", "v"], *results, strict=True):
        try:
            torch.testing.assert_close(fused_out, unfused)
        except AssertionError as error:
            problems.append(f"fused forward, {name}: {str(error).splitlines()[1:4]}")
    return problems


def main() -> list[str]:
    """Prints each program's count (``torch: A per layer + B``, then ``fused: ...``)."""
    problems = fused_forward_problems()
    for fused in (False, True):
        one, two = decode_step_kernels(1, fused), decode_step_kernels(2, fused)
        layer, rest = per_layer(one, two)
        print(f"{'fused' if fused else 'torch'}: {layer} per layer + {rest}")
        if syncs := sorted(SYNCS & set(two)):
            problems.append(f"a decode step syncs: {syncs}")
    return problems


if __name__ == "__main__":
    # The GPU's program, run on CPU tensors: the CPU's own C++ kernels
    # (engine/native.py) must not stand in for the torch forward counted as "before".
    os.environ["WSINFER_NATIVE_CPU"] = "0"
    problems = main()
    print("\n".join(problems) or "ok")
    sys.exit(1 if problems else 0)
