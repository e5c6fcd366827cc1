// dist_bench: what splitting attention across processes costs on one
// machine (docs/DISTRIBUTED.md). Processes on one machine share its cores
// and memory, so speed-up is not the figure: each case times the
// distributed call at N ranks against the single-process kernel doing the
// same total work with the same total threads, and prints the bytes the
// cost model (attnkit/parallel_cost.h) says each rank sends.
//
//   mpirun -np 2 build/bench/dist_bench
//       [--case all|hp-prefill|hp-decode|cp|cp-allgather|cp-allreduce|ring]
//       [--reps 15] [--threads 1] [--calls-only]
//
// Every rank runs --threads worker threads; the single-process baseline
// runs on rank 0 with ranks * threads threads while the other ranks wait
// asleep (MPI_Ibarrier polled every 0.2 ms, so they take no core).
// Ranks stay bound to their cores as mpirun binds them (at 2 ranks, one
// core each: unbound, two ranks could share a core while a neighbour's
// process holds the other, and a rank waiting in a collective would then
// keep its peer off the core for whole scheduler ticks); for the baseline,
// rank 0 moves every thread of its process onto all online cores and back.
// A distributed time is, per repetition, the slowest rank's,
// after a barrier. A case times its baseline, its distributed call and the
// call's parts (the local compute alone on every rank at once, the
// collective alone) in turn, round after round, and prints medians and the
// median of each entry's per-round ratio to the baseline. --calls-only runs
// only the distributed calls of the chosen case, for bench/dist_bytes.sh,
// which counts the bytes each rank really sends with Open MPI's monitoring.
#include <dirent.h>
#include <mpi.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/attention_layer.h"
#include "attnkit/dist.h"
#include "attnkit/parallel_cost.h"
#include "bench_stats.h"

