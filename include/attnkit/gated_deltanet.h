// attnkit/gated_deltanet.h — Qwen3-Next's Gated DeltaNet layer (linear
// attention with a fixed-size state per sequence), as the authors' modeling
// code (transformers' Qwen3NextGatedDeltaNet) computes it.
//
// For x [batch, seq, hidden] (Hk = num_k_heads, Hv = num_v_heads, r = Hv /
// Hk, dk = key_head_dim, dv = value_head_dim, K = conv_kernel):
//
//   qkvz = x in_proj_qkvz^T    per key head g: [q_g (dk) | k_g (dk) |
//                              v of value heads g*r .. g*r+r-1 (r*dv) | z of the same (r*dv)]
//   ba   = x in_proj_ba^T      per key head g: [b (r) | a (r)] of value heads g*r ..
//   mixed = [q of every key head | k of every key head | v of every value head]
//   mixed = silu(causal depthwise conv over time of mixed, kernel K, no bias)
//           (the K - 1 inputs before the first token come from the state, zero at the start)
//   q, k  = q / sqrt(sum q^2 + 1e-6), k likewise (per head), then q *= dk^-0.5
//   g     = -exp(A_log) * softplus(a + dt_bias)     (a log-decay, <= 0)
//   beta  = sigmoid(b)
//   o     = gated delta rule (value head h reads key head h / r; nothing is
//           copied per value head):
//             S <- exp(g) S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q
//   o     = o / sqrt(mean over dv of o^2 + rms_norm_eps) * norm.weight * silu(z)
//           (the weight itself, not 1 + w, unlike Qwen3-Next's other RMSNorms)
//   out   = o out_proj^T
//
// State: a GatedDeltaNetState holds, per sequence, the conv's last K - 1
// inputs and S per value head (f32). forward() with a state continues the
// sequences from it and leaves their end in it, so a prefill followed by
// token-by-token decode computes exactly what one longer call computes (to
// rounding); a fresh state is the start of a sequence. docs/LINEAR_ATTENTION.md
// has the two forms of the recurrence (chunked prefill, recurrent decode).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "attnkit/config.h"
#include "attnkit/model_spec.h"
#include "attnkit/status.h"
#include "attnkit/tensor.h"
#include "attnkit/weights.h"

namespace attnkit {

class LinearStatePool;

// Sizes > 0, num_v_heads a multiple of num_k_heads, rms_norm_eps finite and
// >= 0; errors name the field and its value.
Status validate(const GatedDeltaNetConfig& config);

// Per-sequence state of one Gated DeltaNet layer for `batch_size` sequences.
// Made by GatedDeltaNet::new_state (zeros: the start of every sequence).
class GatedDeltaNetState {
 public:
  GatedDeltaNetState(GatedDeltaNetState&&) noexcept = default;
  GatedDeltaNetState& operator=(GatedDeltaNetState&&) noexcept = default;
  GatedDeltaNetState(const GatedDeltaNetState&) = delete;
  GatedDeltaNetState& operator=(const GatedDeltaNetState&) = delete;

  int64_t batch_size() const { return conv_.dim(0); }
  // [batch, conv_kernel - 1, conv channels] f32: the conv's last inputs,
  // oldest first; channels as `mixed` above (2 * Hk * dk + Hv * dv).
  const TensorView& conv_state() const { return conv_.view(); }
  // [batch, num_v_heads, key_head_dim, value_head_dim] f32: S per value head.
  const TensorView& recurrent_state() const { return recurrent_.view(); }
  // Back to the start of every sequence (zeros).
  void reset();

 private:
  friend class GatedDeltaNet;
  friend class LinearStatePool;
  GatedDeltaNetState() = default;
  Tensor conv_, recurrent_;
};

class GatedDeltaNet {
 public:
  // Validates the config; allocates nothing (an unloaded layer refuses
  // forward()).
  static Result<GatedDeltaNet> create(const GatedDeltaNetConfig& config);

