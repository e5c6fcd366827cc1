#include "numpy_util.h"

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string_view>
#include <utility>

namespace attnkit::python {
namespace {

py::dtype numpy_dtype(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return py::dtype::of<float>();
    case DType::kF64:
      return py::dtype::of<double>();
    case DType::kF16:
      return py::dtype("float16");
    case DType::kBool:
      return py::dtype::of<bool>();
    case DType::kI32:
      return py::dtype::of<int32_t>();
    case DType::kI64:
      return py::dtype::of<int64_t>();
    case DType::kI8:
      return py::dtype::of<int8_t>();
    case DType::kFp8E4M3:
      return py::dtype::of<uint8_t>();  // the codes; numpy has no fp8
    case DType::kBF16:
      break;  // numpy has no bfloat16; callers widen to float32
  }
  throw std::runtime_error(std::string("attnkit: no numpy dtype for ") + dtype_name(dtype));
}

bool same_dtype(const py::dtype& a, const py::dtype& b) {
  return py::detail::npy_api::get().PyArray_EquivTypes_(a.ptr(), b.ptr());
}

std::string type_name(py::handle obj) {
  return py::str(py::type::handle_of(obj).attr("__name__")).cast<std::string>();
}

std::string dtype_str(const py::dtype& d) {
  return py::str(static_cast<py::handle>(d)).cast<std::string>();
}

std::string rank_rule(const ArgSpec& spec) {
  if (spec.min_rank == spec.max_rank) return "rank " + std::to_string(spec.min_rank);
  return "rank " + std::to_string(spec.min_rank) + " to " + std::to_string(spec.max_rank);
}

std::string accepted_kinds(const char* accept) {
  std::string s;
  auto add = [&s](const char* what) {
    if (!s.empty()) s += " or ";
    s += what;
  };
  if (std::strchr(accept, 'f')) add("floating");
  if (std::strchr(accept, 'i') || std::strchr(accept, 'u')) add("integer");
  if (std::strchr(accept, 'b')) add("bool");
  return s;
}

// Fills view.shape/strides from `a`; returns false when its memory cannot be
// described by a TensorView as it is (negative or unaligned strides,
// misaligned data, foreign byte order is checked by the caller).
bool describe_in_place(const py::array& a, TensorView* view) {
  const auto itemsize = static_cast<int64_t>(a.itemsize());
  if (reinterpret_cast<uintptr_t>(a.data()) % static_cast<uintptr_t>(itemsize) != 0) return false;
  view->rank = static_cast<int>(a.ndim());
  for (int i = 0; i < view->rank; ++i) {
    const int64_t n = a.shape(i), bytes = a.strides(i);
    view->shape[i] = n;
    // A size-1 (or empty) dimension is never stepped along, so its stride
    // does not matter and may be anything numpy left there.
    if (n <= 1) {
      view->strides[i] = 0;
      continue;
    }
    if (bytes < 0 || bytes % itemsize != 0) return false;
    view->strides[i] = bytes / itemsize;
  }
  return true;
}

// Copies v (any strides, rank 0..4) into contiguous dst, element by element
// through memcpy: views into a safetensors mapping are not aligned.
template <typename Src, typename Dst, typename Convert>
void copy_strided(const TensorView& v, Dst* dst, Convert convert) {
  std::array<int64_t, kMaxRank> shape{1, 1, 1, 1}, strides{0, 0, 0, 0};
  const int pad = kMaxRank - v.rank;
  for (int i = 0; i < v.rank; ++i) {
    shape[pad + i] = v.shape[i];
    strides[pad + i] = v.strides[i];
  }
  const char* base = static_cast<const char*>(v.data);
  for (int64_t a = 0; a < shape[0]; ++a)
    for (int64_t b = 0; b < shape[1]; ++b)
      for (int64_t c = 0; c < shape[2]; ++c) {
        const int64_t row = a * strides[0] + b * strides[1] + c * strides[2];
        for (int64_t d = 0; d < shape[3]; ++d) {
          Src x;
          std::memcpy(&x, base + (row + d * strides[3]) * static_cast<int64_t>(sizeof(Src)),
                      sizeof(Src));
          *dst++ = convert(x);
        }
      }
}

void replace_all(std::string* s, std::string_view from, std::string_view to) {
  for (size_t at = s->find(from); at != std::string::npos; at = s->find(from, at + to.size()))
    s->replace(at, from.size(), to);
}

}  // namespace

