#include "io/weight_loader.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "core/checked_math.h"

namespace attnkit::io {
namespace {

std::string dims_str(const int64_t* dims, int rank) {
  std::string s = "[";
  for (int i = 0; i < rank; ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + "]";
}

// One element of a float source as f32. memcpy because safetensors data has
// no alignment guarantee.
float load_element(const unsigned char* p, DType dtype) {
  switch (dtype) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, p, sizeof f);
      return f;
    }
    case DType::kBF16: {
      bf16 b;
      std::memcpy(&b.bits, p, sizeof b.bits);
      return bf16_to_float(b);
    }
    case DType::kF16: {
      uint16_t h;
      std::memcpy(&h, p, sizeof h);
      return f16_to_float(h);
    }
    case DType::kF64: {
      double d;
      std::memcpy(&d, p, sizeof d);
      return static_cast<float>(d);
    }
    default:
      return 0.0f;  // unreachable: the dtype was checked by the caller
  }
}

}  // namespace

std::string weight_name(std::string_view prefix, std::string_view name) {
  std::string s(prefix);
  if (!s.empty() && s.back() != '.') s += '.';
  s += name;
  return s;
}

namespace {

// copy_weight_f32 and copy_weight_keep_bf16: a bf16 source is stored as
// bf16 when keep_bf16, every other source as f32.
Status copy_weight(const WeightMap& weights, std::string_view prefix, std::string_view name,
                   std::initializer_list<int64_t> expected_shape, std::string_view shape_meaning,
                   const char* fn, bool keep_bf16, Tensor* dst) {
  const std::string full = weight_name(prefix, name);
  const std::string where = std::string(fn) + ": weight '" + full + "'";
  const int64_t* want = expected_shape.begin();
  const int want_rank = static_cast<int>(expected_shape.size());
  const std::string want_str =
      dims_str(want, want_rank) +
      (shape_meaning.empty() ? "" : " (" + std::string(shape_meaning) + ")");

  auto it = weights.find(full);
  if (it == weights.end()) return not_found(where + " is missing; expected shape " + want_str);
  const TensorView& src = it->second;

  if (src.rank < 0 || src.rank > kMaxRank)
    return invalid_argument(where + " has rank " + std::to_string(src.rank) +
                            ", must be in [0, 4]");
  if (src.rank != want_rank || !std::equal(want, want + want_rank, src.shape.begin()))
    return invalid_argument(where + " has shape " + dims_str(src.shape.data(), src.rank) +
                            ", expected " + want_str);
  if (src.dtype != DType::kF32 && src.dtype != DType::kBF16 && src.dtype != DType::kF16 &&
      src.dtype != DType::kF64)
    return invalid_argument(where + " has dtype " + dtype_name(src.dtype) +
                            ", must be f32, bf16, f16 or f64");

  int64_t numel = 1;
  for (int i = 0; i < src.rank; ++i) {
    // A negative size cannot match a non-negative expected size; checked
    // anyway because callers may pass computed expected shapes.
    if (src.shape[i] < 0)
      return invalid_argument(where + ": shape[" + std::to_string(i) +
                              "] = " + std::to_string(src.shape[i]) + " must be >= 0");
    if (src.strides[i] < 0)
      return invalid_argument(where + ": strides[" + std::to_string(i) +
                              "] = " + std::to_string(src.strides[i]) + " must be >= 0");
    if (!checked_mul(numel, src.shape[i], &numel))
      return invalid_argument(where + ": element count of " + src.describe() +
                              " overflows 64 bits");
  }
  if (numel > 0) {
    if (src.data == nullptr) return invalid_argument(where + " has no data (nullptr)");
    // The byte offset of the last element must be representable, or the
    // copy loop's address arithmetic below would overflow.
    int64_t last = 0, bytes = 0;
    for (int i = 0; i < src.rank; ++i) {
      int64_t term;
      if (!checked_mul(src.shape[i] - 1, src.strides[i], &term) || !checked_add(last, term, &last))
        return invalid_argument(where + " " + src.describe() +
                                ": shape times strides overflows 64-bit offsets");
    }
    if (!checked_mul(last, static_cast<int64_t>(dtype_size(src.dtype)), &bytes))
      return invalid_argument(where + " " + src.describe() + ": byte offset overflows 64 bits");
  }

  const bool as_bf16 = keep_bf16 && src.dtype == DType::kBF16;
  Tensor out;
  {
    // Tensor::zeros takes a rank-0 shape as a scalar. A shape the config
    // allows may still not fit in memory: say which weight and caller.
    Result<Tensor> r = Tensor::zeros(as_bf16 ? DType::kBF16 : DType::kF32, want, want_rank);
    if (!r.ok()) return Status(r.status().code(), where + ": " + r.status().message());
    out = std::move(r).value();
  }
  if (numel > 0) {
    const size_t esize = dtype_size(src.dtype);
    const auto* base = static_cast<const unsigned char*>(src.data);
    float* o = out.ptr<float>();
    bf16* ob = out.ptr<bf16>();
    // Pad to 4 dims so one loop nest handles every rank; padded dims have
    // size 1 and so never advance.
    int64_t shape[kMaxRank] = {1, 1, 1, 1}, stride[kMaxRank] = {0, 0, 0, 0};
    const int pad = kMaxRank - src.rank;
    for (int i = 0; i < src.rank; ++i) {
      shape[pad + i] = src.shape[i];
      stride[pad + i] = src.strides[i];
    }
    int64_t n = 0;
    for (int64_t a = 0; a < shape[0]; ++a)
      for (int64_t b = 0; b < shape[1]; ++b)
        for (int64_t c = 0; c < shape[2]; ++c)
          for (int64_t d = 0; d < shape[3]; ++d) {
            const int64_t off = a * stride[0] + b * stride[1] + c * stride[2] + d * stride[3];
            if (as_bf16) {
              std::memcpy(&ob[n++].bits, base + off * static_cast<int64_t>(esize), sizeof(bf16));
              continue;
            }
            const float v = load_element(base + off * static_cast<int64_t>(esize), src.dtype);
            if (src.dtype == DType::kF64 && std::isinf(v)) {
              double dv;
              std::memcpy(&dv, base + off * static_cast<int64_t>(esize), sizeof dv);
              if (std::isfinite(dv))
                return invalid_argument(where + ": element " + std::to_string(n) + " = " +
                                        std::to_string(dv) + " (f64) is beyond the f32 range");
            }
            o[n++] = v;
          }
  }
  *dst = std::move(out);
  return Status::Ok();
}

}  // namespace

