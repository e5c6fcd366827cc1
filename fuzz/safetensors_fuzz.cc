// libFuzzer target: SafetensorsFile::parse on arbitrary bytes. When a file
// is accepted, every view must lie inside the input (checked explicitly, and
// every byte is read so ASan sees any overrun of libFuzzer's exact-size
// copy), and every float tensor goes through the layers' weight loader.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "attnkit/weights.h"
#include "io/weight_loader.h"

namespace {

[[noreturn]] void fail(const char* what, const std::string& name) {
  std::fprintf(stderr, "safetensors_fuzz: %s (tensor '%s')\n", what, name.c_str());
  std::abort();
}

attnkit::Status load_as_f32(const attnkit::WeightMap& weights, const std::string& name,
                            const attnkit::TensorView& v, attnkit::Tensor* out) {
  // expected_shape is an initializer_list, so spell out each rank.
  const auto& s = v.shape;
  switch (v.rank) {
    case 0:
      return attnkit::io::copy_weight_f32(weights, "", name, {}, "", "fuzz", out);
    case 1:
      return attnkit::io::copy_weight_f32(weights, "", name, {s[0]}, "", "fuzz", out);
    case 2:
      return attnkit::io::copy_weight_f32(weights, "", name, {s[0], s[1]}, "", "fuzz", out);
    case 3:
      return attnkit::io::copy_weight_f32(weights, "", name, {s[0], s[1], s[2]}, "", "fuzz", out);
    default:
      return attnkit::io::copy_weight_f32(weights, "", name, {s[0], s[1], s[2], s[3]}, "", "fuzz",
                                          out);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attnkit::Result<attnkit::SafetensorsFile> file = attnkit::SafetensorsFile::parse(data, size);
  if (!file.ok()) {
    if (file.status().message().empty()) fail("error without a message", "");
    return 0;
  }
  const attnkit::WeightMap& tensors = file->tensors();
  const uintptr_t lo = reinterpret_cast<uintptr_t>(data), hi = lo + size;
  uint8_t sum = 0;
  for (const auto& [name, v] : tensors) {
    if (v.rank < 0 || v.rank > attnkit::kMaxRank) fail("rank out of range", name);
    if (!v.is_contiguous()) fail("view is not contiguous", name);
    const uintptr_t p = reinterpret_cast<uintptr_t>(v.data);
    const uint64_t nbytes = static_cast<uint64_t>(v.numel()) * attnkit::dtype_size(v.dtype);
    if (p < lo || p > hi || nbytes > hi - p) fail("view outside the input", name);
    for (uint64_t i = 0; i < nbytes; ++i) sum ^= static_cast<const uint8_t*>(v.data)[i];

    const bool is_float = v.dtype == attnkit::DType::kF32 || v.dtype == attnkit::DType::kBF16 ||
                          v.dtype == attnkit::DType::kF16 || v.dtype == attnkit::DType::kF64;
    attnkit::Tensor t;
    const attnkit::Status st = load_as_f32(tensors, name, v, &t);
    // Only f64 values beyond the f32 range may fail a float load.
    if (is_float && !st.ok() && v.dtype != attnkit::DType::kF64) fail(st.message().c_str(), name);
    if (!is_float && st.ok()) fail("non-float dtype loaded as f32", name);
    if (st.ok() && t.numel() != v.numel()) fail("loaded element count differs", name);
  }
  // Strict loading with nothing expected rejects every non-empty map.
  if (attnkit::io::check_no_unexpected(tensors, "", {}, "fuzz").ok() != tensors.empty())
    fail("check_no_unexpected disagrees with the map", "");
  // Keeps the reads above from being optimised away.
  volatile uint8_t sink = sum;
  (void)sink;
  return 0;
}
