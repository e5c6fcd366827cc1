#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "cli.h"
#include "commands.h"
#include "measure.h"

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

MachineCheck remeasure_machine(const MachineProfile& before, double peak_gflops_override,
                               double bandwidth_gbps_override, int threads, bool quick) {
  if (peak_gflops_override > 0 && bandwidth_gbps_override > 0)
    return compare_machine_profiles(before, before);
  MachineProfile after = measure_machine(threads, quick);
  if (peak_gflops_override > 0) after.fp32_peak_gflops = peak_gflops_override;
  if (bandwidth_gbps_override > 0) after.dram_read_gbps = bandwidth_gbps_override;
  return compare_machine_profiles(before, after);
}

std::vector<std::string> machine_warnings(const MachineCheck& check) {
  std::vector<std::string> out;
  if (!check.agree)
    out.push_back("warning: the machine measured differently before and after the run (" +
                  check.disagreement +
                  "): it was busy during one of them; the fractions use the higher figures, and "
                  "a rerun on a quiet machine gives figures to trust");
  else if (!check.best.stable && check.best.simd != "given")
    out.push_back(
        "warning: the machine's peak or bandwidth probe did not settle (no two runs within 5%): "
        "the machine is busy; its figures and the fractions may be off");
  return out;
}

nlohmann::json machine_json(const MachineCheck& check) {
  auto figures = [](const MachineProfile& p) {
    return nlohmann::json{{"fp32_peak_gflops", p.fp32_peak_gflops},
                          {"bf16_dot_peak_gflops", p.bf16_dot_peak_gflops},
                          {"dram_read_gbps", p.dram_read_gbps},
                          {"stable", p.stable}};
  };
  const MachineProfile& m = check.best;
  return {{"simd", m.simd},
          {"threads", m.threads},
          {"fp32_peak_gflops", m.fp32_peak_gflops},
          {"dram_read_gbps", m.dram_read_gbps},
          {"bf16_dot_peak_gflops", m.bf16_dot_peak_gflops},
          {"stable", m.stable},
          {"agree", check.agree},
          {"before", figures(check.before)},
          {"after", figures(check.after)}};
}

std::string roof_percent(double fraction, double roof) {
  return format_percent(fraction) + (fraction > roof ? "*" : "");
}

std::string above_roof_warning(int count, const std::string& what) {
  return "warning: " + std::to_string(count) + " " + what +
         " above this machine's measured roof (marked *): % peak over the fp32 peak (for bf16 "
         "K/V the bf16 dot peak where higher) or % BW over the read bandwidth means the machine "
         "figure was measured low (busy machine) or, for % BW, that the data came from cache";
}

int64_t default_mla_rank(int64_t head_dim) { return 4 * head_dim; }

int64_t default_mla_rope_dim(int64_t head_dim) {
  return std::max<int64_t>(2, std::min<int64_t>(64, head_dim / 2) / 2 * 2);
}

MlaConfig mla_layer_config(const ModelShape& s, double rope_theta) {
  MlaConfig c;
  c.model_type = "attnkit";
  c.hidden_size = s.hidden_size;
  c.num_attention_heads = s.num_heads;
  c.q_lora_rank = s.q_lora_rank;
  c.kv_lora_rank = s.kv_lora_rank;
  c.qk_nope_head_dim = s.qk_nope_head_dim;
  c.qk_rope_head_dim = s.qk_rope_head_dim;
  c.v_head_dim = s.v_head_dim;
  c.rope_theta = rope_theta;
  if (s.index_topk > 0) {  // DeepSeek sparse attention
    c.index_n_heads = s.index_n_heads;
    c.index_head_dim = s.index_head_dim;
    c.index_topk = s.index_topk;
  }
  return c;
}

std::string variant_label(const ModelShape& m) {
  if (m.mla) return "mla";
  if (m.num_kv_heads == m.num_heads) return "mha";
  if (m.num_kv_heads == 1) return "mqa";
  return "gqa-" + std::to_string(m.num_kv_heads);
}

}  // namespace attnkit::cli
