// attnkit/config.h — what one layer is, as plain data: the attention,
// MLA and MoE configurations and the execution knobs every layer takes.
//
// Field names follow Hugging Face. These structs are the contract between
// whoever reads a model's description (io/) and whoever computes a layer
// (layers/): every floor may read this header, and it includes no layer.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "attnkit/attention.h"  // Backend
#include "attnkit/rope.h"
#include "attnkit/status.h"

namespace attnkit {

// Execution knobs shared by the layers.
struct RunOptions {
  Backend backend = Backend::kAuto;
  int num_threads = 0;  // 0 = ATTNKIT_NUM_THREADS or all cores
};

// How a layer normalises each head of q and k (Hugging Face's modules).
enum class QkNorm : uint8_t {
  kNone,
  // Qwen3: RMSNorm(x) * w, per head over head_dim, before RoPE
  // (q_norm.weight, k_norm.weight [head_dim]).
  kRms,
  // Gemma 3, Qwen3-Next: RMSNorm(x) * (1 + w), per head, before RoPE.
  kRmsOnePlus,
  // Llama 4 (Llama4TextL2Norm): x * rsqrt(mean(x^2) + eps), no weight, after
  // RoPE, only on the layers that use RoPE.
  kL2,
};

// One MHA / MQA / GQA attention layer.
struct AttentionConfig {
  std::string model_type;    // "llama", "mistral", "qwen2", "qwen3", ... (informational)
  int64_t hidden_size = 0;   // hidden_size
  int64_t num_heads = 0;     // num_attention_heads
  int64_t num_kv_heads = 0;  // num_key_value_heads (default num_attention_heads)
  int64_t head_dim = 0;      // head_dim (default hidden_size / num_attention_heads)
  bool qkv_bias = false;     // q_proj/k_proj/v_proj carry .bias
  bool o_bias = false;       // o_proj carries .bias
  QkNorm qk_norm = QkNorm::kNone;
  double rms_norm_eps = 1e-6;
  bool use_rope = true;        // false = NoPE (Llama 4's global layers)
  RopeConfig rope;             // rope.head_dim == head_dim
  int64_t sliding_window = 0;  // 0 = none; W = each token sees itself and W-1 before it
  // Chunked local attention (Llama 4's attention_chunk_size): a token sees
  // the tokens of its own chunk of C positions only (k / C == q / C, k <= q).
  // 0 = none.
  int64_t chunk_size = 0;
  float softcap = 0.0f;        // attn_logit_softcapping (Gemma-2); 0 = off
  float softmax_scale = 0.0f;  // 0 = 1/sqrt(head_dim)
  bool causal = true;          // decoder self-attention
  // gpt-oss: one learned logit per query head (self_attn.sinks [num_heads])
  // joins each softmax denominator (AttentionOptions::sinks).
  bool sinks = false;
  // Qwen3-Next: q_proj emits [query | gate] per head (2 * head_dim rows per
  // head) and the attention output is multiplied by sigmoid(gate) before
  // o_proj.
  bool output_gate = false;
  // Llama 4's attn_temperature_tuning (NoPE layers): q is multiplied by
  // log(floor((pos + 1) / floor_scale) + 1) * attn_scale + 1 at absolute
  // position pos.
  bool temperature_tuning = false;
  double floor_scale = 8192.0;
  double attn_scale = 0.1;
};

// Checks the invariants every layer relies on (positive sizes, num_heads %
// num_kv_heads == 0, rope consistent with head_dim, ...).
Status validate(const AttentionConfig& config);

// One MLA layer, field names as in Hugging Face's DeepseekV2/V3 configs.
struct MlaConfig {
  std::string
      model_type;  // "deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2" (informational)
  int64_t hidden_size = 0;          // d
  int64_t num_attention_heads = 0;  // H
  int64_t q_lora_rank = 0;          // d_q; 0 (JSON null or 0) = direct q_proj
  int64_t kv_lora_rank = 0;         // d_c, >= 1
  int64_t qk_nope_head_dim = 0;     // d_n, >= 1
  int64_t qk_rope_head_dim = 0;     // d_r, even, >= 2
  int64_t v_head_dim = 0;           // d_v, >= 1
  double rope_theta = 10000.0;
  // kNone or kYarn. For kYarn: factor, original_max_position_embeddings,
  // beta_fast, beta_slow, mscale, mscale_all_dim (0 = absent).
  RopeScaling rope_scaling;
  double rms_norm_eps = 1e-6;
  int64_t max_position_embeddings = 0;  // informational; 0 = unknown
  // The RoPE pairing of the rope features: true = interleaved (2i, 2i+1),
  // false = half-split (i, i + d_r/2). Hugging Face's rope_interleave.
  bool rope_interleave = true;
  // DeepSeek-V3.2's sparse attention (DSA, model_type deepseek_v32): a
  // lightning indexer of index_n_heads heads of index_head_dim scores every
  // earlier token and MLA attends over the index_topk best only
  // (attnkit/sparse_attention.h). index_n_heads = 0 = dense MLA. With DSA,
  // q_lora_rank >= 1 (the indexer query reads MLA's compressed query),
  // index_head_dim a multiple of 128 (one fp8 scale per 128 values), a
  // power of two (Sylvester's Hadamard) and >= qk_rope_head_dim, index_topk >= 1.
  int64_t index_n_heads = 0;
  int64_t index_head_dim = 0;
  int64_t index_topk = 0;
  // Indexer fp8 scales rounded up to a power of two (DeepSeek's "ue8m0"
  // scale_fmt, what the released V3.2 config sets), else amax / 448.
  bool index_scale_ue8m0 = true;

