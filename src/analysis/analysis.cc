// The counting conventions are stated in include/attnkit/analysis.h; every
// function here is a direct transcription of one of them.
#include <algorithm>
#include <cstdint>
#include <string>

#include "attnkit/analysis.h"
#include "attnkit/kv_cache.h"
#include "attnkit/sparse_attention.h"

namespace attnkit {
bool LayerShape::operator==(const LayerShape& o) const {
  const GatedDeltaNetConfig &a = linear, &b = o.linear;
  return kind == o.kind && sliding_window == o.sliding_window && chunk_size == o.chunk_size &&
         use_rope == o.use_rope && sinks == o.sinks && output_gate == o.output_gate &&
         a.hidden_size == b.hidden_size && a.num_k_heads == b.num_k_heads &&
         a.num_v_heads == b.num_v_heads && a.key_head_dim == b.key_head_dim &&
         a.value_head_dim == b.value_head_dim && a.conv_kernel == b.conv_kernel;
}

LayerShape layer_shape(const ModelShape& m, int64_t layer) {
  if (layer < 0 || layer >= static_cast<int64_t>(m.layers.size())) return LayerShape{};
  return m.layers[static_cast<size_t>(layer)];
}

int64_t tokens_held(const ModelShape& m, int64_t layer, int64_t context) {
  const LayerShape l = layer_shape(m, layer);
  if (l.kind == MixerKind::kGatedDeltaNet) return 0;
  if (l.sliding_window > 0) return std::min(context, l.sliding_window);
  if (l.chunk_size > 0) return std::min(context, l.chunk_size);
  return context;
}

namespace {

double sq_pairs(double n) { return n * (n + 1.0) / 2.0; }

// Query-key pairs a causal (or bidirectional) prefill of S tokens scores in
// one layer: each query sees at most W keys (sliding), or only the keys
// of its own chunk of C (chunked).
double visible_pairs(const ModelShape& m, int64_t s, const LayerShape& l) {
  const double S = static_cast<double>(s);
  if (l.chunk_size > 0) {
    const int64_t c = l.chunk_size;
    const double full = static_cast<double>(s / c), C = static_cast<double>(c),
                 rest = static_cast<double>(s % c);
    if (!m.causal) return full * C * C + rest * rest;
    return full * sq_pairs(C) + sq_pairs(rest);
  }
  const int64_t w = l.sliding_window;
  if (!m.causal) return w > 0 ? S * std::min<double>(S, 2.0 * w - 1.0) : S * S;
  if (w <= 0 || w >= s) return sq_pairs(S);
  const double W = static_cast<double>(w);
  return sq_pairs(W) + (S - W) * W;
}

// A Gated DeltaNet layer's weights (Hugging Face's linear_attn.* modules):
// in_proj_qkvz [2 key_dim + 2 value_dim, d], in_proj_ba [2 nv, d],
// conv1d [conv channels, 1, K] (no bias), dt_bias [nv], A_log [nv],
// norm [value_head_dim], out_proj [d, value_dim].
int64_t delta_net_params(const GatedDeltaNetConfig& g) {
  const int64_t key_dim = g.num_k_heads * g.key_head_dim,
                value_dim = g.num_v_heads * g.value_head_dim;
  const int64_t conv_channels = 2 * key_dim + value_dim;
  return (2 * key_dim + 2 * value_dim) * g.hidden_size + 2 * g.num_v_heads * g.hidden_size +
         conv_channels * g.conv_kernel + 2 * g.num_v_heads + g.value_head_dim +
         value_dim * g.hidden_size;
}

// Its FLOPs for one token (header: projections, the conv, the state).
double delta_net_flops_per_token(const GatedDeltaNetConfig& g) {
  const int64_t key_dim = g.num_k_heads * g.key_head_dim,
                value_dim = g.num_v_heads * g.value_head_dim;
  const double projections = static_cast<double>(
      (2 * key_dim + 2 * value_dim + 2 * g.num_v_heads + value_dim) * g.hidden_size);
  const double conv = static_cast<double>((2 * key_dim + value_dim) * g.conv_kernel);
  return 2.0 * projections + 2.0 * conv + 7.0 * static_cast<double>(g.state_values());
}

// The first attention layer: what "the model's attention layer" means.
int64_t first_attention_layer(const ModelShape& m) {
  for (int64_t l = 0; l < m.num_layers; ++l)
    if (layer_shape(m, l).kind == MixerKind::kAttention) return l;
  return -1;
}

}  // namespace

namespace {

// One attention layer's weights with the layer's own extras.
int64_t attention_layer_params(const ModelShape& m, const LayerShape& l) {
  const int64_t d = m.hidden_size, h = m.num_heads;
  const int64_t extras = (l.sinks ? h : 0) + (l.output_gate && !m.mla ? h * m.head_dim * d : 0);
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
    return p + extras;
  }
  const int64_t q_out = h * m.head_dim, k_out = m.num_kv_heads * m.head_dim,
                v_out = m.num_kv_heads * m.head_dim_v;
  int64_t p = (q_out + k_out + v_out) * d + d * h * m.head_dim_v;
  if (m.q_bias) p += q_out;
  if (m.k_bias) p += k_out;
  if (m.v_bias) p += v_out;
  if (m.o_bias) p += d;
  if (m.qk_norm) p += 2 * m.head_dim;
  return p + extras;
}

}  // namespace

