// The continuous-batching engine behind `attnkit serve-bench` and the
// serving section of `attnkit compare`: a stack of attnkit's own layers
// over one paged KV pool, and a scheduler in the manner of vLLM's. It sees
// only the public API (include/attnkit/).
//
// The model. `layers` blocks, each
//   h = h + mixer(rms_norm(h))            AttentionLayer or LatentAttention,
//                                         forward_batch over the pool; or
//                                         GatedDeltaNet, forward_batch over
//                                         the sequences' state slots
//   h = h + ffn(rms_norm(h))              with ffn: the config's MoE, or its
//                                         dense SwiGLU MLP as a one-expert
//                                         MoE (the same arithmetic)
// and the step's output for a token is rms_norm(h) (unit gains). Weights
// are seeded random, kept in `weight_dtype` (bf16 as checkpoints ship).
// Nothing is sampled: a prompt token is a row of a seeded random
// vocabulary table, and each generated token's input is the output the
// stack gave for the token before it, so every token costs the real work
// and a sequence's outputs are a deterministic function of its prompt.
//
// The scheduler (run()), once per step:
//   1. requests whose arrival time has come join the waiting queue;
//   2. running sequences, oldest admission first, each get their next
//      tokens: one to decode, or the next prompt chunk, within
//      `max_tokens_per_step` for the whole step (vLLM's chunked prefill).
//      Their slots are reserved in the pool (PagedKVCache::append, all or
//      nothing); when the pool is out of pages the most recently admitted
//      running sequence is preempted: its pages are freed and it goes back
//      to the front of the queue, to be recomputed from its prompt and the
//      outputs it has so far (vLLM's recompute preemption);
//   3. if nothing was preempted, waiting requests are admitted in order
//      while the token budget, `max_seqs` and the pool allow: the free
//      pages must hold every token the request knows (its prompt, and its
//      outputs when it is recomputed) besides the prompt pages promised to
//      the running sequences, and keep a watermark of 1 % of the pool free
//      while others run (vLLM reserves a whole prompt at admission and
//      keeps this watermark), so that admissions do not preempt each other
//      before they decode;
//   4. one forward pass over every scheduled token; each sequence whose
//      scheduled tokens reach the end of what it knows gets an output.
// A stack may mix layer kinds (ModelSpec::stack: gpt-oss's sliding and full
// layers, Gemma 3's local and global, Llama 4's chunked and NoPE, Qwen3-Next's
// Gated DeltaNet and gated full attention). Its attention layers share one
// pool (they must agree on kv heads and head dim); when their windows and
// chunks agree the pool has them and releases pages as they slide, else the
// pool has none and each layer passes its own per call, so a sliding or
// chunked layer then holds every token as a full layer does (the page
// accounting counts what the pool holds: Report::pool_releases_pages).
// Linear-attention layers hold one fixed-size state per sequence in a
// LinearStatePool beside the pool, added and removed with the sequence; its
// bytes count against the same budget (Budget in serve_engine.cc): a sequence costs its
// state besides its pages.
//
// The clock is the measured time of the steps; when nothing runs and
// nothing waits it jumps to the next arrival instead of sleeping.
//
// CacheMode::kStatic emulates engines without paging: every admitted
// sequence reserves `max_seq_len` tokens of the budget up front, as a dense
// per-sequence cache does, so at most budget / (max_seq_len * bytes per
// token) sequences run at once and none is ever preempted. The tokens still
// live in pages of the same pool, so the attention costs what the paged
// mode's does (docs/PAGED.md measures the paged decode at 1.00-1.06x a
// dense one): the two modes differ in admission only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "attnkit/attention_layer.h"
#include "attnkit/gated_deltanet.h"
#include "attnkit/latent_attention.h"
#include "attnkit/linear_state_pool.h"
#include "attnkit/moe.h"
#include "attnkit/paged_kv_cache.h"
#include "attnkit/status.h"
#include "attnkit/tensor.h"

namespace attnkit::serve {

// One layer of a stack whose layers differ: softmax attention (any window,
// chunk, sinks, output gate, RoPE or NoPE) or Gated DeltaNet.
struct StackLayer {
  LayerKind kind = LayerKind::kAttention;  // kAttention or kLinearAttention
  AttentionConfig attention;               // kAttention; must be causal
  GatedDeltaNetConfig linear;              // kLinearAttention
};

struct ModelSpec {
  bool mla = false;
  AttentionConfig attention;  // every layer's when !mla and `stack` is empty; must be causal
  // When not empty: `layers` entries, each layer's own mixer (overrides
  // `attention`; !mla). At least one is attention (the pool's shape).
  std::vector<StackLayer> stack;
  MlaConfig latent;  // when mla
  // The feed-forward after each attention layer, when `ffn`.
  bool ffn = false;
  MoeConfig moe;
  int64_t layers = 1;
  DType weight_dtype = DType::kBF16;  // kF32 or kBF16
  uint64_t seed = 1;
};

class Model {
 public:
  // Builds the layers and fills their weights (seeded random).
  static Result<Model> create(const ModelSpec& spec);

  const ModelSpec& spec() const { return spec_; }
  int64_t hidden_size() const { return hidden_; }
  // Bytes of the layers' weights as kept.
  size_t weight_bytes() const { return weight_bytes_; }

  // A pool for this model: one pool layer per attention layer, with the
  // layers' window / chunk when they all agree, else none (each layer
  // passes its own per call and the pool releases no pages).
  Result<PagedKVCache> new_pool(int64_t num_pages, int64_t page_size, DType kv_dtype) const;
  // Whether new_pool's pool releases the pages of tokens that left every
  // layer's window or chunk (one window / chunk for all attention layers).
  bool pool_releases_pages() const;
  // The state slots of the linear-attention layers (one per sequence, at
  // most max_sequences; 0 = no limit), or a pool of no layers.
  Result<LinearStatePool> new_state_pool(int64_t max_sequences = 0) const;
  // Bytes of one sequence's state over every linear-attention layer.
  int64_t state_bytes_per_sequence() const;
  int64_t linear_layers() const { return static_cast<int64_t>(linear_.size()); }

