// Linear layers over a GGUF's own quantized blocks, as llama.cpp multiplies them:
// the activations are quantized to int8 per block of 32 inputs (one float scale a
// block), and each block's products are summed as integers; the weights stay in
// the file's blocks (Q4_1 for the layers, Q8_0 for SmolLM2's output layer).
// engine/quant.py says why and what it costs in accuracy.
//
// Integer sums are exact, so the only float arithmetic is per block (scale the
// block's integer sum, add the block's offset term) and one reduction at the end,
// in an order this code fixes: an output depends only on its own row of inputs,
// never on the number of rows, the row tiling or the threads. A row is the same
// bits alone or batched, and a prefill recomputes the very activations its decode
// steps computed (the takeover promise).
//
// Layout. Blocks are taken four at a time (a "group" of 128 inputs; a row's last
// group may hold fewer). A group's integer products fill sixteen int32 lanes, four
// a block: lane l sums the products of bytes 4l..4l+3 of the group's "low" 64
// bytes and of its "high" 64 bytes, where low holds inputs 0..15 of each block and
// high inputs 16..31 (block b at bytes 16b..16b+15 of each). That is the Q4_1
// block's own nibble order (byte j: input j low, input j + 16 high), so a Q4_1
// group is its blocks' 16 nibble bytes side by side; Q8_0 bytes are re-ordered at
// pack time (pack_q8_0). A packed row is the file's row, re-ordered: per group,
// the weights, then the blocks' fp16 scales (Q4_1: the G d's, then the G m's).

#include "native.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

using wsinfer::fold;
// A row's 16 float lanes (four a block of a group), as I32x16's integer ones.
typedef wsinfer::Lanes F32x16;
typedef int32_t I32x16 __attribute__((vector_size(64)));
typedef uint8_t U8x64 __attribute__((vector_size(64)));
typedef int8_t I8x64 __attribute__((vector_size(64)));

constexpr int64_t BLOCK = 32;          // inputs a block
constexpr int64_t GROUP_BLOCKS = 4;    // blocks a group
constexpr int64_t GROUP = BLOCK * GROUP_BLOCKS;
constexpr int64_t Q4_1_BYTES = 20;     // fp16 d, fp16 m, 16 nibble bytes
constexpr int64_t Q8_0_BYTES = 34;     // fp16 d, 32 int8
constexpr int64_t OUT_CHUNK = 16;      // output rows a task walks per input tile
constexpr int64_t PREFETCH_AHEAD = 1024;  // bytes: the weights stream from memory

template <typename V>
inline V load(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// Lane l: the sum over j < 4 of u[4l + j] * s[4l + j], for u unsigned and s signed
// (|s| <= 127), plus the same over u2, s2. Exact in every branch.
inline I32x16 dot_u8s8(U8x64 u, I8x64 s, U8x64 u2, I8x64 s2) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), (__m512i)u, (__m512i)s);
  return (I32x16)_mm512_dpbusd_epi32(acc, (__m512i)u2, (__m512i)s2);
#elif defined(__AVX2__)
  // maddubs: pairs of u8 * s8 into int16 (no saturation as used here: the
  // unsigned side is a nibble or |int8| <= 128, so 2 * 128 * 127 < 32767 at most),
  // then madd into int32.
  const __m256i ones = _mm256_set1_epi16(1);
  I32x16 out;
  for (int half = 0; half < 2; ++half) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&u) + half);
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&s) + half);
    __m256i a2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&u2) + half);
    __m256i b2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&s2) + half);
    __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones),
                                   _mm256_madd_epi16(_mm256_maddubs_epi16(a2, b2), ones));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(&out) + half, sum);
  }
  return out;
#else
  I32x16 out;
  for (int l = 0; l < 16; ++l) {
    int32_t acc = 0;
    for (int j = 0; j < 4; ++j) {
      acc += int32_t(u[4 * l + j]) * int32_t(s[4 * l + j]);
      acc += int32_t(u2[4 * l + j]) * int32_t(s2[4 * l + j]);
    }
    out[l] = acc;
  }
  return out;
#endif
}

// |w| and s carrying w's sign, so that a signed * signed product is unsigned * signed.
inline void move_sign(I8x64 w, I8x64 s, U8x64* magnitude, I8x64* signed_s) {
#if defined(__AVX512BW__)
  const __mmask64 negative = _mm512_movepi8_mask((__m512i)w);
  *magnitude = (U8x64)_mm512_abs_epi8((__m512i)w);
  *signed_s = (I8x64)_mm512_mask_sub_epi8((__m512i)s, negative, _mm512_setzero_si512(),
                                          (__m512i)s);
#else
  const I8x64 zero = {};
  *magnitude = (U8x64)(w < zero ? -w : w);  // -(-128) wraps to 128 as unsigned: right
  *signed_s = w < zero ? -s : s;
#endif
}

