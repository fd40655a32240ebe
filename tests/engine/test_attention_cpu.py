"""CPU attention that gives a query the same bits however it is batched (engine/attention_cpu.py).

Three layers of proof: the properties of torch's CPU kernels the design stands on,
checked on the machine that runs the tests; the attention itself against a query
computed alone, over hundreds of seeded batch compositions (decode batches of mixed
lengths and empty rows, prefill chunks of any start and width); and a quantized
engine whose logits go through bfloat16 at every layer, drawing the same tokens
with the same log-probabilities alone, batched and rebuilt from its token log.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import structlog
import torch

from tests.engine.conftest import run_all, tokens_of
from tests.engine.test_core import request
from wsinfer.engine import attention_cpu, native
from wsinfer.engine import core as core_module
from wsinfer.engine.attention import decode_attention
from wsinfer.engine.attention_cpu import (
    CHUNK,
    FOLD_BY_CUMSUM,
    QUERY_ROWS,
    QUERY_TILE,
    InvariantAttention,
    TiledAttention,
    batch_invariant_here,
    fold,
)
from wsinfer.engine.core import EngineConfig, EngineCore
from wsinfer.engine.llama import FastLlama, Linear
from wsinfer.engine.model import LoadedModel
from wsinfer.engine.quant import GROUP, Int4Linear, Int8Linear
from wsinfer.sessions.schema import GenerationParams

HEAD_DIM = 64


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> object:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


# --- what the design stands on ------------------------------------------------------


def test_a_matmul_row_is_the_same_in_any_product_whose_rows_are_a_multiple_of_4(
    threads: int,
) -> None:
    """Scores (inner length D, any number of keys) and probabilities times values
    (inner length CHUNK): every row of every product, against one product of them all."""
    gen = torch.Generator().manual_seed(1)
    queries = torch.randn(1536, HEAD_DIM, generator=gen)
    keys = torch.randn(64 * CHUNK, HEAD_DIM, generator=gen)
    probs = torch.rand(1536, CHUNK, generator=gen)
    values = torch.randn(CHUNK, HEAD_DIM, generator=gen)
    all_scores = torch.bmm(queries[None], keys[None].transpose(1, 2))[0]
    all_out = torch.bmm(probs[None], values[None])[0]
    for m in [*range(QUERY_ROWS, 48, QUERY_ROWS), 192, 1536]:
        for start in (0, 5, 300):
            rows = slice(start, start + m)
            for n in (CHUNK, 3 * CHUNK, 64 * CHUNK):
                scores = torch.bmm(queries[None, rows], keys[None, :n].transpose(1, 2))[0]
                assert torch.equal(scores, all_scores[rows, :n]), (m, start, n)
            out = torch.bmm(probs[None, rows], values[None])[0]
            assert torch.equal(out, all_out[rows]), (m, start)


def remainder_multiplied_another_way() -> bool:
    """Why M is padded: whether this CPU's BLAS gives 3 query rows alone other bits
    than the same rows among 64 (measured so on AVX2 machines; some AVX-512 ones
    multiply them alike, and the padding then changes nothing)."""
    gen = torch.Generator().manual_seed(1)
    queries = torch.randn(64, HEAD_DIM, generator=gen)
    keys = torch.randn(CHUNK, HEAD_DIM, generator=gen)
    whole = torch.bmm(queries[None], keys[None].transpose(1, 2))[0]
    alone = torch.bmm(queries[None, :3], keys[None].transpose(1, 2))[0]
    return not torch.equal(alone, whole[:3])


def test_a_fixed_shape_matmul_does_not_depend_on_its_batch(threads: int) -> None:
    gen = torch.Generator().manual_seed(2)
    probs = torch.rand(600, QUERY_ROWS, CHUNK, generator=gen)
    values = torch.randn(600, CHUNK, HEAD_DIM, generator=gen)
    alone = torch.cat([torch.bmm(probs[i : i + 1], values[i : i + 1]) for i in range(0, 600, 61)])
    for batch in (1, 7, 61, 300, 600):
        together = torch.bmm(probs[:batch], values[:batch])
        assert torch.equal(together[::61], alone[: len(together[::61])]), batch


def test_a_matmul_does_not_depend_on_how_far_apart_its_rows_lie(threads: int) -> None:
    """One row's kv heads are read in place from the gathered slots (rows ``Hkv * D``
    apart), a batch's from a copy (``D`` apart)."""
    gen = torch.Generator().manual_seed(6)
    queries = torch.randn(3, 12, HEAD_DIM, generator=gen)
    slots = torch.randn(5 * CHUNK, 3, HEAD_DIM, generator=gen)  # [keys, heads, D]
    in_place = slots.transpose(0, 1)
    copied = in_place.contiguous()
    assert in_place.stride(1) == 3 * HEAD_DIM and copied.stride(1) == HEAD_DIM
    assert torch.equal(
        torch.bmm(queries, in_place.transpose(1, 2)), torch.bmm(queries, copied.transpose(1, 2))
    )
    probs = torch.rand(3, 12, CHUNK, generator=gen)
    chunk = in_place[:, :CHUNK]
    assert torch.equal(torch.bmm(probs, chunk), torch.bmm(probs, chunk.contiguous()))


