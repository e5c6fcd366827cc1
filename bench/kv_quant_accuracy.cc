// How far the attention output moves when the KV cache stores 8-bit (or
// bf16) values instead of f32: the relative L2 error against the same cache
// in f32, for the storage types the caches offer, on Gaussian keys and on
// keys with outlier channels, for a GQA layer (KVCache) and an absorbed MLA
// layer (PagedKVCache's latent layout). The table in docs/QUANTIZATION.md
// comes from this program; public API only, no timing.
//
// Inputs, per trial (seeded; medians over the trials are printed):
//   GQA   8 query heads over 2 kv heads, head_dim 128, 2048 tokens through
//         KVCache::attend in one causal call; the last 16 query rows (which
//         see ~2048 keys) are compared. Values Gaussian. Keys Gaussian, or
//         with 6 outlier channels of constant sign and magnitude 15 placed
//         before RoPE in the lower-frequency half of the rotate-half pairs
//         (KIVI's and KVQuant's observation), then rotated at positions
//         0..2047 with theta 500000 (Llama 3) or 10000.
//   MLA   16 heads on DeepSeek-V3's latent rows: c (512) with per-channel
//         gains exp(N(0, 0.7)) (the RMSNorm weights' spread; 0 for
//         "Gaussian") and a 64-wide rope key (outliers as above, theta
//         10000); queries absorbed (576 wide), softmax scale 1/sqrt(192).
// Queries are scaled so that the scores' standard deviation is 3: peaked
// attention, where errors in the largest scores matter.
//
//   build/bench/kv_quant_accuracy [trials]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "attnkit/kv_cache.h"
#include "attnkit/paged_kv_cache.h"

namespace {

using attnkit::DType;

constexpr DType kTypes[] = {DType::kBF16, DType::kI8, DType::kFp8E4M3};
constexpr int64_t kTokens = 2048, kCompared = 16;

// Rotate-half RoPE of x [n, d] at positions 0..n-1, in place.
void rope(std::vector<float>& x, int64_t n, int64_t d, double theta) {
  const int64_t h = d / 2;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < h; ++i) {
      const double a = static_cast<double>(t) * std::pow(theta, -2.0 * i / d);
      float& lo = x[t * d + i];
      float& hi = x[t * d + i + h];
      const double l = lo, r = hi;
      lo = static_cast<float>(l * std::cos(a) - r * std::sin(a));
      hi = static_cast<float>(l * std::sin(a) + r * std::cos(a));
    }
}

// Keys [n, d]: Gaussian, plus (theta > 0) 6 constant-sign outlier channels
// of magnitude 15 in the lower-frequency half of the pairs, then RoPE.
std::vector<float> keys(std::mt19937_64& rng, int64_t n, int64_t d, double theta) {
  std::normal_distribution<float> normal;
  std::vector<float> k(static_cast<size_t>(n * d));
  for (float& x : k) x = normal(rng);
  if (theta <= 0) return k;
  const int64_t h = d / 2;
  std::uniform_int_distribution<int64_t> pair(h / 2, h - 1);
  std::bernoulli_distribution coin;
  for (int o = 0; o < 6; ++o) {
    const int64_t c = pair(rng) + (coin(rng) ? h : 0);
    const float sign = coin(rng) ? 15.0f : -15.0f;
    for (int64_t t = 0; t < n; ++t) k[t * d + c] += sign;
  }
  rope(k, n, d, theta);
  return k;
}

// Scales q in place so that the scores q.k * scale have standard deviation 3.
void sharpen(std::vector<float>& q, int64_t rows, const std::vector<float>& k, int64_t n, int64_t d,
             double scale) {
  double sum = 0, sum2 = 0;
  int64_t count = 0;
  for (int64_t r = 0; r < rows; r += 7)
    for (int64_t j = 0; j < n; j += 5) {
      double s = 0;
      for (int64_t c = 0; c < d; ++c) s += double(q[r * d + c]) * k[j * d + c];
      s *= scale;
      sum += s;
      sum2 += s * s;
      ++count;
    }
  const double sd = std::sqrt(sum2 / count - (sum / count) * (sum / count));
  for (float& x : q) x = static_cast<float>(x * 3.0 / sd);
}

double rel_l2(const std::vector<float>& a, const std::vector<float>& b, size_t from) {
  double num = 0, den = 0;
  for (size_t i = from; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / den);
}

// GQA through KVCache: returns out [kTokens, heads, d] for `dtype`.
std::vector<float> gqa_out(DType dtype, const std::vector<float>& q, const std::vector<float>& k,
                           const std::vector<float>& v, int64_t heads, int64_t kv_heads,
                           int64_t d) {
  auto cache = attnkit::KVCache::create({1, kTokens, kv_heads, d, 0, dtype, 0});
  if (!cache.ok()) std::abort();
  std::vector<float> out(static_cast<size_t>(kTokens * heads * d));
  const attnkit::Status st =
      cache->attend(attnkit::make_view(q.data(), DType::kF32, {1, kTokens, heads, d}),
                    attnkit::make_view(k.data(), DType::kF32, {1, kTokens, kv_heads, d}),
                    attnkit::make_view(v.data(), DType::kF32, {1, kTokens, kv_heads, d}),
                    attnkit::make_view(out.data(), DType::kF32, {1, kTokens, heads, d}));
  if (!st.ok()) std::abort();
  return out;
}

