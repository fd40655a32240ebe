"""The C++ linear layers over a GGUF's own Q4_1 and Q8_0 blocks (engine/native_quant.cpp,
``BlockLinear`` in engine/quant.py): exactly llama.cpp's arithmetic (int8 activations per
block of 32, integer products), close to the float matmul, each row's bits independent of
its company and of the threads, bad input refused with a clear error."""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.engine.test_quant import q4_1_rows
from wsinfer.engine import native, native_build
from wsinfer.engine.quant import BlockLinear, dequantize_q4_1

module = native.kernels()
pytestmark = pytest.mark.skipif(module is None, reason="the native kernels did not build here")

# 1 to 18 blocks of 32: whole groups of four blocks, and every size of a last group.
COLUMNS = [32, 64, 96, 128, 160, 576]


def q8_0_rows(codes: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Raw Q8_0 bytes for int8 ``codes`` [rows, cols] with per-block fp16 ``d``."""
    rows, cols = codes.shape
    head = d.astype(np.float16).view(np.uint8).reshape(rows, cols // 32, 2)
    body = codes.astype(np.int8).view(np.uint8).reshape(rows, cols // 32, 32)
    return np.concatenate([head, body], axis=-1).reshape(rows, -1)


def random_q4_1(rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, size=(rows, cols))
    d = rng.uniform(0.001, 0.02, size=(rows, cols // 32)).astype(np.float16)
    m = rng.uniform(-0.15, 0.0, size=(rows, cols // 32)).astype(np.float16)
    return q4_1_rows(codes, d, m)


def random_q8_0(rows: int, cols: int, seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """Raw rows (-128 included among the codes) and the float weight they hold."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(-128, 128, size=(rows, cols))
    d = rng.uniform(0.001, 0.02, size=(rows, cols // 32)).astype(np.float16)
    weight = codes.reshape(rows, -1, 32) * d.astype(np.float32)[..., None]
    return q8_0_rows(codes, d), torch.from_numpy(weight.reshape(rows, cols).astype(np.float32))


def quantized_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8 activations: per block of 32, scale = max|x| / 127 and code =
    x * (1 / scale) rounded to even, in float32 as the kernel computes them."""
    blocks = x.view(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = torch.round(blocks * inverse[..., None])
    return codes.double(), scale.double()


def q4_1_reference(x: torch.Tensor, raw: np.ndarray, cols: int) -> torch.Tensor:
    """sum over blocks of d * scale * (integer products) + m * sum(x), in float64."""
    blocks = raw.reshape(raw.shape[0], cols // 32, 20)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64))
    m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64))
    q = (dequantize_q4_1(raw, cols).double().view(raw.shape[0], -1, 32) - m[..., None]) / d[
        ..., None
    ]
    codes, scale = quantized_activations(x)
    products = torch.einsum("rbi,nbi->rnb", codes, q.round())
    sums = x.double().view(x.shape[0], -1, 32).sum(-1)
    return (products * d[None] * scale[:, None]).sum(-1) + sums @ m.t()


def test_q4_1_is_llama_cpps_arithmetic_and_close_to_the_float_matmul() -> None:
    for cols in COLUMNS:
        raw = random_q4_1(40, cols, cols)
        linear = BlockLinear("Q4_1", raw, cols)
        x = torch.randn(6, cols, generator=torch.Generator().manual_seed(cols))
        got = linear(x)
        assert got.dtype == torch.float32 and got.shape == (6, 40)
        exact = q4_1_reference(x, raw, cols)
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5, msg=f"{cols}")
        # int8 activations: within a percent or two of the float product.
        full = x.double() @ dequantize_q4_1(raw, cols).double().t()
        assert (got.double() - full).abs().max() < 0.02 * full.abs().max(), cols


def test_q8_0_is_llama_cpps_arithmetic_and_close_to_the_float_matmul() -> None:
    for cols in COLUMNS:
        raw, weight = random_q8_0(40, cols, cols)
        linear = BlockLinear("Q8_0", raw, cols)
        x = torch.randn(6, cols, generator=torch.Generator().manual_seed(cols))
        got = linear(x)
        codes, scale = quantized_activations(x)
        w_blocks = weight.double().view(40, -1, 32)
        exact = torch.einsum("rbi,nbi,rb->rn", codes, w_blocks, scale)
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5, msg=f"{cols}")
        full = x.double() @ weight.double().t()
        assert (got.double() - full).abs().max() < 0.02 * full.abs().max(), cols


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_a_rows_bits_do_not_depend_on_its_company_or_the_threads(kind: str) -> None:
    cols = 576
    raw = random_q4_1(300, cols, 1) if kind == "Q4_1" else random_q8_0(300, cols, 1)[0]
    linear = BlockLinear(kind, raw, cols)
    x = torch.randn(37, cols, generator=torch.Generator().manual_seed(2))
    full = linear(x)
    for rows in (1, 3, 4, 5, 17):  # tiles of four rows: whole, partial, several
        assert torch.equal(linear(x[:rows]), full[:rows]), rows
    assert torch.equal(linear(x[20:21]), full[20:21])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(linear(x), full)
    finally:
        torch.set_num_threads(threads)


def test_leading_dimensions_are_kept() -> None:
    linear = BlockLinear("Q4_1", random_q4_1(8, 64, 3), 64)
    x = torch.randn(2, 3, 64)
    assert torch.equal(linear(x), linear(x.reshape(6, 64)).view(2, 3, 8))


def test_a_zero_row_gives_zeros_and_a_nan_stays_in_its_row() -> None:
    for kind in ("Q4_1", "Q8_0"):
        raw = random_q4_1(16, 96, 4) if kind == "Q4_1" else random_q8_0(16, 96, 4)[0]
        linear = BlockLinear(kind, raw, 96)
        x = torch.randn(3, 96)
        x[0] = 0.0
        x[1, 40] = float("nan")
        got = linear(x)
        assert torch.all(got[0] == 0), kind
        assert torch.all(got[1].isnan()), kind
        assert torch.equal(got[2], linear(x[2:3])[0]), kind


def test_bad_input_is_refused_with_its_reason() -> None:
    assert module is not None
    packed = BlockLinear("Q4_1", random_q4_1(8, 64, 5), 64).packed
    cases = [
        (torch.randn(2, 96), packed, "rows hold 2 blocks of 32"),
        (torch.randn(2, 48), packed, "not whole blocks"),
        (torch.randn(2, 64, dtype=torch.float64), packed, "float32"),
        (torch.randn(64), packed, "float32 CPU tensor \\[rows, in\\]"),
        (torch.randn(2, 64), packed.to(torch.int8), "uint8"),
    ]
    for x, weight, message in cases:
        with pytest.raises(RuntimeError, match=message):
            module.q4_1_linear(x, weight)
    with pytest.raises(RuntimeError, match="not whole blocks of 20"):
        module.pack_q4_1(torch.zeros(4, 30, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="not whole blocks of 34"):
        module.pack_q8_0(torch.zeros(4, 40, dtype=torch.uint8))


def test_a_non_contiguous_input_is_multiplied_as_its_values() -> None:
    linear = BlockLinear("Q8_0", random_q8_0(8, 64, 6)[0], 64)
    wide = torch.randn(4, 128)
    assert torch.equal(linear(wide[:, ::2]), linear(wide[:, ::2].contiguous()))


@pytest.mark.slow  # the other variants' builds, ~30-60 s each
@pytest.mark.timeout(1200)
@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 instruction sets")
def test_every_variant_builds_and_those_this_cpu_runs_compute_what_its_own_does(
    tmp_path: Path,
) -> None:
    """Every x86 variant's branches (native_quant.cpp's #if), built here: those this CPU
    runs give the very bits of the engine's build where both have FMA (AVX-512 VNNI's
    dot products and AVX2's maddubs make the same integer sums, then the same float
    steps), the portable one (no FMA: a multiply and an add rounded apart) the same
    values to float32 rounding. The others (AVX-512 on an AVX2 machine) only build."""
    assert module is not None
    ours = next(v for v in native_build.X86_VARIANTS if module.__name__.startswith(
        f"wsinfer_native_{v.name}_"))  # fmt: skip
    runs = native_build.runnable(native_build.X86_VARIANTS, native_build.cpu_flags())
    builds = {}
    for variant in native_build.X86_VARIANTS:
        if variant != ours:
            path = native_build.build(tmp_path, variant)
            if variant in runs:
                builds[variant] = native_build.load(path)
    for cols in (32, 96, 160, 576):
        q4_1 = torch.from_numpy(random_q4_1(50, cols, cols))
        q8_0 = torch.from_numpy(random_q8_0(50, cols, cols)[0])
        x = torch.randn(9, cols, generator=torch.Generator().manual_seed(cols))
        want = (
            module.q4_1_linear(x, module.pack_q4_1(q4_1)),
            module.q8_0_linear(x, module.pack_q8_0(q8_0)),
        )
        for variant, build in builds.items():
            got = (
                build.q4_1_linear(x, build.pack_q4_1(q4_1)),
                build.q8_0_linear(x, build.pack_q8_0(q8_0)),
            )
            for theirs, mine in zip(got, want, strict=True):
                if "fma" in variant.requires and "fma" in ours.requires:
                    assert torch.equal(theirs, mine), (variant.name, cols)
                else:
                    torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-5)
    # A float16 KV cache: stored and widened by each variant's own instructions
    # (AVX-512's 16-wide, F16C's 8-wide, portable C++), attended as ours does.
    g = torch.Generator().manual_seed(9)
    qkv, cos, sin = torch.randn(40, 15 * 64, generator=g), torch.randn(64, 64), torch.randn(64, 64)
    positions, slots = torch.arange(40), torch.arange(40) + 3
    table, rows = torch.tensor([[0, 1, 2]]), torch.zeros(40, dtype=torch.long)
    outputs = {}
    for variant, build in [(ours, module), *builds.items()]:
        k, v = (torch.zeros(3, 16, 3, 64, dtype=torch.float16) for _ in range(2))
        q = build.rope_cache(qkv, positions, cos, sin, slots, k, v, 9)
        outputs[variant] = (k, v, build.paged_attention(q, k, v, table, rows, positions + 3, 0.125))
    for variant, got in outputs.items():
        assert torch.equal(got[1], outputs[ours][1]), variant.name  # v: a copy, rounded
        for theirs, mine in zip(got, outputs[ours], strict=True):
            if "fma" in variant.requires and "fma" in ours.requires:
                assert torch.equal(theirs, mine), variant.name
            else:  # the rotary's products rounded apart: a key may round to its neighbour
                torch.testing.assert_close(theirs.float(), mine.float(), rtol=2e-3, atol=1e-3)