// A group's fp16 d's (or m's), each on the four lanes of its block: `count` of them
// read from h, zeros for the rest (a row's last group may hold fewer than four).
inline F32x16 per_block(const uint8_t* h, int64_t count) {
#if defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512BW__) && defined(__F16C__)
  const __m128i bits = count == GROUP_BLOCKS
                           ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(h))
                           : _mm_maskz_loadu_epi16(static_cast<__mmask8>((1u << count) - 1), h);
  const __m512 v = _mm512_castps128_ps512(_mm_cvtph_ps(bits));
  const __m512i lanes = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  return (F32x16)_mm512_permutexvar_ps(lanes, v);
#else
  float v[4] = {};
  for (int64_t b = 0; b < count; ++b) {
    uint16_t bits;
    std::memcpy(&bits, h + 2 * b, 2);
    v[b] = half_to_float(bits);
  }
  return F32x16{v[0], v[0], v[0], v[0], v[1], v[1], v[1], v[1],
                v[2], v[2], v[2], v[2], v[3], v[3], v[3], v[3]};
#endif
}

// `n` <= 64 bytes from p, zeros after them (a masked load: copying a short group
// into a buffer first cost more than the group's arithmetic).
inline U8x64 load_bytes(const uint8_t* p, int64_t n) {
  if (n == 64) return load<U8x64>(p);
#if defined(__AVX512BW__)
  return (U8x64)_mm512_maskz_loadu_epi8((__mmask64{1} << n) - 1, p);
#else
  U8x64 v = {};
  std::memcpy(&v, p, n);
  return v;
#endif
}

// One row of inputs, quantized: per group the 128 int8 (low then high halves, as
// the weights), each block's scale on its lanes, and each block's float sum / 4 on
// its lanes (the Q4_1 offset term: m * sum(x), spread over the block's 4 lanes).
struct QuantRow {
  const int8_t* codes;  // [groups][128]
  const float* scale;   // [groups][16]
  const float* sum4;    // [groups][16]
};

struct QuantInput {
  int64_t rows = 0, groups = 0;
  std::vector<int8_t> codes;
  std::vector<float> scale, sum4;
  QuantRow row(int64_t r) const {
    return {codes.data() + r * groups * GROUP, scale.data() + r * groups * 16,
            sum4.data() + r * groups * 16};
  }
};

// x [rows, in] float32 into blocks of 32: scale = max |x| / 127, code = x / scale
// rounded to nearest even (llama.cpp's Q8 activations); a block of zeros: scale 0.
QuantInput quantize_input(const at::Tensor& x) {
  QuantInput q;
  q.rows = x.size(0);
  const int64_t in = x.size(1), blocks = in / BLOCK;
  q.groups = (blocks + GROUP_BLOCKS - 1) / GROUP_BLOCKS;
  q.codes.assign(q.rows * q.groups * GROUP, 0);
  q.scale.assign(q.rows * q.groups * 16, 0.0f);
  q.sum4.assign(q.rows * q.groups * 16, 0.0f);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, q.rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        const float* v = xp + r * in + b * BLOCK;
        float top = 0.0f, total = 0.0f;
        for (int64_t i = 0; i < BLOCK; ++i) top = std::max(top, std::fabs(v[i]));
        for (int64_t i = 0; i < BLOCK; ++i) total += v[i];
        // A NaN or infinity makes the block's scale NaN, so it reaches the output
        // (as it would in float arithmetic) instead of vanishing into zero codes.
        const bool finite = std::isfinite(top) && std::isfinite(total);
        const float scale = finite ? top / 127.0f : std::numeric_limits<float>::quiet_NaN();
        const float inverse = finite && scale > 0.0f ? 1.0f / scale : 0.0f;
        const int64_t g = b / GROUP_BLOCKS, slot = b % GROUP_BLOCKS;
        int8_t* codes = q.codes.data() + (r * q.groups + g) * GROUP;
        for (int64_t i = 0; i < BLOCK; ++i) {
          const int64_t at = (i < 16 ? 0 : 64) + slot * 16 + (i % 16);
          codes[at] = static_cast<int8_t>(std::nearbyint(v[i] * inverse));
        }
        float* scale_lanes = q.scale.data() + (r * q.groups + g) * 16 + slot * 4;
        float* sum_lanes = q.sum4.data() + (r * q.groups + g) * 16 + slot * 4;
        for (int j = 0; j < 4; ++j) {
          scale_lanes[j] = scale;
          sum_lanes[j] = total * 0.25f;
        }
      }
    }
  });
  return q;
}

