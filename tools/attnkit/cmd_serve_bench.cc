// attnkit serve-bench: the seeds' claim — GQA, MQA and MLA shrink the KV
// cache, so a server fits more sequences and produces more tokens per
// second — measured: a stream of requests served by a continuous-batching
// scheduler over a paged KV pool of a fixed size (attnkit/serve.h), per
// attention variant, KV dtype, cache mode and memory budget, reported as
// vLLM's benchmark scripts report it (throughput, time to first token,
// time per output token, percentiles) plus the concurrency the budget
// allowed and the KV memory used and reserved.
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <thread>

#include "attnkit/analysis.h"
#include "attnkit/config.h"
#include "attnkit/machine.h"
#include "attnkit/model.h"
#include "attnkit/model_spec.h"
#include "attnkit/serve.h"
#include "attnkit/weights.h"
#include "cli.h"
#include "commands.h"
#include "measure.h"

namespace attnkit::cli {
namespace {

using ojson = nlohmann::ordered_json;

struct Options {
  std::string model, config, model_dir, trace, rate = "inf", prompt = "32-256", output = "16-128";
  std::string weights = "bf16", backend = "auto";
  std::vector<std::string> variants, kv_dtypes = {"bf16"}, caches = {"paged"}, memory;
  std::vector<std::string> prefix_cache = {"off"};
  int64_t layers = 2, requests = 32, page_size = 16, max_tokens = 512, max_seqs = 256;
  int64_t shared_prefix = 0, prefix_groups = 1, turns = 1;
  int64_t max_seq_len = 0, threads = 0, seed = 1, repeats = 1;
  bool mlp = false, json = false, csv = false;
};

// The model to serve: its shape, and the config.json text its layers
// come from (empty for the default shape).
struct Source {
  ModelShape shape;
  std::string json;
  std::string label;
};

std::string file_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// With neither --model, --config nor --model-dir: compare's layer (d_model
// 2048, 32 query heads of 64, MHA, RoPE).
Source load_source(const Options& o) {
  Source s;
  if (!o.model_dir.empty()) {
    std::error_code ec;
    if (!std::filesystem::is_directory(o.model_dir, ec))
      throw UsageError{"--model-dir '" + o.model_dir + "' is not a directory"};
    const std::string config = (std::filesystem::path(o.model_dir) / "config.json").string();
    s.shape = load_model("", config);  // a usage error when it is not there
    s.label = o.model_dir;
    s.json = file_text(config);
    return s;
  }
  if (o.model.empty() && o.config.empty()) {
    s.shape.name = "d_model 2048 (compare's layer)";
    s.shape.hidden_size = 2048;
    s.shape.num_heads = s.shape.num_kv_heads = 32;
    s.shape.head_dim = s.shape.head_dim_v = 64;
    s.shape.num_layers = 1;
    s.label = s.shape.name;
    return s;
  }
  s.shape = load_model(o.model, o.config);
  s.label = s.shape.name;
  if (!o.model.empty()) {
    s.json = value_or_throw(preset_config_json(o.model), "preset");
  } else {
    s.json = file_text(o.config);
  }
  return s;
}

// The engine serves the model's first --layers layers, each of its own
// kind (attnkit/serve.h): softmax attention of any window, chunk, sinks,
// gate, RoPE or NoPE, and Gated DeltaNet with its state slots. A stack it
// cannot run as configured is refused, naming what it cannot run, never
// replaced by something else.
void check_servable(const Source& src, int64_t layers) {
  if (src.json.empty()) return;
  const ModelShape stack = first_layers(src.shape, layers);
  const std::vector<LayerGroup> groups = layer_groups(stack);
  const std::string mix = layer_mix(stack);
  const std::string where = src.label + "'s first " +
                            (layers == 1 ? "layer" : std::to_string(layers) + " layers") + " (" +
                            mix.substr(mix.find(": ") + 2) + ")";
  bool attention = false;
  for (const LayerGroup& g : groups) {
    if (g.shape.kind == MixerKind::kAttention) attention = true;
    if (g.shape.kind != MixerKind::kAttention && g.shape.kind != MixerKind::kGatedDeltaNet &&
        groups.size() > 1)
      throw UsageError{where +
                       " mix MLA with other layer kinds, which the serving engine "
                       "does not run (one pool holds one layout)"};
  }
  if (!attention && !stack.mla)
    throw UsageError{where +
                     " hold no softmax-attention layer; the serving engine's pool takes its shape "
                     "from one: give more --layers"};
}

// The served layers of a config: the first `layers` of its ModelSpec, each
// with its own attention config or Gated DeltaNet config.
std::vector<serve::StackLayer> stack_of(const Source& src, int64_t layers) {
  const auto spec = model_spec_from_json(src.json);
  if (!spec.ok()) throw UsageError{src.label + ": " + spec.status().message()};
  if (layers > spec->num_layers)
    throw UsageError{"--layers " + std::to_string(layers) + ": " + src.label + " has " +
                     std::to_string(spec->num_layers) + " layers"};
  std::vector<serve::StackLayer> out;
  for (int64_t l = 0; l < layers; ++l) {
    const LayerSpec& ls = spec->layers[static_cast<size_t>(l)];
    serve::StackLayer s;
    s.kind = ls.kind;
    if (ls.kind == LayerKind::kLinearAttention) {
      s.linear = ls.linear;
    } else {
      auto c = attention_config_from_json(src.json, l);
      if (!c.ok()) throw UsageError{src.label + ": " + c.status().message()};
      if (!c->causal) throw UsageError{src.label + ": serving needs a causal decoder"};
      s.attention = *c;
    }
    out.push_back(s);
  }
  return out;
}

// Whether every served layer is softmax attention of one config (then the
// engine's single-config path, and its variants, serve it).
bool uniform(const std::vector<serve::StackLayer>& stack) {
  for (const serve::StackLayer& s : stack) {
    if (s.kind != LayerKind::kAttention) return false;
    const AttentionConfig &a = s.attention, &b = stack[0].attention;
    if (a.sliding_window != b.sliding_window || a.chunk_size != b.chunk_size ||
        a.use_rope != b.use_rope || a.rope.theta != b.rope.theta || a.sinks != b.sinks ||
        a.output_gate != b.output_gate || a.temperature_tuning != b.temperature_tuning ||
        a.qk_norm != b.qk_norm)
      return false;
  }
  return true;
}

// The same-shape stack with every layer full attention: every layer gets
// the stack's first full-attention layer (no window, no chunk), or the
// first attention layer with its window or chunk taken off.
std::vector<serve::StackLayer> all_full(std::vector<serve::StackLayer> stack) {
  const serve::StackLayer* full = nullptr;
  for (const serve::StackLayer& s : stack)
    if (s.kind == LayerKind::kAttention && full == nullptr && s.attention.sliding_window == 0 &&
        s.attention.chunk_size == 0)
      full = &s;
  for (const serve::StackLayer& s : stack)
    if (s.kind == LayerKind::kAttention && full == nullptr) full = &s;
  serve::StackLayer f = *full;
  f.attention.sliding_window = f.attention.chunk_size = 0;
  std::fill(stack.begin(), stack.end(), f);
  return stack;
}

// The configured attention of layer 0 (the default layer without a config).
AttentionConfig base_attention(const Source& src) {
  if (src.json.empty()) {
    AttentionConfig c =
        value_or_throw(attention_config_from_variant("mha", 2048, 32, false), "default layer");
    c.causal = true;
    c.use_rope = true;
    c.rope.head_dim = 64;
    return c;
  }
  auto c = attention_config_from_json(src.json, 0);
  if (!c.ok()) throw UsageError{src.label + ": " + c.status().message()};
  if (!c->causal) throw UsageError{src.label + ": serving needs a causal decoder"};
  return *c;
}

std::string label_of(const AttentionConfig& c) {
  if (c.num_kv_heads == c.num_heads) return "mha";
  if (c.num_kv_heads == 1) return "mqa";
  return "gqa-" + std::to_string(c.num_kv_heads);
}

struct Variant {
  std::string name;
  serve::ModelSpec spec;
  ojson indexer = nullptr;  // mla-dsa: the lightning indexer's sizes and their source
};

// mla-dsa of an MLA config: DeepSeek-V3.2's sparse attention with the
// config's indexer, or V3.2's own (64 heads of 128, top-2048, ue8m0
// scales) when the config has none; the indexer query reads MLA's
// compressed query, so q_lora_rank is required.
Variant dsa_variant(serve::ModelSpec spec, const std::string& label) {
  MlaConfig& c = spec.latent;
  const bool configured = c.sparse();
  if (!configured) {
    c.index_n_heads = 64;
    c.index_head_dim = 128;
    c.index_topk = 2048;
    c.index_scale_ue8m0 = true;
  }
  if (c.q_lora_rank < 1)
    throw UsageError{"--variants: mla-dsa: " + label +
                     " has no q_lora_rank; DeepSeek's lightning indexer projects its query from "
                     "MLA's compressed query"};
  const int64_t key = c.index_head_dim + 4 * (c.index_head_dim / 128);  // fp8 codes + f32 scales
  return {"mla-dsa", spec,
          ojson{{"n_heads", c.index_n_heads},
                {"head_dim", c.index_head_dim},
                {"topk", c.index_topk},
                {"scales", c.index_scale_ue8m0 ? "ue8m0" : "amax/448"},
                {"from", configured ? "config" : "DeepSeek-V3.2 defaults"},
                {"key_bytes_per_token_per_layer", key}}};
}

// The feed-forward of the config: its MoE, or its dense SwiGLU MLP
// (intermediate_size) as a one-expert MoE, which computes exactly
// down(silu(gate x) * up x).
MoeConfig feed_forward(const Source& src, int64_t layers) {
  if (src.json.empty())
    throw UsageError{"--mlp needs --config (the feed-forward's sizes come from config.json)"};
  const auto j = nlohmann::json::parse(src.json, nullptr, false);
  // The served layers' kinds of feed-forward, from the model description.
  int64_t moe_layers = 0;
  const auto spec = model_spec_from_json(src.json);
  const int64_t served = spec.ok() ? std::min(layers, spec->num_layers) : 0;
  for (int64_t l = 0; l < served; ++l)
    if (spec->layers[static_cast<size_t>(l)].ffn.kind == FeedForwardKind::kMoe) ++moe_layers;
  if (moe_layers > 0 && moe_layers < served)
    throw UsageError{"--mlp: " + src.label + "'s first " + std::to_string(served) +
                     " layers mix dense and MoE feed-forwards; the serving engine runs one kind"};
  if (moe_layers > 0 ||
      (!j.is_discarded() && (j.contains("num_local_experts") || j.contains("n_routed_experts")))) {
    auto moe = moe_config_from_json(src.json);
    if (!moe.ok()) throw UsageError{"--mlp: " + src.label + ": " + moe.status().message()};
    return *moe;
  }
  if (j.is_discarded() || !j.contains("intermediate_size") ||
      !j["intermediate_size"].is_number_integer())
    throw UsageError{"--mlp: " + src.label +
                     " has no intermediate_size and no experts (presets describe attention only; "
                     "give the model's config.json with --config)"};
  if (j.contains("hidden_act") && j["hidden_act"] != "silu")
    throw UsageError{"--mlp: hidden_act " + j["hidden_act"].dump() +
                     " is not silu; the library's feed-forward is SwiGLU"};
  MoeConfig c;
  c.model_type = "dense";
  c.hidden_size = src.shape.hidden_size;
  c.n_routed_experts = c.num_experts_per_tok = 1;
  c.moe_intermediate_size = j["intermediate_size"].get<int64_t>();
  c.norm_topk_prob = false;  // one expert: softmax weight exactly 1
  return c;
}

// The engine's spec without its layers: weight dtype, seed, feed-forward.
serve::ModelSpec base_spec(const Options& o, const Source& src) {
  serve::ModelSpec base;
  base.layers = o.layers;
  if (o.weights != "f32" && o.weights != "bf16")
    throw UsageError{"--weights must be f32 or bf16, got '" + o.weights + "'"};
  base.weight_dtype = o.weights == "bf16" ? DType::kBF16 : DType::kF32;
  base.seed = static_cast<uint64_t>(o.seed);
  if (o.mlp) {
    base.ffn = true;
    base.moe = feed_forward(src, o.layers);
  }
  return base;
}

// The kv heads of variant `n` (mha, mqa, gqa-N) of a layer of H heads.
int64_t kv_heads_of(const std::string& n, int64_t H) {
  int64_t kv = 0;
  if (n == "mha") kv = H;
  if (n == "mqa") kv = 1;
  if (n.rfind("gqa-", 0) == 0 && n.size() > 4 && n.size() < 12 &&
      n.find_first_not_of("0123456789", 4) == std::string::npos)
    kv = std::stoll(n.substr(4));
  if (kv < 1)
    throw UsageError{"--variants: unknown variant '" + n +
                     "' (mha, mqa, gqa-N, mla, mla-dsa, all-full)"};
  if (H % kv != 0)
    throw UsageError{"--variants: " + n + ": " + std::to_string(kv) +
                     " kv heads must divide the model's " + std::to_string(H) + " heads"};
  return kv;
}

// A stack of several layer kinds: as configured, its kv-head variants
// (every attention layer alike) and all-full (every layer full attention);
// by default as configured, and all-full when it has linear layers (the
// hybrid's comparison at one budget).
std::vector<Variant> stack_variants(std::vector<std::string> names, const Source& src,
                                    const serve::ModelSpec& base,
                                    const std::vector<serve::StackLayer>& stack) {
  const serve::StackLayer& first = all_full(stack)[0];
  const std::string configured = label_of(first.attention);
  if (names.empty()) {
    names = {configured};
    for (const serve::StackLayer& s : stack)
      if (s.kind == LayerKind::kLinearAttention) {
        names.push_back("all-full");
        break;
      }
  }
  std::vector<Variant> out;
  for (const std::string& n : names) {
    serve::ModelSpec spec = base;
    if (n == "mla" || n == "mla-dsa")
      throw UsageError{"--variants: " + n + ": " + src.label +
                       "'s served layers differ in kind; an MLA variant of them is not defined "
                       "(give --layers to serve layers of one kind)"};
    spec.stack = n == "all-full" ? all_full(stack) : stack;
    if (n != "all-full" && n != configured) {
      const int64_t kv = kv_heads_of(n, first.attention.num_heads);
      for (serve::StackLayer& l : spec.stack) l.attention.num_kv_heads = kv;
    }
    out.push_back({n, spec});
  }
  return out;
}

std::vector<Variant> plan_variants(const Options& o, const Source& src) {
  std::vector<std::string> names = o.variants;
  serve::ModelSpec base = base_spec(o, src);
  std::vector<Variant> out;
  if (src.shape.mla) {
    base.mla = true;
    auto c = mla_config_from_json(src.json);
    if (!c.ok()) throw UsageError{src.label + ": " + c.status().message()};
    base.latent = *c;
    // A DSA model's default: both, dense first.
    if (names.empty())
      names = c->sparse() ? std::vector<std::string>{"mla", "mla-dsa"}
                          : std::vector<std::string>{"mla"};
    for (const std::string& n : names) {
      if (n == "mla-dsa") {
        out.push_back(dsa_variant(base, src.label));
        continue;
      }
      if (n != "mla")
        throw UsageError{"--variants: " + n + ": " + src.label +
                         " is MLA; its variants here are mla and mla-dsa"};
      serve::ModelSpec dense = base;  // mla: dense attention, the indexer left out
      dense.latent.index_n_heads = dense.latent.index_head_dim = dense.latent.index_topk = 0;
      out.push_back({"mla", dense});
    }
    return out;
  }
  if (!src.json.empty()) {
    const std::vector<serve::StackLayer> stack = stack_of(src, o.layers);
    if (!uniform(stack)) return stack_variants(names, src, base, stack);
  }
  const AttentionConfig attn = base_attention(src);
  const int64_t H = attn.num_heads;
  if (names.empty()) {
    names = {label_of(attn)};
    for (int64_t g : {8, 4})
      if (H % g == 0 && g < H && g != attn.num_kv_heads && g > 1)
        names.push_back("gqa-" + std::to_string(g));
    if (attn.num_kv_heads != 1) names.push_back("mqa");
    names.push_back("mla");
  }
  for (const std::string& n : names) {
    serve::ModelSpec spec = base;
    spec.attention = attn;
    if (n == "mla-dsa")
      throw UsageError{"--variants: mla-dsa: " + src.label +
                       " is not MLA; DeepSeek's sparse attention runs on an MLA model with "
                       "q_lora_rank (e.g. --model deepseek-v3 or deepseek-v3.2)"};
    if (n == "mla") {
      spec.mla = true;
      ModelShape shape = src.shape;
      shape.head_dim = shape.head_dim_v = attn.head_dim;
      const int64_t rope = default_mla_rope_dim(attn.head_dim);
      auto mla = with_mla(shape, default_mla_rank(attn.head_dim), rope, 0);
      if (!mla.ok()) throw UsageError{"--variants: mla: " + mla.status().message()};
      spec.latent = mla_layer_config(*mla, attn.rope.theta);
    } else if (n == "all-full") {
      spec.attention.sliding_window = spec.attention.chunk_size = 0;
    } else {
      spec.attention.num_kv_heads = kv_heads_of(n, H);
    }
    out.push_back({n, spec});
  }
  return out;
}

// The bytes a variant's layers will keep, before building them: a
// feed-forward of hundreds of experts is more than most machines hold.
double attention_params(const AttentionConfig& c) {
  const double d = static_cast<double>(c.hidden_size);
  return (c.output_gate ? 3 : 2) * d * static_cast<double>(c.num_heads * c.head_dim) +
         2 * d * static_cast<double>(c.num_kv_heads * c.head_dim);
}

double planned_weight_bytes(const serve::ModelSpec& s) {
  double params = 0;
  if (s.mla) {
    const MlaConfig& c = s.latent;
    const double d = static_cast<double>(c.hidden_size),
                 H = static_cast<double>(c.num_attention_heads);
    const double dq = static_cast<double>(c.q_lora_rank),
                 dqk = static_cast<double>(c.qk_head_dim());
    const double dc = static_cast<double>(c.kv_lora_rank);
    params = (dq > 0 ? dq * d + H * dqk * dq : H * dqk * d) +
             (dc + static_cast<double>(c.qk_rope_head_dim)) * d +
             H * static_cast<double>(c.qk_nope_head_dim + c.v_head_dim) * dc +
             d * H * static_cast<double>(c.v_head_dim);
    const double hi = static_cast<double>(c.index_n_heads),
                 di = static_cast<double>(c.index_head_dim);
    params += hi * di * dq + di * d + hi * d;  // the indexer (0 for dense MLA)
  } else if (s.stack.empty()) {
    params = attention_params(s.attention);
  } else {
    // The mean over the stack's layers, times layers below.
    for (const serve::StackLayer& l : s.stack) {
      const GatedDeltaNetConfig& g = l.linear;
      const double d = static_cast<double>(g.hidden_size);
      const double kd = static_cast<double>(g.num_k_heads * g.key_head_dim),
                   vd = static_cast<double>(g.num_v_heads * g.value_head_dim);
      params += l.kind == LayerKind::kLinearAttention
                    ? d * (2 * kd + 2 * vd + 2 * static_cast<double>(g.num_v_heads) + vd)
                    : attention_params(l.attention);
    }
    params /= static_cast<double>(s.stack.size());
  }
  if (s.ffn) {
    const MoeConfig& m = s.moe;
    const double d = static_cast<double>(m.hidden_size),
                 E = static_cast<double>(m.n_routed_experts);
    const double I = static_cast<double>(m.moe_intermediate_size);
    params += E * d + 3 * d * I * (E + static_cast<double>(m.n_shared_experts));
  }
  return params * static_cast<double>(s.layers) * static_cast<double>(dtype_size(s.weight_dtype));
}

// "N" or "A-B" (inclusive), each >= 1.
std::pair<int64_t, int64_t> parse_range(const std::string& flag, const std::string& text) {
  const size_t dash = text.find('-');
  const auto num = [&](const std::string& s) -> int64_t {
    if (s.empty() || s.size() > 12 || s.find_first_not_of("0123456789") != std::string::npos)
      throw UsageError{flag + " must be N or A-B (token counts >= 1), got '" + text + "'"};
    return std::stoll(s);
  };
  const int64_t lo = num(text.substr(0, dash));
  const int64_t hi = dash == std::string::npos ? lo : num(text.substr(dash + 1));
  if (lo < 1 || hi < lo)
    throw UsageError{flag + " must be N or A-B with 1 <= A <= B, got '" + text + "'"};
  return {lo, hi};
}

// The fixture's vocabulary: the ids a trace's prompts may use.
constexpr int64_t kVocab = serve::ModelSpec{}.vocab_size;

// The served model's vocabulary: the fixture's, or the checkpoint's.
int64_t vocab_of(const Options& o, const Source& src) {
  if (o.model_dir.empty()) return kVocab;
  const auto j = nlohmann::json::parse(src.json, nullptr, false);
  if (j.is_discarded() || !j.contains("vocab_size") || !j["vocab_size"].is_number_integer() ||
      j["vocab_size"].get<int64_t>() < 1 || j["vocab_size"].get<int64_t>() > (int64_t{1} << 31))
    throw UsageError{"--model-dir " + o.model_dir +
                     ": config.json has no vocab_size in [1, 2^31] (the ids prompts may use)"};
  return j["vocab_size"].get<int64_t>();
}

// A trace line's prompt: its prompt_token_ids, or prompt_tokens seeded ids
// below vocab.
std::vector<int32_t> prompt_of(const nlohmann::json& j, const std::string& where, int64_t line,
                               int64_t vocab) {
  std::vector<int32_t> ids;
  if (j.contains("prompt_token_ids")) {
    const auto& a = j["prompt_token_ids"];
    if (!a.is_array() || a.empty() || a.size() > (size_t{1} << 30))
      throw UsageError{where + "prompt_token_ids must be a non-empty array of token ids"};
    for (const auto& t : a) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= vocab)
        throw UsageError{where + "prompt_token_ids entries must be integers in [0, " +
                         std::to_string(vocab) + ") (the served model's vocabulary), got " +
                         t.dump()};
      ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
    }
    if (j.contains("prompt_tokens") && j["prompt_tokens"].is_number_integer() &&
        j["prompt_tokens"].get<int64_t>() != static_cast<int64_t>(ids.size()))
      throw UsageError{where + "prompt_tokens " + j["prompt_tokens"].dump() + " differs from the " +
                       std::to_string(ids.size()) + " prompt_token_ids"};
    return ids;
  }
  const int64_t n = j["prompt_tokens"].get<int64_t>();
  serve::TraceOptions t;
  t.requests = 1;
  t.prompt_min = t.prompt_max = n;
  t.output_min = t.output_max = 1;
  t.seed = static_cast<uint64_t>(line);
  t.vocab_size = vocab;
  return serve::synthetic_trace(t)[0].prompt_token_ids;
}

