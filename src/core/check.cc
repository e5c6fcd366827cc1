#include "core/check.h"

#include <algorithm>

#include "core/checked_math.h"

namespace attnkit::check {

std::string shape_text(std::span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

std::string shape_text(const TensorView& v) {
  return shape_text(std::span<const int64_t>(v.shape.data(), static_cast<size_t>(v.rank)));
}

Status activation(const char* fn, const char* name, const TensorView& v, int64_t hidden,
                  bool contiguous) {
  ATTNKIT_RETURN_IF_ERROR(view(fn, name, v, 3, {DType::kF32}));
  ATTNKIT_RETURN_IF_ERROR(dim(fn, name, v, 2, "hidden_size", hidden, "config().hidden_size"));
  const std::string f = std::string(fn) + ": " + name;
  if (contiguous && !v.is_contiguous())
    return invalid_argument(f + " " + v.describe() + " must be contiguous (row-major)");
  if (v.shape[2] > 1 && v.strides[2] != 1)
    return invalid_argument(f + ".strides[2] = " + std::to_string(v.strides[2]) +
                            " must be 1 (the hidden dimension must be contiguous)");
  return Status::Ok();
}

Status run_options(const char* fn, int num_threads, Backend backend, const char* prefix) {
  const std::string f = std::string(fn) + ": " + prefix;
  if (num_threads < 0)
    return invalid_argument(f + "num_threads = " + std::to_string(num_threads) +
                            " must be >= 0 (0 = default)");
  if (backend != Backend::kAuto && backend != Backend::kReference && backend != Backend::kFast)
    return invalid_argument(f + "backend = " + std::to_string(static_cast<int>(backend)) +
                            " is not a Backend value");
  return Status::Ok();
}

Status view(const char* fn, const char* name, const TensorView& v, int rank,
            std::initializer_list<DType> dtypes) {
  const std::string prefix = std::string(fn) + ": " + name;
  if (v.data == nullptr) return invalid_argument(prefix + " is missing (data == nullptr)");
  if (v.rank != rank)
    return invalid_argument(prefix + " has rank " + std::to_string(v.rank) + " (" + v.describe() +
                            "), must have rank " + std::to_string(rank));
  if (std::find(dtypes.begin(), dtypes.end(), v.dtype) == dtypes.end()) {
    std::string allowed;
    for (DType d : dtypes) allowed += std::string(allowed.empty() ? "" : " or ") + dtype_name(d);
    return invalid_argument(prefix + ".dtype = " + dtype_name(v.dtype) + " must be " + allowed);
  }
  int64_t extent = 0;  // largest element offset
  for (int i = 0; i < rank; ++i) {
    if (v.shape[i] < 0)
      return invalid_argument(prefix + ".shape[" + std::to_string(i) +
                              "] = " + std::to_string(v.shape[i]) + " must be >= 0");
    if (v.strides[i] < 0)
      return invalid_argument(prefix + ".strides[" + std::to_string(i) +
                              "] = " + std::to_string(v.strides[i]) + " must be >= 0");
  }
  for (int i = 0; i < rank; ++i) {
    if (v.shape[i] == 0) return Status::Ok();  // empty: nothing addressed
    int64_t term;
    if (!checked_mul(v.shape[i] - 1, v.strides[i], &term) || !checked_add(extent, term, &extent))
      return invalid_argument(prefix + " " + v.describe() +
                              ": shape times strides overflows 64-bit offsets");
  }
  int64_t bytes;
  if (!checked_mul(extent + 1, static_cast<int64_t>(dtype_size(v.dtype)), &bytes))
    return invalid_argument(prefix + " " + v.describe() + ": byte extent overflows 64 bits");
  return Status::Ok();
}

Status dim(const char* fn, const char* name, const TensorView& v, int axis, const char* what,
           int64_t expected, const std::string& source) {
  if (v.shape[axis] == expected) return Status::Ok();
  return invalid_argument(std::string(fn) + ": " + name + ".shape[" + std::to_string(axis) + "] (" +
                          what + ") = " + std::to_string(v.shape[axis]) + " must equal " + source +
                          " = " + std::to_string(expected));
}

namespace {
void extent(const TensorView& v, uintptr_t* lo, uintptr_t* hi) {
  int64_t last = 0;
  for (int i = 0; i < v.rank; ++i) {
    if (v.shape[i] == 0) {
      *lo = *hi = reinterpret_cast<uintptr_t>(v.data);
      return;
    }
    last += (v.shape[i] - 1) * v.strides[i];
  }
  *lo = reinterpret_cast<uintptr_t>(v.data);
  *hi = *lo + static_cast<uintptr_t>(last + 1) * dtype_size(v.dtype);
}
}  // namespace

Status positions(const char* fn, std::span<const int64_t> positions, int64_t seq, int64_t rows,
                 bool empty_ok) {
  const std::string f = fn;
  const int64_t n = static_cast<int64_t>(positions.size());
  if (!(n == seq || n == rows || (empty_ok && n == 0)))
    return invalid_argument(f + ": positions has " + std::to_string(n) + " entries, must have " +
                            (empty_ok ? "0 (default), seq = " : "seq = ") + std::to_string(seq) +
                            (empty_ok ? "" : " (shared by the batch)") +
                            " or batch * seq = " + std::to_string(rows));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = positions[static_cast<size_t>(i)];
    if (p < 0 || p >= kMaxPosition)
      return invalid_argument(f + ": positions[" + std::to_string(i) + "] = " + std::to_string(p) +
                              " must be in [0, 2^53)");
  }
  return Status::Ok();
}

bool overlaps(const TensorView& a, const TensorView& b) {
  if (!a.present() || !b.present()) return false;
  uintptr_t alo, ahi, blo, bhi;
  extent(a, &alo, &ahi);
  extent(b, &blo, &bhi);
  if (alo == ahi || blo == bhi) return false;
  return alo < bhi && blo < ahi;
}

}  // namespace attnkit::check
