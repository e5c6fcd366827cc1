// attnkit/dist.h — attention split across processes with MPI (the library
// attnkit::dist, built when CMake finds MPI; the core attnkit library has no
// MPI dependency). docs/DISTRIBUTED.md explains the strategies, their
// communication volumes and what they cost on this machine.
//
//   HeadParallelAttention        MHA/MQA/GQA layer split by heads (Megatron-style)
//   HeadParallelLatentAttention  MLA layer split by query heads
//   context_parallel_decode      decode over keys split by tokens, merged by LSE
//   merge_partial_attention      that merge alone, for any local partial attention
//   ring_attention               causal prefill over load-balanced token chunks
//
// Every function here is collective over its communicator: every rank calls
// it, in the same order, with the arguments the contract says must match.
// Errors are collective too. Each rank checks its own arguments, then the
// ranks agree on the outcome (one small collective) before any rank enters
// a data collective, so an invalid argument on one rank makes the call fail
// on every rank with that rank's message, "... (on rank r of N)", and no
// rank is left waiting. A call that fails changes no rank's outputs, caches
// or weights. Nothing throws. One gap remains: a resource failure (memory)
// on one rank after the agreement, inside a layer's forward, is still
// reported on every rank, but the other ranks' caches have by then taken the
// new tokens; the next call on the caches fails with a message that their
// lengths differ, and the caches must be reset.
//
// The communicator must be a valid intracommunicator on every rank and MPI
// initialised (MPI_THREAD_FUNNELED or higher: attnkit's worker threads never
// call MPI, the calling thread does). The layers duplicate it, so their
// messages never meet the caller's; the free functions use it directly, with
// tag kRingTag for ring_attention's point-to-point messages.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/attention_layer.h"
#include "attnkit/config.h"
#include "attnkit/kv_cache.h"
#include "attnkit/latent_attention.h"
#include "attnkit/parallel_cost.h"
#include "attnkit/status.h"
#include "attnkit/tensor.h"
#include "attnkit/weights.h"

namespace attnkit::dist {

// The tag of ring_attention's sends and receives on the caller's communicator.
inline constexpr int kRingTag = 0x7a11;

// A communicator the object owns (an MPI_Comm_dup), freed when it goes, unless MPI
// has been finalised by then.
class OwnedComm {
 public:
  OwnedComm() = default;
  explicit OwnedComm(MPI_Comm comm) : comm_(comm) {}
  OwnedComm(OwnedComm&& other) noexcept;
  OwnedComm& operator=(OwnedComm&& other) noexcept;
  OwnedComm(const OwnedComm&) = delete;
  OwnedComm& operator=(const OwnedComm&) = delete;
  ~OwnedComm();
  MPI_Comm get() const { return comm_; }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
};

// Collective. Every rank passes the outcome of some step of its own; every
// rank gets OK when all passed OK, else the lowest failing rank's status
// with " (on rank r of N)" appended. For callers that do local work of
// their own before calling the functions below (a binding converting its
// arguments), so that their failure on one rank also fails every rank.
Status agree(MPI_Comm comm, const Status& local);

// ---------------------------------------------------------------- head parallel

// An MHA/MQA/GQA layer split by heads over the ranks of a communicator.
// Rank r owns the heads head_share(num_heads, num_kv_heads, N, r) gives
// (contiguous kv heads with their query heads; kv heads replicated when
// there are fewer kv heads than ranks), and runs an AttentionLayer on that
// shard: the rows of q/k/v_proj (and their biases) of its heads, the
// columns of o_proj that read them, qk-norm gains whole, RoPE, window and
// softcap as configured. Its KVCache holds only its kv heads. forward()
// sums the ranks' o_proj outputs with one MPI_Allreduce; o_proj's bias is
// loaded on rank 0 only, so it is added once. Every rank passes the same x
// and gets the whole output. num_heads must be >= the number of ranks.
class HeadParallelAttention {
 public:
  // Collective. Fails (on every rank) when the config is invalid or differs
  // between ranks, or num_heads < ranks.
  static Result<HeadParallelAttention> create(MPI_Comm comm, const AttentionConfig& config);
  // attention_config_from_json, then create().
  static Result<HeadParallelAttention> from_config_json(MPI_Comm comm, std::string_view json_text,
                                                        int64_t layer_index = 0);

  const AttentionConfig& config() const { return config_; }                // the whole layer
  const AttentionConfig& local_config() const { return local_.config(); }  // this rank's shard
  const HeadShare& share() const { return share_; }
  int rank() const { return rank_; }
  int ranks() const { return ranks_; }

