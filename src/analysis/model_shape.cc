// Hugging Face config.json -> ModelShape, a summary of the ModelSpec that
// model_spec_from_json reads (src/io/model_spec.cc holds every family's
// rules, gpt2's n_embd, falcon's multi_query and DeepSeek's MLA fields
// included): the first layer's attention sizes and each layer's window.
#include <cstdint>
#include <string>

#include "attnkit/analysis.h"
#include "attnkit/model_spec.h"
#include "io/model_spec_reader.h"

namespace attnkit {

Result<ModelShape> model_shape_from_json(std::string_view json_text) {
  io::SpecRequest request;
  request.fn = "model_shape_from_json";
  request.ffn = false;
  ModelSpec spec;
  ATTNKIT_RETURN_IF_ERROR(io::read_model_spec(json_text, request, &spec));
  ModelShape m;
  m.name = spec.name;
  m.model_type = spec.model_type;
  m.num_layers = spec.num_layers;
  m.hidden_size = spec.hidden_size;
  m.max_position_embeddings = spec.max_position_embeddings;
  m.window_per_layer.assign(static_cast<size_t>(spec.num_layers), 0);
  bool described = false;
  for (size_t l = 0; l < spec.layers.size(); ++l) {
    const LayerSpec& layer = spec.layers[l];
    if (layer.kind == LayerKind::kAttention) {
      const AttentionConfig& a = layer.attention;
      m.window_per_layer[l] = a.sliding_window;
      if (described) continue;
      described = true;
      m.num_heads = a.num_heads;
      m.num_kv_heads = a.num_kv_heads;
      m.head_dim = m.head_dim_v = a.head_dim;
      m.q_bias = m.k_bias = m.v_bias = a.qkv_bias;
      m.o_bias = a.o_bias;
      m.qk_norm = a.qk_norm != QkNorm::kNone;
      m.causal = a.causal;
    } else if (layer.kind == LayerKind::kLatentAttention && !described) {
      // num_key_value_heads and head_dim in these configs do not describe
      // the cache: each head gets its own K/V after decompression, q/k are
      // nope + rope wide and v is v_head_dim wide.
      const MlaConfig& c = layer.mla;
      described = true;
      m.mla = true;
      m.num_heads = m.num_kv_heads = c.num_attention_heads;
      m.kv_lora_rank = c.kv_lora_rank;
      m.q_lora_rank = c.q_lora_rank;
      m.qk_nope_head_dim = c.qk_nope_head_dim;
      m.qk_rope_head_dim = c.qk_rope_head_dim;
      m.v_head_dim = c.v_head_dim;
      m.rope_interleave = c.rope_interleave;
      m.head_dim = c.qk_head_dim();
      m.head_dim_v = c.v_head_dim;
    }
  }
  return m;
}

}  // namespace attnkit
