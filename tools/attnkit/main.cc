// attnkit: compare, analyze, plan and bench attention variants.
#include <cstdio>
#include <cstring>
#include <string>

#include "cli.h"
#include "commands.h"

namespace {

struct Command {
  const char* name;
  int (*run)(int, char**);
  const char* summary;
};

int run_presets(int argc, char** argv) {
  attnkit::cli::Flags f("presets", "List the built-in model presets.", {"attnkit presets"});
  if (!f.parse(argc, argv, 2)) return 0;
  int rc = 0;
  for (const std::string& n : attnkit::preset_names()) {
    auto m = attnkit::model_preset(n);
    if (!m.ok()) {  // listed, and the exit code says one could not be read
      std::fprintf(stderr, "attnkit presets: %s: %s\n", n.c_str(), m.status().message().c_str());
      rc = 1;
      continue;
    }
    std::printf("%-18s %-12s %s\n", n.c_str(), attnkit::cli::variant_label(*m).c_str(),
                m->source.c_str());
  }
  return rc;
}

const Command kCommands[] = {
    {"compare", attnkit::cli::run_compare,
     "build MHA/GQA/MQA/MLA layers, measure them here, print one table"},
    {"analyze", attnkit::cli::run_analyze,
     "exact parameters, KV bytes, FLOPs and what-if sweeps for a model"},
    {"plan", attnkit::cli::run_plan, "largest batch or context per variant for a memory budget"},
    {"bench", attnkit::cli::run_bench,
     "sdpa kernel sweeps: variants x context x batch x KV dtype, vs reference and torch"},
    {"plot", attnkit::cli::run_plot,
     "PNG/SVG plots: KV memory, decode latency vs context, roofline"},
    {"serve-bench", attnkit::cli::run_serve_bench,
     "continuous batching over a paged KV pool: tokens/s, TTFT, TPOT, concurrency per variant"},
    {"presets", run_presets, "list the built-in model presets"},
};

void usage(FILE* out) {
  std::fprintf(out, "usage: attnkit <command> [flags]\n\ncommands:\n");
  for (const Command& c : kCommands) std::fprintf(out, "  %-12s %s\n", c.name, c.summary);
  std::fprintf(out,
               "\n'attnkit <command> --help' shows a command's flags and examples;\n"
               "'attnkit --version' prints the version.\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0 ||
      std::strcmp(argv[1], "help") == 0) {
    usage(stdout);
    return argc < 2 ? 2 : 0;
  }
  if (std::strcmp(argv[1], "--version") == 0) {
    std::printf("attnkit %s\n", attnkit::cli::version());
    return 0;
  }
  for (const Command& c : kCommands) {
    if (std::strcmp(argv[1], c.name) != 0) continue;
    try {
      return c.run(argc, argv);
    } catch (const attnkit::cli::UsageError& e) {
      std::fprintf(stderr, "attnkit %s: %s\n", c.name, e.message.c_str());
      return 2;
    }
  }
  std::fprintf(stderr, "attnkit: unknown command '%s' (try attnkit --help)\n", argv[1]);
  return 2;
}
