// The CPU forward's small kernels, each one call where the torch forward makes
// several: add + RMSNorm, rotary + KV-cache write, SiLU(gate) * up, and paged
// attention. At a decode step's few rows the torch ops cost their dispatch, not
// their arithmetic (engine/native.py says how much).
//
// Every result for a token depends only on that token's inputs (and, for
// attention, the keys and values it may see), summed in an order fixed by this
// code: never by the number of rows, the threads, or how a prompt was chunked.
// A row computes the same bits alone or in any batch, and a prompt's prefill
// the very KV its decode steps wrote. Reductions run in LANES partial sums
// (which the compiler turns into vector registers without reordering them),
// then native.h's fold.
//
// Float32 tensors only, but for the KV caches, which may also be float16 (half the
// bytes a decode step reads at a long context): their keys and values are
// widened to float32 as they are loaded, exactly (every half is a float), so the
// arithmetic and its order are a float32 cache's, on every variant, and a value
// is rounded to half once, as it is stored (to nearest, ties to even).
// Inputs of any layout, caches and weights contiguous.

#include "native.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using wsinfer::fold;
using wsinfer::Lanes;
using wsinfer::LANES;

Lanes load_lanes(const float* x, int64_t count) {
  Lanes v = {};
  std::memcpy(&v, x, count * sizeof(float));
  return v;
}

// A float16 cache element: IEEE binary16's bits, as at::Half stores them.
using Half = uint16_t;

inline float as_float(float x) { return x; }
inline float as_float(Half h) { return c10::detail::fp16_ieee_to_fp32_value(h); }
inline void store(float* out, float x) { *out = x; }
inline void store(Half* out, float x) { *out = c10::detail::fp16_ieee_from_fp32_value(x); }

// count (<= LANES) cache elements as float32 lanes, the rest zero.
inline Lanes load_row(const float* x, int64_t count) { return load_lanes(x, count); }
inline Lanes load_row(const Half* x, int64_t count) {
  Lanes v;
#if defined(__AVX512F__)
  if (count == LANES) {
    const __m512 wide = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
    std::memcpy(&v, &wide, sizeof(v));
    return v;
  }
#elif defined(__F16C__)
  if (count == LANES) {
    const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
    const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 8)));
    std::memcpy(&v, &lo, sizeof(lo));
    std::memcpy(reinterpret_cast<char*>(&v) + sizeof(lo), &hi, sizeof(hi));
    return v;
  }
#endif
  float wide[LANES] = {0};
  for (int64_t i = 0; i < count; ++i) wide[i] = as_float(x[i]);
  return load_lanes(wide, LANES);
}

void check_cache(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() &&
                  (t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf),
              name, " must be a contiguous float32 or float16 CPU tensor");
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    for (int64_t j = 0; j < LANES; ++j) acc[j] += a[i + j] * b[i + j];
  }
  for (int64_t j = 0; i + j < n; ++j) acc[j] += a[i + j] * b[i + j];
  return fold(load_lanes(acc, LANES));
}

inline float sum(const float* a, int64_t n) {
  float acc[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    for (int64_t j = 0; j < LANES; ++j) acc[j] += a[i + j];
  }
  for (int64_t j = 0; i + j < n; ++j) acc[j] += a[i + j];
  return fold(load_lanes(acc, LANES));
}

// exp(x) to about 2 ulp, in plain float arithmetic the compiler can vectorize
// (libm's exp is a call per element): 2^n times a degree-6 polynomial of the
// remainder (Cephes' expf). Below -87.3 it returns 0, as expf underflows.
inline float fast_exp(float x) {
  const bool under = x < -87.3f;
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return under ? 0.0f : p * scale;
}

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
              name, " must be a contiguous float32 CPU tensor");
}

// An input read only: any layout (copied when not contiguous).
at::Tensor float_input(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat,
              name, " must be a float32 CPU tensor");
  return t.contiguous();
}

void check_index(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous(),
              name, " must be a contiguous int64 CPU tensor");
}

// Rows per task of the row-wise kernels: a decode step's few rows run on one
// thread (waking the others costs more than the rows), a prompt's are shared.
constexpr int64_t ROW_GRAIN = 16;

}  // namespace

