// MoeConfig: validation and moe_config_from_json, the first MoE layer of the
// ModelSpec that model_spec_from_json reads (model_spec_ffn.cc).
#include <cmath>
#include <string>

#include "attnkit/config.h"
#include "attnkit/model_spec.h"
#include "io/model_spec_reader.h"

namespace attnkit {
namespace {

constexpr const char* kParse = "moe_config_from_json";
constexpr const char* kValidate = "MoeConfig";

}  // namespace

const char* moe_scoring_func_name(MoeScoringFunc f) {
  switch (f) {
    case MoeScoringFunc::kSoftmax:
      return "softmax";
    case MoeScoringFunc::kSigmoid:
      return "sigmoid";
  }
  return "unknown";
}

const char* moe_topk_method_name(MoeTopkMethod m) {
  switch (m) {
    case MoeTopkMethod::kGreedy:
      return "greedy";
    case MoeTopkMethod::kGroupLimitedGreedy:
      return "group_limited_greedy";
    case MoeTopkMethod::kNoauxTc:
      return "noaux_tc";
  }
  return "unknown";
}

Status validate(const MoeConfig& c) {
  const std::string f = std::string(kValidate) + ": ";
  auto positive = [&](const char* name, int64_t v) -> Status {
    if (v > 0) return Status::Ok();
    return invalid_argument(f + name + " = " + std::to_string(v) + " must be > 0");
  };
  ATTNKIT_RETURN_IF_ERROR(positive("hidden_size", c.hidden_size));
  ATTNKIT_RETURN_IF_ERROR(positive("n_routed_experts", c.n_routed_experts));
  ATTNKIT_RETURN_IF_ERROR(positive("moe_intermediate_size", c.moe_intermediate_size));
  ATTNKIT_RETURN_IF_ERROR(positive("n_group", c.n_group));
  const std::string E = std::to_string(c.n_routed_experts);
  if (c.n_routed_experts > INT32_MAX)
    return invalid_argument(f + "n_routed_experts = " + E + " must be <= 2^31 - 1");
  if (c.num_experts_per_tok < 1 || c.num_experts_per_tok > c.n_routed_experts)
    return invalid_argument(f + "num_experts_per_tok = " + std::to_string(c.num_experts_per_tok) +
                            " must be in [1, n_routed_experts = " + E + "]");
  if (c.n_shared_experts < 0)
    return invalid_argument(f + "n_shared_experts = " + std::to_string(c.n_shared_experts) +
                            " must be >= 0 (0 = no shared experts)");
  if (c.n_shared_experts > 0 && c.moe_intermediate_size > INT64_MAX / c.n_shared_experts)
    return invalid_argument(f + "moe_intermediate_size * n_shared_experts overflows");
  if (c.n_routed_experts % c.n_group != 0)
    return invalid_argument(f + "n_group = " + std::to_string(c.n_group) +
                            " must divide n_routed_experts = " + E);
  if (c.topk_group < 1 || c.topk_group > c.n_group)
    return invalid_argument(f + "topk_group = " + std::to_string(c.topk_group) +
                            " must be in [1, n_group = " + std::to_string(c.n_group) + "]");
  if (!std::isfinite(c.routed_scaling_factor) || c.routed_scaling_factor <= 0.0)
    return invalid_argument(f + "routed_scaling_factor = " +
                            std::to_string(c.routed_scaling_factor) + " must be finite and > 0");
  if (c.scoring_func != MoeScoringFunc::kSoftmax && c.scoring_func != MoeScoringFunc::kSigmoid)
    return invalid_argument(f + "scoring_func = " + std::to_string(int(c.scoring_func)) +
                            " is not a MoeScoringFunc value");
  if (c.naming != MoeWeightNaming::kDeepseek && c.naming != MoeWeightNaming::kMixtral &&
      c.naming != MoeWeightNaming::kGptOss && c.naming != MoeWeightNaming::kLlama4)
    return invalid_argument(f + "naming = " + std::to_string(int(c.naming)) +
                            " is not a MoeWeightNaming value");
  if (c.activation != MoeActivation::kSwiGlu && c.activation != MoeActivation::kGptOssSwiGlu)
    return invalid_argument(f + "activation = " + std::to_string(int(c.activation)) +
                            " is not a MoeActivation value");
  if (c.activation == MoeActivation::kGptOssSwiGlu &&
      (!std::isfinite(c.swiglu_limit) || c.swiglu_limit <= 0.0))
    return invalid_argument(f + "swiglu_limit = " + std::to_string(c.swiglu_limit) +
                            " must be finite and > 0 for the gpt-oss activation");
  if (c.naming == MoeWeightNaming::kMixtral && c.n_shared_experts != 0)
    return invalid_argument(f + "n_shared_experts = " + std::to_string(c.n_shared_experts) +
                            " must be 0 with Mixtral weight names (they have no shared experts)");
  if (c.shared_expert_gate && (c.naming != MoeWeightNaming::kDeepseek || c.n_shared_experts < 1))
    return invalid_argument(f + "shared_expert_gate = true needs DeepSeek-style weight names " +
                            "(MoeWeightNaming::kDeepseek, as Qwen2-MoE / Qwen3-Next use) and " +
                            "n_shared_experts >= 1; naming = " + std::to_string(int(c.naming)) +
                            ", n_shared_experts = " + std::to_string(c.n_shared_experts));
  switch (c.topk_method) {
    case MoeTopkMethod::kGreedy:
      break;
    case MoeTopkMethod::kGroupLimitedGreedy:
    case MoeTopkMethod::kNoauxTc: {
      const int64_t per_group = c.n_routed_experts / c.n_group;
      const char* m = moe_topk_method_name(c.topk_method);
      if (c.topk_group * per_group < c.num_experts_per_tok)
        return invalid_argument(
            f + "topk_method " + m + ": topk_group = " + std::to_string(c.topk_group) +
            " groups of n_routed_experts / n_group = " + std::to_string(per_group) +
            " experts hold fewer than num_experts_per_tok = " +
            std::to_string(c.num_experts_per_tok) + " candidates");
      // A group's score is the sum of its two best experts; it is only
      // needed when some groups are dropped.
      if (c.topk_method == MoeTopkMethod::kNoauxTc && c.topk_group < c.n_group && per_group < 2)
        return invalid_argument(f +
                                "topk_method noaux_tc scores a group by its two best experts: "
                                "n_routed_experts / n_group = " +
                                std::to_string(per_group) +
                                " must be >= 2 when topk_group = " + std::to_string(c.topk_group) +
                                " < n_group = " + std::to_string(c.n_group));
      break;
    }
    default:
      return invalid_argument(f + "topk_method = " + std::to_string(int(c.topk_method)) +
                              " is not a MoeTopkMethod value");
  }
  return Status::Ok();
}

Result<MoeConfig> moe_config_from_json(std::string_view json_text) {
  io::SpecRequest request;
  request.fn = kParse;
  request.mixers = false;
  // Without num_hidden_layers: enough layers to reach the first MoE layer of
  // any family rule (DeepSeek-V3's first three layers are dense).
  request.layers_if_absent = 256;
  ModelSpec spec;
  ATTNKIT_RETURN_IF_ERROR(io::read_model_spec(json_text, request, &spec));
  const std::string fn = kParse;
  for (const LayerSpec& layer : spec.layers) {
    if (layer.ffn.kind != FeedForwardKind::kMoe) continue;
    const MoeConfig& c = layer.ffn.moe;
    return c;
  }
  if (spec.model_type.empty())
    return invalid_argument(fn +
                            ": no expert count: need num_local_experts (Mixtral) or "
                            "n_routed_experts (DeepSeek), or a model_type");
  return invalid_argument(fn + ": model_type = \"" + spec.model_type +
                          "\" has no MoE layer (num_experts_per_tok and the expert count are "
                          "not set, or every layer is dense)");
}

}  // namespace attnkit
