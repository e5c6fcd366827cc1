// libFuzzer target: the gated delta rule (Gated DeltaNet's recurrence,
// src/kernels/gated_delta_rule_params.h) and the GatedDeltaNet layer around
// it, on fuzzer-chosen shapes, lengths, decays, thread counts and SIMD
// targets. The input's first byte picks a mode:
//
//   kernel  one call, run by the reference (double, token by token), the
//           fast recurrent form, the fast chunked form and kAuto. Inputs
//           hold the kernels' contract (q and k L2-normalised, q scaled by
//           dk^-0.5, g in [-1000, 0], beta in [0, 1]) except for up to four
//           fuzzer-placed values in q, k or v (NaN, +-Inf, +-1e30, 3e38, a
//           subnormal, -0). Per sequence, every output of a token before its
//           first non-finite or huge value must be finite and agree with the
//           reference within 1e-4 of the largest such output (the layer's
//           bound); a sequence without one must agree in its final state
//           too. The chunked form must give the same bits for 1 and 3
//           threads. Later tokens only must not crash or read out of bounds.
//   layer   a small random layer: a non-finite A_log or dt_bias must be
//           refused by load_weights with an error naming it, leaving the
//           layer unloaded; otherwise a prompt fed in fuzzer-chosen pieces
//           with a state (fast backend) must agree with one reference call
//           over the whole prompt within 1e-3 of the output's scale.
//
// Every buffer is allocated at exactly the extent its view addresses, so
// ASan reports any read or write past it.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attnkit/gated_deltanet.h"
#include "attnkit/tensor.h"
#include "common/gated_delta_rows.h"
#include "core/cpu_features.h"

namespace {

using attnkit::Backend;
using attnkit::kernels::GdrForm;
using attnkit_test::GdrInputs;

std::string g_case;

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "gated_delta_fuzz: %s\n  case: %s\n", what.c_str(), g_case.c_str());
  std::abort();
}

float uniform(std::mt19937_64& rng, float lo, float hi) {
  return std::uniform_real_distribution<float>(lo, hi)(rng);
}

float special(FuzzedDataProvider& fdp) {
  const float values[] = {std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          1e30f,
                          -1e30f,
                          3e38f,
                          1e-41f,
                          -0.0f};
  return values[fdp.ConsumeIntegralInRange<size_t>(0, std::size(values) - 1)];
}

// Whether v keeps the computation inside f32 (subnormals and -0 do).
bool tame(float v) { return std::isfinite(v) && std::fabs(v) < 1e4f; }

// out [T, hv * dv] then the final state.
std::vector<float> run(const GdrInputs& c, Backend backend, GdrForm form, int threads) {
  std::vector<float> out;
  const attnkit::Status st = attnkit_test::run_gdr(c, backend, form, threads, -7.0f, &out);
  if (!st.ok()) fail("run_gated_delta_rule failed: " + st.message());
  return out;
}

