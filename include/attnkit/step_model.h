// attnkit/step_model.h — what a continuous-batching engine asks of a model.
//
// The engine (attnkit/serve.h) schedules tokens; a StepModel computes them.
// Two models implement it: attnkit::Model (a decoder loaded from a Hugging
// Face checkpoint, attnkit/model.h) and the engine's benchmark fixture (a
// stack of the library's layers with seeded random weights). The engine
// sees only this interface, so the scheduler, the prefix cache and the
// metrics are the same for both.
//
// A step: the engine reserves each scheduled sequence's new token slots in
// the pool (PagedKVCache::append) and, for a model with linear-attention
// layers, holds one state slot per sequence under the same id; then it
// calls forward_step once for every scheduled token of every sequence. The
// model writes those tokens' keys and values into the pool (and advances
// the states), and returns the logits of each sequence's last scheduled
// token: the engine samples from them when that token ends what the
// sequence knows.
#pragma once

#include <cstdint>
#include <span>

#include "attnkit/config.h"
#include "attnkit/linear_state_pool.h"
#include "attnkit/paged_kv_cache.h"
#include "attnkit/status.h"
#include "attnkit/tensor.h"

namespace attnkit {

class StepModel {
 public:
  virtual ~StepModel() = default;

  virtual int64_t vocab_size() const = 0;

  // A pool for this model's attention layers (one pool layer each) with
  // num_pages pages of page_size tokens stored in kv_dtype, and whether
  // the spec's prefix caching is on.
  virtual Result<PagedKVCache> new_pool(int64_t num_pages, int64_t page_size, DType kv_dtype,
                                        bool prefix_caching) const = 0;
  // Whether new_pool's pool releases pages that left every layer's window
  // or chunk (one window / chunk for all its attention layers).
  virtual bool pool_releases_pages() const = 0;
  // The state slots of the linear-attention layers (at most max_sequences;
  // 0 = no limit); a pool of no layers when the model has none.
  virtual Result<LinearStatePool> new_state_pool(int64_t max_sequences) const = 0;
  // Bytes of one sequence's linear-attention state, all layers (0 if none).
  virtual int64_t state_bytes_per_sequence() const = 0;

  // One step over the tokens the engine reserved:
  //   token_ids  [total]          the new tokens, packed by cu_seqlens
  //   cu_seqlens [num_seqs + 1]   0 = cu_seqlens[0] < ... ; total at the end
  //   seq_ids    [num_seqs]       the pool's (and state pool's) sequence ids
  //   logits     [num_seqs, vocab_size]  written: each sequence's last token
  // Token i of sequence s sits at position length(s) - n_s + i of it, where
  // n_s is its count in this step. A failed step changes no logits; what it
  // left in the pool is the engine's to roll back (truncate or remove).
  virtual Status forward_step(std::span<const int32_t> token_ids,
                              std::span<const int32_t> cu_seqlens, std::span<const int64_t> seq_ids,
                              PagedKVCache& pool, LinearStatePool& states, std::span<float> logits,
                              const RunOptions& run) = 0;
};

}  // namespace attnkit
