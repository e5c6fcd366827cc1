// LinearStatePool (include/attnkit/linear_state_pool.h) and
// GatedDeltaNet::forward_batch, which runs a ragged step over its slots.
#include "attnkit/linear_state_pool.h"

#include <algorithm>
#include <new>
#include <string>

#include "core/check.h"
#include "layers/gated_deltanet_rows.h"

namespace attnkit {
namespace {

constexpr const char* kCreate = "LinearStatePool::create";
constexpr const char* kBatch = "GatedDeltaNet::forward_batch";

bool same_shape(const GatedDeltaNetConfig& a, const GatedDeltaNetConfig& b) {
  return a.hidden_size == b.hidden_size && a.num_k_heads == b.num_k_heads &&
         a.num_v_heads == b.num_v_heads && a.key_head_dim == b.key_head_dim &&
         a.value_head_dim == b.value_head_dim && a.conv_kernel == b.conv_kernel;
}

std::string id_text(const char* fn, const char* arg, int64_t id) {
  return std::string(fn) + ": " + arg + " = " + std::to_string(id);
}

// x / out of forward_batch: rank 2 f32 [total, hidden], hidden contiguous.
Status check_rows(const char* name, const TensorView& v, int64_t hidden) {
  ATTNKIT_RETURN_IF_ERROR(check::view(kBatch, name, v, 2, {DType::kF32}));
  ATTNKIT_RETURN_IF_ERROR(check::dim(kBatch, name, v, 1, "hidden_size", hidden, "hidden_size"));
  if (v.shape[1] > 1 && v.strides[1] != 1)
    return invalid_argument(std::string(kBatch) + ": " + name +
                            ".strides[1] = " + std::to_string(v.strides[1]) +
                            " must be 1 (the hidden dimension must be contiguous)");
  return Status::Ok();
}

}  // namespace

Result<LinearStatePool> LinearStatePool::create(std::span<const GatedDeltaNetConfig> layers,
                                                int64_t max_sequences) {
  if (max_sequences < 0)
    return invalid_argument(std::string(kCreate) + ": max_sequences = " +
                            std::to_string(max_sequences) + " must be >= 0 (0 = no limit)");
  for (size_t l = 0; l < layers.size(); ++l) {
    const Status st = validate(layers[l]);
    if (!st.ok())
      return Status(st.code(),
                    std::string(kCreate) + ": layers[" + std::to_string(l) + "]: " + st.message());
  }
  LinearStatePool p;
  p.layers_.assign(layers.begin(), layers.end());
  p.max_sequences_ = max_sequences;
  return p;
}

int64_t LinearStatePool::bytes_per_sequence() const {
  int64_t values = 0;
  for (const GatedDeltaNetConfig& c : layers_) values += c.state_values() + c.conv_state_values();
  return values * static_cast<int64_t>(sizeof(float));
}

Result<std::vector<GatedDeltaNetState>> LinearStatePool::new_slot() const {
  std::vector<GatedDeltaNetState> slot;
  slot.reserve(layers_.size());
  for (const GatedDeltaNetConfig& c : layers_) {
    const int64_t channels = 2 * c.num_k_heads * c.key_head_dim + c.num_v_heads * c.value_head_dim;
    GatedDeltaNetState s;
    ATTNKIT_ASSIGN_OR_RETURN(s.conv_, Tensor::zeros(DType::kF32, {1, c.conv_kernel - 1, channels}));
    ATTNKIT_ASSIGN_OR_RETURN(
        s.recurrent_,
        Tensor::zeros(DType::kF32, {1, c.num_v_heads, c.key_head_dim, c.value_head_dim}));
    slot.push_back(std::move(s));
  }
  return slot;
}

Status LinearStatePool::add_sequence(int64_t seq_id) {
  constexpr const char* fn = "LinearStatePool::add_sequence";
  if (seq_id < 0) return invalid_argument(id_text(fn, "seq_id", seq_id) + " must be >= 0");
  if (contains(seq_id)) return invalid_argument(id_text(fn, "seq_id", seq_id) + " is already held");
  if (max_sequences_ > 0 && num_sequences() >= max_sequences_)
    return resource_exhausted(std::string(fn) + ": all " + std::to_string(max_sequences_) +
                              " slots are held (seq_id = " + std::to_string(seq_id) + ")");
  auto slot = new_slot();
  if (!slot.ok()) return check::prefixed(fn, slot.status());
  try {
    slots_.emplace(seq_id, std::move(slot).value());
  } catch (const std::bad_alloc&) {
    return resource_exhausted(std::string(fn) +
                              ": cannot allocate the slot of seq_id = " + std::to_string(seq_id));
  }
  return Status::Ok();
}

Status LinearStatePool::remove(int64_t seq_id) {
  if (slots_.erase(seq_id) == 0)
    return invalid_argument(id_text("LinearStatePool::remove", "seq_id", seq_id) + " is not held");
  return Status::Ok();
}

Status LinearStatePool::fork(int64_t src, int64_t dst) {
  constexpr const char* fn = "LinearStatePool::fork";
  const auto it = slots_.find(src);
  if (it == slots_.end()) return invalid_argument(id_text(fn, "src", src) + " is not held");
  if (dst < 0) return invalid_argument(id_text(fn, "dst", dst) + " must be >= 0");
  if (contains(dst)) return invalid_argument(id_text(fn, "dst", dst) + " is already held");
  if (max_sequences_ > 0 && num_sequences() >= max_sequences_)
    return resource_exhausted(std::string(fn) + ": all " + std::to_string(max_sequences_) +
                              " slots are held (dst = " + std::to_string(dst) + ")");
  auto slot = new_slot();
  if (!slot.ok()) return check::prefixed(fn, slot.status());
  for (size_t l = 0; l < layers_.size(); ++l) {
    const GatedDeltaNetState& from = it->second[l];
    GatedDeltaNetState& to = (*slot)[l];
    std::copy_n(from.conv_.view().ptr<const float>(), from.conv_.view().numel(),
                to.conv_.view().ptr<float>());
    std::copy_n(from.recurrent_.view().ptr<const float>(), from.recurrent_.view().numel(),
                to.recurrent_.view().ptr<float>());
  }
  try {
    slots_.emplace(dst, std::move(slot).value());
  } catch (const std::bad_alloc&) {
    return resource_exhausted(std::string(fn) +
                              ": cannot allocate the slot of dst = " + std::to_string(dst));
  }
  return Status::Ok();
}

Status LinearStatePool::reset(int64_t seq_id) {
  const auto it = slots_.find(seq_id);
  if (it == slots_.end())
    return invalid_argument(id_text("LinearStatePool::reset", "seq_id", seq_id) + " is not held");
  for (GatedDeltaNetState& s : it->second) s.reset();
  return Status::Ok();
}

Result<GatedDeltaNetState*> LinearStatePool::state(int64_t seq_id, int64_t layer) {
  constexpr const char* fn = "LinearStatePool::state";
  if (layer < 0 || layer >= num_layers())
    return invalid_argument(id_text(fn, "layer", layer) + " must be in [0, " +
                            std::to_string(num_layers()) + ")");
  const auto it = slots_.find(seq_id);
  if (it == slots_.end()) return invalid_argument(id_text(fn, "seq_id", seq_id) + " is not held");
  return &it->second[static_cast<size_t>(layer)];
}

Status GatedDeltaNet::forward_batch(const TensorView& x, std::span<const int32_t> cu_seqlens_q,
                                    std::span<const int64_t> seq_ids, LinearStatePool& states,
                                    int64_t layer_index, const TensorView& out,
                                    const RunOptions& run) const {
  const int64_t hidden = config_.hidden_size;
  ATTNKIT_RETURN_IF_ERROR(check_rows("x", x, hidden));
  ATTNKIT_RETURN_IF_ERROR(check_rows("out", out, hidden));
  const int64_t total = x.shape[0];
  ATTNKIT_RETURN_IF_ERROR(check::dim(kBatch, "out", out, 0, "total_tokens", total, "x.shape[0]"));
  if (check::overlaps(out, x))
    return invalid_argument(std::string(kBatch) + ": out overlaps x; out must not alias x");
  if (!loaded())
    return invalid_argument(std::string(kBatch) +
                            ": weights are not loaded (call load_weights first)");
  if (layer_index < 0 || layer_index >= states.num_layers())
    return invalid_argument(
        id_text(kBatch, "layer_index", layer_index) +
        " must be in [0, states.num_layers() = " + std::to_string(states.num_layers()) + ")");
  if (!same_shape(states.layer_config(layer_index), config_))
    return invalid_argument(id_text(kBatch, "layer_index", layer_index) +
                            ": that layer of the state pool has another shape than this layer");
  const size_t n = seq_ids.size();
  if (cu_seqlens_q.size() != n + 1 || cu_seqlens_q[0] != 0 || cu_seqlens_q[n] != total)
    return invalid_argument(
        std::string(kBatch) + ": cu_seqlens_q has " + std::to_string(cu_seqlens_q.size()) +
        " entries from " +
        (cu_seqlens_q.empty() ? std::string("nothing") : std::to_string(cu_seqlens_q[0])) +
        "; want seq_ids.size() + 1 = " + std::to_string(n + 1) +
        " entries from 0 to total_tokens = " + std::to_string(total));
  std::vector<GatedDeltaNetState*> slots(n);
  for (size_t s = 0; s < n; ++s) {
    if (cu_seqlens_q[s + 1] < cu_seqlens_q[s])
      return invalid_argument(std::string(kBatch) + ": cu_seqlens_q[" + std::to_string(s + 1) +
                              "] = " + std::to_string(cu_seqlens_q[s + 1]) + " < cu_seqlens_q[" +
                              std::to_string(s) + "] = " + std::to_string(cu_seqlens_q[s]) +
                              " (must not decrease)");
    if (std::find(seq_ids.begin(), seq_ids.begin() + static_cast<std::ptrdiff_t>(s), seq_ids[s]) !=
        seq_ids.begin() + static_cast<std::ptrdiff_t>(s))
      return invalid_argument(std::string(kBatch) + ": seq_ids[" + std::to_string(s) +
                              "] = " + std::to_string(seq_ids[s]) + " appears twice");
    auto st = states.state(seq_ids[s], layer_index);
    if (!st.ok()) return check::prefixed(kBatch, st.status());
    slots[s] = *st;
  }
  // Everything is checked: the rows run as one call, the projections as
  // one GEMM over every sequence's rows (in blocks of at most
  // layers::kGdnBlockRows rows), the recurrence from each sequence's slot.
  thread_local std::vector<layers::GdnSegment> segments;
  segments.resize(n);
  for (size_t s = 0; s < n; ++s)
    segments[s] = {x.ptr<const float>() + cu_seqlens_q[s] * x.strides[0],
                   out.ptr<float>() + cu_seqlens_q[s] * out.strides[0],
                   slots[s]->recurrent_.ptr<float>(), slots[s]->conv_.ptr<float>(),
                   cu_seqlens_q[s + 1] - cu_seqlens_q[s]};
  return layers::gated_deltanet_rows(kBatch, config_, tensors_, x.strides[0], out.strides[0],
                                     segments, run);
}

}  // namespace attnkit