// JSON lines {"arrival_s": x, "prompt_tokens": n, "output_tokens": n}, or
// "prompt_token_ids": [...] for prompt_tokens; blank lines are skipped.
// Any other line is a usage error naming it.
std::vector<serve::Request> read_trace(const std::string& path, int64_t vocab) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw UsageError{"--trace '" + path + "' is a directory"};
  std::ifstream in(path);
  if (!in) throw UsageError{"cannot read --trace '" + path + "'"};
  std::vector<serve::Request> out;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = "--trace " + path + " line " + std::to_string(n) + ": ";
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object())
      throw UsageError{where +
                       "not a JSON object (want {\"arrival_s\": 0.5, \"prompt_tokens\": "
                       "128, \"output_tokens\": 64})"};
    for (auto it = j.begin(); it != j.end(); ++it)
      if (it.key() != "arrival_s" && it.key() != "prompt_tokens" && it.key() != "output_tokens" &&
          it.key() != "prompt_token_ids")
        throw UsageError{where + "unknown field \"" + it.key() +
                         "\" (arrival_s, prompt_tokens or prompt_token_ids, output_tokens)"};
    serve::Request r;
    if (!j.contains("arrival_s") || !j["arrival_s"].is_number() ||
        !std::isfinite(j["arrival_s"].get<double>()) || j["arrival_s"].get<double>() < 0)
      throw UsageError{where + "arrival_s must be a number >= 0 (seconds from the start)"};
    r.arrival_s = j["arrival_s"].get<double>();
    for (const char* key : {"prompt_tokens", "output_tokens"}) {
      if (std::string(key) == "prompt_tokens" && j.contains("prompt_token_ids") && !j.contains(key))
        continue;
      if (!j.contains(key) || !j[key].is_number_integer() || j[key].get<int64_t>() < 1 ||
          j[key].get<int64_t>() > (int64_t{1} << 30))
        throw UsageError{where + key + " must be an integer in [1, 2^30], got " +
                         (j.contains(key) ? j[key].dump() : std::string("nothing"))};
    }
    r.prompt_token_ids = prompt_of(j, where, n, vocab);
    r.output_tokens = j["output_tokens"].get<int64_t>();
    out.push_back(std::move(r));
  }
  if (out.empty()) throw UsageError{"--trace '" + path + "' holds no requests"};
  return out;
}

