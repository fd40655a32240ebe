"""The CPU's batch-invariant attention against the SDPA path it replaced, in one run.

    python benchmarks/bench_cpu_attention.py [--model PATH] [--threads N] [--rounds 5]

Two tables, every number the best of ``--rounds`` with the two paths interleaved:

- one layer's attention call (SmolLM2's shape: 9 query heads, 3 kv heads, head
  size 64) at each (rows, context): decode (one query a row; the invariant path's
  per-step plan counted a 30th) and a prefill chunk (one row, ``width`` queries),
  in microseconds, and invariant / SDPA;
- the engine on the quantized weights: decode tok/s at 1 and 8 streams, and the
  prefill of a 512-token prompt, with each attention (the SDPA path is what
  ``engine/runner.py`` ran before ``engine/attention_cpu.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch

from wsinfer.engine import runner
from wsinfer.engine.attention import decode_attention
from wsinfer.engine.attention_cpu import InvariantAttention
from wsinfer.engine.batch import PrefillPiece
from wsinfer.engine.core import EngineConfig, EngineCore
from wsinfer.engine.lifecycle import EngineRequest
from wsinfer.engine.model import LoadedModel, load_model
from wsinfer.engine.sampling import GenerationParams

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # the decode timing of bench_weight_formats
    sys.path.insert(0, str(REPO_ROOT))
from benchmarks.bench_weight_formats import speed  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
DECODE = [(1, 100), (1, 1000), (8, 100), (8, 1000)]
PREFILL = [(64, 64), (512, 512), (512, 2048)]


def best(fn: Callable[[], Any], rounds: int, calls: int) -> float:
    """Fastest of ``rounds`` timings of ``calls`` calls, per call, in seconds."""
    fn()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - started) / calls)
    return min(times)


def layer_table(rounds: int) -> str:
    gen = torch.Generator().manual_seed(0)
    blocks = 8 * 2048 // BLOCK + 1
    k = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    tables = torch.arange(1, blocks).view(8, -1)
    scale = HEAD_DIM**-0.5
    lines = [
        "| call | rows x queries | context | SDPA path, us | invariant, us | invariant / SDPA |",
        "|---|---|---|---|---|---|",
    ]
    for rows, context in DECODE:
        q = torch.randn(rows, Q_HEADS, HEAD_DIM, generator=gen)
        lens = torch.full((rows,), context, dtype=torch.int32)
        a = best(partial(decode_attention, q, k, v, tables[:rows].int(), lens, scale), rounds, 30)
        plan_step = partial(invariant_step, q, k, v, tables[:rows], lens, scale)
        b = best(plan_step, rounds, 1) / 30
        lines.append(f"| decode | {rows} x 1 | {context} | {a * 1e6:.0f} | {b * 1e6:.0f} | "
                     f"{b / a:.2f}x |")  # fmt: skip
    for width, context in PREFILL:
        pieces = [PrefillPiece(None, list(range(context)), tables[0].tolist(),
                               context - width, context)]  # fmt: skip
        q = torch.randn(width, Q_HEADS, HEAD_DIM, generator=gen)
        kv = torch.randn(width, KV_HEADS, HEAD_DIM, generator=gen)
        times = []
        for invariant_path in (False, True):
            with attention_path(invariant_path):
                prefill = runner.PrefillContext(_Pool(k, v), pieces, scale)  # type: ignore[arg-type]
                times.append(best(partial(prefill, 0, q, kv, kv), rounds, 3))
        a, b = times
        lines.append(f"| prefill | 1 x {width} | {context} | {a * 1e6:.0f} | {b * 1e6:.0f} | "
                     f"{b / a:.2f}x |")  # fmt: skip
    return "\n".join(lines)


def invariant_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> None:
    """A decode step's 30 layers: one plan, 30 calls."""
    plan = InvariantAttention(tables, (lens.long() - 1)[:, None], BLOCK, Q_HEADS, KV_HEADS)
    for _ in range(30):
        plan(q[:, None], k, v, scale)


@dataclasses.dataclass
class _Pool:
    """The slice of ``KVPool`` a context uses, over one layer's tensors."""

    k1: torch.Tensor
    v1: torch.Tensor

    @property
    def k(self) -> torch.Tensor:
        return self.k1[None]

    @property
    def v(self) -> torch.Tensor:
        return self.v1[None]

    block_size = BLOCK

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // BLOCK)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k1.view(-1, KV_HEADS, HEAD_DIM).index_copy_(0, slots, k)
        self.v1.view(-1, KV_HEADS, HEAD_DIM).index_copy_(0, slots, v)


@contextmanager
def attention_path(invariant: bool) -> Iterator[None]:
    """Run the engine's CPU attention through ``InvariantAttention`` or the SDPA path."""
    chosen = runner.use_invariant_attention
    runner.use_invariant_attention = lambda pool, softcap: invariant and softcap is None
    try:
        yield
    finally:
        runner.use_invariant_attention = chosen


def prefill_seconds(core: EngineCore, length: int) -> float:
    params = GenerationParams(max_new_tokens=1, temperature=0.0)
    prompt = [(7 * i) % 5000 + 100 for i in range(length)]
    started = time.perf_counter()
    core.add(EngineRequest(request_id=f"p{time.monotonic_ns()}", prompt_ids=prompt,
                           params=params))  # fmt: skip
    while core.has_unfinished():
        core.step()
    return time.perf_counter() - started


def engine_table(loaded: LoadedModel, rounds: int, tokens: int) -> str:
    config = EngineConfig(max_batch_size=8, quantized_cpu_weights=True)
    results: dict[bool, dict[str, float]] = {False: {}, True: {}}
    for _ in range(rounds):
        for invariant in (False, True):
            with attention_path(invariant):
                core = EngineCore(loaded, config)
                got = {
                    "1 stream, tok/s": speed(core, loaded, 1, tokens),
                    "8 streams, tok/s": speed(core, loaded, 8, tokens),
                    "512-token prefill, s": prefill_seconds(core, 512),
                }
            for name, value in got.items():
                keep = max if "tok/s" in name else min
                results[invariant][name] = keep(results[invariant].get(name, value), value)
    lines = ["| quantized engine | SDPA path | invariant | invariant / SDPA |", "|---|---|---|---|"]
    for name, before in results[False].items():
        after = results[True][name]
        lines.append(f"| {name} | {before:.2f} | {after:.2f} | {after / before:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens per stream")
    parser.add_argument("--skip-engine", action="store_true", help="the layer table only")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    print(f"{torch.get_num_threads()} threads, best of {args.rounds}\n")
    with torch.inference_mode():
        print(layer_table(args.rounds))
        if not args.skip_engine:
            loaded = load_model(args.model)
            print(f"\n{loaded.name}, {args.tokens} tokens a stream\n")
            print(engine_table(loaded, args.rounds, args.tokens))


if __name__ == "__main__":
    main()
