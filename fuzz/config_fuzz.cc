// libFuzzer target: the Hugging Face config.json parsers on arbitrary text.
// A parser must either return an error with a message or a config that its
// own validate() accepts; anything else (crash, sanitizer report, escaped
// exception, accepted-but-invalid config) aborts the run.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "attnkit/analysis.h"
#include "attnkit/config.h"
#include "attnkit/latent_attention.h"
#include "attnkit/model_spec.h"
#include "attnkit/moe.h"

namespace {

[[noreturn]] void fail(const char* parser, const char* what, const std::string& message) {
  std::fprintf(stderr, "config_fuzz: %s: %s: %s\n", parser, what, message.c_str());
  std::abort();
}

template <typename T>
void check_error(const char* parser, const attnkit::Result<T>& r) {
  if (!r.ok() && r.status().message().empty()) fail(parser, "error without a message", "");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);

  // Layer indices that pick different per-layer settings, and a negative one.
  for (int64_t layer : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{-1}}) {
    attnkit::Result<attnkit::AttentionConfig> c = attnkit::attention_config_from_json(text, layer);
    check_error("attention_config_from_json", c);
    if (c.ok()) {
      const attnkit::Status v = attnkit::validate(*c);
      if (!v.ok())
        fail("attention_config_from_json", "accepted a config validate() rejects", v.message());
    }
  }

  attnkit::Result<attnkit::MlaConfig> mla = attnkit::mla_config_from_json(text);
  check_error("mla_config_from_json", mla);
  if (mla.ok()) {
    const attnkit::Status v = attnkit::validate(*mla);
    if (!v.ok()) fail("mla_config_from_json", "accepted a config validate() rejects", v.message());
  }

  attnkit::Result<attnkit::MoeConfig> moe = attnkit::moe_config_from_json(text);
  check_error("moe_config_from_json", moe);
  if (moe.ok()) {
    const attnkit::Status v = attnkit::validate(*moe);
    if (!v.ok()) fail("moe_config_from_json", "accepted a config validate() rejects", v.message());
  }

  check_error("model_shape_from_json", attnkit::model_shape_from_json(text));

  // The one reader: every layer it describes is valid for its kind.
  attnkit::Result<attnkit::ModelSpec> spec = attnkit::model_spec_from_json(text);
  check_error("model_spec_from_json", spec);
  if (spec.ok()) {
    if (static_cast<int64_t>(spec->layers.size()) != spec->num_layers)
      fail("model_spec_from_json", "layer count differs from num_layers", "");
    for (const attnkit::LayerSpec& l : spec->layers) {
      attnkit::Status v = attnkit::Status::Ok();
      if (l.kind == attnkit::LayerKind::kAttention) v = attnkit::validate(l.attention);
      if (l.kind == attnkit::LayerKind::kLatentAttention) v = attnkit::validate(l.mla);
      if (v.ok() && l.ffn.kind == attnkit::FeedForwardKind::kMoe) v = attnkit::validate(l.ffn.moe);
      if (!v.ok())
        fail("model_spec_from_json", "described a layer validate() rejects", v.message());
    }
  }
  return 0;
}
