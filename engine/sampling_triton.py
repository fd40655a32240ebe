"""Triton kernels for ``engine/sampling.py``: the exponential race in one pass.

The torch path of a seeded draw materialises the hash, the uniforms and the noise
as ``[B, V]`` int64 / fp32 tensors, about eighteen passes over the vocabulary per
row. Here each program reads its slice of a row's logits once, computes the
penalty, the temperature, the hash noise and a running argmax in registers, and
writes one (score, token) pair; a second, tiny kernel picks each row's winner.

The formulas are the torch path's, operation for operation: the same integer
hash bits, IEEE division (``div_rn``: Triton's ``/`` is an approximate division
on NVIDIA GPUs), and libdevice's ``logf``, which is the function torch's CUDA
``log`` calls. Ties break towards the lower token id, as ``torch.argmax`` does.

CUDA-graph rules: the grid and the split count come from shapes only, and every
parameter is read on the device, so a captured draw replays with new values.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# Triton reads the variable once, at import; so do we.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Tokens per program iteration.
BLOCK_V = 1024
# SMs to fill when the device reports none (Triton's CPU interpreter): an H100's.
DEFAULT_SMS = 132
# Programs per SM to aim for: the race is arithmetic-bound (int64 hash, two logs).
PROGRAMS_PER_SM = 4

if not INTERPRETED:
    from triton.language.extra import libdevice
else:  # the interpreter runs no extern functions; it never reaches the libdevice branch
    libdevice = None


@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.log(x)
    return tl.log(x)


@triton.jit
def _mix(z):
    """SplitMix64's output mix on uint64 (wrapping multiplication)."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _race_kernel(
    logits_ptr, seen_ptr, temp_ptr, penalty_ptr, seed_ptr, index_ptr, floor_ptr,
    val_ptr, tok_ptr,
    vocab, split_len, stride_l, stride_s,
    HAS_SEEN: tl.constexpr, HAS_FLOOR: tl.constexpr,
    BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    temperature = tl.load(temp_ptr + row)
    sampled = temperature > 0
    divisor = tl.where(sampled, temperature, 1.0)
    penalty = tl.load(penalty_ptr + row)
    floor = float("-inf")
    if HAS_FLOOR:
        floor = tl.load(floor_ptr + row)
    # row_keys: mix_seed(seed, index) as an int63, then the per-token offset of race_noise.
    seed = tl.load(seed_ptr + row).to(tl.uint64, bitcast=True)
    index = tl.load(index_ptr + row).to(tl.uint64, bitcast=True)
    key = _mix(seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9)
    key = (key << 1) >> 1
    start = split * split_len
    end = tl.minimum(start + split_len, vocab)
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_tok = tl.full([BLOCK], 2147483647, tl.int32)
    for offset in range(start, end, BLOCK):
        tokens = offset + lanes
        mask = tokens < end
        x = tl.load(logits_ptr + row * stride_l + tokens, mask=mask, other=float("-inf"))
        x = x.to(tl.float32)
        if HAS_SEEN:
            seen = tl.load(seen_ptr + row * stride_s + tokens, mask=mask, other=0) != 0
            shrunk = tl.where(x < 0, x * penalty, tl.math.div_rn(x, penalty))
            x = tl.where(seen, shrunk, x)
        scaled = tl.math.div_rn(x, divisor)
        z = _mix(key + (tokens + 1).to(tl.uint64) * 0x9E3779B97F4A7C15)
        uniform = ((z >> 41).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        score = scaled - _log(-_log(uniform, LIBDEVICE), LIBDEVICE)
        if HAS_FLOOR:
            score = tl.where(scaled < floor, float("-inf"), score)
        score = tl.where(sampled, score, x)
        score = tl.where(mask, score, float("-inf"))
        # Strictly greater: a lane keeps its earliest token among equal scores.
        better = score > best
        best = tl.where(better, score, best)
        best_tok = tl.where(better, tokens, best_tok)
    top = tl.max(best, axis=0)
    top_tok = tl.min(tl.where(best == top, best_tok, 2147483647), axis=0)
    # A slice of -inf scores records none: its first token is then the (tied) winner.
    top_tok = tl.where(top_tok == 2147483647, start, top_tok)
    tl.store(val_ptr + row * num_splits + split, top)
    tl.store(tok_ptr + row * num_splits + split, top_tok)


@triton.jit
def _pick_kernel(val_ptr, tok_ptr, out_ptr, num_splits, BLOCK_S: tl.constexpr):
    """Each row's best (score, token) over its splits; the lower token wins ties."""
    row = tl.program_id(0)
    splits = tl.arange(0, BLOCK_S)
    mask = splits < num_splits
    vals = tl.load(val_ptr + row * num_splits + splits, mask=mask, other=float("-inf"))
    toks = tl.load(tok_ptr + row * num_splits + splits, mask=mask, other=2147483647)
    top = tl.max(vals, axis=0)
    winner = tl.min(tl.where(vals == top, toks, 2147483647), axis=0)
    tl.store(out_ptr + row, winner.to(tl.int64))


def choose_splits(batch: int, vocab: int, sms: int, block: int = BLOCK_V) -> tuple[int, int]:
    """(slices per row, tokens per slice): enough ``batch * slices`` programs to fill the
    GPU, each slice a whole number of blocks, and none empty."""
    want = -(-PROGRAMS_PER_SM * sms // max(batch, 1))
    return split_vocab(vocab, min(want, -(-vocab // block)), block)


def split_vocab(vocab: int, splits: int, block: int) -> tuple[int, int]:
    blocks = -(-vocab // block)
    per_split = -(-blocks // max(1, min(splits, blocks)))
    return -(-blocks // per_split), per_split * block


@functools.cache
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def race_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    penalty: torch.Tensor,
    seed: torch.Tensor,
    index: torch.Tensor,
    seen: torch.Tensor | None = None,
    floor: torch.Tensor | None = None,
    *,
    block: int = BLOCK_V,
    num_splits: int | None = None,
) -> torch.Tensor:
    """int64 [B] tokens: the race of ``sampler.sample_tokens`` (see there for the formula).

    ``logits`` [B, V] (any float dtype, last dimension contiguous); per-row float32
    ``temperature`` (0 = greedy: the argmax of the penalized logits) and ``penalty``,
    int64 ``seed`` and ``index``; ``seen`` [B, V] bool for the repetition penalty;
    ``floor`` float32 [B]: tokens whose scaled logit is below it do not race (top-k/p).
    ``block`` and ``num_splits`` override the tuning, for tests and benchmarks.
    """
    batch, vocab = logits.shape
    if logits.stride(1) != 1 or (seen is not None and seen.stride(1) != 1):
        raise ValueError("logits and seen need a contiguous last dimension")
    out = torch.empty(batch, dtype=torch.long, device=logits.device)
    if batch == 0:
        return out
    if num_splits is None:
        splits, split_len = choose_splits(batch, vocab, sm_count(logits.device), block)
    else:
        splits, split_len = split_vocab(vocab, num_splits, block)
    # Allocated per call: inside a captured graph these come from the graph's own pool.
    vals = torch.empty((batch, splits), dtype=torch.float32, device=logits.device)
    toks = torch.empty((batch, splits), dtype=torch.int32, device=logits.device)
    _race_kernel[(batch, splits)](
        logits, logits if seen is None else seen, temperature, penalty, seed, index,
        temperature if floor is None else floor, vals, toks,
        vocab, split_len, logits.stride(0), 0 if seen is None else seen.stride(0),
        HAS_SEEN=seen is not None, HAS_FLOOR=floor is not None,
        BLOCK=block, LIBDEVICE=not INTERPRETED, num_warps=4,
    )  # fmt: skip
    _pick_kernel[(batch,)](
        vals, toks, out, splits, BLOCK_S=triton.next_power_of_2(splits), num_warps=1
    )
    return out


def warm_up_batches(max_rows: int, vocab: int, sms: int) -> list[int]:
    """One batch size per distinct compiled form of the race up to ``max_rows`` rows.

    Triton compiles a kernel per set of constexprs and per specialization of its integer
    arguments (divisible by 16, equal to 1); the batch is only the grid, so the forms
    differ by (slices, slice length) alone. Running the race once at each of these
    sizes builds every kernel a live step of any size can need."""
    sizes, forms = [], set()
    for rows in range(1, max_rows + 1):
        form = choose_splits(rows, vocab, sms)
        if form not in forms:
            forms.add(form)
            sizes.append(rows)
    return sizes
