// SafetensorsFile / save_safetensors. Malformed files are built byte by
// byte here; written files are checked by decoding them independently
// (length field, header JSON via nlohmann, raw data bytes), not only by
// reading them back with the code under test.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "attnkit/weights.h"

namespace attnkit {
namespace {

using json = nlohmann::json;

std::string temp_path(const std::string& stem) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return ::testing::TempDir() + "attnkit_" + info->name() + "_" + stem + "_" +
         std::to_string(::getpid()) + ".safetensors";
}

// 8-byte little-endian length, header, data — exactly as given.
std::string file_bytes(const std::string& header, const std::string& data = "") {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

Status parse_status(const std::string& bytes) {
  Result<SafetensorsFile> r = SafetensorsFile::parse(bytes.data(), bytes.size());
  return r.ok() ? Status::Ok() : r.status();
}

// The parse must fail with kInvalidArgument and a message containing every
// fragment (the source, the tensor, the field, the value).
void expect_rejected(const std::string& bytes, std::initializer_list<const char*> fragments) {
  const Status s = parse_status(bytes);
  ASSERT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_EQ(s.message().rfind("SafetensorsFile::parse: <buffer>: ", 0), 0u) << s.message();
  for (const char* f : fragments)
    EXPECT_NE(s.message().find(f), std::string::npos)
        << "missing '" << f << "' in: " << s.message();
}

// One well-formed F32 [2] tensor at data offsets [0, 8] plus `extra` header
// entries, to mutate one field at a time.
std::string one_tensor(const std::string& entry, const std::string& data = std::string(8, '\1')) {
  return file_bytes("{\"w\":" + entry + "}", data);
}

TEST(Safetensors, ParsesHandBuiltFileWithUnalignedData) {
  // Header of 77 bytes: the data section starts at file offset 85, so the
  // f32 tensor at data offset 2 sits at an odd address.
  std::string header = R"({"b":{"dtype":"BF16","shape":[1],"data_offsets":[0,2]},)"
                       R"("x":{"dtype":"F32","shape":[2],"data_offsets":[2,10]}})";
  std::string data(10, '\0');
  const uint16_t b = 0x3f80;  // 1.0
  const float x[2] = {-1.5f, 3.25f};
  std::memcpy(&data[0], &b, 2);
  std::memcpy(&data[2], x, 8);
  std::string bytes = file_bytes(header, data);
  ASSERT_NE((8 + header.size() + 2) % 4, 0u);  // the point of the test

  Result<SafetensorsFile> r = SafetensorsFile::parse(bytes.data(), bytes.size());
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const WeightMap& t = r->tensors();
  ASSERT_EQ(t.size(), 2u);
  const TensorView& xv = t.at("x");
  EXPECT_EQ(xv.dtype, DType::kF32);
  EXPECT_EQ(xv.rank, 1);
  EXPECT_EQ(xv.shape[0], 2);
  EXPECT_EQ(xv.strides[0], 1);
  EXPECT_EQ(static_cast<const char*>(xv.data), bytes.data() + 8 + header.size() + 2);
  float got[2];
  std::memcpy(got, xv.data, 8);
  EXPECT_EQ(got[0], -1.5f);
  EXPECT_EQ(got[1], 3.25f);
  EXPECT_EQ(t.at("b").dtype, DType::kBF16);
  EXPECT_TRUE(r->metadata().empty());
}

TEST(Safetensors, ScalarsEmptyTensorsGapsAndTrailingSpaces) {
  std::string header = R"({"s":{"dtype":"I64","shape":[],"data_offsets":[8,16]},)"
                       R"("e":{"dtype":"F16","shape":[0,3],"data_offsets":[16,16]},)"
                       R"("__metadata__":{"format":"pt"}}    )";
  std::string data(16, '\0');
  const int64_t v = -42;
  std::memcpy(&data[8], &v, 8);
  std::string bytes = file_bytes(header, data);
  Result<SafetensorsFile> r = SafetensorsFile::parse(bytes.data(), bytes.size());
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const TensorView& s = r->tensors().at("s");
  EXPECT_EQ(s.rank, 0);
  EXPECT_EQ(s.numel(), 1);
  int64_t got;
  std::memcpy(&got, s.data, 8);
  EXPECT_EQ(got, -42);
  EXPECT_EQ(r->tensors().at("e").numel(), 0);
  EXPECT_EQ(r->metadata().at("format"), "pt");
}

TEST(Safetensors, RejectsShortFilesAndBadHeaderLengths) {
  expect_rejected("", {"file is 0 bytes, shorter than the 8-byte header length"});
  expect_rejected(std::string(7, '\0'), {"file is 7 bytes"});
  std::string bytes = file_bytes("{}");
  bytes[0] = 3;  // claims 3 header bytes, 2 present
  expect_rejected(bytes, {"header length = 3 exceeds the 2 bytes after the length field"});
  bytes = std::string(8, '\xff') + "{}";
  expect_rejected(bytes, {"header length = 18446744073709551615 exceeds the 2 bytes"});
  expect_rejected(file_bytes(""), {"header must be a JSON object starting with '{'"});
  expect_rejected(file_bytes("[]"), {"must be a JSON object"});
}

TEST(Safetensors, RejectsHeaderOverTheSizeCap) {
  // A sparse 100 MB file whose header length claims all of it.
  const std::string path = temp_path("big");
  const uint64_t n = 100'000'001;
  {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::write(fd, &n, 8), 8);
    ASSERT_EQ(::write(fd, "{", 1), 1);
    ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(8 + n)), 0);
    ::close(fd);
  }
  Result<SafetensorsFile> r = SafetensorsFile::open(path);
  ::unlink(path.c_str());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("header length = 100000001 exceeds the limit of "
                                      "100000000 bytes"),
            std::string::npos)
      << r.status().message();
  EXPECT_NE(r.status().message().find(path), std::string::npos);
}

