// attnkit/parallel_cost.h — how attention splits across ranks, and what each
// split costs. Pure arithmetic, no MPI: attnkit::dist (attnkit/dist.h) uses
// head_share() and ring_chunks() to decide what a rank owns, and
// parallel_costs() models the same splits for clusters this machine is not.
//
// Strategies (docs/DISTRIBUTED.md has the pictures and the measurements):
//   single           one rank, the baseline.
//   head-parallel    Megatron-style: rank r owns a share of the kv heads and
//                    their query heads (head_share), the matching column
//                    blocks of q/k/v_proj and row block of o_proj, and the
//                    cache of its kv heads; one all-reduce of the layer's
//                    output per layer and step. MLA: query heads split, the
//                    latent cache and the down-projections replicated.
//   context-parallel weights replicated, every sequence's tokens split:
//                    prefill by ring attention over load-balanced chunk
//                    pairs (ring_chunks), decode by a partial attention per
//                    rank merged with its log-sum-exp in one collective.
//
// Symbols used below: N ranks, B batch, S context (prefill tokens, and the
// cached tokens of the decode step after it), d hidden_size, H num_heads,
// K num_kv_heads, D head_dim, Dv head_dim_v, P attention_params_per_layer,
// e_a / e_kv / e_w the bytes of one activation (f32: 4, what attnkit
// exchanges), KV and weight value. For MLA the K/V a rank sends or reads
// are its latent rows: key d_c + d_r, value d_c (one kv head, the absorbed
// form), and the merged partial outputs are d_c wide.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attnkit/analysis.h"
#include "attnkit/status.h"
#include "attnkit/tensor.h"

namespace attnkit {

// ---------------------------------------------------------------- ownership

// The heads one rank owns under head parallelism.
struct HeadShare {
  int64_t q_begin = 0, q_end = 0;    // query heads [q_begin, q_end)
  int64_t kv_begin = 0, kv_end = 0;  // kv heads [kv_begin, kv_end)
  int64_t num_heads() const { return q_end - q_begin; }
  int64_t num_kv_heads() const { return kv_end - kv_begin; }
};

// Rank `rank` of `ranks` (g = num_heads / num_kv_heads query heads per kv head):
//   K >= N: kv heads [K r / N, K (r+1) / N) (floors, so shares differ by at
//           most one head when N does not divide K) and their query heads;
//   K <  N: the kv heads are replicated, as vLLM does: rank r serves kv head
//           j = floor(r K / N); the m ranks serving j split its g query heads
//           contiguously (the i-th gets [j g + g i / m, j g + g (i+1) / m)).
// MLA passes num_kv_heads = num_heads (every head has its own K/V once
// decompressed), which splits the query heads [H r / N, H (r+1) / N).
// Errors: sizes < 1, num_kv_heads not dividing num_heads, rank outside
// [0, ranks), or num_heads < ranks (a rank would own no query head).
Result<HeadShare> head_share(int64_t num_heads, int64_t num_kv_heads, int64_t ranks, int64_t rank);

// A half-open token range [begin, end) of a sequence.
struct TokenRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};

// Ring attention's load-balanced layout: the S tokens are cut into 2N
// chunks, chunk c = [floor(c S / 2N), floor((c+1) S / 2N)), and rank r holds
// chunk r (`first`) followed by chunk 2N-1-r (`second`), so that under a
// causal mask every rank scores about the same number of query-key pairs:
//   N = 2, S = 8:  tokens 0 1 | 2 3 | 4 5 | 6 7
//                  chunk   0  |  1  |  2  |  3
//                  rank    0  |  1  |  1  |  0   -> rank 0: [0,2)+[6,8), rank 1: [2,4)+[4,6)
// Chunks may be empty when S < 2N. Errors: seqlen < 0, ranks < 1, rank
// outside [0, ranks).
struct RingChunks {
  TokenRange first, second;
  int64_t size() const { return first.size() + second.size(); }
};
Result<RingChunks> ring_chunks(int64_t seqlen, int64_t ranks, int64_t rank);

// ---------------------------------------------------------------- cost model

enum class ParallelStrategy : uint8_t { kSingle, kHeadParallel, kContextParallel };

// "single", "head-parallel", "context-parallel".
const char* parallel_strategy_name(ParallelStrategy strategy);

// The network between ranks: a per-rank, per-direction bandwidth and a
// per-message latency alpha. beta = gbps * 1e9 / 8 bytes per second.
struct LinkModel {
  double gbps = 0.0;        // > 0, Gbit/s
  double latency_us = 5.0;  // >= 0; 5 us: an MPI message over a good Ethernet or RDMA link
};

// What one rank's kernels sustain: FLOP rate and read bandwidth. A tool
// passes measure_machine()'s fp32_peak_gflops and dram_read_gbps (scaled by
// the fractions of them the kernels reach, docs/PERFORMANCE.md, if known).
struct KernelRates {
  double gflops = 0.0;     // > 0
  double read_gbps = 0.0;  // > 0
};