// residual <- x + residual (or x, when residual is undefined); returns
// (residual, rms_norm(residual) * weight), both [N, hidden].
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x_in,
                                     const c10::optional<at::Tensor>& residual,
                                     const at::Tensor& weight, double eps) {
  const at::Tensor x = float_input(x_in, "x");
  check_float(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1),
              "x [N, hidden] and weight [hidden] do not fit");
  const bool adding = residual.has_value() && residual->defined();
  if (adding) {
    check_float(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual and x differ in shape");
  }
  const int64_t rows = x.size(0), hidden = x.size(1);
  at::Tensor sum_out = x.new_empty(x.sizes());
  at::Tensor normed = x.new_empty(x.sizes());
  const float* xp = x.data_ptr<float>();
  const float* rp = adding ? residual->data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  float* sp = sum_out.data_ptr<float>();
  float* np_ = normed.data_ptr<float>();
  const float epsf = static_cast<float>(eps);
  at::parallel_for(0, rows, ROW_GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * hidden;
      float* sr = sp + r * hidden;
      if (rp != nullptr) {
        const float* rr = rp + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) sr[i] = xr[i] + rr[i];
      } else {
        std::memcpy(sr, xr, hidden * sizeof(float));
      }
      const float inv = 1.0f / std::sqrt(dot(sr, sr, hidden) / static_cast<float>(hidden) + epsf);
      float* nr = np_ + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) nr[i] = sr[i] * inv * wp[i];
    }
  });
  return {sum_out, normed};
}

// qkv [N, (Hq + 2 Hkv) D]: q's heads, k's, v's. Returns q rotated [N, Hq, D];
// k rotated and v stored into the caches [blocks, block_size, Hkv, D] at flat
// slots [N] (a negative slot stores nothing). The rotary of transformers'
// apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, tables [positions, D].
at::Tensor rope_cache(const at::Tensor& qkv_in, const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& sin, const at::Tensor& slots, at::Tensor k_cache,
                      at::Tensor v_cache, int64_t q_heads) {
  const at::Tensor qkv = float_input(qkv_in, "qkv");
  check_float(cos, "cos");
  check_float(sin, "sin");
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  check_index(positions, "positions");
  check_index(slots, "slots");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "caches do not match");
  const int64_t rows = qkv.size(0), kv_heads = k_cache.size(2), dim = k_cache.size(3);
  const int64_t slot_count = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (q_heads + 2 * kv_heads) * dim,
              "qkv does not hold q, k and v heads of the cache's size");
  TORCH_CHECK(cos.dim() == 2 && cos.size(1) == dim && sin.sizes() == cos.sizes(),
              "rotary tables do not fit the head size");
  TORCH_CHECK(positions.numel() == rows && slots.numel() == rows, "one position and slot a row");
  TORCH_CHECK(dim % 2 == 0, "odd head size");
  at::Tensor q = qkv.new_empty({rows, q_heads, dim});
  const float* in = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  float* qp = q.data_ptr<float>();
  const int64_t width = qkv.size(1), half = dim / 2, table_rows = cos.size(0);
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(pos[r] >= 0 && pos[r] < table_rows, "position ", pos[r], " outside the rotary table");
    TORCH_CHECK(slot[r] < slot_count, "slot ", slot[r], " outside the cache");
  }
  auto turn = [&](const float* x, const float* c, const float* s, float* out) {
    for (int64_t d = 0; d < half; ++d) out[d] = x[d] * c[d] + (-x[d + half]) * s[d];
    for (int64_t d = half; d < dim; ++d) out[d] = x[d] * c[d] + x[d - half] * s[d];
  };
  auto write = [&](auto* kp, auto* vp) {
    at::parallel_for(0, rows, ROW_GRAIN, [&](int64_t begin, int64_t end) {
      std::vector<float> k_turned(static_cast<size_t>(kv_heads * dim));
      for (int64_t r = begin; r < end; ++r) {
        const float* row = in + r * width;
        const float* c = cp + pos[r] * dim;
        const float* s = sp + pos[r] * dim;
        for (int64_t h = 0; h < q_heads; ++h) turn(row + h * dim, c, s, qp + (r * q_heads + h) * dim);
        if (slot[r] < 0) continue;
        auto* k_out = kp + slot[r] * kv_heads * dim;
        auto* v_out = vp + slot[r] * kv_heads * dim;
        for (int64_t h = 0; h < kv_heads; ++h) {
          turn(row + (q_heads + h) * dim, c, s, k_turned.data() + h * dim);
        }
        const float* v_in = row + (q_heads + kv_heads) * dim;
        for (int64_t i = 0; i < kv_heads * dim; ++i) {
          store(k_out + i, k_turned[i]);
          store(v_out + i, v_in[i]);
        }
      }
    });
  };
  if (k_cache.scalar_type() == at::kHalf) {
    write(reinterpret_cast<Half*>(k_cache.data_ptr<at::Half>()),
          reinterpret_cast<Half*>(v_cache.data_ptr<at::Half>()));
  } else {
    write(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  }
  return q;
}

