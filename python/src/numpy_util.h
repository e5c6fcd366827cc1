// Helpers shared by every binding file (python/src/*.cc): numpy
// arrays as TensorViews without copies where possible, new numpy outputs,
// attnkit Status -> Python exceptions, and the option values every binding
// parses the same way (backend, window_size, sparse, seqlens_k, positions,
// cache dtype, weight dicts).
//
// Copy policy: an input that is already a native float32 (or the requested
// dtype) array with non-negative, element-aligned strides is viewed in place
// — any strides, so a transposed or sliced array costs nothing. Anything
// else (float64, lists, negative strides, torch tensors via __array__) is
// converted once into a contiguous copy. Outputs are always new arrays.
//
// GIL: throw_if_error and everything returning or taking py:: objects needs
// the GIL. Compute calls run under py::gil_scoped_release and keep their
// Status until the GIL is back.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/config.h"
#include "attnkit/status.h"
#include "attnkit/tensor.h"
#include "attnkit/weights.h"

namespace attnkit::python {

namespace py = pybind11;

// A C++ Status message in the words of a Python caller: C++ names become
// the bound ones ("AttentionLayer::load_weights" ->
// "AttentionLayer.load_state_dict", "KVCache::attend" -> "KVCache.attend",
// "MoeLayer::" -> "MoE."), so no message shows a '::'.
std::string python_message(std::string msg);

// Raises the Python exception for a failed Status, with its message as
// python_message gives it: InvalidArgument, OutOfRange, NotFound ->
// ValueError; IoError -> OSError; ResourceExhausted -> MemoryError;
// Internal -> RuntimeError. Returns normally on OK. Needs the GIL.
void throw_if_error(const Status& status);

template <typename T>
T value_or_throw(Result<T> result) {
  if (!result.ok()) throw_if_error(result.status());
  return std::move(result).value();
}

// Raises ValueError("<fn>: <message>").
[[noreturn]] void raise_value_error(const char* fn, const std::string& message);

// An input seen by the C++ API. `array` owns or borrows the memory `view`
// points into; keep it alive for as long as the view is used.
struct InputArray {
  py::array array;
  TensorView view;
  bool copied = false;  // true when a conversion copy was made
};

// What an input argument is, for messages and conversion.
struct ArgSpec {
  const char* fn;    // "sdpa"
  const char* name;  // "q"
  int min_rank;      // accepted ranks, within 1..4
  int max_rank;
  const char* shape;  // "[batch, seqlen_q, num_heads, head_dim]", for messages
  // Which views are read in place; any other is copied C-contiguous.
  enum class Strides {
    kAny,         // every layout describe_in_place accepts
    kUnitLast,    // rows of unit stride (the layers' activations)
    kContiguous,  // C-contiguous (APIs that address x as one dense block)
  };
  Strides strides = Strides::kAny;
};

// `obj` as a float32 view (see the copy policy above). Raises ValueError
// naming spec.fn and spec.name when obj is not a real numeric array or its
// rank is outside [min_rank, max_rank].
InputArray f32_input(py::handle obj, const ArgSpec& spec);

// `obj` as a view of dtype `want` (kF32, kF64, kF16, kBool, kI32, kI64),
// same policy as f32_input; `accept` lists the numpy kinds ('f', 'i', 'u',
// 'b') that may be converted.
InputArray typed_input(py::handle obj, const ArgSpec& spec, DType want, const char* accept);

// Every integer array argument (counts, ids, offsets, lengths, positions):
// `obj` as int64 values, flattened row-major, of rank spec.min_rank ..
// spec.max_rank and an integer dtype (else ValueError, as typed_input).
// Never wraps: an element beyond int64 (a uint64 array, or a Python int in
// [2^63, 2^64) in a list) raises "<fn>: <name>[i] = <value as passed> does
// not fit a 64-bit integer". Scalars go through checked_int.
std::vector<int64_t> int64_values(py::handle obj, const ArgSpec& spec);

// An attention mask, numpy-broadcastable to [batch, num_heads, seqlen_q,
// seqlen_k]: bool (keep where True) is kept as bool, any real float dtype
// becomes an f32 additive mask. Rank 1..4; lower ranks are right-aligned as
// numpy broadcasting does (a [seqlen_q, seqlen_k] mask applies to every
// batch and head).
InputArray mask_input(py::handle obj, const char* fn);

// A new C-contiguous numpy array of dtype `dtype` and the view writing into
// it. Contents are uninitialised.
py::array new_array(DType dtype, std::initializer_list<int64_t> shape, TensorView* view);

// A new numpy array holding a copy of `v` (any strides): f32 -> float32,
// bf16 -> float32 (exact), f16 -> float16, f64, i32, i64, bool, int8 as
// themselves, fp8_e4m3 codes as uint8.
py::array copy_to_numpy(const TensorView& v);

// The values of an 8-bit cache view `codes` (int8 or fp8_e4m3, rank 1..4,
// any strides) as float32: code * scale, the scale of element (..., c) at
// (..., c / block) of `scales` (f32, the same leading shape; block = the
// last dimension for one scale per row). Exact: a code has at most 8
// significant bits.
py::array dequantize_to_numpy(const TensorView& codes, const TensorView& scales, int64_t block);

// Rounds f32 `src` (rank 1..4, any strides) into contiguous bf16 `dst`:
// K/V for kv_dtype="bfloat16", since numpy has no bfloat16 to pass directly.
void round_to_bf16(const TensorView& src, bf16* dst);

// "auto" | "reference" | "fast".
Backend parse_backend(const std::string& text, const char* fn);

// The layers' RunOptions from their Python keywords.
RunOptions parse_run_options(const std::string& backend, int num_threads, const char* fn);

// (left, right), each >= -1; None = (-1, -1).
WindowSize parse_window_size(py::handle obj, const char* fn);

// None, or {"kind": "strided"|"fixed", "stride": l, "summary": c,
// "block_size": b} (summary and block_size optional).
SparsePattern parse_sparse(py::handle obj, const char* fn);

// None -> empty; else a 1-D integer sequence of int32 values.
std::vector<int32_t> parse_seqlens_k(py::handle obj, const char* fn);

// None -> empty; else integer positions of shape [seq] or [batch, seq],
// flattened row-major (what Rope::apply and the layers take).
std::vector<int64_t> parse_positions(py::handle obj, const char* fn);

// softmax_scale as the bindings take it: None -> 0 (the C++ API's
// "1/sqrt(head_dim)"), else a finite value > 0.
float parse_softmax_scale(const std::optional<double>& scale, const char* fn);

// The options sdpa() and sdpa_varlen() share (FlashAttention's names),
// parsed in fn's name. A mask's array is kept in *mask_array, which the
// returned options' mask views.
AttentionOptions parse_sdpa_options(const char* fn, const std::optional<double>& softmax_scale,
                                    bool causal, py::handle window_size, double softcap,
                                    py::handle mask, py::handle sparse, const std::string& backend,
                                    int num_threads, InputArray* mask_array);

// Attention sinks and chunked local attention as every attention binding
// takes them: sinks None, or one float logit per query head ([num_heads],
// kept in *sinks_array, which opt->sinks views), and chunk_size (0 = off).
void parse_sinks_and_chunk(py::handle sinks, int64_t chunk_size, const char* fn,
                           AttentionOptions* opt, InputArray* sinks_array);

// "float32" | "f32" -> kF32, "bfloat16" | "bf16" -> kBF16, and with
// `eight_bit` (the caches) "int8" -> kI8, "fp8_e4m3" -> kFp8E4M3; `name` is
// the argument's name in messages.
DType parse_cache_dtype(const std::string& text, const char* fn, const char* name = "dtype",
                        bool eight_bit = true);

// The Python name of a storage dtype: "float32", "bfloat16", "int8" or
// "fp8_e4m3".
const char* cache_dtype_name(DType dtype);

// The entries of a state dict {name: array} under `prefix`, as a WeightMap
// (full names kept). As the layers' loaders do, the prefix is joined with a
// '.' unless it is empty or already ends in one, so "model.layers.1" selects
// "model.layers.1.q_proj.weight" but not "model.layers.10.q_proj.weight". float16/float32/float64
// arrays are viewed as they are (no copy when aligned and non-negatively strided); other real
// numeric arrays are converted to float32. Entries outside the prefix are not looked at. `keep`
// receives the arrays the views point into.
WeightMap weights_from_dict(py::handle obj, const char* fn, const std::string& prefix,
                            std::vector<InputArray>* keep);

// A Python int (or __index__ object) as int64; a Python number as double.
// Raise ValueError("<fn>: <what> must be ...") otherwise.
int64_t checked_int(py::handle obj, const char* fn, const std::string& what);
double checked_float(py::handle obj, const char* fn, const std::string& what);

// "(2, 3, 4)" — a Python-style shape for messages.
std::string shape_str(const py::array& a);

}  // namespace attnkit::python