Status copy_weight_f32(const WeightMap& weights, std::string_view prefix, std::string_view name,
                       std::initializer_list<int64_t> expected_shape,
                       std::string_view shape_meaning, const char* fn, Tensor* dst) {
  return copy_weight(weights, prefix, name, expected_shape, shape_meaning, fn, false, dst);
}

Status copy_weight_keep_bf16(const WeightMap& weights, std::string_view prefix,
                             std::string_view name, std::initializer_list<int64_t> expected_shape,
                             std::string_view shape_meaning, const char* fn, Tensor* dst) {
  return copy_weight(weights, prefix, name, expected_shape, shape_meaning, fn, true, dst);
}

const std::vector<std::string>& ignored_buffers() {
  // Buffers transformers' attention modules registered in older versions
  // (persistent RoPE tables), which many exported state dicts still carry:
  // derived from the config, never weights.
  static const std::vector<std::string> kIgnored = {"rotary_emb.inv_freq", "rotary_emb.cos_cached",
                                                    "rotary_emb.sin_cached"};
  return kIgnored;
}

Status check_no_unexpected(const WeightMap& weights, std::string_view prefix,
                           const std::vector<std::string>& expected_names, const char* fn) {
  std::string under(prefix);
  if (!under.empty() && under.back() != '.') under += '.';
  for (auto it = weights.lower_bound(under); it != weights.end(); ++it) {
    const std::string& name = it->first;
    if (name.compare(0, under.size(), under) != 0) break;  // sorted: past the prefix
    const std::string_view local = std::string_view(name).substr(under.size());
    if (std::find(ignored_buffers().begin(), ignored_buffers().end(), local) !=
        ignored_buffers().end())
      continue;
    bool expected = false;
    for (const std::string& e : expected_names)
      if (name.size() == under.size() + e.size() &&
          name.compare(under.size(), std::string::npos, e) == 0) {
        expected = true;
        break;
      }
    if (!expected) {
      std::string list;
      for (const std::string& e : expected_names) list += (list.empty() ? "" : ", ") + e;
      return invalid_argument(std::string(fn) + ": unexpected weight '" + name + "' under '" +
                              under + "' (expected only: " + (list.empty() ? "none" : list) +
                              "; the buffers rotary_emb.inv_freq, .cos_cached and .sin_cached "
                              "are ignored)");
    }
  }
  return Status::Ok();
}

Status WeightLoader::load(std::string_view name, std::initializer_list<int64_t> expected_shape,
                          std::string_view shape_meaning, Tensor* dst) {
  loaded_.emplace_back(name);
  return copy_weight_f32(weights_, prefix_, name, expected_shape, shape_meaning, fn_, dst);
}

Status WeightLoader::load_matrix(std::string_view name,
                                 std::initializer_list<int64_t> expected_shape,
                                 std::string_view shape_meaning, Tensor* dst) {
  loaded_.emplace_back(name);
  return copy_weight_keep_bf16(weights_, prefix_, name, expected_shape, shape_meaning, fn_, dst);
}

bool WeightLoader::contains(std::string_view name) const {
  return weights_.find(weight_name(prefix_, name)) != weights_.end();
}

Status WeightLoader::finish() const { return check_no_unexpected(weights_, prefix_, loaded_, fn_); }

}  // namespace attnkit::io
