// attnkit/moe.h — the mixture-of-experts feed-forward (Mixtral, DeepSeek-V2,
// DeepSeek-V3 / Kimi-K2, Qwen2-MoE / Qwen3-MoE / Qwen3-Next, gpt-oss).
//
// For each token x (a row of hidden_size values):
//
//   logits = x Wg^T                                   Wg [n_routed_experts, hidden]
//   score  = softmax(logits)  or  sigmoid(logits)      (scoring_func)
//   choice = score + e_score_correction_bias           (noaux_tc only; else score)
//   groups: experts split into n_group equal groups of consecutive ids;
//     group_limited_greedy: group score = max choice in the group
//     noaux_tc:             group score = sum of the group's two largest choices
//     keep the topk_group best groups; experts elsewhere cannot be chosen
//     (greedy: every expert is a candidate)
//   chosen = the num_experts_per_tok candidates with the largest choice
//   w_i    = score[chosen_i]  (the score, never the biased choice)
//   norm_topk_prob: w_i /= (sum_i w_i + 1e-20)
//   w_i   *= routed_scaling_factor
//   y = sum_i w_i * expert_{chosen_i}(x)      (in increasing expert id order;
//                                              Llama 4: expert_{chosen_i}(w_i * x),
//                                              the weight scales the input)
//     + shared_expert(x)                      (n_shared_experts > 0)
//       * sigmoid(x . w_sg)                   (shared_expert_gate: Qwen2-MoE,
//                                              Qwen3-Next; w_sg [hidden])
//   expert(x) = down(silu(gate(x)) * up(x))   (SwiGLU, no biases)
//
// Ties: where scores are exactly equal the lower expert id (or group id)
// wins. torch.topk leaves this choice unspecified (torch 1.13 on the CPU may
// return a higher index first), so attnkit fixes it.
//
// Only the chosen experts run: tokens are grouped by expert and each expert
// with at least one token runs one projection over exactly its tokens. An
// expert no token chose costs nothing. docs/MOE.md has the per-family
// defaults and the differences from Hugging Face's code.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "attnkit/config.h"
#include "attnkit/status.h"
#include "attnkit/tensor.h"
#include "attnkit/weights.h"

namespace attnkit {

// validate(MoeConfig), moe_config_from_json and the enum names live in
// attnkit/config.h.

// What the router decided in one forward call.
struct MoeRouting {
  int64_t num_tokens = 0;  // batch * seq; token t = b * seq + s
  int64_t top_k = 0;       // num_experts_per_tok
  // [num_tokens, top_k]: token t's experts, largest choice first (ties:
  // lower id first), and the final weight applied to each (after
  // normalisation and routed_scaling_factor).
  std::vector<int32_t> expert_ids;
  std::vector<float> weights;
  // [n_routed_experts]: how many tokens chose each expert (load balance);
  // sums to num_tokens * top_k.
  std::vector<int64_t> tokens_per_expert;
};

class MoeLayer {
 public:
  // Validates the config; allocates nothing (an unloaded layer refuses
  // forward()), so a full-size config costs nothing until load_weights().
  static Result<MoeLayer> create(const MoeConfig& config);

  // Move-only: a full-size layer holds gigabytes of weights.
  MoeLayer(MoeLayer&&) noexcept = default;
  MoeLayer& operator=(MoeLayer&&) noexcept = default;
  MoeLayer(const MoeLayer&) = delete;
  MoeLayer& operator=(const MoeLayer&) = delete;

  const MoeConfig& config() const { return config_; }

  // One weight: its name after the block prefix ("gate.weight",
  // "experts.3.w1.weight"), shape [rows, cols] (cols == 0: [rows]; depth >
  // 0: [rows, cols, depth]) and what the dims mean, for error messages.
  struct WeightSpec {
    std::string name;
    int64_t rows = 0, cols = 0;
    const char* meaning = "";
    int64_t depth = 0;
  };
  // Every weight in load order, as weight_names() lists them (with the
  // block prefix): the gate, the correction bias (noaux_tc), gate/up/down
  // of expert 0, 1, ..., those of the shared experts, then the shared
  // expert's gate (Qwen2-MoE, Qwen3-Next); the fused namings differ (see
  // load_weights). The layer's tensors follow this order; a benchmark's
  // random weights are made from it.
  std::vector<WeightSpec> weight_specs() const;

