// attnkit/kv_cache.h — per-layer key/value cache for MHA/MQA/GQA decoding.
//
// A cache has a fixed capacity of `max_seq_len` tokens per sequence and
// stores K and V as f32, bf16, int8 or fp8 E4M3:
//   keys   [batch, slots, num_kv_heads, head_dim]
//   values [batch, slots, num_kv_heads, head_dim_v]
// A token's row of K (or V) is padded by one 64-byte line when its bytes
// are a multiple of 2 KiB (see kv_token_stride), so the views are strided:
// keys().strides[1] may exceed num_kv_heads * head_dim. Read them through
// their strides.
//
// The 8-bit types (int8, fp8_e4m3) quantize each token's row of each kv
// head once, when the token is written, symmetrically with one fp32 scale
// (max |x| / 127 or / 448): value = code * scale, the int8 code or the E4M3
// value. A token row holds its codes, then its scales:
//   [num_kv_heads * dim codes | to 4 bytes | num_kv_heads fp32 scales | to 32 bytes]
// key_scales() / value_scales() view the scales as [batch, slots,
// num_kv_heads, 1]. A row holding NaN or Inf gets scale NaN (its attention
// rows are NaN, as with f32). docs/QUANTIZATION.md gives the measured error.
//
// Without a window, slots = max_seq_len and token t lives in slot t. With a
// sliding window of W (each token sees itself and the W-1 tokens before it),
// only W-1 past tokens can ever be seen again, so slots = min(max_seq_len,
// W-1) and token t lives in slot t mod slots (a ring buffer).
//
// With chunks of C (spec.chunk_size), slots = min(max_seq_len, C) and
// token t lives in slot t mod C: the current chunk's length() mod C tokens
// fill slots [0, length() mod C); the slots after them hold older chunks'
// tokens, which no query sees again.
//
// All sequences of a batch advance together: length() tokens have been
// appended to each, and the next token's position is length().
#pragma once

#include <cstddef>
#include <cstdint>

#include "attnkit/attention.h"
#include "attnkit/status.h"
#include "attnkit/tensor.h"

namespace attnkit {

struct KVCacheSpec {
  int64_t batch_size = 0;
  int64_t max_seq_len = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t head_dim_v = 0;      // 0 = head_dim
  DType dtype = DType::kF32;   // kF32, kBF16, kI8 or kFp8E4M3
  int64_t sliding_window = 0;  // 0 = none, else W >= 1
  // Chunked local attention (Llama 4): 0 = none, else C >= 1; a token sees
  // only the tokens of its own chunk, so the cache keeps at most the
  // current chunk (a ring of min(max_seq_len, C) slots). At most one of
  // sliding_window and chunk_size is set.
  int64_t chunk_size = 0;
};

// Elements between consecutive tokens of a [token, num_kv_heads, dim]
// cache of `dtype` as KVCache lays it out: num_kv_heads * dim, plus one
// 64-byte line when that row is a multiple of 2 KiB (8-bit types: the bytes
// of a row of codes and scales, above, padded alike). A row that size puts
// all of a kv head's rows into a few of the L1's sets, which cost 1-token
// decode 3-11 % (attnkit_bench --benchmark_filter='^decode/gqa32-8/k16384/',
// 2026-11-24 at 61fcf54 on a Zen 5: docs/PERFORMANCE-LOG.md,
// 2026-11-24 · 61fcf54); callers that keep their own caches for sdpa() can
// use the same stride. Returns 0 when an argument is < 1 or the row's
// element count overflows 64 bits.
int64_t kv_token_stride(int64_t num_kv_heads, int64_t dim, DType dtype);

// A [batch, tokens, num_kv_heads, dim] view of `data` in that layout:
// tokens kv_token_stride() elements apart, batch items tokens times that.
// `data` holds batch * tokens * kv_token_stride() elements; the caller keeps
// it alive and checks the sizes (kv_token_stride() > 0).
TensorView kv_cache_view(void* data, DType dtype, int64_t batch, int64_t tokens,
                         int64_t num_kv_heads, int64_t dim);
// For the 8-bit types: the [batch, tokens, num_kv_heads, 1] f32 view of the
// scales in the same memory (the cache's layout, above); an absent view for
// f32 and bf16. `data` is 4-byte aligned.
TensorView kv_cache_scales_view(void* data, DType dtype, int64_t batch, int64_t tokens,
                                int64_t num_kv_heads, int64_t dim);

// The caches' 8-bit rule applied to any rows: each row (the last axis) of
// x, f32 [..., dim] (rank 1-4, any strides), quantized symmetrically with
// one fp32 scale into codes (int8 or fp8_e4m3, x's shape) and scales (f32,
// x's shape with a last dimension of 1), as KVCache stores them; e.g. for
// sdpa()'s options.k_scales. Rows of codes are contiguous. Fails, writing
// nothing, on mismatched shapes or dtypes, or outputs that overlap x or
// each other.
Status quantize_kv_rows(const TensorView& x, const TensorView& codes, const TensorView& scales);

// Channels per scale in the 8-bit types' MLA latent rows (LatentCache and
// PagedKVCache's latent layout; MHA/GQA rows have one scale per kv head):
// the latent c carries per-channel gains and the rope key part outlier
// channels, and blocks of 64 measured about half the int8 error of one
// scale per row on such rows (docs/QUANTIZATION.md). The absorbed form
// dequantizes a tile once for all 128 heads, so blocks cost it nothing.
inline constexpr int64_t kLatentScaleBlock = 64;

class KVCache {
 public:
  static Result<KVCache> create(const KVCacheSpec& spec);

