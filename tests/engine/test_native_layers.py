"""The C++ layer stack (engine/native_layers.cpp, ``quant.layer_stack``): a model whose
linear layers all multiply GGUF blocks runs its layers in one call, with the very bits
of the layer program in Python (the same kernels in the same order), prefill and decode,
hidden states and the KV it stores; anything else keeps the Python program."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_native import _forward_twice, _tiny_model
from tests.engine.test_native_quant import random_q4_1, random_q8_0
from wsinfer.engine import native
from wsinfer.engine.llama import FastLlama
from wsinfer.engine.quant import BlockLinear, layer_stack

module = native.kernels()
pytestmark = pytest.mark.skipif(module is None, reason="the native kernels did not build here")


def _blocks_model(layers: int = 2) -> FastLlama:
    """The tiny model with every linear layer random Q4_1 blocks (one Q8_0), as the
    quantized core builds its layers from a GGUF."""
    model = _tiny_model(layers)
    seed = 0
    for layer in model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            old = getattr(layer, name)
            rows, cols = old.out_features, old.matrix().shape[1]
            seed += 1
            if name == "o" and seed == 2:  # a Q8_0 layer among the Q4_1 ones
                setattr(layer, name, BlockLinear("Q8_0", random_q8_0(rows, cols, seed)[0], cols))
            else:
                setattr(layer, name, BlockLinear("Q4_1", random_q4_1(rows, cols, seed), cols))
    return model


def test_the_stack_computes_the_layer_programs_very_bits() -> None:
    model = _blocks_model()
    stack = layer_stack(model)
    assert stack is not None
    in_python = _forward_twice(model)
    called = []

    class Spy:
        def forward(self, *args: torch.Tensor) -> torch.Tensor:
            called.append(len(args))
            return stack.forward(*args)

    model.layer_stack = Spy()
    in_one_call = _forward_twice(model)
    assert len(called) == 2  # the prefill and the decode step both ran through it
    for name, ours, theirs in zip(
        ["prefill", "decode", "k", "v"], in_one_call, in_python, strict=True
    ):
        assert torch.equal(ours, theirs), name


def test_a_model_with_any_other_linear_layer_keeps_the_python_program() -> None:
    assert layer_stack(_tiny_model(2)) is None  # float32 layers
    model = _blocks_model(2)
    model.layers[1].down = _tiny_model(2).layers[1].down
    assert layer_stack(model) is None


def _stack_args(model: FastLlama) -> dict:
    linears = [getattr(layer, n) for layer in model.layers for n in ("qkv", "o", "gate_up", "down")]
    norms = [w for layer in model.layers for w in (layer.norm_attn_in, layer.norm_mlp_in)]
    return dict(
        packed=[x.packed for x in linears], kinds=[x.kind for x in linears],
        norms=[*norms, model.norm], cos=[model.cos], sin=[model.sin],
        rope_of_layer=model.rope_of_layer, q_heads=model.num_heads, scale=model.scale,
        eps=model.eps,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kinds": ["Q5_K"] * 8}, "no kernel for Q5_K blocks"),
        ({"norms": []}, "two norms a layer"),
        ({"rope_of_layer": [0, 3]}, "names no rotary table"),
        ({"sin": []}, "rotary tables come in pairs"),
        ({"rope_of_layer": []}, "a stack of no layers"),
    ],
)
def test_a_stack_that_does_not_fit_is_refused_with_a_clear_error(change, message) -> None:
    args = _stack_args(_blocks_model(2)) | change
    with pytest.raises(RuntimeError, match=message):
        module.LayerStack(**args)


def test_pools_of_another_model_are_refused() -> None:
    model = _blocks_model(2)
    stack = module.LayerStack(**_stack_args(model))
    x = torch.zeros(1, 64)
    pool = torch.zeros(3, 4, 16, 2, 16)  # three layers' pools for a two-layer stack
    index = torch.zeros(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="pools .* of the stack's layers"):
        stack.forward(x, index, index, pool, pool, index.view(1, 1), index, index)
