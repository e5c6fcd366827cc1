// Loading layer weights from a WeightMap (internal API for src/layers/).
//
// Loading is strict and transactional:
//   - every expected weight must be present, with exactly the expected
//     shape; f32, bf16, f16 and f64 sources with any strides are converted
//     to a fresh contiguous f32 Tensor, except that projection matrices
//     (load_matrix) keep a bf16 source as bf16, which kernels::linear runs
//     as it is (half the memory of an f32 copy);
//   - every name under the layer's prefix must be expected, so a typo in a
//     checkpoint or a config that disagrees with it (bias present but
//     qkv_bias false) is an error rather than a silently ignored tensor; the
//     one exception is the non-weight buffers older transformers versions
//     saved with the attention module (ignored_buffers(): rotary_emb.inv_freq,
//     rotary_emb.cos_cached, rotary_emb.sin_cached), which are skipped;
//   - nothing the layer owns changes until all of it validated: load into
//     local Tensors, call finish(), then move them into the layer.
//
//   io::WeightLoader w(weights, prefix, "AttentionLayer::load_weights");
//   Tensor wq, wo;
//   ATTNKIT_RETURN_IF_ERROR(w.load("q_proj.weight", {nh * hd, hidden},
//                                  "num_heads*head_dim, hidden_size", &wq));
//   ATTNKIT_RETURN_IF_ERROR(w.load("o_proj.weight", {hidden, nh * hd},
//                                  "hidden_size, num_heads*head_dim", &wo));
//   ATTNKIT_RETURN_IF_ERROR(w.finish());  // no unexpected names under prefix
//   wq_ = std::move(wq);  wo_ = std::move(wo);
//
// Names: `prefix` joins `name` with a '.' unless it is empty or already ends
// in '.', so "model.layers.0.self_attn" and "model.layers.0.self_attn." are
// the same prefix. Source views may be unaligned (safetensors does not align
// its data), so elements are read with memcpy.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "attnkit/status.h"
#include "attnkit/tensor.h"
#include "attnkit/weights.h"

namespace attnkit::io {

// prefix + '.' + name (see above for when the '.' is added).
std::string weight_name(std::string_view prefix, std::string_view name);

// Looks up weight_name(prefix, name) and, when its shape is `expected_shape`,
// sets *dst to a new contiguous f32 copy. `shape_meaning` describes the
// expected dims for the message ("num_heads*head_dim, hidden_size"); `fn`
// names the caller. *dst is untouched on failure. Errors:
//   kNotFound         the name is absent
//   kInvalidArgument  wrong shape or rank, a non-float dtype, a malformed view
//                     (missing data, negative stride), or an f64 value beyond
//                     the f32 range
//   kResourceExhausted the copy cannot be allocated
Status copy_weight_f32(const WeightMap& weights, std::string_view prefix, std::string_view name,
                       std::initializer_list<int64_t> expected_shape,
                       std::string_view shape_meaning, const char* fn, Tensor* dst);

// copy_weight_f32, except that a bf16 source is copied as bf16 (exactly):
// for projection matrices, which kernels::linear takes in either dtype.
Status copy_weight_keep_bf16(const WeightMap& weights, std::string_view prefix,
                             std::string_view name, std::initializer_list<int64_t> expected_shape,
                             std::string_view shape_meaning, const char* fn, Tensor* dst);

// Names under a layer's prefix that are buffers, not weights, and are
// skipped by the strict check ("rotary_emb.inv_freq", ...).
const std::vector<std::string>& ignored_buffers();

// Strict loading: every weight whose name starts with the prefix (joined as
// above; an empty prefix means every weight) must be one of
// weight_name(prefix, n) for n in `expected_names` or an ignored buffer.
// The error names the first unexpected weight and lists what was expected.
Status check_no_unexpected(const WeightMap& weights, std::string_view prefix,
                           const std::vector<std::string>& expected_names, const char* fn);

// Convenience that remembers what it loaded, so the strict check cannot
// drift from the loads. Holds references: `weights` must outlive it.
class WeightLoader {
 public:
  WeightLoader(const WeightMap& weights, std::string_view prefix, const char* fn)
      : weights_(weights), prefix_(prefix), fn_(fn) {}

  // copy_weight_f32 for one name; records the name as expected (also when
  // the load fails, so a later finish() does not report it twice).
  Status load(std::string_view name, std::initializer_list<int64_t> expected_shape,
              std::string_view shape_meaning, Tensor* dst);
  // load() for a projection matrix: copy_weight_keep_bf16.
  Status load_matrix(std::string_view name, std::initializer_list<int64_t> expected_shape,
                     std::string_view shape_meaning, Tensor* dst);
  // Whether the weight exists (for weights whose presence the config does
  // not determine); does not mark it expected.
  bool contains(std::string_view name) const;
  // check_no_unexpected with every name passed to load().
  Status finish() const;

 private:
  const WeightMap& weights_;
  std::string prefix_;
  const char* fn_;
  std::vector<std::string> loaded_;
};

}  // namespace attnkit::io