void fuzz_kernel(FuzzedDataProvider& fdp, std::mt19937_64& rng) {
  GdrInputs c;
  c.batch = fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  c.seq = fdp.ConsumeIntegralInRange<int64_t>(1, 200);
  c.hk = fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  c.hv = c.hk * fdp.ConsumeIntegralInRange<int64_t>(1, 4);
  c.dk = fdp.ConsumeIntegralInRange<int64_t>(1, 40);
  c.dv = fdp.ConsumeIntegralInRange<int64_t>(1, 40);
  // Rows may carry padding past q | k | v, as a wider projection's would.
  c.width = 2 * c.hk * c.dk + c.hv * c.dv + fdp.ConsumeIntegralInRange<int64_t>(0, 3);
  const float g_lo = -std::pow(10.0f, fdp.ConsumeFloatingPointInRange<float>(-3.0f, 3.0f));
  const float g_hi = fdp.ConsumeBool() ? 0.0f : g_lo / 2;
  const int threads = fdp.ConsumeIntegralInRange<int>(1, 3);
  const auto targets = attnkit::kAllSimdTargets;
  const attnkit::SimdTarget target =
      targets[fdp.ConsumeIntegralInRange<size_t>(0, std::size(attnkit::kAllSimdTargets) - 1)];
  const int64_t T = c.batch * c.seq;
  c.rows.resize(static_cast<size_t>(T * c.width));
  for (float& v : c.rows) v = uniform(rng, -1.0f, 1.0f);
  attnkit_test::normalise_qk(c);
  c.g.resize(static_cast<size_t>(T * c.hv));
  for (float& v : c.g) v = std::max(-1000.0f, uniform(rng, g_lo, g_hi));
  c.beta.resize(c.g.size());
  for (float& v : c.beta) v = uniform(rng, 0.0f, 1.0f);
  c.state0.resize(static_cast<size_t>(c.batch * c.hv * c.dk * c.dv));
  for (float& v : c.state0) v = uniform(rng, -0.5f, 0.5f);
  // Specials in q, k or v; first_bad[b] = the first token of b that has one
  // outside f32's comfortable range.
  std::vector<int64_t> first_bad(static_cast<size_t>(c.batch), c.seq);
  const int n_special = fdp.ConsumeIntegralInRange<int>(0, 4);
  for (int i = 0; i < n_special; ++i) {
    const int64_t row = fdp.ConsumeIntegralInRange<int64_t>(0, T - 1);
    const int64_t col = fdp.ConsumeIntegralInRange<int64_t>(0, 2 * c.hk * c.dk + c.hv * c.dv - 1);
    const float v = special(fdp);
    c.rows[static_cast<size_t>(row * c.width + col)] = v;
    if (!tame(v)) {
      int64_t& f = first_bad[static_cast<size_t>(row / c.seq)];
      f = std::min(f, row % c.seq);
    }
  }
  g_case = "batch=" + std::to_string(c.batch) + " seq=" + std::to_string(c.seq) +
           " heads=" + std::to_string(c.hk) + "/" + std::to_string(c.hv) +
           " dims=" + std::to_string(c.dk) + "/" + std::to_string(c.dv) + " g in [" +
           std::to_string(g_lo) + ", " + std::to_string(g_hi) +
           "] threads=" + std::to_string(threads) + " target=" + attnkit::simd_target_name(target) +
           " specials=" + std::to_string(n_special);

  const attnkit::SimdTarget active = attnkit::simd_target();
  const bool on_target = attnkit::set_simd_target(target);
  const std::vector<float> want = run(c, Backend::kReference, GdrForm::kAuto, 1);
  const std::vector<float> chunked = run(c, Backend::kFast, GdrForm::kChunked, threads);
  const std::vector<float> forms[] = {run(c, Backend::kFast, GdrForm::kRecurrent, threads), chunked,
                                      run(c, Backend::kFast, GdrForm::kAuto, threads)};
  const char* names[] = {"recurrent", "chunked", "auto"};
  if (run(c, Backend::kFast, GdrForm::kChunked, threads == 1 ? 3 : 1) != chunked &&
      std::all_of(first_bad.begin(), first_bad.end(), [&](int64_t f) { return f == c.seq; }))
    fail("chunked form: another thread count changed the bits");
  if (on_target) attnkit::set_simd_target(active);

  const int64_t out_row = c.hv * c.dv, state_seq = c.hv * c.dk * c.dv;
  for (int64_t b = 0; b < c.batch; ++b) {
    const int64_t good = first_bad[static_cast<size_t>(b)];
    // The compared values: b's outputs before `good`, and its state if whole.
    std::vector<size_t> idx;
    for (int64_t i = 0; i < good * out_row; ++i)
      idx.push_back(static_cast<size_t>(b * c.seq * out_row + i));
    if (good == c.seq)
      for (int64_t i = 0; i < state_seq; ++i)
        idx.push_back(static_cast<size_t>(T * out_row + b * state_seq + i));
    double scale = 0;
    for (size_t i : idx) scale = std::max(scale, std::fabs(static_cast<double>(want[i])));
    // 1e-4 of the largest value, and a floor for all-tiny results.
    const double bound = 1e-4 * scale + 1e-30;
    for (int f = 0; f < 3; ++f)
      for (size_t i : idx) {
        const float got = forms[f][i];
        if (!std::isfinite(got) || std::fabs(static_cast<double>(got) - want[i]) > bound)
          fail(std::string(names[f]) + ": sequence " + std::to_string(b) + ", value " +
               std::to_string(i) + " = " + std::to_string(got) + ", reference " +
               std::to_string(want[i]) + ", bound " + std::to_string(bound));
      }
  }
}

