// bf16 weights kept as bf16 against f32 weights, in a Llama-3-8B attention
// layer (hidden 4096, 32 query heads and 8 kv heads of 128, RoPE theta
// 5e5): the bytes a layer keeps, and the time of a serving step through it
// (AttentionLayer::forward_batch over a paged pool, bf16 KV), as the ratio
// f32 time / bf16 time, median [quartiles] of pairs alternated in one
// process so that the machine's moment-to-moment speed cancels out.
//
//   decode    `batch` sequences of 1024 cached tokens each decode one token
//   prefill   one sequence's 512-token prompt chunk
//
// Each dtype's step runs through copies of the layer totalling >= 1 GiB of
// weights (the pool has one layer per copy), as a model's 32 layers do, so
// that every layer's weights come from memory, not from the last-level
// cache. Public API only; no benchmark framework.
//
//   build/bench/weight_dtype_bench [threads, default 2] [pairs, default 15]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attention_layer.h"
#include "attnkit/machine.h"
#include "attnkit/paged_kv_cache.h"
#include "bench_stats.h"

namespace {

using attnkit::DType;
using attnkit::PagedKVCache;
using Clock = std::chrono::steady_clock;

constexpr int64_t kHidden = 4096, kHeads = 32, kKvHeads = 8, kDim = 128, kPage = 16;
constexpr int64_t kContext = 1024, kPrompt = 512;
constexpr size_t kRotateBytes = size_t{1} << 30;

void check(const attnkit::Status& st, const char* what) {
  if (st.ok()) return;
  std::fprintf(stderr, "weight_dtype_bench: %s: %s\n", what, st.to_string().c_str());
  std::exit(1);
}

attnkit::AttentionConfig llama3_8b() {
  attnkit::AttentionConfig c;
  c.model_type = "llama";
  c.hidden_size = kHidden;
  c.num_heads = kHeads;
  c.num_kv_heads = kKvHeads;
  c.head_dim = kDim;
  c.rope.head_dim = kDim;
  c.rope.theta = 500000.0;
  return c;
}

// The layer's copies, in one dtype, and a pool with one layer per copy.
struct Stack {
  std::vector<attnkit::AttentionLayer> layers;
  size_t layer_bytes = 0;
};

Stack make_stack(DType dtype, std::mt19937& rng) {
  const attnkit::AttentionConfig c = llama3_8b();
  const int64_t q = kHeads * kDim, kv = kKvHeads * kDim;
  const struct {
    const char* name;
    int64_t rows, cols;
  } mats[] = {{"q_proj.weight", q, kHidden},
              {"k_proj.weight", kv, kHidden},
              {"v_proj.weight", kv, kHidden},
              {"o_proj.weight", kHidden, q}};
  // The same values for both dtypes: bf16-representable, as a bf16
  // checkpoint's.
  std::vector<std::vector<float>> f32(4);
  std::vector<std::vector<attnkit::bf16>> b16(4);
  attnkit::WeightMap map;
  for (size_t i = 0; i < 4; ++i) {
    std::uniform_real_distribution<float> u(-0.015f, 0.015f);
    for (int64_t e = 0; e < mats[i].rows * mats[i].cols; ++e) {
      b16[i].push_back(attnkit::float_to_bf16(u(rng)));
      f32[i].push_back(attnkit::bf16_to_float(b16[i].back()));
    }
    map[mats[i].name] =
        dtype == DType::kBF16
            ? attnkit::make_view(b16[i].data(), DType::kBF16, {mats[i].rows, mats[i].cols})
            : attnkit::make_view(f32[i].data(), DType::kF32, {mats[i].rows, mats[i].cols});
  }
  Stack s;
  for (const auto& m : mats) s.layer_bytes += size_t(m.rows * m.cols) * attnkit::dtype_size(dtype);
  const size_t copies = (kRotateBytes + s.layer_bytes - 1) / s.layer_bytes;
  for (size_t i = 0; i < copies; ++i) {
    auto layer = attnkit::AttentionLayer::create(c);
    check(layer.status(), "create");
    check(layer->load_weights(map), "load_weights");
    s.layers.push_back(std::move(layer).value());
  }
  return s;
}

// `batch` sequences of `cached` tokens (random K/V stored) in a pool with
// one layer per copy of the stack.
struct Batch {
  PagedKVCache pool;
  std::vector<int64_t> ids;
};

Batch make_batch(const Stack& s, int64_t batch, int64_t cached, int64_t new_tokens,
                 std::mt19937& rng) {
  const int64_t pages = batch * ((cached + new_tokens + kPage - 1) / kPage + 1);
  auto pool = s.layers[0].new_paged_cache(pages, kPage, static_cast<int64_t>(s.layers.size()),
                                          DType::kBF16);
  check(pool.status(), "pool");
  Batch b{std::move(pool).value(), {}};
  std::vector<float> kv(size_t(std::max<int64_t>(cached, 1) * kKvHeads * kDim));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (float& x : kv) x = u(rng);
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t id = b.pool.add_sequence();
    b.ids.push_back(id);
    if (cached == 0) continue;
    check(b.pool.append(std::vector<int64_t>{id}, std::vector<int64_t>{cached}), "append");
    const auto view = attnkit::make_view(kv.data(), DType::kF32, {cached, kKvHeads, kDim});
    for (size_t l = 0; l < s.layers.size(); ++l)
      check(b.pool.store(static_cast<int64_t>(l), view, view,
                         std::vector<int32_t>{0, static_cast<int32_t>(cached)},
                         std::vector<int64_t>{id}),
            "store");
  }
  return b;
}

