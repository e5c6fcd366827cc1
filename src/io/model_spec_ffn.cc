// The feed-forward after every layer's token mixer: a dense gate/up/down
// MLP, or a mixture of experts. Which layers carry experts is each family's
// rule (DeepSeek's first_k_dense_replace / moe_layer_freq, Qwen's
// decoder_sparse_step / mlp_only_layers, Llama 4's moe_layers /
// interleave_moe_layer_step); the routing defaults are each config class's
// (docs/MODELS.md).
#include <cmath>
#include <string>
#include <vector>

#include "io/model_spec_reader.h"

namespace attnkit::io {
namespace {

bool is_deepseek(Family f) {
  return f == Family::kDeepseekV2 || f == Family::kDeepseekV3 || f == Family::kDeepseekGeneric;
}
bool is_qwen_moe(Family f) {
  return f == Family::kQwen2Moe || f == Family::kQwen3Moe || f == Family::kQwen3Next;
}

const char* default_act(Family f) {
  switch (f) {
    case Family::kGemma:
    case Family::kGemma2:
    case Family::kGemma3:
      return "gelu_pytorch_tanh";
    case Family::kGpt2:
      return "gelu_new";
    case Family::kBert:
    case Family::kFalcon:
      return "gelu";
    default:
      return "silu";
  }
}

// A list of layer indices (mlp_only_layers, moe_layers).
Status read_index_list(const SpecContext& c, const char* key, std::vector<bool>* marked) {
  marked->assign(static_cast<size_t>(c.num_layers), false);
  const json* list = c.f.get(key);
  if (list == nullptr) return Status::Ok();
  if (!list->is_array())
    return c.f.error(c.f.path(key) + " = " + json_brief(*list) +
                     " must be a list of layer indices");
  for (size_t i = 0; i < list->size(); ++i) {
    const json& v = (*list)[i];
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= c.num_layers)
      return c.f.error(c.f.path(key) + "[" + std::to_string(i) + "] = " + json_brief(v) +
                       " must be a layer index in [0, num_hidden_layers = " +
                       std::to_string(c.num_layers) + ")");
    (*marked)[static_cast<size_t>(v.get<int64_t>())] = true;
  }
  return Status::Ok();
}

Status positive_step(const SpecContext& c, const char* key, int64_t fallback, int64_t* out) {
  *out = fallback;
  ATTNKIT_RETURN_IF_ERROR(c.f.integer(key, out));
  if (*out >= 1) return Status::Ok();
  return c.f.error(c.f.path(key) + " = " + std::to_string(*out) + " must be >= 1");
}

// Which layers carry experts.
Status moe_layers(const SpecContext& c, std::vector<bool>* moe) {
  const int64_t n = c.num_layers;
  moe->assign(static_cast<size_t>(n), false);
  const Family fam = c.family;
  if (fam == Family::kMixtral || fam == Family::kGptOss) {
    moe->assign(static_cast<size_t>(n), true);
    return Status::Ok();
  }
  if (is_deepseek(fam)) {
    // modeling_deepseek_v3.py: experts when n_routed_experts is set, from
    // layer first_k_dense_replace on, on every moe_layer_freq-th layer.
    if (!c.f.has("n_routed_experts")) return Status::Ok();
    int64_t first = fam == Family::kDeepseekV3 ? 3 : 0, freq = 1;
    ATTNKIT_RETURN_IF_ERROR(c.f.integer("first_k_dense_replace", &first));
    if (first < 0)
      return c.f.error(c.f.path("first_k_dense_replace") + " = " + std::to_string(first) +
                       " must be >= 0");
    ATTNKIT_RETURN_IF_ERROR(positive_step(c, "moe_layer_freq", 1, &freq));
    for (int64_t i = first; i < n; ++i) (*moe)[static_cast<size_t>(i)] = i % freq == 0;
    return Status::Ok();
  }
  if (is_qwen_moe(fam)) {
    // modeling_qwen2_moe.py: experts unless the layer is in mlp_only_layers,
    // when num_experts > 0 and (i + 1) % decoder_sparse_step == 0.
    int64_t experts = 0, step = 1;
    ATTNKIT_RETURN_IF_ERROR(c.f.required("num_experts", "the number of routed experts"));
    ATTNKIT_RETURN_IF_ERROR(c.f.integer("num_experts", &experts));
    ATTNKIT_RETURN_IF_ERROR(positive_step(c, "decoder_sparse_step", 1, &step));
    std::vector<bool> mlp_only;
    ATTNKIT_RETURN_IF_ERROR(read_index_list(c, "mlp_only_layers", &mlp_only));
    for (int64_t i = 0; i < n; ++i)
      (*moe)[static_cast<size_t>(i)] =
          experts > 0 && !mlp_only[static_cast<size_t>(i)] && (i + 1) % step == 0;
    return Status::Ok();
  }
  if (fam == Family::kLlama4) {
    // configuration_llama4.py: moe_layers, else every
    // interleave_moe_layer_step-th layer counting from step - 1.
    if (c.f.has("moe_layers")) return read_index_list(c, "moe_layers", moe);
    int64_t step = 1;
    ATTNKIT_RETURN_IF_ERROR(positive_step(c, "interleave_moe_layer_step", 1, &step));
    for (int64_t i = step - 1; i < n; i += step) (*moe)[static_cast<size_t>(i)] = true;
  }
  return Status::Ok();
}

Status required_int(const SpecContext& c, const char* key, const char* why, int64_t* out) {
  ATTNKIT_RETURN_IF_ERROR(c.f.required(key, why));
  return c.f.integer(key, out);
}

Status read_choice(const SpecContext& c, const char* key, MoeScoringFunc* out) {
  std::string s;
  ATTNKIT_RETURN_IF_ERROR(c.f.string(key, &s));
  if (!c.f.has(key)) return Status::Ok();
  if (s == "softmax") {
    *out = MoeScoringFunc::kSoftmax;
  } else if (s == "sigmoid") {
    *out = MoeScoringFunc::kSigmoid;
  } else {
    return c.f.error(c.f.path(key) + " = \"" + s + "\" must be \"softmax\" or \"sigmoid\"");
  }
  return Status::Ok();
}

Status read_choice(const SpecContext& c, const char* key, MoeTopkMethod* out) {
  std::string s;
  ATTNKIT_RETURN_IF_ERROR(c.f.string(key, &s));
  if (!c.f.has(key)) return Status::Ok();
  if (s == "greedy") {
    *out = MoeTopkMethod::kGreedy;
  } else if (s == "group_limited_greedy") {
    *out = MoeTopkMethod::kGroupLimitedGreedy;
  } else if (s == "noaux_tc") {
    *out = MoeTopkMethod::kNoauxTc;
  } else {
    return c.f.error(c.f.path(key) + " = \"" + s +
                     "\" must be \"greedy\", \"group_limited_greedy\" or \"noaux_tc\"");
  }
  return Status::Ok();
}

// The experts' configuration (every MoE layer of a model shares it).
Status read_moe(const SpecContext& c, MoeConfig* m) {
  const Family fam = c.family;
  m->model_type = c.model_type;
  m->hidden_size = c.hidden_size;
  const char* why = "an MoE layer needs its expert count, top-k and expert width";
  const char* count_key = "n_routed_experts";
  const char* width_key = "moe_intermediate_size";
  if (fam == Family::kMixtral || fam == Family::kLlama4) {
    count_key = "num_local_experts";
    width_key = "intermediate_size";
  } else if (fam == Family::kGptOss) {
    count_key = c.f.has("num_experts") ? "num_experts" : "num_local_experts";
    width_key = "intermediate_size";
  } else if (is_qwen_moe(fam)) {
    count_key = "num_experts";
  }
  ATTNKIT_RETURN_IF_ERROR(required_int(c, count_key, why, &m->n_routed_experts));
  // gpt-oss's own config names top-k experts_per_token.
  const char* topk_key = fam == Family::kGptOss && !c.f.has("num_experts_per_tok")
                             ? "experts_per_token"
                             : "num_experts_per_tok";
  ATTNKIT_RETURN_IF_ERROR(required_int(c, topk_key, why, &m->num_experts_per_tok));
  ATTNKIT_RETURN_IF_ERROR(required_int(c, width_key, why, &m->moe_intermediate_size));

  switch (fam) {
    case Family::kMixtral: {
      m->naming = MoeWeightNaming::kMixtral;
      // Mixtral always renormalises; a config that says otherwise describes
      // a model this block would silently misrun.
      bool norm = true;
      ATTNKIT_RETURN_IF_ERROR(c.f.boolean("norm_topk_prob", &norm));
      if (!norm)
        return c.f.error(c.f.path("norm_topk_prob") +
                         " = false: mixtral always renormalises the top-k weights");
      break;
    }
    case Family::kGptOss: {
      // The router keeps the top-k logits and softmaxes them: a softmax over
      // all experts renormalised over the chosen ones.
      m->naming = MoeWeightNaming::kGptOss;
      m->activation = MoeActivation::kGptOssSwiGlu;
      m->router_bias = true;
      m->expert_bias = true;
      m->swiglu_limit = 7.0;
      ATTNKIT_RETURN_IF_ERROR(c.f.number("swiglu_limit", &m->swiglu_limit));
      double alpha = 1.702;
      ATTNKIT_RETURN_IF_ERROR(c.f.number("swiglu_alpha", &alpha));
      if (alpha != 1.702)
        return c.f.error(c.f.path("swiglu_alpha") + " = " + num(alpha) +
                         " is not supported (the expert activation's sigmoid gain is 1.702)");
      break;
    }
    case Family::kLlama4:
      // Llama4TextMoe: sigmoid of the top-k router logits, no renormalising,
      // one shared expert as wide as a routed one.
      m->naming = MoeWeightNaming::kLlama4;
      m->scoring_func = MoeScoringFunc::kSigmoid;
      m->norm_topk_prob = false;
      m->n_shared_experts = 1;
      break;
    case Family::kQwen2Moe:
    case Family::kQwen3Moe:
    case Family::kQwen3Next: {
      m->norm_topk_prob = fam == Family::kQwen3Next;
      ATTNKIT_RETURN_IF_ERROR(c.f.boolean("norm_topk_prob", &m->norm_topk_prob));
      int64_t shared = 0;
      ATTNKIT_RETURN_IF_ERROR(c.f.integer("shared_expert_intermediate_size", &shared));
      if (shared < 0 ||
          (shared > 0 && m->moe_intermediate_size > 0 && shared % m->moe_intermediate_size != 0))
        return c.f.error(c.f.path("shared_expert_intermediate_size") + " = " +
                         std::to_string(shared) + " must be >= 0 and a multiple of " +
                         "moe_intermediate_size = " + std::to_string(m->moe_intermediate_size));
      m->n_shared_experts = m->moe_intermediate_size > 0 ? shared / m->moe_intermediate_size : 0;
      // Qwen2MoeSparseMoeBlock / Qwen3NextSparseMoeBlock: one shared expert
      // under mlp.shared_expert, scaled by sigmoid(shared_expert_gate(x)).
      m->shared_expert_gate = fam != Family::kQwen3Moe && m->n_shared_experts > 0;
      break;
    }
    default: {
      // DeepSeek: DeepseekV2Config / DeepseekV3Config defaults; without
      // model_type neutral ones (softmax, greedy, no renormalising, scale
      // 1, no shared experts).
      const bool v3 = fam == Family::kDeepseekV3;
      m->scoring_func = v3 ? MoeScoringFunc::kSigmoid : MoeScoringFunc::kSoftmax;
      m->topk_method = v3 ? MoeTopkMethod::kNoauxTc : MoeTopkMethod::kGreedy;
      m->norm_topk_prob = v3;
      m->routed_scaling_factor = v3 ? 2.5 : 1.0;
      m->n_shared_experts = v3 ? 1 : fam == Family::kDeepseekV2 ? 2 : 0;
      m->n_group = v3 ? 8 : 1;
      m->topk_group = v3 ? 4 : 1;
      // n_shared_experts = null means none.
      if (c.cfg.contains("n_shared_experts") && !c.f.has("n_shared_experts"))
        m->n_shared_experts = 0;
      ATTNKIT_RETURN_IF_ERROR(c.f.integer("n_shared_experts", &m->n_shared_experts));
      ATTNKIT_RETURN_IF_ERROR(c.f.boolean("norm_topk_prob", &m->norm_topk_prob));
      ATTNKIT_RETURN_IF_ERROR(c.f.number("routed_scaling_factor", &m->routed_scaling_factor));
      ATTNKIT_RETURN_IF_ERROR(c.f.integer("n_group", &m->n_group));
      ATTNKIT_RETURN_IF_ERROR(c.f.integer("topk_group", &m->topk_group));
      ATTNKIT_RETURN_IF_ERROR(read_choice(c, "scoring_func", &m->scoring_func));
      ATTNKIT_RETURN_IF_ERROR(read_choice(c, "topk_method", &m->topk_method));
      break;
    }
  }
  std::string act;
  ATTNKIT_RETURN_IF_ERROR(c.f.string("hidden_act", &act));
  if (c.f.has("hidden_act") && act != "silu")
    return c.f.error(c.f.path("hidden_act") + " = \"" + act +
                     "\" is not supported; the experts are SwiGLU (\"silu\")");
  return renamed(c, validate(*m), "MoeConfig");
}

}  // namespace

