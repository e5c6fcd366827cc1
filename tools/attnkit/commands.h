// One function per subcommand; each returns the process exit code. Each
// command translates: flags into an options struct, library calls that
// return result structs (figures and conclusions: attnkit/report.h,
// analysis.h), then short renderers for the table, JSON or CSV.
// scripts/check_function_length.py keeps every function in tools/attnkit/
// under 80 lines.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "attnkit/analysis.h"
#include "attnkit/latent_attention.h"
#include "attnkit/machine.h"

namespace attnkit::cli {

int run_analyze(int argc, char** argv);
int run_plan(int argc, char** argv);
int run_compare(int argc, char** argv);
int run_bench(int argc, char** argv);
int run_plot(int argc, char** argv);
int run_serve_bench(int argc, char** argv);

// --model NAME or --config PATH (exactly one) -> the model's shape.
// Throws UsageError with a one-line reason.
ModelShape load_model(const std::string& model, const std::string& config_path);

// The machine's figures: measured quickly unless both overrides are > 0.
MachineProfile machine_profile(double peak_gflops_override, double bandwidth_gbps_override);

// After the work `before` was measured for: measures the machine again the
// same way (threads, quick) and compares. The figures to judge the run by
// are the better of the two; figures given on the command line stay as
// given (both given: nothing is measured and the check agrees).
MachineCheck remeasure_machine(const MachineProfile& before, double peak_gflops_override,
                               double bandwidth_gbps_override, int threads, bool quick);

// The lines to print under a table about `check`: that the two
// measurements disagree, or that a probe did not settle. Empty when
// neither; each line is also a JSON "warnings" entry.
std::vector<std::string> machine_warnings(const MachineCheck& check);

// The JSON "machine" object of a measured run: the figures used (the best
// of the two measurements), whether they were stable and agreed, and both
// measurements.
nlohmann::json machine_json(const MachineCheck& check);

// A fraction of a roof for a table ("42%"), marked "42%*" when above
// `roof` (a measured rate cannot exceed its roof; one that does says the
// roof was measured low or, for bandwidth, that the data came from cache).
std::string roof_percent(double fraction, double roof = 1.0);

// The warning line under a table with `count` `what` ("row(s)") marked by
// roof_percent, saying what such a fraction means.
std::string above_roof_warning(int count, const std::string& what);

// "mha" / "gqa-4" / "mqa" / "mla" for a shape.
std::string variant_label(const ModelShape& m);

// MLA of matching size for a model without it, as compare and serve-bench
// build it: kv_lora_rank 4 x head_dim (DeepSeek's 512 = 4 x 128) and
// qk_rope_head_dim min(64, head_dim / 2), even and >= 2.
int64_t default_mla_rank(int64_t head_dim);
int64_t default_mla_rope_dim(int64_t head_dim);
// The MLA layer of a shape with MLA fields (as with_mla() makes them),
// with its q_lora_rank and, where index_topk > 0, its DSA indexer.
MlaConfig mla_layer_config(const ModelShape& mla_shape, double rope_theta = 10000.0);

}  // namespace attnkit::cli
