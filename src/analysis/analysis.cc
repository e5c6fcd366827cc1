// The counting conventions are stated in include/attnkit/analysis.h; every
// function here is a direct transcription of one of them.
#include <algorithm>
#include <cstdint>
#include <string>

#include "attnkit/analysis.h"
#include "attnkit/kv_cache.h"

namespace attnkit {
namespace {

int64_t window_of(const ModelShape& m, int64_t layer) {
  if (layer < 0 || layer >= static_cast<int64_t>(m.window_per_layer.size())) return 0;
  return m.window_per_layer[static_cast<size_t>(layer)];
}

int64_t tokens_held(const ModelShape& m, int64_t context, int64_t layer) {
  const int64_t w = window_of(m, layer);
  return w > 0 ? std::min(context, w) : context;
}

// Query-key pairs a causal (or bidirectional) prefill of S tokens scores
// when each query sees at most W keys (W = 0: unlimited).
double visible_pairs(const ModelShape& m, int64_t s, int64_t w) {
  const double S = static_cast<double>(s);
  if (!m.causal) return w > 0 ? S * std::min<double>(S, 2.0 * w - 1.0) : S * S;
  if (w <= 0 || w >= s) return S * (S + 1.0) / 2.0;
  const double W = static_cast<double>(w);
  return W * (W + 1.0) / 2.0 + (S - W) * W;
}

}  // namespace

int64_t attention_params_per_layer(const ModelShape& m) {
  const int64_t d = m.hidden_size, h = m.num_heads;
  if (m.mla) {
    const int64_t qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
    int64_t p = 0;
    if (m.q_lora_rank > 0)
      p += m.q_lora_rank * d + m.q_lora_rank + h * qk * m.q_lora_rank;  // q_a, q_a_layernorm, q_b
    else
      p += h * qk * d;                                              // q_proj
    p += (m.kv_lora_rank + m.qk_rope_head_dim) * d;                 // kv_a_proj_with_mqa
    p += m.kv_lora_rank;                                            // kv_a_layernorm
    p += h * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank;  // kv_b_proj
    p += d * h * m.v_head_dim;                                      // o_proj
    return p;
  }
  const int64_t q_out = h * m.head_dim, k_out = m.num_kv_heads * m.head_dim,
                v_out = m.num_kv_heads * m.head_dim_v;
  int64_t p = (q_out + k_out + v_out) * d + d * h * m.head_dim_v;
  if (m.q_bias) p += q_out;
  if (m.k_bias) p += k_out;
  if (m.v_bias) p += v_out;
  if (m.o_bias) p += d;
  if (m.qk_norm) p += 2 * m.head_dim;
  return p;
}

int64_t kv_values_per_token_per_layer(const ModelShape& m, bool mla_latent) {
  if (m.mla) {
    if (mla_latent) return m.kv_lora_rank + m.qk_rope_head_dim;
    return m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim);
  }
  return m.num_kv_heads * (m.head_dim + m.head_dim_v);
}

namespace {

// Bytes one token takes in one layer's cache: its values, plus for the
// 8-bit types one fp32 scale per row of a kv head (K and V), or per
// kLatentScaleBlock channels of an MLA latent row, as the caches store them
// (include/attnkit/kv_cache.h).
int64_t kv_token_layer_bytes(const ModelShape& m, DType kv_dtype, bool mla_latent) {
  const int64_t values =
      kv_values_per_token_per_layer(m, mla_latent) * static_cast<int64_t>(dtype_size(kv_dtype));
  if (kv_dtype != DType::kI8 && kv_dtype != DType::kFp8E4M3) return values;
  int64_t rows;
  if (m.mla && mla_latent)
    rows = (m.kv_lora_rank + m.qk_rope_head_dim + kLatentScaleBlock - 1) / kLatentScaleBlock;
  else
    rows = 2 * (m.mla ? m.num_heads : m.num_kv_heads);
  return values + 4 * rows;
}

}  // namespace

int64_t kv_bytes_per_token(const ModelShape& m, DType kv_dtype, bool mla_latent) {
  return kv_token_layer_bytes(m, kv_dtype, mla_latent) * m.num_layers;
}

double kv_cache_bytes(const ModelShape& m, DType kv_dtype, int64_t context, int64_t batch,
                      bool mla_latent) {
  // One sequence's bytes in 128 bits: at most 2^43 bytes per token and
  // layer (sizes are capped at 2^20 by the parsers) x 2^63 tokens x 2^20
  // layers = 2^126. Times the batch in double: a product below 2^53 is
  // exact, a larger one is within two roundings of the truth.
  const __int128 per_token_layer = kv_token_layer_bytes(m, kv_dtype, mla_latent);
  __int128 per_sequence = 0;
  for (int64_t l = 0; l < m.num_layers; ++l)
    per_sequence += per_token_layer * tokens_held(m, context, l);
  return static_cast<double>(per_sequence) * static_cast<double>(batch);
}

