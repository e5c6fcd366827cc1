// MoeConfig: validation and parsing from a Hugging Face config.json
// (mixtral, deepseek_v2, deepseek_v3, kimi_k2).
#include <cmath>
#include <string>

#include <nlohmann/json.hpp>

#include "attnkit/moe.h"

namespace attnkit {
namespace {

constexpr const char* kParse = "moe_config_from_json";
constexpr const char* kValidate = "MoeConfig";

using json = nlohmann::json;

std::string dump(const json& v) {
  std::string s = v.dump();
  return s.size() > 80 ? s.substr(0, 77) + "..." : s;
}

std::string fail(const std::string& what) { return std::string(kParse) + ": " + what; }

// The routing defaults of each family's transformers config class (for a
// field the config.json leaves out) and its weight naming.
struct Family {
  const char* model_type;
  MoeWeightNaming naming;
  const char* expert_count_field;
  const char* inter_field;
  MoeScoringFunc scoring_func;
  MoeTopkMethod topk_method;
  bool norm_topk_prob;
  double routed_scaling_factor;
  int64_t n_shared_experts;
  int64_t n_group;
  int64_t topk_group;
};

constexpr Family kMixtral = {
    .model_type = "mixtral",
    .naming = MoeWeightNaming::kMixtral,
    .expert_count_field = "num_local_experts",
    .inter_field = "intermediate_size",
    .scoring_func = MoeScoringFunc::kSoftmax,
    .topk_method = MoeTopkMethod::kGreedy,
    .norm_topk_prob = true,
    .routed_scaling_factor = 1.0,
    .n_shared_experts = 0,
    .n_group = 1,
    .topk_group = 1,
};
constexpr Family kDeepseekV2 = {
    .model_type = "deepseek_v2",
    .naming = MoeWeightNaming::kDeepseek,
    .expert_count_field = "n_routed_experts",
    .inter_field = "moe_intermediate_size",
    .scoring_func = MoeScoringFunc::kSoftmax,
    .topk_method = MoeTopkMethod::kGreedy,
    .norm_topk_prob = false,
    .routed_scaling_factor = 1.0,
    .n_shared_experts = 2,
    .n_group = 1,
    .topk_group = 1,
};
constexpr Family kDeepseekV3 = {
    .model_type = "deepseek_v3",
    .naming = MoeWeightNaming::kDeepseek,
    .expert_count_field = "n_routed_experts",
    .inter_field = "moe_intermediate_size",
    .scoring_func = MoeScoringFunc::kSigmoid,
    .topk_method = MoeTopkMethod::kNoauxTc,
    .norm_topk_prob = true,
    .routed_scaling_factor = 2.5,
    .n_shared_experts = 1,
    .n_group = 8,
    .topk_group = 4,
};

// nullopt-like: a missing field leaves *out as is.
Status read_int(const json& obj, const char* name, bool required, int64_t* out) {
  const auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) {
    if (!required) return Status::Ok();
    return invalid_argument(fail(std::string("required field ") + name +
                                 (it == obj.end() ? " is missing" : " is null")));
  }
  if (!it->is_number_integer())
    return invalid_argument(fail(std::string(name) + " = " + dump(*it) + " must be an integer"));
  *out = it->get<int64_t>();
  return Status::Ok();
}

Status read_double(const json& obj, const char* name, double* out) {
  const auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) return Status::Ok();
  if (!it->is_number())
    return invalid_argument(fail(std::string(name) + " = " + dump(*it) + " must be a number"));
  *out = it->get<double>();
  return Status::Ok();
}

Status read_bool(const json& obj, const char* name, bool* out) {
  const auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) return Status::Ok();
  if (!it->is_boolean())
    return invalid_argument(fail(std::string(name) + " = " + dump(*it) + " must be true or false"));
  *out = it->get<bool>();
  return Status::Ok();
}