  GatedDeltaNet(GatedDeltaNet&&) noexcept = default;
  GatedDeltaNet& operator=(GatedDeltaNet&&) noexcept = default;
  GatedDeltaNet(const GatedDeltaNet&) = delete;
  GatedDeltaNet& operator=(const GatedDeltaNet&) = delete;

  const GatedDeltaNetConfig& config() const { return config_; }

  // The names load_weights() reads, relative to its prefix (Hugging Face's,
  // under model.layers.{i}.linear_attn.), with shapes (C = 2 * Hk * dk +
  // Hv * dv, the conv channels):
  //   in_proj_qkvz.weight [2 * Hk * dk + 2 * Hv * dv, hidden]  (grouped per key head, above)
  //   in_proj_ba.weight   [2 * Hv, hidden]                     (grouped per key head, above)
  //   conv1d.weight       [C, 1, K]
  //   A_log               [Hv]
  //   dt_bias             [Hv]
  //   norm.weight         [dv]
  //   out_proj.weight     [hidden, Hv * dv]
  std::vector<std::string> weight_names() const;

  // Copies every name above from `weights` as `prefix + name` (prefix e.g.
  // "model.layers.0.linear_attn"). Projection matrices keep a bf16 source
  // as bf16 (kernels::linear runs them as bf16 GEMMs with fp32
  // accumulation); everything else becomes f32. Strict: a missing name, a
  // wrong shape or dtype, another name under the prefix, or a non-finite
  // A_log or dt_bias is an error naming it, and then the layer is unchanged.
  Status load_weights(const WeightMap& weights, std::string_view prefix = "");

  bool loaded() const { return !tensors_.empty(); }

  // A zero state for `batch_size` sequences (>= 1).
  Result<GatedDeltaNetState> new_state(int64_t batch_size) const;

  // x [batch, seq, hidden] f32, any strides -> out [batch, seq, hidden] f32,
  // any strides, must not overlap x. seq may be 0 (nothing happens).
  // state, if given, must come from new_state() of a layer of the same
  // shape, for `batch` sequences; it is read as the sequences' start and
  // updated to their end. Without a state every sequence starts from zero
  // and its end is dropped. Fails, changing neither out nor state, on bad
  // shapes, a state of another batch size or layer shape, or unloaded
  // weights. run.backend kReference runs the recurrence's reference twin
  // (double) and the projections' loop; kAuto/kFast the fast forms.
  Status forward(const TensorView& x, const TensorView& out, GatedDeltaNetState* state = nullptr,
                 const RunOptions& run = {}) const;

  // One continuous-batching step over per-sequence state slots: the new
  // tokens of n sequences packed along one axis, prompts and decodes mixed,
  //   x   [total_tokens, hidden]  f32 (hidden contiguous)
  //   out [total_tokens, hidden]  f32, written; must not overlap x
  // Sequence seq_ids[s] (distinct, held by `states`) owns rows
  // [cu_seqlens_q[s], cu_seqlens_q[s + 1]) (n + 1 entries, from 0,
  // non-decreasing, ending at total_tokens); they run through the
  // recurrence from its slot in layer `layer_index` of `states` (whose
  // config must be this layer's), which is left at their end. Each
  // sequence's rows are one forward() call on its slot, so a sequence's
  // output is bit for bit what forward() gives it alone over the same
  // rows. Fails, changing neither out nor any slot, on bad shapes, ids,
  // cu_seqlens or a pool layer of another shape.
  Status forward_batch(const TensorView& x, std::span<const int32_t> cu_seqlens_q,
                       std::span<const int64_t> seq_ids, LinearStatePool& states,
                       int64_t layer_index, const TensorView& out,
                       const RunOptions& run = {}) const;

 private:
  GatedDeltaNet() = default;

  GatedDeltaNetConfig config_;
  // In weight_names() order; empty until load_weights().
  std::vector<Tensor> tensors_;
};

}  // namespace attnkit
