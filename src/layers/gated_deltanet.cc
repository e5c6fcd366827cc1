// GatedDeltaNet: projections (kernels::linear), the causal depthwise conv
// and its rolling state, the per-head normalisations and gates, and the
// recurrence through kernels::run_gated_delta_rule.
//
// forward() and forward_batch() both run gated_deltanet_rows(): the rows of
// several sequences in blocks of at most kGdnBlockRows rows, each block in
// this thread's scratch (grown once, reused: no allocation in steady state;
// R = the block's rows, C conv channels):
//   qkvz  [R, 2 Hk dk + 2 Hv dv]  the input projection, grouped per key head
//   ba    [R, 2 Hv]
//   mixed [R, C]   q | k | v gathered from qkvz, then convolved in place
//   gb    [2, R, Hv]  g, then beta
//   core  [R, Hv dv]  the recurrence's output, normalised and gated in place
// and per sequence its conv inputs [K - 1, C], committed at the end.
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
#include "kernels/scratch.h"
#include "layers/gated_deltanet_rows.h"

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
  const int64_t H = c.hidden_size, Hv = c.num_v_heads;
  const int64_t dk = c.key_head_dim, dv = c.value_head_dim, K = c.conv_kernel;
  const int64_t C = conv_channels(c);
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

  // Without a state every sequence starts from zeros and its end is dropped.
  Tensor zero_conv, zero_rec;
  float *conv = nullptr, *rec = nullptr;
  if (state != nullptr) {
    conv = state->conv_.ptr<float>();
    rec = state->recurrent_.ptr<float>();
  } else {
    ATTNKIT_RETURN_IF_ERROR(zeros("the conv state", {batch, K - 1, C}, &zero_conv));
    ATTNKIT_RETURN_IF_ERROR(zeros("the recurrent state", {batch, Hv, dk, dv}, &zero_rec));
    conv = zero_conv.ptr<float>();
    rec = zero_rec.ptr<float>();
  }
  // Rows of one sequence at strides[1] (strides[0] when seq is 1, so that a
  // decode batch is one matrix wherever its rows lie at one stride).
  const int64_t ldx = seq == 1 ? x.strides[0] : x.strides[1];
  const int64_t ldo = seq == 1 ? out.strides[0] : out.strides[1];
  thread_local std::vector<layers::GdnSegment> segments;
  segments.clear();
  for (int64_t b = 0; b < batch; ++b)
    segments.push_back({x.ptr<const float>() + b * x.strides[0],
                        out.ptr<float>() + b * out.strides[0], rec + b * Hv * dk * dv,
                        conv + b * (K - 1) * C, seq});
  return layers::gated_deltanet_rows(kFwd, c, tensors_, ldx, ldo, segments, run);
}

namespace layers {
namespace {

// The pieces of a block: rows [t0, t0 + len) of segment `seg`, at row
// `row` of the block's scratch.
struct Piece {
  size_t seg;
  int64_t t0, len, row;
};

// This thread's scratch for gated_deltanet_rows: grown to the largest
// call's need, then reused.
struct RowsScratch {
  kernels::Scratch<float> floats;
  std::vector<Piece> pieces;
};
RowsScratch& rows_scratch() {
  thread_local RowsScratch s;
  return s;
}

class Rows {
 public:
  Rows(const GatedDeltaNetConfig& c, const std::vector<Tensor>& w, int64_t ldx, int64_t ldo,
       std::span<const GdnSegment> segs, const RunOptions& run, float* scratch, int64_t cap)
      : c_(c), w_(w), ldx_(ldx), ldo_(ldo), segs_(segs), run_(run) {
    H_ = c.hidden_size;
    Hk_ = c.num_k_heads;
    Hv_ = c.num_v_heads;
    dk_ = c.key_head_dim;
    dv_ = c.value_head_dim;
    K_ = c.conv_kernel;
    r_ = Hv_ / Hk_;
    kd_ = Hk_ * dk_;
    vd_ = Hv_ * dv_;
    C_ = conv_channels(c);
    wq_ = 2 * kd_ + 2 * vd_;
    qkvz_ = scratch;
    ba_ = qkvz_ + cap * wq_;
    mixed_ = ba_ + cap * 2 * Hv_;
    gb_ = mixed_ + cap * C_;
    core_ = gb_ + 2 * cap * Hv_;
    next_ = core_ + cap * vd_;
    hist_ = next_ + (K_ - 1) * C_;
    cap_ = cap;
    lin_ = {.num_threads = resolve_num_threads(run.num_threads),
            .backend = run.backend,
            .gemv_for_one_row = true};
  }