// gate_up [N, 2 I] (gate, then up) -> silu(gate) * up [N, I].
at::Tensor silu_mul(const at::Tensor& gate_up_in) {
  const at::Tensor gate_up = float_input(gate_up_in, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [N, 2 I]");
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2;
  at::Tensor out = gate_up.new_empty({rows, inner});
  const float* in = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, ROW_GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = in + r * 2 * inner;
      const float* up = gate + inner;
      float* o = op + r * inner;
      for (int64_t i = 0; i < inner; ++i) o[i] = gate[i] / (1.0f + fast_exp(-gate[i])) * up[i];
    }
  });
  return out;
}

// Causal attention over the paged cache. Token t (of N) of row rows[t] sees
// that row's keys 0..query_pos[t], found through block_tables[rows[t]]; a
// negative position sees nothing and gets zeros. q [N, Hq, D] -> [N, Hq, D].
//
// A query's score for a key is dot()'s arithmetic: dim d's product added to lane
// d % 16 in index order, then the lanes folded in native.h's fold; its
// softmax and the weighted sum of values run over its keys in index order. A
// query alone (a decode step) reads each key row in place, its 16 lanes one
// register. Up to QUERY_TILE consecutive tokens of one row (a prefill) share each
// block of keys transposed once, its lanes across keys: the same additions in the
// same order, so a query gets the same bits alone as in any tile (the takeover
// promise), and the tile's values stay in cache between its queries.
namespace {
constexpr int64_t QUERY_TILE = 16;
constexpr int64_t KEY_BLOCK = 16;
static_assert(KEY_BLOCK == LANES, "a transposed block's lanes are dot()'s lanes");
typedef int32_t LaneIndex __attribute__((vector_size(KEY_BLOCK * sizeof(int32_t))));

// The score of a query head against one key row, in place: lane j sums dims j,
// j + 16, ... (a short last chunk adds to its first lanes only).
template <typename T>
inline float score_in_place(const float* q, const T* k, int64_t dim, float scale) {
  Lanes acc = {};
  int64_t i = 0;
  for (; i + LANES <= dim; i += LANES) acc += load_lanes(q + i, LANES) * load_row(k + i, LANES);
  if (i < dim) {
    const int64_t rest = dim - i;
    const Lanes summed = acc + load_lanes(q + i, rest) * load_row(k + i, rest);
    const LaneIndex lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    acc = lane < static_cast<int32_t>(rest) ? summed : acc;
  }
  return fold(acc) * scale;
}

// The scores of U query heads (heads[0..U), each at q + offset(head)) for one
// transposed block of KEY_BLOCK keys (keys_t [D][KEY_BLOCK]), stored at scores +
// head * stride: score_in_place's additions with the keys across the lanes. The
// fold's tree is walked depth first (node<J, W> sums lanes J, J + W, ... as the
// tree does), so only a few partial sums a head are live at once, and each row of
// the block is read once for all U heads.
template <int U>
struct BlockScores {
  const float* query[U];
  const float* keys_t;
  int64_t dim;

  // Lane j: the products of dims j, j + 16, ... in order.
  void lane(int64_t j, Lanes* out) const {
    for (int u = 0; u < U; ++u) out[u] = Lanes{};
    for (int64_t d = j; d < dim; d += LANES) {
      const Lanes row = load_lanes(keys_t + d * KEY_BLOCK, KEY_BLOCK);
      for (int u = 0; u < U; ++u) out[u] += query[u][d] * row;
    }
  }