int64_t layer_params(const ModelShape& m, int64_t layer) {
  const LayerShape l = layer_shape(m, layer);
  if (l.kind == MixerKind::kGatedDeltaNet) return delta_net_params(l.linear);
  return attention_layer_params(m, l);
}

int64_t attention_params_per_layer(const ModelShape& m) {
  const int64_t first = first_attention_layer(m);
  return attention_layer_params(m, first < 0 ? LayerShape{} : layer_shape(m, first));
}

int64_t attention_params_total(const ModelShape& m) {
  int64_t total = 0;
  for (int64_t l = 0; l < m.num_layers; ++l) total += layer_params(m, l);
  return total;
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

// What a cache stores per token and layer: the K/V (or latent) bytes and,
// beside a DSA model's latent row, its indexer key.
int64_t stored_token_layer_bytes(const ModelShape& m, DType kv_dtype, bool mla_latent) {
  return kv_token_layer_bytes(m, kv_dtype, mla_latent) +
         (m.mla && mla_latent ? indexer_key_bytes_per_token(m) : 0);
}

}  // namespace

int64_t kv_bytes_per_token(const ModelShape& m, DType kv_dtype, bool mla_latent) {
  int64_t layers = 0;
  for (int64_t l = 0; l < m.num_layers; ++l)
    layers += layer_shape(m, l).kind == MixerKind::kAttention ? 1 : 0;
  return stored_token_layer_bytes(m, kv_dtype, mla_latent) * layers;
}

double kv_cache_bytes(const ModelShape& m, DType kv_dtype, int64_t context, int64_t batch,
                      bool mla_latent) {
  // One sequence's bytes in 128 bits: at most 2^43 bytes per token and
  // layer (sizes are capped at 2^20 by the parsers) x 2^63 tokens x 2^20
  // layers = 2^126. Times the batch in double: a product below 2^53 is
  // exact, a larger one is within two roundings of the truth.
  const __int128 per_token_layer = stored_token_layer_bytes(m, kv_dtype, mla_latent);
  __int128 per_sequence = 0;
  for (int64_t l = 0; l < m.num_layers; ++l)
    per_sequence += per_token_layer * tokens_held(m, l, context);
  return static_cast<double>(per_sequence) * static_cast<double>(batch);
}

int64_t linear_state_bytes_per_layer(const ModelShape& m, int64_t layer, DType state_dtype) {
  const LayerShape l = layer_shape(m, layer);
  if (l.kind != MixerKind::kGatedDeltaNet) return 0;
  return (l.linear.state_values() + l.linear.conv_state_values()) *
         static_cast<int64_t>(dtype_size(state_dtype));
}

double linear_state_bytes(const ModelShape& m, int64_t batch, DType state_dtype) {
  int64_t per_sequence = 0;
  for (int64_t l = 0; l < m.num_layers; ++l)
    per_sequence += linear_state_bytes_per_layer(m, l, state_dtype);
  return static_cast<double>(per_sequence) * static_cast<double>(batch);
}

double cache_bytes(const ModelShape& m, DType kv_dtype, int64_t context, int64_t batch,
                   bool mla_latent) {
  return kv_cache_bytes(m, kv_dtype, context, batch, mla_latent) +
         linear_state_bytes(m, batch, DType::kF32);
}

double prefill_flops_per_layer(const ModelShape& m, int64_t seq, int64_t layer) {
  const LayerShape l = layer_shape(m, layer);
  if (l.kind == MixerKind::kGatedDeltaNet)
    return static_cast<double>(seq) * delta_net_flops_per_token(l.linear);
  const double pairs = visible_pairs(m, seq, l);
  return 2.0 * static_cast<double>(seq) * static_cast<double>(attention_layer_params(m, l)) +
         2.0 * static_cast<double>(m.num_heads) * static_cast<double>(m.head_dim + m.head_dim_v) *
             pairs;
}