void check_input(const at::Tensor& x, const at::Tensor& packed, int64_t block_bytes) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2,
              "x must be a float32 CPU tensor [rows, in]");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte &&
                  packed.dim() == 2 && packed.is_contiguous(),
              "the packed weight must be a contiguous uint8 CPU tensor [out, bytes]");
  TORCH_CHECK(x.size(1) % BLOCK == 0, "x's ", x.size(1), " inputs are not whole blocks of 32");
  TORCH_CHECK(packed.size(1) == x.size(1) / BLOCK * block_bytes, "x has ", x.size(1),
              " inputs; the weight's rows hold ", packed.size(1) / block_bytes, " blocks of 32");
}

// Where group g of a packed row starts, and how many blocks it holds.
inline int64_t group_blocks(int64_t g, int64_t blocks) {
  return std::min(GROUP_BLOCKS, blocks - g * GROUP_BLOCKS);
}

// Outputs [first, last) of the TILE input rows from r0: each weight group decoded
// once for the tile. The accumulators stay in registers because TILE is a constant:
// indexed by a loop variable they lived on the stack, and each group's update waited
// on a store and a load. Two sums a row (the scaled products, and Q4_1's offset
// term), added at the end: one dependent addition a group each instead of two.
template <typename Weights, int TILE>
void tile_outputs(const QuantInput& q, int64_t r0, const uint8_t* wp, int64_t row_bytes,
                  int64_t blocks, int64_t first, int64_t last, float* op, int64_t outs) {
  QuantRow in[TILE];
  for (int t = 0; t < TILE; ++t) in[t] = q.row(r0 + t);
  for (int64_t n = first; n < last; ++n) {
    F32x16 acc[TILE] = {}, offset[TILE] = {};
    const uint8_t* w = wp + n * row_bytes;
    for (int64_t g = 0; g < q.groups; ++g) {
      const int64_t count = group_blocks(g, blocks);
      __builtin_prefetch(w + PREFETCH_AHEAD);
      Weights::template accumulate<TILE>(w, count, g, in, acc, offset);
      w += count * Weights::BYTES;
    }
    for (int t = 0; t < TILE; ++t) op[(r0 + t) * outs + n] = fold(acc[t] + offset[t]);
  }
}

// The shared walk: output rows split among threads (each output computed by one,
// whole), input rows in tiles of up to 8 sharing each weight group's decoding.
// `Weights` adds a group's products into each input row's 16 lanes.
template <typename Weights>
at::Tensor quantized_linear(const at::Tensor& x_in, const at::Tensor& packed) {
  check_input(x_in, packed, Weights::BYTES);
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0), outs = packed.size(0), blocks = x.size(1) / BLOCK;
  at::Tensor out = x.new_empty({rows, outs});
  if (rows == 0 || outs == 0) return out;
  const QuantInput q = quantize_input(x);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = packed.size(1);
  at::parallel_for(0, (outs + OUT_CHUNK - 1) / OUT_CHUNK, 1, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t first = chunk * OUT_CHUNK, last = std::min(outs, first + OUT_CHUNK);
      // Tiles of 8 input rows, the rest in tiles of 4, 2, 1 (a tile's rows must be a
      // constant for the accumulators to stay in registers).
      for (int64_t r0 = 0; r0 < rows;) {
        const int64_t left = rows - r0;
        if (left >= 8) {
          tile_outputs<Weights, 8>(q, r0, wp, row_bytes, blocks, first, last, op, outs);
          r0 += 8;
        } else if (left >= 4) {
          tile_outputs<Weights, 4>(q, r0, wp, row_bytes, blocks, first, last, op, outs);
          r0 += 4;
        } else if (left >= 2) {
          tile_outputs<Weights, 2>(q, r0, wp, row_bytes, blocks, first, last, op, outs);
          r0 += 2;
        } else {
          tile_outputs<Weights, 1>(q, r0, wp, row_bytes, blocks, first, last, op, outs);
          r0 += 1;
        }
      }
    }
  });
  return out;
}