void fuzz_layer(FuzzedDataProvider& fdp, std::mt19937_64& rng) {
  attnkit::GatedDeltaNetConfig c;
  c.hidden_size = fdp.ConsumeIntegralInRange<int64_t>(1, 24);
  c.num_k_heads = fdp.ConsumeIntegralInRange<int64_t>(1, 2);
  c.num_v_heads = c.num_k_heads * fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  c.key_head_dim = fdp.ConsumeIntegralInRange<int64_t>(1, 20);
  c.value_head_dim = fdp.ConsumeIntegralInRange<int64_t>(1, 20);
  c.conv_kernel = fdp.ConsumeIntegralInRange<int64_t>(1, 4);
  const int64_t H = c.hidden_size, Hv = c.num_v_heads;
  const int64_t kd = c.num_k_heads * c.key_head_dim, vd = Hv * c.value_head_dim;
  const int64_t batch = fdp.ConsumeIntegralInRange<int64_t>(1, 2);
  const int64_t seq = fdp.ConsumeIntegralInRange<int64_t>(1, 300);
  g_case = "layer hidden=" + std::to_string(H) + " heads=" + std::to_string(c.num_k_heads) + "/" +
           std::to_string(Hv) + " dims=" + std::to_string(c.key_head_dim) + "/" +
           std::to_string(c.value_head_dim) + " K=" + std::to_string(c.conv_kernel) +
           " batch=" + std::to_string(batch) + " seq=" + std::to_string(seq);
  auto layer = attnkit::GatedDeltaNet::create(c);
  if (!layer.ok()) fail("create refused a valid config: " + layer.status().message());

  std::vector<std::vector<float>> store;
  store.reserve(7);
  attnkit::WeightMap m;
  auto add = [&](const char* name, std::initializer_list<int64_t> shape, float lo, float hi) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    store.emplace_back(static_cast<size_t>(n));
    for (float& v : store.back()) v = uniform(rng, lo, hi);
    m[name] = attnkit::make_view(store.back().data(), attnkit::DType::kF32, shape);
  };
  const float sx = 2.0f / std::sqrt(static_cast<float>(H));
  add("in_proj_qkvz.weight", {2 * kd + 2 * vd, H}, -sx, sx);
  add("in_proj_ba.weight", {2 * Hv, H}, -sx, sx);
  add("conv1d.weight", {2 * kd + vd, 1, c.conv_kernel}, -0.7f, 0.7f);
  add("A_log", {Hv}, -1.2f, 2.5f);
  add("dt_bias", {Hv}, -4.0f, 1.0f);
  add("norm.weight", {c.value_head_dim}, 0.5f, 1.5f);
  add("out_proj.weight", {H, vd}, -0.5f, 0.5f);
  if (fdp.ConsumeIntegralInRange<int>(0, 3) == 0) {
    // A non-finite decay parameter: refused, named, nothing loaded.
    const bool a_log = fdp.ConsumeBool();
    const float bad = fdp.ConsumeBool() ? std::numeric_limits<float>::quiet_NaN()
                                        : std::numeric_limits<float>::infinity();
    store[a_log ? 3 : 4][fdp.ConsumeIntegralInRange<size_t>(0, static_cast<size_t>(Hv - 1))] = bad;
    const attnkit::Status st = layer->load_weights(m);
    if (st.ok() || layer->loaded()) fail("load_weights took a non-finite A_log or dt_bias");
    if (st.message().find(a_log ? "A_log" : "dt_bias") == std::string::npos)
      fail("load_weights' error does not name the weight: " + st.message());
    return;
  }
  const attnkit::Status loaded = layer->load_weights(m);
  if (!loaded.ok()) fail("load_weights failed: " + loaded.message());

  std::vector<float> x(static_cast<size_t>(batch * seq * H));
  for (float& v : x) v = uniform(rng, -1.0f, 1.0f);
  std::vector<float> want(x.size()), got(x.size(), -7.0f);
  const attnkit::Status ref =
      layer->forward(attnkit::make_view(x.data(), attnkit::DType::kF32, {batch, seq, H}),
                     attnkit::make_view(want.data(), attnkit::DType::kF32, {batch, seq, H}),
                     nullptr, {Backend::kReference, 1});
  if (!ref.ok()) fail("reference forward failed: " + ref.message());
  auto state = layer->new_state(batch);
  if (!state.ok()) fail("new_state failed");
  const int threads = fdp.ConsumeIntegralInRange<int>(1, 3);
  for (int64_t t0 = 0; t0 < seq;) {
    const int64_t n = std::min(seq - t0, fdp.ConsumeIntegralInRange<int64_t>(1, 300));
    attnkit::TensorView xv =
        attnkit::make_view(x.data() + t0 * H, attnkit::DType::kF32, {batch, n, H});
    attnkit::TensorView ov =
        attnkit::make_view(got.data() + t0 * H, attnkit::DType::kF32, {batch, n, H});
    xv.strides[0] = ov.strides[0] = seq * H;
    const attnkit::Status st = layer->forward(xv, ov, &*state, {Backend::kFast, threads});
    if (!st.ok()) fail("forward failed: " + st.message());
    t0 += n;
  }
  double scale = 0;
  for (float v : want) scale = std::max(scale, std::fabs(static_cast<double>(v)));
  for (size_t i = 0; i < want.size(); ++i)
    if (!std::isfinite(got[i]) ||
        std::fabs(static_cast<double>(got[i]) - want[i]) > 1e-3 * scale + 1e-30)
      fail("layer in pieces: value " + std::to_string(i) + " = " + std::to_string(got[i]) +
           ", one reference call " + std::to_string(want[i]) + ", scale " + std::to_string(scale));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider fdp(data, size);
  g_case.clear();
  const int mode = fdp.ConsumeIntegralInRange<int>(0, 3);
  std::mt19937_64 rng(fdp.ConsumeIntegral<uint64_t>());
  if (mode <= 2)
    fuzz_kernel(fdp, rng);
  else
    fuzz_layer(fdp, rng);
  return 0;
}
