// Built-in model presets, written as the Hugging Face config.json fields
// that matter for attention so that they go through the same parser as a
// user's --config file. Figures and sources: shared/reference/model-configs.json,
// summarised in docs/ANALYSIS.md (the official HF config.json of each repo).
#include <algorithm>
#include <cctype>
#include <string>

#include "attnkit/analysis.h"

namespace attnkit {
namespace {

struct Preset {
  const char* name;
  const char* source;  // Hugging Face repository the config comes from
  const char* json;
};

constexpr Preset kPresets[] = {
    {"GPT-2", "openai-community/gpt2",
     R"({"model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024})"},
    {"BERT-base", "google-bert/bert-base-uncased",
     R"({"model_type": "bert", "hidden_size": 768, "num_attention_heads": 12,
         "num_hidden_layers": 12, "max_position_embeddings": 512})"},
    {"Llama-2-7B", "meta-llama/Llama-2-7b-hf",
     R"({"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
         "num_key_value_heads": 32, "num_hidden_layers": 32, "max_position_embeddings": 4096,
         "rope_theta": 10000.0, "attention_bias": false})"},
    {"Llama-2-70B", "meta-llama/Llama-2-70b-hf",
     R"({"model_type": "llama", "hidden_size": 8192, "num_attention_heads": 64,
         "num_key_value_heads": 8, "num_hidden_layers": 80, "max_position_embeddings": 4096,
         "rope_theta": 10000.0, "attention_bias": false})"},
    {"Llama-3-8B", "meta-llama/Meta-Llama-3-8B",
     R"({"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
         "num_key_value_heads": 8, "num_hidden_layers": 32, "max_position_embeddings": 8192,
         "rope_theta": 500000.0, "attention_bias": false})"},
    {"Llama-3-70B", "meta-llama/Meta-Llama-3-70B",
     R"({"model_type": "llama", "hidden_size": 8192, "num_attention_heads": 64,
         "num_key_value_heads": 8, "num_hidden_layers": 80, "max_position_embeddings": 8192,
         "rope_theta": 500000.0, "attention_bias": false})"},
    {"Mistral-7B", "mistralai/Mistral-7B-v0.1",
     R"({"model_type": "mistral", "hidden_size": 4096, "num_attention_heads": 32,
         "num_key_value_heads": 8, "num_hidden_layers": 32, "max_position_embeddings": 32768,
         "rope_theta": 10000.0, "sliding_window": 4096})"},
    {"Falcon-7B", "tiiuae/falcon-7b",
     R"({"model_type": "falcon", "hidden_size": 4544, "num_attention_heads": 71,
         "num_hidden_layers": 32, "multi_query": true, "new_decoder_architecture": false,
         "bias": false, "parallel_attn": true, "max_position_embeddings": 2048})"},
    {"Qwen2.5-7B", "Qwen/Qwen2.5-7B",
     R"({"model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28,
         "num_key_value_heads": 4, "num_hidden_layers": 28, "max_position_embeddings": 131072,
         "rope_theta": 1000000.0, "use_sliding_window": false, "sliding_window": 131072,
         "max_window_layers": 28})"},
    {"Qwen3-8B", "Qwen/Qwen3-8B",
     R"({"model_type": "qwen3", "hidden_size": 4096, "num_attention_heads": 32,
         "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 36,
         "max_position_embeddings": 40960, "rope_theta": 1000000.0, "attention_bias": false,
         "use_sliding_window": false, "sliding_window": null, "max_window_layers": 36})"},
    {"Gemma-2-9B", "google/gemma-2-9b",
     R"({"model_type": "gemma2", "hidden_size": 3584, "num_attention_heads": 16,
         "num_key_value_heads": 8, "head_dim": 256, "num_hidden_layers": 42,
         "max_position_embeddings": 8192, "rope_theta": 10000.0, "sliding_window": 4096,
         "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
         "final_logit_softcapping": 30.0, "attention_bias": false})"},
    {"DeepSeek-V2-Lite", "deepseek-ai/DeepSeek-V2-Lite",
     R"({"model_type": "deepseek_v2", "hidden_size": 2048, "num_attention_heads": 16,
         "num_key_value_heads": 16, "num_hidden_layers": 27, "max_position_embeddings": 163840,
         "q_lora_rank": null, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
         "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_theta": 10000,
         "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                          "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}})"},
    {"DeepSeek-V2", "deepseek-ai/DeepSeek-V2",
     R"({"model_type": "deepseek_v2", "hidden_size": 5120, "num_attention_heads": 128,
         "num_key_value_heads": 128, "num_hidden_layers": 60, "max_position_embeddings": 163840,
         "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
         "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_theta": 10000,
         "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                          "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}})"},
    {"DeepSeek-V3", "deepseek-ai/DeepSeek-V3",
     R"({"model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128,
         "num_key_value_heads": 128, "num_hidden_layers": 61, "max_position_embeddings": 163840,
         "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
         "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_theta": 10000,
         "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                          "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}})"},
    {"Kimi-K2", "moonshotai/Kimi-K2-Instruct",
     R"({"model_type": "kimi_k2", "hidden_size": 7168, "num_attention_heads": 64,
         "num_key_value_heads": 64, "num_hidden_layers": 61, "max_position_embeddings": 131072,
         "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
         "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_theta": 50000.0,
         "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                          "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}})"},
};

std::string fold(std::string_view s) {
  std::string out;
  for (char c : s)
    if (std::isalnum(static_cast<unsigned char>(c)))
      out += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

const Preset* find(std::string_view name) {
  const std::string key = fold(name);
  for (const Preset& p : kPresets)
    if (fold(p.name) == key) return &p;
  // Accept the repository name too ("mistral-7b-v0.1", "meta-llama-3-8b").
  for (const Preset& p : kPresets) {
    std::string_view repo = p.source;
    repo = repo.substr(repo.find('/') + 1);
    if (fold(repo) == key) return &p;
  }
  return nullptr;
}

Status unknown(std::string_view name) {
  std::string names;
  for (const Preset& p : kPresets) names += std::string(names.empty() ? "" : ", ") + p.name;
  return not_found("model_preset: '" + std::string(name) + "' is not a preset; presets: " + names);
}

}  // namespace

std::vector<std::string> preset_names() {
  std::vector<std::string> out;
  for (const Preset& p : kPresets) out.emplace_back(p.name);
  return out;
}

Result<std::string> preset_config_json(std::string_view name) {
  const Preset* p = find(name);
  if (p == nullptr) return unknown(name);
  return std::string(p->json);
}

Result<ModelShape> model_preset(std::string_view name) {
  const Preset* p = find(name);
  if (p == nullptr) return unknown(name);
  ATTNKIT_ASSIGN_OR_RETURN(ModelShape m, model_shape_from_json(p->json));
  m.name = p->name;
  m.source = std::string("huggingface.co/") + p->source + " config.json";
  return m;
}

}  // namespace attnkit