double prefill_flops_per_layer(const ModelShape& m, int64_t seq, int64_t layer) {
  const double pairs = visible_pairs(m, seq, window_of(m, layer));
  return 2.0 * static_cast<double>(seq) * static_cast<double>(attention_params_per_layer(m)) +
         2.0 * static_cast<double>(m.num_heads) * static_cast<double>(m.head_dim + m.head_dim_v) *
             pairs;
}

double decode_flops_per_layer(const ModelShape& m, int64_t context, int64_t layer,
                              bool mla_absorbed) {
  const double L = static_cast<double>(tokens_held(m, context, layer));
  const double proj = 2.0 * static_cast<double>(attention_params_per_layer(m));
  const double h = static_cast<double>(m.num_heads);
  if (m.mla && mla_absorbed) {
    const double dc = static_cast<double>(m.kv_lora_rank),
                 dr = static_cast<double>(m.qk_rope_head_dim);
    return proj + 2.0 * h * (dc + dr) * L + 2.0 * h * dc * L;
  }
  return proj + 2.0 * h * static_cast<double>(m.head_dim + m.head_dim_v) * L;
}

double decode_bytes_per_layer(const ModelShape& m, int64_t context, int64_t batch, DType kv_dtype,
                              DType weight_dtype, int64_t layer) {
  const double weights = static_cast<double>(attention_params_per_layer(m)) *
                         static_cast<double>(dtype_size(weight_dtype));
  const double kv = static_cast<double>(kv_token_layer_bytes(m, kv_dtype, true)) *
                    static_cast<double>(tokens_held(m, context, layer));
  return weights + static_cast<double>(batch) * kv;
}

std::vector<int64_t> valid_kv_head_counts(int64_t num_heads) {
  std::vector<int64_t> out;
  for (int64_t n = 1; n <= num_heads; ++n)
    if (num_heads % n == 0) out.push_back(n);
  return out;
}

Result<ModelShape> with_kv_heads(const ModelShape& m, int64_t num_kv_heads) {
  if (m.mla)
    return invalid_argument("with_kv_heads: model '" + m.name +
                            "' uses MLA, whose cache is a latent, not kv heads");
  if (num_kv_heads < 1 || num_kv_heads > m.num_heads || m.num_heads % num_kv_heads != 0)
    return invalid_argument("with_kv_heads: num_kv_heads = " + std::to_string(num_kv_heads) +
                            " must divide num_heads = " + std::to_string(m.num_heads));
  ModelShape out = m;
  out.num_kv_heads = num_kv_heads;
  out.name = m.name + " [kv_heads=" + std::to_string(num_kv_heads) + "]";
  return out;
}

Result<ModelShape> with_mla(const ModelShape& m, int64_t kv_lora_rank, int64_t qk_rope_head_dim,
                            int64_t q_lora_rank) {
  if (kv_lora_rank < 1)
    return invalid_argument("with_mla: kv_lora_rank = " + std::to_string(kv_lora_rank) +
                            " must be >= 1");
  if (qk_rope_head_dim < 0 || qk_rope_head_dim % 2 != 0 || qk_rope_head_dim >= m.head_dim)
    return invalid_argument("with_mla: qk_rope_head_dim = " + std::to_string(qk_rope_head_dim) +
                            " must be even and in [0, head_dim = " + std::to_string(m.head_dim) +
                            ")");
  if (q_lora_rank < 0)
    return invalid_argument("with_mla: q_lora_rank = " + std::to_string(q_lora_rank) +
                            " must be >= 0 (0 = direct q_proj)");
  ModelShape out = m;
  out.mla = true;
  out.kv_lora_rank = kv_lora_rank;
  out.q_lora_rank = q_lora_rank;
  out.qk_rope_head_dim = qk_rope_head_dim;
  out.qk_nope_head_dim = m.head_dim - qk_rope_head_dim;
  out.v_head_dim = m.head_dim_v;
  out.num_kv_heads = m.num_heads;
  out.q_bias = out.k_bias = out.v_bias = out.o_bias = false;
  out.qk_norm = false;
  out.name = m.name + " [mla r=" + std::to_string(kv_lora_rank) + "]";
  return out;
}

}  // namespace attnkit