// numpy's default (linear) percentile of `v` (not empty).
double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  const double pos = p / 100.0 * static_cast<double>(v.size() - 1);
  const size_t i = static_cast<size_t>(pos);
  if (i + 1 >= v.size()) return v.back();
  return v[i] + (pos - static_cast<double>(i)) * (v[i + 1] - v[i]);
}

struct Row {
  std::string variant, kv, cache;
  bool prefix_cache = false;
  int64_t memory = 0;
  serve::Report r;  // the run of median output tokens/s
  size_t weight_bytes = 0;
  std::vector<double> tokens_per_s;  // every run's, in run order
  std::string weights, model_dir;    // the weights' dtype as kept; --model-dir
  ojson indexer = nullptr;           // Variant::indexer
  int64_t layers = 1;
};

double output_tokens_per_s(const serve::Report& r) {
  int64_t outputs = 0;
  for (const serve::RequestReport& q : r.requests) outputs += q.metrics.output_tokens;
  return static_cast<double>(outputs) / std::max(r.end_s - r.start_s, 1e-9);
}

ojson stats(const std::vector<double>& v) {
  if (v.empty()) return ojson(nullptr);
  double sum = 0;
  for (double x : v) sum += x;
  return {{"mean", sum / static_cast<double>(v.size())},
          {"p50", percentile(v, 50)},
          {"p90", percentile(v, 90)},
          {"p99", percentile(v, 99)}};
}

