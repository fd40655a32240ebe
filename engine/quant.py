"""The GGUF's quantized weights, kept quantized, for the CPU decode step.

transformers de-quantizes a GGUF to float32 at load: SmolLM2-135M's Q4_1 file
becomes ~0.54 GB that every decode step streams from memory, 6.4x what the file
holds. A CPU step at batch 1-32 is bound by those bytes, so here the linear
layers read the file's own blocks again and multiply with torch's int4
weight-only CPU kernel (``_weight_int4pack_mm_for_cpu``, groups of 32 along the
input, one scale and zero per group and output row: Q4_1's layout exactly).

Q4_1 block (32 weights, 20 bytes): fp16 ``d``, fp16 ``m``, 16 bytes of nibbles
(low nibbles: weights 0-15, high nibbles: 16-31); weight = d * q + m. The int4
kernel computes (q - 8) * scale + zero, so scale = d and zero = m + 8 d.

The kernel is fast only with bfloat16 activations (AVX-512 BF16 / AMX); the
residual stream, norms, attention and the KV cache stay float32, and only a
linear layer's input and output pass through bfloat16. That changes logits in
their last bits, so tokens can differ from the float32 path where two candidates
are nearly tied; every engine running the same weight format draws the same
tokens (prefill, decode and a takeover all use these layers).

The output layer (SmolLM2's is the tied Q8_0 token embedding: 32 weights per fp16
scale) is a 576 x 49152 matrix, the largest single read of a step: in float32 it
was a third of a one-stream step. torch has no int8 kernel with per-group scales,
so it is re-quantized to int8 with one scale per output row and multiplied by
``_weight_int8pack_mm`` (bfloat16 activations): a quarter of the bytes, 2.5x
faster at one row and 3x at eight. Measured against the float32 model over 207
positions of prose and code, the mean KL divergence of the next-token
distribution is 0.0019 nats with it (0.0003 with a float32 output layer) and the
top token agrees at 97.6% of positions (98.1%). The embedding lookup keeps the
float32 table (one row a token).

Where the C++ kernels load (``engine/native.py``: built, not turned off),
the layers multiply the file's blocks with them instead (``BlockLinear``,
``engine/native_quant.cpp``), as llama.cpp does: each activation row is quantized
to int8 per block of 32 inputs (one float scale a block) and each block's products
are summed as integers, with AVX-512 VNNI or AVX2 where the CPU has them. The
output layer keeps the file's own Q8_0 blocks (no re-quantization). Integer sums
are exact and the float arithmetic per block is fixed by the code, so a row's
logits are the same bits at any batch size, as with the torch kernels. The int8
activations cost accuracy, as they do in llama.cpp: against the float32 model
(``bench_weight_formats.py``, 207 positions) the mean KL divergence is 0.0156
nats and the top token agrees at 92.9% of positions, where torch's kernels give
0.0016 and 97.1%. Nearly all of it is the layers' activations: the Q8_0 output
layer alone costs 0.0008 (the per-row int8 one 0.0016). In return, 1.2x to 1.6x
the decode tok/s of torch's kernels at 1 to 32 streams (``bench_cpu_kernels.py``,
two runs on one machine).

Other tensor types keep the float32 path.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

from . import native
from .llama import FastLlama, Linear

GROUP = 32  # weights per Q4_1 block, and the int4 kernel's group size
_Q4_1_BYTES = 20

log = structlog.get_logger("wsinfer.engine.quant")


class QuantError(ValueError):
    """The GGUF file does not hold what the model's layers need."""


class Int4Linear:
    """``x @ W^T`` with W as int4 groups (bias-free); float32 in, float32 out."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        """``codes`` int32 [out, in] in 0..15; ``scales`` / ``zeros`` float32 [out, in / 32]."""
        self.out_features, self.in_features = codes.shape
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        # The kernel wants [in / 32, out, 2], in the activations' dtype.
        pair = torch.stack([scales.t(), zeros.t()], dim=-1)
        self.scales_zeros = pair.to(torch.bfloat16).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), self.packed, GROUP, self.scales_zeros
        )
        return out.to(x.dtype)

    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes


class Int8Linear:
    """``x @ W^T`` with W as int8, one scale per output row; float32 in, float32 out."""

    def __init__(self, weight: torch.Tensor) -> None:
        """``weight`` float [out, in], re-quantized symmetrically per row."""
        self.out_features, self.in_features = weight.shape
        largest = weight.float().abs().amax(dim=1)
        # The kernel takes the scales in the activations' dtype: round them first and
        # code against the rounded ones, so each weight is off by half a step at most.
        self.scales = (largest / 127).clamp(min=2**-100).to(torch.bfloat16)
        codes = torch.round(weight.float() / self.scales.float()[:, None]).clamp(-127, 127)
        self.codes = codes.to(torch.int8).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.codes, self.scales)
        return out.to(x.dtype)

    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes


class BlockLinear:
    """``x @ W^T`` over a GGUF's own Q4_1 or Q8_0 rows, by the C++ kernels (int8
    activations per block of 32, integer products); float32 in, float32 out."""

    KINDS = {"Q4_1": ("pack_q4_1", "q4_1_linear"), "Q8_0": ("pack_q8_0", "q8_0_linear")}

    def __init__(self, kind: str, raw: np.ndarray, in_features: int) -> None:
        """``raw`` uint8 [out, in / 32 * block bytes]: the file's rows, in their order."""
        module = native.kernels()
        assert module is not None, "BlockLinear without the native kernels"
        pack, linear = self.KINDS[kind]
        self.kind = kind
        self.out_features, self.in_features = raw.shape[0], in_features
        self.packed = getattr(module, pack)(torch.from_numpy(np.array(raw, dtype=np.uint8)))
        self._linear = getattr(module, linear)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # the forward's case: a reshape and a view cost ~2% of a one-row step
            return self._linear(x, self.packed)  # type: ignore[no-any-return]
        rows = x.reshape(-1, self.in_features)
        return self._linear(rows, self.packed).view(*x.shape[:-1], self.out_features)  # type: ignore[no-any-return]

    def nbytes(self) -> int:
        return self.packed.nbytes


