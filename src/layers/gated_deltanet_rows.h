// The body of GatedDeltaNet::forward and forward_batch: the layer over a
// list of sequences' new rows, each with its own state, in blocks of at
// most kGdnBlockRows rows, so that its scratch is bounded whatever the
// sequences' lengths (src/layers/gated_deltanet.cc).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "attnkit/config.h"
#include "attnkit/model_spec.h"
#include "attnkit/status.h"
#include "attnkit/tensor.h"
#include "kernels/gated_delta_rule_params.h"

namespace attnkit::layers {

// Rows per block: four of the recurrence's chunks, enough rows that the
// projections' GEMMs read their weights once per 256 tokens, few enough
// that a block's scratch (about 97 KiB per row at Qwen3-Next's shape) is
// 25 MiB. A sequence longer than a block runs in pieces that start at
// multiples of it, so its chunks fall where one call's would.
inline constexpr int64_t kGdnBlockRows = 4 * kernels::kGdrChunk;

// One sequence's new rows: row t of x at x + t * ldx, of out at out + t *
// ldo (ldx, ldo the call's); `recurrent` [Hv, dk, dv] and `conv` [K - 1,
// C] its state, read as its start and left at its end.
struct GdnSegment {
  const float* x = nullptr;
  float* out = nullptr;
  float* recurrent = nullptr;
  float* conv = nullptr;
  int64_t len = 0;
};

// Runs the layer (weights in GatedDeltaNet::weight_names() order) over
// every segment, all checked by the caller. Fails only when scratch cannot
// be allocated, before anything is written; `fn` names the caller.
Status gated_deltanet_rows(const char* fn, const GatedDeltaNetConfig& config,
                           const std::vector<Tensor>& weights, int64_t ldx, int64_t ldo,
                           std::span<const GdnSegment> segments, const RunOptions& run);

}  // namespace attnkit::layers
