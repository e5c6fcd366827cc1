// Batch invariance of PagedKVCache::attend on the fast kernels (issue 34:
// prefix caching must never change an output bit). A query row's output
// must be a function of that row, its keys and the options only: the same
// bits whether the sequence's rows are computed in one call, as a prefix
// plus a suffix of 1-77 rows (what a prefix-cache hit does), token by
// token, inside a ragged batch of other sequences, or with 1 or 2 threads.
// Every SIMD target the CPU has runs (the plan's tile sizes differ by
// target); the one-call rows are also held to the reference backend.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attnkit/paged_kv_cache.h"
#include "common/attention_bounds.h"
#include "common/random.h"
#include "core/cpu_features.h"

namespace {

using attnkit::Backend;
using attnkit::DType;
using attnkit::PagedKVCache;
using attnkit::PagedKVCacheSpec;

struct Shape {
  const char* name;
  int64_t num_heads, num_kv_heads, head_dim, head_dim_v;
  int64_t window_left = -1;  // options.window_size.left
};

// A sequence's queries, keys and values at every position: q [len, H, D],
// k [len, Hkv, D], v [len, Hkv, Dv].
struct Seq {
  int64_t len = 0;
  std::vector<float> q, k, v;
};

Seq make_seq(const Shape& sh, int64_t len, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  Seq s;
  s.len = len;
  for (auto [vec, n] :
       {std::pair{&s.q, sh.num_heads * sh.head_dim}, std::pair{&s.k, sh.num_kv_heads * sh.head_dim},
        std::pair{&s.v, sh.num_kv_heads * sh.head_dim_v}}) {
    vec->resize(size_t(len * n));
    for (float& x : *vec) x = u(rng);
  }
  return s;
}

PagedKVCache make_pool(const Shape& sh, DType dtype) {
  PagedKVCacheSpec s;
  s.num_layers = 1;
  s.num_pages = 512;
  s.page_size = 16;
  s.num_kv_heads = sh.num_kv_heads;
  s.head_dim = sh.head_dim;
  s.head_dim_v = sh.head_dim_v;
  s.dtype = dtype;
  return PagedKVCache::create(s).value();
}

// One attend step: counts[i] new rows of seqs[i] (those after its length in
// the pool) for sequence ids[i]; their output rows [count, H, Dv] are
// appended to (*outs)[i].
void step(const Shape& sh, PagedKVCache& pool, const std::vector<int64_t>& ids,
          const std::vector<const Seq*>& seqs, const std::vector<int64_t>& counts, int threads,
          Backend backend, std::vector<std::vector<float>>* outs) {
  const int64_t H = sh.num_heads, Hkv = sh.num_kv_heads, D = sh.head_dim, Dv = sh.head_dim_v;
  std::vector<int64_t> first;
  for (int64_t id : ids) first.push_back(pool.length(id).value());
  ASSERT_TRUE(pool.append(ids, counts).ok());
  std::vector<int32_t> cu{0};
  for (int64_t c : counts) cu.push_back(cu.back() + int32_t(c));
  const int64_t total = cu.back();
  std::vector<float> q, k, v, o(size_t(total * H * Dv));
  for (size_t i = 0; i < ids.size(); ++i) {
    const Seq& s = *seqs[i];
    ASSERT_LE(first[i] + counts[i], s.len);
    auto take = [&](std::vector<float>& dst, const std::vector<float>& src, int64_t n) {
      dst.insert(dst.end(), src.begin() + first[i] * n, src.begin() + (first[i] + counts[i]) * n);
    };
    take(q, s.q, H * D);
    take(k, s.k, Hkv * D);
    take(v, s.v, Hkv * Dv);
  }
  attnkit::AttentionOptions opt;
  opt.num_threads = threads;
  opt.backend = backend;
  opt.window_size.left = sh.window_left;
  const attnkit::Status st =
      pool.attend(0, attnkit::make_view(q.data(), DType::kF32, {total, H, D}),
                  attnkit::make_view(k.data(), DType::kF32, {total, Hkv, D}),
                  attnkit::make_view(v.data(), DType::kF32, {total, Hkv, Dv}), cu, ids,
                  attnkit::make_view(o.data(), DType::kF32, {total, H, Dv}), opt);
  ASSERT_TRUE(st.ok()) << st.to_string();
  for (size_t i = 0; i < ids.size(); ++i)
    (*outs)[i].insert((*outs)[i].end(), o.begin() + cu[i] * H * Dv, o.begin() + cu[i + 1] * H * Dv);
}

const char* dtype_label(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "bf16";
    case DType::kI8:
      return "int8";
    case DType::kFp8E4M3:
      return "fp8_e4m3";
    default:
      return "f32";
  }
}