Status read_ffns(const SpecContext& c, std::vector<LayerSpec>* layers) {
  const Family fam = c.family;
  std::string act = default_act(fam);
  const char* act_key = fam == Family::kGpt2 ? "activation_function"
                        : fam == Family::kGemma3 && c.f.has("hidden_activation")
                            ? "hidden_activation"
                            : "hidden_act";
  ATTNKIT_RETURN_IF_ERROR(c.f.string(act_key, &act));
  // The dense width; 0 when the config does not give it (the analysis then
  // counts no feed-forward).
  const char* width_key = fam == Family::kLlama4   ? "intermediate_size_mlp"
                          : fam == Family::kGpt2   ? "n_inner"
                          : fam == Family::kFalcon ? "ffn_hidden_size"
                                                   : "intermediate_size";
  int64_t width = 0;
  ATTNKIT_RETURN_IF_ERROR(c.f.integer(width_key, &width));
  if (c.f.has(width_key)) ATTNKIT_RETURN_IF_ERROR(in_range(c, width_key, width, 1));
  std::vector<bool> moe;
  ATTNKIT_RETURN_IF_ERROR(moe_layers(c, &moe));
  MoeConfig experts;
  bool any_moe = false;
  for (bool b : moe) any_moe |= b;
  if (any_moe) ATTNKIT_RETURN_IF_ERROR(read_moe(c, &experts));
  for (size_t i = 0; i < layers->size(); ++i) {
    FeedForwardSpec& ffn = (*layers)[i].ffn;
    ffn.hidden_act = act;
    if (moe[i]) {
      ffn.kind = FeedForwardKind::kMoe;
      ffn.moe = experts;
    } else {
      ffn.kind = FeedForwardKind::kDense;
      ffn.intermediate_size = width;
    }
  }
  return Status::Ok();
}

}  // namespace attnkit::io