  // Collective. Takes the whole layer's weights (Hugging Face names under
  // `prefix`, the shapes AttentionLayer::weight_names() lists for config())
  // and keeps this rank's shard. Strict as AttentionLayer::load_weights; on
  // failure no rank's weights change.
  Status load_weights(const WeightMap& weights, std::string_view prefix = "");

  // Collective. This rank's cache: its kv heads only.
  Result<KVCache> new_cache(int64_t batch_size, int64_t max_seq_len,
                            DType dtype = DType::kF32) const;

  // Collective. AttentionLayer::forward's contract, over all heads:
  //   x   [batch, seq, hidden] f32, hidden contiguous; the same on every rank
  //   out [batch, seq, hidden] f32, contiguous, not overlapping x; written on every rank
  // positions and the cache's presence and length must match across ranks;
  // batch * seq * hidden must fit an int (one MPI message).
  Status forward(const TensorView& x, const TensorView& out,
                 std::span<const int64_t> positions = {}, KVCache* cache = nullptr,
                 const RunOptions& run = {});

 private:
  HeadParallelAttention() = default;
  // create() and from_config_json(): a parse failure is agreed on like any other.
  static Result<HeadParallelAttention> build(MPI_Comm comm, const Result<AttentionConfig>& config);

  OwnedComm comm_;
  int rank_ = 0, ranks_ = 1;
  AttentionConfig config_;
  HeadShare share_;
  AttentionLayer local_;  // this rank's shard
  bool loaded_ = false;
};

// An MLA layer split by query heads: rank r owns heads head_share(H, H, N, r),
// i.e. [H r / N, H (r+1) / N): its rows of q_b_proj (or q_proj) and of
// kv_b_proj, its columns of o_proj; q_a_proj, kv_a_proj_with_mqa and their
// norms are replicated. The latent cache is replicated too: every rank
// computes the same latent rows (kv_a is replicated), stores all of them
// ([batch, max_seq_len, d_c + d_r], as LatentAttention's cache), and reads all
// of them for its own heads, in the naive form (decompressing only its
// heads' K/V) or the absorbed one (attending the latent rows with its heads'
// absorbed queries). One all-reduce of the o_proj partial sums per call.
class HeadParallelLatentAttention {
 public:
  static Result<HeadParallelLatentAttention> create(MPI_Comm comm, const MlaConfig& config);
  static Result<HeadParallelLatentAttention> from_config_json(MPI_Comm comm,
                                                              std::string_view json_text);

  const MlaConfig& config() const { return config_; }
  const MlaConfig& local_config() const { return local_.config(); }
  const HeadShare& share() const { return share_; }
  int rank() const { return rank_; }
  int ranks() const { return ranks_; }

  // As HeadParallelAttention::load_weights, with LatentAttention's names.
  Status load_weights(const WeightMap& weights, std::string_view prefix = "");
  Result<LatentCache> new_cache(int64_t batch_size, int64_t max_seq_len,
                                DType dtype = DType::kF32) const;
  // LatentAttention::forward's contract; x and out contiguous, the form
  // the same on every rank (kAuto chooses the same on every rank).
  Status forward(const TensorView& x, const TensorView& out,
                 std::span<const int64_t> positions = {}, LatentCache* cache = nullptr,
                 const RunOptions& run = {}, MlaForm form = MlaForm::kAuto);

 private:
  HeadParallelLatentAttention() = default;
  static Result<HeadParallelLatentAttention> build(MPI_Comm comm, const Result<MlaConfig>& config);