  template <int J, int W>
  void node(Lanes* out) const {
    if constexpr (W == LANES) {
      lane(J, out);
    } else {
      Lanes right[U];
      node<J, 2 * W>(out);
      node<J + W, 2 * W>(right);
      for (int u = 0; u < U; ++u) out[u] += right[u];
    }
  }
};

template <int U, typename Offset>
inline void score_block(const float* q, const int64_t* heads, const Offset& offset,
                        const float* keys_t, int64_t dim, float scale, float* scores,
                        int64_t stride) {
  BlockScores<U> block{{}, keys_t, dim};
  for (int u = 0; u < U; ++u) block.query[u] = q + offset(heads[u]);
  Lanes sums[U];
  block.template node<0, 1>(sums);
  for (int u = 0; u < U; ++u) {
    sums[u] *= scale;
    std::memcpy(scores + heads[u] * stride, &sums[u], sizeof(Lanes));
  }
}

// out[d] = sum over keys k < seen, in order, of p[k] * values[k][d]: 64 dims at a
// time in four registers (four independent chains), then 16, then one. Every
// element is the same chain of multiply-adds in every branch.
template <typename T>
inline void weighted_values(const float* p, int64_t seen, const T* const* values, int64_t dim,
                            float* out) {
  int64_t d0 = 0;
  for (; d0 + 4 * KEY_BLOCK <= dim; d0 += 4 * KEY_BLOCK) {
    Lanes a[4] = {};
    for (int64_t key = 0; key < seen; ++key) {
      const T* v = values[key] + d0;
      for (int u = 0; u < 4; ++u) a[u] += p[key] * load_row(v + u * KEY_BLOCK, LANES);
    }
    std::memcpy(out + d0, a, sizeof(a));
  }
  for (; d0 + KEY_BLOCK <= dim; d0 += KEY_BLOCK) {
    Lanes a = {};
    for (int64_t key = 0; key < seen; ++key) a += p[key] * load_row(values[key] + d0, LANES);
    std::memcpy(out + d0, &a, sizeof(a));
  }
  for (; d0 < dim; ++d0) {
    float a = 0.0f;
    for (int64_t key = 0; key < seen; ++key) a += p[key] * as_float(values[key][d0]);
    out[d0] = a;
  }
}

// A key row, widened, transposed into column j of keys_t [D][KEY_BLOCK].
template <typename T>
inline void transpose_key(const T* k, int64_t dim, int64_t j, float* keys_t) {
  for (int64_t d0 = 0; d0 < dim; d0 += LANES) {
    const int64_t count = std::min<int64_t>(LANES, dim - d0);
    const Lanes row = load_row(k + d0, count);
    for (int64_t e = 0; e < count; ++e) keys_t[(d0 + e) * KEY_BLOCK + j] = row[e];
  }
}
}  // namespace