std::string python_message(std::string msg) {
  // The C++ entry points a Python call reaches, by the name the caller used.
  static constexpr std::pair<std::string_view, std::string_view> kNames[] = {
      {"AttentionLayer::load_weights", "AttentionLayer.load_state_dict"},
      {"AttentionLayer::weight", "AttentionLayer.state_dict"},
      {"AttentionLayer::create", "AttentionLayer"},
      {"LatentAttention::load_weights", "LatentAttention.load_state_dict"},
      {"LatentAttention::weight", "LatentAttention.state_dict"},
      {"LatentAttention::create", "LatentAttention"},
      {"GatedDeltaNet::load_weights", "GatedDeltaNet.load_state_dict"},
      {"GatedDeltaNet::create", "GatedDeltaNet"},
      {"KVCache::create", "KVCache"},
      {"Rope::create", "Rope"},
      {"MoeLayer::", "MoE."},
      {"SafetensorsFile::open", "load_safetensors"},
      {"SafetensorsFile::parse", "load_safetensors"},
      {"Tensor::zeros", "allocating an array"},
      {"model_spec_from_json", "model_spec_from_config"},
      {"Model::", "Model."},
  };
  for (const auto& [cpp, py] : kNames) replace_all(&msg, cpp, py);
  // Every other C++ method (KVCache::attend, Rope::apply, ...) has the same
  // name in Python, after a '.'.
  replace_all(&msg, "::", ".");
  // The attention layers load with load_state_dict in Python (MoE keeps
  // load_weights, its Python name too).
  if (msg.rfind("AttentionLayer.", 0) == 0 || msg.rfind("LatentAttention.", 0) == 0)
    replace_all(&msg, "(call load_weights", "(call load_state_dict");
  return msg;
}

void throw_if_error(const Status& status) {
  if (status.ok()) return;
  const std::string msg = python_message(status.message());
  switch (status.code()) {
    case StatusCode::kIoError:
      PyErr_SetString(PyExc_OSError, msg.c_str());
      throw py::error_already_set();
    case StatusCode::kResourceExhausted:
      PyErr_SetString(PyExc_MemoryError, msg.c_str());
      throw py::error_already_set();
    case StatusCode::kInternal:
      throw std::runtime_error(msg);
    case StatusCode::kOk:
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
    case StatusCode::kNotFound:
      break;
  }
  throw py::value_error(msg);
}

void raise_value_error(const char* fn, const std::string& message) {
  throw py::value_error(std::string(fn) + ": " + message);
}

int64_t checked_int(py::handle obj, const char* fn, const std::string& what) {
  if (!py::isinstance<py::int_>(obj) && !py::hasattr(obj, "__index__"))
    raise_value_error(fn, what + " must be an integer, got " + type_name(obj) + " " +
                              py::repr(obj).cast<std::string>());
  try {
    return py::int_(py::reinterpret_borrow<py::object>(obj)).cast<int64_t>();
  } catch (const py::cast_error&) {
    raise_value_error(
        fn, what + " = " + py::repr(obj).cast<std::string>() + " does not fit a 64-bit integer");
  }
}

double checked_float(py::handle obj, const char* fn, const std::string& what) {
  if (!py::isinstance<py::float_>(obj) && !py::isinstance<py::int_>(obj) &&
      !py::hasattr(obj, "__float__"))
    raise_value_error(fn, what + " must be a number, got " + type_name(obj) + " " +
                              py::repr(obj).cast<std::string>());
  return py::float_(py::reinterpret_borrow<py::object>(obj)).cast<double>();
}

std::string shape_str(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) {
    if (i) s += ", ";
    s += std::to_string(a.shape(i));
  }
  if (a.ndim() == 1) s += ",";
  return s + ")";
}

namespace {

bool strides_accepted(const TensorView& v, ArgSpec::Strides rule) {
  switch (rule) {
    case ArgSpec::Strides::kAny:
      return true;
    case ArgSpec::Strides::kUnitLast:
      return v.rank == 0 || v.shape[v.rank - 1] <= 1 || v.strides[v.rank - 1] == 1;
    case ArgSpec::Strides::kContiguous:
      return v.is_contiguous();
  }
  return false;
}

}  // namespace

