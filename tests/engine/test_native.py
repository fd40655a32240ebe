"""The C++ CPU kernels (engine/native.py): each against the torch ops it replaces,
each token's bits independent of its company, bad input refused with a clear
error, and the torch forward kept where the kernels cannot be built."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from wsinfer.engine import native
from wsinfer.engine.batch import PrefillPiece
from wsinfer.engine.kvpool import KVPool
from wsinfer.engine.llama import FastLlama, rotary
from wsinfer.engine.runner import DecodeContext, PrefillContext

module = native.kernels()
pytestmark = pytest.mark.skipif(module is None, reason="the native kernels did not build here")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_add_rms_norm_matches_torch() -> None:
    g = _gen()
    x, residual = torch.randn(5, 576, generator=g), torch.randn(5, 576, generator=g)
    weight = torch.rand(576, generator=g) + 0.5
    total, normed = module.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, x + residual)
    torch.testing.assert_close(normed, F.rms_norm(x + residual, (576,), weight, 1e-5))
    alone, normed_alone = module.add_rms_norm(x, None, weight, 1e-5)
    assert torch.equal(alone, x)
    torch.testing.assert_close(normed_alone, F.rms_norm(x, (576,), weight, 1e-5))


def test_silu_mul_matches_torch() -> None:
    gate_up = torch.randn(3, 2 * 1536, generator=_gen()) * 6
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(module.silu_mul(gate_up), F.silu(gate) * up)


def test_rope_cache_rotates_q_and_k_and_stores_k_and_v() -> None:
    g = _gen()
    q_heads, kv_heads, dim, n = 9, 3, 64, 4
    qkv = torch.randn(n, (q_heads + 2 * kv_heads) * dim, generator=g)
    cos, sin = torch.randn(50, dim, generator=g), torch.randn(50, dim, generator=g)
    positions = torch.tensor([0, 7, 49, 3])
    slots = torch.tensor([5, 0, 17, -1])  # the last stores nothing
    k_cache = torch.full((3, 8, kv_heads, dim), math.nan)
    v_cache = torch.full((3, 8, kv_heads, dim), math.nan)
    q = module.rope_cache(qkv, positions, cos, sin, slots, k_cache, v_cache, q_heads)
    heads = qkv.view(n, -1, dim)
    turned = rotary(heads, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    torch.testing.assert_close(q, turned[:, :q_heads])
    flat_k, flat_v = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    for row, slot in enumerate(slots.tolist()[:3]):
        torch.testing.assert_close(flat_k[slot], turned[row, q_heads : q_heads + kv_heads])
        assert torch.equal(flat_v[slot], heads[row, q_heads + kv_heads :])
    written = {5, 0, 17}
    untouched = [s for s in range(24) if s not in written]
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


def _pool(blocks: int, block_size: int, kv_heads: int, dim: int, seed: int = 1):
    g = _gen(seed)
    k = torch.randn(blocks, block_size, kv_heads, dim, generator=g)
    v = torch.randn(blocks, block_size, kv_heads, dim, generator=g)
    return k, v


def _reference(q, k, v, table, position, scale):
    """One token's attention by SDPA over its row's keys 0..position (float64)."""
    block_size, kv_heads, dim = k.shape[1:]
    keys = k[table].reshape(-1, kv_heads, dim)[: position + 1].double()
    values = v[table].reshape(-1, kv_heads, dim)[: position + 1].double()
    group = q.shape[0] // kv_heads
    keys = keys.repeat_interleave(group, 1).transpose(0, 1)
    values = values.repeat_interleave(group, 1).transpose(0, 1)
    out = F.scaled_dot_product_attention(q.double()[:, None], keys, values, scale=scale)
    return out[:, 0].float()


def test_paged_attention_matches_sdpa_and_never_reads_unseen_slots() -> None:
    q_heads, kv_heads, dim, bs = 9, 3, 64, 16
    k, v = _pool(12, bs, kv_heads, dim)
    tables = torch.tensor([[3, 7, 1, 0, 5], [2, 9, 11, 4, 6]])
    positions = [0, 15, 16, 40, 63]
    # Slots past what any query sees hold NaN: they must not reach an output.
    k[5:7], v[5:7] = math.nan, math.nan
    q = torch.randn(len(positions) * 2, q_heads, dim, generator=_gen(2))
    rows = torch.tensor([r for r in (0, 1) for _ in positions])
    query_pos = torch.tensor(positions * 2)
    out = module.paged_attention(q, k, v, tables, rows, query_pos, 0.125)
    assert not out.isnan().any()
    for t in range(len(rows)):
        expected = _reference(q[t], k, v, tables[rows[t]], int(query_pos[t]), 0.125)
        torch.testing.assert_close(out[t], expected, rtol=1e-5, atol=1e-5)


def test_a_negative_position_attends_to_nothing() -> None:
    k, v = _pool(4, 16, 2, 32)
    q = torch.randn(2, 4, 32, generator=_gen())
    out = module.paged_attention(
        q, k, v, torch.tensor([[1, 2]]), torch.tensor([0, 0]), torch.tensor([-1, 5]), 0.2
    )
    assert torch.equal(out[0], torch.zeros(4, 32)) and out[1].abs().sum() > 0


@pytest.mark.parametrize("dim", [64, 40, 8])  # whole chunks of 16 dims, a short last one, less
def test_a_tokens_attention_is_the_same_bits_in_any_company(dim: int) -> None:
    """Decode alone, decode in a ragged batch, and inside a prefill of its prompt:
    each query's output equal bit for bit (the takeover promise's attention half)."""
    q_heads, kv_heads, bs = 9, 3, 16
    k, v = _pool(40, bs, kv_heads, dim, seed=3)
    tables = torch.arange(1, 41).view(4, 10).remainder(40)
    q = torch.randn(4, 160, q_heads, dim, generator=_gen(4))

    def run(rows: list[int], positions: list[int]) -> torch.Tensor:
        queries = torch.stack([q[r, p] for r, p in zip(rows, positions, strict=True)])
        return module.paged_attention(
            queries, k, v, tables, torch.tensor(rows), torch.tensor(positions), 0.125
        )

    alone = {(r, p): run([r], [p])[0] for r, p in [(0, 0), (1, 159), (2, 64), (3, 17)]}
    batched = run([0, 1, 2, 3], [0, 159, 64, 17])
    for i, key in enumerate([(0, 0), (1, 159), (2, 64), (3, 17)]):
        assert torch.equal(batched[i], alone[key])
    prompt = run([1] * 160, list(range(160)))  # a whole prompt, many threads' tasks
    assert torch.equal(prompt[159], alone[(1, 159)])
    chunk = run([2] * 40, list(range(40, 80)))  # a later chunk of another prompt
    assert torch.equal(chunk[64 - 40], alone[(2, 64)])


def test_a_float16_cache_stores_the_rounded_values_a_float32_cache_holds() -> None:
    g = _gen(6)
    q_heads, kv_heads, dim, n = 9, 3, 64, 5
    qkv = torch.randn(n, (q_heads + 2 * kv_heads) * dim, generator=g) * 3
    qkv[0, -1] = 70000.0  # past float16's range: stored as inf, as torch rounds it
    cos, sin = torch.randn(50, dim, generator=g), torch.randn(50, dim, generator=g)
    positions, slots = torch.tensor([0, 7, 49, 3, 9]), torch.tensor([5, 0, 17, -1, 23])
    caches = {}
    for dtype in (torch.float32, torch.float16):
        k, v = (
            torch.zeros(3, 8, kv_heads, dim, dtype=dtype),
            torch.zeros(3, 8, kv_heads, dim, dtype=dtype),
        )
        caches[dtype] = (module.rope_cache(qkv, positions, cos, sin, slots, k, v, q_heads), k, v)
    (q32, k32, v32), (q16, k16, v16) = caches[torch.float32], caches[torch.float16]
    assert torch.equal(q16, q32)  # q stays float32
    assert torch.equal(k16, k32.half()) and torch.equal(v16, v32.half())  # round to nearest even
    assert v16.view(-1, kv_heads, dim)[5, -1, -1].isinf()


@pytest.mark.parametrize("dim", [64, 40, 8])
def test_float16_caches_attend_as_float32_caches_holding_the_same_values(dim: int) -> None:
    """Widening is exact, so the bits are those of a float32 cache of the rounded
    values: alone, batched, in a prefill's tiles (the takeover promise holds)."""
    q_heads, kv_heads, bs = 9, 3, 16
    k, v = _pool(40, bs, kv_heads, dim, seed=7)
    k16, v16 = k.half(), v.half()
    k32, v32 = k16.float(), v16.float()
    tables = torch.arange(1, 41).view(4, 10).remainder(40)
    q = torch.randn(4, 160, q_heads, dim, generator=_gen(8))

    def run(caches: tuple[torch.Tensor, torch.Tensor], rows: list[int], positions: list[int]):
        queries = torch.stack([q[r, p] for r, p in zip(rows, positions, strict=True)])
        return module.paged_attention(
            queries, *caches, tables, torch.tensor(rows), torch.tensor(positions), 0.125
        )

    for rows, positions in [
        ([1], [159]),
        ([0, 1, 2, 3], [0, 159, 64, 17]),
        ([1] * 160, list(range(160))),
    ]:
        assert torch.equal(run((k16, v16), rows, positions), run((k32, v32), rows, positions))