double decode_flops_per_layer(const ModelShape& m, int64_t context, int64_t layer,
                              bool mla_absorbed) {
  const LayerShape l = layer_shape(m, layer);
  if (l.kind == MixerKind::kGatedDeltaNet) return delta_net_flops_per_token(l.linear);
  const double L = static_cast<double>(tokens_held(m, layer, context));
  const double proj = 2.0 * static_cast<double>(attention_layer_params(m, l));
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
  const double weights =
      static_cast<double>(layer_params(m, layer)) * static_cast<double>(dtype_size(weight_dtype));
  const double per_sequence =
      layer_shape(m, layer).kind == MixerKind::kGatedDeltaNet
          ? static_cast<double>(linear_state_bytes_per_layer(m, layer, DType::kF32))
          : static_cast<double>(kv_token_layer_bytes(m, kv_dtype, true)) *
                static_cast<double>(tokens_held(m, layer, context));
  return weights + static_cast<double>(batch) * per_sequence;
}

ModelTotals model_totals(const ModelShape& m, int64_t context, int64_t batch, DType kv_dtype,
                         DType weight_dtype) {
  ModelTotals t;
  const double b = static_cast<double>(batch);
  for (int64_t l = 0; l < m.num_layers; ++l) {
    t.prefill_flops += prefill_flops_per_layer(m, context, l) * b;
    t.decode_flops += decode_flops_per_layer(m, context, l) * b;
    t.decode_bytes += decode_bytes_per_layer(m, context, batch, kv_dtype, weight_dtype, l);
  }
  return t;
}

namespace {

std::string group_label(const LayerShape& l) {
  if (l.kind == MixerKind::kGatedDeltaNet) return "Gated DeltaNet";
  std::string s = l.sliding_window > 0 ? "sliding " + std::to_string(l.sliding_window)
                  : l.chunk_size > 0   ? "chunked " + std::to_string(l.chunk_size)
                                       : "full";
  if (!l.use_rope) s += " NoPE";
  if (l.output_gate) s += " (gated)";
  return s;
}

}  // namespace

std::vector<LayerGroup> layer_groups(const ModelShape& m) {
  std::vector<LayerGroup> out;
  for (int64_t l = 0; l < m.num_layers; ++l) {
    const LayerShape s = layer_shape(m, l);
    auto it =
        std::find_if(out.begin(), out.end(), [&](const LayerGroup& g) { return g.shape == s; });
    if (it == out.end()) it = out.insert(out.end(), LayerGroup{s, group_label(s), {}});
    it->layers.push_back(l);
  }
  return out;
}

std::string layer_mix(const ModelShape& m) {
  std::string out = std::to_string(m.num_layers) + (m.num_layers == 1 ? " layer: " : " layers: ");
  bool first = true;
  for (const LayerGroup& g : layer_groups(m)) {
    out += (first ? "" : ", ") + std::to_string(g.layers.size()) + " " + g.label;
    first = false;
  }
  return out;
}

ModelShape first_layers(const ModelShape& m, int64_t n) {
  ModelShape out = m;
  out.num_layers = n;
  out.layers.clear();
  if (!m.layers.empty())
    for (int64_t l = 0; l < n; ++l) out.layers.push_back(layer_shape(m, l % m.num_layers));
  return out;
}

std::vector<LayerGroupFigures> layer_group_figures(const ModelShape& m, DType kv_dtype,
                                                   int64_t context, int64_t batch) {
  std::vector<LayerGroupFigures> out;
  const double b = static_cast<double>(batch);
  const double per_token = static_cast<double>(stored_token_layer_bytes(m, kv_dtype, true));
  for (const LayerGroup& g : layer_groups(m)) {
    LayerGroupFigures f;
    f.label = g.label;
    f.count = static_cast<int64_t>(g.layers.size());
    const int64_t first = g.layers.front();
    f.params_per_layer = layer_params(m, first);
    f.tokens_held = tokens_held(m, first, context);
    for (int64_t l : g.layers) {
      if (g.shape.kind == MixerKind::kAttention)
        f.kv_bytes += per_token * static_cast<double>(tokens_held(m, l, context)) * b;
      f.state_bytes += static_cast<double>(linear_state_bytes_per_layer(m, l, DType::kF32)) * b;
      f.prefill_flops += prefill_flops_per_layer(m, context, l) * b;
      f.decode_flops += decode_flops_per_layer(m, context, l) * b;
    }
    out.push_back(f);
  }
  return out;
}

namespace {

bool is_dsa(const ModelShape& m) { return m.mla && m.index_topk > 0 && m.index_n_heads > 0; }

// The indexer key's own weights (wk, k_norm gain and bias): what a call
// that selects nothing still runs for its new tokens.
int64_t indexer_key_params(const ModelShape& m) {
  return m.index_head_dim * m.hidden_size + 2 * m.index_head_dim;
}

// FLOPs of the indexer's scores for one query over L keys.
double indexer_score_flops(const ModelShape& m, double keys) {
  const double hi = static_cast<double>(m.index_n_heads);
  return (2.0 * hi * static_cast<double>(m.index_head_dim) + 2.0 * hi) * keys;
}

// FLOPs of absorbed MLA per (query, chosen key).
double absorbed_pair_flops(const ModelShape& m) {
  return 2.0 * static_cast<double>(m.num_heads) *
         static_cast<double>(2 * m.kv_lora_rank + m.qk_rope_head_dim);
}

}  // namespace

