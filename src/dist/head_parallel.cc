// Head-parallel layers: each rank runs the core library's own layer
// (AttentionLayer, LatentAttention) on its shard of heads, and the ranks sum
// the shards' o_proj outputs with one MPI_Allreduce.
//
// A shard is an ordinary layer config with fewer heads, so biases, every
// qk-norm kind, RoPE / NoPE with temperature tuning, windows, chunks,
// softcap, both MLA forms and the caches work unchanged; sinks and the
// output gate are per head and cut with the heads. Its
// weights are views into the caller's full weights (row blocks of q/k/v and
// kv_b, a column block of o_proj), which the shard's own strict loader
// copies; nothing here reads weight values.
//
// The order of every collective call: local checks, one agreement (every
// rank learns whether any rank failed, and the facts that must match),
// then the local compute, a second agreement on its outcome (a rank whose
// compute failed must not leave the others in the all-reduce), then the
// all-reduce.
#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "attnkit/dist.h"
#include "core/check.h"
#include "dist/common.h"

namespace attnkit::dist {

OwnedComm::OwnedComm(OwnedComm&& other) noexcept : comm_(other.comm_) {
  other.comm_ = MPI_COMM_NULL;
}

OwnedComm& OwnedComm::operator=(OwnedComm&& other) noexcept {
  if (this != &other) {
    OwnedComm old(comm_);  // frees the current one
    comm_ = other.comm_;
    other.comm_ = MPI_COMM_NULL;
  }
  return *this;
}

OwnedComm::~OwnedComm() {
  if (comm_ == MPI_COMM_NULL) return;
  // After MPI_Finalize no MPI call is allowed; the communicator went with it.
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Comm_free(&comm_);
}

namespace {

using internal::Agreement;
using internal::check_comm;
using internal::mpi_status;

constexpr const char* kCreate = "HeadParallelAttention::create";
constexpr const char* kLoad = "HeadParallelAttention::load_weights";
constexpr const char* kNewCache = "HeadParallelAttention::new_cache";
constexpr const char* kForward = "HeadParallelAttention::forward";
constexpr const char* kMlaCreate = "HeadParallelLatentAttention::create";
constexpr const char* kMlaLoad = "HeadParallelLatentAttention::load_weights";
constexpr const char* kMlaNewCache = "HeadParallelLatentAttention::new_cache";
constexpr const char* kMlaForward = "HeadParallelLatentAttention::forward";

using check::prefixed;

// The layers' rule for joining a prefix and a weight name (attention_layer.h).
std::string full_name(std::string_view prefix, std::string_view name) {
  std::string s(prefix);
  if (!s.empty() && s.back() != '.') s += '.';
  return s + std::string(name);
}

// A weight this rank keeps a block of: indices [begin, end) of dimension
// `dim` of a tensor whose whole shape is `full`.
struct Cut {
  const char* name;
  int dim;
  int64_t begin, end;
  std::vector<int64_t> full;
  const char* meaning;  // the full shape in config terms, for messages
};

// The shard's weights: `weights` with every cut entry replaced by a view of
// its block and the `dropped` names removed. A cut weight that is missing
// stays missing, for the shard's loader to report by its full name.
Status shard_weights(const char* fn, const WeightMap& weights, std::string_view prefix,
                     const std::vector<Cut>& cuts, const std::vector<const char*>& dropped,
                     WeightMap* out) {
  WeightMap map = weights;
  for (const Cut& c : cuts) {
    auto it = map.find(full_name(prefix, c.name));
    if (it == map.end()) continue;
    TensorView& v = it->second;
    bool shape_ok = v.rank == static_cast<int>(c.full.size());
    for (int i = 0; shape_ok && i < v.rank; ++i) shape_ok = v.shape[i] == c.full[size_t(i)];
    if (!shape_ok)
      return invalid_argument(std::string(fn) + ": " + it->first + " has shape " +
                              check::shape_text(v) + ", expected [" + c.meaning +
                              "] = " + check::shape_text(c.full));
    if (v.data != nullptr) {
      const int64_t offset = c.begin * v.strides[c.dim] * static_cast<int64_t>(dtype_size(v.dtype));
      v.data = static_cast<char*>(v.data) + offset;
    }
    v.shape[c.dim] = c.end - c.begin;
  }
  for (const char* name : dropped) map.erase(full_name(prefix, name));
  *out = std::move(map);
  return Status::Ok();
}

// What both layers check before the agreement: x, out, positions and run
// options as the local layer will; out contiguous and small enough for one
// MPI message (it is the all-reduce's receive buffer).
Status check_call(const char* fn, const TensorView& x, const TensorView& out, int64_t hidden,
                  bool x_contiguous, std::span<const int64_t> positions, const RunOptions& run) {
  const std::string f = fn;
  ATTNKIT_RETURN_IF_ERROR(check::activation(fn, "x", x, hidden, x_contiguous));
  ATTNKIT_RETURN_IF_ERROR(check::activation(fn, "out", out, hidden, true));
  for (int i = 0; i < 2; ++i)
    if (out.shape[i] != x.shape[i])
      return invalid_argument(f + ": out.shape[" + std::to_string(i) +
                              "] = " + std::to_string(out.shape[i]) + " must equal x.shape[" +
                              std::to_string(i) + "] = " + std::to_string(x.shape[i]));
  if (check::overlaps(out, x)) return invalid_argument(f + ": out overlaps x; it must not alias");
  const int64_t T = x.shape[1];
  if (x.shape[0] > 0 &&
      T > std::numeric_limits<int>::max() / x.shape[0] / std::max<int64_t>(hidden, 1))
    return invalid_argument(f + ": batch * seq * hidden_size = " + std::to_string(x.shape[0]) +
                            " * " + std::to_string(T) + " * " + std::to_string(hidden) +
                            " must fit an int (one MPI message); split the call");
  ATTNKIT_RETURN_IF_ERROR(check::positions(fn, positions, T, x.shape[0] * T, true));
  return check::run_options(fn, run);
}

// The facts every rank's forward() must agree on, in run_collective_forward's order.
constexpr const char* kForwardFactNames[] = {"x.shape[0] (batch)",
                                             "x.shape[1] (seq)",
                                             "cache given (1) or not (0)",
                                             "cache length",
                                             "positions count",
                                             "positions (FNV-1a hash)",
                                             "form"};

// Agreement on the call, the local compute, agreement on its outcome, then
// the sum of the ranks' partial outputs into `out`.
template <typename Compute>
Status run_collective_forward(MPI_Comm comm, const char* fn, Status local, const TensorView& x,
                              const TensorView& out, int64_t hidden,
                              std::span<const int64_t> positions, bool has_cache,
                              int64_t cache_length, int64_t form, Compute compute) {
  const int64_t B = x.rank == 3 ? x.shape[0] : 0, T = x.rank == 3 ? x.shape[1] : 0;
  Tensor partial;  // this rank's o_proj output, [batch, seq, hidden]
  if (local.ok() && B * T > 0) {
    Result<Tensor> p = Tensor::zeros(DType::kF32, {B, T, hidden});
    if (p.ok())
      partial = std::move(p).value();
    else
      local = prefixed(fn, p.status());
  }
  const int64_t facts[] = {B,
                           T,
                           has_cache ? 1 : 0,
                           cache_length,
                           static_cast<int64_t>(positions.size()),
                           static_cast<int64_t>(internal::hash_values(positions)),
                           form};
  Result<Agreement> a = Agreement::reach(comm, fn, local, facts);
  if (!a.ok()) return a.status();
  for (size_t i = 0; i < std::size(facts); ++i)
    ATTNKIT_RETURN_IF_ERROR(a->same(i, kForwardFactNames[i]));
  if (B * T == 0) return Status::Ok();
  ATTNKIT_RETURN_IF_ERROR(internal::agree(comm, fn, compute(partial.view())));
  return mpi_status(fn, "MPI_Allreduce",
                    MPI_Allreduce(partial.data(), out.data, static_cast<int>(B * T * hidden),
                                  MPI_FLOAT, MPI_SUM, comm));
}

// A double's bits, so that configs compare exactly.
int64_t bits(double v) {
  int64_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

// Facts of a config that must match across ranks, for create().
uint64_t hash_config(const AttentionConfig& c) {
  const RopeConfig& r = c.rope;
  const int64_t fields[] = {c.qkv_bias,
                            c.o_bias,
                            static_cast<int64_t>(c.qk_norm),
                            bits(c.rms_norm_eps),
                            c.use_rope,
                            r.head_dim,
                            r.rotary_dim,
                            bits(r.theta),
                            static_cast<int64_t>(r.pairing),
                            static_cast<int64_t>(r.scaling.type),
                            bits(r.scaling.factor),
                            bits(r.scaling.low_freq_factor),
                            bits(r.scaling.high_freq_factor),
                            r.scaling.original_max_position_embeddings,
                            bits(r.scaling.beta_fast),
                            bits(r.scaling.beta_slow),
                            bits(r.scaling.mscale),
                            bits(r.scaling.mscale_all_dim),
                            bits(r.scaling.attention_factor),
                            r.scaling.truncate,
                            c.sliding_window,
                            c.chunk_size,
                            bits(c.softcap),
                            bits(c.softmax_scale),
                            c.causal,
                            c.sinks,
                            c.output_gate,
                            c.temperature_tuning,
                            bits(c.floor_scale),
                            bits(c.attn_scale)};
  return internal::hash_values(fields);
}

uint64_t hash_config(const MlaConfig& c) {
  const RopeScaling& s = c.rope_scaling;
  const int64_t fields[] = {bits(c.rope_theta),       static_cast<int64_t>(s.type),
                            bits(s.factor),           s.original_max_position_embeddings,
                            bits(s.beta_fast),        bits(s.beta_slow),
                            bits(s.mscale),           bits(s.mscale_all_dim),
                            bits(s.attention_factor), bits(c.rms_norm_eps),
                            c.rope_interleave};
  return internal::hash_values(fields);
}

// Agreement for create(): local status plus the config's sizes and the
// hash of its other fields, which must match across ranks.
Status agree_on_config(MPI_Comm comm, const char* fn, const Status& local,
                       std::span<const int64_t> sizes, std::span<const char* const> names,
                       uint64_t other_fields) {
  std::vector<int64_t> facts(sizes.begin(), sizes.end());
  facts.push_back(static_cast<int64_t>(other_fields));
  Result<Agreement> a = Agreement::reach(comm, fn, local, facts);
  if (!a.ok()) return a.status();
  for (size_t i = 0; i < sizes.size(); ++i) ATTNKIT_RETURN_IF_ERROR(a->same(i, names[i]));
  return a->same(sizes.size(), "the config's other fields (FNV-1a hash)");
}

Result<OwnedComm> duplicate(const char* fn, MPI_Comm comm) {
  MPI_Comm dup = MPI_COMM_NULL;
  ATTNKIT_RETURN_IF_ERROR(mpi_status(fn, "MPI_Comm_dup", MPI_Comm_dup(comm, &dup)));
  return OwnedComm(dup);
}

// Loads `shard` into a fresh layer made by `make`, agrees, and only when
// every rank succeeded moves it into `*layer`.
template <typename Layer, typename Make>
Status load_shard(MPI_Comm comm, const char* fn, const WeightMap& weights, std::string_view prefix,
                  const std::vector<Cut>& cuts, const std::vector<const char*>& dropped, Make make,
                  Layer* layer) {
  WeightMap shard;
  Status local = shard_weights(fn, weights, prefix, cuts, dropped, &shard);
  Layer staged;
  if (local.ok()) {
    Result<Layer> fresh = make();
    if (!fresh.ok())
      local = prefixed(fn, fresh.status());
    else
      staged = std::move(fresh).value();
  }
  if (local.ok()) local = prefixed(fn, staged.load_weights(shard, prefix));
  ATTNKIT_RETURN_IF_ERROR(internal::agree(comm, fn, local));
  *layer = std::move(staged);
  return Status::Ok();
}

template <typename Cache>
Result<Cache> agree_on_cache(MPI_Comm comm, const char* fn, Result<Cache> cache) {
  const Status local = cache.ok() ? Status::Ok() : prefixed(fn, cache.status());
  ATTNKIT_RETURN_IF_ERROR(internal::agree(comm, fn, local));
  return cache;
}

}  // namespace

// ---------------------------------------------------------------- MHA / GQA

Result<HeadParallelAttention> HeadParallelAttention::create(MPI_Comm comm,
                                                            const AttentionConfig& config) {
  return build(comm, config);
}

Result<HeadParallelAttention> HeadParallelAttention::from_config_json(MPI_Comm comm,
                                                                      std::string_view json_text,
                                                                      int64_t layer_index) {
  return build(comm, attention_config_from_json(json_text, layer_index));
}

Result<HeadParallelAttention> HeadParallelAttention::build(MPI_Comm comm,
                                                           const Result<AttentionConfig>& parsed) {
  int rank = 0, ranks = 0;
  ATTNKIT_RETURN_IF_ERROR(check_comm(kCreate, comm, &rank, &ranks));
  HeadParallelAttention layer;
  const AttentionConfig config = parsed.ok() ? *parsed : AttentionConfig{};
  Status local = prefixed(kCreate, parsed.ok() ? validate(config) : parsed.status());
  if (local.ok()) {
    Result<HeadShare> share = head_share(config.num_heads, config.num_kv_heads, ranks, rank);
    if (!share.ok()) local = prefixed(kCreate, share.status());
    if (local.ok()) {
      layer.share_ = *share;
      AttentionConfig shard = config;
      shard.num_heads = share->num_heads();
      shard.num_kv_heads = share->num_kv_heads();
      shard.o_bias = config.o_bias && rank == 0;  // added once to the sum
      Result<AttentionLayer> l = AttentionLayer::create(shard);
      if (!l.ok())
        local = prefixed(kCreate, l.status());
      else
        layer.local_ = std::move(l).value();
    }
  }
  const int64_t sizes[] = {config.hidden_size, config.num_heads, config.num_kv_heads,
                           config.head_dim};
  const char* const names[] = {"config.hidden_size", "config.num_heads", "config.num_kv_heads",
                               "config.head_dim"};
  ATTNKIT_RETURN_IF_ERROR(agree_on_config(comm, kCreate, local, sizes, names, hash_config(config)));
  ATTNKIT_ASSIGN_OR_RETURN(layer.comm_, duplicate(kCreate, comm));
  layer.rank_ = rank;
  layer.ranks_ = ranks;
  layer.config_ = config;
  return layer;
}

Status HeadParallelAttention::load_weights(const WeightMap& weights, std::string_view prefix) {
  const AttentionConfig& c = config_;
  const int64_t D = c.head_dim, d = c.hidden_size, H = c.num_heads, K = c.num_kv_heads;
  const int64_t q0 = share_.q_begin * D, q1 = share_.q_end * D, k0 = share_.kv_begin * D,
                k1 = share_.kv_end * D;
  // Under output_gate each head owns 2 * head_dim rows of q_proj
  // ([query | gate]), so a block of heads is still one block of rows.
  const int64_t g = c.output_gate ? 2 : 1;
  const char* q_meaning =
      c.output_gate ? "num_heads*2*head_dim, hidden_size" : "num_heads*head_dim, hidden_size";
  std::vector<Cut> cuts = {
      {"q_proj.weight", 0, g * q0, g * q1, {g * H * D, d}, q_meaning},
      {"k_proj.weight", 0, k0, k1, {K * D, d}, "num_kv_heads*head_dim, hidden_size"},
      {"v_proj.weight", 0, k0, k1, {K * D, d}, "num_kv_heads*head_dim, hidden_size"},
      {"o_proj.weight", 1, q0, q1, {d, H * D}, "hidden_size, num_heads*head_dim"}};
  if (c.qkv_bias) {
    cuts.push_back({"q_proj.bias",
                    0,
                    g * q0,
                    g * q1,
                    {g * H * D},
                    c.output_gate ? "num_heads*2*head_dim" : "num_heads*head_dim"});
    cuts.push_back({"k_proj.bias", 0, k0, k1, {K * D}, "num_kv_heads*head_dim"});
    cuts.push_back({"v_proj.bias", 0, k0, k1, {K * D}, "num_kv_heads*head_dim"});
  }
  // gpt-oss's sinks are one logit per query head: this rank's heads.
  if (c.sinks) cuts.push_back({"sinks", 0, share_.q_begin, share_.q_end, {H}, "num_heads"});
  std::vector<const char*> dropped;
  if (c.o_bias && rank_ != 0) dropped.push_back("o_proj.bias");
  const AttentionConfig shard = local_.config();
  ATTNKIT_RETURN_IF_ERROR(load_shard(
      comm_.get(), kLoad, weights, prefix, cuts, dropped,
      [&] { return AttentionLayer::create(shard); }, &local_));
  loaded_ = true;
  return Status::Ok();
}

Result<KVCache> HeadParallelAttention::new_cache(int64_t batch_size, int64_t max_seq_len,
                                                 DType dtype) const {
  return agree_on_cache(comm_.get(), kNewCache, local_.new_cache(batch_size, max_seq_len, dtype));
}

Status HeadParallelAttention::forward(const TensorView& x, const TensorView& out,
                                      std::span<const int64_t> positions, KVCache* cache,
                                      const RunOptions& run) {
  const std::string f = kForward;
  const int64_t hidden = config_.hidden_size;
  Status local = loaded_ ? check_call(kForward, x, out, hidden, false, positions, run)
                         : invalid_argument(f + ": no weights loaded (call load_weights first)");
  if (local.ok() && cache) {
    // The cache must be one this layer's new_cache() made, with room left.
    const KVCacheSpec& s = cache->spec();
    const AttentionConfig& lc = local_.config();
    const int64_t T = x.shape[1];
    if (!config_.causal)
      local = invalid_argument(f + ": a cache needs a causal layer; config().causal is false");
    else if (s.num_kv_heads != lc.num_kv_heads || s.head_dim != lc.head_dim ||
             (s.head_dim_v != 0 && s.head_dim_v != lc.head_dim) ||
             s.sliding_window != lc.sliding_window || s.chunk_size != lc.chunk_size ||
             s.batch_size != x.shape[0])
      local = invalid_argument(
          f + ": cache spec (batch_size " + std::to_string(s.batch_size) + ", num_kv_heads " +
          std::to_string(s.num_kv_heads) + ", head_dim " + std::to_string(s.head_dim) +
          ", sliding_window " + std::to_string(s.sliding_window) + ", chunk_size " +
          std::to_string(s.chunk_size) + ") must be this rank's (" + std::to_string(x.shape[0]) +
          ", " + std::to_string(lc.num_kv_heads) + ", " + std::to_string(lc.head_dim) + ", " +
          std::to_string(lc.sliding_window) + ", " + std::to_string(lc.chunk_size) +
          "); make it with new_cache()");
    else if (T > s.max_seq_len - cache->length())
      local = out_of_range(f + ": cache length " + std::to_string(cache->length()) + " + " +
                           std::to_string(T) +
                           " new tokens exceeds max_seq_len = " + std::to_string(s.max_seq_len));
    else if (check::overlaps(out, cache->keys()) || check::overlaps(out, cache->values()))
      local = invalid_argument(f + ": out overlaps the cache's storage");
  }
  return run_collective_forward(
      comm_.get(), kForward, local, x, out, hidden, positions, cache != nullptr,
      cache ? cache->length() : 0, 0,
      [&](const TensorView& partial) { return local_.forward(x, partial, positions, cache, run); });
}

// ---------------------------------------------------------------- MLA

Result<HeadParallelLatentAttention> HeadParallelLatentAttention::create(MPI_Comm comm,
                                                                        const MlaConfig& config) {
  return build(comm, config);
}

Result<HeadParallelLatentAttention> HeadParallelLatentAttention::from_config_json(
    MPI_Comm comm, std::string_view json_text) {
  return build(comm, mla_config_from_json(json_text));
}

Result<HeadParallelLatentAttention> HeadParallelLatentAttention::build(
    MPI_Comm comm, const Result<MlaConfig>& parsed) {
  int rank = 0, ranks = 0;
  ATTNKIT_RETURN_IF_ERROR(check_comm(kMlaCreate, comm, &rank, &ranks));
  HeadParallelLatentAttention layer;
  const MlaConfig config = parsed.ok() ? *parsed : MlaConfig{};
  Status local = prefixed(kMlaCreate, parsed.ok() ? validate(config) : parsed.status());
  if (local.ok()) {
    const int64_t H = config.num_attention_heads;
    Result<HeadShare> share = head_share(H, H, ranks, rank);
    if (!share.ok()) local = prefixed(kMlaCreate, share.status());
    if (local.ok()) {
      layer.share_ = *share;
      MlaConfig shard = config;
      shard.num_attention_heads = share->num_heads();
      Result<LatentAttention> l = LatentAttention::create(shard);
      if (!l.ok())
        local = prefixed(kMlaCreate, l.status());
      else
        layer.local_ = std::move(l).value();
    }
  }
  const int64_t sizes[] = {config.hidden_size,  config.num_attention_heads, config.q_lora_rank,
                           config.kv_lora_rank, config.qk_nope_head_dim,    config.qk_rope_head_dim,
                           config.v_head_dim};
  const char* const names[] = {"config.hidden_size",      "config.num_attention_heads",
                               "config.q_lora_rank",      "config.kv_lora_rank",
                               "config.qk_nope_head_dim", "config.qk_rope_head_dim",
                               "config.v_head_dim"};
  ATTNKIT_RETURN_IF_ERROR(
      agree_on_config(comm, kMlaCreate, local, sizes, names, hash_config(config)));
  ATTNKIT_ASSIGN_OR_RETURN(layer.comm_, duplicate(kMlaCreate, comm));
  layer.rank_ = rank;
  layer.ranks_ = ranks;
  layer.config_ = config;
  return layer;
}

Status HeadParallelLatentAttention::load_weights(const WeightMap& weights,
                                                 std::string_view prefix) {
  const MlaConfig& c = config_;
  const int64_t H = c.num_attention_heads, d = c.hidden_size, dqk = c.qk_head_dim(),
                dnv = c.qk_nope_head_dim + c.v_head_dim, dv = c.v_head_dim;
  const int64_t h0 = share_.q_begin, h1 = share_.q_end;
  std::vector<Cut> cuts;
  if (c.q_lora_rank > 0)
    cuts.push_back({"q_b_proj.weight",
                    0,
                    h0 * dqk,
                    h1 * dqk,
                    {H * dqk, c.q_lora_rank},
                    "num_attention_heads*(qk_nope_head_dim+qk_rope_head_dim), q_lora_rank"});
  else
    cuts.push_back({"q_proj.weight",
                    0,
                    h0 * dqk,
                    h1 * dqk,
                    {H * dqk, d},
                    "num_attention_heads*(qk_nope_head_dim+qk_rope_head_dim), hidden_size"});
  cuts.push_back({"kv_b_proj.weight",
                  0,
                  h0 * dnv,
                  h1 * dnv,
                  {H * dnv, c.kv_lora_rank},
                  "num_attention_heads*(qk_nope_head_dim+v_head_dim), kv_lora_rank"});
  cuts.push_back({"o_proj.weight",
                  1,
                  h0 * dv,
                  h1 * dv,
                  {d, H * dv},
                  "hidden_size, num_attention_heads*v_head_dim"});
  const MlaConfig shard = local_.config();
  ATTNKIT_RETURN_IF_ERROR(load_shard(
      comm_.get(), kMlaLoad, weights, prefix, cuts, {},
      [&] { return LatentAttention::create(shard); }, &local_));
  loaded_ = true;
  return Status::Ok();
}

Result<LatentCache> HeadParallelLatentAttention::new_cache(int64_t batch_size, int64_t max_seq_len,
                                                           DType dtype) const {
  return agree_on_cache(comm_.get(), kMlaNewCache,
                        local_.new_cache(batch_size, max_seq_len, dtype));
}

Status HeadParallelLatentAttention::forward(const TensorView& x, const TensorView& out,
                                            std::span<const int64_t> positions, LatentCache* cache,
                                            const RunOptions& run, MlaForm form) {
  const std::string f = kMlaForward;
  const MlaConfig& c = config_;
  Status local = loaded_ ? check_call(kMlaForward, x, out, c.hidden_size, true, positions, run)
                         : invalid_argument(f + ": no weights loaded (call load_weights first)");
  if (local.ok() && form != MlaForm::kAuto && form != MlaForm::kNaive && form != MlaForm::kAbsorbed)
    local = invalid_argument(f + ": form = " + std::to_string(static_cast<int>(form)) +
                             " is not an MlaForm value");
  if (local.ok() && cache) {
    const int64_t T = x.shape[1];
    if (cache->kv_lora_rank() != c.kv_lora_rank ||
        cache->qk_rope_head_dim() != c.qk_rope_head_dim || cache->batch_size() != x.shape[0])
      local = invalid_argument(f + ": cache (batch_size " + std::to_string(cache->batch_size()) +
                               ", kv_lora_rank " + std::to_string(cache->kv_lora_rank()) +
                               ", qk_rope_head_dim " + std::to_string(cache->qk_rope_head_dim()) +
                               ") must be this layer's (" + std::to_string(x.shape[0]) + ", " +
                               std::to_string(c.kv_lora_rank) + ", " +
                               std::to_string(c.qk_rope_head_dim) + "); make it with new_cache()");
    else if (T > cache->max_seq_len() - cache->length())
      local = out_of_range(f + ": cache overflow: length " + std::to_string(cache->length()) +
                           " + " + std::to_string(T) +
                           " new tokens > max_seq_len = " + std::to_string(cache->max_seq_len()));
    else if (check::overlaps(out, cache->storage()))
      local = invalid_argument(f + ": out overlaps the cache storage");
  }
  return run_collective_forward(comm_.get(), kMlaForward, local, x, out, c.hidden_size, positions,
                                cache != nullptr, cache ? cache->length() : 0,
                                static_cast<int64_t>(form), [&](const TensorView& partial) {
                                  return local_.forward(x, partial, positions, cache, run, form);
                                });
}

}  // namespace attnkit::dist
