// MoeLayer: router, top-k selection, expert dispatch by counting sort, and
// the SwiGLU experts through kernels::linear.
//
// forward() runs in two phases over token shards (see shard_count):
//   1. route: router logits for the shard's tokens (one linear), then per
//      token the scores, the group limit and the top-k, into the routing
//      arrays. Any non-finite logit fails the call here, before anything is
//      written.
//   2. experts: per shard, a counting sort groups the shard's (token, slot)
//      pairs by expert (tokens ascending within an expert); every expert
//      with tokens gathers them into a contiguous block and runs gate, up
//      and down as three linear calls over exactly those rows, adding
//      weight * output into the token's fp32 accumulator. Experts run in id
//      order, so each token's sum is in expert id order whatever the shard
//      boundaries; the shared experts run over all shard rows; then the
//      shard's rows of out are written.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <system_error>
#include <thread>

#include "attnkit/moe.h"
#include "core/check.h"
#include "core/checked_math.h"
#include "io/weight_loader.h"
#include "kernels/linear.h"
#include "ops/attention_checks.h"

namespace attnkit {
namespace {

constexpr const char* kFwd = "MoeLayer::forward";
constexpr const char* kLoad = "MoeLayer::load_weights";
// Fewer tokens than this per shard are not worth a thread.
constexpr int64_t kMinTokensPerShard = 8;
// Shards where they must follow the shape alone (see shard_count): a few,
// as each shard reads every expert it routes to.
constexpr int64_t kShapeShards = 4;

bool has_score_bias(const MoeConfig& c) { return c.topk_method == MoeTopkMethod::kNoauxTc; }

// Positions in MoeLayer::tensors_ (the order of weight_specs()).
constexpr size_t kGateIndex = 0;
constexpr size_t kScoreBiasIndex = 1;
size_t expert_index(const MoeConfig& c, int64_t e) {
  return (has_score_bias(c) ? 2 : 1) + 3 * static_cast<size_t>(e);
}
size_t shared_index(const MoeConfig& c) { return expert_index(c, c.n_routed_experts); }

const char* block_name(const MoeConfig& c) {
  return c.naming == MoeWeightNaming::kMixtral  ? "block_sparse_moe"
         : c.naming == MoeWeightNaming::kLlama4 ? "feed_forward"
                                                : "mlp";
}

bool gpt_oss(const MoeConfig& c) { return c.naming == MoeWeightNaming::kGptOss; }
bool llama4(const MoeConfig& c) { return c.naming == MoeWeightNaming::kLlama4; }
// Namings whose experts come as two fused [E, ...] tensors, repacked at load.
bool fused(const MoeConfig& c) { return gpt_oss(c) || llama4(c); }

// The fields the layer itself checks beyond validate(): which namings
// carry biases, and what each naming's checkpoints can hold.
Status check_layer_fields(const MoeConfig& c) {
  const std::string f = "MoeLayer::create: ";
  if (!gpt_oss(c) && (c.router_bias || c.expert_bias))
    return invalid_argument(f + "router_bias / expert_bias = " + std::to_string(c.router_bias) +
                            " / " + std::to_string(c.expert_bias) +
                            " need gpt-oss weight names (MoeWeightNaming::kGptOss); the other "
                            "namings have no biases");
  if (gpt_oss(c) && c.n_shared_experts != 0)
    return invalid_argument(f + "n_shared_experts = " + std::to_string(c.n_shared_experts) +
                            " must be 0 with gpt-oss weight names (they have no shared experts)");
  if (c.activation == MoeActivation::kGptOssSwiGlu &&
      (!std::isfinite(c.swiglu_limit) || !(c.swiglu_limit > 0.0)))
    return invalid_argument(f + "swiglu_limit = " + std::to_string(c.swiglu_limit) +
                            " must be finite and > 0 for the gpt-oss activation");
  return Status::Ok();
}

// Fused expert weights (gpt-oss, Llama 4), repacked per expert into the
// layout the other namings load (nn.Linear, [out, in]): from gate_up_proj
// [E, H, 2I] (x @ W) the gate [I, H] and up [I, H] of expert e, taken from
// the even and odd columns (gpt-oss, `interleaved`) or from the first and
// second halves (Llama4TextExperts' chunk(2)); from down_proj [E, I, H]
// (x @ W) the down [H, I]. Element bytes are copied as they are (f32 or bf16).
Status repack_fused(const Tensor& gate_up, const Tensor& down, int64_t E, int64_t H, int64_t I,
                    bool interleaved, std::vector<Tensor>* experts) {
  const size_t es = dtype_size(gate_up.dtype());
  const char* gu = static_cast<const char*>(gate_up.data());
  const char* dn = static_cast<const char*>(down.data());
  for (int64_t e = 0; e < E; ++e) {
    ATTNKIT_ASSIGN_OR_RETURN(Tensor g, Tensor::zeros(gate_up.dtype(), {I, H}));
    ATTNKIT_ASSIGN_OR_RETURN(Tensor u, Tensor::zeros(gate_up.dtype(), {I, H}));
    ATTNKIT_ASSIGN_OR_RETURN(Tensor d, Tensor::zeros(down.dtype(), {H, I}));
    char* gd = static_cast<char*>(g.data());
    char* ud = static_cast<char*>(u.data());
    char* dd = static_cast<char*>(d.data());
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < I; ++i) {
        const char* row = gu + ((e * H + h) * 2 * I) * static_cast<int64_t>(es);
        const int64_t gc = interleaved ? 2 * i : i, uc = interleaved ? 2 * i + 1 : I + i;
        std::memcpy(gd + (i * H + h) * static_cast<int64_t>(es), row + gc * es, es);
        std::memcpy(ud + (i * H + h) * static_cast<int64_t>(es), row + uc * es, es);
        std::memcpy(dd + (h * I + i) * static_cast<int64_t>(es),
                    dn + ((e * I + i) * H + h) * static_cast<int64_t>(es), es);
      }
    experts->push_back(std::move(g));
    experts->push_back(std::move(u));
    experts->push_back(std::move(d));
  }
  return Status::Ok();
}

int resolve_threads(int requested) {
  if (requested > 0) return requested;
  if (const char* env = std::getenv("ATTNKIT_NUM_THREADS")) {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && n > 0) return static_cast<int>(std::min(n, 1024L));
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw > 0 ? static_cast<int>(hw) : 1;
}

// Token shards of a T-token call. A shard's tokens share each expert's
// projections, so its boundaries decide which rows meet in a linear call.
// Where a row's result does not depend on the other rows of its call
// (kernels::linear_rows_independent: oneDNN's brgemm, or the reference),
// any boundaries give the same bits, and there is one shard per thread.
// Elsewhere (oneDNN's jit sgemm on AVX2) they would change the last bits
// with the thread count, so they follow the shape alone: kShapeShards.
// `weights` are the layer's, whose dtypes decide which GEMM runs.
int64_t shard_count(int64_t T, int threads, Backend backend, const std::vector<Tensor>& weights) {
  bool independent = true;
  for (const Tensor& w : weights)
    independent = independent && kernels::linear_rows_independent(backend, w.dtype());
  const int64_t wanted = independent ? threads : kShapeShards;
  return std::max<int64_t>(1, std::min<int64_t>(wanted, T / kMinTokensPerShard));
}

// Runs fn(0) .. fn(n - 1) on up to `workers` threads, worker w taking
// shards w, w + workers, ...; worker 0 is the calling thread. If a thread
// cannot be started its shards run here instead, so the work always
// completes.
template <typename Fn>
void run_shards(int64_t n, int64_t workers, const Fn& fn) {
  workers = std::clamp<int64_t>(workers, 1, n);
  auto work = [&fn, n, workers](int64_t w) {
    for (int64_t s = w; s < n; s += workers) fn(s);
  };
  std::vector<std::thread> threads;
  try {
    threads.reserve(static_cast<size_t>(workers));
  } catch (const std::bad_alloc&) {
    for (int64_t s = 0; s < n; ++s) fn(s);
    return;
  }
  for (int64_t w = 1; w < workers; ++w) {
    try {
      threads.emplace_back([&work, w] { work(w); });
    } catch (const std::system_error&) {
      work(w);
    }
  }
  work(0);
  for (auto& t : threads) t.join();
}

// The expert's activation, in place in g; g and u [rows, n], contiguous.
//   kSwiGlu:       silu(g) * u
//   kGptOssSwiGlu: g' = min(g, limit), u' = clamp(u, -limit, limit),
//                  (u' + 1) * g' * sigmoid(1.702 g')   (gpt-oss's alpha)
void activate(const MoeConfig& c, float* g, const float* u, int64_t count) {
  if (c.activation == MoeActivation::kSwiGlu) {
    for (int64_t i = 0; i < count; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    return;
  }
  const float limit = static_cast<float>(c.swiglu_limit);
  for (int64_t i = 0; i < count; ++i) {
    const float gi = std::min(g[i], limit), ui = std::clamp(u[i], -limit, limit);
    g[i] = (ui + 1.0f) * (gi / (1.0f + std::exp(-1.702f * gi)));
  }
}

// Routing scratch for one shard, sized by the config.
struct RouteScratch {
  std::vector<double> score, choice, group_score;
  std::vector<int32_t> candidates, groups;
};

// `a` ranks before `b`: larger value, then lower index.
struct Ranks {
  const double* v;
  bool operator()(int32_t a, int32_t b) const { return v[a] > v[b] || (v[a] == v[b] && a < b); }
};

// Routes one token. logits [E]; bias [E] or null. Writes k ids (best
// first) and their final weights. Returns false if a logit is not finite.
bool route_token(const MoeConfig& c, const float* logits, const float* bias, RouteScratch& s,
                 int32_t* ids, float* weights) {
  const int64_t E = c.n_routed_experts, k = c.num_experts_per_tok;
  for (int64_t e = 0; e < E; ++e)
    if (!std::isfinite(logits[e])) return false;
  double* score = s.score.data();
  if (c.scoring_func == MoeScoringFunc::kSoftmax) {
    double m = logits[0];
    for (int64_t e = 1; e < E; ++e) m = std::max(m, static_cast<double>(logits[e]));
    double sum = 0.0;
    for (int64_t e = 0; e < E; ++e) {
      score[e] = std::exp(logits[e] - m);
      sum += score[e];
    }
    for (int64_t e = 0; e < E; ++e) score[e] /= sum;
  } else {
    for (int64_t e = 0; e < E; ++e)
      score[e] = 1.0 / (1.0 + std::exp(-static_cast<double>(logits[e])));
  }
  double* choice = s.choice.data();
  for (int64_t e = 0; e < E; ++e)
    choice[e] = score[e] + (bias ? static_cast<double>(bias[e]) : 0.0);

  s.candidates.clear();
  const bool grouped = c.topk_method != MoeTopkMethod::kGreedy && c.topk_group < c.n_group;
  if (!grouped) {
    for (int64_t e = 0; e < E; ++e) s.candidates.push_back(static_cast<int32_t>(e));
  } else {
    const int64_t G = c.n_group, per = E / G;
    for (int64_t g = 0; g < G; ++g) {
      const double* v = choice + g * per;
      double best = v[0], second = -HUGE_VAL;
      for (int64_t i = 1; i < per; ++i) {
        if (v[i] > best) {
          second = best;
          best = v[i];
        } else if (v[i] > second) {
          second = v[i];
        }
      }
      s.group_score[g] = c.topk_method == MoeTopkMethod::kNoauxTc ? best + second : best;
      s.groups[g] = static_cast<int32_t>(g);
    }
    std::partial_sort(s.groups.begin(), s.groups.begin() + c.topk_group, s.groups.begin() + G,
                      Ranks{s.group_score.data()});
    // Candidates in id order, so ties among experts still go to the lower id.
    std::sort(s.groups.begin(), s.groups.begin() + c.topk_group);
    for (int64_t gi = 0; gi < c.topk_group; ++gi)
      for (int64_t i = 0; i < per; ++i)
        s.candidates.push_back(static_cast<int32_t>(s.groups[gi] * per + i));
  }
  std::partial_sort(s.candidates.begin(), s.candidates.begin() + k, s.candidates.end(),
                    Ranks{choice});

  double sum = 0.0;
  for (int64_t i = 0; i < k; ++i) sum += score[s.candidates[i]];
  const double denom = c.norm_topk_prob ? sum + 1e-20 : 1.0;
  for (int64_t i = 0; i < k; ++i) {
    ids[i] = s.candidates[i];
    weights[i] = static_cast<float>(score[s.candidates[i]] / denom * c.routed_scaling_factor);
  }
  return true;
}

}  // namespace

Result<MoeLayer> MoeLayer::create(const MoeConfig& config) {
  ATTNKIT_RETURN_IF_ERROR(validate(config));
  ATTNKIT_RETURN_IF_ERROR(check_layer_fields(config));
  MoeLayer layer;
  layer.config_ = config;
  return layer;
}

std::vector<MoeLayer::WeightSpec> MoeLayer::weight_specs() const {
  const MoeConfig& c = config_;
  const int64_t E = c.n_routed_experts, H = c.hidden_size, I = c.moe_intermediate_size;
  const bool mix = c.naming == MoeWeightNaming::kMixtral;
  std::vector<WeightSpec> specs;
  if (gpt_oss(c)) {
    specs.push_back({"router.weight", E, H, "n_routed_experts, hidden_size"});
    if (c.router_bias) specs.push_back({"router.bias", E, 0, "n_routed_experts"});
    specs.push_back(
        {"experts.gate_up_proj", E, H, "n_routed_experts, hidden_size, 2*intermediate", 2 * I});
    if (c.expert_bias)
      specs.push_back({"experts.gate_up_proj_bias", E, 2 * I, "n_routed_experts, 2*intermediate"});
    specs.push_back({"experts.down_proj", E, I, "n_routed_experts, intermediate, hidden_size", H});
    if (c.expert_bias)
      specs.push_back({"experts.down_proj_bias", E, H, "n_routed_experts, hidden_size"});
    return specs;
  }
  if (llama4(c)) {
    specs.push_back({"router.weight", E, H, "n_routed_experts, hidden_size"});
    specs.push_back(
        {"experts.gate_up_proj", E, H, "n_routed_experts, hidden_size, 2*intermediate", 2 * I});
    specs.push_back({"experts.down_proj", E, I, "n_routed_experts, intermediate, hidden_size", H});
    if (c.n_shared_experts > 0) {
      const int64_t S = I * c.n_shared_experts;
      const char* in = "intermediate_size*n_shared_experts, hidden_size";
      specs.push_back({"shared_expert.gate_proj.weight", S, H, in});
      specs.push_back({"shared_expert.up_proj.weight", S, H, in});
      specs.push_back({"shared_expert.down_proj.weight", H, S,
                       "hidden_size, intermediate_size*n_shared_experts"});
    }
    return specs;
  }
  specs.push_back({"gate.weight", E, H, "n_routed_experts, hidden_size"});
  if (has_score_bias(c))
    specs.push_back({"gate.e_score_correction_bias", E, 0, "n_routed_experts"});
  const char* gate = mix ? "w1" : "gate_proj";
  const char* up = mix ? "w3" : "up_proj";
  const char* down = mix ? "w2" : "down_proj";
  for (int64_t e = 0; e < E; ++e) {
    const std::string base = "experts." + std::to_string(e) + ".";
    specs.push_back({base + gate + ".weight", I, H, "moe_intermediate_size, hidden_size"});
    specs.push_back({base + up + ".weight", I, H, "moe_intermediate_size, hidden_size"});
    specs.push_back({base + down + ".weight", H, I, "hidden_size, moe_intermediate_size"});
  }
  if (c.n_shared_experts > 0) {
    const int64_t S = I * c.n_shared_experts;
    const char* in = "moe_intermediate_size*n_shared_experts, hidden_size";
    // Qwen2-MoE / Qwen3-Next name their one gated shared expert singular.
    const std::string shared = c.shared_expert_gate ? "shared_expert." : "shared_experts.";
    specs.push_back({shared + "gate_proj.weight", S, H, in});
    specs.push_back({shared + "up_proj.weight", S, H, in});
    specs.push_back(
        {shared + "down_proj.weight", H, S, "hidden_size, moe_intermediate_size*n_shared_experts"});
    if (c.shared_expert_gate)
      specs.push_back({"shared_expert_gate.weight", 1, H, "1, hidden_size"});
  }
  return specs;
}

std::vector<std::string> MoeLayer::weight_names() const {
  std::vector<std::string> names;
  for (const WeightSpec& s : weight_specs())
    names.push_back(std::string(block_name(config_)) + "." + s.name);
  return names;
}

Status MoeLayer::load_weights(const WeightMap& weights, std::string_view prefix) {
  const std::string block = io::weight_name(prefix, block_name(config_));
  io::WeightLoader loader(weights, block, kLoad);
  const std::vector<WeightSpec> specs = weight_specs();
  std::vector<Tensor> staged(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    const WeightSpec& s = specs[i];
    if (s.cols == 0)
      ATTNKIT_RETURN_IF_ERROR(loader.load(s.name, {s.rows}, s.meaning, &staged[i]));
    else if (s.depth > 0)
      ATTNKIT_RETURN_IF_ERROR(
          loader.load_matrix(s.name, {s.rows, s.cols, s.depth}, s.meaning, &staged[i]));
    else if (s.name.ends_with("_bias"))  // gpt-oss's expert biases stay f32
      ATTNKIT_RETURN_IF_ERROR(loader.load(s.name, {s.rows, s.cols}, s.meaning, &staged[i]));
    else
      ATTNKIT_RETURN_IF_ERROR(loader.load_matrix(s.name, {s.rows, s.cols}, s.meaning, &staged[i]));
  }
  ATTNKIT_RETURN_IF_ERROR(loader.finish());
  if (!fused(config_)) {
    tensors_ = std::move(staged);
    return Status::Ok();
  }
  // gpt-oss: router (and its bias), then the repacked experts in the
  // other namings' order, then the expert biases [E, 2I] and [E, H].
  // Llama 4: router, the repacked experts, then the shared expert as loaded.
  const MoeConfig& c = config_;
  const int64_t E = c.n_routed_experts, H = c.hidden_size, I = c.moe_intermediate_size;
  size_t next = 0;
  std::vector<Tensor> repacked;
  Tensor router = std::move(staged[next++]), router_bias, gate_up_bias, down_bias;
  if (c.router_bias) router_bias = std::move(staged[next++]);
  const Tensor& gate_up = staged[next++];
  if (c.expert_bias) gate_up_bias = std::move(staged[next++]);
  const Tensor& down = staged[next++];
  if (c.expert_bias) down_bias = std::move(staged[next++]);
  if (gate_up.dtype() != down.dtype())
    return invalid_argument(
        std::string(kLoad) + ": " + io::weight_name(block, "experts.gate_up_proj") + " is " +
        dtype_name(gate_up.dtype()) + " but " + io::weight_name(block, "experts.down_proj") +
        " is " + dtype_name(down.dtype()) + "; the experts must share one dtype");
  try {
    repacked.reserve(static_cast<size_t>(1 + 3 * E) + staged.size());
  } catch (const std::bad_alloc&) {
    return resource_exhausted(std::string(kLoad) + ": cannot allocate the repacked experts");
  }
  repacked.push_back(std::move(router));
  ATTNKIT_RETURN_IF_ERROR(repack_fused(gate_up, down, E, H, I, gpt_oss(c), &repacked));
  for (size_t i = next; i < staged.size(); ++i) repacked.push_back(std::move(staged[i]));
  // Biases as the kernels take them: gate [E, I], up [E, I] from the
  // interleaved [E, 2I], down [E, H] as it is.
  Tensor gate_b, up_b;
  if (c.expert_bias) {
    ATTNKIT_ASSIGN_OR_RETURN(gate_b, Tensor::zeros(DType::kF32, {E, I}));
    ATTNKIT_ASSIGN_OR_RETURN(up_b, Tensor::zeros(DType::kF32, {E, I}));
    const float* src = gate_up_bias.ptr<const float>();
    for (int64_t j = 0; j < E * I; ++j) {
      gate_b.ptr<float>()[j] = src[2 * j];
      up_b.ptr<float>()[j] = src[2 * j + 1];
    }
  }
  tensors_ = std::move(repacked);
  router_bias_ = std::move(router_bias);
  gate_bias_ = std::move(gate_b);
  up_bias_ = std::move(up_b);
  down_bias_ = std::move(down_bias);
  return Status::Ok();
}

Result<TensorView> MoeLayer::weight(std::string_view name) const {
  const std::string block = std::string(block_name(config_)) + ".";
  if (!loaded())
    return invalid_argument("MoeLayer::weight: weights are not loaded (call load_weights first)");
  if (name.substr(0, block.size()) == block && fused(config_)) {
    const std::string_view rest = name.substr(block.size());
    if (rest == "router.weight") return tensors_[kGateIndex].view();
    if (llama4(config_) && config_.n_shared_experts > 0) {
      const char* shared[] = {"shared_expert.gate_proj.weight", "shared_expert.up_proj.weight",
                              "shared_expert.down_proj.weight"};
      for (size_t k = 0; k < 3; ++k)
        if (rest == shared[k]) return tensors_[shared_index(config_) + k].view();
    }
    if (rest == "router.bias" && config_.router_bias) return router_bias_.view();
    if (rest == "experts.down_proj_bias" && config_.expert_bias) return down_bias_.view();
    if (rest.starts_with("experts."))
      return not_found("MoeLayer::weight: \"" + std::string(name) +
                       "\" is repacked at load into per-expert gate, up and down matrices "
                       "(nn.Linear layout); the fused checkpoint layout is not kept");
  } else if (name.substr(0, block.size()) == block) {
    const std::string_view rest = name.substr(block.size());
    const std::vector<WeightSpec> specs = weight_specs();
    for (size_t i = 0; i < specs.size(); ++i)
      if (specs[i].name == rest) return tensors_[i].view();
  }
  return not_found("MoeLayer::weight: no weight named \"" + std::string(name) +
                   "\" (weight_names() lists them)");
}

Status MoeLayer::forward(const TensorView& x, const TensorView& out, MoeRouting* routing,
                         const RunOptions& run) const {
  const MoeConfig& c = config_;
  ATTNKIT_RETURN_IF_ERROR(check::view(kFwd, "x", x, 3, {DType::kF32}));
  ATTNKIT_RETURN_IF_ERROR(check::view(kFwd, "out", out, 3, {DType::kF32}));
  const int64_t H = c.hidden_size, E = c.n_routed_experts, K = c.num_experts_per_tok;
  const int64_t I = c.moe_intermediate_size, S = I * c.n_shared_experts;
  const int64_t batch = x.shape[0], seq = x.shape[1];
  ATTNKIT_RETURN_IF_ERROR(check::dim(kFwd, "x", x, 2, "hidden_size", H, "config.hidden_size"));
  ATTNKIT_RETURN_IF_ERROR(check::dim(kFwd, "out", out, 0, "batch", batch, "x.shape[0]"));
  ATTNKIT_RETURN_IF_ERROR(check::dim(kFwd, "out", out, 1, "seq", seq, "x.shape[1]"));
  ATTNKIT_RETURN_IF_ERROR(check::dim(kFwd, "out", out, 2, "hidden_size", H, "config.hidden_size"));
  if (check::overlaps(out, x))
    return invalid_argument(std::string(kFwd) + ": out overlaps x; out must not alias x");
  ATTNKIT_RETURN_IF_ERROR(check_no_self_overlap(kFwd, "out", out));
  ATTNKIT_RETURN_IF_ERROR(check::run_options(kFwd, run));
  if (!loaded())
    return invalid_argument(std::string(kFwd) +
                            ": weights are not loaded (call load_weights first)");
  int64_t T = 0, TK = 0;
  if (!checked_mul(batch, seq, &T) || !checked_mul(T, K, &TK))
    return invalid_argument(std::string(kFwd) + ": batch * seq * num_experts_per_tok overflows");

  // Rows of x in one stride `ldx` where its layout allows; otherwise a
  // packed copy. Strided rows are gathered through x_row() anyway.
  const float* xd = x.ptr<const float>();
  auto x_row = [&](int64_t t) { return xd + (t / seq) * x.strides[0] + (t % seq) * x.strides[1]; };
  int64_t ldx = H;
  bool pack = x.strides[2] != 1 && H > 1;
  if (!pack && T > 1) {
    if (seq == 1)
      ldx = x.strides[0];
    else if (batch == 1 || x.strides[0] == seq * x.strides[1])
      ldx = x.strides[1];
    else
      pack = true;
  }

  const int threads = resolve_threads(run.num_threads);
  const int64_t shards = shard_count(T, threads, run.backend, tensors_);
  const int64_t per_shard = (T + shards - 1) / shards;
  const int64_t inter_max = std::max(I, S);

  // Every allocation happens before anything is written.
  Tensor packed, logits;
  std::vector<Tensor> work(static_cast<size_t>(shards));
  MoeRouting r;
  std::vector<RouteScratch> route(static_cast<size_t>(shards));
  std::vector<std::vector<int64_t>> slot_of(static_cast<size_t>(shards));  // expert-sorted slots
  std::vector<std::vector<int64_t>> counts(static_cast<size_t>(shards));
  // Scratch per shard: xb, y, acc [per_shard, H]; g, u [per_shard, inter_max].
  int64_t work_elems = 0;
  if (!checked_mul(per_shard, 3 * H + 2 * inter_max, &work_elems))
    return resource_exhausted(std::string(kFwd) + ": scratch size overflows");
  try {
    r.num_tokens = T;
    r.top_k = K;
    r.expert_ids.resize(static_cast<size_t>(TK));
    r.weights.resize(static_cast<size_t>(TK));
    r.tokens_per_expert.assign(static_cast<size_t>(E), 0);
    for (int64_t s = 0; s < shards; ++s) {
      RouteScratch& rs = route[static_cast<size_t>(s)];
      rs.score.resize(static_cast<size_t>(E));
      rs.choice.resize(static_cast<size_t>(E));
      rs.group_score.resize(static_cast<size_t>(c.n_group));
      rs.groups.resize(static_cast<size_t>(c.n_group));
      rs.candidates.reserve(static_cast<size_t>(E));
      slot_of[static_cast<size_t>(s)].resize(static_cast<size_t>(per_shard * K));
      counts[static_cast<size_t>(s)].resize(static_cast<size_t>(E + 1));
    }
  } catch (const std::bad_alloc&) {
    return resource_exhausted(std::string(kFwd) + ": cannot allocate the routing arrays for " +
                              std::to_string(T) + " tokens");
  }
  if (T == 0) {
    if (routing) *routing = std::move(r);
    return Status::Ok();
  }
  if (pack) {
    ATTNKIT_ASSIGN_OR_RETURN(packed, Tensor::zeros(DType::kF32, {T, H}));
    for (int64_t t = 0; t < T; ++t)
      for (int64_t d = 0; d < H; ++d) packed.ptr<float>()[t * H + d] = x_row(t)[d * x.strides[2]];
    xd = packed.ptr<const float>();
    ldx = H;
  }
  const float* xrows = xd;  // row t at xrows + t * ldx (direct or packed)
  ATTNKIT_ASSIGN_OR_RETURN(logits, Tensor::zeros(DType::kF32, {T, E}));
  for (Tensor& w : work) {
    ATTNKIT_ASSIGN_OR_RETURN(w, Tensor::zeros(DType::kF32, {work_elems}));
  }

  const kernels::Weight gate_w = kernels::weight_of(tensors_[kGateIndex]);
  const float* bias = has_score_bias(c) ? tensors_[kScoreBiasIndex].ptr<const float>() : nullptr;

  // Every projection runs on its shard's thread (one thread inside), on the
  // caller's backend: kReference runs the loop twin (kernels/linear.h).
  kernels::LinearOptions lin;
  lin.backend = run.backend;

  // Phase 1: routing. bad[s] = first token of shard s with a non-finite logit.
  std::vector<int64_t> bad(static_cast<size_t>(shards), -1);
  run_shards(shards, threads, [&](int64_t s) {
    const int64_t t0 = std::min(T, s * per_shard), t1 = std::min(T, t0 + per_shard);
    if (t0 == t1) return;
    float* lg = logits.ptr<float>() + t0 * E;
    kernels::linear(xrows + t0 * ldx, ldx, gate_w, router_bias_.ptr<const float>(), lg, E, t1 - t0,
                    E, H, lin);
    for (int64_t t = t0; t < t1; ++t) {
      if (!route_token(c, lg + (t - t0) * E, bias, route[static_cast<size_t>(s)],
                       r.expert_ids.data() + t * K, r.weights.data() + t * K)) {
        bad[static_cast<size_t>(s)] = t;
        return;
      }
    }
  });
  for (int64_t t : bad)
    if (t >= 0)
      return invalid_argument(std::string(kFwd) + ": router logits of token " + std::to_string(t) +
                              " (batch " + std::to_string(t / seq) + ", position " +
                              std::to_string(t % seq) +
                              ") are not finite: x or the gate weights hold NaN or Inf");
  for (int32_t id : r.expert_ids) ++r.tokens_per_expert[static_cast<size_t>(id)];

  // Phase 2: experts, shared experts, output.
  const bool input_scaled = llama4(c);
  run_shards(shards, threads, [&](int64_t s) {
    const int64_t t0 = std::min(T, s * per_shard), t1 = std::min(T, t0 + per_shard);
    const int64_t nt = t1 - t0;
    if (nt == 0) return;
    float* xb = work[static_cast<size_t>(s)].ptr<float>();
    float* y = xb + per_shard * H;
    float* acc = y + per_shard * H;
    float* g = acc + per_shard * H;
    float* u = g + per_shard * inter_max;
    std::fill(acc, acc + nt * H, 0.0f);

    // Counting sort of the shard's slots (t * K + j) by expert.
    std::vector<int64_t>& cnt = counts[static_cast<size_t>(s)];
    std::vector<int64_t>& slots = slot_of[static_cast<size_t>(s)];
    std::fill(cnt.begin(), cnt.end(), 0);
    const int32_t* ids = r.expert_ids.data();
    for (int64_t q = t0 * K; q < t1 * K; ++q) ++cnt[static_cast<size_t>(ids[q]) + 1];
    for (int64_t e = 0; e < E; ++e) cnt[static_cast<size_t>(e + 1)] += cnt[static_cast<size_t>(e)];
    for (int64_t q = t0 * K; q < t1 * K; ++q)
      slots[static_cast<size_t>(cnt[static_cast<size_t>(ids[q])]++)] = q;
    // cnt[e] now holds the end of expert e's run; runs start at cnt[e-1].
    int64_t begin = 0;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t end = cnt[static_cast<size_t>(e)], n = end - begin;
      if (n == 0) continue;
      for (int64_t i = 0; i < n; ++i)
        std::copy_n(xrows + (slots[static_cast<size_t>(begin + i)] / K) * ldx, H, xb + i * H);
      // Llama4TextMoe scales the expert's input by the routing weight (and
      // sums its outputs unweighted); SwiGLU is not linear, so the two differ.
      if (input_scaled)
        for (int64_t i = 0; i < n; ++i) {
          const float wt = r.weights[static_cast<size_t>(slots[static_cast<size_t>(begin + i)])];
          for (int64_t d = 0; d < H; ++d) xb[i * H + d] *= wt;
        }
      const size_t w = expert_index(c, e);
      // gpt-oss's per-expert biases (null elsewhere).
      const float* gb = gate_bias_.data() ? gate_bias_.ptr<const float>() + e * I : nullptr;
      const float* ub = up_bias_.data() ? up_bias_.ptr<const float>() + e * I : nullptr;
      const float* db = down_bias_.data() ? down_bias_.ptr<const float>() + e * H : nullptr;
      kernels::linear(xb, H, kernels::weight_of(tensors_[w]), gb, g, I, n, I, H, lin);
      kernels::linear(xb, H, kernels::weight_of(tensors_[w + 1]), ub, u, I, n, I, H, lin);
      activate(c, g, u, n * I);
      kernels::linear(g, I, kernels::weight_of(tensors_[w + 2]), db, y, H, n, H, I, lin);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t q = slots[static_cast<size_t>(begin + i)];
        const float wt = input_scaled ? 1.0f : r.weights[static_cast<size_t>(q)];
        float* a = acc + (q / K - t0) * H;
        const float* yi = y + i * H;
        for (int64_t d = 0; d < H; ++d) a[d] += wt * yi[d];
      }
      begin = end;
    }
    if (S > 0) {
      const size_t w = shared_index(c);
      const float* xs = xrows + t0 * ldx;
      kernels::linear(xs, ldx, kernels::weight_of(tensors_[w]), nullptr, g, S, nt, S, H, lin);
      kernels::linear(xs, ldx, kernels::weight_of(tensors_[w + 1]), nullptr, u, S, nt, S, H, lin);
      activate(c, g, u, nt * S);
      kernels::linear(g, S, kernels::weight_of(tensors_[w + 2]), nullptr, y, H, nt, H, S, lin);
      if (c.shared_expert_gate) {
        // Each token's own sigmoid(x . w) scales the shared expert; g is
        // free again and holds the nt gate logits.
        kernels::linear(xs, ldx, kernels::weight_of(tensors_[w + 3]), nullptr, g, 1, nt, 1, H, lin);
        for (int64_t i = 0; i < nt; ++i) {
          const float sg = 1.0f / (1.0f + std::exp(-g[i]));
          for (int64_t d = 0; d < H; ++d) acc[i * H + d] += sg * y[i * H + d];
        }
      } else {
        for (int64_t i = 0; i < nt * H; ++i) acc[i] += y[i];
      }
    }
    float* od = out.ptr<float>();
    for (int64_t t = t0; t < t1; ++t) {
      float* o = od + (t / seq) * out.strides[0] + (t % seq) * out.strides[1];
      const float* a = acc + (t - t0) * H;
      for (int64_t d = 0; d < H; ++d) o[d * out.strides[2]] = a[d];
    }
  });
  if (routing) *routing = std::move(r);
  return Status::Ok();
}

}  // namespace attnkit