  const KVCacheSpec& spec() const { return spec_; }
  int64_t length() const { return length_; }  // tokens appended so far
  int64_t slots() const { return slots_; }    // tokens the storage holds
  // Tokens currently held: min(length, slots).
  int64_t stored() const { return length_ < slots_ ? length_ : slots_; }
  // Bytes of the K and V values the cache can hold (the KV memory formula:
  // batch * slots * num_kv_heads * (head_dim + head_dim_v) * dtype size,
  // plus for the 8-bit types the 2 * batch * slots * num_kv_heads fp32
  // scales).
  size_t nbytes() const;
  // Bytes allocated for them, including the row padding.
  size_t storage_nbytes() const { return key_storage_.nbytes() + value_storage_.nbytes(); }
  // [batch, slots, num_kv_heads, head_dim (head_dim_v)], strided.
  const TensorView& keys() const { return keys_; }
  const TensorView& values() const { return values_; }
  // 8-bit types: [batch, slots, num_kv_heads, 1] f32, strided; absent
  // otherwise.
  const TensorView& key_scales() const { return key_scales_; }
  const TensorView& value_scales() const { return value_scales_; }

  // Forgets every token (storage is kept).
  void reset() { length_ = 0; }

  // Appends T new tokens to every sequence and attends the T queries, as
  // the continuation of a causal sequence: query t sits at position
  // length() + t and sees every held token and the new tokens up to itself
  // (within the window, if any). On success length() grows by T.
  //   q     [batch, T, num_heads, head_dim]     f32
  //   k_new [batch, T, num_kv_heads, head_dim]   f32
  //   v_new [batch, T, num_kv_heads, head_dim_v] f32
  //   out   [batch, T, num_heads, head_dim_v]    f32
  // From `options` only softmax_scale, softcap, sinks, sparse, backend and
  // num_threads apply; causal is implied, the window and the chunk are the
  // cache's (options.chunk_size must be 0 or spec.chunk_size), and a mask,
  // seqlens_k, a window_size or (with a sliding window or chunks, whose
  // ring keeps no absolute positions) a sparse pattern is an error. Fails
  // with kOutOfRange, changing nothing, when length() + T > max_seq_len.
  Status attend(const TensorView& q, const TensorView& k_new, const TensorView& v_new,
                const TensorView& out, const AttentionOptions& options = {});

 private:
  Status attend_chunked(const TensorView& q, const TensorView& k_new, const TensorView& v_new,
                        const TensorView& out, const AttentionOptions& options);

  KVCacheSpec spec_;
  int64_t slots_ = 0;
  int64_t length_ = 0;
  Tensor key_storage_;  // [batch, slots, kv_token_stride]
  Tensor value_storage_;
  TensorView keys_;  // views into the storage
  TensorView values_;
  TensorView key_scales_;
  TensorView value_scales_;
};

}  // namespace attnkit
