"""The GGUF's Q4_1 weights kept quantized (engine/quant.py): decoding, matmuls, the core."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import structlog
import torch

from tests.engine.conftest import run_all, tokens_of
from tests.engine.test_core import request
from wsinfer.engine import native
from wsinfer.engine.core import EngineConfig, EngineCore
from wsinfer.engine.llama import fast_model_for
from wsinfer.engine.model import LoadedModel
from wsinfer.engine.prompts import render_chat
from wsinfer.engine.quant import (
    BlockLinear,
    GgufTensors,
    Int4Linear,
    Int8Linear,
    QuantError,
    _output_layer,
    cpu_quantized_model,
    dequantize_q4_1,
    int4_linear,
    q4_1_parts,
    quantized_model,
    unpermute_rows,
)
from wsinfer.sessions.schema import GenerationParams


def q4_1_rows(codes: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Raw Q4_1 bytes for ``codes`` [rows, cols] (0..15) with per-block ``d`` and ``m``."""
    rows, cols = codes.shape
    blocks = codes.reshape(rows, cols // 32, 32).astype(np.uint8)
    nibbles = blocks[..., :16] | (blocks[..., 16:] << 4)
    head = np.stack([d.astype(np.float16), m.astype(np.float16)], axis=-1).view(np.uint8)
    return np.concatenate([head.reshape(rows, cols // 32, 4), nibbles], axis=-1).reshape(rows, -1)


@pytest.fixture
def blocks() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(48, 96))
    d = rng.uniform(0.001, 0.02, size=(48, 3)).astype(np.float16)
    m = rng.uniform(-0.2, 0.0, size=(48, 3)).astype(np.float16)
    return codes, d, m


def test_q4_1_blocks_decode_as_d_times_q_plus_m(blocks: tuple[np.ndarray, ...]) -> None:
    codes, d, m = blocks
    raw = q4_1_rows(codes, d, m)
    assert raw.shape == (48, 3 * 20)
    expected = codes.reshape(48, 3, 32) * d[..., None].astype(np.float32) + m[..., None]
    got = dequantize_q4_1(raw, 96)
    assert torch.equal(got, torch.from_numpy(expected.reshape(48, 96).astype(np.float32)))
    parsed, _, _ = q4_1_parts(raw, 96)
    assert torch.equal(parsed, torch.from_numpy(codes.astype(np.int32)))


def test_q4_1_rows_must_be_whole_blocks(blocks: tuple[np.ndarray, ...]) -> None:
    with pytest.raises(QuantError, match="whole blocks"):
        q4_1_parts(q4_1_rows(*blocks), 90)


def test_int4_linear_is_the_dequantized_matmul(blocks: tuple[np.ndarray, ...]) -> None:
    raw = q4_1_rows(*blocks)
    linear = int4_linear([q4_1_parts(raw, 96)])
    x = torch.randn(5, 96)
    expected = x @ dequantize_q4_1(raw, 96).t()
    got = linear(x)
    assert got.dtype == torch.float32
    # bfloat16 activations and scales: about 3 significant digits.
    torch.testing.assert_close(got, expected, rtol=0.02, atol=0.02 * expected.abs().max().item())


def test_quantized_rows_do_not_depend_on_the_batch(blocks: tuple[np.ndarray, ...]) -> None:
    """Bit for bit: a row's logits (so its seeded draws) are the same at any batch size."""
    linear = int4_linear([q4_1_parts(q4_1_rows(*blocks), 96)])
    x = torch.randn(33, 96)
    full = linear(x)
    for rows in (1, 2, 8, 17):
        assert torch.equal(linear(x[:rows]), full[:rows])


def test_int8_linear_is_the_matmul_with_its_per_row_scales() -> None:
    """Codes times row scales give back the weight to half a step; the product is the
    float matmul of those de-quantized rows up to bfloat16 activations and output."""
    torch.manual_seed(0)
    weight = torch.randn(64, 96) * torch.linspace(0.01, 2.0, 64)[:, None]
    weight[5] = 0.0  # an all-zero row must not divide by zero
    linear = Int8Linear(weight)
    scales = linear.scales.float()[:, None]
    restored = linear.codes.float() * scales
    assert torch.all((restored - weight).abs() <= scales * (0.5 + 2**-6))
    assert linear.codes.abs().max() == 127
    x = torch.randn(8, 96)
    expected = x.bfloat16().float() @ restored.t()
    got = linear(x)
    assert got.dtype == torch.float32 and got.shape == (8, 64)
    assert torch.allclose(got, expected, rtol=2**-7, atol=1e-3)
    assert torch.all(got[:, 5] == 0)


def test_int8_rows_do_not_depend_on_the_batch() -> None:
    torch.manual_seed(1)
    linear = Int8Linear(torch.randn(4096, 576))
    x = torch.randn(16, 576)
    batched = linear(x)
    for row in (0, 7, 15):
        assert torch.equal(linear(x[row : row + 1]), batched[row : row + 1])


def test_unpermute_rows_is_transformers_reverse_permute() -> None:
    rows = np.arange(12 * 2).reshape(12, 2)
    # 2 heads of 6 rows: llama.cpp interleaves each head's two rotary halves.
    got = unpermute_rows(rows, 2)
    assert got[:6, 0].tolist() == [0, 4, 8, 2, 6, 10]


def test_int4_linear_rejects_codes_out_of_groups() -> None:
    with pytest.raises(RuntimeError):
        Int4Linear(torch.zeros(8, 40, dtype=torch.int32), torch.ones(8, 1), torch.zeros(8, 1))


# --- the real model ----------------------------------------------------------------------


def test_the_gguf_blocks_are_the_converted_models_weights(smol: LoadedModel) -> None:
    """q/k rows re-ordered as transformers does: the same float32 values, exactly."""
    assert smol.gguf is not None
    tensors = GgufTensors(smol.gguf)
    attn, mlp = smol.model.model.layers[7].self_attn, smol.model.model.layers[7].mlp
    cases = [
        ("attn_q", attn.q_proj, 9),
        ("attn_k", attn.k_proj, 3),
        ("ffn_down", mlp.down_proj, None),
    ]
    for name, module, heads in cases:
        codes, d, m = tensors.q4_1(f"blk.7.{name}.weight", heads)
        got = (codes.view(codes.shape[0], -1, 32) * d[..., None] + m[..., None]).flatten(1)
        assert torch.equal(got, module.weight.detach()), name


@pytest.mark.skipif(native.kernels() is None, reason="the native kernels did not build here")
def test_an_output_layer_the_blocks_cannot_take_is_re_quantized_to_int8(
    tiny: LoadedModel,
) -> None:
    """The file's output layer is used as it is only when it is Q8_0 of the model's
    shape; any other type or shape falls back to the float one as int8 per row."""
    fast = fast_model_for(tiny.model, 64, True)
    vocab, hidden = fast.lm_head.matrix().shape  # type: ignore[attr-defined]

    class Tensors:
        def __init__(self, kind: str, rows: int) -> None:
            self.kind_of, self.rows_of = kind, rows

        def kind(self, name: str) -> str | None:
            return self.kind_of if name == "token_embd.weight" else None

        def rows(self, name: str, kind: str) -> tuple[np.ndarray, int]:
            return np.zeros((self.rows_of, hidden // 32 * 34), np.uint8), hidden

    fits = _output_layer(fast, Tensors("Q8_0", vocab), True)  # type: ignore[arg-type]
    assert isinstance(fits, BlockLinear) and fits.kind == "Q8_0"
    for kind, rows in (("Q6_K", vocab), ("Q8_0", vocab - 1)):
        head = _output_layer(fast, Tensors(kind, rows), True)  # type: ignore[arg-type]
        assert isinstance(head, Int8Linear), (kind, rows)
    assert isinstance(_output_layer(fast, Tensors("Q8_0", vocab), False), Int8Linear)  # type: ignore[arg-type]


def test_a_gguf_that_does_not_fit_the_model_is_refused(
    tiny: LoadedModel, smol: LoadedModel
) -> None:
    assert smol.gguf is not None
    fast = fast_model_for(tiny.model, 64, True)
    with pytest.raises(QuantError, match="do not match"):
        quantized_model(fast, smol.gguf)


def test_a_core_falls_back_to_float32_when_the_gguf_does_not_fit(
    tiny: LoadedModel, smol: LoadedModel
) -> None:
    mismatched = dataclasses.replace(tiny, gguf=smol.gguf)
    core = EngineCore(mismatched, EngineConfig(quantized_cpu_weights=True))
    assert core.model is fast_model_for(tiny.model, core.max_context, True)
    core.add(request("a", [1, 2, 3], GenerationParams(max_new_tokens=3)))
    assert len(tokens_of(run_all(core)["a"])) == 3


def test_quantized_weights_are_the_default_and_float32_is_one_flag_away(
    smol: LoadedModel,
) -> None:
    assert not isinstance(
        EngineCore(smol, EngineConfig(quantized_cpu_weights=False)).model.layers[0].qkv,
        (Int4Linear, BlockLinear),
    )
    quant = EngineCore(smol)
    head = quant.model.lm_head
    if native.kernels() is not None:  # the file's own blocks, the output layer's Q8_0 too
        assert all(
            isinstance(layer.qkv, BlockLinear) and layer.qkv.kind == "Q4_1"
            for layer in quant.model.layers
        )
        assert isinstance(head, BlockLinear) and head.kind == "Q8_0"
    else:
        assert all(isinstance(layer.qkv, Int4Linear) for layer in quant.model.layers)
        assert isinstance(head, Int8Linear)
    assert (head.out_features, head.in_features) == (smol.model.config.vocab_size, 576)


@pytest.mark.skipif(native.kernels() is None, reason="the native kernels did not build here")
def test_the_native_blocks_and_torchs_int4_kernel_multiply_alike(smol: LoadedModel) -> None:
    """The same file through either kernel set: every linear of a layer, and the output
    layer, within a couple of percent of each other (both quantize the activations:
    int8 per block natively, bfloat16 in torch's kernels)."""
    assert smol.gguf is not None
    fast = fast_model_for(smol.model, 64, True)
    blocks, torch_kernels = (
        quantized_model(fast, smol.gguf, True),
        quantized_model(fast, smol.gguf, False),
    )
    pairs = [
        (getattr(blocks.layers[3], n), getattr(torch_kernels.layers[3], n))
        for n in ("qkv", "o", "gate_up", "down")
    ]
    pairs.append((blocks.lm_head, torch_kernels.lm_head))
    generator = torch.Generator().manual_seed(0)
    for ours, theirs in pairs:
        assert isinstance(ours, BlockLinear) and not isinstance(theirs, BlockLinear)
        x = torch.randn(3, ours.in_features, generator=generator)
        a, b = ours(x), theirs(x)
        assert (a - b).abs().max() < 0.03 * b.abs().max(), ours.kind


QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a child.",
    "List three prime numbers.",
]


def test_the_quantized_core_draws_the_same_tokens_alone_batched_and_taken_over(
    smol: LoadedModel,
) -> None:
    """The real model in the default (quantized) format: seeded turns draw the same tokens and
    log-probabilities, float for float, run alone or four together, and a core rebuilt
    from a turn's token log part-way goes on with the very tokens (the KV it recomputes
    by prefill is the KV decode wrote). bfloat16 at every layer's input would round up
    any difference in attention's last bit (engine/attention_cpu.py)."""
    no_eos = dataclasses.replace(smol, eos_token_ids=set())
    config = EngineConfig(max_batch_size=4)
    seeded = GenerationParams(max_new_tokens=48, temperature=0.8, seed=11, logprobs=True)
    prompts = [render_chat(smol.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]

    def run(requests: list[tuple[str, list[int], list[int]]]) -> dict[str, tuple[list, list]]:
        core = EngineCore(no_eos, config)
        for rid, prompt, generated in requests:
            core.add(request(rid, prompt, seeded, generated_ids=generated))
        return {
            rid: (tokens_of(outs), [e.logprob for o in outs for e in o.logprobs])
            for rid, outs in run_all(core).items()
        }

    together = run([(f"r{i}", p, []) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        tokens, logprobs = together[f"r{i}"]
        assert run([("a", prompt, [])])["a"] == (tokens, logprobs), f"turn {i} alone"
        for cut in (5, 29):
            rebuilt = run([("t", prompt, tokens[:cut])])["t"]
            assert rebuilt == (tokens[cut:], logprobs[cut:]), f"turn {i} from token {cut}"


def test_the_quantized_core_knows_the_capital_of_france(smol: LoadedModel) -> None:
    ids = render_chat(
        smol.tokenizer, [{"role": "user", "content": "What is the capital of France?"}]
    )
    core = EngineCore(smol)
    core.add(request("a", ids, GenerationParams(max_new_tokens=16, temperature=0.0)))
    assert "Paris" in smol.tokenizer.decode(tokens_of(run_all(core)["a"]))


def test_an_engine_says_its_cpu_weights_are_quantized(smol: LoadedModel) -> None:
    assert smol.gguf is not None
    fast = fast_model_for(smol.model, 64, True)
    with structlog.testing.capture_logs() as logs:
        cpu_quantized_model(types.SimpleNamespace(), fast, smol.gguf)  # not cached there
    said = [e for e in logs if e["event"] == "quantized CPU weights"]
    assert said == [
        {
            "event": "quantized CPU weights",
            "log_level": "info",
            "file": smol.gguf.name,
            "q4_1_layers": 30,
            "output_layer": "Q8_0" if native.kernels() is not None else "int8",
            "kernels": "native" if native.kernels() is not None else "torch",
        }
    ]
