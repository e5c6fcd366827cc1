// attnkit/serve.h — a continuous-batching engine over the paged KV pool.
//
// Engine serves any StepModel (attnkit/step_model.h): requests carry prompt
// token ids and an output length; each step() schedules tokens in the
// manner of vLLM (docs/SERVING.md has the scheduler in full):
//   1. running sequences, oldest admission first, get their next tokens:
//      one to decode, or the next prompt chunk, within max_tokens_per_step
//      for the whole step (chunked prefill). Their slots are reserved in
//      the pool, all or nothing; when the pool is out of pages the most
//      recently admitted running sequence is preempted: its pages are freed
//      and it goes back to the front of the queue, to be recomputed from
//      its prompt and the tokens it has so far (recompute preemption);
//   2. if nothing was preempted, waiting requests are admitted first come
//      first served while the token budget, max_seqs and the pool allow
//      (the pool must hold every token the request knows beside the prompt
//      pages promised to the running sequences, and keep 1 % of the pool
//      free while others run); with prefix caching an admitted request
//      first takes over the longest cached page-aligned prefix of what it
//      knows (PagedKVCache::add_sequence(prompt)) and computes the rest;
//   3. one forward_step over every scheduled token; each sequence whose
//      tokens reach the end of what it knows samples its next token (greedy
//      argmax, or the options' sample callback).
// CacheMode::kStatic emulates engines without paging: each admitted
// sequence reserves max_seq_len tokens of the budget up front.
//
// The clock is the measured time of the steps (advance_clock() moves it
// over idle time); every metric is on that clock.
//
// serve::SyntheticModel is the benchmark fixture: a stack of the library's
// layers with seeded random weights, a small seeded vocabulary and LM head,
// so that the layers' work dominates; serve::run() drives an Engine
// through a trace of timed requests and reports what `attnkit serve-bench`
// prints.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "attnkit/attention_layer.h"
#include "attnkit/gated_deltanet.h"
#include "attnkit/latent_attention.h"
#include "attnkit/linear_state_pool.h"
#include "attnkit/moe.h"
#include "attnkit/paged_kv_cache.h"
#include "attnkit/status.h"
#include "attnkit/step_model.h"
#include "attnkit/tensor.h"

namespace attnkit {

enum class CacheMode { kPaged, kStatic };

struct EngineOptions {
  int64_t kv_memory = int64_t{256} << 20;  // bytes: KV pages and linear states, all layers
  int64_t page_size = 16;
  DType kv_dtype = DType::kBF16;
  bool prefix_caching = false;  // reuse cached full pages of a shared prompt prefix
  // The pool's attention plans (PagedKVCache::set_batch_invariant): on, a
  // request's tokens and logits do not depend on what else runs, how its
  // prompt was chunked or what the prefix cache held; off, decode attention
  // is faster (key splits) and outputs agree to rounding only.
  bool batch_invariant = true;
  int64_t max_tokens_per_step = 512;  // vLLM's max_num_batched_tokens
  int64_t max_seqs = 256;             // vLLM's max_num_seqs
  CacheMode cache = CacheMode::kPaged;
  int64_t max_seq_len = 0;  // kStatic: the token slots each sequence reserves (> 0)
  RunOptions run;
  // The next token from a sequence's last logits [vocab_size]; empty =
  // greedy (the first largest logit). A token outside the vocabulary ends
  // that request with an error.
  std::function<int32_t(std::span<const float> logits)> sample;
};

// What happened to a request, in this order: kFirstToken once, then a
// kToken per generated token (the first included), then kFinish.
struct RequestEvent {
  enum class Kind { kFirstToken, kToken, kFinish };
  Kind kind = Kind::kToken;
  int64_t request_id = 0;
  int32_t token = -1;  // kToken: the token; else -1
  double time_s = 0;   // engine clock
};
using EventCallback = std::function<void(const RequestEvent&)>;

// A request's metrics on the engine clock (-1 = not yet).
struct RequestMetrics {
  double arrival_s = 0;
  double admitted_s = -1;  // first scheduled: queue time = admitted_s - arrival_s
  double first_token_s = -1;
  double finish_s = -1;
  int64_t prompt_tokens = 0;
  int64_t output_tokens = 0;  // generated so far
  int64_t preemptions = 0;
  int64_t cached_tokens = 0;  // prompt tokens taken over from the prefix cache, all admissions
};

// The requests that advanced in one step.
struct StepOutput {
  int64_t request_id = 0;
  std::vector<int32_t> new_token_ids;  // 0 (a prompt chunk short of its end) or 1
  bool finished = false;
  Status status;  // not OK: the request ended with this error (a bad sampled token)
};

// Totals since create(), on the engine clock.
struct EngineStats {
  int64_t steps = 0, preemptions = 0;
  int64_t tokens_computed = 0;         // forward-pass tokens, recomputation included
  int64_t prompt_tokens_computed = 0;  // of those, prompt tokens (prefill)
  int64_t prompt_tokens_admitted = 0;  // prompt tokens of every admission
  int64_t prompt_tokens_cached = 0;    // of those, taken over from the prefix cache
  int64_t peak_running = 0;            // sequences in one step
  double busy_s = 0;                   // time in steps (the clock's share)
  double wall_s = 0;                   // time in step(), its bookkeeping after the pass too
  double forward_s = 0;                // of that, in forward_step; the rest is overhead
  double running_s = 0;                // sum of sequences-in-step x step time
  double peak_used_bytes = 0, used_byte_s = 0;          // KV of computed tokens + states
  double peak_reserved_bytes = 0, reserved_byte_s = 0;  // pages (or static slots) + states
};

// How an engine's kv_memory divides (Engine::budget).
struct EngineBudget {
  int64_t page_bytes = 0;       // one page, all layers
  int64_t bytes_per_token = 0;  // all layers
  int64_t state_bytes = 0;      // one sequence's linear-attention state, all layers
  int64_t pages = 0;            // the pool's
  int64_t max_seq_len = 0;      // kStatic: each slot's reservation
  int64_t slots = 0;            // kStatic: the sequences the budget holds
};

class Engine {
 public:
  // An engine over `model` (which must outlive it), with a pool of the
  // pages kv_memory holds beside one sequence's linear state.
  static Result<Engine> create(StepModel& model, const EngineOptions& options);

