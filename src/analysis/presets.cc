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
    // DeepSeek-V3.2-Exp's config.json (https://huggingface.co/deepseek-ai/
    // DeepSeek-V3.2-Exp/blob/main/config.json; DeepSeek-V3.2 has the same
    // attention): DeepSeek-V3's shape plus the lightning indexer.
    {"DeepSeek-V3.2", "deepseek-ai/DeepSeek-V3.2-Exp",
     R"({"model_type": "deepseek_v32", "hidden_size": 7168, "num_attention_heads": 128,
         "num_key_value_heads": 128, "num_hidden_layers": 61, "max_position_embeddings": 163840,
         "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
         "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_theta": 10000,
         "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048,
         "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                          "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}})"},
    {"Kimi-K2", "moonshotai/Kimi-K2-Instruct",
     R"({"model_type": "kimi_k2", "hidden_size": 7168, "num_attention_heads": 64,
         "num_key_value_heads": 64, "num_hidden_layers": 61, "max_position_embeddings": 131072,
         "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
         "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_theta": 50000.0,
         "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                          "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}})"},
    // The 2025 families: the config.json as published, the same text as
    // tests/data/configs/ (sources in docs/ANALYSIS.md). Gemma 3 and Llama 4
    // are multimodal wrappers whose text model is text_config.
    {"gpt-oss-20b", "openai/gpt-oss-20b",
     R"({"architectures": ["GptOssForCausalLM"], "attention_bias": true,
         "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4,
         "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
         "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
         "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
         "full_attention", "sliding_attention", "full_attention", "sliding_attention",
         "full_attention", "sliding_attention", "full_attention", "sliding_attention",
         "full_attention", "sliding_attention", "full_attention", "sliding_attention",
         "full_attention", "sliding_attention", "full_attention", "sliding_attention",
         "full_attention", "sliding_attention", "full_attention", "sliding_attention",
         "full_attention"], "max_position_embeddings": 131072, "model_type": "gpt_oss",
         "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
         "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": false,
         "pad_token_id": 199999,
         "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn",
         "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
         "quant_method": "mxfp4"}, "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0,
         "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
         "rope_type": "yarn", "truncate": false}, "rope_theta": 150000,
         "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
         "tie_word_embeddings": false, "transformers_version": "4.55.0.dev0", "use_cache": true,
         "vocab_size": 201088})"},
    {"gpt-oss-120b", "openai/gpt-oss-120b",
     R"({"architectures": ["GptOssForCausalLM"], "attention_bias": true,
         "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4,
         "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
         "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
         "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
         "full_attention", "sliding_attention", "full_attention", "sliding_attention",
         "full_attention", "sliding_attention", "full_attention", "sliding_attention",
         "full_attention", "sliding_attention", "full_attention", "sliding_attention",
         "full_attention", "sliding_attention", "full_attention", "sliding_attention",
         "full_attention", "sliding_attention", "full_attention", "sliding_attention",
         "full_attention", "sliding_attention", "full_attention", "sliding_attention",
         "full_attention", "sliding_attention", "full_attention", "sliding_attention",
         "full_attention", "sliding_attention", "full_attention", "sliding_attention",
         "full_attention"], "max_position_embeddings": 131072, "model_type": "gpt_oss",
         "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 36,
         "num_key_value_heads": 8, "num_local_experts": 128, "output_router_logits": false,
         "pad_token_id": 199999,
         "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn",
         "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
         "quant_method": "mxfp4"}, "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0,
         "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
         "rope_type": "yarn", "truncate": false}, "rope_theta": 150000,
         "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
         "tie_word_embeddings": false, "transformers_version": "4.55.0.dev0", "use_cache": true,
         "vocab_size": 201088})"},
    // As released: no layer_types and no sliding_window_pattern (its
    // default, 6, applies), and gemma-3-4b-it leaves the head counts and
    // head_dim to Gemma3TextConfig's defaults (8, 4, 256).
    {"Gemma-3-4B", "google/gemma-3-4b-it",
     R"({"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
         "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
         "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
         "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
         "model_type": "gemma3_text", "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0,
         "rope_type": "linear"}, "sliding_window": 1024}, "torch_dtype": "bfloat16",
         "transformers_version": "4.50.0.dev0", "vision_config": {"hidden_size": 1152,
         "image_size": 896, "intermediate_size": 4304, "model_type": "siglip_vision_model",
         "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14,
         "vision_use_head": false}})"},
    {"Gemma-3-27B", "google/gemma-3-27b-it",
     R"({"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
         "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
         "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
         "text_config": {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504,
         "model_type": "gemma3_text", "num_attention_heads": 32, "num_hidden_layers": 62,
         "num_key_value_heads": 16, "query_pre_attn_scalar": 168,
         "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
         "sliding_window_pattern": 6}, "torch_dtype": "bfloat16",
         "transformers_version": "4.50.0.dev0", "vision_config": {"hidden_size": 1152,
         "image_size": 896, "intermediate_size": 4304, "model_type": "siglip_vision_model",
         "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14,
         "vision_use_head": false}})"},
    {"Llama-4-Scout", "meta-llama/Llama-4-Scout-17B-16E",
     R"({"architectures": ["Llama4ForConditionalGeneration"], "boi_token_index": 200080,
         "eoi_token_index": 200081, "image_token_index": 200092, "model_type": "llama4",
         "text_config": {"attention_bias": false, "attention_chunk_size": 8192,
         "attention_dropout": 0.0, "attn_scale": 0.1, "attn_temperature_tuning": 4,
         "bos_token_id": 200000, "cache_implementation": "hybrid", "eos_token_id": [200001,
         200007, 200008], "floor_scale": 8192, "for_llm_compressor": false, "head_dim": 128,
         "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02,
         "interleave_moe_layer_step": 1, "intermediate_size": 8192,
         "intermediate_size_mlp": 16384, "max_position_embeddings": 10485760,
         "model_type": "llama4_text", "moe_layers": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
         13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34,
         35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47], "no_rope_layers": [1, 1, 1, 0, 1,
         1, 1, 0, 1, 1, 1, 0, 1, 1, 1, 0, 1, 1, 1, 0, 1, 1, 1, 0, 1, 1, 1, 0, 1, 1, 1, 0, 1, 1,
         1, 0, 1, 1, 1, 0, 1, 1, 1, 0, 1, 1, 1, 0], "num_attention_heads": 40,
         "num_experts_per_tok": 1, "num_hidden_layers": 48, "num_key_value_heads": 8,
         "num_local_experts": 16, "output_router_logits": false, "pad_token_id": 200018,
         "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0,
         "low_freq_factor": 1.0, "original_max_position_embeddings": 8192,
         "rope_type": "llama3"}, "rope_theta": 500000.0, "router_aux_loss_coef": 0.001,
         "router_jitter_noise": 0.0, "torch_dtype": "bfloat16", "use_qk_norm": true,
         "vocab_size": 202048}, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
         "transformers_version": "4.51.0.dev0", "vision_config": {"hidden_size": 1408,
         "image_size": 336, "model_type": "llama4_vision_model", "num_attention_heads": 16,
         "num_channels": 3, "num_hidden_layers": 34, "patch_size": 14,
         "pixel_shuffle_ratio": 0.5, "rope_theta": 10000, "vision_output_dim": 4096}})"},
    {"Qwen3-Next-80B-A3B", "Qwen/Qwen3-Next-80B-A3B-Instruct",
     R"({"architectures": ["Qwen3NextForCausalLM"], "attention_bias": false,
         "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
         "eos_token_id": 151645, "full_attention_interval": 4, "head_dim": 256,
         "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
         "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
         "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
         "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_next",
         "moe_intermediate_size": 512, "norm_topk_prob": true, "num_attention_heads": 16,
         "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48,
         "num_key_value_heads": 2, "output_router_logits": false, "partial_rotary_factor": 0.25,
         "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 10000000,
         "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512,
         "tie_word_embeddings": false, "torch_dtype": "bfloat16",
         "transformers_version": "4.57.0.dev0", "use_cache": true, "use_sliding_window": false,
         "vocab_size": 151936})"},
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