  bool sparse() const { return index_n_heads > 0; }
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  // Values one token occupies in the latent cache: d_c + d_r.
  int64_t cache_values_per_token() const { return kv_lora_rank + qk_rope_head_dim; }
};

// Sizes >= 1 (q_lora_rank >= 0), qk_rope_head_dim even, rope_theta > 1,
// rms_norm_eps > 0, YaRN fields in range. The message names the field.
Status validate(const MlaConfig& config);

// sigma = qk_head_dim^-1/2 * m^2 (attnkit/latent_attention.h).
double mla_softmax_scale(const MlaConfig& config);

// The MLA layer of a Hugging Face config.json (deepseek_v2, deepseek_v3,
// kimi_k2), read by model_spec_from_json (attnkit/model_spec.h). Required:
// hidden_size, num_attention_heads, q_lora_rank (may be null),
// kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim; a config
// without num_hidden_layers is read as one layer. Errors name the field and
// its value; a config whose layers are not MLA is an error naming its kind.
Result<MlaConfig> mla_config_from_json(std::string_view json_text);

// How LatentAttention computes (attnkit/latent_attention.h).
enum class MlaForm : uint8_t { kAuto, kNaive, kAbsorbed };

// "auto", "naive", "absorbed".
const char* mla_form_name(MlaForm form);

enum class MoeScoringFunc : uint8_t {
  kSoftmax,  // "softmax": over all routed experts (Mixtral, DeepSeek-V2)
  kSigmoid,  // "sigmoid": per expert (DeepSeek-V3, Kimi-K2)
};

enum class MoeTopkMethod : uint8_t {
  kGreedy,              // "greedy": top-k over all experts
  kGroupLimitedGreedy,  // "group_limited_greedy": DeepSeek-V2's group limit
  kNoauxTc,             // "noaux_tc": DeepSeek-V3's bias-corrected group limit
};

// Which Hugging Face weight names the layer reads (see weight_names()).
enum class MoeWeightNaming : uint8_t {
  kDeepseek,  // mlp.gate.*, mlp.experts.{i}.{gate,up,down}_proj, mlp.shared_experts.*
  kMixtral,   // block_sparse_moe.gate, block_sparse_moe.experts.{i}.w1/w3/w2
  kGptOss,    // mlp.router.{weight,bias}, mlp.experts.{gate_up_proj,down_proj}[_bias] (fused)
  // Llama 4: feed_forward.router, feed_forward.experts.{gate_up_proj,down_proj}
  // (fused), feed_forward.shared_expert.{gate,up,down}_proj. Llama4TextMoe
  // scales each chosen expert's input (not its output) by the router weight.
  // MoeLayer does the same.
  kLlama4,
};

// The expert's activation.
enum class MoeActivation : uint8_t {
  // down(silu(gate(x)) * up(x)) (Mixtral, DeepSeek).
  kSwiGlu,
  // gpt-oss: g = min(gate(x), limit), u = clamp(up(x), -limit, limit),
  // down((u + 1) * g * sigmoid(1.702 * g)); limit = swiglu_limit.
  kGptOssSwiGlu,
};

struct MoeConfig {
  std::string model_type;  // "mixtral", "deepseek_v2", "deepseek_v3", "kimi_k2" (informational)
  MoeWeightNaming naming = MoeWeightNaming::kDeepseek;
  int64_t hidden_size = 0;
  int64_t n_routed_experts = 0;       // Mixtral: num_local_experts
  int64_t num_experts_per_tok = 0;    // top-k
  int64_t moe_intermediate_size = 0;  // per routed expert; Mixtral: intermediate_size
  int64_t n_shared_experts = 0;       // shared MLP width = moe_intermediate_size * this; 0 = none
  bool norm_topk_prob = true;
  double routed_scaling_factor = 1.0;
  MoeScoringFunc scoring_func = MoeScoringFunc::kSoftmax;
  MoeTopkMethod topk_method = MoeTopkMethod::kGreedy;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  MoeActivation activation = MoeActivation::kSwiGlu;
  double swiglu_limit = 0.0;  // kGptOssSwiGlu: the clamp (gpt-oss: 7.0)
  bool router_bias = false;   // the router (gate) has a bias (gpt-oss)
  bool expert_bias = false;   // every expert projection has a bias (gpt-oss)
  // Qwen2-MoE / Qwen3-Next: the shared expert is mlp.shared_expert.* (one
  // MLP of width moe_intermediate_size * n_shared_experts) and its output is
  // scaled per token by sigmoid(x . mlp.shared_expert_gate.weight [1, hidden]).
  // Needs kDeepseek names (the router and routed experts are named alike)
  // and n_shared_experts > 0.
  bool shared_expert_gate = false;
};

// The rules MoeLayer::create() enforces, each reported with the field and
// its value: sizes > 0, n_shared_experts >= 0, num_experts_per_tok in [1,
// n_routed_experts], n_group divides n_routed_experts, topk_group in [1,
// n_group], for the group-limited methods topk_group * (experts per group)
// >= num_experts_per_tok and, for noaux_tc with topk_group < n_group, at
// least 2 experts per group; routed_scaling_factor finite and > 0;
// swiglu_limit finite and > 0 for kGptOssSwiGlu; enums in range;
// shared_expert_gate only with kDeepseek names and n_shared_experts > 0.
Status validate(const MoeConfig& config);

// The first MoE layer of a Hugging Face config.json, read by
// model_spec_from_json (attnkit/model_spec.h): mixtral, deepseek_v2,
// deepseek_v3, kimi_k2, qwen2_moe, qwen3_moe, qwen3_next (their gated
// shared expert), gpt_oss, llama4 (its input-scaled routing); without
// model_type the expert-count field decides the family. A config without
// MoE layers is an error naming it.
Result<MoeConfig> moe_config_from_json(std::string_view json_text);

// "softmax", "noaux_tc", ... (the config.json spelling).
const char* moe_scoring_func_name(MoeScoringFunc f);
const char* moe_topk_method_name(MoeTopkMethod m);

// Softmax-attention layer `layer_index` of a Hugging Face config.json, read
// by model_spec_from_json (attnkit/model_spec.h; docs/MODELS.md has every
// family's rules). An error when that layer is another kind (MLA, linear
// attention), or when model_type is a family read for the analysis only
// (gpt2, bert, falcon, gemma); a config without num_hidden_layers describes
// layers 0..layer_index.
Result<AttentionConfig> attention_config_from_json(std::string_view json_text,
                                                   int64_t layer_index = 0);

// The seeds' unified constructor: "mha" (num_kv_heads = num_heads), "mqa"
// (1) or "gqa-N" (N kv heads); head_dim = d_model / num_heads, no RoPE,
// non-causal, biases on all four projections when `bias` is set (as
// nn.Linear's default in the seeds' modules).
Result<AttentionConfig> attention_config_from_variant(std::string_view variant, int64_t d_model,
                                                      int64_t num_heads, bool bias = true);

}  // namespace attnkit