  Engine(Engine&&) noexcept;
  Engine& operator=(Engine&&) noexcept;
  ~Engine();

  // Queues a request; its id (0, 1, ... in order of acceptance). Refused,
  // changing nothing: an empty prompt, a token outside the vocabulary,
  // max_tokens < 1, a request whose prompt + max_tokens - 1 token slots the
  // whole pool (kStatic: max_seq_len) cannot hold, an arrival_s after the
  // clock. arrival_s defaults to the clock.
  Result<int64_t> add_request(std::span<const int32_t> prompt_token_ids, int64_t max_tokens,
                              EventCallback on_event = {},
                              std::optional<double> arrival_s = std::nullopt);

  // One scheduling step and forward pass; the requests that advanced. With
  // nothing to do: an empty list. A failed forward pass returns its error
  // and sends every scheduled sequence back to the queue to be recomputed
  // (nothing is lost).
  Result<std::vector<StepOutput>> step();

  bool has_unfinished() const { return !running_.empty() || !waiting_.empty(); }
  int64_t num_running() const { return static_cast<int64_t>(running_.size()); }
  int64_t num_waiting() const { return static_cast<int64_t>(waiting_.size()); }

  double clock_s() const { return clock_; }
  // Moves the clock forward to t (idle time; never backwards).
  void advance_clock(double t);

  Result<RequestMetrics> metrics(int64_t request_id) const;
  const EngineStats& stats() const { return stats_; }

  const EngineBudget& budget() const { return budget_; }
  // The pool's prefix cache counters (all zero without prefix caching).
  PrefixCacheStats prefix_cache_stats() const { return pool_->prefix_cache_stats(); }
  const EngineOptions& options() const { return options_; }
  // The budget create() would divide (options checked; no pool built).
  static Result<EngineBudget> plan_budget(const StepModel& model, const EngineOptions& options);

 private:
  struct Req;
  Engine() = default;
  Req& req(int64_t id);
  int64_t known(int64_t id) const;
  int64_t free_pages(int64_t running) const;
  Status reserve(int64_t id, int64_t want);
  Status enter(int64_t id);
  void leave(int64_t id);
  void preempt(int64_t id);
  Status schedule_running(int64_t& budget, bool& preempted);
  Status admit(int64_t& budget);
  Status forward();
  void collect(double dt, std::vector<StepOutput>& out);
  void account(double dt);

  StepModel* model_ = nullptr;
  EngineOptions options_;
  int64_t vocab_ = 0;
  EngineBudget budget_;
  std::optional<PagedKVCache> pool_;
  std::optional<LinearStatePool> states_;
  std::vector<Req> reqs_;
  std::deque<int64_t> waiting_;
  std::vector<int64_t> running_;  // admission order
  std::vector<int64_t> scheduled_, counts_;
  std::vector<int32_t> tokens_, cu_;
  std::vector<int64_t> ids_;
  std::vector<float> logits_;
  EngineStats stats_;
  double clock_ = 0;
};

namespace serve {

// One layer of a fixture stack whose layers differ: softmax attention (any
// window, chunk, sinks, output gate, RoPE or NoPE) or Gated DeltaNet.
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
  // The feed-forward after each mixer, when `ffn`.
  bool ffn = false;
  MoeConfig moe;
  int64_t layers = 1;
  DType weight_dtype = DType::kBF16;  // kF32 or kBF16
  int64_t vocab_size = 512;
  uint64_t seed = 1;
};

// The first `layers` layers of a Hugging Face config.json (text), each of
// its own kind: MLA for DeepSeek's families, else each layer's attention
// config or Gated DeltaNet config. No feed-forward.
Result<ModelSpec> synthetic_spec_from_json(const std::string& config_json, int64_t layers);

// The benchmark fixture. `layers` blocks, each
//   h = h + mixer(rms_norm(h))     AttentionLayer or LatentAttention over the
//                                  pool, or GatedDeltaNet over the state slots
//   h = h + ffn(rms_norm(h))       when spec.ffn: the MoE (a dense SwiGLU MLP
//                                  is a one-expert MoE)
// with h of a token = its row of a seeded embedding table [vocab, hidden]
// (unit RMS), and logits = head · rms_norm(h) for a seeded head
// [vocab, hidden]. Norm gains are 1; weights are seeded uniform in
// nn.Linear's range, kept in weight_dtype.
class SyntheticModel final : public StepModel {
 public:
  static Result<SyntheticModel> create(const ModelSpec& spec);

