// attnkit/rope.h — rotary position embedding (RoPE).
//
// Each pair of features (x_a, x_b) of the first `rotary_dim` features of a
// head is rotated by the angle pos * inv_freq[i]:
//   x_a' = x_a cos - x_b sin,   x_b' = x_b cos + x_a sin
// Which features form pair i is the pairing (rotary_dim = 8, pairs 0..3):
//
//   kHalfSplit (GPT-NeoX, Hugging Face Llama/Mistral/Qwen, "rotate_half"):
//     features: 0 1 2 3 | 4 5 6 7      pair i = (i, i + rotary_dim/2)
//     pairs:    0 1 2 3 | 0 1 2 3
//   kInterleaved (GPT-J, Meta's Llama code, DeepSeek MLA checkpoints):
//     features: 0 1 | 2 3 | 4 5 | 6 7  pair i = (2i, 2i + 1)
//     pairs:    0 0 | 1 1 | 2 2 | 3 3
//
// Features at and beyond rotary_dim pass through unchanged (partial RoPE).
// inv_freq[i] = theta^(-2i / rotary_dim), then adjusted by the scaling
// variant exactly as Hugging Face's rope utilities do (linear, llama3, yarn).
// YaRN additionally multiplies cos and sin by attention_factor().
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "attnkit/status.h"
#include "attnkit/tensor.h"

namespace attnkit {

enum class RopePairing : uint8_t { kHalfSplit, kInterleaved };

struct RopeScaling {
  enum class Type : uint8_t { kNone, kLinear, kLlama3, kYarn };
  Type type = Type::kNone;
  double factor = 1.0;  // linear, llama3, yarn: > 0 (llama3/yarn: >= 1)
  // llama3
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  // llama3 and yarn: the pre-extension context length.
  int64_t original_max_position_embeddings = 0;
  // yarn
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  // yarn: 0 = absent. attention_factor, if > 0, overrides the derived one.
  double mscale = 0.0;
  double mscale_all_dim = 0.0;
  double attention_factor = 0.0;
  // yarn: true rounds the correction range [low, high] outward to whole
  // dimensions (floor / ceil), as transformers' default; false keeps them
  // fractional (gpt-oss's "truncate": false).
  bool truncate = true;
};

struct RopeConfig {
  int64_t head_dim = 0;    // features per head the rotation is applied to
  int64_t rotary_dim = 0;  // 0 = head_dim; even, <= head_dim
  double theta = 10000.0;  // rope_theta
  RopePairing pairing = RopePairing::kHalfSplit;
  RopeScaling scaling;
};

class Rope {
 public:
  // Validates the config: head_dim > 0, rotary_dim even and in (0, head_dim],
  // theta > 1, scaling fields in range.
  static Result<Rope> create(const RopeConfig& config);

  const RopeConfig& config() const { return config_; }
  int64_t rotary_dim() const { return config_.rotary_dim; }
  // [rotary_dim / 2] inverse frequencies after scaling.
  std::span<const double> inv_freq() const { return inv_freq_; }
  // cos/sin multiplier: YaRN's mscale ratio, 1 otherwise.
  double attention_factor() const { return attention_factor_; }

  // Rotates x in place.
  //   x         [batch, seq, heads, head_dim] f32, any strides
  //   positions [seq] (shared by the batch) or [batch * seq] (row-major
  //             [batch, seq]); each >= 0
  Status apply(const TensorView& x, std::span<const int64_t> positions) const;

 private:
  RopeConfig config_;
  std::vector<double> inv_freq_;
  double attention_factor_ = 1.0;
};

}  // namespace attnkit