def test_a_float16_key_cache_needs_a_float16_value_cache() -> None:
    k, v = _pool(4, 16, 2, 32)
    q = torch.randn(1, 4, 32, generator=_gen())
    with pytest.raises(RuntimeError, match="caches do not match"):
        module.paged_attention(
            q, k.half(), v, torch.tensor([[1, 2]]), torch.tensor([0]), torch.tensor([5]), 0.2
        )
    with pytest.raises(RuntimeError, match="float32 or float16"):
        module.paged_attention(
            q,
            k.double(),
            v.double(),
            torch.tensor([[1, 2]]),
            torch.tensor([0]),
            torch.tensor([5]),
            0.2,
        )


def test_rows_are_the_same_bits_in_any_batch() -> None:
    g = _gen(5)
    x, res = torch.randn(8, 576, generator=g), torch.randn(8, 576, generator=g)
    weight = torch.rand(576, generator=g)
    _, batched = module.add_rms_norm(x, res, weight, 1e-5)
    gate_up = torch.randn(40, 3072, generator=g)
    mlp = module.silu_mul(gate_up)
    for r in range(8):
        assert torch.equal(
            module.add_rms_norm(x[r : r + 1], res[r : r + 1], weight, 1e-5)[1][0], batched[r]
        )
    for r in (0, 17, 39):
        assert torch.equal(module.silu_mul(gate_up[r : r + 1])[0], mlp[r])


