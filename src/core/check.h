// Argument checks for the public boundary. Each returns a Status whose
// message names the function, the argument, its value and the rule, so the
// call sites stay one line each.
#pragma once

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>

#include "attnkit/config.h"
#include "attnkit/status.h"
#include "attnkit/tensor.h"

namespace attnkit::check {

// `v` is present, has `rank` dims, a dtype from `dtypes`, non-negative
// sizes and strides, and an addressable extent that fits in 64 bits.
Status view(const char* fn, const char* name, const TensorView& v, int rank,
            std::initializer_list<DType> dtypes);

// v.shape[axis] == expected; `what` names the dimension ("num_heads") and
// `source` where the expected value comes from ("q.shape[2]").
Status dim(const char* fn, const char* name, const TensorView& v, int axis, const char* what,
           int64_t expected, const std::string& source);

// Last-dimension stride 1 is not required; but two views must not overlap
// when one is written. Conservative: compares address extents.
bool overlaps(const TensorView& a, const TensorView& b);

// "[2, 3, 4]": a shape for messages; the view's form prints its first
// v.rank sizes.
std::string shape_text(std::span<const int64_t> dims);
std::string shape_text(const TensorView& v);

// An f32 [batch, seq, hidden] activation as the layers read or write it:
// a valid rank-3 view (check::view), shape[2] == hidden (the layer's
// config().hidden_size), the hidden dimension contiguous (projections read
// rows with unit stride; batch and seq strides are free), and where
// `contiguous` the whole view row-major.
Status activation(const char* fn, const char* name, const TensorView& v, int64_t hidden,
                  bool contiguous = false);

// num_threads >= 0 (0 = the default) and backend one of Backend's values.
// `prefix` is how fn's caller reaches the two fields: "run." for a
// RunOptions argument, "" where they are fields of fn's own options
// (AttentionOptions).
Status run_options(const char* fn, int num_threads, Backend backend, const char* prefix);
inline Status run_options(const char* fn, const RunOptions& run) {
  return run_options(fn, run.num_threads, run.backend, "run.");
}

// RoPE computes position * inv_freq in double, so positions must be exact
// there: below 2^53.
constexpr int64_t kMaxPosition = int64_t{1} << 53;

// `positions` for a [batch, seq] input of rows = batch * seq tokens: seq
// entries (shared by the batch), one per row, or, where `empty_ok`, none
// (the caller's default 0, 1, ...); each in [0, kMaxPosition).
Status positions(const char* fn, std::span<const int64_t> positions, int64_t seq, int64_t rows,
                 bool empty_ok);

// `st` with "fn: " before its message (Ok stays Ok): a callee's error in
// the words of the public call that made it.
inline Status prefixed(const char* fn, const Status& st) {
  return st.ok() ? st : Status(st.code(), std::string(fn) + ": " + st.message());
}

inline Status finite_float(const char* fn, const char* name, double value) {
  if (std::isfinite(value)) return Status::Ok();
  return invalid_argument(std::string(fn) + ": " + name + " = " + std::to_string(value) +
                          " must be finite");
}

}  // namespace attnkit::check
