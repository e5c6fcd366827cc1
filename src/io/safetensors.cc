// SafetensorsFile and save_safetensors. The file is untrusted input: the
// header is parsed and every entry checked (dtype, shape, offsets, overlaps,
// duplicates) into a temporary map; views are handed out only when all of
// it passed. Nothing throws out: nlohmann's exceptions and bad_alloc are
// caught at the two entry points.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <system_error>
#include <utility>
#include <vector>

#include "attnkit/weights.h"
#include "core/check.h"
#include "core/checked_math.h"

namespace attnkit {

// The format stores the header length and all tensor data little-endian;
// views hand the bytes out as they are.
static_assert(std::endian::native == std::endian::little,
              "safetensors views assume a little-endian host");

namespace {

using json = nlohmann::json;

// The reference implementation refuses headers over 100 MB, and so do we:
// the header is parsed into a tree many times its size, so a length field
// of, say, 4 GB in a hostile file would otherwise cost tens of GB of memory.
// Real headers are far smaller (about 150 bytes per tensor: a few MB for
// the largest checkpoints).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// A valid header is an object of objects holding a shape array: three
// levels. Deeper nesting is rejected before parsing, because the parser's
// own stacks grow with depth.
constexpr int kMaxHeaderDepth = 3;

struct DTypeEntry {
  const char* name;
  DType dtype;
};
constexpr DTypeEntry kSupported[] = {
    {"F64", DType::kF64}, {"F32", DType::kF32}, {"F16", DType::kF16},   {"BF16", DType::kBF16},
    {"I64", DType::kI64}, {"I32", DType::kI32}, {"BOOL", DType::kBool},
};
// Dtypes the format defines that attnkit has no DType for; named so the
// message can say "unsupported" rather than "unknown".
constexpr const char* kKnownUnsupported[] = {
    "U8",      "I8",      "U16",     "I16",     "U32", "U64", "F8_E5M2",
    "F8_E4M3", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4",  "C64",
};

const char* safetensors_dtype_name(DType d) {
  for (const DTypeEntry& e : kSupported)
    if (e.dtype == d) return e.name;
  return nullptr;
}

// Untrusted strings go into messages cut to a readable length.
std::string clip(std::string_view s) {
  constexpr size_t kMax = 120;
  if (s.size() <= kMax) return std::string(s);
  return std::string(s.substr(0, kMax)) + "...(" + std::to_string(s.size()) + " bytes)";
}

std::string show(const json& j) {
  // Parsed strings are valid UTF-8, so replace never triggers; it only
  // keeps dump() from throwing.
  return clip(j.dump(-1, ' ', false, json::error_handler_t::replace));
}

// The deepest bracket nesting outside strings, stopping early once it
// exceeds `limit`. Malformed JSON is left for the parser to report.
int nesting_depth(const char* p, size_t n, int limit) {
  int depth = 0, deepest = 0;
  bool in_string = false;
  for (size_t i = 0; i < n; ++i) {
    const char c = p[i];
    if (in_string) {
      if (c == '\\')
        ++i;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      deepest = std::max(deepest, ++depth);
      if (deepest > limit) return deepest;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return deepest;
}

struct Range {
  uint64_t begin, end;
  const std::string* name;
};

class HeaderReader {
 public:
  // `fn` and `source` prefix every message: "SafetensorsFile::open: 'a.st'".
  HeaderReader(const char* fn, std::string source) : prefix_(std::string(fn) + ": " + source) {}

  Status read(const unsigned char* data, uint64_t size, WeightMap* tensors,
              std::map<std::string, std::string, std::less<>>* metadata) const;

 private:
  Status fail(const std::string& what) const { return invalid_argument(prefix_ + ": " + what); }
  Status tensor_fail(const std::string& name, const std::string& what) const {
    return fail("tensor '" + clip(name) + "': " + what);
  }
  Status parse_json(const char* text, size_t n, json* header) const;
  Status read_entry(const std::string& name, const json& entry, uint64_t data_size, DType* dtype,
                    int* rank, int64_t* shape, uint64_t* begin) const;

  std::string prefix_;
};

Status HeaderReader::parse_json(const char* text, size_t n, json* header) const {
  // nlohmann's lexer takes a NUL byte as the end of input and would ignore
  // whatever follows it; JSON text never contains one.
  if (const void* nul = std::memchr(text, '\0', n))
    return fail("header is not valid JSON (NUL byte at header offset " +
                std::to_string(static_cast<const char*>(nul) - text) + ")");
  const int depth = nesting_depth(text, n, kMaxHeaderDepth);
  if (depth > kMaxHeaderDepth)
    return fail("header JSON nests more than " + std::to_string(kMaxHeaderDepth) +
                " levels deep; a safetensors header needs " + std::to_string(kMaxHeaderDepth));
  // nlohmann keeps one of two equal keys silently; a duplicated tensor name
  // would make the file mean two things, so duplicates are found here, at
  // every object level, with their decoded spelling.
  std::vector<std::set<std::string>> keys;
  std::string duplicate;
  auto on_event = [&](int /*depth*/, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::object_start) {
      keys.emplace_back();
    } else if (event == json::parse_event_t::object_end) {
      keys.pop_back();
    } else if (event == json::parse_event_t::key && !keys.empty()) {
      const std::string& k = parsed.get_ref<const std::string&>();
      if (!keys.back().insert(k).second && duplicate.empty()) duplicate = k;
    }
    return true;
  };
  try {
    *header = json::parse(text, text + n, on_event);
  } catch (const json::exception& e) {
    return fail(std::string("header is not valid JSON (") + e.what() + ")");
  }
  if (!duplicate.empty()) return fail("header has the key '" + clip(duplicate) + "' twice");
  return Status::Ok();
}

Status HeaderReader::read_entry(const std::string& name, const json& entry, uint64_t data_size,
                                DType* dtype, int* rank, int64_t* shape, uint64_t* begin) const {
  if (!entry.is_object())
    return tensor_fail(name, std::string("entry must be a JSON object, got ") + entry.type_name() +
                                 " " + show(entry));
  for (const auto& [key, value] : entry.items()) {
    if (key != "dtype" && key != "shape" && key != "data_offsets")
      return tensor_fail(
          name, "unknown field '" + clip(key) + "' (fields are dtype, shape, data_offsets)");
  }
  for (const char* field : {"dtype", "shape", "data_offsets"})
    if (!entry.contains(field))
      return tensor_fail(name, std::string("missing field '") + field + "'");

  const json& jd = entry["dtype"];
  if (!jd.is_string()) return tensor_fail(name, "dtype = " + show(jd) + " must be a string");
  const std::string& dname = jd.get_ref<const std::string&>();
  const DTypeEntry* found = nullptr;
  for (const DTypeEntry& e : kSupported)
    if (dname == e.name) found = &e;
  if (found == nullptr) {
    const bool known = std::find(std::begin(kKnownUnsupported), std::end(kKnownUnsupported),
                                 dname) != std::end(kKnownUnsupported);
    return tensor_fail(name, "dtype = \"" + clip(dname) + "\" is " +
                                 (known ? "not supported" : "not a safetensors dtype") +
                                 " (supported: F64, F32, F16, BF16, I64, I32, BOOL)");
  }
  *dtype = found->dtype;

  const json& js = entry["shape"];
  if (!js.is_array()) return tensor_fail(name, "shape = " + show(js) + " must be an array");
  if (js.size() > static_cast<size_t>(kMaxRank))
    return tensor_fail(name, "shape = " + show(js) + " has rank " + std::to_string(js.size()) +
                                 "; at most " + std::to_string(kMaxRank) + " is supported");
  *rank = static_cast<int>(js.size());
  int64_t numel = 1;
  for (int i = 0; i < *rank; ++i) {
    const json& d = js[static_cast<size_t>(i)];
    const std::string at = "shape[" + std::to_string(i) + "] = " + show(d);
    if (d.is_number_unsigned()) {
      if (d.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        return tensor_fail(name, at + " does not fit in 64-bit signed");
      shape[i] = static_cast<int64_t>(d.get<uint64_t>());
    } else if (d.is_number_integer()) {
      shape[i] = d.get<int64_t>();
      if (shape[i] < 0) return tensor_fail(name, at + " must be >= 0");
    } else {
      return tensor_fail(name, at + " must be a non-negative integer");
    }
    if (!checked_mul(numel, shape[i], &numel))
      return tensor_fail(name, "shape = " + show(js) + ": element count overflows 64 bits");
  }
  int64_t nbytes;
  if (!checked_mul(numel, static_cast<int64_t>(dtype_size(*dtype)), &nbytes))
    return tensor_fail(name,
                       "shape = " + show(js) + " of " + dname + ": byte count overflows 64 bits");

  const json& jo = entry["data_offsets"];
  if (!jo.is_array() || jo.size() != 2 || !jo[0].is_number_unsigned() ||
      !jo[1].is_number_unsigned())
    return tensor_fail(
        name, "data_offsets = " + show(jo) + " must be [begin, end] with non-negative integers");
  const uint64_t b = jo[0].get<uint64_t>(), e = jo[1].get<uint64_t>();
  if (b > e) return tensor_fail(name, "data_offsets = " + show(jo) + ": begin > end");
  if (e > data_size)
    return tensor_fail(name, "data_offsets = " + show(jo) + ": end is beyond the data section (" +
                                 std::to_string(data_size) + " bytes)");
  if (e - b != static_cast<uint64_t>(nbytes))
    return tensor_fail(name, "data_offsets = " + show(jo) + " span " + std::to_string(e - b) +
                                 " bytes, but shape " + show(js) + " of " + dname + " needs " +
                                 std::to_string(nbytes));
  *begin = b;
  return Status::Ok();
}

Status HeaderReader::read(const unsigned char* data, uint64_t size, WeightMap* tensors,
                          std::map<std::string, std::string, std::less<>>* metadata) const {
  if (size < 8)
    return fail("file is " + std::to_string(size) +
                " bytes, shorter than the 8-byte header length field");
  uint64_t n;
  std::memcpy(&n, data, sizeof n);
  if (n > size - 8)
    return fail("header length = " + std::to_string(n) + " exceeds the " +
                std::to_string(size - 8) + " bytes after the length field");
  if (n > kMaxHeaderBytes)
    return fail("header length = " + std::to_string(n) + " exceeds the limit of " +
                std::to_string(kMaxHeaderBytes) + " bytes");
  const char* text = reinterpret_cast<const char*>(data + 8);
  if (n == 0 || text[0] != '{') return fail("header must be a JSON object starting with '{'");
  const uint64_t data_size = size - 8 - n;
  const unsigned char* data_section = data + 8 + n;

  json header;
  ATTNKIT_RETURN_IF_ERROR(parse_json(text, static_cast<size_t>(n), &header));
  if (!header.is_object())
    return fail(std::string("header must be a JSON object, got ") + header.type_name());

  WeightMap out;
  std::map<std::string, std::string, std::less<>> meta;
  std::vector<Range> ranges;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object())
        return fail("__metadata__ = " + show(entry) + " must be an object of strings");
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string())
          return fail("__metadata__['" + clip(key) + "'] = " + show(value) + " must be a string");
        meta.emplace(key, value.get<std::string>());
      }
      continue;
    }
    DType dtype{};
    int rank = 0;
    int64_t shape[kMaxRank] = {};
    uint64_t begin = 0;
    ATTNKIT_RETURN_IF_ERROR(read_entry(name, entry, data_size, &dtype, &rank, shape, &begin));
    TensorView v;
    // Views are typed void* for the API; the data stays read-only (the
    // mapping is PROT_READ).
    v.data = const_cast<unsigned char*>(data_section + begin);
    v.dtype = dtype;
    v.rank = rank;
    int64_t stride = 1;
    for (int r = rank - 1; r >= 0; --r) {
      v.shape[r] = shape[r];
      v.strides[r] = stride;
      stride *= shape[r];  // cannot overflow: numel was checked
    }
    // Keys of a parsed object are unique, so this always inserts.
    const auto it = out.emplace(name, v).first;
    const uint64_t nbytes = static_cast<uint64_t>(v.numel()) * dtype_size(dtype);
    if (nbytes > 0) ranges.push_back({begin, begin + nbytes, &it->first});
  }

  // Two tensors sharing bytes would alias each other; the format forbids
  // it. Empty tensors occupy nothing and were left out above.
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].begin < ranges[i - 1].end)
      return fail("tensors '" + clip(*ranges[i - 1].name) + "' (bytes [" +
                  std::to_string(ranges[i - 1].begin) + ", " + std::to_string(ranges[i - 1].end) +
                  ")) and '" + clip(*ranges[i].name) + "' (bytes [" +
                  std::to_string(ranges[i].begin) + ", " + std::to_string(ranges[i].end) +
                  ")) overlap");
  }
  *tensors = std::move(out);
  *metadata = std::move(meta);
  return Status::Ok();
}

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

}  // namespace

