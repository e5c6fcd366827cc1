// attnkit/linear_state_pool.h — per-sequence state slots for the
// linear-attention layers of a hybrid model (Qwen3-Next's Gated DeltaNet),
// kept beside a PagedKVCache so that one pool serves the whole stack.
//
// A softmax-attention layer keeps K/V per token, in pages; a Gated DeltaNet
// layer keeps one fixed-size state per sequence (its conv's last inputs and
// S per value head, GatedDeltaNetState), whatever the sequence's length.
// The slots here follow the paged pool's sequences under the pool's own ids:
// the engine calls add_sequence(id) with the id PagedKVCache::add_sequence
// gave, remove(id) with PagedKVCache::remove, fork(src, dst) with
// PagedKVCache::fork. A new slot is zeros (the start of a sequence);
// GatedDeltaNet::forward_batch reads a sequence's slot as its start and
// leaves its end there. Each slot is allocated when its sequence is added
// (not in any kernel) and freed when it is removed.
//
// Every failing call returns an error naming the function, the argument and
// its value, and changes nothing.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <vector>

#include "attnkit/gated_deltanet.h"
#include "attnkit/model_spec.h"
#include "attnkit/status.h"

namespace attnkit {

class LinearStatePool {
 public:
  // One pool layer per entry of `layers` (each validated); no layers is a
  // pool that holds nothing per sequence (a stack without linear layers).
  // max_sequences: slots at most (0 = no limit); add_sequence beyond it
  // fails with kResourceExhausted.
  static Result<LinearStatePool> create(std::span<const GatedDeltaNetConfig> layers,
                                        int64_t max_sequences = 0);

  LinearStatePool(LinearStatePool&&) noexcept = default;
  LinearStatePool& operator=(LinearStatePool&&) noexcept = default;
  LinearStatePool(const LinearStatePool&) = delete;
  LinearStatePool& operator=(const LinearStatePool&) = delete;

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  const GatedDeltaNetConfig& layer_config(int64_t layer) const {
    return layers_[static_cast<size_t>(layer)];
  }
  int64_t max_sequences() const { return max_sequences_; }
  int64_t num_sequences() const { return static_cast<int64_t>(slots_.size()); }
  bool contains(int64_t seq_id) const { return slots_.count(seq_id) != 0; }
  // Bytes of one sequence's slot, every layer (f32 conv and recurrent state).
  int64_t bytes_per_sequence() const;

  // A zero slot for seq_id (>= 0, not held). kResourceExhausted when
  // max_sequences slots are held or the allocation fails.
  Status add_sequence(int64_t seq_id);
  // Frees seq_id's slot (held).
  Status remove(int64_t seq_id);
  // dst (>= 0, not held) gets a copy of src's slot (held): a fork continues
  // from where src stands, as PagedKVCache::fork shares src's pages.
  Status fork(int64_t src, int64_t dst);
  // Back to zeros: the sequence starts again (e.g. after preemption).
  Status reset(int64_t seq_id);

  // seq_id's state in layer `layer`: batch 1, for GatedDeltaNet::forward.
  Result<GatedDeltaNetState*> state(int64_t seq_id, int64_t layer);

 private:
  LinearStatePool() = default;
  Result<std::vector<GatedDeltaNetState>> new_slot() const;

  std::vector<GatedDeltaNetConfig> layers_;
  int64_t max_sequences_ = 0;
  std::map<int64_t, std::vector<GatedDeltaNetState>> slots_;  // id -> one state per layer
};

}  // namespace attnkit
