// attnkit/weights.h — named weights and the safetensors reader.
//
// Layers load their weights from a WeightMap: Hugging Face names mapped to
// views in PyTorch's nn.Linear layout ([out_features, in_features]). The
// views may be f32, bf16, f16 or f64; layers convert to their own storage,
// so the map only has to outlive the load call.
//
// A .safetensors file is: a little-endian u64 N, then N bytes of JSON
// {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]},
//  "__metadata__": {"key": "value"}}, then the data section that the
// offsets index. Files are untrusted: every length, offset, shape and dtype
// is checked before anything is read, and the file is memory-mapped rather
// than copied.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>

#include "attnkit/status.h"
#include "attnkit/tensor.h"

namespace attnkit {

using WeightMap = std::map<std::string, TensorView, std::less<>>;

class SafetensorsFile {
 public:
  // Maps the file read-only and validates its header and every tensor entry.
  static Result<SafetensorsFile> open(const std::string& path);
  // Parses a buffer the caller keeps alive for the object's lifetime (no
  // copy). The same validation as open().
  static Result<SafetensorsFile> parse(const void* data, size_t size);

  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  // Views into the mapped data, valid while this object lives (moving the
  // object keeps them valid). Supported dtypes: F64, F32, F16, BF16, I64,
  // I32, BOOL; others are rejected. The views are read-only (the mapping is
  // PROT_READ) and contiguous, but NOT aligned: the format places tensors
  // at arbitrary byte offsets, so read elements with memcpy, never by
  // dereferencing a float* or double* (the layers' weight loading does).
  // Scalars have rank 0. Overlapping byte ranges and duplicate names are
  // rejected; gaps between tensors are allowed.
  const WeightMap& tensors() const { return tensors_; }
  const std::map<std::string, std::string, std::less<>>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  struct Mapping;
  std::unique_ptr<Mapping> mapping_;
  WeightMap tensors_;
  std::map<std::string, std::string, std::less<>> metadata_;
};

// Writes tensors (contiguous or not) to a .safetensors file; the inverse of
// SafetensorsFile::open, used by tests and tools.
Status save_safetensors(const std::string& path, const WeightMap& tensors,
                        const std::map<std::string, std::string, std::less<>>& metadata = {});

}  // namespace attnkit
