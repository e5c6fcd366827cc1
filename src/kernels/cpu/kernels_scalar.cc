// Portable microkernels: the same templates over a 4-lane "vector" of plain
// floats, compiled with the project's baseline flags, for CPUs without AVX2
// (and non-x86 builds). The compiler maps the lane loops onto whatever SIMD
// the baseline has (SSE2 on x86-64).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attnkit/tensor.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/simd_kernels.h"

namespace attnkit::kernels::cpu {
namespace {

struct VScalar {
  static constexpr int kLanes = 4;
  struct F {
    float x[kLanes];
  };
  using Mask = int64_t;  // lanes [0, Mask) are on
  static constexpr int kQkVecs = 2, kQkAcc = 8, kQkMaxKeys = 4;
  static constexpr int kPvRows = 4, kPvVecs = 2;

  template <class Op>
  static F map(F a, Op op) {
    for (float& x : a.x) x = op(x);
    return a;
  }
  template <class Op>
  static F zip(F a, F b, Op op) {
    for (int i = 0; i < kLanes; ++i) a.x[i] = op(a.x[i], b.x[i]);
    return a;
  }

  static F zero() { return F{}; }
  static F set1(float v) { return F{{v, v, v, v}}; }
  static F load(const float* p) {
    F r;
    std::memcpy(r.x, p, sizeof r.x);
    return r;
  }
  static void store(float* p, F a) { std::memcpy(p, a.x, sizeof a.x); }
  static F bcast(const float* p) { return set1(*p); }
  static Mask mask_first(int64_t n) { return n > kLanes ? kLanes : n; }
  static F load_masked(const float* p, Mask m) {
    F r{};
    for (int64_t i = 0; i < m; ++i) r.x[i] = p[i];
    return r;
  }
  static void store_masked(float* p, Mask m, F a) {
    for (int64_t i = 0; i < m; ++i) p[i] = a.x[i];
  }
  static F fma(F a, F b, F c) {
    for (int i = 0; i < kLanes; ++i) c.x[i] = std::fma(a.x[i], b.x[i], c.x[i]);
    return c;
  }
  static F mul(F a, F b) {
    return zip(a, b, [](float u, float v) { return u * v; });
  }
  static F add(F a, F b) {
    return zip(a, b, [](float u, float v) { return u + v; });
  }
  static F sub(F a, F b) {
    return zip(a, b, [](float u, float v) { return u - v; });
  }
  static F div(F a, F b) {
    return zip(a, b, [](float u, float v) { return u / v; });
  }
  // Same NaN rule as the x86 max instructions: b unless a > b.
  static F max(F a, F b) {
    return zip(a, b, [](float u, float v) { return u > v ? u : v; });
  }
  static F abs(F a) {
    return map(a, [](float u) { return std::fabs(u); });
  }
  static F copysign(F mag, F sign) {
    return zip(mag, sign, [](float u, float v) { return std::copysign(u, v); });
  }
  static F ninf_to_zero(F a) {
    return map(a, [](float u) { return u == -INFINITY ? 0.0f : u; });
  }
  static F exp(F a) {
    return map(a, [](float u) { return std::exp(u); });
  }
  static void prefetch(const void*) {}
  static F widen_bf16(const uint16_t* p, int64_t n) {
    F r{};
    for (int64_t i = 0; i < n && i < kLanes; ++i) {
      const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
      std::memcpy(&r.x[i], &bits, sizeof bits);
    }
    return r;
  }
  static F widen_i8(const int8_t* p, int64_t n) {
    F r{};
    for (int64_t i = 0; i < n && i < kLanes; ++i) r.x[i] = p[i];
    return r;
  }
  // The SIMD targets' decoding (kernel_table.h): the code's magnitude bits
  // become a binary16's exponent and mantissa, giving value * 2^-8.
  static F widen_fp8(const uint8_t* p, int64_t n) {
    F r{};
    for (int64_t i = 0; i < n && i < kLanes; ++i)
      r.x[i] = f16_to_float(static_cast<uint16_t>(((p[i] & 0x7fu) << 7) | ((p[i] & 0x80u) << 8)));
    return r;
  }
};

constexpr KernelTable kScalarTable = {
    VScalar::kLanes,
    VScalar::kQkVecs* VScalar::kLanes,
    simd::qk_f32<VScalar>,
    simd::softcap<VScalar>,
    simd::softmax<VScalar>,
    simd::pv_f32<VScalar>,
    simd::widen_bf16<VScalar>,
    nullptr,
    0,
    nullptr,
    nullptr,
    nullptr,
    nullptr,
    nullptr,
    nullptr,
    nullptr,
    simd::pv_widen<VScalar>,
    simd::dequant_f32<VScalar>,
    nullptr,
    nullptr,
    nullptr,
    0,
    simd::pv_i8<VScalar>,
    simd::pv_fp8<VScalar>,
    simd::pv_i8<VScalar>,
};

}  // namespace

const KernelTable* scalar_kernel_table() { return &kScalarTable; }

}  // namespace attnkit::kernels::cpu