ojson row_json(const Row& row) {
  const serve::Report& r = row.r;
  std::vector<double> ttft, tpot, queue;
  int64_t outputs = 0;
  for (const serve::RequestReport& rq : r.requests) {
    const RequestMetrics& q = rq.metrics;
    ttft.push_back(q.first_token_s - q.arrival_s);
    queue.push_back(q.admitted_s - q.arrival_s);
    if (q.output_tokens > 1)
      tpot.push_back((q.finish_s - q.first_token_s) / static_cast<double>(q.output_tokens - 1));
    outputs += q.output_tokens;
  }
  const double span = std::max(r.end_s - r.start_s, 1e-9);
  return {{"variant", row.variant},
          {"kv_dtype", row.kv},
          {"cache", row.cache},
          {"prefix_cache", row.prefix_cache},
          {"memory_bytes", row.memory},
          {"kv_bytes_per_token", r.kv_bytes_per_token},
          // Of kv_bytes_per_token, the indexer keys' (mla-dsa; all layers).
          {"index_key_bytes_per_token",
           row.indexer.is_null()
               ? 0
               : row.indexer["key_bytes_per_token_per_layer"].get<int64_t>() * row.layers},
          {"indexer", row.indexer},
          {"state_bytes_per_sequence", r.state_bytes_per_sequence},
          {"pool_releases_pages", r.pool_releases_pages},
          {"pool_pages", r.pool_pages},
          {"static_slots", row.cache == "static" ? ojson(r.max_running) : ojson(nullptr)},
          {"static_max_seq_len", row.cache == "static" ? ojson(r.max_seq_len) : ojson(nullptr)},
          {"requests", r.requests.size()},
          {"output_tokens", outputs},
          {"duration_s", span},
          {"busy_s", r.stats.busy_s},
          {"output_tokens_per_s", output_tokens_per_s(r)},
          {"output_tokens_per_s_runs", row.tokens_per_s},
          {"requests_per_s", static_cast<double>(r.requests.size()) / span},
          {"ttft_s", stats(ttft)},
          {"tpot_s", stats(tpot)},
          {"queue_s", stats(queue)},
          {"peak_running", r.stats.peak_running},
          {"mean_running", r.mean_running},
          {"kv_used_bytes", {{"mean", r.mean_used_bytes}, {"peak", r.stats.peak_used_bytes}}},
          {"kv_reserved_bytes",
           {{"mean", r.mean_reserved_bytes}, {"peak", r.stats.peak_reserved_bytes}}},
          {"preemptions", r.stats.preemptions},
          {"steps", r.stats.steps},
          {"tokens_computed", r.stats.tokens_computed},
          {"prefill_tokens_computed", r.stats.prompt_tokens_computed},
          {"prefix_hit_rate", r.prefix_hit_rate},
          {"weight_bytes", row.weight_bytes},
          {"weights", row.weights},
          {"model_dir", row.model_dir.empty() ? ojson(nullptr) : ojson(row.model_dir)}};
}

// CSV cells: nested objects flatten to key_sub columns.
void flatten(const ojson& j, const std::string& prefix, std::vector<std::string>* keys,
             std::vector<std::string>* cells) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string key = prefix.empty() ? it.key() : prefix + "_" + it.key();
    if (it->is_object()) {
      flatten(*it, key, keys, cells);
      continue;
    }
    keys->push_back(key);
    cells->push_back(it->is_null()     ? ""
                     : it->is_string() ? "\"" + it->get<std::string>() + "\""
                                       : it->dump());
  }
}

// Lines that say what the rows mean: per group of rows that differ only in
// variant, whether throughput follows KV bytes per token; per variant, the
// paged mode's throughput over the static one's.
std::string group_of(const ojson& r) {
  return r["cache"].get<std::string>() + " " + r["kv_dtype"].get<std::string>() + " " +
         format_bytes(r["memory_bytes"].get<double>()) +
         (r["prefix_cache"].get<bool>() ? " prefix-cached" : "");
}

// Per configuration served with and without the prefix cache: what it did
// to the time to first token and the prefill work.
void conclude_prefix(const ojson& rows, std::vector<std::string>& lines) {
  for (const ojson& on : rows) {
    if (!on["prefix_cache"].get<bool>()) continue;
    for (const ojson& off : rows)
      if (!off["prefix_cache"].get<bool>() && off["variant"] == on["variant"] &&
          off["cache"] == on["cache"] && off["kv_dtype"] == on["kv_dtype"] &&
          off["memory_bytes"] == on["memory_bytes"] && !on["ttft_s"].is_null())
        lines.push_back(on["variant"].get<std::string>() + " " + on["kv_dtype"].get<std::string>() +
                        " " + format_bytes(on["memory_bytes"].get<double>()) +
                        ": the prefix cache took over " +
                        format_sig3(100.0 * on["prefix_hit_rate"].get<double>(), "") +
                        " % of the prompt tokens; TTFT p50 " +
                        format_seconds(on["ttft_s"]["p50"].get<double>()) + " vs " +
                        format_seconds(off["ttft_s"]["p50"].get<double>()) + " without (" +
                        format_ratio(on["ttft_s"]["p50"].get<double>() /
                                     std::max(off["ttft_s"]["p50"].get<double>(), 1e-12)) +
                        "); prefill tokens computed " +
                        std::to_string(on["prefill_tokens_computed"].get<int64_t>()) + " vs " +
                        std::to_string(off["prefill_tokens_computed"].get<int64_t>()) + ".");
  }
}