TEST(Safetensors, RejectsInvalidJson) {
  expect_rejected(file_bytes("{\"w\":"), {"header is not valid JSON"});
  expect_rejected(file_bytes("{} x"), {"header is not valid JSON"});
  expect_rejected(file_bytes("{\"\xff\":{}}"), {"header is not valid JSON"});  // not UTF-8
  expect_rejected(file_bytes(std::string("{\"a\":1}\0\0", 9)), {"header is not valid JSON"});
  // Deep nesting is refused before the parser sees it.
  expect_rejected(file_bytes("{\"w\":{\"shape\":[[1]]}}"), {"nests more than 3 levels"});
  expect_rejected(file_bytes("{\"w\":" + std::string(100000, '[') + "}"),
                  {"nests more than 3 levels"});
  // Brackets inside strings do not count.
  expect_rejected(file_bytes(R"({"[[[{{{":{"dtype":"Q","shape":[],"data_offsets":[0,0]}})"),
                  {"tensor '[[[{{{': dtype = \"Q\" is not a safetensors dtype"});
}

TEST(Safetensors, RejectsWrongEntryTypesAndFields) {
  expect_rejected(file_bytes(R"({"w":5})"),
                  {"tensor 'w': entry must be a JSON object, got number 5"});
  expect_rejected(one_tensor(R"({"dtype":"F32","shape":[2]})"),
                  {"tensor 'w': missing field 'data_offsets'"});
  expect_rejected(one_tensor(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1})"),
                  {"tensor 'w': unknown field 'x'"});
  expect_rejected(one_tensor(R"({"dtype":7,"shape":[2],"data_offsets":[0,8]})"),
                  {"tensor 'w': dtype = 7 must be a string"});
  expect_rejected(one_tensor(R"({"dtype":"F32","shape":{"a":2},"data_offsets":[0,8]})"),
                  {"tensor 'w': shape = {\"a\":2} must be an array"});
}

TEST(Safetensors, RejectsUnsupportedAndUnknownDtypes) {
  for (const char* d : {"U8", "I8", "F8_E4M3", "F8_E5M2", "U64"}) {
    expect_rejected(
        one_tensor(std::string(R"({"dtype":")") + d + R"(","shape":[8],"data_offsets":[0,8]})"),
        {"tensor 'w': dtype = \"", d, "\" is not supported"});
  }
  expect_rejected(one_tensor(R"({"dtype":"f32","shape":[2],"data_offsets":[0,8]})"),
                  {"tensor 'w': dtype = \"f32\" is not a safetensors dtype"});
}

TEST(Safetensors, RejectsBadShapes) {
  auto with_shape = [](const std::string& shape) {
    return one_tensor(R"({"dtype":"F32","shape":)" + shape + R"(,"data_offsets":[0,8]})");
  };
  expect_rejected(with_shape("[2,-1]"), {"tensor 'w': shape[1] = -1 must be >= 0"});
  expect_rejected(with_shape("[2.0]"),
                  {"tensor 'w': shape[0] = 2.0 must be a non-negative integer"});
  expect_rejected(with_shape("[\"2\"]"), {"shape[0] = \"2\" must be a non-negative integer"});
  expect_rejected(with_shape("[null]"), {"shape[0] = null must be"});
  expect_rejected(with_shape("[1,1,1,1,2]"), {"shape = [1,1,1,1,2] has rank 5; at most 4"});
  expect_rejected(with_shape("[18446744073709551615]"),
                  {"shape[0] = 18446744073709551615 does not fit in 64-bit signed"});
  // 2^32 * 2^32: the element count overflows; 2^62 f32: the byte count does.
  expect_rejected(with_shape("[4294967296,4294967296]"), {"element count overflows 64 bits"});
  expect_rejected(with_shape("[4611686018427387904]"), {"of F32: byte count overflows 64 bits"});
  // A wrong but representable count is a size mismatch.
  expect_rejected(with_shape("[3]"),
                  {"data_offsets = [0,8] span 8 bytes, but shape [3] of F32 needs 12"});
}

TEST(Safetensors, RejectsBadDataOffsets) {
  auto with_offsets = [](const std::string& o, const std::string& data = std::string(8, '\1')) {
    return one_tensor(R"({"dtype":"F32","shape":[2],"data_offsets":)" + o + "}", data);
  };
  expect_rejected(with_offsets("8"), {"tensor 'w': data_offsets = 8 must be [begin, end]"});
  expect_rejected(with_offsets("[0,8,8]"), {"data_offsets = [0,8,8] must be [begin, end]"});
  expect_rejected(with_offsets("[-8,0]"), {"data_offsets = [-8,0] must be [begin, end]"});
  expect_rejected(with_offsets("[0,8.0]"), {"data_offsets = [0,8.0] must be"});
  expect_rejected(with_offsets("[8,0]"), {"data_offsets = [8,0]: begin > end"});
  expect_rejected(with_offsets("[4,12]"),
                  {"data_offsets = [4,12]: end is beyond the data section (8 bytes)"});
  expect_rejected(with_offsets("[0,18446744073709551615]"), {"end is beyond the data section"});
  expect_rejected(with_offsets("[0,4]"), {"span 4 bytes, but shape [2] of F32 needs 8"});
}

TEST(Safetensors, RejectsOverlappingRanges) {
  std::string header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]},)"
                       R"("c":{"dtype":"I32","shape":[2],"data_offsets":[4,12]}})";
  expect_rejected(file_bytes(header, std::string(20, '\0')),
                  {"tensors 'a' (bytes [0, 8)) and 'c' (bytes [4, 12)) overlap"});
  // Touching ranges and empty tensors inside another's range are fine.
  header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},)"
           R"("z":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})";
  EXPECT_TRUE(parse_status(file_bytes(header, std::string(16, '\0'))).ok());
  // The same range twice.
  header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
           R"("b":{"dtype":"BF16","shape":[4],"data_offsets":[0,8]}})";
  expect_rejected(file_bytes(header, std::string(8, '\0')), {"'a'", "'b'", "overlap"});
}

TEST(Safetensors, RejectsDuplicateKeys) {
  const std::string e = R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  expect_rejected(file_bytes("{\"w\":" + e + ",\"w\":" + e + "}", std::string(8, '\0')),
                  {"header has the key 'w' twice"});
  // The same name spelled with an escape is the same name.
  expect_rejected(file_bytes("{\"w\":" + e + ",\"\\u0077\":" + e + "}", std::string(8, '\0')),
                  {"header has the key 'w' twice"});
  expect_rejected(one_tensor(R"({"dtype":"F32","dtype":"F16","shape":[2],"data_offsets":[0,8]})"),
                  {"header has the key 'dtype' twice"});
  expect_rejected(file_bytes(R"({"__metadata__":{"k":"a","k":"b"}})"),
                  {"header has the key 'k' twice"});
}

TEST(Safetensors, RejectsBadMetadata) {
  expect_rejected(file_bytes(R"({"__metadata__":["a"]})"),
                  {"__metadata__ = [\"a\"] must be an object of strings"});
  expect_rejected(file_bytes(R"({"__metadata__":{"format":1}})"),
                  {"__metadata__['format'] = 1 must be a string"});
}

TEST(Safetensors, LongUntrustedStringsAreClippedInMessages) {
  const std::string name(5000, 'n');
  const Status s = parse_status(file_bytes("{\"" + name + "\":3}"));
  ASSERT_FALSE(s.ok());
  EXPECT_LT(s.message().size(), 400u) << s.message();
  EXPECT_NE(s.message().find("(5000 bytes)"), std::string::npos) << s.message();
}

// Random byte flips, truncations and insertions of a valid file: every
// outcome is a clean error or a file whose views lie inside the buffer.
TEST(Safetensors, MutatedFilesFailCleanly) {
  const std::string header = R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},)"
                             R"("b":{"dtype":"BF16","shape":[3],"data_offsets":[16,22]},)"
                             R"("__metadata__":{"k":"v"}})";
  const std::string valid = file_bytes(header, std::string(22, '\x5a'));
  std::mt19937 rng(1234);
  int accepted = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    std::string m = valid;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const size_t pos = rng() % m.size();
      switch (rng() % 3) {
        case 0:
          m[pos] = static_cast<char>(rng());
          break;
        case 1:
          m.resize(pos);
          break;
        default:
          m.insert(pos, 1, "{}[]\",:0-9e"[rng() % 11]);
          break;
      }
      if (m.empty()) break;
    }
    Result<SafetensorsFile> r = SafetensorsFile::parse(m.data(), m.size());
    if (!r.ok()) {
      EXPECT_FALSE(r.status().message().empty());
      continue;
    }
    ++accepted;
    for (const auto& [name, v] : r->tensors()) {
      const char* p = static_cast<const char*>(v.data);
      const size_t bytes = static_cast<size_t>(v.numel()) * dtype_size(v.dtype);
      ASSERT_GE(p, m.data()) << name;
      ASSERT_LE(p + bytes, m.data() + m.size()) << name;
    }
  }
  EXPECT_GT(accepted, 0);  // some mutations hit only data bytes
}

