// attnkit plot: PNG/SVG plots of a bench run — KV memory against context
// per variant, measured decode latency against context, and a roofline of
// this machine with the measured points — or of a serve-bench run:
// throughput and concurrency against the KV memory budget per variant. The drawing is the Python
// module's attnkit.plot (matplotlib, /usr/bin/python3); this command finds it, runs `attnkit bench
// --json` first when no --input is given, and lists the files written. Keeping the drawing in one
// place (Python) means the tool and `python -m attnkit.plot` can never draw different pictures.
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "cli.h"
#include "commands.h"
#include "measure.h"

namespace attnkit::cli {
namespace {

namespace fs = std::filesystem;

std::string quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

fs::path self_exe() {
  std::error_code ec;
  fs::path p = fs::read_symlink("/proc/self/exe", ec);
  return ec ? fs::path() : p;
}

// plot.py: $ATTNKIT_PLOT_SCRIPT, the build tree's copy beside this binary
// (<build>/python/attnkit/plot.py), the source tree, or share/attnkit/.
std::string find_plot_script() {
  std::vector<fs::path> candidates;
  if (const char* env = std::getenv("ATTNKIT_PLOT_SCRIPT")) candidates.emplace_back(env);
  const fs::path exe = self_exe();
  if (!exe.empty()) candidates.push_back(exe.parent_path() / "python" / "attnkit" / "plot.py");
  candidates.push_back(fs::path(__FILE__).parent_path() / ".." / ".." / "python" / "attnkit" /
                       "plot.py");
  if (!exe.empty())
    candidates.push_back(exe.parent_path() / ".." / "share" / "attnkit" / "plot.py");
  std::error_code ec;
  for (const fs::path& p : candidates)
    if (fs::is_regular_file(p, ec)) return p.lexically_normal().string();
  return "";
}

// Runs `cmd` and returns its stdout and exit status.
std::pair<std::string, int> capture(const std::string& cmd) {
  std::string text;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return {"", -1};
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) text.append(buf, n);
  const int st = pclose(p);
  return {text, WIFEXITED(st) ? WEXITSTATUS(st) : -1};
}

struct Options {
  std::string input, out_dir = ".";
  std::vector<std::string> formats = {"png"};
  int64_t layers = 1;
  bool json = false;
};

// The flags, described; false when --help was given.
bool parse_options(int argc, char** argv, Options* po) {
  Options& o = *po;
  Flags f(
      "plot",
      "Draws three plots from an `attnkit bench --json` result: KV-cache memory against context\n"
      "per variant (from the bench's shapes), measured decode latency against context (batch 1,\n"
      "with the PyTorch baseline dashed where it was measured), and a roofline of this machine\n"
      "(measured fp32 peak and read bandwidth) with every measured point. Without --input it\n"
      "runs `attnkit bench --json --batches 1` first (about a minute) and keeps its result as\n"
      "bench.json in --out. From an `attnkit serve-bench --json` result it draws two: output\n"
      "tokens/s and sequences per step against the KV memory budget, per variant.\n"
      "Drawing is done by the Python module attnkit.plot (matplotlib,\n"
      "/usr/bin/python3); `python3 -m attnkit.plot --help` is the same thing without this tool.",
      {"attnkit plot --out plots",
       "attnkit bench --json > bench.json && attnkit plot --input bench.json --format png,svg",
       "attnkit plot --input bench.json --layers 32 --out docs/img   # a 32-layer model's cache",
       "attnkit serve-bench --memory 16MiB,32MiB,64MiB --json > serve.json && attnkit plot --input "
       "serve.json"});
  f.add_string("--input", &o.input,
               "a saved `attnkit bench --json` or `serve-bench --json` result");
  f.add_string("--out", &o.out_dir, "directory for the files (default .; created)");
  f.add_string_list("--format", &o.formats, "png, svg or both (default png)");
  f.add_int("--layers", &o.layers, "layers for the KV-memory plot (default 1)", 1);
  f.add_bool("--json", &o.json, "print the files written as JSON");
  return f.parse(argc, argv, 2);
}

// The formats, the input and the output directory, checked before anything
// runs: where the files go is the user's choice, so a place that cannot
// take them is a usage error (exit 2).
void check_options(const Options& o) {
  for (const std::string& fmt : o.formats)
    if (fmt != "png" && fmt != "svg")
      throw UsageError{"--format entries must be png or svg, got '" + fmt + "'"};
  std::error_code ec;
  if (!o.input.empty() && !fs::is_regular_file(o.input, ec))
    throw UsageError{"cannot read --input '" + o.input + "'"};
  if (!o.input.empty()) {
    std::ifstream in(o.input);
    const auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    const bool serve = j.is_object() && j.contains("kind") && j["kind"] == "serve-bench";
    if (j.is_discarded() || !j.is_object() || !j.contains("rows") ||
        !(serve || j.contains("machine")))
      throw UsageError{"--input '" + o.input +
                       "' is not an `attnkit bench --json` or `serve-bench --json` result"};
  }
  fs::create_directories(o.out_dir, ec);
  if (ec) throw UsageError{"cannot create --out '" + o.out_dir + "': " + ec.message()};
  if (!fs::is_directory(o.out_dir, ec))
    throw UsageError{"--out '" + o.out_dir + "' is not a directory"};
  if (access(o.out_dir.c_str(), W_OK | X_OK) != 0)
    throw UsageError{"cannot write into --out '" + o.out_dir + "'"};
}

// Without --input: runs `attnkit bench --json --batches 1` and keeps its
// result as bench.json in the output directory; returns that path.
std::string run_bench_for_input(const std::string& out_dir) {
  const std::string input = (fs::path(out_dir) / "bench.json").string();
  const fs::path exe = self_exe();
  if (exe.empty()) throw RunError{"cannot find this program to run `attnkit bench`"};
  std::fprintf(stderr,
               "attnkit plot: running `attnkit bench --json --batches 1` (save it and use --input "
               "to skip this)\n");
  auto [text, rc] = capture(quote(exe.string()) + " bench --json --batches 1");
  if (rc != 0) throw RunError{"`attnkit bench` failed (exit " + std::to_string(rc) + ")"};
  std::ofstream(input) << text;
  return input;
}

void print_files(const nlohmann::json& j, const std::string& input) {
  std::error_code ec;
  Table t({"plot", "file", "size"}, /*numbers_right=*/false);
  for (const auto& fl : j["files"])
    t.add({fl["plot"].get<std::string>(), fl["path"].get<std::string>(),
           format_bytes(static_cast<double>(fs::file_size(fl["path"].get<std::string>(), ec)))});
  std::fputs(t.str().c_str(), stdout);
  std::printf("\nfrom %s\n", input.c_str());
  for (const auto& w : j.value("warnings", nlohmann::json::array()))
    std::printf("warning: %s\n", w.get<std::string>().c_str());
}

}  // namespace

