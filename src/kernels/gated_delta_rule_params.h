// The gated delta rule (Gated DeltaNet's token mixer, Qwen3-Next's linear
// attention), one plain params struct for its kernels.
//
// Per sequence b and value head h (key head kh = h / (num_v_heads /
// num_k_heads); keys and queries are shared by the value heads of a group,
// never copied per value head), with S the [key_head_dim, value_head_dim]
// state, token by token:
//
//   S     <- exp(g_t) * S                      (g_t <= 0: a log-decay)
//   delta  = beta_t * (v_t - S^T k_t)          [value_head_dim]
//   S     <- S + k_t delta^T
//   out_t  = S^T q_t
//
// q and k arrive L2-normalised, q already scaled by key_head_dim^-0.5 (the
// layer does both, so the kernels only run the recurrence). The state is
// read as the sequence's starting point and overwritten with its end.
//
// Two forms compute it (docs/LINEAR_ATTENTION.md):
//   recurrent  the loop above; a decode step reads and writes S once.
//   chunked    chunks of kGdrChunk tokens: within a chunk the recurrence is
//              solved with small matrix products (a unit lower-triangular
//              system for the deltas), the state passes from chunk to
//              chunk; within a chunk only the decays exp(G_i - G_j) with
//              j <= i (<= 1; G the cumulative sum of g) are formed, as
//              products of the factors exp(g_t) in double.
#pragma once

#include <cstdint>

namespace attnkit::kernels {

// Tokens per chunk of the chunked form: the authors' chunk, and a size at
// which the intra-chunk products (64 x 64 x head_dim) run near the GEMM's
// peak while the 64 x 64 triangular solve stays a small part of the work.
inline constexpr int64_t kGdrChunk = 64;

// kAuto runs the recurrent form up to this many tokens per sequence (decode,
// short speculative steps) and the chunked form beyond: at Qwen3-Next's
// shape (32 value heads of 128 x 128, one thread, state in cache) 4 tokens
// took 268 us recurrent vs 449 us chunked, 8 tokens 523 vs 539 us.
inline constexpr int64_t kGdrRecurrentMaxSeq = 7;

// Which form runs (tests force each; kAuto lets the dispatcher choose).
enum class GdrForm : uint8_t { kAuto, kRecurrent, kChunked };

struct GatedDeltaRuleParams {
  int64_t batch = 0, seq = 0;
  int64_t num_k_heads = 0, num_v_heads = 0;  // num_v_heads a multiple of num_k_heads
  int64_t key_head_dim = 0, value_head_dim = 0;

  // Token t of sequence b, head h, starts at base + (b * seq + t) * stride
  // + h * head_stride; each head's values are contiguous. A head stride of
  // 0 stands for the head dim: the heads side by side in a token's row
  // (token-major, [batch, seq, heads, head_dim] at a row stride). Head-major
  // rows ([heads][batch * seq][head_dim]: stride = head_dim, head stride >=
  // batch * seq * head_dim) put a chunk's rows of one head in one run of
  // memory, which the hardware prefetchers follow (docs/LINEAR_ATTENTION.md).
  const float* q = nullptr;  // [batch, seq, num_k_heads, key_head_dim] at the strides
  const float* k = nullptr;  // [batch, seq, num_k_heads, key_head_dim] at the strides
  const float* v = nullptr;  // [batch, seq, num_v_heads, value_head_dim] at the strides
  int64_t q_stride = 0, k_stride = 0, v_stride = 0;
  int64_t q_head_stride = 0, k_head_stride = 0, v_head_stride = 0;
  const float* g = nullptr;     // [batch, seq, num_v_heads] contiguous, log-decays (<= 0)
  const float* beta = nullptr;  // [batch, seq, num_v_heads] contiguous, in [0, 1]
  float* state = nullptr;       // [batch, num_v_heads, key_head_dim, value_head_dim], in/out
  float* out = nullptr;         // [batch, seq, num_v_heads, value_head_dim], row stride out_stride
  int64_t out_stride = 0;

  int num_threads = 0;  // 0 = default (core/threads.h)
  GdrForm form = GdrForm::kAuto;

  // Row `row` (= b * seq + t) of key head kh's query / key, value head h's value.
  const float* q_at(int64_t row, int64_t kh) const {
    return q + row * q_stride + kh * (q_head_stride != 0 ? q_head_stride : key_head_dim);
  }
  const float* k_at(int64_t row, int64_t kh) const {
    return k + row * k_stride + kh * (k_head_stride != 0 ? k_head_stride : key_head_dim);
  }
  const float* v_at(int64_t row, int64_t h) const {
    return v + row * v_stride + h * (v_head_stride != 0 ? v_head_stride : value_head_dim);
  }
};

}  // namespace attnkit::kernels
