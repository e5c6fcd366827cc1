// The attnkit tool's small command-line kit: flag parsing (CLI11 underneath)
// with help and examples, unit formatting, aligned tables. Bad flags end the
// process with exit code 2 and one line on stderr (see UsageError).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "attnkit/tensor.h"

namespace CLI {
class App;
}  // namespace CLI

namespace attnkit::cli {

// Thrown inside the tool only (never across the library's API) and turned
// into "attnkit <command>: <message>" and exit code 2 by main().
struct UsageError {
  std::string message;
};

// One command's flags. Every flag is "--name VALUE" or "--name=VALUE" (a
// bool flag takes no value); a flag given twice keeps its last value. The
// values are converted here, not by CLI11, so that every message names the
// flag, the value and the rule in the tool's own words.
class Flags {
 public:
  Flags(std::string command, std::string summary, std::vector<std::string> examples);
  ~Flags();

  void add_string(const std::string& name, std::string* dst, const std::string& help);
  void add_int(const std::string& name, int64_t* dst, const std::string& help,
               int64_t min_value = 0);
  void add_double(const std::string& name, double* dst, const std::string& help);
  // Byte sizes: "24GiB", "512MiB", "1.5GB", "4096", "2PiB".
  void add_bytes(const std::string& name, int64_t* dst, const std::string& help);
  // Comma-separated lists: "1,2,4".
  void add_int_list(const std::string& name, std::vector<int64_t>* dst, const std::string& help);
  void add_string_list(const std::string& name, std::vector<std::string>* dst,
                       const std::string& help);
  void add_bool(const std::string& name, bool* dst, const std::string& help);

  // Parses argv[first..argc). Returns false when --help was given (help has
  // been printed). Throws UsageError on anything it does not understand.
  bool parse(int argc, char** argv, int first);
  std::string help() const;
  // Whether the command line named flag `name` (after parse).
  bool given(const std::string& name) const;

 private:
  std::string command_;
  std::vector<std::string> examples_;
  std::unique_ptr<CLI::App> app_;
};

int64_t parse_bytes(const std::string& text);  // throws UsageError

// A KV storage type by its flag name: f32, bf16, int8, fp8_e4m3 (throws
// UsageError naming `flag` otherwise), and back.
DType kv_dtype_of(const std::string& name, const std::string& flag = "--kv-dtype");
const char* kv_dtype_label(DType kv);

// The tool's version (the CMake project's), for `attnkit --version`.
const char* version();

// v to three significant digits (two decimals below 10, one below 100,
// none from there), then `suffix` as given: format_sig3(41.94, " M") is
// "41.9 M". The format_* functions here and in measure.h build on it.
std::string format_sig3(double v, const char* suffix);
std::string format_bytes(double bytes);       // "1.00 GiB", "576 B"
std::string format_count(double n);           // "41.9 M", "2.36 k"
std::string format_flops(double flops);       // "3.52 TFLOP"
std::string format_rate(double flops_per_s);  // "212.4 GFLOP/s"
std::string format_seconds(double s);         // "12.3 ms", "450 us"

// A table printed with aligned columns; numbers are right-aligned.
class Table {
 public:
  // numbers_right: right-align cells that start with a digit (columns of
  // figures); off for key/value listings.
  explicit Table(std::vector<std::string> header, bool numbers_right = true);
  void add(std::vector<std::string> row);
  std::string str() const;

 private:
  std::vector<std::string> header_;
  bool numbers_right_;
  std::vector<std::vector<std::string>> rows_;
};

}  // namespace attnkit::cli