InputArray typed_input(py::handle obj, const ArgSpec& spec, DType want, const char* accept) {
  InputArray in;
  in.array = py::array::ensure(obj);
  if (!in.array)
    raise_value_error(spec.fn, std::string(spec.name) + " must be a numpy array " + spec.shape +
                                   ", got " + type_name(obj));
  const auto ndim = static_cast<int>(in.array.ndim());
  if (ndim < spec.min_rank || ndim > spec.max_rank)
    raise_value_error(spec.fn, std::string(spec.name) + " must have " + rank_rule(spec) + " " +
                                   spec.shape + ", got shape " + shape_str(in.array));
  const py::dtype have = in.array.dtype();
  if (!std::strchr(accept, have.kind()))
    raise_value_error(spec.fn, std::string(spec.name) + " has dtype " + dtype_str(have) +
                                   ", must be " + accepted_kinds(accept));
  const py::dtype target = numpy_dtype(want);
  in.view.dtype = want;
  if (same_dtype(have, target) && describe_in_place(in.array, &in.view) &&
      strides_accepted(in.view, spec.strides)) {
    in.view.data = const_cast<void*>(in.array.data());
    return in;
  }
  auto& api = py::detail::npy_api::get();
  PyObject* converted = api.PyArray_FromAny_(
      in.array.ptr(), target.inc_ref().ptr(), 0, 0,
      py::detail::npy_api::NPY_ARRAY_ENSUREARRAY_ | py::detail::npy_api::NPY_ARRAY_C_CONTIGUOUS_ |
          py::detail::npy_api::NPY_ARRAY_ALIGNED_ | py::detail::npy_api::NPY_ARRAY_FORCECAST_,
      nullptr);
  if (!converted) throw py::error_already_set();
  in.array = py::reinterpret_steal<py::array>(converted);
  in.copied = true;
  describe_in_place(in.array, &in.view);
  in.view.data = const_cast<void*>(in.array.data());
  return in;
}

namespace {

// Raises for the first Python int in the (nested) list or tuple `obj` that
// int64 cannot hold, naming it as the caller wrote it ("seq_ids[1] =
// 9223372036854775808"). numpy would make such a list uint64 (wrapped
// below), float64 or object, and the message would show another value.
void check_list_ints(py::handle obj, const ArgSpec& spec, const std::string& index) {
  if (!py::isinstance<py::list>(obj) && !py::isinstance<py::tuple>(obj)) return;
  const py::sequence seq = py::reinterpret_borrow<py::sequence>(obj);
  for (size_t i = 0; i < seq.size(); ++i) {
    const py::object item = seq[i];
    const std::string at = index + "[" + std::to_string(i) + "]";
    if (py::isinstance<py::int_>(item))
      checked_int(item, spec.fn, spec.name + at);
    else
      check_list_ints(item, spec, at);
  }
}

}  // namespace

std::vector<int64_t> int64_values(py::handle obj, const ArgSpec& spec) {
  check_list_ints(obj, spec, "");
  // A 64-bit unsigned array can hold values beyond int64, which the int64
  // conversion below would wrap: they are read as uint64 first.
  const py::array probe = py::array::ensure(obj);
  if (probe && probe.dtype().kind() == 'u' && probe.itemsize() == 8) {
    const auto u = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>::ensure(probe);
    const uint64_t* p = u.data();
    const py::ssize_t cols = u.ndim() == 2 ? u.shape(1) : u.size();
    for (py::ssize_t i = 0; i < u.size(); ++i) {
      if (p[i] <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) continue;
      const std::string at =
          u.ndim() == 2 ? "[" + std::to_string(i / cols) + ", " + std::to_string(i % cols) + "]"
                        : "[" + std::to_string(i) + "]";
      raise_value_error(spec.fn, std::string(spec.name) + at + " = " + std::to_string(p[i]) +
                                     " does not fit a 64-bit integer");
    }
  }
  const InputArray in = typed_input(obj, spec, DType::kI64, "iu");
  const TensorView& v = in.view;
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(v.numel()));
  const int64_t rows = v.rank == 2 ? v.shape[0] : 1, cols = v.shape[v.rank - 1];
  const int64_t row_stride = v.rank == 2 ? v.strides[0] : 0, col_stride = v.strides[v.rank - 1];
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      out.push_back(v.ptr<const int64_t>()[r * row_stride + c * col_stride]);
  return out;
}

InputArray f32_input(py::handle obj, const ArgSpec& spec) {
  return typed_input(obj, spec, DType::kF32, "fiu");
}