int run_plot(int argc, char** argv) {
  Options o;
  if (!parse_options(argc, argv, &o)) return 0;
  check_options(o);
  std::string input = o.input;
  const char* py_env = std::getenv("ATTNKIT_PYTHON");
  const std::string py = py_env ? py_env : "/usr/bin/python3";
  try {
    if (access(py.c_str(), X_OK) != 0)
      throw RunError{py + " not found (plots need Debian's python3-matplotlib)"};
    const std::string script = find_plot_script();
    if (script.empty())
      throw RunError{"python/attnkit/plot.py not found (set ATTNKIT_PLOT_SCRIPT)"};
    if (input.empty()) input = run_bench_for_input(o.out_dir);
    std::string fmt_list;
    for (const std::string& fm : o.formats) fmt_list += (fmt_list.empty() ? "" : ",") + fm;
    auto [text, rc] = capture(quote(py) + " " + quote(script) + " --input " + quote(input) +
                              " --out " + quote(o.out_dir) + " --format " + fmt_list +
                              " --layers " + std::to_string(o.layers) + " --json");
    const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (rc != 0 || j.is_discarded() || !j.contains("files"))
      throw RunError{"plot.py failed (exit " + std::to_string(rc) + "); run " + py + " " + script +
                     " --input " + input + " to see why"};
    if (o.json) {
      std::printf("%s\n", j.dump(2).c_str());
      return 0;
    }
    print_files(j, input);
    return 0;
  } catch (const RunError& e) {
    std::fprintf(stderr, "attnkit plot: %s\n", e.message.c_str());
    return 1;
  }
}

}  // namespace attnkit::cli
