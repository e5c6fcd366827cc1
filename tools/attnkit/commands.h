// One function per subcommand; each returns the process exit code.
#pragma once

#include <string>

#include "attnkit/analysis.h"
#include "attnkit/machine.h"

namespace attnkit::cli {

int run_analyze(int argc, char** argv);
int run_plan(int argc, char** argv);
int run_compare(int argc, char** argv);
int run_bench(int argc, char** argv);
int run_plot(int argc, char** argv);

// --model NAME or --config PATH (exactly one) -> the model's shape.
// Throws UsageError with a one-line reason.
ModelShape load_model(const std::string& model, const std::string& config_path);

// The machine's figures: measured quickly unless both overrides are > 0.
MachineProfile machine_profile(double peak_gflops_override, double bandwidth_gbps_override);

// "mha" / "gqa-4" / "mqa" / "mla" for a shape.
std::string variant_label(const ModelShape& m);

}  // namespace attnkit::cli