InputArray mask_input(py::handle obj, const char* fn) {
  const ArgSpec spec{fn, "mask", 1, 4, "broadcastable to [batch, num_heads, seqlen_q, seqlen_k]"};
  py::array probe = py::array::ensure(obj);
  InputArray in;
  if (probe && probe.dtype().kind() == 'b')
    in = typed_input(probe, spec, DType::kBool, "b");
  else if (!probe || probe.dtype().kind() == 'f')
    in = typed_input(obj, spec, DType::kF32, "f");
  else
    raise_value_error(fn, "mask has dtype " + dtype_str(probe.dtype()) +
                              ", must be bool (True = attend) or floating (added to the scores)");
  // numpy broadcasting aligns trailing axes: prepend size-1 axes.
  const int pad = kMaxRank - in.view.rank;
  for (int i = kMaxRank - 1; i >= 0; --i) {
    in.view.shape[i] = i >= pad ? in.view.shape[i - pad] : 1;
    in.view.strides[i] = i >= pad ? in.view.strides[i - pad] : 0;
  }
  in.view.rank = kMaxRank;
  return in;
}

py::array new_array(DType dtype, std::initializer_list<int64_t> shape, TensorView* view) {
  std::vector<py::ssize_t> dims(shape.begin(), shape.end());
  py::array a(numpy_dtype(dtype), dims);
  if (view) {
    view->data = a.mutable_data();
    view->dtype = dtype;
    describe_in_place(a, view);
    // Keep the natural strides of size-1 dims for a plain contiguous view.
    int64_t stride = 1;
    for (int i = view->rank - 1; i >= 0; --i) {
      view->strides[i] = stride;
      stride *= view->shape[i];
    }
  }
  return a;
}

py::array copy_to_numpy(const TensorView& v) {
  const DType out_dtype = v.dtype == DType::kBF16 ? DType::kF32 : v.dtype;
  std::vector<py::ssize_t> dims(v.shape.begin(), v.shape.begin() + v.rank);
  py::array a(numpy_dtype(out_dtype), dims);
  if (v.numel() == 0) return a;
  auto same = [](auto x) { return x; };
  switch (v.dtype) {
    case DType::kF32:
      copy_strided<float>(v, static_cast<float*>(a.mutable_data()), same);
      break;
    case DType::kF64:
      copy_strided<double>(v, static_cast<double*>(a.mutable_data()), same);
      break;
    case DType::kF16:
      copy_strided<uint16_t>(v, static_cast<uint16_t*>(a.mutable_data()), same);
      break;
    case DType::kBF16:
      copy_strided<bf16>(v, static_cast<float*>(a.mutable_data()),
                         [](bf16 x) { return bf16_to_float(x); });
      break;
    case DType::kBool:
      copy_strided<uint8_t>(v, static_cast<uint8_t*>(a.mutable_data()),
                            [](uint8_t x) { return static_cast<uint8_t>(x != 0); });
      break;
    case DType::kI32:
      copy_strided<int32_t>(v, static_cast<int32_t*>(a.mutable_data()), same);
      break;
    case DType::kI64:
      copy_strided<int64_t>(v, static_cast<int64_t*>(a.mutable_data()), same);
      break;
    case DType::kI8:
    case DType::kFp8E4M3:
      copy_strided<uint8_t>(v, static_cast<uint8_t*>(a.mutable_data()), same);
      break;
  }
  return a;
}

py::array dequantize_to_numpy(const TensorView& codes, const TensorView& scales, int64_t block) {
  std::vector<py::ssize_t> dims(codes.shape.begin(), codes.shape.begin() + codes.rank);
  py::array a(py::dtype::of<float>(), dims);
  float* dst = static_cast<float*>(a.mutable_data());
  const int r = codes.rank;
  int64_t shape[4] = {1, 1, 1, 1}, cs[4] = {0, 0, 0, 0}, ss[4] = {0, 0, 0, 0};
  for (int i = 0; i < r; ++i) {
    shape[4 - r + i] = codes.shape[i];
    cs[4 - r + i] = codes.strides[i];
    ss[4 - r + i] = scales.strides[i];
  }
  const uint8_t* c = codes.ptr<const uint8_t>();
  const float* s = scales.ptr<const float>();
  for (int64_t i0 = 0; i0 < shape[0]; ++i0)
    for (int64_t i1 = 0; i1 < shape[1]; ++i1)
      for (int64_t i2 = 0; i2 < shape[2]; ++i2)
        for (int64_t i3 = 0; i3 < shape[3]; ++i3) {
          const uint8_t code = c[i0 * cs[0] + i1 * cs[1] + i2 * cs[2] + i3 * cs[3]];
          const float scale = s[i0 * ss[0] + i1 * ss[1] + i2 * ss[2] + i3 / block * ss[3]];
          const float value =
              codes.dtype == DType::kI8 ? static_cast<int8_t>(code) : fp8_e4m3_to_float(code);
          *dst++ = value * scale;
        }
  return a;
}

