"""Paged decode attention on a GPU: correctness, CUDA-graph replay, and bandwidth.

    python benchmarks/gpu/bench_attention.py            # on a CUDA machine
    TRITON_INTERPRET=1 python benchmarks/gpu/bench_attention.py --smoke   # CPU: checks only
    python benchmarks/gpu/bench_attention.py --cpu      # the CPU (torch) path's time per call

1. Correctness: the Triton kernel against the torch path run in float64 on the
   same inputs, on fresh random pools (shuffled blocks, mixed lengths, padding
   rows, GQA groups of 1 to 7, head_dim 64 and 128, bf16/fp16/fp32), the output
   poisoned with NaN first; ||out - ref|| / ||ref|| per case.
2. CUDA graphs: one capture of ``decode_attention``, replayed after new lengths
   and block tables are copied into the captured buffers, against eager calls.
3. Time per call (Llama-3.2-1B's heads: 32 query, 8 kv, head_dim 64, bf16, blocks
   of 16) at batch x context: a CUDA graph of enough calls on separate pools
   ("layers") to stream well past the 50 MB L2, median over replays timed with
   CUDA events; bytes = every row's K and V read once; GB/s against the measured
   copy bandwidth. Beside it: SDPA (flash) on a contiguous cache of the same
   shape, what a non-paged cache would cost, and the torch path (gather + SDPA).
4. The split count at batch 1: every power of two against the one chosen.

``--cpu`` times the torch path (gather + SDPA) on the CPU against SDPA on a
contiguous cache, SmolLM2-135M's heads (9 / 3, D 64, fp32): the CPU engine's
attention, per layer and step; best of 20 calls.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from wsinfer.engine.attention import decode_attention, decode_attention_torch
from wsinfer.engine.attention_triton import choose_splits, decode_attention_triton, sm_count

Pools = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
BLOCK_SIZE = 16


def make_inputs(
    lens: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype, device: str, width: int = 0
) -> Pools:
    """q, k_cache, v_cache, block_tables, seq_lens: each row on its own shuffled blocks;
    every unowned slot holds NaN and table entries past a row hold an out-of-range id."""
    need = [-(-n // BLOCK_SIZE) for n in lens]
    width = max(width, max(need, default=0), 1)
    num_blocks = sum(need) + 2
    shape = (num_blocks, BLOCK_SIZE, hkv, d)
    k_cache = torch.full(shape, math.nan, dtype=dtype, device=device)
    v_cache = torch.full(shape, math.nan, dtype=dtype, device=device)
    order = torch.randperm(num_blocks, device=device)
    tables = torch.full((len(lens), width), 1 << 30, dtype=torch.int32, device=device)
    taken = 0
    for row, n in enumerate(lens):
        blocks = order[taken : taken + need[row]]
        taken += need[row]
        tables[row, : need[row]] = blocks.int()
        slots = (blocks[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE, device=device)).flatten()
        slots = slots[:n]
        k_cache.view(-1, hkv, d)[slots] = torch.randn(n, hkv, d, device=device).to(dtype)
        v_cache.view(-1, hkv, d)[slots] = torch.randn(n, hkv, d, device=device).to(dtype)
    q = torch.randn(len(lens), hq, d, device=device).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32, device=device)


def reference(inputs: Pools, scale: float) -> torch.Tensor:
    """The torch path in float64 (its fully masked fallback: the pools hold NaN)."""
    q, k, v, tables, lens = inputs
    return decode_attention_torch(
        q.double().cpu(), k.double().cpu(), v.double().cpu(), tables.cpu(), lens.cpu(), scale
    )


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64 = out.double().cpu()
    if not torch.isfinite(out64).all():
        return math.inf
    return float((out64 - ref).norm() / ref.norm().clamp_min(1e-30))


# --- 1. correctness ---------------------------------------------------------------------

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def correctness(device: str, smoke: bool) -> list[str]:
    cases = [
        ([1, 0, 17, 300, 4096], 32, 8, 64, torch.bfloat16, None),
        ([5000], 32, 8, 64, torch.bfloat16, None),
        ([77] * 64, 32, 8, 64, torch.bfloat16, None),
        ([129, 1, 0, 2048], 14, 2, 64, torch.bfloat16, None),  # Qwen2.5-0.5B: group 7
        ([300, 31], 9, 3, 64, torch.float32, None),  # SmolLM2-135M: group 3
        ([1000, 0, 16], 8, 8, 128, torch.float16, None),
        ([1000, 0, 16], 32, 8, 128, torch.bfloat16, 1),
        ([1000, 3, 16], 32, 8, 128, torch.bfloat16, 32),
    ]
    if smoke:  # the interpreter is slow: short rows
        cases = [
            ([1, 0, 17, 90], 8, 2, 64, torch.bfloat16, None),
            ([40], 9, 3, 64, torch.float32, 4),
        ]
    rows = [
        "| rows' lengths | Hq / Hkv | D | dtype | splits | rel. error | ok |",
        "|---|---|---|---|---|---|---|",
    ]
    for lens, hq, hkv, d, dtype, splits in cases:
        inputs = make_inputs(lens, hq, hkv, d, dtype, device)
        scale = 1 / math.sqrt(d)
        out = torch.full_like(inputs[0], math.nan)
        decode_attention_triton(*inputs, scale, out, num_splits=splits)
        err = rel_error(out, reference(inputs, scale))
        shown = lens if len(lens) < 6 else f"{len(lens)} x {lens[0]}"
        ok = "yes" if err <= TOLERANCE[dtype] else "NO"
        rows.append(
            f"| {shown} | {hq} / {hkv} | {d} | {str(dtype)[6:]} | {splits or 'auto'} "
            f"| {err:.1e} | {ok} |"
        )
    return rows


# --- 2. CUDA graphs ---------------------------------------------------------------------


def graph_replay(device: str) -> list[str]:
    """Capture once with one set of lengths, replay with others copied into the buffers."""
    batch, width, hq, hkv, d = 8, 64, 32, 8, 64
    q, k, v, tables, lens = make_inputs(
        [width * BLOCK_SIZE] * batch, hq, hkv, d, torch.bfloat16, device
    )
    owned = tables.flatten().clone()  # every row is full: all its blocks are written
    out = torch.empty_like(q)
    decode_attention(q, k, v, tables, lens, 0.125, out)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(q, k, v, tables, lens, 0.125, out)
    errors = []
    for trial in range(5):
        new_lens = torch.randint(0, width * BLOCK_SIZE + 1, (batch,), device=device)
        new_lens[trial % batch] = 0  # a padding row
        lens.copy_(new_lens.int())
        # Any of the written blocks, in any order (rows may share blocks: reads only).
        pick = torch.randint(0, owned.numel(), tables.shape, device=device)
        tables.copy_(owned[pick])
        q.copy_(torch.randn_like(q))
        graph.replay()
        eager = decode_attention(q, k, v, tables, lens, 0.125)
        errors.append(rel_error(out, eager.double().cpu()))
        if not out[trial % batch].eq(0).all():
            errors.append(math.inf)
    ok = max(errors) <= 1e-6
    return [
        f"CUDA graph: 5 replays with new lengths, tables and queries vs eager: max rel. "
        f"error {max(errors):.1e} ({'ok' if ok else 'MISMATCH'})"
    ]


# --- 3. timing ----------------------------------------------------------------------------


def copy_bandwidth() -> float:
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / median_seconds(lambda: dst.copy_(src), 20)


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def graphed(calls: list[Callable[[], object]]) -> Callable[[], None]:
    """One CUDA graph running every call in turn (so launch gaps do not count)."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return graph.replay


