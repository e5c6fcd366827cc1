// Hugging Face config.json -> ModelShape: the ModelSpec that
// model_spec_from_json reads (src/io/model_spec.cc holds every family's
// rules, gpt2's n_embd, falcon's multi_query and DeepSeek's MLA fields
// included), seen by the analysis (model_shape_from_spec: the model's
// attention sizes and each layer's kind, window, chunk and state).
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
  return model_shape_from_spec(spec);
}

}  // namespace attnkit
