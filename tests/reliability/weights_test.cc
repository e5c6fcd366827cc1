// Weight files are untrusted and large: SafetensorsFile::open maps them
// read-only instead of copying them. The hostile-header cases live in
// tests/io/safetensors_test.cc and fuzz/safetensors_fuzz.cc; this checks the
// mapping itself on a 1 GiB file (sparse: it occupies no disk blocks).
#include "attnkit/weights.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

namespace {

// True when /proc/self/maps has a mapping of `path` that contains
// [addr, addr + bytes).
bool mapped_from(const std::string& path, const void* addr, uint64_t bytes) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  const uint64_t a = reinterpret_cast<uintptr_t>(addr);
  while (std::getline(maps, line)) {
    std::istringstream in(line);
    std::string range, perms, offset, dev, inode, file;
    in >> range >> perms >> offset >> dev >> inode >> file;
    if (file != path) continue;
    const uint64_t lo = std::stoull(range.substr(0, range.find('-')), nullptr, 16);
    const uint64_t hi = std::stoull(range.substr(range.find('-') + 1), nullptr, 16);
    if (lo <= a && a + bytes <= hi) return perms[1] == '-';  // and read-only
  }
  return false;
}

TEST(ReliabilityWeights, LargeFilesAreMappedReadOnlyNotCopied) {
  const uint64_t n = uint64_t{1} << 28;  // f32 elements: 1 GiB
  const std::string header = "{\"w\":{\"dtype\":\"F32\",\"shape\":[" + std::to_string(n) +
                             "],\"data_offsets\":[0," + std::to_string(4 * n) + "]}}";
  char tmpl[] = "/tmp/attnkit_reliability_XXXXXX";
  const int fd = mkstemp(tmpl);
  ASSERT_GE(fd, 0);
  const std::string path = tmpl;
  const uint64_t len = header.size();
  uint8_t prefix[8];
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<uint8_t>(len >> (8 * i));
  ASSERT_EQ(write(fd, prefix, 8), 8);
  ASSERT_EQ(write(fd, header.data(), header.size()), static_cast<ssize_t>(header.size()));
  ASSERT_EQ(ftruncate(fd, static_cast<off_t>(8 + header.size() + 4 * n)), 0);  // zeros, sparse
  close(fd);

  {
    auto file = attnkit::SafetensorsFile::open(path);
    ASSERT_TRUE(file.ok()) << file.status().to_string();
    const attnkit::TensorView& w = file->tensors().at("w");
    EXPECT_EQ(w.numel(), static_cast<int64_t>(n));
    EXPECT_TRUE(mapped_from(path, w.data, 4 * n)) << "the tensor's bytes are not the file mapping";
    float last;
    std::memcpy(&last, static_cast<const char*>(w.data) + 4 * (n - 1), 4);
    EXPECT_EQ(last, 0.0f);
  }
  std::remove(path.c_str());
}

}  // namespace