  // One continuous-batching step over the tokens reserved in `pool` (and,
  // with linear-attention layers, the sequences' slots in `states`, under
  // the same ids):
  //   x   [total, hidden]  the new tokens' inputs, packed by cu_seqlens
  //   out [total, hidden]  written: rms_norm of the last block's h per row
  Status forward(std::span<const float> x, std::span<const int32_t> cu_seqlens,
                 std::span<const int64_t> seq_ids, PagedKVCache& pool, LinearStatePool& states,
                 std::span<float> out, const RunOptions& run);

  // The input vector of prompt token `position` of request `request`: a
  // row of the vocabulary table, chosen by a hash of both.
  std::span<const float> prompt_token(int64_t request, int64_t position) const;

 private:
  Model() = default;
  Status add_mixer(const StackLayer& layer, uint64_t seed);
  Status add_latent(uint64_t seed);
  Status add_feed_forward(uint64_t seed);
  Status run_mixer(int64_t l, const TensorView& in, std::span<const int32_t> cu_seqlens,
                   std::span<const int64_t> seq_ids, PagedKVCache& pool, LinearStatePool& states,
                   const TensorView& out, const RunOptions& run);

  ModelSpec spec_;
  int64_t hidden_ = 0;
  size_t weight_bytes_ = 0;
  std::vector<AttentionLayer> attention_;
  std::vector<LatentAttention> latent_;
  std::vector<GatedDeltaNet> linear_;
  // Per model layer: its index in attention_ / latent_ (the pool layer) or
  // in linear_ (the state pool layer), and whether it is linear.
  std::vector<int64_t> index_;
  std::vector<bool> is_linear_;
  std::vector<MoeLayer> ffn_;
  std::vector<float> vocabulary_;    // [kVocabulary, hidden]
  std::vector<float> h_, in_, tmp_;  // step scratch, grown to the largest step
};

struct Request {
  double arrival_s = 0.0;     // from the start of the trace, >= 0
  int64_t prompt_tokens = 1;  // >= 1
  int64_t output_tokens = 1;  // >= 1
};

enum class CacheMode { kPaged, kStatic };

struct Options {
  CacheMode cache = CacheMode::kPaged;
  int64_t memory_bytes = 0;  // the KV budget, all layers
  int64_t page_size = 16;
  DType kv_dtype = DType::kBF16;
  int64_t max_tokens_per_step = 512;  // vLLM's max_num_batched_tokens
  int64_t max_seqs = 256;             // vLLM's max_num_seqs
  // kStatic: the tokens each sequence reserves (0 = the longest request's
  // prompt + output - 1, what a static engine must be configured for).
  int64_t max_seq_len = 0;
  RunOptions run;
  bool keep_outputs = false;  // record every output vector (tests)
  // Called after each step that finished requests: (finished, total).
  std::function<void(int64_t, int64_t)> on_progress;
};

struct RequestReport {
  double arrival_s = 0.0;
  double first_token_s = -1.0;  // engine clock; -1 = never
  double finish_s = -1.0;
  int64_t output_tokens = 0;  // produced
  int64_t preemptions = 0;
  std::vector<float> outputs;  // [output_tokens, hidden] when keep_outputs
};

struct Report {
  std::vector<RequestReport> requests;  // in trace order
  double start_s = 0.0, end_s = 0.0;    // first arrival, last finish (engine clock)
  double busy_s = 0.0;                  // time spent in steps
  int64_t steps = 0, preemptions = 0;
  int64_t tokens_computed = 0;           // forward-pass tokens, recomputation included
  int64_t peak_running = 0;              // sequences in one step
  double mean_running = 0.0;             // per step, weighted by step time
  int64_t kv_bytes_per_token = 0;        // all layers
  int64_t state_bytes_per_sequence = 0;  // linear-attention layers, all of them
  bool pool_releases_pages = true;       // Model::pool_releases_pages
  int64_t pool_pages = 0;
  int64_t max_running = 0;  // kStatic: the slots the budget holds; kPaged: 0 (no fixed limit)
  int64_t max_seq_len = 0;  // kStatic: each slot's reservation
  // KV bytes: `used` holds the tokens computed, `reserved` what the
  // sequences hold (pages, or static slots); peak and step-time mean.
  double peak_used_bytes = 0.0, mean_used_bytes = 0.0;
  double peak_reserved_bytes = 0.0, mean_reserved_bytes = 0.0;
};

// A synthetic trace of n requests: prompt and output lengths uniform on
// [prompt_min, prompt_max] and [output_min, output_max]; arrivals a Poisson
// process of `rate` requests per second, or all at 0 when rate is infinite.
// Seeded: the same arguments give the same trace.
std::vector<Request> synthetic_trace(int64_t n, double rate, int64_t prompt_min, int64_t prompt_max,
                                     int64_t output_min, int64_t output_max, uint64_t seed);

// Why `requests` cannot be served under `options` on `model` (one line
// naming the request, its tokens and the budget), or OK: a request needs
// prompt + output - 1 token slots (its last output is not fed back).
Status check_feasible(const Model& model, std::span<const Request> requests,
                      const Options& options);

// Serves every request (check_feasible first) and reports what happened.
Result<Report> run(Model& model, std::span<const Request> requests, const Options& options);

}  // namespace attnkit::serve