// Returns false (and leaves *out) when the field is absent or null.
Status read_string(const json& obj, const char* name, std::string* out, bool* present) {
  *present = false;
  const auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) return Status::Ok();
  if (!it->is_string())
    return invalid_argument(fail(std::string(name) + " = " + dump(*it) + " must be a string"));
  *out = it->get<std::string>();
  *present = true;
  return Status::Ok();
}

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
  if (c.naming != MoeWeightNaming::kDeepseek && c.naming != MoeWeightNaming::kMixtral)
    return invalid_argument(f + "naming = " + std::to_string(int(c.naming)) +
                            " is not a MoeWeightNaming value");
  if (c.naming == MoeWeightNaming::kMixtral && c.n_shared_experts != 0)
    return invalid_argument(f + "n_shared_experts = " + std::to_string(c.n_shared_experts) +
                            " must be 0 with Mixtral weight names (they have no shared experts)");
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
  json j = json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return invalid_argument(fail("the text is not valid JSON"));
  if (!j.is_object()) return invalid_argument(fail("the JSON must be an object, got " + dump(j)));

  std::string model_type;
  bool has_model_type = false;
  ATTNKIT_RETURN_IF_ERROR(read_string(j, "model_type", &model_type, &has_model_type));
  const Family* fam = nullptr;
  if (has_model_type) {
    if (model_type == "mixtral")
      fam = &kMixtral;
    else if (model_type == "deepseek_v2")
      fam = &kDeepseekV2;
    else if (model_type == "deepseek_v3" || model_type == "kimi_k2")
      fam = &kDeepseekV3;
    else
      return invalid_argument(fail("model_type = \"" + model_type +
                                   "\" is not an MoE family attnkit reads (mixtral, deepseek_v2, "
                                   "deepseek_v3, kimi_k2)"));
  } else {
    const bool mixtral = j.contains("num_local_experts");
    const bool deepseek = j.contains("n_routed_experts");
    if (mixtral == deepseek)
      return invalid_argument(
          fail(mixtral ? "without model_type, num_local_experts and n_routed_experts are both set; "
                         "give model_type"
                       : "no expert count: need num_local_experts (Mixtral) or n_routed_experts "
                         "(DeepSeek), or a model_type"));
    // Without a model_type a DeepSeek-named config gets the neutral
    // defaults (softmax, greedy, no renormalisation, scale 1, no shared).
    static constexpr Family kGeneric = {
        .model_type = "",
        .naming = MoeWeightNaming::kDeepseek,
        .expert_count_field = "n_routed_experts",
        .inter_field = "moe_intermediate_size",
        .scoring_func = MoeScoringFunc::kSoftmax,
        .topk_method = MoeTopkMethod::kGreedy,
        .norm_topk_prob = false,
        .routed_scaling_factor = 1.0,
        .n_shared_experts = 0,
        .n_group = 1,
        .topk_group = 1,
    };
    fam = mixtral ? &kMixtral : &kGeneric;
  }

  MoeConfig c;
  c.model_type = model_type;
  c.naming = fam->naming;
  c.scoring_func = fam->scoring_func;
  c.topk_method = fam->topk_method;
  c.norm_topk_prob = fam->norm_topk_prob;
  c.routed_scaling_factor = fam->routed_scaling_factor;
  c.n_shared_experts = fam->n_shared_experts;
  c.n_group = fam->n_group;
  c.topk_group = fam->topk_group;

  ATTNKIT_RETURN_IF_ERROR(read_int(j, "hidden_size", true, &c.hidden_size));
  ATTNKIT_RETURN_IF_ERROR(read_int(j, fam->expert_count_field, true, &c.n_routed_experts));
  {
    const auto it = j.find("num_experts_per_tok");
    if (it == j.end() || it->is_null())
      return invalid_argument(fail("num_experts_per_tok is " +
                                   std::string(it == j.end() ? "missing" : "null") +
                                   ": a dense model, not an MoE layer"));
  }
  ATTNKIT_RETURN_IF_ERROR(read_int(j, "num_experts_per_tok", true, &c.num_experts_per_tok));
  ATTNKIT_RETURN_IF_ERROR(read_int(j, fam->inter_field, true, &c.moe_intermediate_size));

  if (fam->naming == MoeWeightNaming::kMixtral) {
    // Mixtral always renormalises and has no routing knobs; a config that
    // says otherwise describes a model this block would silently misrun.
    bool norm = true;
    ATTNKIT_RETURN_IF_ERROR(read_bool(j, "norm_topk_prob", &norm));
    if (!norm)
      return invalid_argument(
          fail("norm_topk_prob = false: mixtral always renormalises the "
               "top-k weights"));
  } else {
    // HF: n_shared_experts = null means none.
    const auto it = j.find("n_shared_experts");
    if (it != j.end() && it->is_null()) c.n_shared_experts = 0;
    ATTNKIT_RETURN_IF_ERROR(read_int(j, "n_shared_experts", false, &c.n_shared_experts));
    ATTNKIT_RETURN_IF_ERROR(read_bool(j, "norm_topk_prob", &c.norm_topk_prob));
    ATTNKIT_RETURN_IF_ERROR(read_double(j, "routed_scaling_factor", &c.routed_scaling_factor));
    ATTNKIT_RETURN_IF_ERROR(read_int(j, "n_group", false, &c.n_group));
    ATTNKIT_RETURN_IF_ERROR(read_int(j, "topk_group", false, &c.topk_group));
    std::string s;
    bool present = false;
    ATTNKIT_RETURN_IF_ERROR(read_string(j, "scoring_func", &s, &present));
    if (present) {
      if (s == "softmax")
        c.scoring_func = MoeScoringFunc::kSoftmax;
      else if (s == "sigmoid")
        c.scoring_func = MoeScoringFunc::kSigmoid;
      else
        return invalid_argument(
            fail("scoring_func = \"" + s + "\" must be \"softmax\" or \"sigmoid\""));
    }
    ATTNKIT_RETURN_IF_ERROR(read_string(j, "topk_method", &s, &present));
    if (present) {
      if (s == "greedy")
        c.topk_method = MoeTopkMethod::kGreedy;
      else if (s == "group_limited_greedy")
        c.topk_method = MoeTopkMethod::kGroupLimitedGreedy;
      else if (s == "noaux_tc")
        c.topk_method = MoeTopkMethod::kNoauxTc;
      else
        return invalid_argument(fail("topk_method = \"" + s +
                                     "\" must be \"greedy\", \"group_limited_greedy\" or "
                                     "\"noaux_tc\""));
    }
  }
  {
    std::string act;
    bool present = false;
    ATTNKIT_RETURN_IF_ERROR(read_string(j, "hidden_act", &act, &present));
    if (present && act != "silu")
      return invalid_argument(
          fail("hidden_act = \"" + act + "\" is not supported; the experts are SwiGLU (\"silu\")"));
  }
  const Status st = validate(c);
  if (!st.ok())  // Same rule, reported under the parser's name.
    return Status(st.code(),
                  std::string(kParse) + st.message().substr(std::string(kValidate).size()));
  return c;
}

}  // namespace attnkit