namespace {

using attnkit::DType;
using attnkit::Status;
using attnkit::TensorView;
using attnkit::bench::median;

int g_rank = 0, g_ranks = 1, g_threads = 1, g_reps = 15;
bool g_calls_only = false;

void check(const Status& st, const char* what) {
  if (st.ok()) return;
  std::fprintf(stderr, "dist_bench: %s: %s\n", what, st.to_string().c_str());
  MPI_Abort(MPI_COMM_WORLD, 1);
}

// xorshift64*: a fast deterministic fill, the same on every rank.
std::vector<float> random_vector(int64_t n, uint64_t seed, float scale) {
  std::vector<float> v(static_cast<size_t>(n));
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (float& e : v) {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    e = scale * static_cast<float>(
                    static_cast<double>((s * 2685821657736338717ull) >> 11) * 0x1p-53 * 2.0 - 1.0);
  }
  return v;
}

// A barrier whose waiters sleep instead of spinning.
void quiet_barrier() {
  MPI_Request req;
  MPI_Ibarrier(MPI_COMM_WORLD, &req);
  int done = 0;
  while (!done) {
    MPI_Test(&req, &done, MPI_STATUS_IGNORE);
    if (!done) usleep(200);
  }
}

// Every thread of this process (the caller, attnkit's pool, OpenMP's
// workers) onto the CPUs of `mask`.
void set_process_affinity(const cpu_set_t& mask) {
  DIR* tasks = opendir("/proc/self/task");
  if (!tasks) return;
  while (const dirent* e = readdir(tasks))
    if (e->d_name[0] != '.') sched_setaffinity(std::atoi(e->d_name), sizeof mask, &mask);
  closedir(tasks);
}

// One of the things a case times: the single-process baseline on rank 0
// alone with the others asleep; the distributed call on every rank (the
// slowest rank's time counts); or a part of it, on every rank likewise.
struct Timed {
  enum Kind { kSingle, kCall, kPart };
  const char* label;
  std::function<void()> fn;
  Kind kind;
};

double once(const Timed& t) {
  if (t.kind == Timed::kSingle) {
    double dt = 0;
    if (g_rank == 0) {
      cpu_set_t bound, all;
      sched_getaffinity(0, sizeof bound, &bound);
      CPU_ZERO(&all);
      for (long c = 0; c < sysconf(_SC_NPROCESSORS_ONLN); ++c) CPU_SET(c, &all);
      set_process_affinity(all);
      const double t0 = MPI_Wtime();
      t.fn();
      dt = MPI_Wtime() - t0;
      set_process_affinity(bound);
    }
    quiet_barrier();
    MPI_Bcast(&dt, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    return dt;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  const double t0 = MPI_Wtime();
  t.fn();
  double dt = MPI_Wtime() - t0, slowest = 0;
  MPI_Allreduce(&dt, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return slowest;
}

// Times every entry once per round, in turn, for --reps rounds after one
// warm-up round, so that all of them meet the same machine (it is shared:
// a slow stretch slows a whole round, not one entry). Prints each entry's
// median and fastest time, the median over rounds of its time over the
// first entry's (the single-process baseline), and the ratio of the
// fastest times: on a shared machine the fastest of many rounds is the
// best estimate of the time without neighbours. With --calls-only it runs only the
// distributed calls, between barriers (zero-byte messages), so that the
// bytes Open MPI counts are theirs.
void interleaved(const std::vector<Timed>& entries) {
  if (g_calls_only) {
    for (int r = 0; r <= g_reps; ++r)
      for (const Timed& e : entries)
        if (e.kind == Timed::kCall) {
          MPI_Barrier(MPI_COMM_WORLD);
          e.fn();
        }
    return;
  }
  std::vector<std::vector<double>> t(entries.size()), ratio(entries.size());
  for (int r = 0; r <= g_reps; ++r)
    for (size_t i = 0; i < entries.size(); ++i) {
      const double dt = once(entries[i]);
      if (r == 0) continue;  // warm-up
      t[i].push_back(dt);
      ratio[i].push_back(dt / t[0].back());
    }
  if (g_rank != 0) return;
  const auto least = [](const std::vector<double>& v) {
    return *std::min_element(v.begin(), v.end());
  };
  for (size_t i = 0; i < entries.size(); ++i)
    std::printf("  %-44s %9.3f %9.3f ms  %6.2fx %6.2fx\n", entries[i].label, median(t[i]) * 1e3,
                least(t[i]) * 1e3, median(ratio[i]), least(t[i]) / least(t[0]));
}

// The busiest rank's bytes per call, from the cost model, for a one-layer
// model of these shapes with f32 weights, K/V and exchanges.
attnkit::StrategyCost model(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
                            int64_t batch, int64_t context, attnkit::ParallelStrategy s) {
  attnkit::ModelShape m;
  m.name = "bench";
  m.num_layers = 1;
  m.hidden_size = hidden;
  m.num_heads = heads;
  m.num_kv_heads = kv_heads;
  m.head_dim = m.head_dim_v = head_dim;
  attnkit::ParallelWorkload w;
  w.batch = batch;
  w.context = context;
  w.kv_dtype = w.weight_dtype = DType::kF32;
  auto costs = attnkit::parallel_costs(m, g_ranks, w, {1.0, 1.0}, {1.0, 0.0});
  check(costs.ok() ? Status::Ok() : costs.status(), "parallel_costs");
  for (const attnkit::StrategyCost& c : *costs)
    if (c.strategy == s) return c;
  return {};
}

void model_bytes(const char* what, double bytes) {
  if (g_rank == 0) std::printf("  %-44s %10.0f bytes per rank per call\n", what, bytes);
}

// ---- head-parallel: a Llama-3.2-1B-shaped layer ---------------------------

constexpr int64_t kHidden = 2048, kHeads = 32, kKvHeads = 8, kHeadDim = 64;

struct HeadCase {
  attnkit::AttentionConfig config;
  std::vector<std::vector<float>> storage;
  attnkit::WeightMap weights;
};

HeadCase head_case() {
  HeadCase h;
  attnkit::AttentionConfig& c = h.config;
  c.model_type = "llama";
  c.hidden_size = kHidden;
  c.num_heads = kHeads;
  c.num_kv_heads = kKvHeads;
  c.head_dim = kHeadDim;
  c.rope.head_dim = kHeadDim;
  c.rope.theta = 500000.0;
  const int64_t q = kHeads * kHeadDim, kv = kKvHeads * kHeadDim;
  const struct {
    const char* name;
    int64_t rows, cols;
  } shapes[] = {{"q_proj.weight", q, kHidden},
                {"k_proj.weight", kv, kHidden},
                {"v_proj.weight", kv, kHidden},
                {"o_proj.weight", kHidden, q}};
  h.storage.reserve(4);
  uint64_t seed = 1;
  for (const auto& s : shapes) {
    h.storage.push_back(
        random_vector(s.rows * s.cols, seed++, std::sqrt(3.0f / static_cast<float>(s.cols))));
    h.weights[s.name] = attnkit::make_view(h.storage.back().data(), DType::kF32, {s.rows, s.cols});
  }
  return h;
}

void bench_head_parallel(bool prefill, bool decode) {
  HeadCase h = head_case();
  auto dist = attnkit::dist::HeadParallelAttention::create(MPI_COMM_WORLD, h.config);
  check(dist.ok() ? Status::Ok() : dist.status(), "HeadParallelAttention::create");
  check(dist->load_weights(h.weights), "load_weights");
  attnkit::AttentionLayer single;
  if (g_rank == 0 && !g_calls_only) {
    auto s = attnkit::AttentionLayer::create(h.config);
    check(s.ok() ? Status::Ok() : s.status(), "AttentionLayer::create");
    single = std::move(s).value();
    check(single.load_weights(h.weights), "load_weights");
  }
  const attnkit::RunOptions run{attnkit::Backend::kAuto, g_threads};
  const attnkit::RunOptions run_single{attnkit::Backend::kAuto, g_threads * g_ranks};
  // An all-reduce of the layer's output alone, for the overhead's split.
  std::vector<float> red_in(static_cast<size_t>(256 * kHidden), 1.0f), red_out(red_in.size());
  const auto all_reduce = [&](int64_t floats) {
    MPI_Allreduce(red_in.data(), red_out.data(), static_cast<int>(floats), MPI_FLOAT, MPI_SUM,
                  MPI_COMM_WORLD);
  };

  if (prefill) {
    const int64_t T = 256;
    const std::vector<float> x = random_vector(T * kHidden, 7, 1.0f);
    std::vector<float> out(x.size());
    const TensorView xv = attnkit::make_view(x.data(), DType::kF32, {1, T, kHidden});
    const TensorView ov = attnkit::make_view(out.data(), DType::kF32, {1, T, kHidden});
    if (g_rank == 0)
      std::printf("head-parallel prefill: hidden %ld, %ld/%ld heads x %ld, %ld tokens\n",
                  long(kHidden), long(kHeads), long(kKvHeads), long(kHeadDim), long(T));
    interleaved({
        {"single process",
         [&] { check(single.forward(xv, ov, {}, nullptr, run_single), "forward"); },
         Timed::kSingle},
        {"head-parallel forward",
         [&] { check(dist->forward(xv, ov, {}, nullptr, run), "forward"); }, Timed::kCall},
        {"  of which an all-reduce of the output alone", [&] { all_reduce(T * kHidden); },
         Timed::kPart},
    });
    model_bytes("model: sent", model(kHidden, kHeads, kKvHeads, kHeadDim, 1, T,
                                     attnkit::ParallelStrategy::kHeadParallel)
                                   .prefill.bytes_sent);
  }
  if (decode) {
    const int64_t L = 2048, steps = g_reps + 2;
    const std::vector<float> prompt = random_vector(L * kHidden, 8, 1.0f);
    std::vector<float> scratch(prompt.size());
    auto cache = dist->new_cache(1, L + steps);
    check(cache.ok() ? Status::Ok() : cache.status(), "new_cache");
    const TensorView pv = attnkit::make_view(prompt.data(), DType::kF32, {1, L, kHidden});
    const TensorView sv = attnkit::make_view(scratch.data(), DType::kF32, {1, L, kHidden});
    check(dist->forward(pv, sv, {}, &*cache, run), "prefill");
    attnkit::KVCache single_cache;
    if (g_rank == 0 && !g_calls_only) {
      auto c = single.new_cache(1, L + steps);
      check(c.ok() ? Status::Ok() : c.status(), "new_cache");
      single_cache = std::move(c).value();
      check(single.forward(pv, sv, {}, &single_cache, run_single), "prefill");
    }
    const std::vector<float> x = random_vector(kHidden, 9, 1.0f);
    std::vector<float> out(x.size());
    const TensorView xv = attnkit::make_view(x.data(), DType::kF32, {1, 1, kHidden});
    const TensorView ov = attnkit::make_view(out.data(), DType::kF32, {1, 1, kHidden});
    if (g_rank == 0)
      std::printf("head-parallel decode: 1 token over %ld cached (f32 cache)\n", long(L));
    interleaved({
        {"single process",
         [&] { check(single.forward(xv, ov, {}, &single_cache, run_single), "forward"); },
         Timed::kSingle},
        {"head-parallel forward",
         [&] { check(dist->forward(xv, ov, {}, &*cache, run), "forward"); }, Timed::kCall},
        {"  of which an all-reduce of the output alone", [&] { all_reduce(kHidden); },
         Timed::kPart},
    });
    model_bytes("model: sent", model(kHidden, kHeads, kKvHeads, kHeadDim, 1, L,
                                     attnkit::ParallelStrategy::kHeadParallel)
                                   .decode.bytes_sent);
  }
}

// ---- context-parallel decode and ring attention: GQA 32/8 x 128 -----------

constexpr int64_t kAttnHeads = 32, kAttnKv = 8, kAttnDim = 128;

// This rank's contiguous share [begin, end) of S tokens.
std::pair<int64_t, int64_t> contiguous_share(int64_t S) {
  return {S * g_rank / g_ranks, S * (g_rank + 1) / g_ranks};
}

// `methods`: which merges to time (both, or one for bench/dist_bytes.sh).
void bench_context_parallel(const std::vector<attnkit::dist::MergeMethod>& methods) {
  for (int64_t S : {int64_t{32768}, int64_t{2048}}) {
    const int64_t B = 1, H = kAttnHeads, K = kAttnKv, D = kAttnDim;
    const auto [b0, b1] = contiguous_share(S);
    const int64_t n = b1 - b0;
    const std::vector<float> q = random_vector(B * H * D, 11, 1.0f);
    // Only rank 0 holds the whole cache (for the baseline); every rank its share.
    const std::vector<float> k_all = g_rank == 0 && !g_calls_only
                                         ? random_vector(B * S * K * D, 12, 1.0f)
                                         : std::vector<float>();
    const std::vector<float> v_all = g_rank == 0 && !g_calls_only
                                         ? random_vector(B * S * K * D, 13, 1.0f)
                                         : std::vector<float>();
    const std::vector<float> k = random_vector(B * n * K * D, 14 + uint64_t(g_rank), 1.0f);
    const std::vector<float> v = random_vector(B * n * K * D, 20 + uint64_t(g_rank), 1.0f);
    std::vector<float> out(static_cast<size_t>(B * H * D)), lse(static_cast<size_t>(B * H));
    const TensorView qv = attnkit::make_view(q.data(), DType::kF32, {B, 1, H, D});
    const TensorView kv = attnkit::make_view(k.data(), DType::kF32, {B, n, K, D});
    const TensorView vv = attnkit::make_view(v.data(), DType::kF32, {B, n, K, D});
    const TensorView ov = attnkit::make_view(out.data(), DType::kF32, {B, 1, H, D});
    const TensorView lv = attnkit::make_view(lse.data(), DType::kF32, {B, H, 1});
    if (g_rank == 0)
      std::printf("context-parallel decode: 1 query, %ld keys (f32), %ld/%ld heads x %ld\n",
                  long(S), long(H), long(K), long(D));
    using attnkit::dist::MergeMethod;
    attnkit::dist::ContextParallelOptions cp[2];
    for (MergeMethod m : {MergeMethod::kAllgather, MergeMethod::kAllreduce}) {
      cp[int(m)].num_threads = g_threads;
      cp[int(m)].merge = m;
    }
    attnkit::AttentionOptions whole, local;
    whole.num_threads = g_threads * g_ranks;
    local.num_threads = g_threads;
    const TensorView k_whole = attnkit::make_view(k_all.data(), DType::kF32, {B, S, K, D});
    const TensorView v_whole = attnkit::make_view(v_all.data(), DType::kF32, {B, S, K, D});
    std::vector<float> merged(out.size());
    const TensorView mv = attnkit::make_view(merged.data(), DType::kF32, {B, 1, H, D});
    const auto decode = [&](MergeMethod m) {
      check(attnkit::dist::context_parallel_decode(MPI_COMM_WORLD, qv, kv, vv, ov, cp[int(m)], lv),
            "context_parallel_decode");
    };
    const auto merge = [&](MergeMethod m) {
      check(attnkit::dist::merge_partial_attention(MPI_COMM_WORLD, ov, lv, mv, {}, m),
            "merge_partial_attention");
    };
    std::vector<Timed> entries = {
        {"single process",
         [&] { check(attnkit::sdpa(qv, k_whole, v_whole, ov, whole, lv), "sdpa"); },
         Timed::kSingle}};
    for (MergeMethod m : methods)
      entries.push_back({m == MergeMethod::kAllgather ? "context-parallel, merge by all-gather"
                                                      : "context-parallel, merge by all-reduce",
                         [&, m] { decode(m); }, Timed::kCall});
    entries.push_back({"  local sdpa alone, every rank at once",
                       [&] { check(attnkit::sdpa(qv, kv, vv, ov, local, lv), "sdpa"); },
                       Timed::kPart});
    for (MergeMethod m : methods)
      entries.push_back(
          {m == MergeMethod::kAllgather ? "  merge alone, all-gather" : "  merge alone, all-reduce",
           [&, m] { merge(m); }, Timed::kPart});
    interleaved(entries);
    model_bytes("model: sent", model(kAttnHeads * kAttnDim, H, K, D, B, S,
                                     attnkit::ParallelStrategy::kContextParallel)
                                   .decode.bytes_sent);
  }
}

void bench_ring() {
  const int64_t B = 1, H = kAttnHeads, K = kAttnKv, D = kAttnDim, S = 4096;
  const attnkit::RingChunks ch = *attnkit::ring_chunks(S, g_ranks, g_rank);
  const int64_t n = ch.size();
  const std::vector<float> q_all = random_vector(B * S * H * D, 31, 1.0f);
  const std::vector<float> k_all = random_vector(B * S * K * D, 32, 1.0f);
  const std::vector<float> v_all = random_vector(B * S * K * D, 33, 1.0f);
  std::vector<float> ql, kl, vl;
  for (const attnkit::TokenRange& t : {ch.first, ch.second}) {
    ql.insert(ql.end(), q_all.begin() + t.begin * H * D, q_all.begin() + t.end * H * D);
    kl.insert(kl.end(), k_all.begin() + t.begin * K * D, k_all.begin() + t.end * K * D);
    vl.insert(vl.end(), v_all.begin() + t.begin * K * D, v_all.begin() + t.end * K * D);
  }
  std::vector<float> out(static_cast<size_t>(n * H * D));
  if (g_rank == 0)
    std::printf("ring attention prefill: %ld tokens causal (f32), %ld/%ld heads x %ld\n", long(S),
                long(H), long(K), long(D));
  attnkit::dist::RingOptions ro;
  ro.num_threads = g_threads;
  attnkit::AttentionOptions whole;
  whole.causal = true;
  whole.num_threads = g_threads * g_ranks;
  attnkit::AttentionOptions local = whole;
  local.num_threads = g_threads;
  std::vector<float> out_all(static_cast<size_t>(S * H * D));
  interleaved({
      {"single process",
       [&] {
         check(attnkit::sdpa(attnkit::make_view(q_all.data(), DType::kF32, {B, S, H, D}),
                             attnkit::make_view(k_all.data(), DType::kF32, {B, S, K, D}),
                             attnkit::make_view(v_all.data(), DType::kF32, {B, S, K, D}),
                             attnkit::make_view(out_all.data(), DType::kF32, {B, S, H, D}), whole),
               "sdpa");
       },
       Timed::kSingle},
      {"ring attention",
       [&] {
         check(attnkit::dist::ring_attention(
                   MPI_COMM_WORLD, attnkit::make_view(ql.data(), DType::kF32, {B, n, H, D}),
                   attnkit::make_view(kl.data(), DType::kF32, {B, n, K, D}),
                   attnkit::make_view(vl.data(), DType::kF32, {B, n, K, D}),
                   attnkit::make_view(out.data(), DType::kF32, {B, n, H, D}), ro),
               "ring_attention");
       },
       Timed::kCall},
      // The ring's arithmetic without its communication: each of the rank's
      // two query chunks against every key before it, in one causal call
      // each (bottom-right alignment puts the chunk after those keys).
      {"  its arithmetic alone, every rank at once",
       [&] {
         int64_t row0 = 0;
         for (const attnkit::TokenRange& tr : {ch.first, ch.second}) {
           const int64_t rows = tr.size();
           if (rows > 0)
             check(attnkit::sdpa(
                       attnkit::make_view(ql.data() + row0 * H * D, DType::kF32, {B, rows, H, D}),
                       attnkit::make_view(k_all.data(), DType::kF32, {B, tr.end, K, D}),
                       attnkit::make_view(v_all.data(), DType::kF32, {B, tr.end, K, D}),
                       attnkit::make_view(out.data() + row0 * H * D, DType::kF32, {B, rows, H, D}),
                       local),
                   "sdpa");
           row0 += rows;
         }
       },
       Timed::kPart},
  });
  model_bytes(
      "model: sent",
      model(H * D, H, K, D, B, S, attnkit::ParallelStrategy::kContextParallel).prefill.bytes_sent);
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_ranks);
  std::string which = "all";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--case" && has_value)
      which = argv[++i];
    else if (a == "--reps" && has_value)
      g_reps = std::max(1, std::atoi(argv[++i]));
    else if (a == "--threads" && has_value)
      g_threads = std::max(1, std::atoi(argv[++i]));
    else if (a == "--calls-only")
      g_calls_only = true;
    else {
      if (g_rank == 0)
        std::fprintf(stderr,
                     "usage: dist_bench [--case all|hp-prefill|hp-decode|cp|cp-allreduce|"
                     "cp-allgather|ring] [--reps N] "
                     "[--threads N] [--calls-only]\n");
      MPI_Finalize();
      return 2;
    }
  }
  if (g_rank == 0 && sysconf(_SC_NPROCESSORS_ONLN) < g_ranks * g_threads)
    std::printf("dist_bench: WARNING: %ld cores for the baseline's %d threads\n",
                sysconf(_SC_NPROCESSORS_ONLN), g_ranks * g_threads);
  if (g_rank == 0)
    std::printf(
        "dist_bench: %d ranks x %d threads; baseline: 1 process x %d threads; %d rounds\n"
        "  %-44s %9s %9s     %7s %7s\n",
        g_ranks, g_threads, g_ranks * g_threads, g_reps, "", "median", "fastest", "median",
        "fastest");
  const bool all = which == "all";
  if (all || which == "hp-prefill" || which == "hp-decode")
    bench_head_parallel(all || which == "hp-prefill", all || which == "hp-decode");
  using attnkit::dist::MergeMethod;
  if (all || which == "cp")
    bench_context_parallel({MergeMethod::kAllgather, MergeMethod::kAllreduce});
  if (which == "cp-allreduce") bench_context_parallel({MergeMethod::kAllreduce});
  if (which == "cp-allgather") bench_context_parallel({MergeMethod::kAllgather});
  if (all || which == "ring") bench_ring();
  MPI_Finalize();
  return 0;
}