int64_t indexer_params(const ModelShape& m) {
  if (!is_dsa(m)) return 0;
  return m.index_n_heads * m.index_head_dim * m.q_lora_rank + indexer_key_params(m) +
         m.index_n_heads * m.hidden_size;
}

int64_t indexer_key_bytes_per_token(const ModelShape& m) {
  if (!is_dsa(m)) return 0;
  return m.index_head_dim + 4 * (m.index_head_dim / kIndexerBlock);
}

DsaLayerFigures dsa_layer_figures(const ModelShape& m, int64_t context, int64_t batch,
                                  DType kv_dtype, DType weight_dtype) {
  DsaLayerFigures f;
  f.context = context;
  const double b = static_cast<double>(batch), S = static_cast<double>(context);
  f.dense_prefill_flops = prefill_flops_per_layer(m, context) * b;
  f.dense_decode_flops = decode_flops_per_layer(m, context) * b;
  f.dense_decode_bytes = decode_bytes_per_layer(m, context, batch, kv_dtype, weight_dtype);
  const double wsize = static_cast<double>(dtype_size(weight_dtype));
  const double key_flops = 2.0 * static_cast<double>(indexer_key_params(m));
  if (context <= m.index_topk) {
    // Nothing to select: dense MLA plus the new tokens' indexer keys.
    f.dsa_prefill_flops = f.dense_prefill_flops + key_flops * S * b;
    f.dsa_decode_flops = f.dense_decode_flops + key_flops * b;
    f.dsa_decode_bytes = f.dense_decode_bytes + static_cast<double>(indexer_key_params(m)) * wsize;
    return f;
  }
  const double params = static_cast<double>(layer_params(m, 0) + indexer_params(m));
  const double k = static_cast<double>(m.index_topk);
  const double chosen_pairs = sq_pairs(k) + (S - k) * k;  // sum_t min(k, t + 1)
  f.dsa_prefill_flops = (2.0 * S * params + indexer_score_flops(m, sq_pairs(S)) +
                         absorbed_pair_flops(m) * chosen_pairs) *
                        b;
  f.dsa_indexer_decode_flops = indexer_score_flops(m, S) * b;
  f.dsa_decode_flops = (2.0 * params + absorbed_pair_flops(m) * k) * b + f.dsa_indexer_decode_flops;
  const double latent_row = static_cast<double>(kv_token_layer_bytes(m, kv_dtype, true));
  f.dsa_decode_bytes =
      params * wsize +
      b * (S * static_cast<double>(indexer_key_bytes_per_token(m)) + k * latent_row);
  return f;
}

namespace {

// The smallest context in (index_topk, 2^40] where `cheaper` holds, or 0:
// past index_topk the dense cost grows faster per token than DSA's, so
// once DSA is cheaper it stays cheaper (a bisection).
template <typename F>
int64_t first_context_where(const ModelShape& m, const F& cheaper) {
  int64_t lo = m.index_topk, hi = int64_t{1} << 40;  // cheaper(lo) false
  if (!cheaper(hi)) return 0;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (cheaper(mid) ? hi : lo) = mid;
  }
  return hi;
}

}  // namespace

DsaCrossover dsa_crossover(const ModelShape& m, int64_t batch, DType kv_dtype, DType weight_dtype) {
  DsaCrossover c;
  if (!is_dsa(m)) return c;
  const auto at = [&](int64_t L) { return dsa_layer_figures(m, L, batch, kv_dtype, weight_dtype); };
  c.decode_flops = first_context_where(m, [&](int64_t L) {
    const DsaLayerFigures f = at(L);
    return f.dsa_decode_flops < f.dense_decode_flops;
  });
  c.decode_bytes = first_context_where(m, [&](int64_t L) {
    const DsaLayerFigures f = at(L);
    return f.dsa_decode_bytes < f.dense_decode_bytes;
  });
  c.prefill_flops = first_context_where(m, [&](int64_t L) {
    const DsaLayerFigures f = at(L);
    return f.dsa_prefill_flops < f.dense_prefill_flops;
  });
  return c;
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
  for (LayerShape& l : out.layers) l.sinks = l.output_gate = false;
  out.name = m.name + " [mla r=" + std::to_string(kv_lora_rank) + "]";
  return out;
}

}  // namespace attnkit
