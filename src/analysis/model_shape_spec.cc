// ModelSpec -> ModelShape: the analysis' view of the one model description.
// The attention sizes are model-wide in ModelShape, so the attention layers
// of the spec must agree on them; what differs per layer (kind, window,
// chunk, RoPE, sinks, gate, linear state) goes to ModelShape::layers.
#include <string>

#include "attnkit/analysis.h"

namespace attnkit {
namespace {

constexpr const char* kFn = "model_shape_from_spec";

Status layer_error(size_t layer, const std::string& what) {
  return invalid_argument(std::string(kFn) + ": layer " + std::to_string(layer) + " " + what);
}

// The model-wide attention sizes one attention layer implies.
ModelShape attention_sizes(const LayerSpec& l) {
  ModelShape s;
  if (l.kind == LayerKind::kLatentAttention) {
    const MlaConfig& c = l.mla;
    s.mla = true;
    s.hidden_size = c.hidden_size;
    s.num_heads = s.num_kv_heads = c.num_attention_heads;
    s.q_lora_rank = c.q_lora_rank;
    s.kv_lora_rank = c.kv_lora_rank;
    s.qk_nope_head_dim = c.qk_nope_head_dim;
    s.qk_rope_head_dim = c.qk_rope_head_dim;
    s.v_head_dim = c.v_head_dim;
    s.rope_interleave = c.rope_interleave;
    s.head_dim = c.qk_head_dim();
    s.head_dim_v = c.v_head_dim;
    s.index_topk = c.index_topk;
    if (c.sparse()) {
      s.index_n_heads = c.index_n_heads;
      s.index_head_dim = c.index_head_dim;
    }
    return s;
  }
  const AttentionConfig& c = l.attention;
  s.hidden_size = c.hidden_size;
  s.num_heads = c.num_heads;
  s.num_kv_heads = c.num_kv_heads;
  s.head_dim = s.head_dim_v = c.head_dim;
  s.q_bias = s.k_bias = s.v_bias = c.qkv_bias;
  s.o_bias = c.o_bias;
  // Llama 4's L2 norm has no weight; the RMS norms carry one per head_dim.
  s.qk_norm = c.qk_norm == QkNorm::kRms || c.qk_norm == QkNorm::kRmsOnePlus;
  s.causal = c.causal;
  return s;
}

bool same_sizes(const ModelShape& a, const ModelShape& b) {
  return a.mla == b.mla && a.hidden_size == b.hidden_size && a.num_heads == b.num_heads &&
         a.num_kv_heads == b.num_kv_heads && a.head_dim == b.head_dim &&
         a.head_dim_v == b.head_dim_v && a.q_bias == b.q_bias && a.o_bias == b.o_bias &&
         a.qk_norm == b.qk_norm && a.causal == b.causal && a.q_lora_rank == b.q_lora_rank &&
         a.kv_lora_rank == b.kv_lora_rank && a.qk_rope_head_dim == b.qk_rope_head_dim;
}

// The Gated DeltaNet sizes multiply three at a time (state, projections);
// each is capped by the reader at 2^20, which bounds two-factor products
// but not these: a layer whose weights or f32 state pass 2^60 (no model
// comes near) is refused so that the analysis' int64 sums cannot overflow.
bool delta_net_fits(const GatedDeltaNetConfig& g) {
  using i128 = __int128;
  const i128 key_dim = i128{g.num_k_heads} * g.key_head_dim,
             value_dim = i128{g.num_v_heads} * g.value_head_dim;
  const i128 weights = (3 * key_dim + 4 * value_dim + 2 * g.num_v_heads) * g.hidden_size +
                       (2 * key_dim + value_dim) * g.conv_kernel;
  const i128 state = (i128{g.num_v_heads} * g.key_head_dim * g.value_head_dim +
                      i128{g.conv_kernel} * (2 * key_dim + value_dim)) *
                     4;
  constexpr i128 kLimit = i128{1} << 60;
  return weights < kLimit && state < kLimit;
}

}  // namespace

Result<ModelShape> model_shape_from_spec(const ModelSpec& spec) {
  if (spec.num_layers < 1 || static_cast<int64_t>(spec.layers.size()) != spec.num_layers)
    return invalid_argument(
        std::string(kFn) + ": layers.size() = " + std::to_string(spec.layers.size()) +
        " must equal num_layers = " + std::to_string(spec.num_layers) + " (>= 1)");
  ModelShape m;
  bool have_attention = false;
  std::vector<LayerShape> layers;
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    const LayerSpec& l = spec.layers[i];
    LayerShape s;
    if (l.kind == LayerKind::kLinearAttention) {
      if (!delta_net_fits(l.linear))
        return layer_error(i, "(Gated DeltaNet) has weights or a state past 2^60 bytes");
      s.kind = MixerKind::kGatedDeltaNet;
      s.linear = l.linear;
      layers.push_back(s);
      continue;
    }
    const ModelShape sizes = attention_sizes(l);
    if (!have_attention) {
      m = sizes;
      have_attention = true;
    } else if (!same_sizes(m, sizes)) {
      return layer_error(i,
                         "has other attention sizes (heads, head_dim, biases, qk-norm or MLA "
                         "ranks) than the first attention layer; the analysis needs them equal");
    }
    if (l.kind == LayerKind::kAttention) {
      s.sliding_window = l.attention.sliding_window;
      s.chunk_size = l.attention.chunk_size;
      s.use_rope = l.attention.use_rope;
      s.sinks = l.attention.sinks;
      s.output_gate = l.attention.output_gate;
    }
    layers.push_back(s);
  }
  // A model of linear layers only still has its width.
  if (!have_attention) m.hidden_size = spec.hidden_size;
  m.name = spec.name;
  m.model_type = spec.model_type;
  m.num_layers = spec.num_layers;
  m.max_position_embeddings = spec.max_position_embeddings;
  m.weight_quantization = spec.quantization.quant_method;
  m.layers = std::move(layers);
  return m;
}

}  // namespace attnkit