// Where two runs of a sequence's rows first differ, or "" if bit-identical.
std::string first_difference(const Shape& sh, const std::vector<float>& a,
                             const std::vector<float>& b) {
  if (a.size() != b.size())
    return "sizes " + std::to_string(a.size()) + " vs " + std::to_string(b.size());
  if (std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0) return "";
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0)
      return "row " + std::to_string(int64_t(i) / (sh.num_heads * sh.head_dim_v)) + ": " +
             std::to_string(a[i]) + " vs " + std::to_string(b[i]);
  return "";
}

TEST(PagedInvariance, RowsAreTheSameBitsHoweverTheSequenceIsChunkedOrBatched) {
  const Shape shapes[] = {{"GQA 8/2 128", 8, 2, 128, 128},
                          {"MHA 4/4 64/32 window 300", 4, 4, 64, 32, 299}};
  const attnkit::SimdTarget best = attnkit::simd_target();
  int trial = 0;
  for (attnkit::SimdTarget target : {attnkit::SimdTarget::kAvx2, attnkit::SimdTarget::kAvx512,
                                     attnkit::SimdTarget::kAvx512Bf16}) {
    if (target > best || !attnkit::set_simd_target(target)) continue;
    for (const Shape& sh : shapes)
      for (DType dtype : {DType::kF32, DType::kBF16, DType::kI8, DType::kFp8E4M3})
        for (int rep = 0; rep < 2; ++rep, ++trial) {
          std::mt19937 rng(1000 + uint32_t(trial));
          // Prefixes around 512 and 1024 (on and off page and split
          // boundaries), suffixes of 1-77 rows; the first trials take the
          // shapes the defect was found with.
          const int64_t prefixes[] = {1024, 512, 600, 1040};
          const int64_t prefix = rep == 0 ? prefixes[trial / 2 % 4]
                                          : std::uniform_int_distribution<int64_t>(
                                                trial % 2 ? 480 : 990, trial % 2 ? 560 : 1060)(rng);
          const int64_t suffix = rep == 0 ? 76 : std::uniform_int_distribution<int64_t>(1, 77)(rng);
          const int64_t len = prefix + suffix;
          SCOPED_TRACE(std::string("target ") + attnkit::simd_target_name(target) + " " + sh.name +
                       " " + dtype_label(dtype) + " prefix " + std::to_string(prefix) + " suffix " +
                       std::to_string(suffix));
          const Seq x = make_seq(sh, len, 7 * uint32_t(trial) + 1);
          const Seq y = make_seq(sh, len + 40, 7 * uint32_t(trial) + 2);
          const Seq z = make_seq(sh, 300, 7 * uint32_t(trial) + 3);

          // (a) All at once, 1 thread: the rows every other way must give.
          std::vector<std::vector<float>> whole(1);
          {
            PagedKVCache pool = make_pool(sh, dtype);
            const int64_t id = pool.add_sequence();
            step(sh, pool, {id}, {&x}, {len}, 1, Backend::kAuto, &whole);
          }
          // The reference twin agrees within the fp32 bound (on the best
          // target only: the reference does not depend on it).
          if (target == best) {
            std::vector<std::vector<float>> ref(1);
            PagedKVCache pool = make_pool(sh, dtype);
            const int64_t id = pool.add_sequence();
            step(sh, pool, {id}, {&x}, {len}, 1, Backend::kReference, &ref);
            EXPECT_TRUE(attnkit_test::all_close(
                "fast vs reference", whole[0], attnkit_test::widen(std::span<const float>(ref[0])),
                attnkit_test::attention_tolerance(sh.head_dim, len, dtype, Backend::kAuto)));
          }
          for (int threads : {1, 2}) {
            SCOPED_TRACE(std::to_string(threads) + " threads");
            // (d) All at once again: the thread count changes nothing.
            {
              std::vector<std::vector<float>> out(1);
              PagedKVCache pool = make_pool(sh, dtype);
              const int64_t id = pool.add_sequence();
              step(sh, pool, {id}, {&x}, {len}, threads, Backend::kAuto, &out);
              EXPECT_EQ(first_difference(sh, whole[0], out[0]), "") << "all at once";
            }
            // vdpbf16ps sums P V over pairs of keys from a task's first
            // key, which under a window is its first row's first visible
            // key: a row's pairs then depend on its task's first row
            // (tile_policy.h). Only the thread count is held there.
            if (sh.window_left >= 0 && dtype == DType::kBF16 &&
                target == attnkit::SimdTarget::kAvx512Bf16)
              continue;
            // (b) Prefix, then the suffix in one call.
            {
              std::vector<std::vector<float>> out(1);
              PagedKVCache pool = make_pool(sh, dtype);
              const int64_t id = pool.add_sequence();
              step(sh, pool, {id}, {&x}, {prefix}, threads, Backend::kAuto, &out);
              step(sh, pool, {id}, {&x}, {suffix}, threads, Backend::kAuto, &out);
              EXPECT_EQ(first_difference(sh, whole[0], out[0]), "") << "prefix + suffix";
            }
            // Prefix, then the suffix token by token (decode).
            {
              std::vector<std::vector<float>> out(1);
              PagedKVCache pool = make_pool(sh, dtype);
              const int64_t id = pool.add_sequence();
              step(sh, pool, {id}, {&x}, {prefix}, threads, Backend::kAuto, &out);
              for (int64_t i = 0; i < suffix; ++i)
                step(sh, pool, {id}, {&x}, {1}, threads, Backend::kAuto, &out);
              EXPECT_EQ(first_difference(sh, whole[0], out[0]), "") << "prefix + decode";
            }
            // (c) In ragged batches: beside y (as many rows in the first
            // step, so in the same kernel call, with more keys) and z (other
            // row counts), then the suffix beside y's and a decode row of z.
            {
              std::vector<std::vector<float>> o2(3);
              PagedKVCache pool = make_pool(sh, dtype);
              const int64_t a = pool.add_sequence(), b = pool.add_sequence(),
                            c = pool.add_sequence();
              std::vector<std::vector<float>> sink(1);
              step(sh, pool, {b}, {&y}, {40}, threads, Backend::kAuto, &sink);
              step(sh, pool, {a, b, c}, {&x, &y, &z}, {prefix, prefix, 37}, threads, Backend::kAuto,
                   &o2);
              std::vector<std::vector<float>> o3(3);
              step(sh, pool, {c, a, b}, {&z, &x, &y}, {1, suffix, suffix}, threads, Backend::kAuto,
                   &o3);
              std::vector<float> rows = o2[0];
              rows.insert(rows.end(), o3[1].begin(), o3[1].end());
              EXPECT_EQ(first_difference(sh, whole[0], rows), "") << "in a ragged batch";
            }
          }
        }
  }
  attnkit::set_simd_target(best);
}