  static int64_t floats(const GatedDeltaNetConfig& c, int64_t cap, int64_t num_segments) {
    const int64_t C = conv_channels(c), Hv = c.num_v_heads;
    const int64_t wq = 2 * c.num_k_heads * c.key_head_dim + 2 * Hv * c.value_head_dim;
    return cap * (wq + 2 * Hv + C + 2 * Hv + Hv * c.value_head_dim) +
           (num_segments + 1) * (c.conv_kernel - 1) * C;
  }

  // The segments' conv inputs into this call's copies (committed by finish()).
  void start() {
    for (size_t i = 0; i < segs_.size(); ++i)
      std::copy_n(segs_[i].conv, (K_ - 1) * C_, hist_ + static_cast<int64_t>(i) * (K_ - 1) * C_);
  }
  void finish() {
    for (size_t i = 0; i < segs_.size(); ++i)
      std::copy_n(hist_ + static_cast<int64_t>(i) * (K_ - 1) * C_, (K_ - 1) * C_, segs_[i].conv);
  }

  void block(std::span<const Piece> pieces, int64_t rows);

 private:
  // Calls f(first piece, pieces, rows) for each run of pieces whose rows of
  // `base` (x or out) lie one after another at stride ld.
  template <class F>
  void runs(std::span<const Piece> pieces, bool of_x, F f) const {
    size_t a = 0;
    while (a < pieces.size()) {
      size_t e = a + 1;
      int64_t n = pieces[a].len;
      while (e < pieces.size() &&
             at(pieces[e], of_x) ==
                 at(pieces[e - 1], of_x) + pieces[e - 1].len * (of_x ? ldx_ : ldo_)) {
        n += pieces[e].len;
        ++e;
      }
      f(pieces[a], n);
      a = e;
    }
  }
  const float* at(const Piece& p, bool of_x) const {
    return of_x ? segs_[p.seg].x + p.t0 * ldx_ : out_at(p);
  }
  float* out_at(const Piece& p) const { return segs_[p.seg].out + p.t0 * ldo_; }

  // f(lo, hi) over [0, n) in tasks of `per_task`, on the layer's threads
  // (each element is computed the same way whichever thread runs it).
  template <class F>
  void parallel(int64_t n, int64_t per_task, const F& f) const {
    const struct {
      const F& f;
      int64_t n, per_task;
    } ctx{f, n, per_task};
    // One pointer captured: std::function keeps it without allocating.
    parallel_for((n + per_task - 1) / per_task, lin_.num_threads, [c = &ctx](int64_t task, int) {
      const int64_t lo = task * c->per_task;
      c->f(lo, std::min(c->n, lo + c->per_task));
    });
  }
  // mixed holds a block's rows head-major: [2 Hk heads of dk, Hv heads of
  // dv][rows][head dim], so that the recurrence reads a chunk's rows of one
  // head as one run (64 rows of 128 floats: 32 KiB), which the hardware
  // prefetchers follow; token-major, they lay a token's C floats apart. The
  // first channel of the head of channel ch, whose values of row t then
  // start at mixed_ + head_start(ch) * rows + t * head dim.
  int64_t head_start(int64_t ch) const {
    return ch < 2 * kd_ ? ch / dk_ * dk_ : 2 * kd_ + (ch - 2 * kd_) / dv_ * dv_;
  }
  void conv(const Piece& p, int64_t rows, int64_t ch0, int64_t ch1);
  void recurrence(std::span<const Piece> pieces, int64_t rows);

