// Bindings for model_spec_from_json: the model description as plain Python
// data (attnkit.model_spec_from_config in attnkit/model_spec.py takes a dict
// or the JSON text). Failures raise ValueError with the C++ message.
#include <string>

#include <pybind11/stl.h>

#include "attnkit/model_spec.h"
#include "bindings.h"
#include "numpy_util.h"
#include "rope.h"

namespace attnkit::python {
namespace {

const char* kind_name(LayerKind k) {
  switch (k) {
    case LayerKind::kAttention:
      return "attention";
    case LayerKind::kLatentAttention:
      return "latent_attention";
    case LayerKind::kLinearAttention:
      return "linear_attention";
  }
  return "unknown";
}

const char* qk_norm_name(QkNorm n) {
  switch (n) {
    case QkNorm::kNone:
      return "none";
    case QkNorm::kRms:
      return "rms";
    case QkNorm::kRmsOnePlus:
      return "rms_one_plus";
    case QkNorm::kL2:
      return "l2";
  }
  return "unknown";
}

py::dict rope_dict(const RopeConfig& r, int64_t rotary_dim_default) {
  py::dict d;
  d["theta"] = r.theta;
  d["rotary_dim"] = r.rotary_dim > 0 ? r.rotary_dim : rotary_dim_default;
  d["pairing"] = r.pairing == RopePairing::kInterleaved ? "interleaved" : "half_split";
  d["scaling"] = rope_type_name(r.scaling.type);
  if (r.scaling.type != RopeScaling::Type::kNone) d["factor"] = r.scaling.factor;
  return d;
}

py::dict layer_dict(const LayerSpec& l) {
  py::dict d;
  d["kind"] = kind_name(l.kind);
  if (l.kind == LayerKind::kAttention) {
    const AttentionConfig& a = l.attention;
    d["num_heads"] = a.num_heads;
    d["num_kv_heads"] = a.num_kv_heads;
    d["head_dim"] = a.head_dim;
    d["window"] = a.sliding_window;
    d["chunk"] = a.chunk_size;
    d["rope"] = a.use_rope ? py::object(rope_dict(a.rope, a.head_dim)) : py::object(py::none());
    d["qk_norm"] = qk_norm_name(a.qk_norm);
    d["sinks"] = a.sinks;
    d["output_gate"] = a.output_gate;
    d["temperature_tuning"] = a.temperature_tuning;
    d["softcap"] = a.softcap;
    d["softmax_scale"] = a.softmax_scale;
  } else if (l.kind == LayerKind::kLatentAttention) {
    const MlaConfig& m = l.mla;
    d["num_heads"] = m.num_attention_heads;
    d["q_lora_rank"] = m.q_lora_rank;
    d["kv_lora_rank"] = m.kv_lora_rank;
    d["qk_nope_head_dim"] = m.qk_nope_head_dim;
    d["qk_rope_head_dim"] = m.qk_rope_head_dim;
    d["v_head_dim"] = m.v_head_dim;
    d["window"] = 0;
    d["chunk"] = 0;
    py::dict rope;
    rope["theta"] = m.rope_theta;
    rope["rotary_dim"] = m.qk_rope_head_dim;
    rope["pairing"] = m.rope_interleave ? "interleaved" : "half_split";
    rope["scaling"] = rope_type_name(m.rope_scaling.type);
    d["rope"] = rope;
  } else {
    const GatedDeltaNetConfig& g = l.linear;
    d["num_k_heads"] = g.num_k_heads;
    d["num_v_heads"] = g.num_v_heads;
    d["key_head_dim"] = g.key_head_dim;
    d["value_head_dim"] = g.value_head_dim;
    d["conv_kernel"] = g.conv_kernel;
    d["state_values"] = g.state_values();
    d["window"] = 0;
    d["chunk"] = 0;
    d["rope"] = py::none();
  }
  py::dict ffn;
  ffn["kind"] = l.ffn.kind == FeedForwardKind::kMoe ? "moe" : "dense";
  ffn["hidden_act"] = l.ffn.hidden_act;
  if (l.ffn.kind == FeedForwardKind::kMoe) {
    const MoeConfig& m = l.ffn.moe;
    ffn["n_routed_experts"] = m.n_routed_experts;
    ffn["num_experts_per_tok"] = m.num_experts_per_tok;
    ffn["moe_intermediate_size"] = m.moe_intermediate_size;
    ffn["n_shared_experts"] = m.n_shared_experts;
  } else {
    ffn["intermediate_size"] = l.ffn.intermediate_size;
  }
  d["ffn"] = ffn;
  return d;
}

py::dict spec_dict(const ModelSpec& s) {
  py::dict d;
  d["name"] = s.name;
  d["model_type"] = s.model_type;
  d["wrapper_model_type"] = s.wrapper_model_type;
  d["num_layers"] = s.num_layers;
  d["hidden_size"] = s.hidden_size;
  d["vocab_size"] = s.vocab_size;
  d["max_position_embeddings"] = s.max_position_embeddings;
  d["tie_word_embeddings"] = s.tie_word_embeddings;
  d["rms_norm_eps"] = s.rms_norm_eps;
  py::dict q;
  q["quant_method"] = s.quantization.quant_method;
  q["modules_not_to_convert"] = s.quantization.modules_not_to_convert;
  d["quantization"] = q;
  py::list layers;
  for (const LayerSpec& l : s.layers) layers.append(layer_dict(l));
  d["layers"] = layers;
  return d;
}

}  // namespace

void bind_model_spec(py::module_& m) {
  m.def(
      "_model_spec_from_json",
      [](const std::string& text) { return spec_dict(value_or_throw(model_spec_from_json(text))); },
      py::arg("text"), "The model description of a Hugging Face config.json string, as a dict.");
}

}  // namespace attnkit::python
