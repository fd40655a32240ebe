"""Sampling per decode step: the torch path against the fused Triton race.

    python benchmarks/gpu/bench_sampling.py          # on a CUDA machine
    python benchmarks/gpu/bench_sampling.py --cpu    # the CPU (torch) path only, small sizes

CUDA: bf16 logits at batch {1, 64, 256} x vocabulary {49152 (SmolLM2), 128256
(Llama 3)}, the three programs of ``sampling.Variant``: GREEDY (argmax; the same
for both), SAMPLE (temperature 0.8, repetition penalty 1.1, 2% of tokens seen,
every fourth row greedy) and FILTERED (SAMPLE plus top-k 50 / top-p 0.95 on
alternate rows). Each measurement is a CUDA graph of ``calls`` draws on separate
logits buffers (enough to stream ~256 MB, so large sizes do not sit in the 50 MB
L2; small ones do), replayed and timed with CUDA events: the median per draw in
µs, and GB/s of logits read (B x V x 2 bytes per draw). ``same`` counts the rows
whose Triton token equals the torch path's (both run on the GPU). A last table
sweeps the Triton block size for SAMPLE.

CPU: at batch {1, 8, 32} x {49152, 128256}, fp32 logits shaped like a language
model's (a few likely tokens over a long tail), the full race (``sample_tokens_torch``)
against the candidate race the CPU runs (``sampling_cpu``), interleaved, median of 10;
``same`` counts equal tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from wsinfer.engine.sampling import (
    SamplingTensors,
    Variant,
    sample_tokens_torch,
    sample_tokens_triton,
)

BATCHES = [1, 64, 256]
VOCABS = [49152, 128256]
STREAM_BYTES = 256 << 20
MAX_CALLS = 32
REPLAYS = 20


def make_params(batch: int, variant: Variant, device: str) -> SamplingTensors:
    rows = torch.arange(batch, device=device)
    filtered = variant is Variant.FILTERED
    return SamplingTensors(
        torch.where(rows % 4 == 3, 0.0, 0.8),
        torch.where((rows % 2 == 0) & filtered, 50, 0),
        torch.where((rows % 2 == 1) & filtered, 0.95, 1.0).float(),
        torch.full((batch,), 1.1, device=device),
        torch.randint(-(2**63), 2**63 - 1, (batch,), device=device),
        torch.randint(0, 4000, (batch,), device=device),
    )


def inputs(batch: int, vocab: int, dtype: torch.dtype, device: str, copies: int) -> list:
    seen = torch.rand(batch, vocab, device=device) < 0.02
    return [((torch.randn(batch, vocab, device=device) * 3).to(dtype), seen) for _ in range(copies)]


def graph_time(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], data: list) -> float:
    """Median µs per call of ``fn`` over ``data``, as one replayed CUDA graph."""
    for logits, seen in data[:2]:
        fn(logits, seen)  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for logits, seen in data:
            fn(logits, seen)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPLAYS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(data))
    del graph
    return statistics.median(times)


def cuda_row(batch: int, vocab: int, variant: Variant) -> str:
    calls = max(1, min(MAX_CALLS, STREAM_BYTES // (batch * vocab * 2)))
    data = inputs(batch, vocab, torch.bfloat16, "cuda", calls)
    params = make_params(batch, variant, "cuda")
    seen_of = (lambda s: None) if variant is Variant.GREEDY else (lambda s: s)
    torch_fn = lambda x, s: sample_tokens_torch(x, params, variant, seen_of(s))  # noqa: E731
    triton_fn = lambda x, s: sample_tokens_triton(x, params, variant, seen_of(s))  # noqa: E731
    same = int((torch_fn(*data[0]) == triton_fn(*data[0])).sum().item())
    t_torch, t_triton = graph_time(torch_fn, data), graph_time(triton_fn, data)
    gbs = [batch * vocab * 2 / (t * 1e-6) / 1e9 for t in (t_torch, t_triton)]
    torch.cuda.empty_cache()
    return (
        f"| {variant.name} | {batch} | {vocab} | {t_torch:.1f} | {gbs[0]:.0f} | {t_triton:.1f} "
        f"| {gbs[1]:.0f} | {t_torch / t_triton:.1f}x | {same}/{batch} |"
    )


def block_sweep(batch: int, vocab: int) -> str:
    from wsinfer.engine.sampling_triton import race_triton

    calls = max(1, min(MAX_CALLS, STREAM_BYTES // (batch * vocab * 2)))
    data = inputs(batch, vocab, torch.bfloat16, "cuda", calls)
    p = make_params(batch, Variant.SAMPLE, "cuda")
    cells = []
    for block in (256, 512, 1024, 2048, 4096):

        def fn(x: torch.Tensor, s: torch.Tensor, block: int = block) -> torch.Tensor:
            return race_triton(x, p.temperature, p.penalty, p.seed, p.index, s, block=block)

        cells.append(f"{graph_time(fn, data):.1f}")
    return f"| {batch} | {vocab} | " + " | ".join(cells) + " |"


def run_cuda() -> None:
    print(f"# Sampling per draw on {torch.cuda.get_device_name()}, bf16 logits\n")
    print("| variant | B | V | torch µs | torch GB/s | triton µs | triton GB/s | speedup | same |")
    print("|---|---|---|---|---|---|---|---|---|")
    for variant in (Variant.GREEDY, Variant.SAMPLE, Variant.FILTERED):
        for batch in BATCHES:
            for vocab in VOCABS:
                print(cuda_row(batch, vocab, variant), flush=True)
    print("\n## Triton block size, SAMPLE (µs per draw)\n")
    print("| B | V | 256 | 512 | 1024 | 2048 | 4096 |\n|---|---|---|---|---|---|---|")
    for batch in BATCHES:
        for vocab in VOCABS:
            print(block_sweep(batch, vocab), flush=True)


def llm_logits(batch: int, vocab: int) -> torch.Tensor:
    """A long N(0, 2.5) tail and 8 tokens per row 10-16 above it."""
    tail = torch.randn(batch, vocab) * 2.5
    return tail.scatter_add(1, torch.randint(0, vocab, (batch, 8)), 10 + 6 * torch.rand(batch, 8))


def run_cpu(threads: int) -> None:
    from wsinfer.engine.sampling_cpu import sample_tokens_cpu

    torch.set_num_threads(threads)
    print(f"# Sampling per draw on the CPU, fp32 logits, {threads} thread(s)\n")
    print("| variant | B | V | full race ms | candidate race ms | speedup | same |")
    print("|---|---|---|---|---|---|---|")
    for batch in (1, 8, 32):
        for vocab in VOCABS:
            logits, seen = llm_logits(batch, vocab), torch.rand(batch, vocab) < 0.02
            for variant in (Variant.SAMPLE, Variant.FILTERED):
                params = make_params(batch, variant, "cpu")
                fns = [sample_tokens_torch, sample_tokens_cpu]
                times: list[list[float]] = [[], []]
                for _ in range(10):
                    for fn, spent in zip(fns, times, strict=True):
                        start = time.perf_counter()
                        fn(logits, params, variant, seen)
                        spent.append((time.perf_counter() - start) * 1000)
                full, fast = (statistics.median(t) for t in times)
                same = fns[0](logits, params, variant, seen) == fns[1](
                    logits, params, variant, seen
                )
                cells = f"{full:.2f} | {fast:.2f} | {full / fast:.1f}x | {int(same.sum())}/{batch}"
                print(f"| {variant.name} | {batch} | {vocab} | {cells} |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="the torch path on the CPU only")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for --cpu")
    args = parser.parse_args()
    if args.cpu or not torch.cuda.is_available():
        run_cpu(args.threads)
    else:
        run_cuda()
    return 0


if __name__ == "__main__":
    sys.exit(main())