  const GatedDeltaNetConfig& c_;
  const std::vector<Tensor>& w_;
  int64_t ldx_, ldo_;
  std::span<const GdnSegment> segs_;
  const RunOptions& run_;
  int64_t H_, Hk_, Hv_, dk_, dv_, K_, r_, kd_, vd_, C_, wq_, cap_;
  float *qkvz_, *ba_, *mixed_, *gb_, *core_, *next_, *hist_;
  kernels::LinearOptions lin_;
};

// The causal depthwise conv with SiLU over a piece's rows of mixed (a
// block of `rows`, head-major), in place, channels [ch0, ch1) (channels
// are independent, so tasks split them), a head's channels at a time:
// position t reads inputs t - K + 1 .. t, those before the piece from its
// sequence's conv inputs ([K - 1, C], oldest first), so walking t
// downwards never reads an input already overwritten. The new conv inputs
// (the last K - 1) are taken first and replace the old after the walk.
void Rows::conv(const Piece& p, int64_t rows, int64_t ch0, int64_t ch1) {
  const int64_t K = K_, C = C_, len = p.len;
  float* old = hist_ + static_cast<int64_t>(p.seg) * (K - 1) * C;
  const float* wconv = w_[kConv].ptr<const float>();  // [C, 1, K]
  for (int64_t a = ch0; a < ch1;) {
    const int64_t head = head_start(a), ld = a < 2 * kd_ ? dk_ : dv_;
    const int64_t e = std::min(ch1, head + ld);
    // Channel ch of row u of the piece at in[u * ld + ch].
    float* in = mixed_ + head * rows + p.row * ld - head;
    auto input = [&](int64_t u, int64_t ch) -> float {
      return u >= 0 ? in[u * ld + ch] : old[(K - 1 + u) * C + ch];
    };
    for (int64_t s = 0; s < K - 1; ++s)
      for (int64_t ch = a; ch < e; ++ch) next_[s * C + ch] = input(len - (K - 1) + s, ch);
    for (int64_t t = len - 1; t >= 0; --t) {
      for (int64_t ch = a; ch < e; ++ch) {
        float acc = 0.0f;
        for (int64_t j = 0; j < K; ++j) acc += wconv[ch * K + j] * input(t - (K - 1) + j, ch);
        in[t * ld + ch] = static_cast<float>(silu(acc));
      }
    }
    a = e;
  }
  for (int64_t s = 0; s < K - 1; ++s)
    std::copy(next_ + s * C + ch0, next_ + s * C + ch1, old + s * C + ch0);
}

// The gated delta rule over the block's pieces: one kernel call per run of
// pieces of one length whose states lie one after another (a dense
// state's batch), else one per piece.
void Rows::recurrence(std::span<const Piece> pieces, int64_t rows) {
  const int64_t state_floats = Hv_ * dk_ * dv_;
  size_t a = 0;
  while (a < pieces.size()) {
    size_t e = a + 1;
    while (e < pieces.size() && pieces[e].len == pieces[a].len &&
           segs_[pieces[e].seg].recurrent == segs_[pieces[e - 1].seg].recurrent + state_floats)
      ++e;
    kernels::GatedDeltaRuleParams p;
    p.batch = static_cast<int64_t>(e - a);
    p.seq = pieces[a].len;
    p.num_k_heads = Hk_;
    p.num_v_heads = Hv_;
    p.key_head_dim = dk_;
    p.value_head_dim = dv_;
    // Head-major rows (head_start): a head's rows one after another.
    p.q = mixed_ + pieces[a].row * dk_;
    p.k = mixed_ + kd_ * rows + pieces[a].row * dk_;
    p.v = mixed_ + 2 * kd_ * rows + pieces[a].row * dv_;
    p.q_stride = p.k_stride = dk_;
    p.v_stride = dv_;
    p.q_head_stride = p.k_head_stride = rows * dk_;
    p.v_head_stride = rows * dv_;
    p.g = gb_ + pieces[a].row * Hv_;
    p.beta = gb_ + rows * Hv_ + pieces[a].row * Hv_;
    p.state = segs_[pieces[a].seg].recurrent;
    p.out = core_ + pieces[a].row * vd_;
    p.out_stride = vd_;
    p.num_threads = run_.num_threads;
    // Scratch was reserved before the first block: this cannot fail.
    (void)kernels::run_gated_delta_rule(p, run_.backend);
    a = e;
  }
}

void Rows::block(std::span<const Piece> pieces, int64_t rows) {
  const int64_t Hv = Hv_, dk = dk_, dv = dv_, r = r_, kd = kd_, vd = vd_, C = C_;
  const int64_t group_w = 2 * dk + 2 * r * dv;  // one key head's columns of qkvz
  // Input projections: one GEMM per run of rows at one stride.
  runs(pieces, true, [&](const Piece& p, int64_t n) {
    kernels::linear(at(p, true), ldx_, kernels::weight_of(w_[kQkvz]), nullptr, qkvz_ + p.row * wq_,
                    wq_, n, wq_, H_, lin_);
    kernels::linear(at(p, true), ldx_, kernels::weight_of(w_[kBa]), nullptr, ba_ + p.row * 2 * Hv,
                    2 * Hv, n, 2 * Hv, H_, lin_);
  });

  // The elementwise steps run on the layer's threads too: on one, the
  // conv, norms and gates were about a seventh of a long prefill's time
  // (docs/LINEAR_ATTENTION.md). Rows, or conv channels, per task:
  constexpr int64_t kRowsPerTask = 16, kChannelsPerTask = 512;

  // mixed = [q of every key head | k of every key head | v of every value
  // head], head-major (head_start).
  parallel(rows, kRowsPerTask, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* src = qkvz_ + t * wq_;
      for (int64_t g = 0; g < Hk_; ++g) {
        const float* grp = src + g * group_w;
        std::copy(grp, grp + dk, mixed_ + (g * rows + t) * dk);
        std::copy(grp + dk, grp + 2 * dk, mixed_ + ((Hk_ + g) * rows + t) * dk);
        for (int64_t i = 0; i < r; ++i)
          std::copy(grp + 2 * dk + i * dv, grp + 2 * dk + (i + 1) * dv,
                    mixed_ + 2 * kd * rows + ((g * r + i) * rows + t) * dv);
      }
    }
  });
  parallel(C, kChannelsPerTask, [&](int64_t ch0, int64_t ch1) {
    for (const Piece& p : pieces) conv(p, rows, ch0, ch1);
  });

