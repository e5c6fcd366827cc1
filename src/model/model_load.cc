// Model::from_pretrained: config.json into the model description, the
// checkpoint's tensors into the layers, strictly (every tensor read once,
// each with its shape).
#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <utility>

#include "io/weight_loader.h"
#include "model/checkpoint.h"
#include "model/model_impl.h"

namespace attnkit {
namespace {

constexpr const char* kFn = "Model::from_pretrained";

constexpr std::array<const char*, 15> kSupported = {
    "llama",       "mistral",     "qwen2",        "qwen3",   "mixtral",
    "qwen2_moe",   "qwen3_moe",   "qwen3_next",   "gemma2",  "gemma3_text",
    "deepseek_v2", "deepseek_v3", "deepseek_v32", "gpt_oss", "llama4_text"};

// How a multimodal wrapper's checkpoint names its text model's tensors:
// each `renames` prefix of the checkpoint stands for the text model's
// (Gemma3ForCausalLM's / Llama4ForCausalLM's) prefix beside it, and the
// tensors under `skipped` (vision tower, projector) are not text weights.
// A name under neither keeps its name, and is then read or reported as
// unread like any other.
struct WrapperNaming {
  const char* wrapper;
  std::array<std::pair<const char*, const char*>, 3> renames;
  std::array<const char*, 4> skipped;
};

constexpr std::array<WrapperNaming, 2> kWrappers = {{
    // Llama4ForConditionalGeneration as released (Scout, Maverick):
    // language_model.model.*, language_model.lm_head.weight.
    {"llama4",
     {{{"language_model.", ""}, {nullptr, nullptr}, {nullptr, nullptr}}},
     {"vision_model.", "multi_modal_projector.", nullptr, nullptr}},
    // Gemma3ForConditionalGeneration: the names transformers saved before
    // its 4.52 multimodal refactor (language_model.model.*,
    // language_model.lm_head.weight) and since (model.language_model.*,
    // lm_head.weight), as its _checkpoint_conversion_mapping relates them.
    {"gemma3",
     {{{"language_model.model.", "model."},
       {"model.language_model.", "model."},
       {"language_model.lm_head.", "lm_head."}}},
     {"vision_tower.", "model.vision_tower.", "multi_modal_projector.",
      "model.multi_modal_projector."}},
}};

const WrapperNaming* wrapper_naming(const std::string& wrapper) {
  for (const WrapperNaming& w : kWrappers)
    if (wrapper == w.wrapper) return &w;
  return nullptr;
}

bool is_gemma(const ModelSpec& spec) {
  return spec.model_type == "gemma2" || spec.model_type == "gemma3_text";
}

// Zero-centred RMSNorm gains, stored as w and applied as 1 + w: Gemma's
// and Qwen3-Next's (Qwen3NextRMSNorm) decoder norms.
bool one_plus_norms(const ModelSpec& spec) {
  return is_gemma(spec) || spec.model_type == "qwen3_next";
}

// Tensors of the checkpoint no forward pass reads, as Hugging Face skips
// them on load: Qwen3-Next's multi-token-prediction head (mtp.*).
bool is_skipped_module(const ModelSpec& spec, const std::string& name) {
  return spec.model_type == "qwen3_next" && name.starts_with("mtp.");
}

// "Model::from_pretrained: <what>: <message>", the message's own leading
// "Model::from_pretrained: " (the loaders' name) dropped.
Status prefixed(const std::string& what, const Status& st) {
  if (st.ok()) return st;
  std::string msg = st.message();
  const std::string own = std::string(kFn) + ": ";
  if (msg.starts_with(own)) msg.erase(0, own.size());
  return Status(st.code(), own + what + ": " + msg);
}

std::string layer_prefix(size_t i) { return "model.layers." + std::to_string(i) + "."; }

// What attnkit runs of this description, or the first thing it does not.
Status check_supported(const ModelSpec& spec) {
  if (std::find_if(kSupported.begin(), kSupported.end(),
                   [&](const char* t) { return spec.model_type == t; }) == kSupported.end()) {
    std::string list;
    for (const char* t : kSupported) list += std::string(list.empty() ? "" : ", ") + t;
    return invalid_argument(std::string(kFn) + ": model_type \"" + spec.model_type +
                            "\" is not loaded as a whole model yet (supported: " + list + ")");
  }
  if (!spec.wrapper_model_type.empty() && wrapper_naming(spec.wrapper_model_type) == nullptr)
    return invalid_argument(std::string(kFn) + ": model_type \"" + spec.wrapper_model_type +
                            "\" is a multimodal wrapper whose text model is not loaded from it "
                            "(wrappers loaded: gemma3, llama4); only its text model's (\"" +
                            spec.model_type + "\") own checkpoint loads");
  if (!spec.quantization.quant_method.empty())
    return invalid_argument(
        std::string(kFn) + ": quantization_config.quant_method = \"" +
        spec.quantization.quant_method +
        "\": quantized weights are not loaded (f32, bf16, f16 and f64 are); load a bf16 "
        "dequantized checkpoint instead (e.g. transformers' from_pretrained with "
        "Mxfp4Config(dequantize=True) for mxfp4, then save_pretrained, which writes no "
        "quantization_config)");
  // The first layer with K/V in the pool: every such layer shares its kind
  // and shape (one pool); linear-attention layers keep theirs in the state
  // pool.
  const LayerSpec* first = nullptr;
  for (const LayerSpec& l : spec.layers)
    if (l.kind != LayerKind::kLinearAttention && first == nullptr) first = &l;
  if (first == nullptr)
    return invalid_argument(std::string(kFn) + ": all " + std::to_string(spec.layers.size()) +
                            " layers are linear attention; at least one softmax-attention "
                            "layer is needed (the paged pool keeps the positions)");
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    const LayerSpec& l = spec.layers[i];
    const std::string where = std::string(kFn) + ": layer " + std::to_string(i);
    if (l.kind != LayerKind::kLinearAttention && l.kind != first->kind)
      return invalid_argument(where + " mixes MLA and softmax attention in one model");
    if (l.kind == LayerKind::kAttention &&
        (l.attention.num_kv_heads != first->attention.num_kv_heads ||
         l.attention.head_dim != first->attention.head_dim))
      return invalid_argument(where +
                              ": kv heads and head dim differ from the first attention "
                              "layer's (one pool)");
    const std::string& act = l.ffn.hidden_act;
    if (l.ffn.kind == FeedForwardKind::kDense && act != "silu" && act != "gelu_pytorch_tanh")
      return invalid_argument(where + ": hidden_act \"" + act +
                              "\" is not supported (silu, gelu_pytorch_tanh)");
  }
  return Status::Ok();
}

// A norm's gain [hidden] f32: w, or 1 + w for the zero-centred norms.
Status load_norm(io::WeightLoader& w, const std::string& name, int64_t dim, bool one_plus,
                 Tensor* out) {
  Tensor t;
  ATTNKIT_RETURN_IF_ERROR(w.load(name, {dim}, "hidden_size", &t));
  if (one_plus)
    for (int64_t i = 0; i < dim; ++i) t.ptr<float>()[i] += 1.0f;
  *out = std::move(t);
  return Status::Ok();
}

// The dense gate/up/down under `prefix` (e.g. "model.layers.0.mlp.").
Status load_mlp(io::WeightLoader& w, const std::string& prefix, int64_t hidden,
                const FeedForwardSpec& ffn, DenseMlp* out) {
  DenseMlp m;
  m.intermediate = ffn.intermediate_size;
  m.gelu_tanh = ffn.hidden_act == "gelu_pytorch_tanh";
  const int64_t I = m.intermediate;
  if (I < 1)
    return invalid_argument("intermediate_size = " + std::to_string(I) +
                            " must be >= 1 for a dense feed-forward");
  ATTNKIT_RETURN_IF_ERROR(w.load_matrix(prefix + "gate_proj.weight", {I, hidden},
                                        "intermediate_size, hidden_size", &m.gate));
  ATTNKIT_RETURN_IF_ERROR(w.load_matrix(prefix + "up_proj.weight", {I, hidden},
                                        "intermediate_size, hidden_size", &m.up));
  ATTNKIT_RETURN_IF_ERROR(w.load_matrix(prefix + "down_proj.weight", {hidden, I},
                                        "hidden_size, intermediate_size", &m.down));
  *out = std::move(m);
  return Status::Ok();
}

size_t bytes_of(const Tensor& t) { return t.data() != nullptr ? t.nbytes() : 0; }

template <typename Layer>
size_t layer_bytes(const Layer& layer) {
  size_t n = 0;
  for (const std::string& name : layer.weight_names())
    if (auto v = layer.weight(name); v.ok())
      n += static_cast<size_t>(v->numel()) * dtype_size(v->dtype);
  return n;
}

// Bytes a loaded GatedDeltaNet keeps (it has no per-weight accessor): its
// projection matrices (in_proj_qkvz, in_proj_ba, out_proj: the rank-2
// tensors) as stored when bf16, everything else f32 (GatedDeltaNet::
// load_weights' rule).
size_t linear_layer_bytes(const WeightMap& weights, const std::string& prefix,
                          const GatedDeltaNet& layer) {
  size_t n = 0;
  for (const std::string& name : layer.weight_names()) {
    const auto it = weights.find(prefix + name);
    if (it == weights.end()) continue;
    const bool keeps_bf16 = it->second.rank == 2 && it->second.dtype == DType::kBF16;
    n += static_cast<size_t>(it->second.numel()) * (keeps_bf16 ? 2 : 4);
  }
  return n;
}

// The mixer of layer i (self_attn.*, or linear_attn.* for a Gated
// DeltaNet layer), its names added to `used`.
Status load_mixer(const WeightMap& weights, size_t i, Model::Impl* m, Block* b,
                  std::set<std::string>* used) {
  const LayerSpec& l = m->spec.layers[i];
  b->kind = l.kind;
  if (l.kind == LayerKind::kLinearAttention) {
    const std::string prefix = layer_prefix(i) + "linear_attn.";
    ATTNKIT_ASSIGN_OR_RETURN(GatedDeltaNet layer, GatedDeltaNet::create(l.linear));
    ATTNKIT_RETURN_IF_ERROR(layer.load_weights(weights, prefix));
    for (const std::string& n : layer.weight_names()) used->insert(prefix + n);
    m->weight_bytes += linear_layer_bytes(weights, prefix, layer);
    b->mixer = static_cast<int64_t>(m->linear.size());
    m->linear.push_back(std::move(layer));
    return Status::Ok();
  }
  const std::string prefix = layer_prefix(i) + "self_attn.";
  if (l.kind == LayerKind::kLatentAttention) {
    ATTNKIT_ASSIGN_OR_RETURN(LatentAttention layer, LatentAttention::create(l.mla));
    ATTNKIT_RETURN_IF_ERROR(layer.load_weights(weights, prefix));
    for (const std::string& n : layer.weight_names()) used->insert(prefix + n);
    m->weight_bytes += layer_bytes(layer);
    b->mixer = static_cast<int64_t>(m->latent.size());
    m->latent.push_back(std::move(layer));
    return Status::Ok();
  }
  ATTNKIT_ASSIGN_OR_RETURN(AttentionLayer layer, AttentionLayer::create(l.attention));
  ATTNKIT_RETURN_IF_ERROR(layer.load_weights(weights, prefix));
  for (const std::string& n : layer.weight_names()) used->insert(prefix + n);
  m->weight_bytes += layer_bytes(layer);
  b->mixer = static_cast<int64_t>(m->attention.size());
  m->attention.push_back(std::move(layer));
  return Status::Ok();
}

// The feed-forward of layer i, its names added to `used`.
Status load_ffn(const WeightMap& weights, size_t i, Model::Impl* m, Block* b,
                std::set<std::string>* used) {
  const FeedForwardSpec& ffn = m->spec.layers[i].ffn;
  const std::string prefix = layer_prefix(i);
  if (ffn.kind == FeedForwardKind::kMoe) {
    ATTNKIT_ASSIGN_OR_RETURN(MoeLayer layer, MoeLayer::create(ffn.moe));
    ATTNKIT_RETURN_IF_ERROR(layer.load_weights(weights, prefix));
    for (const std::string& n : layer.weight_names()) used->insert(prefix + n);
    m->weight_bytes += layer_bytes(layer);
    b->moe = true;
    b->ffn = static_cast<int64_t>(m->moe.size());
    m->moe.push_back(std::move(layer));
    return Status::Ok();
  }
  io::WeightLoader w(weights, "", kFn);
  DenseMlp mlp;
  // Llama 4 names its feed-forward feed_forward.*, dense or not.
  const std::string block =
      prefix + (m->spec.model_type == "llama4_text" ? "feed_forward." : "mlp.");
  ATTNKIT_RETURN_IF_ERROR(load_mlp(w, block, m->spec.hidden_size, ffn, &mlp));
  for (const char* n : {"gate_proj", "up_proj", "down_proj"}) used->insert(block + n + ".weight");
  m->weight_bytes += bytes_of(mlp.gate) + bytes_of(mlp.up) + bytes_of(mlp.down);
  b->ffn = static_cast<int64_t>(m->mlp.size());
  m->mlp.push_back(std::move(mlp));
  return Status::Ok();
}

// Layer i's norms: input_layernorm, post_attention_layernorm and, for
// Gemma, pre_feedforward_layernorm and post_feedforward_layernorm.
Status load_block_norms(const WeightMap& weights, size_t i, Model::Impl* m, Block* b,
                        std::set<std::string>* used) {
  const bool gemma = is_gemma(m->spec), one_plus = one_plus_norms(m->spec);
  const int64_t H = m->spec.hidden_size;
  const std::string p = layer_prefix(i);
  io::WeightLoader w(weights, "", kFn);
  ATTNKIT_RETURN_IF_ERROR(load_norm(w, p + "input_layernorm.weight", H, one_plus, &b->input_norm));
  if (gemma) {
    ATTNKIT_RETURN_IF_ERROR(
        load_norm(w, p + "post_attention_layernorm.weight", H, true, &b->post_attn_norm));
    ATTNKIT_RETURN_IF_ERROR(
        load_norm(w, p + "pre_feedforward_layernorm.weight", H, true, &b->pre_ffn_norm));
    ATTNKIT_RETURN_IF_ERROR(
        load_norm(w, p + "post_feedforward_layernorm.weight", H, true, &b->post_ffn_norm));
  } else {
    ATTNKIT_RETURN_IF_ERROR(
        load_norm(w, p + "post_attention_layernorm.weight", H, one_plus, &b->pre_ffn_norm));
  }
  for (const char* n : {"input_layernorm", "post_attention_layernorm"})
    used->insert(p + n + ".weight");
  if (gemma)
    for (const char* n : {"pre_feedforward_layernorm", "post_feedforward_layernorm"})
      used->insert(p + n + ".weight");
  m->weight_bytes += bytes_of(b->input_norm) + bytes_of(b->post_attn_norm) +
                     bytes_of(b->pre_ffn_norm) + bytes_of(b->post_ffn_norm);
  return Status::Ok();
}

// Embedding, final norm and LM head.
Status load_ends(const WeightMap& weights, Model::Impl* m, std::set<std::string>* used) {
  const int64_t V = m->spec.vocab_size, H = m->spec.hidden_size;
  io::WeightLoader w(weights, "", kFn);
  ATTNKIT_RETURN_IF_ERROR(
      w.load_matrix("model.embed_tokens.weight", {V, H}, "vocab_size, hidden_size", &m->embed));
  ATTNKIT_RETURN_IF_ERROR(
      load_norm(w, "model.norm.weight", H, one_plus_norms(m->spec), &m->final_norm));
  used->insert("model.embed_tokens.weight");
  used->insert("model.norm.weight");
  if (!m->spec.tie_word_embeddings) {
    ATTNKIT_RETURN_IF_ERROR(
        w.load_matrix("lm_head.weight", {V, H}, "vocab_size, hidden_size", &m->lm_head));
    used->insert("lm_head.weight");
  }
  if (is_gemma(m->spec)) {
    // HF multiplies by sqrt(hidden) as a tensor of the embedding's dtype.
    const float s = static_cast<float>(std::sqrt(static_cast<double>(H)));
    m->embed_scale = m->embed.dtype() == DType::kBF16 ? bf16_to_float(float_to_bf16(s)) : s;
  }
  m->weight_bytes += bytes_of(m->embed) + bytes_of(m->lm_head) + bytes_of(m->final_norm);
  return Status::Ok();
}

// The text model's tensors of a wrapper's checkpoint, under the text
// model's names; `original` maps each renamed tensor back to its name in
// the checkpoint (for messages). Two checkpoint names for one text tensor
// (both naming schemes in one checkpoint) are an error naming both.
Result<WeightMap> wrapper_text_tensors(const WrapperNaming& naming, const model::Checkpoint& ckpt,
                                       std::map<std::string, std::string>* original) {
  WeightMap out;
  for (const auto& tensor : ckpt.tensors) {
    // Named, not a structured binding: clang 14 cannot capture those.
    const std::string& name = tensor.first;
    if (std::any_of(naming.skipped.begin(), naming.skipped.end(),
                    [&](const char* p) { return p != nullptr && name.starts_with(p); }))
      continue;
    std::string text = name;
    for (const auto& [from, to] : naming.renames)
      if (from != nullptr && name.starts_with(from)) {
        text = to + name.substr(std::char_traits<char>::length(from));
        break;
      }
    if (out.count(text) != 0) {
      const auto first = original->find(text);
      return invalid_argument(std::string(kFn) + ": " + ckpt.where + " has tensors \"" +
                              (first != original->end() ? first->second : text) + "\" and \"" +
                              name + "\", which are both the " + naming.wrapper +
                              " text model's \"" + text +
                              "\" (two naming schemes in one checkpoint?)");
    }
    if (text != name) (*original)[text] = name;
    out[text] = tensor.second;
  }
  return out;
}

bool is_ignored_buffer(const std::string& name) {
  for (const std::string& b : io::ignored_buffers())
    if (name == b || (name.size() > b.size() && name.ends_with("." + b))) return true;
  return false;
}

// Embedding, final norm, LM head and every decoder layer, their names
// added to `used`.
Status load_layers(const WeightMap& tensors, Model::Impl* m, std::set<std::string>* used) {
  ATTNKIT_RETURN_IF_ERROR(load_ends(tensors, m, used));
  for (size_t i = 0; i < m->spec.layers.size(); ++i) {
    Block b;
    const std::string where = "layer " + std::to_string(i);
    ATTNKIT_RETURN_IF_ERROR(prefixed(where, load_block_norms(tensors, i, m, &b, used)));
    ATTNKIT_RETURN_IF_ERROR(prefixed(where, load_mixer(tensors, i, m, &b, used)));
    ATTNKIT_RETURN_IF_ERROR(prefixed(where, load_ffn(tensors, i, m, &b, used)));
    m->blocks.push_back(std::move(b));
  }
  return Status::Ok();
}

}  // namespace

