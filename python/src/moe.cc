// Bindings for the MoE feed-forward: class MoE (from a config.json string;
// attnkit.moe_from_config in attnkit/moe.py takes a dict). forward() runs
// without the GIL; failures raise with the C++ Status message.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <pybind11/stl.h>

#include "attnkit/moe.h"
#include "bindings.h"
#include "numpy_util.h"

namespace attnkit::python {
namespace {

const char* naming_name(MoeWeightNaming n) {
  switch (n) {
    case MoeWeightNaming::kMixtral:
      return "mixtral";
    case MoeWeightNaming::kGptOss:
      return "gpt_oss";
    case MoeWeightNaming::kLlama4:
      return "llama4";
    case MoeWeightNaming::kDeepseek:
      break;
  }
  return "deepseek";
}

py::dict config_dict(const MoeConfig& c) {
  py::dict d;
  d["model_type"] = c.model_type;
  d["naming"] = naming_name(c.naming);
  d["hidden_size"] = c.hidden_size;
  d["n_routed_experts"] = c.n_routed_experts;
  d["num_experts_per_tok"] = c.num_experts_per_tok;
  d["moe_intermediate_size"] = c.moe_intermediate_size;
  d["n_shared_experts"] = c.n_shared_experts;
  d["norm_topk_prob"] = c.norm_topk_prob;
  d["routed_scaling_factor"] = c.routed_scaling_factor;
  d["scoring_func"] = moe_scoring_func_name(c.scoring_func);
  d["topk_method"] = moe_topk_method_name(c.topk_method);
  d["n_group"] = c.n_group;
  d["topk_group"] = c.topk_group;
  d["activation"] = c.activation == MoeActivation::kGptOssSwiGlu ? "gpt_oss_swiglu" : "swiglu";
  d["swiglu_limit"] = c.swiglu_limit;
  d["router_bias"] = c.router_bias;
  d["expert_bias"] = c.expert_bias;
  return d;
}

py::dict routing_dict(const MoeRouting& r, int64_t batch, int64_t seq) {
  TensorView ids, w, counts;
  py::array ids_a = new_array(DType::kI32, {batch, seq, r.top_k}, &ids);
  py::array w_a = new_array(DType::kF32, {batch, seq, r.top_k}, &w);
  py::array counts_a =
      new_array(DType::kI64, {static_cast<int64_t>(r.tokens_per_expert.size())}, &counts);
  std::copy(r.expert_ids.begin(), r.expert_ids.end(), ids.ptr<int32_t>());
  std::copy(r.weights.begin(), r.weights.end(), w.ptr<float>());
  std::copy(r.tokens_per_expert.begin(), r.tokens_per_expert.end(), counts.ptr<int64_t>());
  py::dict d;
  d["expert_ids"] = ids_a;
  d["weights"] = w_a;
  d["tokens_per_expert"] = counts_a;
  return d;
}

py::object forward_py(const MoeLayer& layer, py::handle x, bool return_routing, int num_threads,
                      const std::string& backend) {
  constexpr const char* kFn = "MoE.forward";
  const InputArray xi = f32_input(x, {kFn, "x", 3, 3, "[batch, seq, hidden_size]"});
  const RunOptions run = parse_run_options(backend, num_threads, kFn);
  const TensorView& xv = xi.view;
  TensorView out;
  py::array out_a = new_array(DType::kF32, {xv.shape[0], xv.shape[1], xv.shape[2]}, &out);
  MoeRouting routing;
  Status st;
  {
    py::gil_scoped_release release;
    st = layer.forward(xv, out, return_routing ? &routing : nullptr, run);
  }
  throw_if_error(st);
  if (!return_routing) return out_a;
  return py::make_tuple(out_a, routing_dict(routing, xv.shape[0], xv.shape[1]));
}

}  // namespace

void bind_moe(py::module_& m) {
  py::class_<MoeLayer>(m, "MoE", R"doc(
Mixture-of-experts feed-forward (Mixtral, DeepSeek-V2, DeepSeek-V3 / Kimi-K2,
Qwen3-MoE, gpt-oss).

Build it with attnkit.moe_from_config(dict) or MoE.from_config_json(text),
load weights with Hugging Face names, then call forward(x). Routing: softmax
or sigmoid scores, optional group limit, top-k (ties: lower expert id),
optional renormalisation, routed_scaling_factor; SwiGLU experts (gpt-oss:
clamped, with biases; its fused gate_up_proj / down_proj are repacked at
load); shared experts added. Only the chosen experts run. See docs/MOE.md
and docs/LAYERS.md.
)doc")
      .def_static(
          "from_config_json",
          [](const std::string& text) {
            auto config = value_or_throw(moe_config_from_json(text));
            return std::make_unique<MoeLayer>(value_or_throw(MoeLayer::create(config)));
          },
          py::arg("text"), "A layer for the MoE fields of a Hugging Face config.json string.")
      .def_property_readonly(
          "config", [](const MoeLayer& l) { return config_dict(l.config()); },
          "The parsed config, with Hugging Face field names.")
      .def("weight_names", &MoeLayer::weight_names,
           "Names load_weights reads, relative to its prefix.")
      .def(
          "load_weights",
          [](MoeLayer& l, py::handle weights, const std::string& prefix) {
            std::vector<InputArray> keep;
            const WeightMap map = weights_from_dict(weights, "MoE.load_weights", prefix, &keep);
            throw_if_error(l.load_weights(map, prefix));
          },
          py::arg("weights"), py::arg("prefix") = "",
          "Copies prefix + name for every name in weight_names() from a dict of arrays. "
          "Strict: a missing or misshapen weight, or an unexpected name under the block, "
          "raises and leaves the layer unchanged.")
      .def_property_readonly("loaded", &MoeLayer::loaded)
      .def(
          "weight",
          [](const MoeLayer& l, const std::string& name) {
            return copy_to_numpy(value_or_throw(l.weight(name)));
          },
          py::arg("name"), "A copy of one loaded weight, by a name from weight_names().")
      .def("forward", &forward_py, py::arg("x"), py::arg("return_routing") = false,
           py::arg("num_threads") = 0, py::arg("backend") = "auto",
           "x [batch, seq, hidden_size] -> out (float32). With return_routing, returns "
           "(out, routing), routing = {'expert_ids': int32 [batch, seq, k] best first, "
           "'weights': float32 [batch, seq, k], 'tokens_per_expert': int64 [n_routed_experts]}.")
      .def("__call__", &forward_py, py::arg("x"), py::arg("return_routing") = false,
           py::arg("num_threads") = 0, py::arg("backend") = "auto");
}

}  // namespace attnkit::python
