// The one plain struct every attention kernel (reference or fast) consumes.
// The API layer (src/kernels/attention_api.cc) validates user arguments and
// fills it; kernels only debug-assert. Nothing here allocates.
#pragma once

#include <cstdint>

#include "attnkit/attention.h"
#include "attnkit/tensor.h"

namespace attnkit::kernels {

// Strides in elements.
struct Strides4 {
  int64_t batch = 0, row = 0, head = 0, dim = 1;
};

struct AttentionParams {
  int64_t batch = 0;
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;  // rows addressable in k/v (logical key count bound)
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t head_dim_v = 0;

  const float* q = nullptr;  // [batch, seqlen_q, num_heads, head_dim]
  Strides4 q_stride;
  const void* k = nullptr;  // [batch, kv rows, num_kv_heads, head_dim]
  Strides4 k_stride;
  const void* v = nullptr;  // [batch, kv rows, num_kv_heads, head_dim_v]
  Strides4 v_stride;
  DType kv_dtype = DType::kF32;  // kF32 or kBF16

  float* out = nullptr;  // [batch, seqlen_q, num_heads, head_dim_v]
  Strides4 out_stride;
  float* lse = nullptr;  // [batch, num_heads, seqlen_q], optional
  int64_t lse_stride_batch = 0, lse_stride_head = 0, lse_stride_row = 0;
  float* probs = nullptr;  // [batch, num_heads, seqlen_q, seqlen_k], optional
  Strides4 probs_stride;   // batch, row = query, head, dim = key

  float scale = 1.0f;
  float softcap = 0.0f;  // 0 = off

  // Per batch item: valid keys, and the key position of query row 0 (key j
  // is visible to row i only if j <= i + q_offset when causal). nullptr =
  // seqlen_k and seqlen_k - seqlen_q for every item.
  const int32_t* k_len = nullptr;
  const int64_t* q_offset = nullptr;

  bool causal = false;
  int64_t window_left = -1;   // -1 = unlimited
  int64_t window_right = -1;  // -1 = unlimited
  SparsePattern sparse;

  // Explicit mask, broadcast strides (0 on broadcast dims): batch, row =
  // query, head, dim = key.
  const uint8_t* bool_mask = nullptr;
  const float* add_mask = nullptr;
  Strides4 mask_stride;

  // Ring buffer: logical key j of every batch item lives in physical row
  // (ring_start + j) % ring_capacity. ring_capacity == 0 = no ring (row j).
  int64_t ring_capacity = 0;
  int64_t ring_start = 0;

  int num_threads = 1;

  int64_t keys_of(int64_t b) const { return k_len ? k_len[b] : seqlen_k; }
  int64_t offset_of(int64_t b) const { return q_offset ? q_offset[b] : keys_of(b) - seqlen_q; }
  int64_t physical_row(int64_t j) const {
    if (ring_capacity == 0) return j;
    int64_t r = ring_start + j;
    return r >= ring_capacity ? r % ring_capacity : r;
  }
};

}  // namespace attnkit::kernels