  // L2-normalised q and k per head, q scaled by dk^-0.5; g and beta.
  const double q_scale = 1.0 / std::sqrt(static_cast<double>(dk));
  const float* a_log = w_[kALog].ptr<const float>();
  const float* dt_bias = w_[kDtBias].ptr<const float>();
  float* g = gb_;
  float* beta = gb_ + rows * Hv;
  parallel(rows, kRowsPerTask, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t hh = 0; hh < 2 * Hk_; ++hh) {
        float* v = mixed_ + (hh * rows + t) * dk;
        double ss = 0.0;
        for (int64_t d = 0; d < dk; ++d) ss += static_cast<double>(v[d]) * v[d];
        const double f = (hh < Hk_ ? q_scale : 1.0) / std::sqrt(ss + kL2NormEps);
        for (int64_t d = 0; d < dk; ++d) v[d] = static_cast<float>(v[d] * f);
      }
      const float* row = ba_ + t * 2 * Hv;
      for (int64_t h = 0; h < Hv; ++h) {
        const int64_t grp = h / r, i = h % r;
        const double bv = row[grp * 2 * r + i], av = row[grp * 2 * r + r + i];
        const double gv = -std::exp(static_cast<double>(a_log[h])) *
                          softplus(av + static_cast<double>(dt_bias[h]));
        g[t * Hv + h] = static_cast<float>(std::max(gv, kMinLogDecay));
        beta[t * Hv + h] = static_cast<float>(1.0 / (1.0 + std::exp(-bv)));
      }
    }
  });

  recurrence(pieces, rows);

  // Gated RMSNorm over each value head: o / rms(o) * w * silu(z).
  const float* w = w_[kNorm].ptr<const float>();
  parallel(rows, kRowsPerTask, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* zrow = qkvz_ + t * wq_;
      for (int64_t h = 0; h < Hv; ++h) {
        float* o = core_ + t * vd + h * dv;
        const float* z = zrow + (h / r) * group_w + 2 * dk + r * dv + (h % r) * dv;
        double ss = 0.0;
        for (int64_t d = 0; d < dv; ++d) ss += static_cast<double>(o[d]) * o[d];
        const double inv = 1.0 / std::sqrt(ss / static_cast<double>(dv) + c_.rms_norm_eps);
        for (int64_t d = 0; d < dv; ++d) o[d] = static_cast<float>(o[d] * inv * w[d] * silu(z[d]));
      }
    }
  });

  // out_proj: one GEMM per run of rows at one stride.
  runs(pieces, false, [&](const Piece& p, int64_t n) {
    kernels::linear(core_ + p.row * vd, vd, kernels::weight_of(w_[kOut]), nullptr, out_at(p), ldo_,
                    n, H_, vd, lin_);
  });
}

}  // namespace

