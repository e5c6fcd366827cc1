// dsa_prefill_bench: the attention of a causal prefill of S tokens (32K by
// default) at DeepSeek-V3.2's layer shape, dense MLA vs DeepSeek sparse
// attention (DSA), on this CPU (public API only, random data).
//
//   dsa_prefill_bench [--length 32768] [--segments 8] [--rows 64] [--reps 3]
//                     [--dense-heads 32] [--threads 0] [--dsa-form absorbed|naive]
//
// dense: the naive form LatentAttention runs for a prefill from empty:
//        sdpa, causal, per head q.k over 192 features and v of 128, every
//        head its own K/V (so --dense-heads of the 128 are run and the time
//        scaled by 128 / dense-heads: heads share nothing).
// dsa:   lightning_indexer_topk (64 heads x 128 fp8 over every earlier
//        indexer key, top 2048) + sdpa with key_indices, --dsa-form
//        absorbed (the default, what LatentAttention runs: 128 heads over
//        the 576-value latent rows, value = their first 512; 278,528 FLOPs
//        per chosen pair) or naive (over the decompressed K/V dense uses,
//        81,920 FLOPs per chosen pair, heads scaled as for dense).
// The projections are not timed: both decompress every latent row once
// (S * H * (d_nope + d_v) * d_c multiply-adds), and the indexer's own
// projections add ~14M MACs a token (include/attnkit/analysis.h).
//
// A full 32K prefill runs for minutes on a small machine, so it is
// sampled: the S query rows are cut into --segments equal segments and
// --rows rows at the middle of each are timed; a row's cost is linear in
// its position for both methods, so the midpoint rule (rows x segment /
// rows) gives each segment's time, and their sums the whole prefill's.
// Every rep times all samples of both methods, alternating which goes
// first; cells are medians over reps, dsa/dense the median of per-rep
// ratios. "pays from" is the segment end from which on DSA's running total
// stays below dense's (prefills of that many tokens or more; on a noisy
// machine the totals of the first segments may cross more than once).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/sparse_attention.h"
#include "bench_stats.h"
#include "dsa_setup.h"