  OwnedComm comm_;
  int rank_ = 0, ranks_ = 1;
  MlaConfig config_;
  HeadShare share_;
  LatentAttention local_;
  bool loaded_ = false;
};

// ---------------------------------------------------------------- context parallel

// How the ranks' partial (out, lse) pairs are combined; both give
// bit-identical results on every rank. With M the bytes of one partial:
//   kAllgather  MPI_Allgather of every partial, then each rank merges them
//               in rank order: (N-1) M sent per rank. The default: its cost
//               does not depend on how the MPI library runs a user operation;
//               under Open MPI 4.1 it sent the same bytes as kAllreduce at 2,
//               3 and 4 ranks, and at 2 ranks the two took the same time
//               within this machine's noise (docs/DISTRIBUTED.md).
//   kAllreduce  one MPI_Allreduce with a custom operation that applies
//               merge_attention_states to a single element holding every
//               row of the partial. Its cost is the MPI library's choice of
//               algorithm for a user operation: recursive doubling sends
//               ceil(log2 N) M per rank, but Open MPI 4.1's default choice
//               (reduce to a root, then broadcast) sends (N-1) M from the
//               root (measured at 4 ranks: 3 M).
enum class MergeMethod : uint8_t { kAllgather, kAllreduce };

// Collective. Combines the ranks' partial attentions over disjoint key sets
// into the attention over all keys, on every rank:
//   out_local [batch, seqlen_q, num_heads, head_dim_v] f32  this rank's partial
//   lse_local [batch, num_heads, seqlen_q]             f32  its log-sum-exp
//   out       [batch, seqlen_q, num_heads, head_dim_v] f32, contiguous, written
//   lse       [batch, num_heads, seqlen_q]             f32, contiguous, optional
// Shapes must match across ranks; a rank without keys passes lse = -inf
// (and any out). This is the hook for caches that compute their partial
// attention some other way (a paged KV pool): any kernel that returns
// (out, lse) over its rank's keys can be merged here.
Status merge_partial_attention(MPI_Comm comm, const TensorView& out_local,
                               const TensorView& lse_local, const TensorView& out,
                               const TensorView& lse = {},
                               MergeMethod method = MergeMethod::kAllgather);

struct ContextParallelOptions {
  float softmax_scale = 0.0f;  // 0 = 1/sqrt(head_dim)
  float softcap = 0.0f;        // 0 = off
  // [batch] valid keys of this rank's share per sequence (a ragged batch);
  // empty = all k_local.shape[1].
  std::span<const int32_t> seqlens_k;
  MergeMethod merge = MergeMethod::kAllgather;
  Backend backend = Backend::kAuto;
  int num_threads = 0;
};

// Collective. Decode attention over keys split across ranks by tokens (any
// split: contiguous, round-robin, or none on some ranks): every query sees
// every key of every rank (no mask; the new tokens are the newest, so
// causality holds), and every rank gets the result.
//   q       [batch, seqlen_q, num_heads, head_dim]         f32, the same on every rank
//   k_local [batch, seqlen_k_r, num_kv_heads, head_dim]   f32 or bf16, this rank's keys
//   v_local [batch, seqlen_k_r, num_kv_heads, head_dim_v] same dtype as k_local
//   out     [batch, seqlen_q, num_heads, head_dim_v]      f32, contiguous, written
//   lse     [batch, num_heads, seqlen_q]                  f32, contiguous, optional
// Each rank runs sdpa() over its keys with lse, then merge_partial_attention.
// seqlen_k_r may differ between ranks and be 0; everything else must match.
Status context_parallel_decode(MPI_Comm comm, const TensorView& q, const TensorView& k_local,
                               const TensorView& v_local, const TensorView& out,
                               const ContextParallelOptions& options = {},
                               const TensorView& lse = {});

// ---------------------------------------------------------------- ring attention

struct RingOptions {
  bool causal = true;
  float softmax_scale = 0.0f;  // 0 = 1/sqrt(head_dim)
  float softcap = 0.0f;        // 0 = off
  Backend backend = Backend::kAuto;
  int num_threads = 0;
};

// Collective. Self-attention over a sequence of S tokens whose queries,
// keys and values are split across the N ranks as ring_chunks(S, N, r)
// says: rank r holds chunk r followed by chunk 2N-1-r of 2N near-equal
// chunks, so that under the causal mask every rank has the same work.
//   q_local   [batch, n_r, num_heads, head_dim]       f32
//   k_local   [batch, n_r, num_kv_heads, head_dim]    f32 or bf16
//   v_local   [batch, n_r, num_kv_heads, head_dim_v]  same dtype as k_local
//   out_local [batch, n_r, num_heads, head_dim_v]     f32, contiguous, written
//   lse_local [batch, num_heads, n_r]                 f32, contiguous, optional
// n_r = ring_chunks(S, N, r).size(); S is the sum of the ranks' n_r, and a
// rank whose n_r does not fit the layout makes the call fail. The K/V
// blocks travel around the ring (rank r sends to r+1): N steps, and during
// each step but the last the next block is received (MPI_Isend/MPI_Irecv)
// while the current one is attended. batch, heads, dims, dtype and options
// must match across ranks; a block's K and V elements must fit an int. The
// scratch (two [batch, n, num_heads, head_dim_v] f32 buffers and two K/V
// blocks) is kept by the calling thread for its later calls.
Status ring_attention(MPI_Comm comm, const TensorView& q_local, const TensorView& k_local,
                      const TensorView& v_local, const TensorView& out_local,
                      const RingOptions& options = {}, const TensorView& lse_local = {});

}  // namespace attnkit::dist
