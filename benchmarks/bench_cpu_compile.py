"""A compiled CPU decode step against the eager one, in one run.

    python benchmarks/bench_cpu_compile.py [--model PATH] [--batches 1,8] [--steps 48]

``torch.compile`` (inductor, static shapes, its C++ kernels) of the engine's own
``FastLlama.forward``, attention left to the engine: the batch-invariant CPU
attention (``engine/attention_cpu.py``) plans on the host and inspects its data,
so it is an opaque custom op in the graph, and everything around it (norms,
rotary, the int4 and int8 matmuls, the residual adds, SiLU) is compiled, one
graph per batch size. One row per batch size, each number the best of
``--rounds`` with the two interleaved: decode ms/step eager and compiled, their
ratio, the seconds the first compiled step took (the compile), and whether a
seeded turn draws the same tokens both ways (the engine's promise that a
prefill, run eagerly, and a decode step agree bit for bit would need that).

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
from wsinfer.engine.lifecycle import EngineRequest  # noqa: E402
from wsinfer.engine.model import LoadedModel  # noqa: E402
from wsinfer.engine.sampling import GenerationParams  # noqa: E402

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
    """``fast.forward`` eager or compiled, chosen per step by ``compiled``."""

    def __init__(self, fast: Any) -> None:
        self.eager: Callable[..., torch.Tensor] = fast.forward
        through = _ThroughOp()

        def traced(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return self.eager(ids, positions, through)

        self.graph = torch.compile(traced, dynamic=False, fullgraph=True)
        self.compiled = False
        fast.forward = self

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, context: Any) -> torch.Tensor:
        if not self.compiled or ids.shape[0] > self.max_decode_rows:
            return self.eager(ids, positions, context)  # prefill stays eager
        _CONTEXT[0] = context
        return self.graph(ids, positions)  # type: ignore[no-any-return]

    max_decode_rows = 0


def seeded_tokens(core: Any, loaded: LoadedModel, steps: int) -> list[int]:
    ids = list(loaded.tokenizer.encode("Tell me a story about a dragon."))
    params = GenerationParams(max_new_tokens=steps, temperature=0.8, seed=7, ignore_eos=True)
    core.add(EngineRequest(request_id=f"same-{time.monotonic_ns()}", prompt_ids=ids, params=params))
    tokens: list[int] = []
    while core.has_unfinished():
        for out in core.step():
            tokens.extend(out.new_token_ids)
    return tokens


def compile_table(loaded: LoadedModel, batches: list[int], steps: int, rounds: int) -> str:
    core = build_core(loaded, EngineConfig(max_batch_size=max(batches)))
    switch = Switch(core.runner.model)
    switch.max_decode_rows = max(batches)
    lines = [
        "| batch | eager ms/step | compiled ms/step | compiled / eager "
        "| first compiled step, s | same tokens |",
        "|---|---|---|---|---|---|",
    ]
    for batch in batches:
        switch.compiled = False
        run_steps(core, loaded, batch, 2)
        switch.compiled = True
        started = time.perf_counter()
        run_steps(core, loaded, batch, 2)  # compiles this batch size's graph
        compile_s = time.perf_counter() - started
        best = {False: float("inf"), True: float("inf")}
        for _ in range(rounds):
            for compiled in (False, True):
                switch.compiled = compiled
                count, seconds = run_steps(core, loaded, batch, steps)
                best[compiled] = min(best[compiled], seconds / max(count, 1))
        same = "n/a"
        if batch == 1:
            drawn = []
            for compiled in (False, True):
                switch.compiled = compiled
                drawn.append(seeded_tokens(core, loaded, steps))
            same = "yes" if drawn[0] == drawn[1] else "no"
        lines.append(
            f"| {batch} | {best[False] * 1000:.1f} | {best[True] * 1000:.1f} "
            f"| {best[True] / best[False]:.2f}x | {compile_s:.1f} | {same} |"
        )
    switch.compiled = False
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = step_arguments(__doc__.split("\n\n")[0], steps=48)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    loaded, batches = load_for(args)
    print(compile_table(loaded, batches, args.steps, args.rounds))


if __name__ == "__main__":
    main()