std::vector<std::string> conclude(const ojson& rows) {
  std::vector<std::string> lines;
  std::vector<std::string> groups;
  for (const ojson& r : rows) {
    const std::string g = group_of(r);
    if (std::find(groups.begin(), groups.end(), g) == groups.end()) groups.push_back(g);
  }
  for (const std::string& g : groups) {
    std::vector<const ojson*> in;
    for (const ojson& r : rows)
      if (group_of(r) == g) in.push_back(&r);
    if (in.size() < 2) continue;
    auto by_tps = in, by_kv = in;
    std::stable_sort(by_tps.begin(), by_tps.end(), [](const ojson* a, const ojson* b) {
      return (*a)["output_tokens_per_s"].get<double>() > (*b)["output_tokens_per_s"].get<double>();
    });
    std::stable_sort(by_kv.begin(), by_kv.end(), [](const ojson* a, const ojson* b) {
      return (*a)["kv_bytes_per_token"].get<int64_t>() < (*b)["kv_bytes_per_token"].get<int64_t>();
    });
    std::string tps, kv;
    for (const ojson* r : by_tps)
      tps += (tps.empty() ? "" : " > ") + (*r)["variant"].get<std::string>();
    for (const ojson* r : by_kv)
      kv += (kv.empty() ? "" : " < ") + (*r)["variant"].get<std::string>();
    lines.push_back(g + ": output tokens/s " + tps + "; KV bytes/token " + kv +
                    (by_tps == by_kv ? " (the same order)" : " (not the same order)") + ".");
  }
  for (const ojson& f : rows) {
    if (f["variant"] != "all-full") continue;
    for (const ojson& h : rows)
      if (h["variant"] != "all-full" && h["cache"] == f["cache"] &&
          h["kv_dtype"] == f["kv_dtype"] && h["memory_bytes"] == f["memory_bytes"])
        lines.push_back(
            h["variant"].get<std::string>() + " " + f["cache"].get<std::string>() + " " +
            f["kv_dtype"].get<std::string>() + " " + format_bytes(f["memory_bytes"].get<double>()) +
            ": the stack as configured runs " +
            format_ratio(h["mean_running"].get<double>() /
                         std::max(f["mean_running"].get<double>(), 1e-9)) +
            " the sequences per step of the same stack with every layer full attention (" +
            format_sig3(h["mean_running"].get<double>(), "") + " vs " +
            format_sig3(f["mean_running"].get<double>(), "") + " mean, " +
            std::to_string(h["peak_running"].get<int64_t>()) + " vs " +
            std::to_string(f["peak_running"].get<int64_t>()) + " peak; KV/token " +
            format_bytes(h["kv_bytes_per_token"].get<double>()) + " + state/sequence " +
            format_bytes(h["state_bytes_per_sequence"].get<double>()) + " vs KV/token " +
            format_bytes(f["kv_bytes_per_token"].get<double>()) + ").");
  }
  for (const ojson& p : rows) {
    if (p["cache"] != "paged" || p["prefix_cache"].get<bool>()) continue;
    for (const ojson& s : rows)
      if (s["cache"] == "static" && s["variant"] == p["variant"] &&
          s["kv_dtype"] == p["kv_dtype"] && s["memory_bytes"] == p["memory_bytes"])
        lines.push_back(p["variant"].get<std::string>() + " " + p["kv_dtype"].get<std::string>() +
                        " " + format_bytes(p["memory_bytes"].get<double>()) + ": paged serves " +
                        format_ratio(p["output_tokens_per_s"].get<double>() /
                                     s["output_tokens_per_s"].get<double>()) +
                        " the static cache's output tokens/s (" +
                        format_sig3(p["mean_running"].get<double>(), "") + " vs " +
                        format_sig3(s["mean_running"].get<double>(), "") +
                        " sequences at a time).");
  }
  for (const ojson& a : rows) {  // DSA against dense MLA on the same pool
    if (a["indexer"].is_null()) continue;
    for (const ojson& b : rows)
      if (b["variant"] == "mla" && group_of(b) == group_of(a) && !a["tpot_s"].is_null() &&
          !b["tpot_s"].is_null())
        lines.push_back(
            group_of(a) + ": mla-dsa (top-" + a["indexer"]["topk"].dump() + ") serves " +
            format_ratio(a["output_tokens_per_s"].get<double>() /
                         std::max(b["output_tokens_per_s"].get<double>(), 1e-12)) +
            " dense mla's output tokens/s; TPOT p50 " +
            format_seconds(a["tpot_s"]["p50"].get<double>()) + " vs " +
            format_seconds(b["tpot_s"]["p50"].get<double>()) + "; its KV/token holds " +
            format_bytes(a["index_key_bytes_per_token"].get<double>()) + " of indexer keys.");
  }
  conclude_prefix(rows, lines);
  return lines;
}