at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& rows, const at::Tensor& query_pos, double scale) {
  const at::Tensor q = float_input(q_in, "q");
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "caches do not match");
  check_index(block_tables, "block_tables");
  check_index(rows, "rows");
  check_index(query_pos, "query_pos");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q [N, Hq, D] and caches [blocks, block_size, Hkv, D] expected");
  const int64_t tokens = q.size(0), q_heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), blocks = k_cache.size(0);
  TORCH_CHECK(k_cache.size(3) == dim && q_heads % kv_heads == 0, "q and the caches do not fit");
  TORCH_CHECK(block_tables.dim() == 2 && rows.numel() == tokens && query_pos.numel() == tokens,
              "one row and position a token, tables [rows, blocks]");
  const int64_t group = q_heads / kv_heads, table_width = block_tables.size(1);
  const int64_t* table = block_tables.data_ptr<int64_t>();
  const int64_t* row_of = rows.data_ptr<int64_t>();
  const int64_t* pos = query_pos.data_ptr<int64_t>();
  // Tiles: runs of up to QUERY_TILE consecutive tokens of one row.
  std::vector<int64_t> tile_start;
  int64_t longest = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(row_of[t] >= 0 && row_of[t] < block_tables.size(0), "row outside the tables");
    TORCH_CHECK(pos[t] < table_width * block_size, "position past the row's table");
    for (int64_t b = 0; pos[t] >= 0 && b <= pos[t] / block_size; ++b) {
      const int64_t block = table[row_of[t] * table_width + b];
      TORCH_CHECK(block >= 0 && block < blocks, "block ", block, " outside the cache");
    }
    longest = std::max(longest, pos[t] + 1);
    if (tile_start.empty() || row_of[t] != row_of[tile_start.back()] ||
        t - tile_start.back() == QUERY_TILE) {
      tile_start.push_back(t);
    }
  }
  const int64_t tiles = static_cast<int64_t>(tile_start.size());
  tile_start.push_back(tokens);
  at::Tensor out = q.new_zeros(q.sizes());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float scalef = static_cast<float>(scale);
  const int64_t slot_stride = kv_heads * dim;
  const int64_t padded = (longest + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
  auto attend = [&](const auto* kp, const auto* vp) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(kp)>>;
    at::parallel_for(0, tiles * kv_heads, 1, [&](int64_t begin, int64_t end) {
      const int64_t most = QUERY_TILE * group;  // query heads of a tile
      std::vector<float> scores(static_cast<size_t>(most * padded));
      std::vector<float> acc(static_cast<size_t>(most * dim));
      std::vector<float> keys_t(static_cast<size_t>(dim * KEY_BLOCK));  // [D][KEY_BLOCK]
      std::vector<int64_t> seen_of(static_cast<size_t>(most));
      std::vector<int64_t> active(static_cast<size_t>(most));
      std::vector<const T*> values(static_cast<size_t>(padded));  // a key's value row
      for (int64_t task = begin; task < end; ++task) {
        const int64_t tile = task / kv_heads, g = task % kv_heads;
        const int64_t first = tile_start[tile], count = tile_start[tile + 1] - first;
        const int64_t* blocks_of_row = table + row_of[first] * table_width;
        auto slot_of = [&](int64_t key) {
          return blocks_of_row[key / block_size] * block_size + key % block_size;
        };
        int64_t reach = 0;  // keys the tile's furthest query sees
        for (int64_t i = 0; i < count; ++i) {
          for (int64_t h = 0; h < group; ++h) seen_of[i * group + h] = std::max<int64_t>(pos[first + i] + 1, 0);
          reach = std::max(reach, pos[first + i] + 1);
        }
        const int64_t heads = count * group;
        // Where query head qh of the tile (and its output) starts in q (and out).
        auto head_offset = [&](int64_t qh) {
          return ((first + qh / group) * q_heads + g * group + qh % group) * dim;
        };
        if (count == 1) {
          // A lone query: each key row read in place for each of its query heads.
          for (int64_t key = 0; key < reach; ++key) {
            const T* k = kp + slot_of(key) * slot_stride + g * dim;
            for (int64_t qh = 0; qh < heads; ++qh) {
              scores[qh * padded + key] = score_in_place(qp + head_offset(qh), k, dim, scalef);
            }
          }
        } else {
          // A tile: a block of keys at a time, transposed once for all its query heads.
          for (int64_t base = 0; base < reach; base += KEY_BLOCK) {
            const int64_t width = std::min(KEY_BLOCK, reach - base);
            for (int64_t j = 0; j < KEY_BLOCK; ++j) {
              if (j < width) {
                const T* k = kp + slot_of(base + j) * slot_stride + g * dim;
                transpose_key(k, dim, j, keys_t.data());
              } else {
                for (int64_t d = 0; d < dim; ++d) keys_t[d * KEY_BLOCK + j] = 0.0f;
              }
            }
            // The query heads that see this block, four at a time, then one at a time.
            int64_t live = 0;
            for (int64_t qh = 0; qh < heads; ++qh) {
              if (seen_of[qh] > base) active[live++] = qh;
            }
            int64_t j = 0;
            for (; j + 4 <= live; j += 4) {
              score_block<4>(qp, active.data() + j, head_offset, keys_t.data(), dim, scalef,
                             scores.data() + base, padded);
            }
            for (; j < live; ++j) {
              score_block<1>(qp, active.data() + j, head_offset, keys_t.data(), dim, scalef,
                             scores.data() + base, padded);
            }
          }
        }
        // Softmax of each query head over its own keys (normalized at the end).
        for (int64_t qh = 0; qh < heads; ++qh) {
          const int64_t seen = seen_of[qh];
          if (seen == 0) continue;
          float* s = scores.data() + qh * padded;
          float top = -std::numeric_limits<float>::infinity();
          for (int64_t key = 0; key < seen; ++key) top = std::max(top, s[key]);
          for (int64_t key = 0; key < seen; ++key) s[key] = fast_exp(s[key] - top);
        }
        // Values: each query head's sum over its keys in order, in registers (the tile's
        // values stay in cache between its query heads).
        for (int64_t key = 0; key < reach; ++key) {
          values[key] = vp + slot_of(key) * slot_stride + g * dim;
        }
        for (int64_t qh = 0; qh < heads; ++qh) {
          weighted_values(scores.data() + qh * padded, seen_of[qh], values.data(), dim,
                          acc.data() + qh * dim);
        }
        for (int64_t qh = 0; qh < heads; ++qh) {
          const int64_t seen = seen_of[qh];
          if (seen == 0) continue;
          const float inv = 1.0f / sum(scores.data() + qh * padded, seen);
          float* o = op + head_offset(qh);
          const float* a = acc.data() + qh * dim;
          for (int64_t d = 0; d < dim; ++d) o[d] = a[d] * inv;
        }
      }
    });
  };
  if (k_cache.scalar_type() == at::kHalf) {
    attend(reinterpret_cast<const Half*>(k_cache.data_ptr<at::Half>()),
           reinterpret_cast<const Half*>(v_cache.data_ptr<at::Half>()));
  } else {
    attend(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  }
  return out;
}
