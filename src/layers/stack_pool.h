// The paged pool of a stack of layers (a model, or the serving engine's
// random-weight fixture): one pool layer per attention layer, in the
// latent layout when the stack is MLA. Shared so that attnkit::Model and
// serve::SyntheticModel build their pools by one rule.
#pragma once

#include <cstdint>
#include <span>

#include "attnkit/attention_layer.h"
#include "attnkit/latent_attention.h"
#include "attnkit/paged_kv_cache.h"
#include "attnkit/status.h"

namespace attnkit::layers {

// Whether one pool can hold every attention layer's window or chunk: they
// all have the same sliding_window and chunk_size. When they differ
// (gpt-oss, Gemma 3, Llama 4) the pool has none, each layer passes its own
// per call, and no page is released as tokens leave a window.
bool stack_shares_window(std::span<const AttentionLayer> attention);

// A pool for `latent` (MLA: non-empty, then `attention` is ignored) or
// `attention` (non-empty) with num_pages pages of page_size tokens in
// kv_dtype, and prefix caching as asked (refused by the pool with a
// window or chunk). A sparse-attention MLA stack (DeepSeek-V3.2) gets
// the lightning indexer's key slots beside each latent row
// (LatentAttention::new_paged_cache), with or without prefix caching.
Result<PagedKVCache> new_stack_pool(std::span<const AttentionLayer> attention,
                                    std::span<const LatentAttention> latent, int64_t num_pages,
                                    int64_t page_size, DType kv_dtype, bool prefix_caching);

}  // namespace attnkit::layers
