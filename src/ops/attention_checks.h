// Checks shared by the entry points that run attention (sdpa, caches,
// layers), so they reject bad input with the same words.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "attnkit/attention.h"
#include "attnkit/status.h"
#include "kernels/attention_params.h"

namespace attnkit {

inline Status check_head_layout(const char* fn, int64_t num_heads, int64_t num_kv_heads,
                                int64_t head_dim, int64_t head_dim_v) {
  const std::string f = fn;
  if (num_heads < 1)
    return invalid_argument(f + ": num_heads = " + std::to_string(num_heads) + " must be >= 1");
  if (num_kv_heads < 1)
    return invalid_argument(f + ": num_kv_heads = " + std::to_string(num_kv_heads) +
                            " must be >= 1");
  if (num_heads % num_kv_heads != 0)
    return invalid_argument(f + ": num_kv_heads = " + std::to_string(num_kv_heads) +
                            " must divide num_heads = " + std::to_string(num_heads));
  if (head_dim < 1)
    return invalid_argument(f + ": head_dim = " + std::to_string(head_dim) + " must be >= 1");
  if (head_dim_v < 1)
    return invalid_argument(f + ": head_dim_v = " + std::to_string(head_dim_v) + " must be >= 1");
  return Status::Ok();
}

// Rejects an output view two of whose elements provably share memory (a
// dim of size > 1 with stride 0, or one stride a small multiple of
// another); never rejects a layout that does not overlap itself.
Status check_no_self_overlap(const char* fn, const char* name, const TensorView& v);

// softmax_scale, softcap, window, chunk_size, sparse, num_threads, backend; k_scales
// and v_scales absent unless `kv_scales` (sdpa checks them itself).
Status check_attention_options(const char* fn, const AttentionOptions& options,
                               bool kv_scales = false);

// options.sinks, where present: f32, rank 1, [num_heads], any stride, every
// value finite.
Status check_sinks(const char* fn, const TensorView& sinks, int64_t num_heads);

// cu_seqlens-style offsets: `count` + 1 entries, 0 first, never decreasing,
// `total` last (total_src names where total comes from). Sets *max_len to
// the longest sequence.
Status check_cu_seqlens(const char* fn, const char* name, std::span<const int32_t> cu,
                        int64_t count, int64_t total, const char* total_src, int32_t* max_len);

struct NamedView {
  const char* name;
  const TensorView* view;  // absent views are skipped
};

// No output overlaps an input or another output.
Status check_outputs_apart(const char* fn, std::span<const NamedView> outputs,
                           std::span<const NamedView> inputs);

// Validates an explicit mask against the full score shape and stores its
// pointer and broadcast strides in `params`.
Status fill_mask(const char* fn, const TensorView& mask, int64_t batch, int64_t num_heads,
                 int64_t seqlen_q, int64_t seqlen_k, kernels::AttentionParams* params);

}  // namespace attnkit