  const ModelSpec& spec() const { return spec_; }
  int64_t hidden_size() const { return hidden_; }
  size_t weight_bytes() const { return weight_bytes_; }  // the layers', as kept
  int64_t linear_layers() const { return static_cast<int64_t>(linear_.size()); }

  int64_t vocab_size() const override { return spec_.vocab_size; }
  Result<PagedKVCache> new_pool(int64_t num_pages, int64_t page_size, DType kv_dtype,
                                bool prefix_caching) const override;
  bool pool_releases_pages() const override;
  Result<LinearStatePool> new_state_pool(int64_t max_sequences) const override;
  int64_t state_bytes_per_sequence() const override;
  Status forward_step(std::span<const int32_t> token_ids, std::span<const int32_t> cu_seqlens,
                      std::span<const int64_t> seq_ids, PagedKVCache& pool, LinearStatePool& states,
                      std::span<float> logits, const RunOptions& run) override;

 private:
  SyntheticModel() = default;
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
  std::vector<float> embedding_;     // [vocab, hidden]
  std::vector<float> head_;          // [vocab, hidden]
  std::vector<float> ones_;          // [hidden]: the norms' unit gains
  std::vector<float> h_, in_, tmp_;  // step scratch, grown to the largest step
};

// A request of a trace.
struct Request {
  double arrival_s = 0.0;  // >= 0: from the start, or from `after`'s finish
  // >= 1 tokens; with `continues`, the tokens after the conversation so far.
  std::vector<int32_t> prompt_token_ids;
  int64_t output_tokens = 1;  // >= 1
  int64_t after = -1;         // a request earlier in the trace to finish first
  // The prompt is `after`'s prompt and the tokens it generated, then
  // prompt_token_ids (the next turn of a conversation).
  bool continues = false;
};

// The whole prompt length of each request (with what `continues` adds).
std::vector<int64_t> prompt_lengths(std::span<const Request> requests);

// A synthetic trace: `requests` conversations of `turns` requests each
// (turns = 1: independent requests), their arrivals a Poisson process of
// `rate` per second, or all at 0 when rate is infinite. Each prompt has
// [prompt_min, prompt_max] own tokens; the first turn's come after a
// shared prefix of shared_prefix tokens (conversation i takes prefix
// i % prefix_groups), and turn k + 1 follows turn k's finish at once,
// continuing it (Request::continues). Outputs have [output_min,
// output_max] tokens. Token ids are seeded hashes below vocab_size; the
// same options give the same trace.
struct TraceOptions {
  int64_t requests = 32;
  double rate = std::numeric_limits<double>::infinity();
  int64_t prompt_min = 32, prompt_max = 256, output_min = 16, output_max = 128;
  int64_t shared_prefix = 0, prefix_groups = 1, turns = 1;
  int64_t vocab_size = 512;
  uint64_t seed = 1;
};
std::vector<Request> synthetic_trace(const TraceOptions& options);

struct RequestReport {
  RequestMetrics metrics;
  std::vector<int32_t> token_ids;  // generated
  Status status;                   // not OK: ended with this error
};

struct Report {
  std::vector<RequestReport> requests;  // in trace order
  EngineStats stats;
  double start_s = 0.0, end_s = 0.0;  // first arrival, last finish (engine clock)
  double mean_running = 0.0;          // per step, weighted by step time
  double mean_used_bytes = 0.0, mean_reserved_bytes = 0.0;
  int64_t kv_bytes_per_token = 0;        // all layers
  int64_t state_bytes_per_sequence = 0;  // linear-attention layers, all of them
  bool pool_releases_pages = true;
  int64_t pool_pages = 0;
  int64_t max_running = 0;  // kStatic: the slots the budget holds; kPaged: 0
  int64_t max_seq_len = 0;  // kStatic: each slot's reservation
  // Prompt tokens taken over from the prefix cache / all admitted.
  double prefix_hit_rate = 0.0;
};

// kStatic with max_seq_len 0: the longest request's prompt + output - 1.
EngineOptions options_for_trace(EngineOptions options, std::span<const Request> requests);

// Why `requests` cannot be served under `options` on `model` (one line
// naming the request, its tokens and the budget), or OK.
Status check_feasible(const StepModel& model, std::span<const Request> requests,
                      const EngineOptions& options);

// Serves every request (check_feasible first), each added when its arrival
// comes, and reports. on_progress(finished, total) after each step that
// finished requests.
Result<Report> run(StepModel& model, std::span<const Request> requests,
                   const EngineOptions& options,
                   const std::function<void(int64_t, int64_t)>& on_progress = {});

}  // namespace serve
}  // namespace attnkit
