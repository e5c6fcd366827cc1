// serve::synthetic_spec_from_json: the fixture's layers from a Hugging Face
// config.json, each of its own kind.
#include <string>

#include "attnkit/config.h"
#include "attnkit/model_spec.h"
#include "attnkit/serve.h"

namespace attnkit::serve {

Result<ModelSpec> synthetic_spec_from_json(const std::string& config_json, int64_t layers) {
  const std::string fn = "synthetic_spec_from_json: ";
  ATTNKIT_ASSIGN_OR_RETURN(const attnkit::ModelSpec model, model_spec_from_json(config_json));
  if (layers < 1 || layers > model.num_layers)
    return invalid_argument(fn + "layers = " + std::to_string(layers) + " must be in [1, " +
                            std::to_string(model.num_layers) + "] (the config's layers)");
  ModelSpec spec;
  spec.layers = layers;
  bool latent = false, other = false;
  for (int64_t l = 0; l < layers; ++l)
    (model.layers[static_cast<size_t>(l)].kind == LayerKind::kLatentAttention ? latent : other) =
        true;
  if (latent && other)
    return invalid_argument(fn + "the first " + std::to_string(layers) +
                            " layers mix MLA with other kinds (one pool holds one layout)");
  if (latent) {
    ATTNKIT_ASSIGN_OR_RETURN(spec.latent, mla_config_from_json(config_json));
    spec.mla = true;
    return spec;
  }
  for (int64_t l = 0; l < layers; ++l) {
    const LayerSpec& ls = model.layers[static_cast<size_t>(l)];
    StackLayer s;
    s.kind = ls.kind;
    if (ls.kind == LayerKind::kLinearAttention) {
      s.linear = ls.linear;
    } else {
      ATTNKIT_ASSIGN_OR_RETURN(s.attention, attention_config_from_json(config_json, l));
      if (!s.attention.causal)
        return invalid_argument(fn + "layer " + std::to_string(l) +
                                " is not causal; serving needs a causal decoder");
    }
    spec.stack.push_back(s);
  }
  return spec;
}

}  // namespace attnkit::serve