// set_batch_invariant(false) plans attend() as sdpa does (a long
// sequence's keys may split across threads in decode): rows then agree with
// the invariant ones and the reference to rounding, not bit for bit.
TEST(PagedInvariance, OffDecodeAgreesWithTheReferenceToRounding) {
  const Shape sh{"GQA 8/2 128", 8, 2, 128, 128};
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    // 1024 keys: 16 tiles for 2 kv heads, which the default plan splits
    // across 2 threads; the reference pass stays short under ASan.
    const int64_t prefix = 1024, decode = 3, len = prefix + decode;
    const Seq x = make_seq(sh, len, dtype == DType::kF32 ? 11 : 12);
    std::vector<std::vector<float>> ref(1), off(1);
    {
      PagedKVCache pool = make_pool(sh, dtype);
      const int64_t id = pool.add_sequence();
      step(sh, pool, {id}, {&x}, {len}, 1, Backend::kReference, &ref);
    }
    PagedKVCache pool = make_pool(sh, dtype);
    EXPECT_TRUE(pool.batch_invariant());
    pool.set_batch_invariant(false);
    const int64_t id = pool.add_sequence();
    step(sh, pool, {id}, {&x}, {prefix}, 2, Backend::kAuto, &off);
    for (int64_t i = 0; i < decode; ++i) step(sh, pool, {id}, {&x}, {1}, 2, Backend::kAuto, &off);
    EXPECT_TRUE(attnkit_test::all_close(
        dtype == DType::kF32 ? "f32, invariance off" : "bf16, invariance off", off[0],
        attnkit_test::widen(std::span<const float>(ref[0])),
        attnkit_test::attention_tolerance(sh.head_dim, len, dtype, Backend::kAuto)));
  }
}

}  // namespace