struct ParallelWorkload {
  int64_t batch = 1;    // B >= 1 sequences
  int64_t context = 0;  // S >= 1: prefill of S tokens; the decode step reads S cached tokens
  DType kv_dtype = DType::kBF16;      // e_kv
  DType weight_dtype = DType::kBF16;  // e_w
  DType comm_dtype = DType::kF32;     // e_a: attnkit exchanges f32 activations and partials
};

// One phase (prefill or one decode step) of one layer, for the busiest rank.
struct PhaseCost {
  double bytes_sent = 0.0;       // bytes the rank sends per layer in this phase
  double bytes_per_token = 0.0;  // bytes_sent / tokens of the phase (B S or B)
  int64_t messages = 0;          // messages the rank sends per layer
  double compute_s = 0.0;        // kernel time per layer (roofline: max(FLOPs/rate, bytes/rate))
  double exposed_comm_s = 0.0;   // communication time per layer not hidden behind compute
  double step_s = 0.0;           // compute_s + exposed_comm_s
};

struct StrategyCost {
  ParallelStrategy strategy = ParallelStrategy::kSingle;
  bool feasible = true;
  std::string infeasible_reason;  // why not, when !feasible (then the numbers are 0)
  // Doubles, as kv_cache_bytes (exact to 2^53 bytes, never capped).
  double weight_bytes_per_rank = 0.0;  // attention weights of all layers, busiest rank
  double kv_bytes_per_rank = 0.0;      // cache of all layers for B sequences of S tokens
  PhaseCost prefill;                   // per layer
  PhaseCost decode;                    // per layer
};

// The three strategies (single, head-parallel, context-parallel, in that
// order) for `ranks` ranks. Per layer, with M the message of a collective:
//
// head-parallel (shares from head_share; the busiest rank counts):
//   weights  P_r e_w, P_r = attention_params_per_layer of the rank's shard
//            (MLA: q_a/kv_a and their norms replicated, per-head parts split)
//   KV       B S (K_r (D + Dv)) e_kv; MLA: B S (d_c + d_r) e_kv, replicated
//   prefill  FLOPs B prefill_flops_per_layer(shard, S); then an all-reduce
//            of M = B S d e_a, not overlapped: reduce-scatter by recursive
//            halving and all-gather by recursive doubling (Rabenseifner's
//            algorithm; Open MPI sent exactly its bytes at 2 and 4 ranks,
//            more at 3, docs/DISTRIBUTED.md), bytes 2 (N-1)/N M in
//            2 ceil(log2 N) messages, time
//            2 ceil(log2 N) alpha + 2 (N-1)/N M / beta
//   decode   roofline of decode_flops/decode_bytes_per_layer(shard, S) for
//            B tokens; then the all-reduce of M = B d e_a
// context-parallel (token shares from ring_chunks; weights replicated):
//   weights  P e_w
//   KV       B n_r KV_token e_kv, n_r = the rank's tokens of S
//   prefill  projections 2 B n_r P FLOPs; attention over the rank's causal
//            pairs (its two chunks; all S keys per query if not causal)
//            at 2 H (D + Dv) FLOPs per pair and sequence (MLA absorbed:
//            2 H (2 d_c + d_r)), in N ring steps of c = attention / N each;
//            step t > 0 receives the block of rank r - t while computing:
//            block bytes B n_src (K (D + Dv)) e_kv (MLA: B n_src (2 d_c + d_r) e_kv),
//            m = alpha + block / beta, so the phase takes
//            projections + c + (N-1) max(c, m); bytes sent sum over the
//            N-1 blocks the rank forwards
//   decode   roofline of the projections (all weights, B tokens) and the
//            attention over n_r cached tokens; then an all-gather of the
//            partials (out, lse), M = B H (Dv + 1) e_a each (MLA: d_c + 1):
//            bytes (N-1) M in ceil(log2 N) messages, time
//            ceil(log2 N) alpha + (N-1) M / beta (attnkit::dist's default
//            merge, MergeMethod::kAllgather)
//
// Sliding windows are not modelled: every layer counts as full attention
// (an upper bound for windowed layers). Errors: ranks < 1, batch or
// context < 1, rates or link bandwidth <= 0 or not finite, latency < 0, a
// model shape with a size < 1, or a dtype other than f32/bf16/f16.
// Strategies that cannot run on `ranks` (head-parallel with fewer query
// heads than ranks) come back with feasible = false and the reason.
Result<std::vector<StrategyCost>> parallel_costs(const ModelShape& model, int64_t ranks,
                                                 const ParallelWorkload& workload,
                                                 const KernelRates& rates, const LinkModel& link);

}  // namespace attnkit