struct SafetensorsFile::Mapping {
  void* addr = nullptr;
  size_t size = 0;
  Mapping(void* a, size_t s) : addr(a), size(s) {}
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { ::munmap(addr, size); }
};

SafetensorsFile::SafetensorsFile(SafetensorsFile&&) noexcept = default;
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&&) noexcept = default;
SafetensorsFile::~SafetensorsFile() = default;

Result<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  constexpr const char* kFn = "SafetensorsFile::open";
  const std::string where = std::string(kFn) + ": '" + path + "'";
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return io_error(where + ": cannot open: " + errno_text(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return io_error(where + ": cannot stat: " + errno_text(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return io_error(where + ": not a regular file");
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    return invalid_argument(where + ": file is " + std::to_string(size) +
                            " bytes, shorter than the 8-byte header length field");
  }
  // MAP_PRIVATE + PROT_READ: the views can never write through to the file.
  // Truncating the file while it is mapped makes later reads fault (SIGBUS);
  // that is the usual contract of mapped files and not checked here.
  void* addr = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (addr == MAP_FAILED) return io_error(where + ": cannot map: " + errno_text(map_err));

  try {
    SafetensorsFile file;
    file.mapping_ = std::make_unique<Mapping>(addr, static_cast<size_t>(size));
    HeaderReader reader(kFn, "'" + path + "'");
    ATTNKIT_RETURN_IF_ERROR(reader.read(static_cast<const unsigned char*>(addr), size,
                                        &file.tensors_, &file.metadata_));
    return file;
  } catch (const std::bad_alloc&) {
    return resource_exhausted(where + ": out of memory while reading the header");
  } catch (const std::exception& e) {
    return internal_error(where + ": unexpected exception: " + e.what());
  }
}

Result<SafetensorsFile> SafetensorsFile::parse(const void* data, size_t size) {
  constexpr const char* kFn = "SafetensorsFile::parse";
  if (data == nullptr && size != 0)
    return invalid_argument(std::string(kFn) +
                            ": <buffer>: data is nullptr but size = " + std::to_string(size));
  try {
    SafetensorsFile file;
    HeaderReader reader(kFn, "<buffer>");
    ATTNKIT_RETURN_IF_ERROR(reader.read(static_cast<const unsigned char*>(data), size,
                                        &file.tensors_, &file.metadata_));
    return file;
  } catch (const std::bad_alloc&) {
    return resource_exhausted(std::string(kFn) +
                              ": <buffer>: out of memory while reading the header");
  } catch (const std::exception& e) {
    return internal_error(std::string(kFn) + ": <buffer>: unexpected exception: " + e.what());
  }
}

namespace {

// Writes the whole buffer or reports why not.
Status write_all(std::FILE* f, const void* p, size_t n, const std::string& where) {
  if (n == 0) return Status::Ok();
  if (std::fwrite(p, 1, n, f) != n) return io_error(where + ": write failed: " + errno_text(errno));
  return Status::Ok();
}

// Appends the elements of `v` in row-major order (a contiguous copy of any
// strided view).
Status write_tensor(std::FILE* f, const TensorView& v, const std::string& where) {
  const int64_t numel = v.numel();
  if (numel == 0) return Status::Ok();
  const size_t esize = dtype_size(v.dtype);
  if (v.is_contiguous()) return write_all(f, v.data, static_cast<size_t>(numel) * esize, where);
  std::vector<unsigned char> buf(static_cast<size_t>(numel) * esize);
  int64_t shape[kMaxRank] = {1, 1, 1, 1}, stride[kMaxRank] = {0, 0, 0, 0};
  const int pad = kMaxRank - v.rank;
  for (int i = 0; i < v.rank; ++i) {
    shape[pad + i] = v.shape[i];
    stride[pad + i] = v.strides[i];
  }
  const auto* src = static_cast<const unsigned char*>(v.data);
  unsigned char* dst = buf.data();
  for (int64_t a = 0; a < shape[0]; ++a)
    for (int64_t b = 0; b < shape[1]; ++b)
      for (int64_t c = 0; c < shape[2]; ++c)
        for (int64_t d = 0; d < shape[3]; ++d) {
          const int64_t off = a * stride[0] + b * stride[1] + c * stride[2] + d * stride[3];
          std::memcpy(dst, src + off * static_cast<int64_t>(esize), esize);
          dst += esize;
        }
  return write_all(f, buf.data(), buf.size(), where);
}

}  // namespace

Status save_safetensors(const std::string& path, const WeightMap& tensors,
                        const std::map<std::string, std::string, std::less<>>& metadata) {
  constexpr const char* kFn = "save_safetensors";
  const std::string where = std::string(kFn) + ": '" + path + "'";
  std::string header;
  try {
    json h = json::object();
    uint64_t offset = 0;
    for (const auto& [name, v] : tensors) {
      const std::string arg = "tensors['" + clip(name) + "']";
      if (name == "__metadata__")
        return invalid_argument(std::string(kFn) + ": " + arg +
                                ": the name is reserved for the metadata");
      if (v.rank < 0 || v.rank > kMaxRank)
        return invalid_argument(std::string(kFn) + ": " + arg +
                                ".rank = " + std::to_string(v.rank) + " must be in [0, 4]");
      if (safetensors_dtype_name(v.dtype) == nullptr)
        return invalid_argument(std::string(kFn) + ": " + arg + ".dtype = " +
                                std::to_string(static_cast<int>(v.dtype)) + " is not a DType");
      bool empty = false;
      for (int i = 0; i < v.rank; ++i) {
        if (v.shape[i] < 0)
          return invalid_argument(std::string(kFn) + ": " + arg + ".shape[" + std::to_string(i) +
                                  "] = " + std::to_string(v.shape[i]) + " must be >= 0");
        empty = empty || v.shape[i] == 0;
      }
      // An empty view needs no data; any other is checked like an argument.
      if (!empty)
        ATTNKIT_RETURN_IF_ERROR(check::view(kFn, arg.c_str(), v, v.rank,
                                            {DType::kF64, DType::kF32, DType::kF16, DType::kBF16,
                                             DType::kI64, DType::kI32, DType::kBool}));
      // check::view proved the byte extent fits in 64 bits; numel is at
      // most that extent.
      const uint64_t nbytes = empty ? 0 : static_cast<uint64_t>(v.numel()) * dtype_size(v.dtype);
      json shape = json::array();
      for (int i = 0; i < v.rank; ++i) shape.push_back(v.shape[i]);
      if (offset + nbytes < offset)
        return invalid_argument(std::string(kFn) + ": total data size overflows 64 bits");
      h[name] = {{"dtype", safetensors_dtype_name(v.dtype)},
                 {"shape", std::move(shape)},
                 {"data_offsets", {offset, offset + nbytes}}};
      offset += nbytes;
    }
    if (!metadata.empty()) h["__metadata__"] = metadata;
    header = h.dump();  // throws type_error on names that are not UTF-8
  } catch (const json::exception& e) {
    return invalid_argument(std::string(kFn) + ": tensor names and metadata must be valid UTF-8 (" +
                            e.what() + ")");
  } catch (const std::bad_alloc&) {
    return resource_exhausted(where + ": out of memory building the header");
  }
  // Pad with spaces to a multiple of 8 so the data section starts 8-byte
  // aligned within the file, as the reference writer does.
  header.append((8 - header.size() % 8) % 8, ' ');
  if (header.size() > kMaxHeaderBytes)
    return invalid_argument(where + ": header would be " + std::to_string(header.size()) +
                            " bytes, over the " + std::to_string(kMaxHeaderBytes) +
                            " that readers accept");

  // Written to a temporary file renamed over `path` at the end, so a failed
  // save leaves no partial file.
  std::string tmp = path + ".tmp.XXXXXX";
  const int fd = ::mkstemp(tmp.data());
  if (fd < 0) return io_error(where + ": cannot create a temporary file: " + errno_text(errno));
  ::fchmod(fd, 0644);
  std::FILE* f = ::fdopen(fd, "wb");
  if (f == nullptr) {
    const int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    return io_error(where + ": cannot open the temporary file: " + errno_text(err));
  }
  Status st;
  try {
    const uint64_t n = header.size();
    st = write_all(f, &n, sizeof n, where);
    if (st.ok()) st = write_all(f, header.data(), header.size(), where);
    for (auto it = tensors.begin(); st.ok() && it != tensors.end(); ++it)
      st = write_tensor(f, it->second, where);
  } catch (const std::bad_alloc&) {
    st = resource_exhausted(where + ": out of memory copying a strided tensor");
  }
  if (std::fclose(f) != 0 && st.ok()) st = io_error(where + ": close failed: " + errno_text(errno));
  if (st.ok() && std::rename(tmp.c_str(), path.c_str()) != 0)
    st = io_error(where + ": cannot rename the temporary file into place: " + errno_text(errno));
  if (!st.ok()) ::unlink(tmp.c_str());
  return st;
}

}  // namespace attnkit