Status gated_deltanet_rows(const char* fn, const GatedDeltaNetConfig& c,
                           const std::vector<Tensor>& weights, int64_t ldx, int64_t ldo,
                           std::span<const GdnSegment> segments, const RunOptions& run) {
  int64_t total = 0;
  for (const GdnSegment& s : segments) total += s.len;
  if (total == 0) return Status::Ok();
  const int64_t cap = std::min(total, kGdnBlockRows);
  RowsScratch& scratch = rows_scratch();
  const int64_t n = Rows::floats(c, cap, static_cast<int64_t>(segments.size()));
  ATTNKIT_RETURN_IF_ERROR(
      scratch.floats.reserve(static_cast<size_t>(n), fn, "floats of Gated DeltaNet scratch"));
  // The recurrence's scratch too, so that no block fails after another
  // has written.
  kernels::GatedDeltaRuleParams shape;
  shape.num_k_heads = c.num_k_heads;
  shape.num_v_heads = c.num_v_heads;
  shape.key_head_dim = c.key_head_dim;
  shape.value_head_dim = c.value_head_dim;
  shape.num_threads = run.num_threads;
  ATTNKIT_RETURN_IF_ERROR(
      check::prefixed(fn, kernels::reserve_gated_delta_rule(shape, run.backend)));

  Rows rows(c, weights, ldx, ldo, segments, run, scratch.floats.get(), cap);
  rows.start();
  // Blocks of at most kGdnBlockRows rows: whole segments while they fit; a
  // segment that does not fit starts a block, and one longer than a block
  // runs in pieces of kGdnBlockRows rows (its last piece may share a block).
  std::vector<Piece>& block = scratch.pieces;
  block.clear();
  int64_t used = 0;
  auto flush = [&] {
    if (block.empty()) return;
    rows.block(block, used);
    block.clear();
    used = 0;
  };
  for (size_t i = 0; i < segments.size(); ++i) {
    for (int64_t t = 0; t < segments[i].len;) {
      const int64_t left = segments[i].len - t;
      if (!block.empty() && left > kGdnBlockRows - used) flush();
      const int64_t len = std::min(left, kGdnBlockRows - used);
      block.push_back({i, t, len, used});
      used += len;
      t += len;
      if (used == kGdnBlockRows) flush();
    }
  }
  flush();
  rows.finish();
  return Status::Ok();
}

}  // namespace layers

}  // namespace attnkit