struct Q4_1 {
  static constexpr int64_t BYTES = Q4_1_BYTES;
  // A file block (fp16 d, fp16 m, 16 nibble bytes) as block b of a packed group.
  static void place(const uint8_t* block, int64_t b, int64_t count, uint8_t* group) {
    std::memcpy(group + 16 * b, block + 4, 16);
    std::memcpy(group + 16 * count + 2 * b, block, 2);
    std::memcpy(group + 18 * count + 2 * b, block + 2, 2);
  }
  // A group of `count` blocks: their nibble bytes (16 each), their fp16 d's, their m's.
  template <int TILE>
  static void accumulate(const uint8_t* w, int64_t count, int64_t g, const QuantRow* in,
                         F32x16* acc, F32x16* offset) {
    const U8x64 packed = load_bytes(w, 16 * count);
    const U8x64 low = packed & 0x0F;
    const U8x64 high = packed >> 4;
    const F32x16 dl = per_block(w + 16 * count, count);
    const F32x16 ml = per_block(w + 18 * count, count);
    for (int t = 0; t < TILE; ++t) {
      const int8_t* codes = in[t].codes + g * GROUP;
      const I32x16 ints = dot_u8s8(low, load<I8x64>(codes), high, load<I8x64>(codes + 64));
      const F32x16 scale = load<F32x16>(in[t].scale + g * 16);
      const F32x16 sum4 = load<F32x16>(in[t].sum4 + g * 16);
      acc[t] += __builtin_convertvector(ints, F32x16) * (dl * scale);
      offset[t] += ml * sum4;
    }
  }
};

struct Q8_0 {
  static constexpr int64_t BYTES = Q8_0_BYTES;
  // A file block (fp16 d, 32 int8) as block b of a packed group.
  static void place(const uint8_t* block, int64_t b, int64_t count, uint8_t* group) {
    std::memcpy(group + 16 * b, block + 2, 16);
    std::memcpy(group + 16 * count + 16 * b, block + 18, 16);
    std::memcpy(group + 32 * count + 2 * b, block, 2);
  }
  // A group of `count` blocks: their low halves (16 int8 each), their high halves,
  // their fp16 d's. No offset term.
  template <int TILE>
  static void accumulate(const uint8_t* w, int64_t count, int64_t g, const QuantRow* in,
                         F32x16* acc, F32x16* /*offset*/) {
    const I8x64 low = (I8x64)load_bytes(w, 16 * count);
    const I8x64 high = (I8x64)load_bytes(w + 16 * count, 16 * count);
    const F32x16 dl = per_block(w + 32 * count, count);
    for (int t = 0; t < TILE; ++t) {
      const int8_t* codes = in[t].codes + g * GROUP;
      U8x64 low_mag, high_mag;
      I8x64 low_s, high_s;
      move_sign(low, load<I8x64>(codes), &low_mag, &low_s);
      move_sign(high, load<I8x64>(codes + 64), &high_mag, &high_s);
      const I32x16 ints = dot_u8s8(low_mag, low_s, high_mag, high_s);
      const F32x16 scale = load<F32x16>(in[t].scale + g * 16);
      acc[t] += __builtin_convertvector(ints, F32x16) * (dl * scale);
    }
  }
};

at::Tensor check_raw(const at::Tensor& raw, int64_t block_bytes, const char* kind) {
  TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == at::kByte && raw.dim() == 2,
              kind, " blocks must be a uint8 CPU tensor [rows, bytes]");
  TORCH_CHECK(raw.size(1) % block_bytes == 0, kind, " rows of ", raw.size(1),
              " bytes are not whole blocks of ", block_bytes);
  return raw.contiguous();
}

// A file's rows re-ordered group by group; `Weights::place` puts block b of a
// group of `count` where the kernel reads it.
template <typename Weights>
at::Tensor pack(const at::Tensor& raw_in, const char* kind) {
  const at::Tensor raw = check_raw(raw_in, Weights::BYTES, kind);
  at::Tensor out = raw.new_empty(raw.sizes());
  const int64_t rows = raw.size(0), blocks = raw.size(1) / Weights::BYTES;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* src = raw.data_ptr<uint8_t>() + r * raw.size(1);
    uint8_t* dst = out.data_ptr<uint8_t>() + r * raw.size(1);
    for (int64_t b0 = 0; b0 < blocks; b0 += GROUP_BLOCKS) {
      const int64_t count = group_blocks(b0 / GROUP_BLOCKS, blocks);
      for (int64_t b = 0; b < count; ++b) {
        Weights::place(src + (b0 + b) * Weights::BYTES, b, count, dst);
      }
      dst += count * Weights::BYTES;
    }
  }
  return out;
}

}  // namespace

// x [rows, in] float32 times the packed Q4_1 weight [out, in / 32 * 20] transposed.
at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& packed) {
  return quantized_linear<Q4_1>(x, packed);
}

// x [rows, in] float32 times the packed Q8_0 weight [out, in / 32 * 34] transposed.
at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& packed) {
  return quantized_linear<Q8_0>(x, packed);
}

// The file's Q4_1 rows (per block: fp16 d, fp16 m, 16 nibble bytes) in group order.
at::Tensor pack_q4_1(const at::Tensor& raw) { return pack<Q4_1>(raw, "Q4_1"); }

// The file's Q8_0 rows (per block: fp16 d, 32 int8) in group order.
at::Tensor pack_q8_0(const at::Tensor& raw) { return pack<Q8_0>(raw, "Q8_0"); }
