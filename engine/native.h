// What the native CPU kernels' sources share: each kernel's declaration (defined in
// the file named above it, bound to Python in native_layers.cpp), the 16-lane float
// register their reductions accumulate in, and the one fold that sums its lanes.
//
// The fold's tree is part of every result's bits: a dot product, an attention score
// and a quantized linear output all end in it, and a row computes the same bits
// alone or batched, in a prefill or a decode step, only because they all sum their
// lanes in this one order. A second copy of it could drift from this one.
//
// ATen's tensor only, not <torch/extension.h> (pybind11, Python, torch's C++ API):
// that header took ~60 s of each file's compile, this one a few.

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>
#include <vector>

// --- native_cpu.cpp ---------------------------------------------------------------

// residual <- x + residual (or x, when residual is undefined); returns
// (residual, rms_norm(residual) * weight), both [N, hidden].
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                     const at::Tensor& weight, double eps);
// q rotated [N, Hq, D] of qkv [N, (Hq + 2 Hkv) D]; k rotated and v stored into the
// caches [blocks, block_size, Hkv, D] at flat slots [N] (negative: not stored).
at::Tensor rope_cache(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& sin, const at::Tensor& slots, at::Tensor k_cache,
                      at::Tensor v_cache, int64_t q_heads);
// gate_up [N, 2 I] (gate, then up) -> silu(gate) * up [N, I].
at::Tensor silu_mul(const at::Tensor& gate_up);
// Causal attention of q [N, Hq, D] over the paged cache: token t of row rows[t] sees
// that row's keys 0..query_pos[t] (a negative position: zeros).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& rows, const at::Tensor& query_pos, double scale);

// --- native_quant.cpp -------------------------------------------------------------

// x [rows, in] float32 times a packed weight [out, in / 32 * block bytes], transposed.
at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& packed);
at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& packed);
// A GGUF's rows of blocks in the kernels' group order.
at::Tensor pack_q4_1(const at::Tensor& raw);
at::Tensor pack_q8_0(const at::Tensor& raw);

// --- native_sampling.cpp ----------------------------------------------------------

// The rows' seeded race [B] int64, or None when a row has no finite maximum.
c10::optional<at::Tensor> seeded_race(const at::Tensor& logits, const at::Tensor& temperature,
                                      const at::Tensor& seed, const at::Tensor& index,
                                      double noise_low);

// --- the lanes and their fold -----------------------------------------------------

namespace wsinfer {

// Partial sums a reduction keeps: element i of a run adds to lane i % LANES.
constexpr int64_t LANES = 16;

// The lanes in one register (GCC's and Clang's vector extension: a zmm register with
// AVX-512, two ymm with AVX2, four xmm without).
typedef float Lanes __attribute__((vector_size(LANES * sizeof(float))));

// The sum of the lanes: the upper half added onto the lower, four times (lane j +=
// lane j + 8, then j + 4, j + 2, j + 1), the same additions in the same order on
// every variant. Halves, not whole-register shuffles: each step is one narrower
// add, with no permute to emulate where a register holds fewer lanes.
inline float fold(Lanes v) {
  typedef float Half __attribute__((vector_size(LANES / 2 * sizeof(float))));
  typedef float Quarter __attribute__((vector_size(LANES / 4 * sizeof(float))));
  Half lo8, hi8;
  std::memcpy(&lo8, &v, sizeof(Half));
  std::memcpy(&hi8, reinterpret_cast<const char*>(&v) + sizeof(Half), sizeof(Half));
  const Half v8 = lo8 + hi8;
  Quarter lo4, hi4;
  std::memcpy(&lo4, &v8, sizeof(Quarter));
  std::memcpy(&hi4, reinterpret_cast<const char*>(&v8) + sizeof(Quarter), sizeof(Quarter));
  const Quarter v4 = lo4 + hi4;
  const float a = v4[0] + v4[2], b = v4[1] + v4[3];
  return a + b;
}

}  // namespace wsinfer