def test_inputs_of_any_layout_are_read_as_their_values() -> None:
    """Views (a column slice, a transpose) give the same bits as their contiguous
    copies: the kernels copy an input that is not contiguous."""
    g = _gen(4)
    wide = torch.randn(6, 2 * 576, generator=g)
    x, res, weight = wide[:, ::2], torch.randn(6, 576, generator=g), torch.rand(576, generator=g)
    assert not x.is_contiguous()
    for got, want in zip(
        module.add_rms_norm(x, res, weight, 1e-5),
        module.add_rms_norm(x.contiguous(), res, weight, 1e-5),
        strict=True,
    ):
        assert torch.equal(got, want)
    gate_up = torch.randn(3072, 5, generator=g).t()
    assert torch.equal(module.silu_mul(gate_up), module.silu_mul(gate_up.contiguous()))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: module.silu_mul(torch.randn(2, 3)), "gate_up must be"),
        (lambda: module.silu_mul(torch.randn(2, 4, dtype=torch.float64)), "float32"),
        (lambda: module.add_rms_norm(torch.randn(2, 8), None, torch.ones(4), 1e-5), "do not fit"),
        (
            lambda: module.rope_cache(
                torch.randn(1, 5 * 8),
                torch.tensor([99]),
                torch.ones(10, 8),
                torch.ones(10, 8),
                torch.tensor([0]),
                torch.zeros(2, 4, 1, 8),
                torch.zeros(2, 4, 1, 8),
                3,
            ),
            "outside the rotary table",
        ),
        (
            lambda: module.rope_cache(
                torch.randn(1, 5 * 8),
                torch.tensor([0]),
                torch.ones(10, 8),
                torch.ones(10, 8),
                torch.tensor([8]),
                torch.zeros(2, 4, 1, 8),
                torch.zeros(2, 4, 1, 8),
                3,
            ),
            "outside the cache",
        ),
        (
            lambda: module.paged_attention(
                torch.randn(1, 2, 8),
                torch.zeros(2, 4, 1, 8),
                torch.zeros(2, 4, 1, 8),
                torch.tensor([[0, 5]]),
                torch.tensor([0]),
                torch.tensor([6]),
                1.0,
            ),
            "outside the cache",
        ),
        (
            lambda: module.paged_attention(
                torch.randn(1, 2, 8),
                torch.zeros(2, 4, 1, 8),
                torch.zeros(2, 4, 1, 8),
                torch.tensor([[0, 1]]),
                torch.tensor([0]),
                torch.tensor([8]),
                1.0,
            ),
            "past the row's table",
        ),
    ],
)
def test_bad_input_is_refused_with_a_clear_error(call, message) -> None:
    with pytest.raises(RuntimeError, match=message):
        call()