// One step through every copy: `tokens` new tokens per sequence, then
// truncated back so that every step sees the same cache. Returns seconds
// per layer.
double step(Stack& s, Batch& b, int64_t cached, int64_t tokens, std::vector<float>& x,
            std::vector<float>& out, const attnkit::RunOptions& run) {
  const int64_t n = static_cast<int64_t>(b.ids.size()), total = n * tokens;
  std::vector<int32_t> cu{0};
  for (int64_t i = 0; i < n; ++i) cu.push_back(cu.back() + static_cast<int32_t>(tokens));
  const auto t0 = Clock::now();
  check(b.pool.append(b.ids, std::vector<int64_t>(size_t(n), tokens)), "append");
  for (size_t l = 0; l < s.layers.size(); ++l)
    check(s.layers[l].forward_batch(attnkit::make_view(x.data(), DType::kF32, {total, kHidden}), cu,
                                    b.ids, b.pool, static_cast<int64_t>(l),
                                    attnkit::make_view(out.data(), DType::kF32, {total, kHidden}),
                                    run),
          "forward_batch");
  for (int64_t id : b.ids) check(b.pool.truncate(id, cached), "truncate");
  return std::chrono::duration<double>(Clock::now() - t0).count() /
         static_cast<double>(s.layers.size());
}

void report(const char* what, int pairs, Stack& f32, Stack& bf16, int64_t batch, int64_t cached,
            int64_t tokens, const attnkit::RunOptions& run, std::mt19937& rng) {
  Batch bf = make_batch(f32, batch, cached, tokens, rng);
  Batch bb = make_batch(bf16, batch, cached, tokens, rng);
  std::vector<float> x(size_t(batch * tokens * kHidden)), out(x.size());
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (float& v : x) v = u(rng);
  step(f32, bf, cached, tokens, x, out, run);  // warm-up: JIT, page faults
  step(bf16, bb, cached, tokens, x, out, run);
  std::vector<double> ratios, tf, tb;
  for (int p = 0; p < pairs; ++p) {
    double a, b;
    if (p % 2 == 0) {
      a = step(f32, bf, cached, tokens, x, out, run);
      b = step(bf16, bb, cached, tokens, x, out, run);
    } else {
      b = step(bf16, bb, cached, tokens, x, out, run);
      a = step(f32, bf, cached, tokens, x, out, run);
    }
    ratios.push_back(a / b);
    tf.push_back(a);
    tb.push_back(b);
  }
  std::sort(ratios.begin(), ratios.end());
  const size_t n = ratios.size();
  std::printf("  %-34s %7.2f ms %7.2f ms   %.2f [%.2f, %.2f]\n", what,
              attnkit::bench::median(tf) * 1e3, attnkit::bench::median(tb) * 1e3, ratios[n / 2],
              ratios[n / 4], ratios[3 * n / 4]);
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const int pairs = argc > 2 ? std::atoi(argv[2]) : 15;
  if (threads < 1 || pairs < 1) {
    std::fprintf(stderr, "usage: weight_dtype_bench [threads >= 1] [pairs >= 1]\n");
    return 2;
  }
  std::mt19937 rng(7);
  Stack f32 = make_stack(DType::kF32, rng), bf16 = make_stack(DType::kBF16, rng);
  std::printf("weight_dtype_bench: %s, %d threads, f32 weights %s; bf16 weights %s\n",
              attnkit::bench::cpu_name().c_str(), threads,
              attnkit::gemm_backend_name(DType::kF32).c_str(),
              attnkit::gemm_backend_name(DType::kBF16).c_str());
  std::printf(
      "Llama-3-8B attention layer: weights f32 %.1f MiB, bf16 %.1f MiB (%.3fx); %zu and "
      "%zu copies rotated\n",
      double(f32.layer_bytes) / (1 << 20), double(bf16.layer_bytes) / (1 << 20),
      double(bf16.layer_bytes) / double(f32.layer_bytes), f32.layers.size(), bf16.layers.size());
  std::printf("  %-34s %10s %10s   %s\n", "step (per layer, bf16 KV)", "f32 w", "bf16 w",
              "f32/bf16 [quartiles]");
  const attnkit::RunOptions run{attnkit::Backend::kAuto, threads};
  report("decode, batch 1, 1024 cached", pairs, f32, bf16, 1, kContext, 1, run, rng);
  report("decode, batch 8, 1024 cached", pairs, f32, bf16, 8, kContext, 1, run, rng);
  report("decode, batch 32, 1024 cached", pairs, f32, bf16, 32, kContext, 1, run, rng);
  report("prefill, one 512-token chunk", std::max(3, pairs / 3), f32, bf16, 1, 0, kPrompt, run,
         rng);
  return 0;
}
