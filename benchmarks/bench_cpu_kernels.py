"""The CPU engine's C++ kernels against what they replace, in one run.

    python benchmarks/bench_cpu_kernels.py [--batches 1,8,32] [--tokens 64]
        [--prompts 200,1000,2000] [--rounds 3] [--threads 2]

Two tables, on the default model (its Q4_1 GGUF):

- **Decode**, sampled tok/s of EngineCore with the quantized layers multiplied by
  the C++ block kernels (``BlockLinear``: int8 activations, integer products, the
  file's Q8_0 output layer) against torch's int4 kernel and an int8 output layer
  (what the engine runs without the native kernels); the block kernels both ways:
  the whole layer stack in one C++ call (``native_layers.cpp``, the default) and
  the layer program in Python, kernel by kernel. The cores live in one process
  and take turns, best of ``--rounds``, so a noisy machine slows them all.
- **Prefill**, milliseconds for a prompt of N distinct tokens (one token generated)
  with the native forward against the torch forward (``WSINFER_NATIVE_CPU=0``):
  each in processes of its own, since the choice is made once a process, the two
  taking turns ``--rounds`` times, best of all.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

from wsinfer.engine import core as core_module
from wsinfer.engine import native
from wsinfer.engine.core import EngineConfig, EngineCore
from wsinfer.engine.lifecycle import EngineRequest
from wsinfer.engine.model import LoadedModel, load_model
from wsinfer.engine.quant import quantized_model
from wsinfer.engine.sampling import GenerationParams

PROMPT = "Tell me a story about a dragon."


# The decode table's engines: torch's kernels, the blocks layer by layer, in one call.
KINDS = ("torch", "layers", "stack")


def core_with(loaded: LoadedModel, kind: str, max_batch: int) -> EngineCore:
    """An EngineCore whose quantized layers use torch's kernels (``torch``) or the C++
    blocks, their layer program in Python (``layers``) or in one call (``stack``)."""
    blocks = kind != "torch"
    chosen = core_module.cpu_quantized_model
    core_module.cpu_quantized_model = lambda _m, fast, gguf: quantized_model(fast, gguf, blocks)
    try:
        core = EngineCore(loaded, EngineConfig(max_batch_size=max_batch))
    finally:
        core_module.cpu_quantized_model = chosen
    if kind == "layers":
        core.runner.model.layer_stack = None
    return core


def decode_rate(core: EngineCore, loaded: LoadedModel, batch: int, tokens: int) -> float:
    """tok/s of ``batch`` seeded turns' decode steps (after their prefill)."""
    ids = list(loaded.tokenizer.encode(PROMPT))
    for i in range(batch):
        params = GenerationParams(max_new_tokens=tokens + 1, temperature=0.8, seed=i)
        core.add(EngineRequest(request_id=f"r{i}", prompt_ids=ids, params=params))
    core.step()  # the prefill, and each turn's first token
    start, steps = time.perf_counter(), 0
    while core.has_unfinished():
        core.step()
        steps += 1
    return batch * steps / (time.perf_counter() - start)


def decode_table(loaded: LoadedModel, batches: list[int], tokens: int, rounds: int) -> str:
    cores = {kind: core_with(loaded, kind, max(batches)) for kind in KINDS}
    best: dict[tuple[str, int], float] = {}
    for _ in range(rounds):
        for batch in batches:
            for kind, core in cores.items():
                rate = decode_rate(core, loaded, batch, tokens)
                best[kind, batch] = max(best.get((kind, batch), 0.0), rate)
    lines = [
        "| streams | torch int4 + int8 output (tok/s) | C++ Q4_1 + Q8_0 blocks, layer by layer "
        "| the same in one call | blocks / torch | one call / layer by layer |",
        "|---|---|---|---|---|---|",
    ]
    for batch in batches:
        torch_rate, layers, stack = (best[kind, batch] for kind in KINDS)
        lines.append(
            f"| {batch} | {torch_rate:.1f} | {layers:.1f} | {stack:.1f} "
            f"| {layers / torch_rate:.2f}x | {stack / layers:.2f}x |"
        )
    return "\n".join(lines)


def prefill_times(loaded: LoadedModel, prompts: list[int]) -> dict[int, float]:
    """Seconds, best of 2, to prefill ``n`` distinct tokens and draw one."""
    core = EngineCore(loaded, EngineConfig(max_batch_size=8))
    times = {}
    for n in prompts:
        best = float("inf")
        for rep in range(2):  # another first token each time: no prefix is shared
            ids = list(range(1000 + rep, 1000 + rep + n))
            params = GenerationParams(max_new_tokens=1, temperature=0.0)
            core.add(EngineRequest(request_id=f"p{n}-{rep}", prompt_ids=ids, params=params))
            start = time.perf_counter()
            while core.has_unfinished():
                core.step()
            best = min(best, time.perf_counter() - start)
        times[n] = best
    return times


def prefill_table(prompts: list[int], threads: int, rounds: int) -> str:
    # The two forwards' processes take turns, ``rounds`` each, best per size.
    measured: dict[str, dict[int, float]] = {"0": {}, "1": {}}
    for _ in range(rounds):
        for flag in ("0", "1"):
            argv = [sys.executable, __file__, "--prefill-child", ",".join(map(str, prompts))]
            argv += ["--threads", str(threads)]
            env = {**os.environ, "WSINFER_NATIVE_CPU": flag}
            run = subprocess.run(argv, env=env, check=True, capture_output=True, text=True)
            for n, seconds in json.loads(run.stdout.splitlines()[-1]).items():
                best = measured[flag].get(int(n), float("inf"))
                measured[flag][int(n)] = min(best, seconds)
    lines = [
        "| prompt tokens | torch forward (ms) | native forward | native / torch time |",
        "|---|---|---|---|",
    ]
    for n in prompts:
        torch_ms, native_ms = measured["0"][n] * 1e3, measured["1"][n] * 1e3
        lines.append(f"| {n} | {torch_ms:.0f} | {native_ms:.0f} | {native_ms / torch_ms:.2f}x |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> Any:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--tokens", type=int, default=64, help="decode steps a turn")
    parser.add_argument("--prompts", default="200,1000,2000", help="prefill sizes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill-child", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = dataclasses.replace(load_model(None), eos_token_ids=set())
    if args.prefill_child:
        times = prefill_times(loaded, [int(n) for n in args.prefill_child.split(",")])
        print(json.dumps(times))
        return
    batches = [int(b) for b in args.batches.split(",")]
    print(f"# bench_cpu_kernels: {args.threads} threads, {args.tokens} sampled tokens a turn")
    if native.kernels() is None:
        print("\nThe native kernels did not build here: nothing to compare.")
        return
    print("\nDecode (one process, the cores taking turns, best of each):\n")
    print(decode_table(loaded, batches, args.tokens, args.rounds))
    print("\nPrefill (a prompt of N distinct tokens, one token drawn, best of each):\n")
    print(prefill_table([int(n) for n in args.prompts.split(",")], args.threads, args.rounds))


if __name__ == "__main__":
    main()
