// Rope: validates the config once, precomputes the scaled inverse
// frequencies (in double, following Hugging Face's rope utilities formula by
// formula), and rotates activations in place. apply() checks every argument
// and every position before it writes anything.
#include "attnkit/rope.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <numbers>
#include <string>
#include <utility>
#include <vector>

#include "core/check.h"
#include "core/checked_math.h"

namespace attnkit {
namespace {

constexpr const char* kCreate = "Rope::create";
constexpr const char* kApply = "Rope::apply";

// Short, round-trippable enough for messages ("0.5", "1e+06", "nan").
std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.10g", v);
  return buf;
}

Status bad(const char* fn, const std::string& what) {
  return invalid_argument(std::string(fn) + ": " + what);
}

// YaRN's magnitude correction: 0.1 * mscale * ln(scale) + 1, and 1 when the
// context is not extended (scale <= 1).
double yarn_mscale(double scale, double mscale) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

// The (fractional) pair index whose wavelength makes `num_rotations` full
// turns over the original context; YaRN's boundary between pairs that keep
// their frequency and pairs that are interpolated.
double yarn_correction_dim(double num_rotations, double dim, double theta, double orig_ctx) {
  return dim * std::log(orig_ctx / (num_rotations * 2.0 * std::numbers::pi)) /
         (2.0 * std::log(theta));
}

Status check_scaling(const RopeScaling& s) {
  using Type = RopeScaling::Type;
  if (s.type != Type::kNone && s.type != Type::kLinear && s.type != Type::kLlama3 &&
      s.type != Type::kYarn)
    return bad(kCreate, "scaling.type = " + std::to_string(static_cast<int>(s.type)) +
                            " is not a RopeScaling::Type value");
  if (s.type == Type::kNone) return Status::Ok();

  const double min_factor = s.type == Type::kLinear ? 0.0 : 1.0;
  if (!std::isfinite(s.factor) || s.factor < min_factor || s.factor == 0.0)
    return bad(kCreate, "scaling.factor = " + num(s.factor) +
                            (s.type == Type::kLinear ? " must be finite and > 0"
                                                     : " must be finite and >= 1"));
  if (s.type == Type::kLinear) return Status::Ok();

  if (s.original_max_position_embeddings <= 0)
    return bad(kCreate, "scaling.original_max_position_embeddings = " +
                            std::to_string(s.original_max_position_embeddings) + " must be > 0");

  if (s.type == Type::kLlama3) {
    if (!std::isfinite(s.low_freq_factor) || s.low_freq_factor <= 0.0)
      return bad(kCreate,
                 "scaling.low_freq_factor = " + num(s.low_freq_factor) + " must be finite and > 0");
    // Equal factors (Llama 4 Scout publishes 1 and 1) leave no blend band.
    if (!std::isfinite(s.high_freq_factor) || !(s.low_freq_factor <= s.high_freq_factor))
      return bad(kCreate,
                 "scaling.high_freq_factor = " + num(s.high_freq_factor) +
                     " must be finite and >= scaling.low_freq_factor = " + num(s.low_freq_factor));
    return Status::Ok();
  }

  // YaRN. beta_fast == beta_slow is allowed: Kimi-K2 ships 1.0 / 1.0, and
  // the ramp's +0.001 guard keeps it well defined.
  if (!std::isfinite(s.beta_slow) || s.beta_slow <= 0.0)
    return bad(kCreate, "scaling.beta_slow = " + num(s.beta_slow) + " must be finite and > 0");
  if (!std::isfinite(s.beta_fast) || s.beta_fast < s.beta_slow)
    return bad(kCreate, "scaling.beta_fast = " + num(s.beta_fast) +
                            " must be finite and >= scaling.beta_slow = " + num(s.beta_slow));
  const std::pair<const char*, double> nonneg[] = {
      {"scaling.mscale", s.mscale},
      {"scaling.mscale_all_dim", s.mscale_all_dim},
      {"scaling.attention_factor", s.attention_factor}};
  for (const auto& [name, v] : nonneg)
    if (!std::isfinite(v) || v < 0.0)
      return bad(kCreate,
                 std::string(name) + " = " + num(v) + " must be finite and >= 0 (0 = absent)");
  return Status::Ok();
}

// Hugging Face's _compute_llama3_parameters: pairs whose wavelength is
// shorter than orig/high_freq_factor keep their frequency, those longer than
// orig/low_freq_factor are divided by factor, and the band between is a
// linear blend in orig/wavelength. With equal factors the band is a single
// wavelength, where transformers divides 0 by 0; such a pair keeps its
// frequency here.
void apply_llama3(const RopeScaling& s, std::vector<double>& inv_freq) {
  const double orig = static_cast<double>(s.original_max_position_embeddings);
  const double low_wavelen = orig / s.low_freq_factor;
  const double high_wavelen = orig / s.high_freq_factor;
  for (double& f : inv_freq) {
    const double wavelen = 2.0 * std::numbers::pi / f;
    if (wavelen > low_wavelen) {
      f /= s.factor;
      continue;
    }
    if (wavelen < high_wavelen || s.high_freq_factor == s.low_freq_factor) continue;
    const double smooth =
        (orig / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    f = (1.0 - smooth) * f / s.factor + smooth * f;
  }
}

// Hugging Face's _compute_yarn_parameters: pair i blends the interpolated
// frequency f/factor and the original f with a ramp that is 0 below the
// beta_fast boundary and 1 above the beta_slow one; truncate rounds the
// boundaries outward to whole pairs first (gpt-oss sets it false).
void apply_yarn(const RopeScaling& s, double theta, int64_t rotary_dim,
                std::vector<double>& inv_freq) {
  const double dim = static_cast<double>(rotary_dim);
  const double orig = static_cast<double>(s.original_max_position_embeddings);
  double low = yarn_correction_dim(s.beta_fast, dim, theta, orig);
  double high = yarn_correction_dim(s.beta_slow, dim, theta, orig);
  if (s.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, dim - 1.0);
  if (low == high) high += 0.001;  // the reference's guard against 0/0
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    const double f = inv_freq[i];
    inv_freq[i] = f / s.factor * ramp + f * (1.0 - ramp);
  }
}

double yarn_attention_factor(const RopeScaling& s) {
  if (s.attention_factor > 0.0) return s.attention_factor;
  if (s.mscale > 0.0 && s.mscale_all_dim > 0.0)
    return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim);
  return yarn_mscale(s.factor, 1.0);
}

}  // namespace

