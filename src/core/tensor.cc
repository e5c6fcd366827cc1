#include "attnkit/tensor.h"

#include <cmath>
#include <cstdlib>
#include <limits>
#include <new>

#include "core/checked_math.h"

namespace attnkit {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
    case DType::kF64:
      return "f64";
    case DType::kBool:
      return "bool";
    case DType::kI32:
      return "i32";
    case DType::kI64:
      return "i64";
    case DType::kI8:
      return "int8";
    case DType::kFp8E4M3:
      return "fp8_e4m3";
  }
  return "unknown";
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 4;
    case DType::kBF16:
      return 2;
    case DType::kF16:
      return 2;
    case DType::kF64:
      return 8;
    case DType::kBool:
      return 1;
    case DType::kI32:
      return 4;
    case DType::kI64:
      return 8;
    case DType::kI8:
    case DType::kFp8E4M3:
      return 1;
  }
  return 0;
}

float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // Inf or NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    bits = sign | (static_cast<uint32_t>(112 - e) << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

float fp8_e4m3_to_float(uint8_t x) {
  const int exp = (x >> 3) & 0xf, mant = x & 7;
  float mag;
  if ((x & 0x7f) == 0x7f)
    mag = std::numeric_limits<float>::quiet_NaN();
  else if (exp == 0)
    mag = std::ldexp(static_cast<float>(mant), -9);  // subnormal: mant * 2^-6 / 8
  else
    mag = std::ldexp(static_cast<float>(8 + mant), exp - 10);  // (1 + mant / 8) * 2^(exp - 7)
  return (x & 0x80) ? -mag : mag;
}

uint8_t float_to_fp8_e4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  const float a = std::fabs(f);
  if (a >= 448.0f) return sign | 0x7e;
  // Below the smallest normal (2^-6) the step is 2^-9. nearbyint rounds
  // half to even; a subnormal rounding up to 8 steps is the smallest
  // normal, whose code is 8 too.
  if (a < 0x1p-6f) return sign | static_cast<uint8_t>(std::nearbyint(std::ldexp(a, 9)));
  int e;
  const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1): exponent field e + 6
  int steps = static_cast<int>(std::nearbyint(std::ldexp(m, 4)));  // 8..16 eighths above 1
  if (steps == 16) {
    steps = 8;
    ++e;
  }
  const int code = ((e + 6) << 3) | (steps - 8);
  return sign | static_cast<uint8_t>(code > 0x7e ? 0x7e : code);
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= shape[i];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  for (int i = rank - 1; i >= 0; --i) {
    if (shape[i] != 1 && strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

std::string TensorView::describe() const {
  std::string s = "[";
  for (int i = 0; i < rank; ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  s += "] ";
  s += dtype_name(dtype);
  return s;
}

TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.rank = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t d : shape) v.shape[i++] = d;
  // Saturating: a shape whose strides overflow gives INT64_MAX strides,
  // which every entry point's view check then rejects (no UB here).
  int64_t stride = 1;
  for (int r = v.rank - 1; r >= 0; --r) {
    v.strides[r] = stride;
    if (!checked_mul(stride, v.shape[r], &stride)) stride = INT64_MAX;
  }
  return v;
}

TensorView make_view(const void* data, DType dtype, std::initializer_list<int64_t> shape) {
  return make_view(const_cast<void*>(data), dtype, shape);
}

void Tensor::Free::operator()(void* p) const { std::free(p); }

Result<Tensor> Tensor::zeros(DType dtype, std::initializer_list<int64_t> shape) {
  return zeros(dtype, shape.begin(), static_cast<int>(shape.size()));
}

Result<Tensor> Tensor::zeros(DType dtype, const int64_t* shape, int rank) {
  if (rank < 0 || rank > kMaxRank)
    return invalid_argument("Tensor::zeros: rank = " + std::to_string(rank) + " must be in [0, 4]");
  int64_t numel = 1;
  for (int i = 0; i < rank; ++i) {
    if (shape[i] < 0)
      return invalid_argument("Tensor::zeros: shape[" + std::to_string(i) +
                              "] = " + std::to_string(shape[i]) + " must be >= 0");
    if (!checked_mul(numel, shape[i], &numel))
      return resource_exhausted("Tensor::zeros: element count overflows 64 bits");
  }
  int64_t bytes;
  if (!checked_mul(numel, static_cast<int64_t>(dtype_size(dtype)), &bytes))
    return resource_exhausted("Tensor::zeros: byte count overflows 64 bits");
  // Round up to the alignment (aligned_alloc requires a multiple) and keep
  // at least one line so an empty tensor still has a non-null pointer.
  int64_t padded;
  if (!checked_add(bytes, int64_t{63}, &padded))
    return resource_exhausted("Tensor::zeros: byte count overflows 64 bits");
  padded = padded / 64 * 64;
  if (padded == 0) padded = 64;
  void* p = std::aligned_alloc(64, static_cast<size_t>(padded));
  if (p == nullptr)
    return resource_exhausted("Tensor::zeros: allocation of " + std::to_string(padded) +
                              " bytes failed");
  std::memset(p, 0, static_cast<size_t>(padded));
  Tensor t;
  t.storage_.reset(p);
  t.view_.data = p;
  t.view_.dtype = dtype;
  t.view_.rank = rank;
  int64_t stride = 1;
  for (int r = rank - 1; r >= 0; --r) {
    t.view_.shape[r] = shape[r];
    t.view_.strides[r] = stride;
    stride *= shape[r];
  }
  return t;
}

}  // namespace attnkit
