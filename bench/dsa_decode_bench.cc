// dsa_decode_bench: one decode step's attention at DeepSeek-V3.2's layer
// shape, dense absorbed MLA vs DeepSeek sparse attention (DSA), over the
// same cache of L tokens (public API only, random data).
//
//   dsa_decode_bench [--contexts 8192,32768,65536] [--reps 5] [--threads 0]
//                    [--cache f32|bf16]
//
// dense: sdpa over the whole latent cache in the absorbed form (128 heads,
//        key = the 576-value latent row, value = its first 512 values).
// dsa:   lightning_indexer_topk (64 heads x 128 fp8 over every cached
//        indexer key, top 2048) + sdpa with key_indices over the chosen
//        latent rows, read in place.
// The projections both share (and the indexer's own, ~14M MACs per token)
// are not timed. Runs are paired and alternate which goes first; each
// cell is the median over --reps of wall seconds; dsa/dense is the median
// of the paired ratios.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/sparse_attention.h"
#include "bench_stats.h"
#include "dsa_setup.h"

namespace {

using attnkit::Backend;
using attnkit::DType;
using attnkit::make_view;
using attnkit::TensorView;

// DeepSeek-V3.2's sizes, Fill and seconds_since (dsa_setup.h).
using namespace attnkit::bench::dsa;

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> contexts = {8192, 32768, 65536};
  int reps = 5, threads = 0;
  DType cache_dtype = DType::kF32;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--contexts") {
      contexts.clear();
      for (size_t p = 0; p < v.size();) {
        const size_t e = std::min(v.find(',', p), v.size());
        contexts.push_back(std::stoll(v.substr(p, e - p)));
        p = e + 1;
      }
    } else if (a == "--reps") {
      reps = std::stoi(v);
    } else if (a == "--threads") {
      threads = std::stoi(v);
    } else if (a == "--cache") {
      cache_dtype = v == "bf16" ? DType::kBF16 : DType::kF32;
    } else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  std::printf("# %s; cache %s; %d reps; threads %d (0 = all)\n", attnkit::bench::cpu_name().c_str(),
              attnkit::dtype_name(cache_dtype), reps, threads);
  std::printf("%10s %12s %12s %12s %10s\n", "context", "dense_s", "dsa_s", "indexer_s",
              "dsa/dense");
  Fill fill;
  for (const int64_t L : contexts) {
    // Latent cache [1, L, 1, 576]; value = the first 512 of each row.
    const size_t esz = cache_dtype == DType::kF32 ? 4 : 2;
    std::vector<char> latent(static_cast<size_t>(L * kRow) * esz);
    if (cache_dtype == DType::kF32) {
      auto* p = reinterpret_cast<float*>(latent.data());
      for (int64_t e = 0; e < L * kRow; ++e) p[e] = fill.next();
    } else {
      auto* p = reinterpret_cast<attnkit::bf16*>(latent.data());
      for (int64_t e = 0; e < L * kRow; ++e) p[e] = attnkit::float_to_bf16(fill.next());
    }
    TensorView k = make_view(latent.data(), cache_dtype, {1, L, 1, kRow});
    TensorView v = make_view(latent.data(), cache_dtype, {1, L, 1, kLatent});
    v.strides = k.strides;
    std::vector<float> q(kHeads * kRow), out(kHeads * kLatent);
    for (float& e : q) e = fill.next() * 0.05f;
    // Indexer: fp8 keys for every token, one query.
    std::vector<uint8_t> kc(static_cast<size_t>(L * kIndexDim)), qc(kIndexHeads * kIndexDim);
    for (auto& e : kc) e = static_cast<uint8_t>(fill.bits() % 0x7e);
    for (auto& e : qc) e = static_cast<uint8_t>(fill.bits() % 0x7e);
    std::vector<float> ks(static_cast<size_t>(L), 0.01f), qs(kIndexHeads, 0.01f), w(kIndexHeads);
    for (float& e : w) e = fill.next();
    std::vector<int32_t> idx(kTopk);

    attnkit::AttentionOptions dense;
    dense.softmax_scale = 0.1f;
    dense.causal = true;
    dense.num_threads = threads;
    attnkit::AttentionOptions sparse = dense;
    sparse.key_indices = make_view(idx.data(), DType::kI32, {1, 1, kTopk});
    attnkit::IndexerOptions io;
    io.num_threads = threads;
    const TensorView qv = make_view(q.data(), DType::kF32, {1, 1, kHeads, kRow});
    const TensorView ov = make_view(out.data(), DType::kF32, {1, 1, kHeads, kLatent});

    const auto run_dense = [&] {
      const auto t0 = std::chrono::steady_clock::now();
      if (!attnkit::sdpa(qv, k, v, ov, dense).ok()) std::abort();
      return seconds_since(t0);
    };
    double index_s = 0;
    const auto run_dsa = [&] {
      const auto t0 = std::chrono::steady_clock::now();
      const attnkit::Status st = attnkit::lightning_indexer_topk(
          make_view(qc.data(), DType::kFp8E4M3, {1, 1, kIndexHeads, kIndexDim}),
          make_view(qs.data(), DType::kF32, {1, 1, kIndexHeads, 1}),
          make_view(w.data(), DType::kF32, {1, 1, kIndexHeads}),
          make_view(kc.data(), DType::kFp8E4M3, {1, L, kIndexDim}),
          make_view(ks.data(), DType::kF32, {1, L, 1}), kTopk,
          make_view(idx.data(), DType::kI32, {1, 1, kTopk}), {}, io);
      if (!st.ok()) std::abort();
      index_s = seconds_since(t0);
      if (!attnkit::sdpa(qv, k, v, ov, sparse).ok()) std::abort();
      return seconds_since(t0);
    };
    std::vector<double> d, s, ix, ratio;
    run_dense();  // warm
    run_dsa();
    for (int r = 0; r < reps; ++r) {
      double td, ts;
      if (r % 2) {
        ts = run_dsa();
        td = run_dense();
      } else {
        td = run_dense();
        ts = run_dsa();
      }
      d.push_back(td);
      s.push_back(ts);
      ix.push_back(index_s);
      ratio.push_back(ts / td);
    }
    std::printf("%10lld %12.5f %12.5f %12.5f %10.3f\n", static_cast<long long>(L),
                attnkit::bench::median(d), attnkit::bench::median(s), attnkit::bench::median(ix),
                attnkit::bench::median(ratio));
    std::fflush(stdout);
  }
  return 0;
}
