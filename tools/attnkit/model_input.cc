#include <filesystem>
#include <fstream>
#include <sstream>

#include "cli.h"
#include "commands.h"

namespace attnkit::cli {

ModelShape load_model(const std::string& model, const std::string& config_path) {
  if (model.empty() == config_path.empty())
    throw UsageError{"give exactly one of --model NAME or --config PATH"};
  if (!model.empty()) {
    auto m = model_preset(model);
    if (!m.ok()) throw UsageError{m.status().message()};
    return *m;
  }
  std::error_code ec;
  if (std::filesystem::is_directory(config_path, ec))
    throw UsageError{"--config '" + config_path + "' is a directory; give the config.json file"};
  std::ifstream in(config_path, std::ios::binary);
  if (!in) throw UsageError{"cannot read config file '" + config_path + "'"};
  std::ostringstream text;
  text << in.rdbuf();
  auto m = model_shape_from_json(text.str());
  if (!m.ok()) throw UsageError{config_path + ": " + m.status().message()};
  if (m->name.empty()) m->name = config_path;
  m->source = config_path;
  return *m;
}

MachineProfile machine_profile(double peak_gflops_override, double bandwidth_gbps_override) {
  MachineProfile p;
  if (peak_gflops_override > 0 && bandwidth_gbps_override > 0) {
    p.simd = "given";
    p.fp32_peak_gflops = peak_gflops_override;
    p.dram_read_gbps = bandwidth_gbps_override;
    return p;
  }
  p = measure_machine(0, /*quick=*/true);
  if (peak_gflops_override > 0) p.fp32_peak_gflops = peak_gflops_override;
  if (bandwidth_gbps_override > 0) p.dram_read_gbps = bandwidth_gbps_override;
  return p;
}

std::string variant_label(const ModelShape& m) {
  if (m.mla) return "mla";
  if (m.num_kv_heads == m.num_heads) return "mha";
  if (m.num_kv_heads == 1) return "mqa";
  return "gqa-" + std::to_string(m.num_kv_heads);
}

}  // namespace attnkit::cli