Result<Rope> Rope::create(const RopeConfig& config) {
  if (config.head_dim <= 0)
    return bad(kCreate, "head_dim = " + std::to_string(config.head_dim) + " must be > 0");
  const int64_t rotary_dim = config.rotary_dim == 0 ? config.head_dim : config.rotary_dim;
  if (rotary_dim < 0 || rotary_dim > config.head_dim || rotary_dim % 2 != 0)
    return bad(kCreate, "rotary_dim = " + std::to_string(config.rotary_dim) +
                            " must be even and in (0, head_dim = " +
                            std::to_string(config.head_dim) + "] (0 = head_dim)");
  if (!std::isfinite(config.theta) || !(config.theta > 1.0))
    return bad(kCreate, "theta = " + num(config.theta) + " must be finite and > 1");
  if (config.pairing != RopePairing::kHalfSplit && config.pairing != RopePairing::kInterleaved)
    return bad(kCreate, "pairing = " + std::to_string(static_cast<int>(config.pairing)) +
                            " is not a RopePairing value");
  ATTNKIT_RETURN_IF_ERROR(check_scaling(config.scaling));

  Rope rope;
  rope.config_ = config;
  rope.config_.rotary_dim = rotary_dim;
  try {
    rope.inv_freq_.resize(static_cast<size_t>(rotary_dim / 2));
  } catch (const std::exception&) {
    return resource_exhausted(std::string(kCreate) + ": cannot allocate " +
                              std::to_string(rotary_dim / 2) + " inverse frequencies");
  }
  for (int64_t i = 0; i < rotary_dim / 2; ++i)
    rope.inv_freq_[static_cast<size_t>(i)] =
        1.0 / std::pow(config.theta, static_cast<double>(2 * i) / static_cast<double>(rotary_dim));

  const RopeScaling& s = config.scaling;
  switch (s.type) {
    case RopeScaling::Type::kNone:
      break;
    case RopeScaling::Type::kLinear:
      for (double& f : rope.inv_freq_) f /= s.factor;
      break;
    case RopeScaling::Type::kLlama3:
      apply_llama3(s, rope.inv_freq_);
      break;
    case RopeScaling::Type::kYarn:
      apply_yarn(s, config.theta, rotary_dim, rope.inv_freq_);
      rope.attention_factor_ = yarn_attention_factor(s);
      break;
  }
  return rope;
}