def test_softmax_over_a_padded_row_gives_the_unpadded_rows_bits(threads: int) -> None:
    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(12, 4096, generator=gen)
    for length in (1, 15, 16, 100, 1000):
        rows = []
        for padded in (CHUNK * -(-length // CHUNK), 2048, 4096):
            row = torch.full((12, padded), -torch.inf)
            row[:, :length] = scores[:, :length]
            rows.append(torch.softmax(row, -1)[:, :length])
        assert all(torch.equal(r, rows[0]) for r in rows), length


def test_cumsum_adds_left_to_right_in_float64() -> None:
    x = torch.tensor([1e8, 1.0, -1e8, 0.0, 0.0])
    assert x.cumsum(0)[-1].item() == 1.0  # float32 left to right would give 0.0


def test_both_folds_give_the_same_bits() -> None:
    """Decode folds its chunks with cumsum, prefill chunk by chunk: the same sums."""
    gen = torch.Generator().manual_seed(7)
    partial = torch.randn(3, 2, 9, 4, HEAD_DIM, generator=gen) * 10.0 ** torch.randint(
        -6, 6, (3, 2, 9, 1, 1), generator=gen
    )
    by_cumsum = fold(partial)
    assert partial[..., 0, :, :].numel() <= FOLD_BY_CUMSUM
    big = partial.repeat(1, 1, 1, FOLD_BY_CUMSUM // partial[..., 0, :, :].numel() + 1, 1)
    by_chunk = fold(big)[..., :4, :]
    assert torch.equal(by_cumsum, by_chunk)
    assert not torch.equal(by_cumsum, partial.sum(-3))  # float32 would round otherwise


# --- the attention ---------------------------------------------------------------------


class Pool:
    """A random block pool whose scratch block and unused blocks hold NaN, as an
    unzeroed CPU pool may."""

    def __init__(self, kv_heads: int, q_heads: int, block_size: int = 16) -> None:
        gen = torch.Generator().manual_seed(4)
        self.block_size, self.kv_heads, self.q_heads = block_size, kv_heads, q_heads
        shape = (700, block_size, kv_heads, HEAD_DIM)
        self.k = torch.randn(shape, generator=gen)
        self.v = torch.randn(shape, generator=gen)
        self.k[0] = self.v[0] = torch.nan
        self.k[600:] = self.v[600:] = torch.nan
        self.tables = (torch.randperm(599, generator=gen)[: 8 * 37] + 1).view(8, 37)
        self.queries = torch.randn(8, 600, q_heads, HEAD_DIM, generator=gen)

    def attend(
        self, rows: list[int], query_pos: torch.Tensor, q: torch.Tensor, tiled: bool = False
    ) -> torch.Tensor:
        # Entries past a row's blocks may be anything: give them NaN blocks.
        tables = torch.cat([self.tables[rows], torch.full((len(rows), 3), 650)], 1)
        kind = TiledAttention if tiled else InvariantAttention
        plan = kind(tables, query_pos, self.block_size, self.q_heads, self.kv_heads)
        return plan(q, self.k, self.v, HEAD_DIM**-0.5)

    def alone(self, row: int, position: int) -> torch.Tensor:
        q = self.queries[row, position].view(1, 1, self.q_heads, HEAD_DIM)
        return self.attend([row], torch.tensor([[position]]), q)[0, 0]


@pytest.mark.parametrize(("kv_heads", "q_heads"), [(3, 9), (2, 2), (1, 8)])
def test_a_query_gets_the_same_bits_in_any_decode_batch_or_prefill(
    kv_heads: int, q_heads: int, threads: int
) -> None:
    pool = Pool(kv_heads, q_heads)
    gen = torch.Generator().manual_seed(5)
    compositions = 0
    for _ in range(60):
        # A decode batch: distinct rows of random lengths, some empty (padding rows).
        size = int(torch.randint(1, 9, (), generator=gen))
        rows = torch.randperm(8, generator=gen)[:size].tolist()
        lengths = torch.randint(1, 590, (size,), generator=gen)
        lengths[torch.rand(size, generator=gen) < 0.2] = 0
        pairs = zip(rows, lengths.tolist(), strict=True)
        q = torch.stack([pool.queries[r, max(n - 1, 0)] for r, n in pairs])
        out = pool.attend(rows, (lengths - 1)[:, None], q[:, None])[:, 0]
        for i, (row, length) in enumerate(zip(rows, lengths.tolist(), strict=True)):
            if length == 0:
                assert torch.equal(out[i], torch.zeros_like(out[i]))
            else:
                assert torch.equal(out[i], pool.alone(row, length - 1)), (rows, lengths)
        # A prefill chunk of one row: any start, any width, padding queries at the end.
        row = rows[0]
        end = int(torch.randint(1, 590, (), generator=gen))
        start = int(torch.randint(0, end, (), generator=gen))
        if torch.rand((), generator=gen) < 0.5:  # a short chunk: every query is checked
            start = max(0, end - int(torch.randint(1, 9, (), generator=gen)))
        width = end - start + int(torch.randint(0, 4, (), generator=gen))
        positions = torch.arange(start, start + width)
        positions[end - start :] = start
        out = pool.attend([row], positions[None], pool.queries[row, positions][None], tiled=True)
        for w in range(0, end - start, 1 if end - start <= 8 else 29):
            assert torch.equal(out[0, w], pool.alone(row, start + w)), (start, end, w)
        compositions += 2
    assert compositions == 120


def test_tiling_a_long_prefill_changes_no_bit() -> None:
    pool = Pool(3, 9)
    rows = [2, 5]
    positions = torch.stack([torch.arange(300, 300 + 2 * QUERY_TILE + 5)] * 2)
    positions[1, -7:] = 300  # the second row's chunk is shorter: padding queries
    q = torch.stack([pool.queries[r, positions[i]] for i, r in enumerate(rows)])
    tables = torch.cat([pool.tables[rows], torch.full((2, 3), 650)], 1)
    tiled = TiledAttention(tables, positions, pool.block_size, 9, 3)
    assert len(tiled.tiles) == 2 * 3
    whole = InvariantAttention(tables, positions, pool.block_size, 9, 3)
    assert torch.equal(tiled(q, pool.k, pool.v, 0.125), whole(q, pool.k, pool.v, 0.125))
    short = TiledAttention(tables, positions[:, :QUERY_TILE], pool.block_size, 9, 3)
    assert len(short.tiles) == 1


def test_it_is_the_attention_sdpa_computes() -> None:
    pool = Pool(3, 9)
    pool.k[0] = pool.v[0] = 0.0  # SDPA's path masks the slots past a row, not the scratch
    lengths = torch.tensor([1, 17, 64, 65, 300, 589])
    rows = list(range(len(lengths)))
    q = torch.stack([pool.queries[r, n - 1] for r, n in zip(rows, lengths.tolist(), strict=True)])
    ours = pool.attend(rows, (lengths - 1)[:, None], q[:, None])[:, 0]
    tables = pool.tables[rows].int()
    theirs = decode_attention(q, pool.k, pool.v, tables, lengths.int(), HEAD_DIM**-0.5)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_the_start_up_check_passes_here_and_fails_without_the_padded_query_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert batch_invariant_here(9, 3, 64, 16)
    if not remainder_multiplied_another_way():
        pytest.skip("this CPU's BLAS multiplies 1 to 3 rows as it does 4: no padding needed")
    monkeypatch.setattr(attention_cpu, "QUERY_ROWS", 1)  # decode's 3 rows: another kernel
    assert not batch_invariant_here.__wrapped__(9, 3, 64, 16)


def test_an_engine_warns_where_the_check_fails(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The torch forward's attention is checked; the C++ kernels' (engine/native.py),
    whose order is their code's, need not be."""
    native_built = native.kernels() is not None
    try:
        for native_on, holds in [(False, True), (False, False), (True, False)]:
            monkeypatch.setenv("WSINFER_NATIVE_CPU", "1" if native_on else "0")
            native.kernels.cache_clear()
            monkeypatch.setattr(core_module, "batch_invariant_here", lambda *s, holds=holds: holds)
            with structlog.testing.capture_logs() as logs:
                EngineCore(tiny)
            warned = [e for e in logs if "not batch-invariant" in e["event"]]
            expected = holds or (native_on and native_built)
            assert len(warned) == (0 if expected else 1), (native_on, holds)
    finally:
        monkeypatch.undo()
        native.kernels.cache_clear()


def test_a_chunk_size_the_blocks_do_not_divide_is_refused() -> None:
    with pytest.raises(ValueError, match="does not divide"):
        InvariantAttention(torch.zeros(1, 1), torch.zeros(1, 1, dtype=torch.long), 48, 2, 1)


# --- the engine ---------------------------------------------------------------------------


def int4_copy(fast: FastLlama) -> FastLlama:
    """``fast`` with every layer's linears as int4 groups and an int8 output layer, as the
    quantized GGUF path builds them (here from the float weights: the tiny model has
    no GGUF)."""
    model = copy.copy(fast)
    model.layers = [copy.copy(layer) for layer in fast.layers]
    for layer in model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(layer, name, _int4(getattr(layer, name)))
    head = fast.lm_head
    assert isinstance(head, Linear)
    model.lm_head = Int8Linear(head.matrix())
    return model


def _int4(linear: Linear) -> Int4Linear:
    weight = linear.matrix().float()
    rows, cols = weight.shape
    groups = weight.reshape(rows, cols // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    d = ((high - low) / 15).clamp(min=1e-8)
    codes = torch.round((groups - low[..., None]) / d[..., None]).clamp(0, 15)
    return Int4Linear(codes.reshape(rows, cols).int(), d, low + 8 * d)


@pytest.fixture
def quantized_tiny(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> LoadedModel:
    monkeypatch.setattr(core_module, "cpu_quantized_model", lambda _m, fast, _g: int4_copy(fast))
    return dataclasses.replace(tiny, gguf=Path("tiny.gguf"), eos_token_ids=set())


PROMPTS = [[1, 2, 3], list(range(5, 40)), list(range(100, 190)), [7] * 61, list(range(300, 317))]
SEEDED = GenerationParams(max_new_tokens=40, temperature=1.0, seed=7, logprobs=True)


def draws(loaded: LoadedModel, requests: list[tuple[str, list[int], list[int]]]) -> dict:
    """Each request's (tokens, log-probabilities) from one quantized core run together."""
    core = EngineCore(loaded, EngineConfig(max_batch_size=8, quantized_cpu_weights=True))
    assert isinstance(core.model.layers[0].qkv, Int4Linear)
    for rid, prompt, generated in requests:
        core.add(request(rid, prompt, SEEDED, generated_ids=generated))
    results = {}
    for rid, outputs in run_all(core).items():
        entries = [e for out in outputs for e in (out.logprobs or [])]
        results[rid] = (tokens_of(outputs), [e.logprob for e in entries])
    return results


def test_a_quantized_core_draws_the_same_bits_alone_batched_and_taken_over(
    quantized_tiny: LoadedModel,
) -> None:
    """bfloat16 at every layer's input rounds any last-bit difference up to a different
    logit: equal log-probabilities, float for float, mean equal attention."""
    together = draws(quantized_tiny, [(f"r{i}", p, []) for i, p in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        tokens, logprobs = together[f"r{i}"]
        assert len(tokens) == 40
        assert draws(quantized_tiny, [("alone", prompt, [])])["alone"] == (tokens, logprobs)
        for cut in (1, 13, 39):
            rebuilt = draws(quantized_tiny, [("t", prompt, tokens[:cut])])["t"]
            assert rebuilt == (tokens[cut:], logprobs[cut:]), (i, cut)
