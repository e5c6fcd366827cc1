// GatedDeltaNet: projections (kernels::linear), the causal depthwise conv
// and its rolling state, the per-head normalisations and gates, and the
// recurrence through kernels::run_gated_delta_rule.
//
// forward() buffers, all allocated before anything the caller sees is
// written (T = batch * seq tokens, C conv channels):
//   qkvz  [T, 2 Hk dk + 2 Hv dv]  the input projection, grouped per key head
//   ba    [T, 2 Hv]
//   mixed [T, C]   q | k | v gathered from qkvz, then convolved in place
//   gb    [2, T, Hv]  g, then beta
//   core  [T, Hv dv]  the recurrence's output, normalised and gated in place
//   conv  [batch, K - 1, C]  the new conv state, committed after the recurrence
#include <algorithm>
#include <cmath>
#include <string>

#include "attnkit/gated_deltanet.h"
#include "core/check.h"
#include "core/checked_math.h"
#include "core/threads.h"
#include "io/weight_loader.h"
#include "kernels/dispatch.h"
#include "kernels/linear.h"

namespace attnkit {
namespace {

constexpr const char* kFwd = "GatedDeltaNet::forward";
constexpr const char* kLoad = "GatedDeltaNet::load_weights";
constexpr const char* kState = "GatedDeltaNet::new_state";

// The authors' l2norm adds this to the sum of squares (FLA's value), not
// rms_norm_eps.
constexpr double kL2NormEps = 1e-6;
// g is floored here: exp(g) is already 0 in double (and f32) below about
// -745, so no result changes, and a chunk's cumulative sums stay finite
// (an infinite g would make exp(G_i - G_j) NaN in the chunked form).
constexpr double kMinLogDecay = -1000.0;

// Positions in tensors_ (the order of weight_names()).
enum : size_t { kQkvz, kBa, kConv, kALog, kDtBias, kNorm, kOut, kNumWeights };

int64_t conv_channels(const GatedDeltaNetConfig& c) {
  return 2 * c.num_k_heads * c.key_head_dim + c.num_v_heads * c.value_head_dim;
}

Status check_io(const char* name, const TensorView& v, int64_t hidden) {
  ATTNKIT_RETURN_IF_ERROR(check::view(kFwd, name, v, 3, {DType::kF32}));
  ATTNKIT_RETURN_IF_ERROR(
      check::dim(kFwd, name, v, 2, "hidden_size", hidden, "config().hidden_size"));
  if (v.shape[2] > 1 && v.strides[2] != 1)
    return invalid_argument(std::string(kFwd) + ": " + name +
                            ".strides[2] = " + std::to_string(v.strides[2]) +
                            " must be 1 (the hidden dimension must be contiguous)");
  return Status::Ok();
}

Status zeros(const char* what, std::initializer_list<int64_t> shape, Tensor* t) {
  auto r = Tensor::zeros(DType::kF32, shape);
  if (!r.ok())
    return Status(r.status().code(),
                  std::string(kFwd) + ": scratch for " + what + ": " + r.status().message());
  *t = std::move(r).value();
  return Status::Ok();
}

double softplus(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }
double silu(double x) { return x / (1.0 + std::exp(-x)); }

}  // namespace

Status validate(const GatedDeltaNetConfig& c) {
  const char* fn = "GatedDeltaNet::create";
  const std::pair<const char*, int64_t> sizes[] = {
      {"hidden_size", c.hidden_size},       {"num_k_heads", c.num_k_heads},
      {"num_v_heads", c.num_v_heads},       {"key_head_dim", c.key_head_dim},
      {"value_head_dim", c.value_head_dim}, {"conv_kernel", c.conv_kernel}};
  for (const auto& [name, value] : sizes)
    if (value <= 0)
      return invalid_argument(std::string(fn) + ": config." + name + " = " + std::to_string(value) +
                              " must be > 0");
  if (c.num_v_heads % c.num_k_heads != 0)
    return invalid_argument(
        std::string(fn) + ": config.num_v_heads = " + std::to_string(c.num_v_heads) +
        " must be a multiple of config.num_k_heads = " + std::to_string(c.num_k_heads));
  if (!std::isfinite(c.rms_norm_eps) || c.rms_norm_eps < 0)
    return invalid_argument(std::string(fn) + ": config.rms_norm_eps = " +
                            std::to_string(c.rms_norm_eps) + " must be finite and >= 0");
  // Every buffer size below must fit in int64: the largest is the qkvz row
  // times the hidden size, and the state.
  int64_t row = 0, w = 0, s = 0;
  if (!checked_mul(2, c.num_k_heads * c.key_head_dim + c.num_v_heads * c.value_head_dim, &row) ||
      !checked_mul(row, c.hidden_size, &w) ||
      !checked_mul(c.num_v_heads * c.key_head_dim, c.value_head_dim, &s) ||
      !checked_mul(conv_channels(c), c.conv_kernel, &s))
    return invalid_argument(std::string(fn) + ": config sizes overflow 64-bit element counts");
  return Status::Ok();
}

void GatedDeltaNetState::reset() {
  std::fill_n(conv_.ptr<float>(), conv_.numel(), 0.0f);
  std::fill_n(recurrent_.ptr<float>(), recurrent_.numel(), 0.0f);
}

Result<GatedDeltaNet> GatedDeltaNet::create(const GatedDeltaNetConfig& config) {
  ATTNKIT_RETURN_IF_ERROR(validate(config));
  GatedDeltaNet layer;
  layer.config_ = config;
  return layer;
}

std::vector<std::string> GatedDeltaNet::weight_names() const {
  return {"in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "A_log", "dt_bias",
          "norm.weight",         "out_proj.weight"};
}

Status GatedDeltaNet::load_weights(const WeightMap& weights, std::string_view prefix) {
  const GatedDeltaNetConfig& c = config_;
  const int64_t H = c.hidden_size, Hv = c.num_v_heads, dv = c.value_head_dim;
  const int64_t kd = c.num_k_heads * c.key_head_dim, vd = Hv * dv, C = conv_channels(c);
  io::WeightLoader loader(weights, prefix, kLoad);
  std::vector<Tensor> t(kNumWeights);
  ATTNKIT_RETURN_IF_ERROR(loader.load_matrix(
      "in_proj_qkvz.weight", {2 * kd + 2 * vd, H},
      "2*num_k_heads*key_head_dim + 2*num_v_heads*value_head_dim, hidden_size", &t[kQkvz]));
  ATTNKIT_RETURN_IF_ERROR(
      loader.load_matrix("in_proj_ba.weight", {2 * Hv, H}, "2*num_v_heads, hidden_size", &t[kBa]));
  ATTNKIT_RETURN_IF_ERROR(loader.load(
      "conv1d.weight", {C, 1, c.conv_kernel},
      "2*num_k_heads*key_head_dim + num_v_heads*value_head_dim, 1, conv_kernel", &t[kConv]));
  ATTNKIT_RETURN_IF_ERROR(loader.load("A_log", {Hv}, "num_v_heads", &t[kALog]));
  ATTNKIT_RETURN_IF_ERROR(loader.load("dt_bias", {Hv}, "num_v_heads", &t[kDtBias]));
  ATTNKIT_RETURN_IF_ERROR(loader.load("norm.weight", {dv}, "value_head_dim", &t[kNorm]));
  ATTNKIT_RETURN_IF_ERROR(loader.load_matrix("out_proj.weight", {H, vd},
                                             "hidden_size, num_v_heads*value_head_dim", &t[kOut]));
  ATTNKIT_RETURN_IF_ERROR(loader.finish());
  for (size_t i : {size_t{kALog}, size_t{kDtBias}}) {
    const float* v = t[i].ptr<const float>();
    for (int64_t h = 0; h < Hv; ++h)
      if (!std::isfinite(v[h]))
        return invalid_argument(
            std::string(kLoad) + ": " + io::weight_name(prefix, weight_names()[i]) + "[" +
            std::to_string(h) + "] = " + std::to_string(v[h]) + " must be finite");
  }
  tensors_ = std::move(t);
  return Status::Ok();
}

Result<GatedDeltaNetState> GatedDeltaNet::new_state(int64_t batch_size) const {
  const GatedDeltaNetConfig& c = config_;
  if (batch_size < 1)
    return invalid_argument(std::string(kState) + ": batch_size = " + std::to_string(batch_size) +
                            " must be >= 1");
  GatedDeltaNetState s;
  auto conv = Tensor::zeros(DType::kF32, {batch_size, c.conv_kernel - 1, conv_channels(c)});
  if (!conv.ok()) return check::prefixed(kState, conv.status());
  auto rec =
      Tensor::zeros(DType::kF32, {batch_size, c.num_v_heads, c.key_head_dim, c.value_head_dim});
  if (!rec.ok()) return check::prefixed(kState, rec.status());
  s.conv_ = std::move(conv).value();
  s.recurrent_ = std::move(rec).value();
  return s;
}

Status GatedDeltaNet::forward(const TensorView& x, const TensorView& out, GatedDeltaNetState* state,
                              const RunOptions& run) const {
  const GatedDeltaNetConfig& c = config_;
  const int64_t H = c.hidden_size, Hk = c.num_k_heads, Hv = c.num_v_heads;
  const int64_t dk = c.key_head_dim, dv = c.value_head_dim, K = c.conv_kernel;
  const int64_t r = Hv / Hk, kd = Hk * dk, vd = Hv * dv, C = conv_channels(c);
  const int64_t group_w = 2 * dk + 2 * r * dv;  // one key head's columns of qkvz
  ATTNKIT_RETURN_IF_ERROR(check_io("x", x, H));
  ATTNKIT_RETURN_IF_ERROR(check_io("out", out, H));
  const int64_t batch = x.shape[0], seq = x.shape[1];
  ATTNKIT_RETURN_IF_ERROR(check::dim(kFwd, "out", out, 0, "batch", batch, "x.shape[0]"));
  ATTNKIT_RETURN_IF_ERROR(check::dim(kFwd, "out", out, 1, "seq", seq, "x.shape[1]"));
  if (check::overlaps(out, x))
    return invalid_argument(std::string(kFwd) + ": out overlaps x; out must not alias x");
  if (run.num_threads < 0)
    return invalid_argument(std::string(kFwd) + ": run.num_threads = " +
                            std::to_string(run.num_threads) + " must be >= 0 (0 = default)");
  if (run.backend != Backend::kAuto && run.backend != Backend::kReference &&
      run.backend != Backend::kFast)
    return invalid_argument(std::string(kFwd) +
                            ": run.backend = " + std::to_string(static_cast<int>(run.backend)) +
                            " is not a Backend value");
  if (!loaded())
    return invalid_argument(std::string(kFwd) +
                            ": weights are not loaded (call load_weights first)");
  if (state != nullptr) {
    if (state->batch_size() != batch)
      return invalid_argument(std::string(kFwd) + ": state holds " +
                              std::to_string(state->batch_size()) +
                              " sequences but x.shape[0] (batch) = " + std::to_string(batch));
    const TensorView& sc = state->conv_state();
    const TensorView& sr = state->recurrent_state();
    if (sc.shape[1] != K - 1 || sc.shape[2] != C || sr.shape[1] != Hv || sr.shape[2] != dk ||
        sr.shape[3] != dv)
      return invalid_argument(std::string(kFwd) + ": state is another layer's: conv_state " +
                              sc.describe() + " and recurrent_state " + sr.describe() +
                              ", this layer's are [" + std::to_string(batch) + ", " +
                              std::to_string(K - 1) + ", " + std::to_string(C) + "] and [" +
                              std::to_string(batch) + ", " + std::to_string(Hv) + ", " +
                              std::to_string(dk) + ", " + std::to_string(dv) + "]");
  }
  int64_t T = 0;
  if (!checked_mul(batch, seq, &T))
    return invalid_argument(std::string(kFwd) + ": batch * seq overflows");
  if (T == 0) return Status::Ok();

  Tensor qkvz, ba, mixed, gb, core, conv, zero_state;
  ATTNKIT_RETURN_IF_ERROR(zeros("in_proj_qkvz", {T, 2 * kd + 2 * vd}, &qkvz));
  ATTNKIT_RETURN_IF_ERROR(zeros("in_proj_ba", {T, 2 * Hv}, &ba));
  ATTNKIT_RETURN_IF_ERROR(zeros("the conv", {T, C}, &mixed));
  ATTNKIT_RETURN_IF_ERROR(zeros("g and beta", {2, T, Hv}, &gb));
  ATTNKIT_RETURN_IF_ERROR(zeros("the recurrence's output", {T, vd}, &core));
  ATTNKIT_RETURN_IF_ERROR(zeros("the conv state", {batch, K - 1, C}, &conv));
  if (state == nullptr)
    ATTNKIT_RETURN_IF_ERROR(zeros("the recurrent state", {batch, Hv, dk, dv}, &zero_state));

  const kernels::LinearOptions lin{.num_threads = resolve_num_threads(run.num_threads),
                                   .backend = run.backend,
                                   .gemv_for_one_row = true};
  // Input projections, per batch item unless every row lies at one stride.
  const int64_t ldx = seq == 1 ? x.strides[0] : x.strides[1];
  const bool x_one = batch == 1 || x.strides[0] == seq * ldx;
  for (int64_t b = 0; b < (x_one ? 1 : batch); ++b) {
    const float* xb = x.ptr<const float>() + b * x.strides[0];
    const int64_t rows = x_one ? T : seq, ld = x_one ? ldx : x.strides[1];
    kernels::linear(xb, ld, kernels::weight_of(tensors_[kQkvz]), nullptr,
                    qkvz.ptr<float>() + b * seq * (2 * kd + 2 * vd), 2 * kd + 2 * vd, rows,
                    2 * kd + 2 * vd, H, lin);
    kernels::linear(xb, ld, kernels::weight_of(tensors_[kBa]), nullptr,
                    ba.ptr<float>() + b * seq * 2 * Hv, 2 * Hv, rows, 2 * Hv, H, lin);
  }

  // mixed = [q of every key head | k of every key head | v of every value head].
  for (int64_t t = 0; t < T; ++t) {
    const float* src = qkvz.ptr<const float>() + t * (2 * kd + 2 * vd);
    float* dst = mixed.ptr<float>() + t * C;
    for (int64_t g = 0; g < Hk; ++g) {
      const float* grp = src + g * group_w;
      std::copy(grp, grp + dk, dst + g * dk);
      std::copy(grp + dk, grp + 2 * dk, dst + kd + g * dk);
      std::copy(grp + 2 * dk, grp + 2 * dk + r * dv, dst + 2 * kd + g * r * dv);
    }
  }

  // The causal depthwise conv with SiLU, in place: position t reads inputs
  // t - K + 1 .. t, those before the call from the state (oldest first),
  // so walking t downwards never reads an input already overwritten. The
  // new state (the last K - 1 inputs) is taken first.
  const float* wconv = tensors_[kConv].ptr<const float>();  // [C, 1, K]
  for (int64_t b = 0; b < batch; ++b) {
    float* in = mixed.ptr<float>() + b * seq * C;
    const float* old = state ? state->conv_state().ptr<const float>() + b * (K - 1) * C : nullptr;
    // Input u of the call (u < 0: the state's row K - 1 + u).
    auto input = [&](int64_t u, int64_t ch) -> float {
      if (u >= 0) return in[u * C + ch];
      return old ? old[(K - 1 + u) * C + ch] : 0.0f;
    };
    float* next = conv.ptr<float>() + b * (K - 1) * C;
    for (int64_t s = 0; s < K - 1; ++s)
      for (int64_t ch = 0; ch < C; ++ch) next[s * C + ch] = input(seq - (K - 1) + s, ch);
    for (int64_t t = seq - 1; t >= 0; --t) {
      for (int64_t ch = 0; ch < C; ++ch) {
        float acc = 0.0f;
        for (int64_t j = 0; j < K; ++j) acc += wconv[ch * K + j] * input(t - (K - 1) + j, ch);
        in[t * C + ch] = static_cast<float>(silu(acc));
      }
    }
  }

  // L2-normalised q and k per head, q scaled by dk^-0.5; g and beta.
  const double q_scale = 1.0 / std::sqrt(static_cast<double>(dk));
  const float* a_log = tensors_[kALog].ptr<const float>();
  const float* dt_bias = tensors_[kDtBias].ptr<const float>();
  float* g = gb.ptr<float>();
  float* beta = g + T * Hv;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t hh = 0; hh < 2 * Hk; ++hh) {
      float* v = mixed.ptr<float>() + t * C + hh * dk;
      double ss = 0.0;
      for (int64_t d = 0; d < dk; ++d) ss += static_cast<double>(v[d]) * v[d];
      const double f = (hh < Hk ? q_scale : 1.0) / std::sqrt(ss + kL2NormEps);
      for (int64_t d = 0; d < dk; ++d) v[d] = static_cast<float>(v[d] * f);
    }
    const float* row = ba.ptr<const float>() + t * 2 * Hv;
    for (int64_t h = 0; h < Hv; ++h) {
      const int64_t grp = h / r, i = h % r;
      const double bv = row[grp * 2 * r + i], av = row[grp * 2 * r + r + i];
      const double gv =
          -std::exp(static_cast<double>(a_log[h])) * softplus(av + static_cast<double>(dt_bias[h]));
      g[t * Hv + h] = static_cast<float>(std::max(gv, kMinLogDecay));
      beta[t * Hv + h] = static_cast<float>(1.0 / (1.0 + std::exp(-bv)));
    }
  }

  kernels::GatedDeltaRuleParams p;
  p.batch = batch;
  p.seq = seq;
  p.num_k_heads = Hk;
  p.num_v_heads = Hv;
  p.key_head_dim = dk;
  p.value_head_dim = dv;
  p.q = mixed.ptr<const float>();
  p.k = p.q + kd;
  p.v = p.q + 2 * kd;
  p.q_stride = p.k_stride = p.v_stride = C;
  p.g = g;
  p.beta = beta;
  p.state = state ? state->recurrent_.ptr<float>() : zero_state.ptr<float>();
  p.out = core.ptr<float>();
  p.out_stride = vd;
  p.num_threads = run.num_threads;
  ATTNKIT_RETURN_IF_ERROR(check::prefixed(kFwd, kernels::run_gated_delta_rule(p, run.backend)));
  if (state) std::copy_n(conv.ptr<const float>(), conv.numel(), state->conv_.ptr<float>());

  // Gated RMSNorm over each value head: o / rms(o) * w * silu(z).
  const float* w = tensors_[kNorm].ptr<const float>();
  for (int64_t t = 0; t < T; ++t) {
    const float* zrow = qkvz.ptr<const float>() + t * (2 * kd + 2 * vd);
    for (int64_t h = 0; h < Hv; ++h) {
      float* o = core.ptr<float>() + t * vd + h * dv;
      const float* z = zrow + (h / r) * group_w + 2 * dk + r * dv + (h % r) * dv;
      double ss = 0.0;
      for (int64_t d = 0; d < dv; ++d) ss += static_cast<double>(o[d]) * o[d];
      const double inv = 1.0 / std::sqrt(ss / static_cast<double>(dv) + c.rms_norm_eps);
      for (int64_t d = 0; d < dv; ++d) o[d] = static_cast<float>(o[d] * inv * w[d] * silu(z[d]));
    }
  }

  // out_proj, per batch item unless every row of out lies at one stride.
  const int64_t ldy = seq == 1 ? out.strides[0] : out.strides[1];
  const bool y_one = batch == 1 || out.strides[0] == seq * ldy;
  for (int64_t b = 0; b < (y_one ? 1 : batch); ++b)
    kernels::linear(core.ptr<const float>() + b * seq * vd, vd, kernels::weight_of(tensors_[kOut]),
                    nullptr, out.ptr<float>() + b * out.strides[0], y_one ? ldy : out.strides[1],
                    y_one ? T : seq, H, vd, lin);
  return Status::Ok();
}

}  // namespace attnkit