TEST(Safetensors, OpenReportsIoErrors) {
  Result<SafetensorsFile> r = SafetensorsFile::open("/nonexistent/dir/model.safetensors");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kIoError);
  EXPECT_NE(r.status().message().find("'/nonexistent/dir/model.safetensors': cannot open"),
            std::string::npos)
      << r.status().message();
  r = SafetensorsFile::open(::testing::TempDir());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kIoError);
  EXPECT_NE(r.status().message().find("not a regular file"), std::string::npos);

  const std::string path = temp_path("short");
  write_file(path, "abc");
  r = SafetensorsFile::open(path);
  ::unlink(path.c_str());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("SafetensorsFile::open: '" + path + "': file is 3 bytes"),
            std::string::npos)
      << r.status().message();
}

template <typename T>
std::string bytes_of(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

// Checks a written file against the format by hand: the length field, the
// 8-byte padding with spaces, each entry's dtype/shape/offsets and the raw
// bytes at those offsets.
void expect_file_holds(const std::string& path, const std::string& name, const char* dtype,
                       const std::vector<int64_t>& shape, const std::string& payload) {
  const std::string f = read_file(path);
  ASSERT_GE(f.size(), 8u);
  uint64_t n;
  std::memcpy(&n, f.data(), 8);
  ASSERT_LE(n, f.size() - 8);
  EXPECT_EQ(n % 8, 0u);
  const std::string header = f.substr(8, n);
  const size_t last = header.find_last_not_of(' ');
  EXPECT_EQ(header[last], '}');
  const json h = json::parse(header);
  const json& e = h.at(name);
  EXPECT_EQ(e.at("dtype"), dtype);
  EXPECT_EQ(e.at("shape").get<std::vector<int64_t>>(), shape);
  const uint64_t b = e.at("data_offsets")[0], end = e.at("data_offsets")[1];
  ASSERT_EQ(end - b, payload.size());
  EXPECT_EQ(f.substr(8 + n + b, end - b), payload) << name;
}

TEST(Safetensors, RoundTripsEveryDtype) {
  std::mt19937 rng(42);
  std::vector<double> f64(6);
  std::vector<float> f32(24);
  std::vector<uint16_t> f16(5), b16(7);
  std::vector<int64_t> i64(3);
  std::vector<int32_t> i32(4);
  std::vector<uint8_t> bools = {0, 1, 1, 0};
  for (double& x : f64) x = std::uniform_real_distribution<double>(-1e10, 1e10)(rng);
  for (float& x : f32) x = std::uniform_real_distribution<float>(-3, 3)(rng);
  for (uint16_t& x : f16) x = static_cast<uint16_t>(rng());
  for (uint16_t& x : b16) x = static_cast<uint16_t>(rng());
  for (int64_t& x : i64) x = static_cast<int64_t>(rng()) << 20;
  for (int32_t& x : i32) x = static_cast<int32_t>(rng());
  const WeightMap in = {
      {"f64", make_view(f64.data(), DType::kF64, {2, 3})},
      {"f32", make_view(f32.data(), DType::kF32, {2, 3, 2, 2})},
      {"f16", make_view(f16.data(), DType::kF16, {5})},
      {"bf16", make_view(b16.data(), DType::kBF16, {7, 1})},
      {"i64", make_view(i64.data(), DType::kI64, {3})},
      {"i32", make_view(i32.data(), DType::kI32, {2, 2})},
      {"bool", make_view(bools.data(), DType::kBool, {4})},
  };
  const std::map<std::string, std::string, std::less<>> meta = {{"format", "pt"}, {"note", "ü"}};
  const std::string path = temp_path("all");
  ASSERT_TRUE(save_safetensors(path, in, meta).ok());

  expect_file_holds(path, "f64", "F64", {2, 3}, bytes_of(f64));
  expect_file_holds(path, "f32", "F32", {2, 3, 2, 2}, bytes_of(f32));
  expect_file_holds(path, "f16", "F16", {5}, bytes_of(f16));
  expect_file_holds(path, "bf16", "BF16", {7, 1}, bytes_of(b16));
  expect_file_holds(path, "i64", "I64", {3}, bytes_of(i64));
  expect_file_holds(path, "i32", "I32", {2, 2}, bytes_of(i32));
  expect_file_holds(path, "bool", "BOOL", {4}, bytes_of(bools));

  Result<SafetensorsFile> r = SafetensorsFile::open(path);
  ::unlink(path.c_str());
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  // Moving the file object keeps its views valid.
  SafetensorsFile file = std::move(r).value();
  SafetensorsFile moved = std::move(file);
  EXPECT_EQ(moved.metadata(), meta);
  ASSERT_EQ(moved.tensors().size(), in.size());
  for (const auto& [name, src] : in) {
    const TensorView& v = moved.tensors().at(name);
    EXPECT_EQ(v.dtype, src.dtype) << name;
    ASSERT_EQ(v.rank, src.rank) << name;
    for (int i = 0; i < v.rank; ++i) EXPECT_EQ(v.shape[i], src.shape[i]) << name;
    EXPECT_TRUE(v.is_contiguous()) << name;
    const size_t nbytes = static_cast<size_t>(src.numel()) * dtype_size(src.dtype);
    EXPECT_EQ(std::memcmp(v.data, src.data, nbytes), 0) << name;
  }
}

TEST(Safetensors, SavesStridedViewsAsContiguousCopies) {
  // A [3, 4] f32 buffer saved transposed ([4, 3], strides {1, 4}) and as a
  // column slice ([3, 2], strides {4, 1}, from column 1).
  std::vector<float> buf(12);
  for (int i = 0; i < 12; ++i) buf[i] = static_cast<float>(i) + 0.5f;
  TensorView t;
  t.data = buf.data();
  t.rank = 2;
  t.shape = {4, 3, 0, 0};
  t.strides = {1, 4, 0, 0};
  TensorView s = t;
  s.data = buf.data() + 1;
  s.shape = {3, 2, 0, 0};
  s.strides = {4, 1, 0, 0};
  const std::string path = temp_path("strided");
  ASSERT_TRUE(save_safetensors(path, {{"t", t}, {"s", s}}).ok());
  std::vector<float> want_t, want_s;
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 3; ++j) want_t.push_back(buf[j * 4 + i]);
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 2; ++j) want_s.push_back(buf[i * 4 + 1 + j]);
  expect_file_holds(path, "t", "F32", {4, 3}, bytes_of(want_t));
  expect_file_holds(path, "s", "F32", {3, 2}, bytes_of(want_s));
  ::unlink(path.c_str());
}

