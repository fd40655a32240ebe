"""A compiled CPU decode step against the eager one, in one run.

    python benchmarks/bench_cpu_compile.py [--model PATH] [--batches 1,8] [--steps 48]

``torch.compile`` (inductor, static shapes, its C++ kernels) of the engine's own
``FastLlama.forward``, attention left to the engine: the batch-invariant CPU
attention (``engine/attention_cpu.py``) plans on the host and inspects its data,
so it is an opaque custom op in the graph, and everything around it (norms,
rotary, the int4 and int8 matmuls, the residual adds, SiLU) is compiled, one
graph per batch size. One row per batch size, each number the best of
``--rounds`` with the two interleaved: decode ms/step eager and compiled, their
ratio, the seconds the first compiled step took (the compile), and of the
decode steps of a run, how many computed the very hidden states the eager step
computes from the same inputs. The engine promises that a turn rebuilt after a
takeover (its tokens prefilled eagerly) recomputes the very KV its decode steps
wrote: a compiled decode step can only take part where every step is bit-equal.

Issue 20 lists compiling the decode step as a way to the CPU's targets; this is
the measurement of whether it pays (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_step import load_for, run_steps, step_arguments  # noqa: E402

from wsinfer.engine.core import EngineConfig, build_core  # noqa: E402
from wsinfer.engine.model import LoadedModel  # noqa: E402

# The attention context of the step being run: the custom op's way to it (a graph
# input cannot be a Python object).
_CONTEXT: list[Any] = [None]


@torch.library.custom_op("wsinfer_bench::attend", mutates_args=())
def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return _CONTEXT[0](layer, q, k, v)  # type: ignore[no-any-return]


@_attend.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(q)


class _ThroughOp:
    """An attention context the compiler sees as the custom op."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Any:
        return torch.ops.wsinfer_bench.attend(q, k, v, layer)


class Switch:
    """``fast.forward`` eager or compiled, chosen per step by ``mode``: "eager",
    "compiled", or "compare" (both, counting the steps whose hidden states agree bit
    for bit; the eager one goes on)."""

    def __init__(self, fast: Any, max_decode_rows: int) -> None:
        self.eager: Callable[..., torch.Tensor] = fast.forward
        self.max_decode_rows = max_decode_rows
        through = _ThroughOp()

        def traced(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return self.eager(ids, positions, through)

        self.graph = torch.compile(traced, dynamic=False, fullgraph=True)
        self.mode = "eager"
        self.equal = self.compared = 0
        fast.forward = self

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, context: Any) -> torch.Tensor:
        if self.mode == "eager" or ids.shape[0] > self.max_decode_rows:
            return self.eager(ids, positions, context)  # prefill stays eager
        _CONTEXT[0] = context
        compiled: torch.Tensor = self.graph(ids, positions)
        if self.mode == "compiled":
            return compiled
        # The same K/V is written twice: the eager pass overwrites it with its own.
        eager = self.eager(ids, positions, context)
        self.equal += int(torch.equal(compiled, eager))
        self.compared += 1
        return eager


def compile_table(loaded: LoadedModel, batches: list[int], steps: int, rounds: int) -> str:
    core = build_core(loaded, EngineConfig(max_batch_size=max(batches)))
    switch = Switch(core.runner.model, max(batches))
    lines = [
        "| batch | eager ms/step | compiled ms/step | compiled / eager "
        "| first compiled step, s | steps bit-equal to eager |",
        "|---|---|---|---|---|---|",
    ]
    for batch in batches:
        switch.mode = "eager"
        run_steps(core, loaded, batch, 2)
        switch.mode = "compiled"
        started = time.perf_counter()
        run_steps(core, loaded, batch, 2)  # compiles this batch size's graph
        compile_s = time.perf_counter() - started
        best = {"eager": float("inf"), "compiled": float("inf")}
        for _ in range(rounds):
            for mode in best:
                switch.mode = mode
                count, seconds = run_steps(core, loaded, batch, steps)
                best[mode] = min(best[mode], seconds / max(count, 1))
        switch.mode, switch.equal, switch.compared = "compare", 0, 0
        run_steps(core, loaded, batch, steps)
        lines.append(
            f"| {batch} | {best['eager'] * 1000:.1f} | {best['compiled'] * 1000:.1f} "
            f"| {best['compiled'] / best['eager']:.2f}x | {compile_s:.1f} "
            f"| {switch.equal} / {switch.compared} |"
        )
    switch.mode = "eager"
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = step_arguments(__doc__.split("\n\n")[0], steps=48)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    loaded, batches = load_for(args)
    print(compile_table(loaded, batches, args.steps, args.rounds))


if __name__ == "__main__":
    main()