Backend parse_backend(const std::string& text, const char* fn) {
  if (text == "auto") return Backend::kAuto;
  if (text == "reference") return Backend::kReference;
  if (text == "fast") return Backend::kFast;
  raise_value_error(fn, "backend = '" + text + "' must be 'auto', 'reference' or 'fast'");
}

RunOptions parse_run_options(const std::string& backend, int num_threads, const char* fn) {
  RunOptions run;
  run.backend = parse_backend(backend, fn);
  run.num_threads = num_threads;
  return run;
}

WindowSize parse_window_size(py::handle obj, const char* fn) {
  if (obj.is_none()) return {};
  if (!py::isinstance<py::sequence>(obj) || py::isinstance<py::str>(obj) || py::len(obj) != 2)
    raise_value_error(fn, "window_size = " + py::repr(obj).cast<std::string>() +
                              " must be a pair (left, right); -1 = unlimited");
  const py::sequence seq = py::reinterpret_borrow<py::sequence>(obj);
  return {checked_int(seq[0], fn, "window_size[0] (left)"),
          checked_int(seq[1], fn, "window_size[1] (right)")};
}

SparsePattern parse_sparse(py::handle obj, const char* fn) {
  SparsePattern sp;
  if (obj.is_none()) return sp;
  if (!py::isinstance<py::dict>(obj))
    raise_value_error(fn,
                      "sparse must be None or a dict {'kind': 'strided'|'fixed', 'stride': "
                      "l, 'summary': c, 'block_size': b}, got " +
                          type_name(obj));
  const py::dict d = py::reinterpret_borrow<py::dict>(obj);
  if (!d.contains("kind"))
    raise_value_error(fn, "sparse['kind'] is missing; must be 'strided' or 'fixed'");
  for (auto item : d) {
    const std::string key = py::str(item.first).cast<std::string>();
    if (key == "kind") {
      const std::string kind = py::str(item.second).cast<std::string>();
      if (kind == "strided")
        sp.kind = SparsePattern::Kind::kStrided;
      else if (kind == "fixed")
        sp.kind = SparsePattern::Kind::kFixed;
      else
        raise_value_error(fn, "sparse['kind'] = '" + kind + "' must be 'strided' or 'fixed'");
    } else if (key == "stride") {
      sp.stride = checked_int(item.second, fn, "sparse['stride']");
    } else if (key == "summary") {
      sp.summary = checked_int(item.second, fn, "sparse['summary']");
    } else if (key == "block_size") {
      sp.block_size = checked_int(item.second, fn, "sparse['block_size']");
    } else {
      raise_value_error(
          fn, "sparse has unknown key '" + key + "'; known: kind, stride, summary, block_size");
    }
  }
  return sp;
}

std::vector<int32_t> parse_seqlens_k(py::handle obj, const char* fn) {
  std::vector<int32_t> out;
  if (obj.is_none()) return out;
  const std::vector<int64_t> lens = int64_values(obj, {fn, "seqlens_k", 1, 1, "[batch]"});
  for (size_t b = 0; b < lens.size(); ++b) {
    const int64_t n = lens[b];
    if (n < 0 || n > std::numeric_limits<int32_t>::max())
      raise_value_error(fn, "seqlens_k[" + std::to_string(b) + "] = " + std::to_string(n) +
                                " must be in [0, seqlen_k]");
    out.push_back(static_cast<int32_t>(n));
  }
  return out;
}

std::vector<int64_t> parse_positions(py::handle obj, const char* fn) {
  if (obj.is_none()) return {};
  return int64_values(obj, {fn, "positions", 1, 2, "[seq] or [batch, seq]"});
}

float parse_softmax_scale(const std::optional<double>& scale, const char* fn) {
  if (!scale) return 0.0f;  // the C++ API's "1/sqrt(head_dim)"
  const auto s = static_cast<float>(*scale);
  if (!(std::isfinite(s) && s > 0.0f))
    raise_value_error(fn, "softmax_scale = " + py::repr(py::float_(*scale)).cast<std::string>() +
                              " must be finite and > 0 (None = 1/sqrt(head_dim))");
  return s;
}