TEST(Safetensors, ManyTensorsRoundTrip) {
  // 160 tensors of a small transformer's names and mixed dtypes/shapes.
  std::mt19937 rng(5);
  std::vector<std::vector<uint8_t>> storage;
  WeightMap in;
  const char* kinds[] = {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                         "q_proj.bias"};
  const DType dtypes[] = {DType::kF32, DType::kBF16, DType::kF16, DType::kF64};
  for (int layer = 0; layer < 32; ++layer) {
    for (int k = 0; k < 5; ++k) {
      const DType d = dtypes[(layer + k) % 4];
      const int64_t rows = 1 + static_cast<int64_t>(rng() % 9),
                    cols = 1 + static_cast<int64_t>(rng() % 7);
      storage.emplace_back(static_cast<size_t>(rows * cols) * dtype_size(d));
      for (uint8_t& byte : storage.back()) byte = static_cast<uint8_t>(rng());
      const std::string name = "model.layers." + std::to_string(layer) + ".self_attn." + kinds[k];
      in[name] = k == 4 ? make_view(storage.back().data(), d, {rows * cols})
                        : make_view(storage.back().data(), d, {rows, cols});
    }
  }
  ASSERT_EQ(in.size(), 160u);
  const std::string path = temp_path("many");
  ASSERT_TRUE(save_safetensors(path, in).ok());
  const json h = json::parse(read_file(path).substr(8, [&] {
    uint64_t n;
    std::memcpy(&n, read_file(path).data(), 8);
    return n;
  }()));
  EXPECT_EQ(h.size(), 160u);  // no __metadata__ when there is none
  Result<SafetensorsFile> r = SafetensorsFile::open(path);
  ::unlink(path.c_str());
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  ASSERT_EQ(r->tensors().size(), 160u);
  for (const auto& [name, src] : in) {
    const TensorView& v = r->tensors().at(name);
    EXPECT_EQ(v.dtype, src.dtype) << name;
    EXPECT_EQ(v.describe(), src.describe()) << name;
    EXPECT_EQ(
        std::memcmp(v.data, src.data, static_cast<size_t>(src.numel()) * dtype_size(src.dtype)), 0)
        << name;
  }
}