def test_the_torch_forward_stays_where_the_kernels_cannot_be_built(monkeypatch) -> None:
    def broken() -> None:
        raise RuntimeError("no compiler here")

    native.kernels.cache_clear()
    try:
        monkeypatch.setattr(native, "_build", broken)
        assert native.kernels() is None
        assert not native.on_native_path(torch.zeros(1))
        native.kernels.cache_clear()
        monkeypatch.setenv("WSINFER_NATIVE_CPU", "0")
        assert native.kernels() is None
    finally:
        native.kernels.cache_clear()
        monkeypatch.undo()
    assert native.kernels() is not None and native.on_native_path(torch.zeros(1))
    assert not native.on_native_path(torch.zeros(1, dtype=torch.bfloat16))


def _forward_twice(model) -> list[torch.Tensor]:
    """A prefill of two rows, then a decode step of both: hidden states and the KV."""
    pieces = [PrefillPiece(None, list(range(3, 24)), [1, 2], 0, 21),
              PrefillPiece(None, [7, 8, 9], [3], 0, 3)]  # fmt: skip
    pool = KVPool(2, 5, 16, 2, 16, torch.float32, torch.device("cpu"))
    pool.k.zero_(), pool.v.zero_()
    with torch.inference_mode():
        prefill = PrefillContext(pool, pieces, model.scale)
        ids = torch.tensor([t for p in pieces for t in p.tokens])
        hidden = [model.forward(ids, prefill.positions, prefill)]
        tables = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
        slots, lens = torch.tensor([37, 51]), torch.tensor([22, 4], dtype=torch.int32)
        decode = DecodeContext(pool, slots, tables, lens, model.scale, None)
        hidden.append(model.forward(torch.tensor([11, 12]), lens.long() - 1, decode))
        on_native = native.kernels() is not None
        assert (prefill.kernel_rows is not None) == (decode.kernel_rows is not None) == on_native
    return [*hidden, pool.k.clone(), pool.v.clone()]


def _tiny_model(layers: int) -> FastLlama:
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.inference_mode():
        for name, weight in model.named_parameters():
            if "norm" in name:  # not all ones: a norm applied in the wrong place shows
                weight.normal_(1.0, 0.3)
        return FastLlama(model, 256, transposed=True)


def test_the_native_forward_computes_what_the_torch_forward_does(monkeypatch) -> None:
    model = _tiny_model(2)
    with_kernels = _forward_twice(model)
    native.kernels.cache_clear()
    monkeypatch.setenv("WSINFER_NATIVE_CPU", "0")
    try:
        with_torch = _forward_twice(model)
    finally:
        monkeypatch.undo()
        native.kernels.cache_clear()
    for name, ours, theirs in zip(
        ["prefill", "decode", "k", "v"], with_kernels, with_torch, strict=True
    ):
        torch.testing.assert_close(ours, theirs, msg=lambda m, name=name: f"{name}: {m}")
    assert native.kernels() is not None
