// The seeded race of engine/sampling.py over the tokens that can win
// (engine/sampling_cpu.py's), for rows without top-k, top-p or a repetition
// penalty, in two passes over each row's logits: its maximum, then the tokens
// within the noise's reach of it. In torch the same draw is some thirty calls,
// each a pass over the vocabulary or a dispatch (~1 ms a step at one row); here
// it is ~50 us.
//
// The arithmetic is sampling.py's: SplitMix64 in wrapping 64-bit integers, u =
// (top 23 bits + 0.5) / 2^23, noise log(-log u), score = logit / T - noise, the
// winner the lowest token id of the best score. The float steps are the same
// IEEE operations (a division, a subtraction, libm's logf), so a draw is the
// torch race's token; only a tie to the last bit between two candidates' scores
// could come out otherwise where torch's vectorized log rounds differently.

#include "native.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <limits>

namespace {

constexpr uint64_t GOLDEN = 0x9E3779B97F4A7C15ull;
constexpr uint64_t MIX1 = 0xBF58476D1CE4E5B9ull;
constexpr uint64_t MIX2 = 0x94D049BB133111EBull;

// sampling.row_keys: the mix of (seed, index), a non-negative int63.
uint64_t row_key(int64_t seed, int64_t index) {
  uint64_t z = static_cast<uint64_t>(seed) * GOLDEN + static_cast<uint64_t>(index + 1) * MIX1;
  z = (z ^ (z >> 30)) * MIX1;
  z = (z ^ (z >> 27)) * MIX2;
  return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFFull;
}

// sampling.token_noise: log(-log u) of the row's key and a token id.
float token_noise(uint64_t key, int64_t token) {
  uint64_t z = key + static_cast<uint64_t>(token + 1) * GOLDEN;
  z = (z ^ (z >> 30)) * MIX1;
  z = (z ^ (z >> 27)) * MIX2;
  const float uniform = (static_cast<float>(z >> 41) + 0.5f) * (1.0f / 8388608.0f);
  return std::log(-std::log(uniform));
}

using wsinfer::LANES;

// The row's largest logit (NaN if it holds one), lanes then a fold.
float row_max(const float* x, int64_t n) {
  float lanes[LANES];
  for (int64_t j = 0; j < LANES; ++j) lanes[j] = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    for (int64_t j = 0; j < LANES; ++j) {
      nan |= x[i + j] != x[i + j];
      lanes[j] = x[i + j] > lanes[j] ? x[i + j] : lanes[j];
    }
  }
  for (int64_t j = 0; i + j < n; ++j) {
    nan |= x[i + j] != x[i + j];
    lanes[j] = x[i + j] > lanes[j] ? x[i + j] : lanes[j];
  }
  float top = lanes[0];
  for (int64_t j = 1; j < LANES; ++j) top = lanes[j] > top ? lanes[j] : top;
  return nan ? std::numeric_limits<float>::quiet_NaN() : top;
}

int64_t first_index_of(const float* x, int64_t n, float value) {
  for (int64_t i = 0; i < n; ++i) {
    if (x[i] == value) return i;
  }
  return n - 1;
}

// One row's token: the argmax for a greedy row (temperature <= 0), else the race;
// -1 where the row has no finite maximum (the caller runs the full race).
int64_t draw(const float* logits, int64_t vocab, float temperature, int64_t seed, int64_t index,
             float noise_low) {
  const float top_logit = row_max(logits, vocab);
  if (!std::isfinite(top_logit)) return -1;
  const int64_t leader = first_index_of(logits, vocab, top_logit);
  if (!(temperature > 0.0f)) return leader;
  // Division is monotone: the largest scaled logit is the largest logit scaled.
  const float top = top_logit / temperature;
  const uint64_t key = row_key(seed, index);
  // sampling_cpu's line: no token below it can reach the leader's own score.
  const float floor = top - token_noise(key, leader);
  const float cutoff = floor + noise_low - (0.01f + 1e-3f * std::fabs(top));
  float best = -std::numeric_limits<float>::infinity();
  int64_t winner = vocab - 1;
  int64_t i = 0;
  auto consider = [&](int64_t token) {
    const float scaled = logits[token] / temperature;
    if (!(scaled >= cutoff)) return;
    const float score = scaled - token_noise(key, token);
    if (score > best) best = score, winner = token;  // in id order: the lowest id of a tie
  };
  for (; i + LANES <= vocab; i += LANES) {
    bool any = false;  // a block of 16 with no candidate costs one vector compare
    for (int64_t j = 0; j < LANES; ++j) any |= logits[i + j] / temperature >= cutoff;
    if (!any) continue;
    for (int64_t j = 0; j < LANES; ++j) consider(i + j);
  }
  for (; i < vocab; ++i) consider(i);
  return winner;
}

}  // namespace

// logits [B, V] float32; temperature [B] float32; seed, index [B] int64. Returns the
// rows' tokens [B] int64, or None when a row has no finite maximum.
c10::optional<at::Tensor> seeded_race(const at::Tensor& logits_in, const at::Tensor& temperature_in,
                                      const at::Tensor& seed_in, const at::Tensor& index_in,
                                      double noise_low) {
  TORCH_CHECK(logits_in.device().is_cpu() && logits_in.scalar_type() == at::kFloat &&
                  logits_in.dim() == 2,
              "logits must be [rows, vocab] float32 on the CPU");
  const int64_t rows = logits_in.size(0), vocab = logits_in.size(1);
  TORCH_CHECK(vocab > 0, "logits over an empty vocabulary");
  TORCH_CHECK(temperature_in.scalar_type() == at::kFloat && temperature_in.numel() == rows,
              "one float32 temperature a row");
  TORCH_CHECK(seed_in.scalar_type() == at::kLong && seed_in.numel() == rows &&
                  index_in.scalar_type() == at::kLong && index_in.numel() == rows,
              "one int64 seed and token index a row");
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor temperature = temperature_in.contiguous();
  const at::Tensor seed = seed_in.contiguous(), index = index_in.contiguous();
  at::Tensor tokens = seed.new_empty({rows});
  const float* lp = logits.data_ptr<float>();
  const float* tp = temperature.data_ptr<float>();
  const int64_t* sp = seed.data_ptr<int64_t>();
  const int64_t* ip = index.data_ptr<int64_t>();
  int64_t* out = tokens.data_ptr<int64_t>();
  const float low = static_cast<float>(noise_low);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      out[r] = draw(lp + r * vocab, vocab, tp[r], sp[r], ip[r], low);
    }
  });
  for (int64_t r = 0; r < rows; ++r) {
    if (out[r] < 0) return c10::nullopt;
  }
  return tokens;
}