TEST(Safetensors, SaveRejectsBadInputsAndWritesNothing) {
  float x[4] = {};
  const std::string path = temp_path("bad");
  Status s = save_safetensors(path, {{"__metadata__", make_view(x, DType::kF32, {4})}});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("reserved"), std::string::npos) << s.message();

  TensorView neg = make_view(x, DType::kF32, {2, 2});
  neg.strides[1] = -1;
  s = save_safetensors(path, {{"w", neg}});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("tensors['w'].strides[1] = -1 must be >= 0"), std::string::npos)
      << s.message();

  s = save_safetensors(path, {{"\xff", make_view(x, DType::kF32, {4})}});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("UTF-8"), std::string::npos) << s.message();

  struct stat st;
  EXPECT_NE(::stat(path.c_str(), &st), 0);  // nothing was written

  s = save_safetensors("/nonexistent/dir/x.safetensors", {{"w", make_view(x, DType::kF32, {4})}});
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_NE(s.message().find("'/nonexistent/dir/x.safetensors'"), std::string::npos);

  // An empty view without data is a valid empty tensor.
  TensorView empty;
  empty.rank = 1;
  empty.strides[0] = 1;
  ASSERT_TRUE(save_safetensors(path, {{"e", empty}}).ok());
  Result<SafetensorsFile> r = SafetensorsFile::open(path);
  ::unlink(path.c_str());
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->tensors().at("e").numel(), 0);
}

}  // namespace
}  // namespace attnkit
