// attnkit/report.h — the figures that the reports of `attnkit compare` and
// `attnkit plan` are made of, computed from model shapes (analysis.h) and,
// where a report measured something, from its measurements: a layer's
// figures, a whole model's sums, what a set of measured variants concludes,
// and how far a memory budget goes. No timing and no text here: a front end
// measures, asks these functions, then renders their result structs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attnkit/analysis.h"
#include "attnkit/tensor.h"

namespace attnkit {

// One attention layer of `shape` (its first attention layer's kind):
// weights in f32, `batch` sequences, KV stored in `kv`. A DeepSeek sparse
// attention shape (index_topk > 0) counts its indexer and its sparse path
// (dsa_layer_figures).
struct LayerFigures {
  double params = 0;              // attention_params_per_layer
  double kv_bytes_per_token = 0;  // kv_bytes_per_token (scales included)
  double kv_cache_bytes = 0;      // `context` tokens x `batch`
  double prefill_flops = 0;       // causal prefill of `prompt` tokens, x `batch`
  double decode_flops = 0;        // one token over `context` cached, x `batch`
  double decode_bytes = 0;        // f32 weights + the K/V that step reads
};
LayerFigures layer_figures(const ModelShape& shape, DType kv, int64_t prompt, int64_t context,
                           int64_t batch);

// A whole model, summed layer by layer (analysis.h's rules), weights f32.
struct ModelFigures {
  int64_t params = 0;              // attention_params_total
  int64_t kv_bytes_per_token = 0;  // all layers that hold K/V
  double kv_cache_bytes = 0;       // `context` tokens x `batch`
  double linear_state_bytes = 0;   // Gated DeltaNet state x `batch` (f32)
  double prefill_flops = 0;        // causal prefill of `prompt` tokens, x `batch`
  double decode_flops = 0;         // one step over `context`, x `batch`
  double decode_bytes = 0;         // what that step reads
};
ModelFigures model_figures(const ModelShape& model, DType kv, int64_t prompt, int64_t context,
                           int64_t batch);

// One variant's measured layer: its shape and the median seconds of a
// prefill and of a decode step.
struct VariantTiming {
  std::string variant;
  ModelShape shape;
  double prefill_seconds = 0;
  double decode_seconds = 0;
};

// A measured variant's rates against this machine's roofs (FLOP/s and
// bytes/s, the figures to judge the run by; 0 = unknown).
struct VariantRates {
  LayerFigures figures;
  double prefill_flops_per_s = 0;
  double decode_flops_per_s = 0;
  double decode_bytes_per_s = 0;
  bool above_roof = false;  // a rate above its roof: the roof was measured low, or cache hits
};
VariantRates variant_rates(const VariantTiming& t, DType kv, int64_t prompt, int64_t context,
                           int64_t batch, double peak_flops_per_s, double read_bytes_per_s);

// What a table of measured variants says to someone choosing one, as row
// indices into the timings (-1 = none): the fastest decode, the smallest
// cache per token, the MHA row they are compared with (the last row with
// as many kv heads as query heads, not MLA), and the MLA rows, whose
// bytes-for-FLOPs trade is stated against MHA.
struct CompareConclusions {
  int fastest_decode = -1;
  int smallest_cache = -1;
  int mha = -1;
  std::vector<int> mla;  // empty when there is no MHA row to compare with
};
CompareConclusions conclude_comparison(const std::vector<VariantTiming>& rows, DType kv);

// The roofline estimate of one decode step of a whole model: the slower of
// reading its bytes at `read_gbps` and doing its FLOPs at `peak_gflops`. A
// DeepSeek sparse attention model (index_topk > 0) is estimated on its
// sparse path (dsa_layer_figures, analysis.h).
struct DecodeEstimate {
  double seconds = 0, flops = 0, bytes = 0;
  bool memory_bound = false;  // reading takes at least as long as computing
};
DecodeEstimate estimate_decode_step(const ModelShape& m, int64_t context, int64_t batch, DType kv,
                                    DType weights, double peak_gflops, double read_gbps);

// The longest context whose cache (K/V and linear state, cache_bytes) for
// `batch` sequences fits `budget` bytes; -1 = any context fits (every
// layer is window- or chunk-capped, or linear).
int64_t max_context_within(const ModelShape& m, DType kv, int64_t batch, double budget);

// How far a budget goes for one variant: with context > 0, the largest
// batch at that context; otherwise (batch > 0) the longest context at that
// batch, capped at `position_limit` (the model's max_position_embeddings;
// 0 = none), since past it a context is not served whatever memory allows.
struct MemoryFit {
  bool fits = false;
  int64_t batch = 0;                // the batch planned at (the answer when context was given)
  int64_t context = 0;              // the context planned at (the answer when batch was given;
                                    // kUnboundedEstimateContext when any context fits)
  bool capped_by_model = false;     // the answer stopped at position_limit
  bool context_unbounded = false;   // batch given, and memory allows any context
  int64_t memory_max_context = -1;  // batch given: what memory alone allows; -1 = any
};
// The context a decode estimate uses when memory allows any context.
constexpr int64_t kUnboundedEstimateContext = 4096;
MemoryFit fit_memory(const ModelShape& v, DType kv, int64_t context, int64_t batch, double budget,
                     int64_t position_limit);

// The variants a budget is planned for: the model as configured, then (for
// a model without MLA) every other valid number of kv heads and MLA of
// kv_lora_rank 512 with mla_rope_dim_for(head_dim).
std::vector<ModelShape> plan_variants(const ModelShape& m);

// The "what if" sweep of `attnkit analyze`: the model at every valid number
// of kv heads (not for MLA), then MLA at each of `mla_ranks` (an MLA model
// keeps its rope width and changes its kv_lora_rank; other models get
// with_mla(), skipping ranks it refuses).
std::vector<ModelShape> what_if_variants(const ModelShape& m,
                                         const std::vector<int64_t>& mla_ranks);

// The decoupled RoPE width given to MLA built from a model of `head_dim`:
// min(64, head_dim / 2), rounded down to even (DeepSeek's 64 at 128).
int64_t mla_rope_dim_for(int64_t head_dim);

}  // namespace attnkit