AttentionOptions parse_sdpa_options(const char* fn, const std::optional<double>& softmax_scale,
                                    bool causal, py::handle window_size, double softcap,
                                    py::handle mask, py::handle sparse, const std::string& backend,
                                    int num_threads, InputArray* mask_array) {
  AttentionOptions opt;
  opt.softmax_scale = parse_softmax_scale(softmax_scale, fn);
  opt.causal = causal;
  opt.window_size = parse_window_size(window_size, fn);
  opt.softcap = static_cast<float>(softcap);
  if (!mask.is_none()) {
    *mask_array = mask_input(mask, fn);
    opt.mask = mask_array->view;
  }
  opt.sparse = parse_sparse(sparse, fn);
  opt.backend = parse_backend(backend, fn);
  opt.num_threads = num_threads;
  return opt;
}

void parse_sinks_and_chunk(py::handle sinks, int64_t chunk_size, const char* fn,
                           AttentionOptions* opt, InputArray* sinks_array) {
  opt->chunk_size = chunk_size;
  if (sinks.is_none()) return;
  *sinks_array = f32_input(sinks, {fn, "sinks", 1, 1, "[num_heads]"});
  opt->sinks = sinks_array->view;
}

void round_to_bf16(const TensorView& src, bf16* dst) {
  int64_t shape[4] = {1, 1, 1, 1}, strides[4] = {0, 0, 0, 0};
  for (int i = 0; i < src.rank; ++i) {
    shape[4 - src.rank + i] = src.shape[i];
    strides[4 - src.rank + i] = src.strides[i];
  }
  const float* p = src.ptr<const float>();
  for (int64_t a = 0; a < shape[0]; ++a)
    for (int64_t b = 0; b < shape[1]; ++b)
      for (int64_t c = 0; c < shape[2]; ++c)
        for (int64_t d = 0; d < shape[3]; ++d)
          *dst++ =
              float_to_bf16(p[a * strides[0] + b * strides[1] + c * strides[2] + d * strides[3]]);
}

DType parse_cache_dtype(const std::string& text, const char* fn, const char* name, bool eight_bit) {
  if (text == "float32" || text == "f32") return DType::kF32;
  if (text == "bfloat16" || text == "bf16") return DType::kBF16;
  if (eight_bit && text == "int8") return DType::kI8;
  if (eight_bit && text == "fp8_e4m3") return DType::kFp8E4M3;
  if (eight_bit)
    raise_value_error(fn, std::string(name) + " = '" + text +
                              "' must be 'float32', 'bfloat16', 'int8' or 'fp8_e4m3'");
  raise_value_error(fn, std::string(name) + " = '" + text +
                            "' must be 'float32' or 'bfloat16' (8-bit K/V carry scales, which "
                            "only the caches keep: KVCache, PagedKVCache, LatentCache)");
}

const char* cache_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "bfloat16";
    case DType::kI8:
      return "int8";
    case DType::kFp8E4M3:
      return "fp8_e4m3";
    default:
      return "float32";
  }
}

WeightMap weights_from_dict(py::handle obj, const char* fn, const std::string& prefix,
                            std::vector<InputArray>* keep) {
  if (!py::isinstance<py::dict>(obj))
    raise_value_error(fn, "state_dict must be a dict {name: array}, got " + type_name(obj));
  const std::string under = prefix.empty() || prefix.back() == '.' ? prefix : prefix + ".";
  WeightMap map;
  for (auto item : py::reinterpret_borrow<py::dict>(obj)) {
    if (!py::isinstance<py::str>(item.first))
      raise_value_error(fn, "state_dict keys must be str, got " + type_name(item.first) + " " +
                                py::repr(item.first).cast<std::string>());
    std::string name = item.first.cast<std::string>();
    // Entries outside the prefix belong to other modules; leave them alone
    // (they may be anything, e.g. integer buffers or scalars).
    if (name.compare(0, under.size(), under) != 0) continue;
    const std::string label = "state_dict['" + name + "']";
    const ArgSpec spec{fn, label.c_str(), 1, 4,
                       "(a weight; torch bfloat16 tensors: pass .float())"};
    py::array probe = py::array::ensure(item.second);
    DType want = DType::kF32;
    if (probe && probe.dtype().kind() == 'f') {
      if (probe.itemsize() == 2) want = DType::kF16;
      if (probe.itemsize() == 8) want = DType::kF64;
    }
    keep->push_back(typed_input(item.second, spec, want, "fiu"));
    map.emplace(std::move(name), keep->back().view);
  }
  return map;
}

}  // namespace attnkit::python
