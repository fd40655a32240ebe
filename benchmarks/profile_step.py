"""Where an engine step's CPU time goes, by kind of op, at each batch size.

    python benchmarks/profile_step.py [--model PATH] [--batches 1,8] [--steps 32]

Runs ``--steps`` decode steps of the engine (sampling, temperature 0.7,
``ignore_eos`` so every row runs them all) under ``torch.profiler`` and prints
one row per batch size: the step's wall time, tokens/s, and the share of the
profiled CPU time in weight matmuls (``mm``, ``addmm``, the int4/int8 kernels),
attention, and everything else (elementwise ops, copies, indexing, sampling).
A step dominated by matmuls is bound by the weights' bytes or FLOPs, not by
Python or op dispatch. The profiler's own overhead inflates the wall times;
the first columns come from a run without it.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from wsinfer.engine.core import EngineConfig, build_core
from wsinfer.engine.lifecycle import EngineRequest
from wsinfer.engine.model import LoadedModel, load_model
from wsinfer.engine.sampling import GenerationParams

# The weights' matmuls; the attention's own ops (engine/attention_cpu.py: the KV
# gather, scores, softmax, probabilities times values, the chunks' fold; SDPA on
# other paths) are counted apart.
MATMULS = ("aten::mm", "aten::addmm", "aten::_weight_int4pack_mm_for_cpu")
MATMULS += ("aten::_weight_int8pack_mm",)
ATTENTION = ("aten::baddbmm", "aten::bmm", "aten::_softmax", "aten::index_select")
ATTENTION += ("aten::cumsum", "scaled_dot_product")
PROMPT = "Tell me a story about a dragon."


def run_steps(core: Any, loaded: LoadedModel, batch: int, steps: int) -> tuple[int, float]:
    """Add ``batch`` turns, step until they end; (decode steps, seconds) after the prefill."""
    ids = list(loaded.tokenizer.encode(PROMPT))
    for row in range(batch):
        params = GenerationParams(
            max_new_tokens=steps + 2, temperature=0.7, seed=row, ignore_eos=True
        )
        rid = f"{time.monotonic_ns()}-{row}"
        core.add(EngineRequest(request_id=rid, prompt_ids=ids, params=params))
    for _ in range(2):  # the prefill and the first decode step
        core.step()
    started, count = time.perf_counter(), 0
    while core.has_unfinished():
        core.step()
        count += 1
    return count, time.perf_counter() - started


def shares(profile: Any) -> tuple[float, float, float]:
    """(matmul, attention, other) shares of the profiled self CPU time."""
    totals = {"mm": 0.0, "attention": 0.0, "other": 0.0}
    for event in profile.key_averages():
        kind = "other"
        if event.key in MATMULS:
            kind = "mm"
        elif event.key in ATTENTION or "scaled_dot_product" in event.key:
            kind = "attention"
        totals[kind] += event.self_cpu_time_total
    whole = sum(totals.values()) or 1.0
    return totals["mm"] / whole, totals["attention"] / whole, totals["other"] / whole


def profile_table(loaded: LoadedModel, batches: list[int], steps: int) -> str:
    core = build_core(loaded, EngineConfig(max_batch_size=max(batches)))
    lines = [
        "| batch | ms/step | tok/s | matmuls | attention | other |",
        "|---|---|---|---|---|---|",
    ]
    for batch in batches:
        count, seconds = run_steps(core, loaded, batch, steps)
        with torch.profiler.profile() as profile:
            run_steps(core, loaded, batch, steps)
        mm, attention, other = shares(profile)
        per_step = seconds / max(count, 1)
        lines.append(
            f"| {batch} | {per_step * 1000:.1f} | {batch / per_step:.1f} | {mm:.0%} | "
            f"{attention:.0%} | {other:.0%} |"
        )
    return "\n".join(lines)


def step_arguments(description: str, steps: int) -> argparse.ArgumentParser:
    """The options of a benchmark that runs the engine's decode steps at batch sizes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    return parser


def load_for(args: argparse.Namespace) -> tuple[LoadedModel, list[int]]:
    """Set the thread count, load the model, say what runs; (model, batch sizes)."""
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    print(f"{loaded.name}, {torch.get_num_threads()} threads, {args.steps} decode steps\n")
    return loaded, [int(b) for b in args.batches.split(",")]


def main(argv: list[str] | None = None) -> None:
    args = step_arguments(__doc__.split("\n\n")[0], steps=32).parse_args(argv)
    loaded, batches = load_for(args)
    print(profile_table(loaded, batches, args.steps))


if __name__ == "__main__":
    main()