def time_case(
    batch: int, context: int, table_tokens: int, splits: int | None = None
) -> tuple[float, float, float, float]:
    """(paged Triton, contiguous flash SDPA, torch path) seconds per call, and KV bytes.
    Block tables are ``table_tokens`` wide, like an engine's (its longest sequence)."""
    hq, hkv, d, dtype = 32, 8, 64, torch.bfloat16
    kv_bytes = 2 * batch * context * hkv * d * 2
    layers = max(1, min(512, -(-(256 << 20) // kv_bytes)))  # >= 256 MB a replay: past the L2
    scale = 1 / math.sqrt(d)
    width = -(-table_tokens // BLOCK_SIZE)
    pools = [
        make_inputs([context] * batch, hq, hkv, d, dtype, "cuda", width) for _ in range(layers)
    ]
    outs = [torch.empty_like(p[0]) for p in pools]
    paged = graphed(
        [
            partial(decode_attention_triton, *p, scale, o, num_splits=splits)
            for p, o in zip(pools, outs, strict=True)
        ]
    )
    t_paged = median_seconds(paged, 20) / layers
    if splits is not None:
        return t_paged, math.nan, math.nan, kv_bytes
    flat = [
        (
            p[0][:, :, None],
            torch.randn(batch, hkv, context, d, device="cuda", dtype=dtype),
            torch.randn(batch, hkv, context, d, device="cuda", dtype=dtype),
        )
        for p in pools
    ]
    flash = graphed(
        [
            partial(F.scaled_dot_product_attention, q, k, v, scale=scale, enable_gqa=True)
            for q, k, v in flat
        ]
    )
    t_flash = median_seconds(flash, 20) / layers
    del flat
    p = pools[0]
    t_torch = median_seconds(lambda: decode_attention_torch(*p, scale, max_len=context), 5)
    return t_paged, t_flash, t_torch, kv_bytes


def chosen_splits(batch: int, context: int, table_tokens: int) -> int:
    width = -(-max(table_tokens, context) // BLOCK_SIZE) * BLOCK_SIZE
    return choose_splits(batch, 8, width, sm_count(torch.device("cuda")))


def timing(
    bandwidth: float, batches: list[int], contexts: list[int], table_tokens: int
) -> list[str]:
    rows = [
        f"Copy bandwidth {bandwidth / 1e9:.0f} GB/s; Llama-3.2-1B heads (32 / 8, D 64), bf16, "
        f"blocks of {BLOCK_SIZE}; per call, one layer",
        "",
        "| batch | context | KV MB | paged Triton µs | GB/s | of copy bw | splits "
        "| flash SDPA, contiguous µs | torch path µs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for batch in batches:
        for context in contexts:
            t_paged, t_flash, t_torch, kv = time_case(batch, context, table_tokens)
            splits = chosen_splits(batch, context, table_tokens)
            rate = kv / t_paged
            rows.append(
                f"| {batch} | {context} | {kv / 1e6:.1f} | {t_paged * 1e6:.1f} | {rate / 1e9:.0f} "
                f"| {rate / bandwidth:.2f} | {splits} | {t_flash * 1e6:.1f} "
                f"| {t_torch * 1e6:.0f} |"
            )
            print(rows[-1], file=sys.stderr, flush=True)
            torch.cuda.empty_cache()
    return rows


def split_sweep(contexts: list[int], table_tokens: int) -> list[str]:
    rows = [
        "| batch 1, context | " + " | ".join(f"{s} splits µs" for s in SPLITS) + " | chosen |",
        "|---|" + "---|" * (len(SPLITS) + 1),
    ]
    for context in contexts:
        cells = [time_case(1, context, table_tokens, s)[0] * 1e6 for s in SPLITS]
        chosen = chosen_splits(1, context, table_tokens)
        rows.append(f"| {context} | " + " | ".join(f"{c:.1f}" for c in cells) + f" | {chosen} |")
    return rows


SPLITS = [1, 2, 4, 8, 16, 32]


def cpu_timing(batches: list[int], contexts: list[int]) -> list[str]:
    """Rows all ``context`` long (no mask), and ragged: one ``context`` long, the others
    shorter by up to half (masked), against SDPA on a contiguous cache of ``context``.
    The three are timed in turn, round after round, so load from elsewhere hits all."""
    rows = [
        f"CPU, {torch.get_num_threads()} threads; SmolLM2-135M heads (9 / 3, D 64), fp32, "
        f"blocks of {BLOCK_SIZE}; per call, one layer, best of 20",
        "",
        "| batch | context | torch path, equal rows µs | torch path, ragged rows µs "
        "| SDPA, contiguous cache µs | equal / contiguous | ragged / contiguous |",
        "|---|---|---|---|---|---|---|",
    ]
    for batch in batches:
        for context in contexts:
            ragged = [context] + torch.randint(context // 2, context + 1, (batch - 1,)).tolist()
            calls = [paged_call([context] * batch), paged_call(ragged)]
            q = torch.randn(batch, 9, 1, 64)
            keys, values = torch.randn(batch, 3, context, 64), torch.randn(batch, 3, context, 64)
            calls.append(partial(F.scaled_dot_product_attention, q, keys, values, enable_gqa=True))
            equal, uneven, flat = best_seconds_each(calls)
            rows.append(
                f"| {batch} | {context} | {equal * 1e6:.0f} | {uneven * 1e6:.0f} "
                f"| {flat * 1e6:.0f} | {equal / flat:.1f}x | {uneven / flat:.1f}x |"
            )
    return rows


def paged_call(lens: list[int]) -> Callable[[], object]:
    q, k, v, tables, seq_lens = make_inputs(lens, 9, 3, 64, torch.float32, "cpu")
    k.nan_to_num_(0.0)  # a pool of finite values, as an engine's is
    v.nan_to_num_(0.0)
    return partial(decode_attention, q, k, v, tables, seq_lens, 0.125)


def best_seconds_each(calls: list[Callable[[], object]], reps: int = 20) -> list[float]:
    best = [math.inf] * len(calls)
    for call in calls:
        call()
    for _ in range(reps):
        for i, call in enumerate(calls):
            start = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter: checks only")
    parser.add_argument("--cpu", action="store_true", help="time the CPU path instead")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--contexts", default="256,1024,4096")
    parser.add_argument("--table-tokens", type=int, default=4096, help="block tables' width")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.cpu:
        print("\n".join(cpu_timing(batches, contexts)))
        return
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--smoke runs the kernels on CPU: set TRITON_INTERPRET=1")
        print("\n".join(correctness("cpu", smoke=True)))
        return
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA (or --smoke with TRITON_INTERPRET=1)")
    name = torch.cuda.get_device_name()
    print(f"# bench_attention: {name}, torch {torch.__version__}\n")
    print("\n".join(correctness("cuda", smoke=False)) + "\n", flush=True)
    print("\n".join(graph_replay("cuda")) + "\n", flush=True)
    bandwidth = copy_bandwidth()
    width = args.table_tokens
    print("\n".join(timing(bandwidth, batches, contexts, width)) + "\n", flush=True)
    print("\n".join(split_sweep(contexts, width)) + "\n", flush=True)


if __name__ == "__main__":
    main()