namespace {

using attnkit::DType;
using attnkit::make_view;
using attnkit::TensorView;

// DeepSeek-V3.2's sizes, Fill and seconds_since (dsa_setup.h).
using namespace attnkit::bench::dsa;

// The naive form's per-head dims: qk_nope_head_dim 128, v_head_dim 128.
constexpr int64_t kNope = 128, kQk = kNope + kRope, kV = 128;

struct Options {
  int64_t length = 32768, segments = 8, rows = 64, dense_heads = 32;
  int reps = 3, threads = 0;
  bool naive = false;  // --dsa-form naive
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--dsa-form") {
      o.naive = std::string(argv[i + 1]) == "naive";
      continue;
    }
    const int64_t v = std::stoll(argv[i + 1]);
    if (a == "--length") {
      o.length = v;
    } else if (a == "--segments") {
      o.segments = v;
    } else if (a == "--rows") {
      o.rows = v;
    } else if (a == "--reps") {
      o.reps = static_cast<int>(v);
    } else if (a == "--dense-heads") {
      o.dense_heads = v;
    } else if (a == "--threads") {
      o.threads = static_cast<int>(v);
    } else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      std::exit(2);
    }
  }
  if (o.length % o.segments != 0 || o.rows > o.length / o.segments || kHeads % o.dense_heads != 0) {
    std::fprintf(stderr, "need segments | length, rows <= length / segments, dense-heads | 128\n");
    std::exit(2);
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const int64_t S = o.length, Hd = o.dense_heads, T = o.rows, seg = S / o.segments;
  std::printf(
      "# %s; prefill of %lld tokens, %lld segments x %lld timed rows; %d reps; threads %d"
      " (0 = all); dense on %lld heads x %lld; DSA %s\n",
      attnkit::bench::cpu_name().c_str(), static_cast<long long>(S),
      static_cast<long long>(o.segments), static_cast<long long>(T), o.reps, o.threads,
      static_cast<long long>(Hd), static_cast<long long>(kHeads / Hd),
      o.naive ? "naive" : "absorbed");
  Fill fill;
  // Dense, naive form: K [1, S, Hd, 192], V [1, S, Hd, 128], queries of T rows.
  std::vector<float> kd(static_cast<size_t>(S * Hd * kQk)), vd(static_cast<size_t>(S * Hd * kV));
  for (float& e : kd) e = fill.next();
  for (float& e : vd) e = fill.next();
  std::vector<float> qd(static_cast<size_t>(T * Hd * kQk)), od(static_cast<size_t>(T * Hd * kV));
  for (float& e : qd) e = fill.next() * 0.1f;
  // DSA, absorbed: latent rows [1, S, 1, 576], queries [1, T, 128, 576].
  std::vector<float> lat, qa, oa;
  if (!o.naive) {
    lat.resize(static_cast<size_t>(S * kRow));
    qa.resize(static_cast<size_t>(T * kHeads * kRow));
    oa.resize(static_cast<size_t>(T * kHeads * kLatent));
    for (float& e : lat) e = fill.next();
    for (float& e : qa) e = fill.next() * 0.05f;
  }
  // Indexer keys for every token and indexer queries for T rows.
  // The keys in a library Tensor, on a 64-byte line as LatentCache holds
  // them (dsa_decode_bench says why).
  attnkit::Result<attnkit::Tensor> kc_tensor =
      attnkit::Tensor::zeros(DType::kFp8E4M3, {1, S, kIndexDim});
  if (!kc_tensor.ok()) std::abort();
  const std::span<uint8_t> kc(static_cast<uint8_t*>(kc_tensor.value().data()),
                              static_cast<size_t>(S * kIndexDim));
  std::vector<uint8_t> qc(static_cast<size_t>(T * kIndexHeads * kIndexDim));
  for (auto& e : kc) e = static_cast<uint8_t>(fill.bits() % 0x7e);
  for (auto& e : qc) e = static_cast<uint8_t>(fill.bits() % 0x7e);
  std::vector<float> ks(static_cast<size_t>(S), 0.01f),
      qs(static_cast<size_t>(T * kIndexHeads), 0.01f), w(static_cast<size_t>(T * kIndexHeads));
  for (float& e : w) e = fill.next();
  std::vector<int32_t> idx(static_cast<size_t>(T * kTopk));

  attnkit::AttentionOptions dense;
  dense.softmax_scale = 0.07f;
  dense.causal = true;
  dense.num_threads = o.threads;
  attnkit::AttentionOptions sparse = dense;
  sparse.key_indices = make_view(idx.data(), DType::kI32, {1, T, kTopk});
  attnkit::IndexerOptions io;
  io.num_threads = o.threads;

  // The T rows ending at position `end` (exclusive): keys [0, end).
  const auto run_dense = [&](int64_t end) {
    TensorView k = make_view(kd.data(), DType::kF32, {1, end, Hd, kQk});
    TensorView v = make_view(vd.data(), DType::kF32, {1, end, Hd, kV});
    const auto t0 = std::chrono::steady_clock::now();
    if (!attnkit::sdpa(make_view(qd.data(), DType::kF32, {1, T, Hd, kQk}), k, v,
                       make_view(od.data(), DType::kF32, {1, T, Hd, kV}), dense)
             .ok())
      std::abort();
    return seconds_since(t0) * static_cast<double>(kHeads / Hd);
  };
  double index_s = 0;
  const auto run_dsa = [&](int64_t end) {
    TensorView k = make_view(kd.data(), DType::kF32, {1, end, Hd, kQk});
    TensorView v = make_view(vd.data(), DType::kF32, {1, end, Hd, kV});
    const auto t0 = std::chrono::steady_clock::now();
    const attnkit::Status st = attnkit::lightning_indexer_topk(
        make_view(qc.data(), DType::kFp8E4M3, {1, T, kIndexHeads, kIndexDim}),
        make_view(qs.data(), DType::kF32, {1, T, kIndexHeads, 1}),
        make_view(w.data(), DType::kF32, {1, T, kIndexHeads}),
        make_view(kc.data(), DType::kFp8E4M3, {1, end, kIndexDim}),
        make_view(ks.data(), DType::kF32, {1, end, 1}), kTopk,
        make_view(idx.data(), DType::kI32, {1, T, kTopk}), {}, io);
    if (!st.ok()) std::abort();
    index_s = seconds_since(t0);
    const auto t1 = std::chrono::steady_clock::now();
    if (!o.naive) {
      TensorView kl = make_view(lat.data(), DType::kF32, {1, end, 1, kRow});
      TensorView vl = make_view(lat.data(), DType::kF32, {1, end, 1, kLatent});
      vl.strides = kl.strides;
      if (!attnkit::sdpa(make_view(qa.data(), DType::kF32, {1, T, kHeads, kRow}), kl, vl,
                         make_view(oa.data(), DType::kF32, {1, T, kHeads, kLatent}), sparse)
               .ok())
        std::abort();
      return index_s + seconds_since(t1);
    }
    if (!attnkit::sdpa(make_view(qd.data(), DType::kF32, {1, T, Hd, kQk}), k, v,
                       make_view(od.data(), DType::kF32, {1, T, Hd, kV}), sparse)
             .ok())
      std::abort();
    return index_s + seconds_since(t1) * static_cast<double>(kHeads / Hd);
  };

  const double scale = static_cast<double>(seg) / static_cast<double>(T);
  const size_t n = static_cast<size_t>(o.segments), reps = static_cast<size_t>(o.reps);
  std::vector<std::vector<double>> d(n), s(n), ix(n);
  std::vector<double> total_ratio;
  run_dense(T);  // warm
  run_dsa(T);
  for (size_t r = 0; r < reps; ++r) {
    double td = 0, ts = 0;
    for (size_t g = 0; g < n; ++g) {
      const int64_t end =
          static_cast<int64_t>(g) * seg + seg / 2 + T / 2;  // rows around the middle
      double a, b;
      if ((r + g) % 2) {
        b = run_dsa(end);
        a = run_dense(end);
      } else {
        a = run_dense(end);
        b = run_dsa(end);
      }
      d[g].push_back(a * scale);
      s[g].push_back(b * scale);
      ix[g].push_back(index_s * scale);
      td += a * scale;
      ts += b * scale;
    }
    total_ratio.push_back(ts / td);
  }
  std::printf("%12s %12s %12s %12s %10s %14s %14s\n", "segment_end", "dense_s", "dsa_s",
              "indexer_s", "dsa/dense", "dense_total_s", "dsa_total_s");
  double cd = 0, cs = 0;
  int64_t pays_from = 0;
  for (size_t g = 0; g < n; ++g) {
    const double md = attnkit::bench::median(d[g]), ms = attnkit::bench::median(s[g]);
    cd += md;
    cs += ms;
    if (cs >= cd) pays_from = 0;
    if (pays_from == 0 && cs < cd) pays_from = static_cast<int64_t>(g + 1) * seg;
    std::printf("%12lld %12.3f %12.3f %12.3f %10.3f %14.2f %14.2f\n",
                static_cast<long long>(static_cast<int64_t>(g + 1) * seg), md, ms,
                attnkit::bench::median(ix[g]), ms / md, cd, cs);
  }
  std::printf(
      "prefill of %lld tokens, attention only: dense %.1f s, DSA %.1f s, DSA/dense %.3f "
      "(median of per-rep ratios); DSA's prefill pays from %lld tokens%s\n",
      static_cast<long long>(S), cd, cs, attnkit::bench::median(total_ratio),
      static_cast<long long>(pays_from), pays_from == 0 ? " (not within the length)" : "");
  return 0;
}