Status Rope::apply(const TensorView& x, std::span<const int64_t> positions) const {
  ATTNKIT_RETURN_IF_ERROR(check::view(kApply, "x", x, 4, {DType::kF32}));
  ATTNKIT_RETURN_IF_ERROR(
      check::dim(kApply, "x", x, 3, "head_dim", config_.head_dim, "config().head_dim"));
  const int64_t batch = x.shape[0], seq = x.shape[1], heads = x.shape[2];
  // Rotation writes every element it reads from a pair; a zero stride would
  // make distinct (token, head, feature) slots the same memory. (An empty
  // view addresses nothing, and row-major strides of one can be 0.)
  const bool empty = x.numel() == 0;
  for (int i = 0; i < 4 && !empty; ++i)
    if (x.shape[i] > 1 && x.strides[i] == 0)
      return bad(kApply, "x.strides[" + std::to_string(i) + "] = 0 with x.shape[" +
                             std::to_string(i) + "] = " + std::to_string(x.shape[i]) +
                             ": an in-place output must not broadcast");
  int64_t tokens;
  if (!checked_mul(batch, seq, &tokens))
    return bad(kApply, "x " + x.describe() + ": batch * seq overflows 64 bits");
  ATTNKIT_RETURN_IF_ERROR(check::positions(kApply, positions, seq, tokens, false));
  const int64_t npos = static_cast<int64_t>(positions.size());
  if (tokens == 0 || heads == 0) return Status::Ok();

  const int64_t half = config_.rotary_dim / 2;
  // cos in [0, half), sin in [half, 2 * half), both times attention_factor.
  std::vector<double> cs;
  try {
    cs.resize(static_cast<size_t>(2 * half));
  } catch (const std::exception&) {
    return resource_exhausted(std::string(kApply) + ": cannot allocate " +
                              std::to_string(2 * half) + " doubles of cos/sin scratch");
  }
  // Feature offsets of the two members of pair i.
  const bool interleaved = config_.pairing == RopePairing::kInterleaved;
  const int64_t step_a = interleaved ? 2 : 1;
  const int64_t offset_b = interleaved ? 1 : half;
  const int64_t sd = x.strides[3];
  float* base = x.ptr<float>();

  const bool shared = npos == seq && tokens != seq;
  // One cos/sin table per position row; a shared row serves every batch entry.
  for (int64_t r = 0; r < npos; ++r) {
    const double pos = static_cast<double>(positions[static_cast<size_t>(r)]);
    for (int64_t i = 0; i < half; ++i) {
      const double angle = pos * inv_freq_[static_cast<size_t>(i)];
      cs[static_cast<size_t>(i)] = std::cos(angle) * attention_factor_;
      cs[static_cast<size_t>(half + i)] = std::sin(angle) * attention_factor_;
    }
    const int64_t s = shared ? r : r % seq;
    const int64_t b_begin = shared ? 0 : r / seq;
    const int64_t b_end = shared ? batch : b_begin + 1;
    for (int64_t b = b_begin; b < b_end; ++b) {
      for (int64_t h = 0; h < heads; ++h) {
        float* row = base + b * x.strides[0] + s * x.strides[1] + h * x.strides[2];
        for (int64_t i = 0; i < half; ++i) {
          float* pa = row + (i * step_a) * sd;
          float* pb = row + (i * step_a + offset_b) * sd;
          const double xa = *pa, xb = *pb;
          const double c = cs[static_cast<size_t>(i)], sn = cs[static_cast<size_t>(half + i)];
          *pa = static_cast<float>(xa * c - xb * sn);
          *pb = static_cast<float>(xb * c + xa * sn);
        }
      }
    }
  }
  return Status::Ok();
}

}  // namespace attnkit
