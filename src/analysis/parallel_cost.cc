// Ownership arithmetic and the cost model of include/attnkit/parallel_cost.h.
// Every per-rank figure comes from the single-rank analysis functions
// applied to the rank's shard of the model (a ModelShape with the rank's
// head counts), so the two cannot disagree on what a layer costs.
#include "attnkit/parallel_cost.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

namespace attnkit {
namespace {

// floor(a * b / c) for 0 <= a, b and c > 0 without overflow.
int64_t mul_div(int64_t a, int64_t b, int64_t c) {
  return static_cast<int64_t>(static_cast<__int128>(a) * b / c);
}

Status check_rank(const char* fn, int64_t ranks, int64_t rank) {
  const std::string f = fn;
  if (ranks < 1)
    return invalid_argument(f + ": ranks = " + std::to_string(ranks) + " must be >= 1");
  if (rank < 0 || rank >= ranks)
    return invalid_argument(f + ": rank = " + std::to_string(rank) +
                            " must be in [0, ranks = " + std::to_string(ranks) + ")");
  return Status::Ok();
}

// The model as the cost model sees it: every layer costed as the model's
// full attention (windows, chunks and linear layers are not modelled).
ModelShape full_attention(const ModelShape& m) {
  ModelShape out = m;
  out.layers.clear();
  return out;
}

// Rank r's shard under head parallelism: its head counts; o_proj's bias
// lives on rank 0 only (it must be added once to the all-reduced sum).
ModelShape head_shard(const ModelShape& m, const HeadShare& s, int64_t rank) {
  ModelShape out = m;
  out.num_heads = s.num_heads();
  out.num_kv_heads = m.mla ? s.num_heads() : s.num_kv_heads();
  out.o_bias = m.o_bias && rank == 0;
  return out;
}

double log2_rounds(int64_t ranks) {
  int64_t rounds = 0;
  while ((int64_t{1} << rounds) < ranks) ++rounds;
  return static_cast<double>(rounds);
}

// Causal query-key pairs of the queries [a, b) of a sequence (each query i
// sees keys 0..i), or all seqlen keys per query when not causal.
double pairs_of(const TokenRange& t, int64_t seqlen, bool causal) {
  const double a = static_cast<double>(t.begin), b = static_cast<double>(t.end);
  if (!causal) return (b - a) * static_cast<double>(seqlen);
  return (b * (b + 1.0) - a * (a + 1.0)) / 2.0;
}

struct Rates {
  double flops_per_s, read_bytes_per_s, link_bytes_per_s, alpha_s;
  double roofline(double flops, double bytes) const {
    return std::max(flops / flops_per_s, bytes / read_bytes_per_s);
  }
};

void finish(PhaseCost* p, double tokens) {
  p->bytes_per_token = p->bytes_sent / tokens;
  p->step_s = p->compute_s + p->exposed_comm_s;
}

Status check_inputs(const ModelShape& m, int64_t ranks, const ParallelWorkload& w,
                    const KernelRates& r, const LinkModel& link) {
  const std::string f = "parallel_costs";
  if (ranks < 1)
    return invalid_argument(f + ": ranks = " + std::to_string(ranks) + " must be >= 1");
  if (w.batch < 1)
    return invalid_argument(f + ": workload.batch = " + std::to_string(w.batch) + " must be >= 1");
  if (w.context < 1)
    return invalid_argument(f + ": workload.context = " + std::to_string(w.context) +
                            " must be >= 1");
  const std::pair<const char*, int64_t> sizes[] = {
      {"num_layers", m.num_layers}, {"hidden_size", m.hidden_size},
      {"num_heads", m.num_heads},   {"num_kv_heads", m.num_kv_heads},
      {"head_dim", m.head_dim},     {"head_dim_v", m.head_dim_v}};
  for (const auto& [name, v] : sizes)
    if (v < 1)
      return invalid_argument(f + ": model." + name + " = " + std::to_string(v) + " must be >= 1");
  if (m.mla && (m.kv_lora_rank < 1 || m.v_head_dim < 1 || m.qk_rope_head_dim < 0))
    return invalid_argument(f + ": model '" + m.name +
                            "' is MLA with kv_lora_rank = " + std::to_string(m.kv_lora_rank) +
                            ", v_head_dim = " + std::to_string(m.v_head_dim) +
                            ", qk_rope_head_dim = " + std::to_string(m.qk_rope_head_dim) +
                            "; the first two must be >= 1, the last >= 0");
  const std::pair<const char*, double> positive[] = {
      {"rates.gflops", r.gflops}, {"rates.read_gbps", r.read_gbps}, {"link.gbps", link.gbps}};
  for (const auto& [name, v] : positive)
    if (!std::isfinite(v) || !(v > 0.0))
      return invalid_argument(f + ": " + name + " = " + std::to_string(v) +
                              " must be finite and > 0");
  if (!std::isfinite(link.latency_us) || link.latency_us < 0.0)
    return invalid_argument(f + ": link.latency_us = " + std::to_string(link.latency_us) +
                            " must be finite and >= 0");
  const std::pair<const char*, DType> dtypes[] = {{"workload.kv_dtype", w.kv_dtype},
                                                  {"workload.weight_dtype", w.weight_dtype},
                                                  {"workload.comm_dtype", w.comm_dtype}};
  for (const auto& [name, dt] : dtypes) {
    // The KV cache may also be 8-bit (the ring's transfers then count the
    // codes; their fp32 scales, 4 bytes per row of a head, are left out).
    const bool kv_8bit = name == dtypes[0].first && (dt == DType::kI8 || dt == DType::kFp8E4M3);
    if (dt != DType::kF32 && dt != DType::kBF16 && dt != DType::kF16 && !kv_8bit)
      return invalid_argument(f + ": " + name + " = " + dtype_name(dt) +
                              " must be f32, bf16 or f16" +
                              (name == dtypes[0].first ? " (or int8, fp8_e4m3)" : ""));
  }
  return Status::Ok();
}

StrategyCost single_cost(const ModelShape& m, const ParallelWorkload& w, const Rates& rt) {
  const double B = static_cast<double>(w.batch), L = static_cast<double>(m.num_layers);
  StrategyCost c;
  c.strategy = ParallelStrategy::kSingle;
  c.weight_bytes_per_rank = static_cast<double>(attention_params_per_layer(m)) *
                            static_cast<double>(dtype_size(w.weight_dtype)) * L;
  c.kv_bytes_per_rank = kv_cache_bytes(m, w.kv_dtype, w.context, w.batch);
  c.prefill.compute_s = B * prefill_flops_per_layer(m, w.context) / rt.flops_per_s;
  c.decode.compute_s =
      rt.roofline(B * decode_flops_per_layer(m, w.context),
                  decode_bytes_per_layer(m, w.context, w.batch, w.kv_dtype, w.weight_dtype));
  finish(&c.prefill, B * static_cast<double>(w.context));
  finish(&c.decode, B);
  return c;
}

StrategyCost head_parallel_cost(const ModelShape& m, int64_t ranks, const ParallelWorkload& w,
                                const Rates& rt) {
  StrategyCost c;
  c.strategy = ParallelStrategy::kHeadParallel;
  const double B = static_cast<double>(w.batch), S = static_cast<double>(w.context),
               N = static_cast<double>(ranks), L = static_cast<double>(m.num_layers);
  for (int64_t r = 0; r < ranks; ++r) {
    Result<HeadShare> share =
        head_share(m.num_heads, m.mla ? m.num_heads : m.num_kv_heads, ranks, r);
    if (!share.ok()) {
      StrategyCost none;
      none.strategy = ParallelStrategy::kHeadParallel;
      none.feasible = false;
      none.infeasible_reason = share.status().message();
      return none;
    }
    const ModelShape shard = head_shard(m, *share, r);
    c.weight_bytes_per_rank =
        std::max(c.weight_bytes_per_rank, static_cast<double>(attention_params_per_layer(shard)) *
                                              static_cast<double>(dtype_size(w.weight_dtype)) * L);
    c.kv_bytes_per_rank =
        std::max(c.kv_bytes_per_rank, kv_cache_bytes(shard, w.kv_dtype, w.context, w.batch));
    c.prefill.compute_s = std::max(c.prefill.compute_s,
                                   B * prefill_flops_per_layer(shard, w.context) / rt.flops_per_s);
    c.decode.compute_s = std::max(
        c.decode.compute_s,
        rt.roofline(B * decode_flops_per_layer(shard, w.context),
                    decode_bytes_per_layer(shard, w.context, w.batch, w.kv_dtype, w.weight_dtype)));
  }
  // One all-reduce of the layer output per phase: reduce-scatter by
  // recursive halving, then all-gather by recursive doubling (Rabenseifner).
  const double e_a = static_cast<double>(dtype_size(w.comm_dtype)),
               d = static_cast<double>(m.hidden_size);
  const double rounds = log2_rounds(ranks);
  const auto all_reduce = [&](double bytes, PhaseCost* p) {
    if (ranks == 1) return;
    p->bytes_sent = 2.0 * (N - 1.0) / N * bytes;
    p->messages = 2 * static_cast<int64_t>(rounds);
    p->exposed_comm_s = 2.0 * rounds * rt.alpha_s + p->bytes_sent / rt.link_bytes_per_s;
  };
  all_reduce(B * S * d * e_a, &c.prefill);
  all_reduce(B * d * e_a, &c.decode);
  finish(&c.prefill, B * S);
  finish(&c.decode, B);
  return c;
}

StrategyCost context_parallel_cost(const ModelShape& m, int64_t ranks, const ParallelWorkload& w,
                                   const Rates& rt) {
  StrategyCost c;
  c.strategy = ParallelStrategy::kContextParallel;
  const double B = static_cast<double>(w.batch), S = static_cast<double>(w.context),
               N = static_cast<double>(ranks), L = static_cast<double>(m.num_layers);
  const double P = static_cast<double>(attention_params_per_layer(m));
  const double e_kv = static_cast<double>(dtype_size(w.kv_dtype)),
               e_a = static_cast<double>(dtype_size(w.comm_dtype)),
               e_w = static_cast<double>(dtype_size(w.weight_dtype));
  const double H = static_cast<double>(m.num_heads);
  // Values per token a ring step sends (K and V), attention FLOPs per
  // (query, key, sequence), and the width of a merged partial output.
  double send_per_token, flops_per_pair, out_width;
  if (m.mla) {
    const double dc = static_cast<double>(m.kv_lora_rank),
                 dr = static_cast<double>(m.qk_rope_head_dim);
    send_per_token = 2.0 * dc + dr;
    flops_per_pair = 2.0 * H * (2.0 * dc + dr);
    out_width = dc;
  } else {
    send_per_token = static_cast<double>(m.num_kv_heads * (m.head_dim + m.head_dim_v));
    flops_per_pair = 2.0 * H * static_cast<double>(m.head_dim + m.head_dim_v);
    out_width = static_cast<double>(m.head_dim_v);
  }
  std::vector<int64_t> tokens(static_cast<size_t>(ranks));
  std::vector<RingChunks> chunks(static_cast<size_t>(ranks));
  for (int64_t r = 0; r < ranks; ++r) {
    chunks[static_cast<size_t>(r)] = *ring_chunks(w.context, ranks, r);
    tokens[static_cast<size_t>(r)] = chunks[static_cast<size_t>(r)].size();
  }
  c.weight_bytes_per_rank = P * e_w * L;
  for (int64_t r = 0; r < ranks; ++r) {
    const RingChunks& ch = chunks[static_cast<size_t>(r)];
    const double n_r = static_cast<double>(ch.size());
    c.kv_bytes_per_rank =
        std::max(c.kv_bytes_per_rank, kv_cache_bytes(m, w.kv_dtype, ch.size(), w.batch));
    // Prefill: projections of the rank's tokens, then N ring steps.
    const double proj_s = 2.0 * B * n_r * P / rt.flops_per_s;
    const double attn_s =
        B * flops_per_pair *
        (pairs_of(ch.first, w.context, m.causal) + pairs_of(ch.second, w.context, m.causal)) /
        rt.flops_per_s;
    const double step_s = attn_s / N;
    double sent = 0.0, exposed = 0.0;
    for (int64_t t = 1; t < ranks; ++t) {
      // Step t computes on the block of rank r - t, received while step
      // t - 1 computed; the rank forwards that block's predecessor.
      const int64_t src = ((r - t) % ranks + ranks) % ranks;
      const double block =
          B * static_cast<double>(tokens[static_cast<size_t>(src)]) * send_per_token * e_kv;
      const int64_t fwd = ((r - t + 1) % ranks + ranks) % ranks;
      sent += B * static_cast<double>(tokens[static_cast<size_t>(fwd)]) * send_per_token * e_kv;
      exposed += std::max(0.0, rt.alpha_s + block / rt.link_bytes_per_s - step_s);
    }
    if (proj_s + attn_s + exposed > c.prefill.step_s) {
      c.prefill.compute_s = proj_s + attn_s;
      c.prefill.exposed_comm_s = exposed;
      c.prefill.bytes_sent = sent;
      c.prefill.step_s = proj_s + attn_s + exposed;
    }
    // Decode: every rank projects the new tokens (all weights) and attends
    // over its own n_r cached tokens.
    const double kv_values = static_cast<double>(kv_values_per_token_per_layer(m));
    const double dec_flops = B * (2.0 * P + flops_per_pair * n_r);
    const double dec_bytes = P * e_w + B * n_r * kv_values * e_kv;
    c.decode.compute_s = std::max(c.decode.compute_s, rt.roofline(dec_flops, dec_bytes));
  }
  c.prefill.messages = ranks - 1;
  // The decode merge, an all-gather of every rank's (out, lse): recursive
  // doubling (Bruck's algorithm when N is not a power of two) sends the
  // other N - 1 partials in ceil(log2 N) messages.
  const double rounds = log2_rounds(ranks);
  const double merge_bytes = B * H * (out_width + 1.0) * e_a;
  c.decode.bytes_sent = (N - 1.0) * merge_bytes;
  c.decode.messages = static_cast<int64_t>(rounds);
  c.decode.exposed_comm_s = rounds * rt.alpha_s + c.decode.bytes_sent / rt.link_bytes_per_s;
  finish(&c.prefill, B * S);
  finish(&c.decode, B);
  return c;
}

}  // namespace

Result<HeadShare> head_share(int64_t num_heads, int64_t num_kv_heads, int64_t ranks, int64_t rank) {
  constexpr const char* fn = "head_share";
  const std::string f = fn;
  ATTNKIT_RETURN_IF_ERROR(check_rank(fn, ranks, rank));
  if (num_heads < 1)
    return invalid_argument(f + ": num_heads = " + std::to_string(num_heads) + " must be >= 1");
  if (num_kv_heads < 1 || num_heads % num_kv_heads != 0)
    return invalid_argument(f + ": num_kv_heads = " + std::to_string(num_kv_heads) +
                            " must be >= 1 and divide num_heads = " + std::to_string(num_heads));
  if (num_heads < ranks)
    return invalid_argument(f + ": num_heads = " + std::to_string(num_heads) +
                            " must be >= ranks = " + std::to_string(ranks) +
                            " (each rank needs at least one query head)");
  const int64_t K = num_kv_heads, N = ranks, g = num_heads / num_kv_heads;
  HeadShare s;
  if (K >= N) {
    s.kv_begin = mul_div(K, rank, N);
    s.kv_end = mul_div(K, rank + 1, N);
    s.q_begin = s.kv_begin * g;
    s.q_end = s.kv_end * g;
    return s;
  }
  // Ranks [ceil(j N / K), ceil((j+1) N / K)) serve kv head j; g >= m holds
  // because H >= N makes g >= N / K, an integer, at least ceil(N / K) >= m.
  const int64_t j = mul_div(rank, K, N);
  const int64_t first = (j * N + K - 1) / K, last = ((j + 1) * N + K - 1) / K;
  const int64_t m = last - first, i = rank - first;
  s.kv_begin = j;
  s.kv_end = j + 1;
  s.q_begin = j * g + g * i / m;
  s.q_end = j * g + g * (i + 1) / m;
  return s;
}

Result<RingChunks> ring_chunks(int64_t seqlen, int64_t ranks, int64_t rank) {
  constexpr const char* fn = "ring_chunks";
  ATTNKIT_RETURN_IF_ERROR(check_rank(fn, ranks, rank));
  if (seqlen < 0)
    return invalid_argument(std::string(fn) + ": seqlen = " + std::to_string(seqlen) +
                            " must be >= 0");
  const int64_t chunks = 2 * ranks;
  const auto bound = [&](int64_t c) { return mul_div(c, seqlen, chunks); };
  RingChunks out;
  out.first = {bound(rank), bound(rank + 1)};
  out.second = {bound(chunks - 1 - rank), bound(chunks - rank)};
  return out;
}

const char* parallel_strategy_name(ParallelStrategy strategy) {
  switch (strategy) {
    case ParallelStrategy::kSingle:
      return "single";
    case ParallelStrategy::kHeadParallel:
      return "head-parallel";
    case ParallelStrategy::kContextParallel:
      return "context-parallel";
  }
  return "unknown";
}

Result<std::vector<StrategyCost>> parallel_costs(const ModelShape& model, int64_t ranks,
                                                 const ParallelWorkload& workload,
                                                 const KernelRates& rates, const LinkModel& link) {
  ATTNKIT_RETURN_IF_ERROR(check_inputs(model, ranks, workload, rates, link));
  const ModelShape m = full_attention(model);
  const Rates rt{rates.gflops * 1e9, rates.read_gbps * 1e9, link.gbps * 1e9 / 8.0,
                 link.latency_us * 1e-6};
  return std::vector<StrategyCost>{single_cost(m, workload, rt),
                                   head_parallel_cost(m, ranks, workload, rt),
                                   context_parallel_cost(m, ranks, workload, rt)};
}

}  // namespace attnkit
