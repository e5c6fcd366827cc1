// The one plain struct every attention kernel (reference or fast) consumes.
// The API layer (src/ops/) validates user arguments and
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
  DType kv_dtype = DType::kF32;  // kF32, kBF16, kI8 or kFp8E4M3

  // 8-bit K/V (kI8, kFp8E4M3, ops/kv_quant.h): k and v hold 1-byte codes,
  // and element c of the K row of (batch item b, physical row r, kv head h)
  // is decode(code) * k_scale[b * k_scale_stride.batch + r *
  // k_scale_stride.row + h * k_scale_stride.head + (c / scale_block) *
  // k_scale_stride.dim] (V likewise, with v_scale). Scales are addressed by
  // the data's physical row, so every key layout (key_row()) finds them.
  // scale_block: channels per scale, 0 = one scale per head row.
  const float* k_scale = nullptr;
  Strides4 k_scale_stride;
  const float* v_scale = nullptr;
  Strides4 v_scale_stride;
  int64_t scale_block = 0;

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
  // seqlen_k and keys_of(b) - rows_of(b) for every item.
  const int32_t* k_len = nullptr;
  const int64_t* q_offset = nullptr;

  // Ragged queries (sdpa_varlen, PagedKVCache::attend): batch item b has
  // q_len[b] <= seqlen_q query rows, rows q_start[b] ... of q, out and lse
  // (whose batch strides are then 0). nullptr = seqlen_q rows from row 0.
  const int32_t* q_start = nullptr;
  const int32_t* q_len = nullptr;

  bool causal = false;
  int64_t window_left = -1;   // -1 = unlimited
  int64_t window_right = -1;  // -1 = unlimited
  SparsePattern sparse;
  // Chunked local attention: key j is visible from position p only when
  // floor(j / chunk_size) == floor(p / chunk_size). 0 = off.
  int64_t chunk_size = 0;

  // Attention sinks: query head h's logit sinks[h * sinks_stride] joins
  // every row's softmax denominator (and no numerator). nullptr = none.
  const float* sinks = nullptr;  // [num_heads]
  int64_t sinks_stride = 1;

  // Explicit mask, broadcast strides (0 on broadcast dims): batch, row =
  // query, head, dim = key.
  const uint8_t* bool_mask = nullptr;
  const float* add_mask = nullptr;
  Strides4 mask_stride;

  // Where logical key j of batch item b lives: row key_row(b, j) counted from
  // k + b * k_stride.batch (and likewise in v). At most one of these is set:
  //   none           row j (a dense [batch, seqlen_k, ...] tensor)
  //   k_start        row k_start[b] + j (packed sequences; batch strides 0)
  //   ring_capacity  row (ring_start + j) % ring_capacity (KVCache's window)
  //   block_table    row page * page_size + j % page_size, where page =
  //                  block_table[b * block_table_stride + j / page_size]
  //                  (PagedKVCache; batch strides 0)
  // Kernels address keys through key_row() only, so every layout runs the
  // same tile loop.
  const int32_t* k_start = nullptr;
  int64_t ring_capacity = 0;
  int64_t ring_start = 0;
  const int32_t* block_table = nullptr;
  int64_t block_table_stride = 0;
  int64_t page_size = 0;

  // Order every row's reduction over its keys by fixed facts only (no key
  // split, fixed key tiles: tile_policy.h): a row's output bits then do not
  // depend on what else shares the call or how its sequence was chunked.
  // Every item must have the same rows_of(b) (PagedKVCache::attend groups so).
  bool batch_invariant = false;

  int num_threads = 1;

  int64_t keys_of(int64_t b) const { return k_len ? k_len[b] : seqlen_k; }
  int64_t rows_of(int64_t b) const { return q_len ? q_len[b] : seqlen_q; }
  int64_t offset_of(int64_t b) const { return q_offset ? q_offset[b] : keys_of(b) - rows_of(b); }
  // Row index of batch item b's query row i in q, out and lse.
  int64_t q_row(int64_t b, int64_t i) const { return q_start ? q_start[b] + i : i; }

  // The physical row of logical key j of batch item b; *run = how many of
  // the keys j .. j + n - 1 (n >= 1) sit in consecutive rows from it.
  int64_t key_row(int64_t b, int64_t j, int64_t n, int64_t* run) const {
    if (block_table != nullptr) {
      // Pages that follow each other in the pool extend the run: a fresh
      // pool hands a sequence consecutive pages, and one long run costs the
      // tile loop one kernel call instead of one per page. (No kernel that
      // batch-invariant calls take rounds by where a run ends: tile_policy.h.)
      const int32_t* table = block_table + b * block_table_stride + j / page_size;
      const int64_t in_page = j % page_size;
      int64_t rows = page_size - in_page;
      for (int64_t p = 1; rows < n && table[p] == table[0] + p; ++p) rows += page_size;
      *run = n < rows ? n : rows;
      return table[0] * page_size + in_page;
    }
    if (ring_capacity > 0) {
      int64_t r = ring_start + j;
      if (r >= ring_capacity) r %= ring_capacity;
      *run = n < ring_capacity - r ? n : ring_capacity - r;
      return r;
    }
    *run = n;
    return k_start ? k_start[b] + j : j;
  }
  int64_t key_row(int64_t b, int64_t j) const {
    int64_t run;
    return key_row(b, j, 1, &run);
  }
};

}  // namespace attnkit::kernels