// Absorbed MLA over a latent pool: out [kTokens, heads, 512] for `dtype`.
std::vector<float> mla_out(DType dtype, const std::vector<float>& qa,
                           const std::vector<float>& latent, int64_t heads) {
  attnkit::PagedKVCacheSpec s;
  s.num_pages = kTokens / 16;
  s.kv_lora_rank = 512;
  s.qk_rope_head_dim = 64;
  s.dtype = dtype;
  auto pool = attnkit::PagedKVCache::create(s);
  if (!pool.ok()) std::abort();
  const int64_t id = pool->add_sequence();
  const int64_t ids[1] = {id}, counts[1] = {kTokens};
  const int32_t cu[2] = {0, static_cast<int32_t>(kTokens)};
  if (!pool->append(ids, counts).ok()) std::abort();
  std::vector<float> out(static_cast<size_t>(kTokens * heads * 512));
  attnkit::AttentionOptions o;
  o.softmax_scale = static_cast<float>(1.0 / std::sqrt(192.0));
  const attnkit::Status st =
      pool->attend(0, attnkit::make_view(qa.data(), DType::kF32, {kTokens, heads, 576}),
                   attnkit::make_view(latent.data(), DType::kF32, {kTokens, 1, 576}), {}, cu, ids,
                   attnkit::make_view(out.data(), DType::kF32, {kTokens, heads, 512}), o);
  if (!st.ok()) std::abort();
  return out;
}

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int trials = argc > 1 ? std::max(1, std::atoi(argv[1])) : 8;
  std::printf("relative L2 error of the attention output against the f32 cache, median of %d\n",
              trials);
  std::printf("| layer | keys | bf16 | int8 | fp8_e4m3 |\n|---|---|---|---|---|\n");
  struct Case {
    const char* layer;
    const char* keys;
    double theta;  // 0: Gaussian keys
  };
  const Case cases[] = {{"GQA 8/2, d 128", "Gaussian", 0},
                        {"GQA 8/2, d 128", "outliers, RoPE theta 5e5", 500000},
                        {"GQA 8/2, d 128", "outliers, RoPE theta 1e4", 10000},
                        {"MLA 16 heads, 512 + 64", "Gaussian", 0},
                        {"MLA 16 heads, 512 + 64", "channel gains, rope outliers", 10000}};
  for (const Case& c : cases) {
    std::vector<double> err[3];
    for (int t = 0; t < trials; ++t) {
      std::mt19937_64 rng(1000 * t + 17);
      std::normal_distribution<float> normal;
      std::vector<float> ref, got[3];
      const bool mla = std::string(c.layer).rfind("MLA", 0) == 0;
      size_t from = 0;
      if (!mla) {
        const int64_t heads = 8, kv_heads = 2, d = 128;
        // Keys per kv head, then interleaved as [token, kv head, d].
        std::vector<float> k(static_cast<size_t>(kTokens * kv_heads * d));
        for (int64_t g = 0; g < kv_heads; ++g) {
          const std::vector<float> kg = keys(rng, kTokens, d, c.theta);
          for (int64_t j = 0; j < kTokens; ++j)
            std::copy_n(kg.begin() + j * d, d, k.begin() + (j * kv_heads + g) * d);
        }
        std::vector<float> v(k.size()), q(static_cast<size_t>(kTokens * heads * d));
        for (float& x : v) x = normal(rng);
        for (float& x : q) x = normal(rng);
        sharpen(q, kTokens * heads, k, kTokens * kv_heads, d, 1.0 / std::sqrt(double(d)));
        ref = gqa_out(DType::kF32, q, k, v, heads, kv_heads, d);
        for (int i = 0; i < 3; ++i) got[i] = gqa_out(kTypes[i], q, k, v, heads, kv_heads, d);
        from = static_cast<size_t>((kTokens - kCompared) * heads * d);
      } else {
        const int64_t heads = 16;
        std::vector<float> latent(static_cast<size_t>(kTokens * 576));
        std::normal_distribution<float> gain_log(0.0f, c.theta > 0 ? 0.7f : 0.0f);
        std::vector<float> gain(512);
        for (float& g : gain) g = std::exp(gain_log(rng));
        const std::vector<float> kr = keys(rng, kTokens, 64, c.theta);
        for (int64_t j = 0; j < kTokens; ++j) {
          for (int64_t x = 0; x < 512; ++x) latent[j * 576 + x] = normal(rng) * gain[x];
          std::copy_n(kr.begin() + j * 64, 64, latent.begin() + j * 576 + 512);
        }
        std::vector<float> qa(static_cast<size_t>(kTokens * heads * 576));
        for (float& x : qa) x = normal(rng);
        sharpen(qa, kTokens * heads, latent, kTokens, 576, 1.0 / std::sqrt(192.0));
        ref = mla_out(DType::kF32, qa, latent, heads);
        for (int i = 0; i < 3; ++i) got[i] = mla_out(kTypes[i], qa, latent, heads);
        from = static_cast<size_t>((kTokens - kCompared) * heads * 512);
      }
      for (int i = 0; i < 3; ++i) err[i].push_back(rel_l2(got[i], ref, from));
    }
    std::printf("| %s | %s | %.2e | %.2e | %.2e |\n", c.layer, c.keys, median(err[0]),
                median(err[1]), median(err[2]));
  }
  return 0;
}