# --- Q4_1 blocks -------------------------------------------------------------------


def q4_1_parts(raw: np.ndarray, columns: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_1 tensor's rows (``raw`` uint8 [rows, columns / 32 * 20]) as int32 codes
    [rows, columns], float32 ``d`` and ``m`` [rows, columns / 32]."""
    if columns % GROUP:
        raise QuantError(f"Q4_1 rows of {columns} weights are not whole blocks")
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, columns // GROUP, _Q4_1_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., 4:]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # [rows, blocks, 32]
    return (
        torch.from_numpy(codes.reshape(rows, columns).astype(np.int32)),
        torch.from_numpy(d),
        torch.from_numpy(m),
    )


def dequantize_q4_1(raw: np.ndarray, columns: int) -> torch.Tensor:
    """float32 [rows, columns], as llama.cpp (and transformers' GGUF loader) compute it."""
    codes, d, m = q4_1_parts(raw, columns)
    rows = codes.shape[0]
    grouped = codes.view(rows, -1, GROUP).float() * d.unsqueeze(-1) + m.unsqueeze(-1)
    return grouped.view(rows, columns)


def unpermute_rows(raw: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (rotary pairs interleaved) as transformers does."""
    half = raw.shape[0] // heads // 2
    return raw.reshape(heads, half, 2, -1).swapaxes(1, 2).reshape(raw.shape)


def int4_linear(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> Int4Linear:
    """One ``Int4Linear`` over the rows of several Q4_1 tensors (fused q/k/v, gate/up)."""
    codes, d, m = (torch.cat(column) for column in zip(*parts, strict=True))
    return Int4Linear(codes, d, m + 8 * d)


# --- the model ------------------------------------------------------------------------


class GgufTensors:
    """A GGUF file's tensors by name (memory-mapped by gguf-py's reader)."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        self.path = path
        self.tensors = {t.name: t for t in GGUFReader(str(path)).tensors}

    def q4_1(self, name: str, permute_heads: int | None = None) -> tuple[Any, ...]:
        raw, columns = self.rows(name, "Q4_1", permute_heads)
        return q4_1_parts(raw, columns)

    def rows(
        self, name: str, kind: str, permute_heads: int | None = None
    ) -> tuple[np.ndarray, int]:
        """Tensor ``name``'s raw rows (uint8 [rows, bytes], q/k rows in transformers'
        order when ``permute_heads`` is given) and its columns; it must be ``kind``."""
        tensor = self.tensors.get(name)
        if tensor is None:
            raise QuantError(f"{self.path.name} has no tensor {name!r}")
        if tensor.tensor_type.name != kind:
            raise QuantError(f"{name} is {tensor.tensor_type.name}, not {kind}")
        raw = np.asarray(tensor.data)
        if permute_heads is not None:
            raw = unpermute_rows(raw, permute_heads)
        return raw, int(tensor.shape[0])

    def kind(self, name: str) -> str | None:
        tensor = self.tensors.get(name)
        return None if tensor is None else str(tensor.tensor_type.name)

    def all_q4_1(self, names: list[str]) -> bool:
        found = [self.tensors.get(n) for n in names]
        return all(t is not None and t.tensor_type.name == "Q4_1" for t in found)


def _layer_names(i: int) -> list[str]:
    parts = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    return [f"blk.{i}.{p}.weight" for p in parts]


def quantized_model(fast: FastLlama, gguf: Path, blocks: bool | None = None) -> FastLlama:
    """A copy of ``fast`` whose linear layers multiply the GGUF's own Q4_1 blocks.

    Only plain Llama layers (no q/k/v bias) whose seven matrices are all Q4_1 are
    replaced. ``blocks`` (default: where the C++ kernels build) multiplies the file's
    blocks natively (``BlockLinear``), the output layer too when the file's is Q8_0;
    otherwise torch's int4 kernel, and the output layer as int8 per row. Raises
    ``QuantError`` if the file does not match the model (a different file, or another
    architecture)."""
    if fast.config.model_type != "llama":
        raise QuantError(f"quantized CPU weights cover llama models, not {fast.config.model_type}")
    if blocks is None:
        blocks = native.kernels() is not None
    tensors = GgufTensors(gguf)
    quant = copy.copy(fast)
    quant.layers = [copy.copy(layer) for layer in fast.layers]
    for i, layer in enumerate(quant.layers):
        if layer.qkv.bias is not None or not tensors.all_q4_1(_layer_names(i)):
            continue
        _quantize_layer(layer, i, tensors, fast, blocks)
    quant.lm_head = _output_layer(fast, tensors, blocks)
    quant.layer_stack = layer_stack(quant)
    return quant


def layer_stack(model: FastLlama) -> Any:
    """The C++ ``LayerStack`` (engine/native_layers.cpp) over ``model``'s layers, when the
    native forward runs them (``llama.covers``) and every linear layer is a
    ``BlockLinear``; else None (the layer program in Python, kernel by kernel)."""
    module = native.kernels()
    linears = [getattr(layer, name) for layer in model.layers for name in _LINEARS]
    if module is None or not model.fusable or not all(isinstance(x, BlockLinear) for x in linears):
        return None
    norms = [norm for layer in model.layers for norm in (layer.norm_attn_in, layer.norm_mlp_in)]
    return module.LayerStack(
        packed=[linear.packed for linear in linears],
        kinds=[linear.kind for linear in linears],
        norms=[*norms, model.norm],
        cos=[cos for cos, _ in model.tables],
        sin=[sin for _, sin in model.tables],
        rope_of_layer=model.rope_of_layer,
        q_heads=model.num_heads,
        scale=model.scale,
        eps=model.eps,
    )


# A layer's linear layers, in the order LayerStack takes them.
_LINEARS = ("qkv", "o", "gate_up", "down")


def _quantize_layer(
    layer: Any, i: int, tensors: GgufTensors, fast: FastLlama, blocks: bool
) -> None:
    q, k, v, o, gate, up, down = _layer_names(i)
    qkv = _q4_1_linear(tensors, [(q, fast.num_heads), (k, fast.num_kv_heads), (v, None)], blocks)
    if qkv.out_features != layer.qkv.out_features:
        raise QuantError(f"{tensors.path.name}: layer {i}'s q/k/v do not match the model")
    layer.qkv = qkv
    layer.o = _q4_1_linear(tensors, [(o, None)], blocks)
    layer.gate_up = _q4_1_linear(tensors, [(gate, None), (up, None)], blocks)
    layer.down = _q4_1_linear(tensors, [(down, None)], blocks)


def _q4_1_linear(
    tensors: GgufTensors, names: list[tuple[str, int | None]], blocks: bool
) -> BlockLinear | Int4Linear:
    """One linear over the rows of several Q4_1 tensors (fused q/k/v, fused gate/up);
    each name with its head count where its rows are llama.cpp's q/k order."""
    if not blocks:
        return int4_linear([tensors.q4_1(name, heads) for name, heads in names])
    rows = [tensors.rows(name, "Q4_1", heads) for name, heads in names]
    return BlockLinear("Q4_1", np.concatenate([raw for raw, _ in rows]), rows[0][1])


def _output_layer(fast: FastLlama, tensors: GgufTensors, blocks: bool) -> BlockLinear | Int8Linear:
    """The file's own Q8_0 output layer (``output.weight``, or the token embedding it is
    tied to) where the native kernels run; else the float one re-quantized to int8."""
    head = fast.lm_head
    assert isinstance(head, Linear)
    name = "output.weight" if tensors.kind("output.weight") is not None else "token_embd.weight"
    weight = head.matrix()
    if blocks and tensors.kind(name) == "Q8_0":
        raw, columns = tensors.rows(name, "Q8_0")
        if (raw.shape[0], columns) == tuple(weight.shape):
            return BlockLinear("Q8_0", raw, columns)
    return Int8Linear(weight)


def cpu_quantized_model(model: Any, fast: FastLlama, gguf: Path) -> FastLlama:
    """``quantized_model(fast, gguf)``, built once per loaded model (several cores may
    share one), or ``fast`` itself when the file does not fit (logged, not fatal)."""
    cached = getattr(model, "_wsinfer_quantized", None)
    if cached is not None and cached.cos is fast.cos:
        return cached  # type: ignore[no-any-return]
    try:
        with torch.inference_mode():
            quant = quantized_model(fast, gguf)
    except QuantError as exc:
        log.warning("quantized CPU weights unavailable; float32", reason=str(exc))
        return fast
    q4 = sum(isinstance(layer.qkv, (Int4Linear, BlockLinear)) for layer in quant.layers)
    head = quant.lm_head
    log.info(
        "quantized CPU weights",
        file=gguf.name,
        q4_1_layers=q4,
        output_layer=head.kind if isinstance(head, BlockLinear) else "int8",
        kernels="native" if isinstance(quant.layers[0].qkv, BlockLinear) else "torch",
    )
    model._wsinfer_quantized = quant
    return quant
