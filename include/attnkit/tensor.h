// attnkit/tensor.h — non-owning strided views, an owning Tensor, bfloat16.
//
// A TensorView describes memory the caller owns: a pointer, a dtype, a rank
// (1..4), a shape and strides counted in elements (not bytes). Strides may
// be anything non-negative, including 0 for broadcasting where a function
// says so; contiguous row-major is the fast case. A view with data == nullptr
// is "absent" and is how optional outputs are left out.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <string>

#include "attnkit/status.h"

namespace attnkit {

enum class DType : uint8_t {
  kF32,   // IEEE binary32
  kBF16,  // bfloat16: the top 16 bits of a binary32
  kF16,   // IEEE binary16 (weights only)
  kF64,   // IEEE binary64 (weights only)
  kBool,  // one byte per element, nonzero = true
  kI32,
  kI64,
  // 8-bit KV-cache storage (kv_cache.h): 1-byte codes, each block of a
  // token row dequantized with its fp32 scale (value = code * scale).
  kI8,       // signed 8-bit integers, symmetric (-128 is never written)
  kFp8E4M3,  // OCP fp8 E4M3 ("e4m3fn": no infinities, max 448, 0x7f/0xff NaN)
};

const char* dtype_name(DType dtype);
size_t dtype_size(DType dtype);

// bfloat16 storage type. Conversion from float rounds to nearest even and
// keeps NaN a NaN (a quiet one).
struct bf16 {
  uint16_t bits = 0;
};

inline float bf16_to_float(bf16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline bf16 float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return bf16{static_cast<uint16_t>(u >> 16)};
}

// IEEE binary16 to float, exact (subnormals, Inf and NaN included).
float f16_to_float(uint16_t h);

// fp8 E4M3 to float, exact (subnormals included; 0x7f and 0xff are NaN).
float fp8_e4m3_to_float(uint8_t x);
// float to fp8 E4M3: round to nearest even, saturating at +-448 (the
// largest finite value; E4M3 has no infinities); NaN gives 0x7f.
uint8_t float_to_fp8_e4m3(float f);

inline constexpr int kMaxRank = 4;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int rank = 0;
  std::array<int64_t, kMaxRank> shape{};
  std::array<int64_t, kMaxRank> strides{};  // in elements

  bool present() const { return data != nullptr; }
  int64_t numel() const;
  bool is_contiguous() const;
  // "[2, 16, 8, 64] f32" — used in error messages.
  std::string describe() const;

  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
};

// A row-major contiguous view over `data` with the given shape.
TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape);
TensorView make_view(const void* data, DType dtype, std::initializer_list<int64_t> shape);

// Owns a 64-byte aligned, contiguous, zero-initialised buffer.
class Tensor {
 public:
  Tensor() = default;
  // Fails with kResourceExhausted when the byte count overflows or the
  // allocation fails, kInvalidArgument on a negative dimension.
  static Result<Tensor> zeros(DType dtype, std::initializer_list<int64_t> shape);
  static Result<Tensor> zeros(DType dtype, const int64_t* shape, int rank);

  const TensorView& view() const { return view_; }
  void* data() const { return view_.data; }
  template <typename T>
  T* ptr() const {
    return static_cast<T*>(view_.data);
  }
  DType dtype() const { return view_.dtype; }
  int rank() const { return view_.rank; }
  int64_t dim(int i) const { return view_.shape[i]; }
  int64_t numel() const { return view_.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(view_.dtype); }

 private:
  struct Free {
    void operator()(void* p) const;
  };
  std::unique_ptr<void, Free> storage_;
  TensorView view_;
};

}  // namespace attnkit