// The threads the layers use by default: ATTNKIT_NUM_THREADS, else every
// core (core/threads.h's rule).
int default_threads() {
  if (const char* env = std::getenv("ATTNKIT_NUM_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

std::string ms(const ojson& stat, const char* key) {
  return stat.is_null() ? "-" : format_seconds(stat[key].get<double>());
}

// Reads the flags into o (after checking what needs no model); false when
// --help was printed.
// What serve-bench --help says it does.
constexpr const char* kAbout =
    "Serves a stream of requests with continuous batching over a paged KV pool of a fixed\n"
    "size, on this machine, for each attention variant of a model (as configured, GQA, MQA,\n"
    "MLA), KV dtype, cache mode and memory budget, and reports what vLLM's benchmarks report:\n"
    "output tokens/s, requests/s, time to first token (TTFT) and time per output token (TPOT)\n"
    "as median, p90 and p99, plus the sequences that ran at once, the KV memory used and\n"
    "reserved, and preemptions. The model is the config's first --layers layers, each of its\n"
    "own kind (sliding, chunked, full, NoPE, sinks, gated output; Gated DeltaNet with a state\n"
    "per sequence beside the pool), as the variant changes their kv heads (+ the config's\n"
    "feed-forward with --mlp) with seeded random weights, a 512-token vocabulary and greedy\n"
    "sampling (attnkit/serve.h's fixture). Without --model or --config the layer is\n"
    "compare's (d_model 2048, 32 heads of 64). --model-dir DIR serves a checkpoint instead\n"
    "(attnkit::Model: all its layers, feed-forward, vocabulary and LM head, weights in the\n"
    "dtype stored). docs/SERVING.md says how the scheduler decides; docs/TOOL.md what the\n"
    "figures include.";

// The flags of the synthetic trace, and --trace.
void add_trace_flags(Flags& f, Options& o) {
  f.add_int("--requests", &o.requests,
            "synthetic trace: requests (conversations with --turns; default 32)", 1);
  f.add_string("--rate", &o.rate,
               "synthetic trace: Poisson arrivals per second, or inf = all at once (default inf)");
  f.add_string("--prompt-tokens", &o.prompt,
               "synthetic trace: prompt length N or uniform A-B (default 32-256)");
  f.add_string("--output-tokens", &o.output,
               "synthetic trace: output length N or uniform A-B (default 16-128)");
  f.add_int("--shared-prefix", &o.shared_prefix,
            "synthetic trace: every prompt starts with the same N-token system prompt; "
            "--prompt-tokens then counts the tokens after it (default 0)",
            0);
  f.add_int("--prefix-groups", &o.prefix_groups,
            "synthetic trace: G distinct shared prompts, request i takes i % G (default 1)", 1);
  f.add_int("--turns", &o.turns,
            "synthetic trace: conversations of T turns; turn k+1 arrives when turn k finishes, "
            "its prompt the conversation so far plus --prompt-tokens new tokens (default 1)",
            1);
  f.add_string("--trace", &o.trace,
               "JSON lines {\"arrival_s\", \"prompt_tokens\" or \"prompt_token_ids\", "
               "\"output_tokens\"} instead");
}

// The flags that shape the random model have nothing to shape with a
// checkpoint: refused by name.
void check_model_dir_flags(const Flags& f, const Options& o) {
  if (o.model_dir.empty()) return;
  for (const char* flag : {"--model", "--config", "--layers", "--variants", "--weights", "--mlp"})
    if (f.given(flag))
      throw UsageError{std::string(flag) +
                       " does not apply with --model-dir (the checkpoint gives its layers, "
                       "attention, feed-forward and weights)"};
}

bool parse_options(int argc, char** argv, Options& o) {
  Flags f("serve-bench", kAbout,
          {"attnkit serve-bench",
           "attnkit serve-bench --model llama-3-8b --layers 1 --memory 256MiB --cache paged,static",
           "attnkit serve-bench --variants mha,gqa-8,mqa,mla --memory 16MiB,32MiB,64MiB --json > "
           "serve.json && attnkit plot --input serve.json",
           "attnkit serve-bench --trace requests.jsonl --kv-dtypes bf16,int8 --csv",
           "attnkit serve-bench --model qwen3-next-80b-a3b --layers 4 --prompt-tokens 2048-4096"});
  f.add_string("--model", &o.model, "a built-in preset (see attnkit presets)");
  f.add_string("--config", &o.config, "a Hugging Face config.json");
  f.add_string("--model-dir", &o.model_dir,
               "serve this checkpoint (config.json + model.safetensors or its index) instead of "
               "random layers");
  f.add_int("--layers", &o.layers, "the config's first layers in the served stack (default 2)", 1);
  f.add_string_list("--variants", &o.variants,
                    "as configured, gqa-N, mqa, mla, all-full (every layer full attention); "
                    "an MLA model: mla (dense) and mla-dsa (DeepSeek-V3.2's indexer + top-k: "
                    "the config's, else 64 heads of 128, top-2048) "
                    "(default: the model's, gqa-8, gqa-4, mqa, mla; a DSA model: mla, mla-dsa; "
                    "a stack of several layer kinds: the model's, and all-full when it has "
                    "linear layers)");
  f.add_string_list("--kv-dtypes", &o.kv_dtypes,
                    "KV cache dtypes: f32, bf16, int8, fp8_e4m3 (default bf16)");
  f.add_string("--weights", &o.weights, "f32 or bf16 weights (default bf16)");
  f.add_string_list("--memory", &o.memory,
                    "KV pool budgets, all layers, e.g. 64MiB,256MiB (default: the configured "
                    "variant's cache for a quarter of the trace's tokens)");
  f.add_int("--page-size", &o.page_size, "tokens per page (default 16)", 1);
  f.add_string_list("--cache", &o.caches,
                    "paged, static or both (static reserves --max-seq-len per sequence; default "
                    "paged)");
  f.add_int("--max-seq-len", &o.max_seq_len,
            "static: tokens each sequence reserves (default: the longest request the trace allows)",
            0);
  add_trace_flags(f, o);
  f.add_string_list("--prefix-cache", &o.prefix_cache,
                    "on, off or both: reuse the cached pages of a shared prompt prefix (default "
                    "off)");
  f.add_int("--max-tokens-per-step", &o.max_tokens,
            "tokens per step: decodes + prompt chunks (default 512)", 1);
  f.add_int("--max-seqs", &o.max_seqs, "sequences per step at most (default 256)", 1);
  f.add_bool("--mlp", &o.mlp, "add the config's feed-forward (dense SwiGLU or MoE) per layer");
  f.add_int("--threads", &o.threads, "threads (default 0 = all cores)", 0);
  f.add_string("--backend", &o.backend, "auto, fast or reference kernels (default auto)");
  f.add_int("--seed", &o.seed, "weights, prompts and synthetic trace seed (default 1)", 0);
  f.add_int("--repeats", &o.repeats,
            "runs of every configuration, in turn; each row is the median by tokens/s (default 1)",
            1);
  f.add_bool("--json", &o.json, "print JSON instead of a table");
  f.add_bool("--csv", &o.csv, "print CSV (one line per configuration) instead of a table");
  if (!f.parse(argc, argv, 2)) return false;
  if (o.json && o.csv) throw UsageError{"give at most one of --json and --csv"};
  if (!o.model.empty() && !o.config.empty())
    throw UsageError{"give at most one of --model NAME or --config PATH"};
  check_model_dir_flags(f, o);
  for (const std::string& k : o.kv_dtypes) (void)kv_dtype_of(k, "--kv-dtypes entries");
  for (const std::string& c : o.caches)
    if (c != "paged" && c != "static")
      throw UsageError{"--cache entries must be paged or static, got '" + c + "'"};
  for (const std::string& c : o.prefix_cache)
    if (c != "on" && c != "off")
      throw UsageError{"--prefix-cache entries must be on or off, got '" + c + "'"};
  if (o.backend != "auto" && o.backend != "fast" && o.backend != "reference")
    throw UsageError{"--backend must be auto, fast or reference, got '" + o.backend + "'"};
  if (!o.trace.empty())
    for (const char* flag : {"--requests", "--rate", "--prompt-tokens", "--output-tokens",
                             "--shared-prefix", "--prefix-groups", "--turns"})
      if (f.given(flag))
        throw UsageError{std::string(flag) +
                         " describes a synthetic trace; "
                         "it cannot go with --trace"};

  return true;
}

struct Trace {
  std::vector<serve::Request> requests;
  std::string label;
  // What a static slot reserves: --max-seq-len, else the longest request
  // the trace allows (a synthetic trace: its longest prompt and output;
  // a file: its longest request), as a static engine is configured.
  int64_t static_len = 0;
  int64_t slots = 0;                    // token slots of every request
  std::vector<int64_t> prompt_lengths;  // each request's whole prompt
};

Trace make_trace(const Options& o, int64_t vocab) {
  Trace t;
  t.static_len = o.max_seq_len;
  if (!o.trace.empty()) {
    t.requests = read_trace(o.trace, vocab);
    t.label = o.trace;
  } else {
    double rate = std::numeric_limits<double>::infinity();
    if (o.rate != "inf") {
      char* end = nullptr;
      rate = std::strtod(o.rate.c_str(), &end);
      if (o.rate.empty() || *end != '\0' || !(rate > 0) || !std::isfinite(rate))
        throw UsageError{"--rate must be a number > 0 (requests per second) or inf, got '" +
                         o.rate + "'"};
    }
    const auto [p0, p1] = parse_range("--prompt-tokens", o.prompt);
    const auto [g0, g1] = parse_range("--output-tokens", o.output);
    // The longest request the trace allows: the last turn of a conversation.
    if (t.static_len == 0) t.static_len = o.shared_prefix + o.turns * (p1 + g1) - 1;
    serve::TraceOptions to;
    to.requests = o.requests;
    to.rate = rate;
    to.prompt_min = p0;
    to.prompt_max = p1;
    to.output_min = g0;
    to.output_max = g1;
    to.shared_prefix = o.shared_prefix;
    to.prefix_groups = o.prefix_groups;
    to.turns = o.turns;
    to.vocab_size = vocab;
    to.seed = static_cast<uint64_t>(o.seed);
    t.requests = serve::synthetic_trace(to);
    t.label = std::to_string(o.requests) + (o.turns > 1 ? " conversations" : " requests") + ", " +
              (o.rate == "inf" ? std::string("all at once") : "Poisson " + o.rate + "/s") +
              ", prompts " + o.prompt + ", outputs " + o.output + " tokens";
    if (o.shared_prefix > 0)
      t.label += ", a shared prefix of " + std::to_string(o.shared_prefix) + " tokens" +
                 (o.prefix_groups > 1 ? " (" + std::to_string(o.prefix_groups) + " distinct)" : "");
    if (o.turns > 1) t.label += ", " + std::to_string(o.turns) + " turns each";
  }
  t.prompt_lengths = serve::prompt_lengths(t.requests);
  for (size_t i = 0; i < t.requests.size(); ++i)
    t.slots += t.prompt_lengths[i] + t.requests[i].output_tokens - 1;
  return t;
}

DType kv_type(const std::string& name) { return kv_dtype_of(name, "--kv-dtypes entries"); }

Backend backend_of(const std::string& name) {
  if (name == "fast") return Backend::kFast;
  if (name == "reference") return Backend::kReference;
  return Backend::kAuto;
}

// A served model and what the rows say of its weights.
struct Built {
  std::unique_ptr<StepModel> model;
  size_t weight_bytes = 0;
  std::string weights;  // dtype: --weights, or the checkpoint's as stored
};

// The dtypes of a checkpoint's tensors as stored, most bytes first
// ("bf16", or "bf16+f32" where some are kept wider), from the headers of
// model.safetensors or of the shards its index names (which loading the
// model has checked).
std::string stored_dtypes(const std::string& dir) {
  const std::filesystem::path index = std::filesystem::path(dir) / "model.safetensors.index.json";
  std::vector<std::string> files = {"model.safetensors"};
  if (std::filesystem::exists(index)) {
    files.clear();
    for (const auto& [name, file] : nlohmann::json::parse(file_text(index))["weight_map"].items())
      if (std::find(files.begin(), files.end(), file) == files.end()) files.push_back(file);
  }
  std::map<std::string, size_t> bytes;
  for (const std::string& f : files) {
    auto st = value_or_throw(SafetensorsFile::open(dir + "/" + f), "--model-dir");
    for (const auto& [name, v] : st.tensors())
      bytes[dtype_name(v.dtype)] += static_cast<size_t>(v.numel()) * dtype_size(v.dtype);
  }
  std::vector<std::pair<size_t, std::string>> order;
  for (const auto& [d, n] : bytes) order.push_back({n, d});
  std::sort(order.rbegin(), order.rend());
  std::string out;
  for (const auto& [n, d] : order) out += (out.empty() ? "" : "+") + d;
  return out;
}

// --model-dir: the checkpoint (attnkit::Model), one row per configuration.
Built load_checkpoint(const Options& o) {
  ModelLoadOptions lo;
  lo.run = {backend_of(o.backend), static_cast<int>(o.threads)};
  auto m = Model::from_pretrained(o.model_dir, lo);
  if (!m.ok()) throw UsageError{"--model-dir: " + m.status().message()};
  Built b;
  b.weight_bytes = m->weight_bytes();
  b.weights = stored_dtypes(o.model_dir);
  b.model = std::make_unique<Model>(std::move(m).value());
  return b;
}

// The checkpoint's row is named by its attention: mla, or its first
// softmax-attention layer's mha, mqa, gqa-N (a hybrid's layer 0 may be
// linear).
std::vector<Variant> checkpoint_variant(const Source& src) {
  if (src.shape.mla) return {{"mla", {}}};
  const auto spec = model_spec_from_json(src.json);
  for (int64_t l = 0; spec.ok() && l < spec->num_layers; ++l)
    if (spec->layers[static_cast<size_t>(l)].kind == LayerKind::kAttention) {
      const auto c = attention_config_from_json(src.json, l);
      if (c.ok()) return {{label_of(*c), {}}};
    }
  return {{"model", {}}};
}

// The served models, built first (their weights are the big allocation),
// where they fit in this machine's memory.
std::vector<Built> build_models(const Options& o, const std::vector<Variant>& variants) {
  std::vector<Built> models;
  if (!o.model_dir.empty()) {
    models.push_back(load_checkpoint(o));
    return models;
  }
  double planned = 0;
  for (const Variant& v : variants) planned += planned_weight_bytes(v.spec);
  const double physical =
      static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
  if (physical > 0 && planned > physical)
    throw UsageError{"the served layers' weights would take " + format_bytes(planned) + " (" +
                     std::to_string(variants.size()) + " variant(s) x " + std::to_string(o.layers) +
                     " layer(s)), more than this machine's " + format_bytes(physical) +
                     "; give fewer --layers or --variants" + (o.mlp ? ", or leave out --mlp" : "")};
  for (const Variant& v : variants) {
    auto m = std::make_unique<serve::SyntheticModel>(
        value_or_throw(serve::SyntheticModel::create(v.spec), v.name + " model"));
    const size_t bytes = m->weight_bytes();
    models.push_back({std::move(m), bytes, o.weights});
  }
  return models;
}

// --memory, or the configured variant's cache (and states) for a quarter of
// the trace's tokens (and requests), in whole MiB: it runs about a quarter
// of the requests at once, and the smaller caches more.
std::vector<int64_t> budgets_of(const Options& o, const Trace& t, const StepModel& first) {
  std::vector<int64_t> budgets;
  for (const std::string& m : o.memory) {
    int64_t b = 0;
    try {
      b = parse_bytes(m);
    } catch (const UsageError& e) {
      throw UsageError{"--memory: " + e.message};
    }
    if (b <= 0) throw UsageError{"--memory entries must be > 0, got '" + m + "'"};
    budgets.push_back(b);
  }
  if (!budgets.empty()) return budgets;
  auto probe =
      value_or_throw(first.new_pool(1, o.page_size, kv_type(o.kv_dtypes[0]), false), "pool");
  const double per_token =
      static_cast<double>(probe.page_nbytes()) / static_cast<double>(o.page_size);
  int64_t longest = 0;  // so that the longest request fits alone
  for (size_t i = 0; i < t.requests.size(); ++i)
    longest =
        std::max(longest, t.prompt_lengths[i] + t.requests[i].output_tokens - 1 + o.page_size);
  const double quarter =
      per_token * std::max(static_cast<double>(t.slots) / 4.0, static_cast<double>(longest));
  const double states = static_cast<double>(first.state_bytes_per_sequence()) *
                        std::ceil(static_cast<double>(t.requests.size()) / 4.0);
  budgets.push_back(static_cast<int64_t>(std::ceil((quarter + states) / (1 << 20))) << 20);
  return budgets;
}

struct Config {
  size_t variant;
  DType kv;
  std::string kv_name, cache;
  int64_t memory;
  bool prefix = false;
};

EngineOptions options_for(const Options& o, const Trace& t, const Config& c) {
  EngineOptions so;
  so.cache = c.cache == "static" ? CacheMode::kStatic : CacheMode::kPaged;
  so.kv_memory = c.memory;
  so.prefix_caching = c.prefix;
  so.page_size = o.page_size;
  so.kv_dtype = c.kv;
  so.max_tokens_per_step = o.max_tokens;
  so.max_seqs = o.max_seqs;
  so.max_seq_len = t.static_len;
  so.run = {backend_of(o.backend), static_cast<int>(o.threads)};
  return so;
}

// Every budget x variant x KV dtype x cache mode, each checked feasible (an
// impossible budget is the user's to fix: said before any run).
std::vector<Config> plan_configs(const Options& o, const Trace& t,
                                 const std::vector<Variant>& variants,
                                 const std::vector<Built>& models) {
  std::vector<Config> configs;
  for (int64_t mem : budgets_of(o, t, *models[0].model))
    for (size_t v = 0; v < variants.size(); ++v)
      for (const std::string& k : o.kv_dtypes)
        for (const std::string& c : o.caches)
          for (const std::string& p : o.prefix_cache) {
            if (p == "on" && c == "static")
              throw UsageError{
                  "--prefix-cache on needs --cache paged (a static slot shares no "
                  "pages)"};
            configs.push_back({v, kv_type(k), kv_dtype_label(kv_type(k)), c, mem, p == "on"});
          }
  for (const Config& c : configs) {
    const Status st =
        serve::check_feasible(*models[c.variant].model, t.requests, options_for(o, t, c));
    if (!st.ok())
      throw UsageError{variants[c.variant].name + " " + c.kv_name + " " + c.cache + " --memory " +
                       format_bytes(static_cast<double>(c.memory)) + ": " + st.message()};
  }
  return configs;
}

// Every configuration once per round, round after round, so that a busy
// spell of the machine falls on all of them alike; a row per
// configuration, its run of median output tokens/s.
std::vector<Row> run_configs(const Options& o, const Trace& t, const std::vector<Variant>& variants,
                             std::vector<Built>& models, const std::vector<Config>& configs) {
  Progress progress("serve-bench", static_cast<int64_t>(configs.size()) * o.repeats *
                                       static_cast<int64_t>(t.requests.size()));
  std::vector<std::vector<serve::Report>> runs(configs.size());
  for (int64_t round = 0; round < o.repeats; ++round)
    for (size_t i = 0; i < configs.size(); ++i) {
      const Config& c = configs[i];
      const std::string what = variants[c.variant].name + " " + c.kv_name + " " + c.cache + " " +
                               format_bytes(static_cast<double>(c.memory));
      const EngineOptions so = options_for(o, t, c);
      int64_t shown = 0;
      const auto on_progress = [&](int64_t done, int64_t) {
        for (; shown < done; ++shown) progress.step(what);
      };
      runs[i].push_back(
          value_or_throw(serve::run(*models[c.variant].model, t.requests, so, on_progress), what));
    }
  progress.finish();
  std::vector<Row> rows;
  for (size_t i = 0; i < configs.size(); ++i) {
    const Config& c = configs[i];
    Row row{variants[c.variant].name,
            c.kv_name,
            c.cache,
            c.prefix,
            c.memory,
            {},
            models[c.variant].weight_bytes,
            {},
            models[c.variant].weights,
            o.model_dir};
    row.indexer = variants[c.variant].indexer;
    row.layers = o.layers;
    for (const serve::Report& r : runs[i]) row.tokens_per_s.push_back(output_tokens_per_s(r));
    std::vector<size_t> order(runs[i].size());
    for (size_t k = 0; k < order.size(); ++k) order[k] = k;
    std::sort(order.begin(), order.end(),
              [&](size_t a, size_t b) { return row.tokens_per_s[a] < row.tokens_per_s[b]; });
    row.r = std::move(runs[i][order[order.size() / 2]]);
    rows.push_back(std::move(row));
  }
  return rows;
}

void print_csv(const ojson& jrows) {
  for (size_t i = 0; i < jrows.size(); ++i) {
    std::vector<std::string> keys, cells;
    flatten(jrows[i], "", &keys, &cells);
    std::string head, line;
    for (size_t k = 0; k < keys.size(); ++k) {
      head += (k ? "," : "") + keys[k];
      line += (k ? "," : "") + cells[k];
    }
    if (i == 0) std::printf("%s\n", head.c_str());
    std::printf("%s\n", line.c_str());
  }
}

// What was served, for the JSON and the table's heading.
struct Served {
  const Options& o;
  const Source& src;
  const Trace& t;
  size_t weights;
  int threads;
  double elapsed;
};

void print_json(const Served& s, const ojson& jrows, const std::vector<std::string>& lines) {
  const Options& o = s.o;
  int64_t prompt = 0, output = 0;
  for (size_t i = 0; i < s.t.requests.size(); ++i) {
    prompt += s.t.prompt_lengths[i];
    output += s.t.requests[i].output_tokens;
  }
  const bool bf16_weights = o.weights.starts_with("bf16");  // a checkpoint's: "bf16+f32"
  ojson j = {{"kind", "serve-bench"},
             {"config",
              {{"model", s.src.label},
               {"model_dir", o.model_dir.empty() ? ojson(nullptr) : ojson(o.model_dir)},
               {"layers", o.layers},
               {"layer_mix", layer_mix(first_layers(s.src.shape, o.layers))},
               {"hidden_size", s.src.shape.hidden_size},
               {"num_heads", s.src.shape.num_heads},
               {"weights", o.weights},
               {"mlp", o.mlp},
               {"page_size", o.page_size},
               {"max_tokens_per_step", o.max_tokens},
               {"max_seqs", o.max_seqs},
               {"backend", o.backend},
               {"threads", s.threads},
               {"gemm", gemm_backend_name(bf16_weights ? DType::kBF16 : DType::kF32)},
               {"seed", o.seed},
               {"repeats", o.repeats}}},
             {"trace",
              {{"source", s.t.label},
               {"requests", s.t.requests.size()},
               {"prompt_tokens", prompt},
               {"output_tokens", output},
               {"token_slots", s.t.slots},
               {"shared_prefix", o.trace.empty() ? o.shared_prefix : 0},
               {"prefix_groups", o.trace.empty() ? o.prefix_groups : 1},
               {"turns", o.trace.empty() ? o.turns : 1}}},
             {"weight_bytes", s.weights},
             {"rows", jrows},
             {"conclusions", lines},
             {"seconds", s.elapsed}};
  std::printf("%s\n", j.dump(2).c_str());
}

// The notes under the table: what the pool and the states count.
void print_notes(const std::vector<Row>& rows, double elapsed) {
  std::printf(
      "\nKV/token = all layers; KV used / reserved = step-time means of the tokens held and of "
      "the pages\n(or static slots) holding them, plus the linear layers' state per running "
      "sequence; seqs = sequences in one step. Took %.1f s.\n",
      elapsed);
  for (const Row& r : rows)
    if (!r.r.pool_releases_pages) {
      std::printf(
          "%s: its attention layers differ in window / chunk, so they share a pool without one: "
          "a sliding or chunked layer holds every token's K/V, as a full layer does (KV/token "
          "counts every attention layer).\n",
          r.variant.c_str());
      break;
    }
  for (const Row& r : rows)
    if (!r.indexer.is_null()) {
      const ojson& i = r.indexer;
      std::printf(
          "%s: DeepSeek-V3.2's lightning indexer (%s: %s heads of %s, top-%s, %s scales) picks "
          "each query's keys; KV/token includes its fp8 keys, %s B per token per layer.\n",
          r.variant.c_str(), i["from"].get<std::string>().c_str(), i["n_heads"].dump().c_str(),
          i["head_dim"].dump().c_str(), i["topk"].dump().c_str(),
          i["scales"].get<std::string>().c_str(),
          i["key_bytes_per_token_per_layer"].dump().c_str());
      break;
    }
  for (const Row& r : rows)
    if (r.r.state_bytes_per_sequence > 0) {
      std::printf(
          "%s: its linear-attention layers hold %s of state per running sequence, counted in "
          "the budget.\n",
          r.variant.c_str(),
          format_bytes(static_cast<double>(r.r.state_bytes_per_sequence)).c_str());
      break;
    }
}

void print_table(const Served& s, const std::vector<Row>& rows, const ojson& jrows,
                 const std::vector<std::string>& lines) {
  const Options& o = s.o;
  std::printf("serving %s: %lld layer%s%s, %s weights (%s); %d threads\n", s.src.label.c_str(),
              (long long)o.layers, o.layers == 1 ? "" : "s", o.mlp ? " + feed-forward" : "",
              o.weights.c_str(), format_bytes(static_cast<double>(s.weights)).c_str(), s.threads);
  std::printf(
      "trace: %s (%lld token slots); pages of %lld tokens, <= %lld tokens and %lld "
      "sequences per step\n\n",
      s.t.label.c_str(), (long long)s.t.slots, (long long)o.page_size, (long long)o.max_tokens,
      (long long)o.max_seqs);
  Table t({"variant", "KV", "cache", "budget", "KV/token", "out tok/s", "req/s", "TTFT p50", "p90",
           "p99", "TPOT p50", "p90", "p99", "seqs peak", "mean", "KV used", "reserved", "preempt"});
  for (const ojson& r : jrows) {
    t.add({r["variant"].get<std::string>(), r["kv_dtype"].get<std::string>(),
           r["cache"].get<std::string>() + (r["prefix_cache"].get<bool>() ? "+prefix" : ""),
           format_bytes(r["memory_bytes"].get<double>()),
           format_bytes(r["kv_bytes_per_token"].get<double>()),
           format_sig3(r["output_tokens_per_s"].get<double>(), ""),
           format_sig3(r["requests_per_s"].get<double>(), ""), ms(r["ttft_s"], "p50"),
           ms(r["ttft_s"], "p90"), ms(r["ttft_s"], "p99"), ms(r["tpot_s"], "p50"),
           ms(r["tpot_s"], "p90"), ms(r["tpot_s"], "p99"),
           std::to_string(r["peak_running"].get<int64_t>()),
           format_sig3(r["mean_running"].get<double>(), ""),
           format_bytes(r["kv_used_bytes"]["mean"].get<double>()),
           format_bytes(r["kv_reserved_bytes"]["mean"].get<double>()),
           std::to_string(r["preemptions"].get<int64_t>())});
  }
  std::fputs(t.str().c_str(), stdout);
  print_notes(rows, s.elapsed);
  if (!lines.empty()) std::printf("\nWhat this means here:\n");
  for (const std::string& l : lines) std::printf("- %s\n", l.c_str());
}

}  // namespace

int run_serve_bench(int argc, char** argv) {
  Options o;
  if (!parse_options(argc, argv, o)) return 0;
  const Source src = load_source(o);
  const bool checkpoint = !o.model_dir.empty();
  if (!checkpoint) check_servable(src, o.layers);
  const std::vector<Variant> variants =
      checkpoint ? checkpoint_variant(src) : plan_variants(o, src);
  const Trace trace = make_trace(o, vocab_of(o, src));
  try {
    const double t_start = now_seconds();
    std::vector<Built> models = build_models(o, variants);
    size_t weights = 0;
    for (const Built& b : models) weights += b.weight_bytes;
    if (checkpoint) {  // what was served, for the heading and the JSON
      o.layers = src.shape.num_layers;
      o.mlp = true;
      o.weights = models[0].weights;
    }
    const std::vector<Config> configs = plan_configs(o, trace, variants, models);
    const std::vector<Row> rows = run_configs(o, trace, variants, models, configs);
    ojson jrows = ojson::array();
    for (const Row& r : rows) jrows.push_back(row_json(r));
    const std::vector<std::string> lines = conclude(jrows);
    const Served served{o,
                        src,
                        trace,
                        weights,
                        o.threads > 0 ? static_cast<int>(o.threads) : default_threads(),
                        now_seconds() - t_start};
    if (o.csv)
      print_csv(jrows);
    else if (o.json)
      print_json(served, jrows, lines);
    else
      print_table(served, rows, jrows, lines);
    return 0;
  } catch (const RunError& e) {
    std::fprintf(stderr, "attnkit serve-bench: %s\n", e.message.c_str());
    return 1;
  }
}

}  // namespace attnkit::cli