  // The names load_weights() reads, relative to its prefix, with shapes
  // (E = n_routed_experts, H = hidden_size, I = moe_intermediate_size,
  // S = I * n_shared_experts):
  //   DeepSeek: mlp.gate.weight [E, H]
  //             mlp.gate.e_score_correction_bias [E]           (noaux_tc only)
  //             mlp.experts.{i}.gate_proj.weight [I, H]
  //             mlp.experts.{i}.up_proj.weight   [I, H]
  //             mlp.experts.{i}.down_proj.weight [H, I]
  //             mlp.shared_experts.{gate,up}_proj.weight [S, H],
  //             mlp.shared_experts.down_proj.weight [H, S]       (S > 0 only)
  //   Qwen2-MoE / Qwen3-Next (kDeepseek with shared_expert_gate): the
  //             router and experts as DeepSeek's, and one gated shared expert
  //             mlp.shared_expert.{gate,up}_proj.weight [S, H],
  //             mlp.shared_expert.down_proj.weight [H, S],
  //             mlp.shared_expert_gate.weight [1, H]
  //   Mixtral:  block_sparse_moe.gate.weight [E, H]
  //             block_sparse_moe.experts.{i}.w1.weight [I, H]  (gate)
  //             block_sparse_moe.experts.{i}.w3.weight [I, H]  (up)
  //             block_sparse_moe.experts.{i}.w2.weight [H, I]  (down)
  //   gpt-oss:  mlp.router.weight [E, H], mlp.router.bias [E]     (router_bias)
  //             mlp.experts.gate_up_proj [E, H, 2I]   x @ W: gate in the even
  //                                                   columns, up in the odd
  //             mlp.experts.gate_up_proj_bias [E, 2I] (expert_bias), interleaved
  //             mlp.experts.down_proj [E, I, H]       x @ W (not nn.Linear's)
  //             mlp.experts.down_proj_bias [E, H]     (expert_bias)
  //             repacked at load into per-expert nn.Linear matrices, so the
  //             fused expert tensors are not kept (weight() names them as
  //             such); routing is the softmax over the top-k router logits,
  //             which scoring_func kSoftmax with norm_topk_prob computes.
  //   Llama 4:  feed_forward.router.weight [E, H]
  //             feed_forward.experts.gate_up_proj [E, H, 2I]  x @ W: gate in
  //                                   the first I columns, up in the last I
  //             feed_forward.experts.down_proj [E, I, H]      x @ W
  //             feed_forward.shared_expert.{gate,up}_proj.weight [S, H],
  //             feed_forward.shared_expert.down_proj.weight [H, S]  (S > 0 only)
  //             repacked at load like gpt-oss's; routing is sigmoid of the
  //             chosen router logits (top-k by logit), not renormalised, and
  //             each weight scales its expert's input (Llama4TextMoe).
  std::vector<std::string> weight_names() const;

  // Copies every name above from `weights` as `prefix + name` (prefix e.g.
  // "model.layers.3." or "model.layers.3"). Matrices keep a bf16 source as
  // bf16 (no f32 copy; the experts and router then run as bf16 GEMMs with
  // fp32 accumulation, see AttentionLayer::load_weights); every other
  // source dtype, and the correction bias, become f32. Strict: a
  // missing name, a wrong shape or dtype, or any other name under
  // prefix + "mlp." (or "block_sparse_moe.") is an error, and then the
  // layer is unchanged.
  Status load_weights(const WeightMap& weights, std::string_view prefix = "");

  bool loaded() const { return !tensors_.empty(); }

  // The layer's copy of one weight (f32, or bf16 as loaded), by a name from
  // weight_names().
  Result<TensorView> weight(std::string_view name) const;

  // x [batch, seq, hidden] f32, any strides -> out [batch, seq, hidden] f32,
  // any strides, must not overlap x. routing, if given, receives the
  // routing. Fails (writing neither out nor routing) on bad shapes, when the
  // weights are not loaded, or when a token's router logits are not finite
  // (NaN or Inf in x or the gate). Results do not depend on
  // run.num_threads: each token's sum runs in expert id order. run.backend
  // is checked but there is one implementation (kernels::linear).
  Status forward(const TensorView& x, const TensorView& out, MoeRouting* routing = nullptr,
                 const RunOptions& run = {}) const;

 private:
  MoeLayer() = default;

  MoeConfig config_;
  // nn.Linear layout, matrices f32 or bf16 (as loaded); empty until
  // load_weights(). gpt-oss and Llama 4: the router, then each expert's
  // repacked gate, up and down, then (Llama 4) the shared expert's.
  std::vector<Tensor> tensors_;
  // gpt-oss's biases, f32: router [E], gate and up [E, I] (de-interleaved),
  // down [E, H]; empty otherwise.
  Tensor router_bias_, gate_bias_, up_bias_, down_bias_;
};

}  // namespace attnkit