std::span<const char* const> supported_model_types() { return kSupported; }

Result<Model> Model::from_pretrained(const std::string& dir, const ModelLoadOptions& options) {
  ATTNKIT_ASSIGN_OR_RETURN(std::string config, model::read_text_file(dir + "/config.json", kFn));
  auto spec = model_spec_from_json(config);
  if (!spec.ok()) return prefixed(dir + "/config.json", spec.status());
  ATTNKIT_RETURN_IF_ERROR(check_supported(*spec));
  ATTNKIT_ASSIGN_OR_RETURN(model::Checkpoint ckpt, model::open_checkpoint(dir, kFn));
  // A wrapper's tensors under the text model's names, and their own names.
  std::map<std::string, std::string> original;
  const WrapperNaming* wrapper = wrapper_naming(spec->wrapper_model_type);
  if (wrapper != nullptr) {
    ATTNKIT_ASSIGN_OR_RETURN(ckpt.tensors, wrapper_text_tensors(*wrapper, ckpt, &original));
  }
  auto m = std::make_unique<Impl>();
  m->spec = std::move(spec).value();
  m->options = options;
  std::set<std::string> used;
  Status st = load_layers(ckpt.tensors, m.get(), &used);
  if (!st.ok() && wrapper != nullptr)
    return Status(st.code(), st.message() + " (a " + wrapper->wrapper +
                                 " checkpoint: its text tensors are read under the " +
                                 m->spec.model_type + " model's names, docs/MODEL.md)");
  ATTNKIT_RETURN_IF_ERROR(st);
  for (const auto& [name, view] : ckpt.tensors)
    if (used.count(name) == 0 && !is_ignored_buffer(name) && !is_skipped_module(m->spec, name)) {
      const auto renamed = original.find(name);
      return invalid_argument(std::string(kFn) + ": " + ckpt.where + " has tensor \"" +
                              (renamed != original.end() ? renamed->second : name) + "\" " +
                              view.describe() + ", which no part of this " + m->spec.model_type +
                              " model reads (a config that disagrees with the checkpoint?)");
    }
  return Model(std::move(m));
}

}  // namespace attnkit
