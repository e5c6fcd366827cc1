// The serving engine of `attnkit serve-bench` (tools/attnkit/serve_engine.h)
// on small models: every request gets exactly its output length; a
// sequence's outputs do not depend on what shares its steps, on how its
// prompt is chunked, or on being preempted and recomputed; smaller KV
// caches admit more sequences at one budget; impossible budgets are
// refused.
//
// The reference for a sequence's outputs is the same sequence served alone
// (max_seqs = 1: one sequence at a time, its prompt in one chunk). With
// Backend::kReference every kernel computes each token's row independently
// of the others (double-accumulated attention per query, the loop GEMM per
// row), so chunking, batching and recomputation must all give the same
// bits. The fast kernels are batch-invariant where
// kernels::linear_rows_independent() (docs/PAGED.md), but a prompt chunked
// differently rounds differently (docs/RELIABILITY.md), so they are held
// bit for bit on unchunked prompts.
#include "serve_engine.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/linear.h"

namespace attnkit::serve {
namespace {

AttentionConfig gqa_config(int64_t kv_heads) {
  AttentionConfig c;
  c.model_type = "llama";
  c.hidden_size = 32;
  c.num_heads = 4;
  c.num_kv_heads = kv_heads;
  c.head_dim = 8;
  c.rope.head_dim = 8;
  c.rope.theta = 10000.0;
  return c;
}

MlaConfig mla_config() {
  MlaConfig c;
  c.model_type = "deepseek_v3";
  c.hidden_size = 32;
  c.num_attention_heads = 4;
  c.kv_lora_rank = 16;
  c.qk_nope_head_dim = 8;
  c.qk_rope_head_dim = 4;
  c.v_head_dim = 8;
  return c;
}

MoeConfig moe_config() {
  MoeConfig c;
  c.model_type = "mixtral";
  c.naming = MoeWeightNaming::kMixtral;
  c.hidden_size = 32;
  c.n_routed_experts = 4;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 24;
  return c;
}

struct Named {
  const char* name;
  ModelSpec spec;
};

std::vector<Named> models() {
  ModelSpec gqa;
  gqa.attention = gqa_config(2);
  gqa.layers = 2;
  ModelSpec mla;
  mla.mla = true;
  mla.latent = mla_config();
  mla.layers = 2;
  ModelSpec moe = gqa;
  moe.ffn = true;
  moe.moe = moe_config();
  moe.weight_dtype = DType::kF32;
  return {{"gqa", gqa}, {"mla", mla}, {"gqa+moe f32 weights", moe}};
}

Model make(const ModelSpec& spec) {
  auto m = Model::create(spec);
  EXPECT_TRUE(m.ok()) << m.status().to_string();
  return std::move(m).value();
}

// Mixed lengths, arrivals spread and repeated.
std::vector<Request> trace() {
  return {{0.0, 13, 5},   {0.0, 3, 9}, {0.0, 21, 2}, {0.0, 1, 6}, {0.001, 9, 7},
          {0.001, 17, 3}, {0.5, 5, 8}, {0.5, 11, 1}, {2.0, 7, 4}, {2.0, 2, 10}};
}

// The same requests, all arriving at 0: which sequences share a step then
// depends on the scheduler alone, not on how long this machine's steps take.
std::vector<Request> at_once(std::vector<Request> reqs) {
  for (Request& r : reqs) r.arrival_s = 0.0;
  return reqs;
}

Report serve(Model& m, const std::vector<Request>& reqs, Options o) {
  o.keep_outputs = true;
  auto r = run(m, reqs, o);
  EXPECT_TRUE(r.ok()) << r.status().to_string();
  return r.ok() ? std::move(r).value() : Report{};
}

// One sequence at a time, each prompt in one chunk, room for everything.
Options alone(Options o) {
  o.cache = CacheMode::kPaged;
  o.max_seqs = 1;
  o.max_tokens_per_step = 1 << 20;
  o.memory_bytes = int64_t{1} << 24;
  return o;
}

void expect_same_outputs(const Report& got, const Report& want, const std::string& what) {
  ASSERT_EQ(got.requests.size(), want.requests.size());
  for (size_t i = 0; i < got.requests.size(); ++i) {
    const auto& a = got.requests[i].outputs;
    const auto& b = want.requests[i].outputs;
    ASSERT_EQ(a.size(), b.size()) << what << ", request " << i;
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)))
        << what << ", request " << i << " (preempted " << got.requests[i].preemptions << "x)";
  }
}

TEST(ServeEngine, EveryRequestGetsExactlyItsOutputs) {
  for (const auto& [name, spec] : models())
    for (CacheMode cache : {CacheMode::kPaged, CacheMode::kStatic}) {
      SCOPED_TRACE(std::string(name) + (cache == CacheMode::kPaged ? " paged" : " static"));
      Model m = make(spec);
      Options o;
      o.cache = cache;
      o.page_size = 4;
      o.max_tokens_per_step = 16;
      auto pool = m.new_pool(1, 4, o.kv_dtype).value();
      o.memory_bytes = static_cast<int64_t>(pool.page_nbytes()) * 12;  // 48 token slots
      const std::vector<Request> reqs = trace();
      const Report r = serve(m, reqs, o);
      ASSERT_EQ(r.requests.size(), reqs.size());
      int64_t outputs = 0;
      for (size_t i = 0; i < reqs.size(); ++i) {
        const RequestReport& q = r.requests[i];
        EXPECT_EQ(q.output_tokens, reqs[i].output_tokens) << "request " << i;
        EXPECT_EQ(int64_t(q.outputs.size()), reqs[i].output_tokens * m.hidden_size());
        EXPECT_GE(q.first_token_s, q.arrival_s);
        EXPECT_GE(q.finish_s, q.first_token_s);
        outputs += q.output_tokens;
      }
      EXPECT_GE(r.end_s, 2.0);  // the last arrivals come at 2 s
      EXPECT_GE(r.tokens_computed, outputs);
      EXPECT_GE(r.peak_reserved_bytes, r.peak_used_bytes);
      if (cache == CacheMode::kStatic) {
        EXPECT_EQ(r.preemptions, 0);
        EXPECT_EQ(r.max_seq_len, 21 + 2 - 1);  // the longest request's slots
        EXPECT_EQ(r.max_running, 48 / 22);     // slots the budget holds
        EXPECT_LE(r.peak_running, r.max_running);
      }
    }
}

// The reference kernels: chunked prompts, batching and recompute
// preemption give the bits of the sequence served alone.
TEST(ServeEngine, PreemptionChunkingAndBatchingChangeNoBitsWithTheReferenceKernels) {
  for (const auto& [name, spec] : models()) {
    SCOPED_TRACE(name);
    Model m = make(spec);
    Options o;
    o.run.backend = Backend::kReference;
    o.page_size = 2;
    o.max_tokens_per_step = 7;
    auto pool = m.new_pool(1, 2, o.kv_dtype).value();
    // 16 pages of 2: the longest request (22 slots) just fits, so several
    // running sequences soon run out of pages.
    o.memory_bytes = static_cast<int64_t>(pool.page_nbytes()) * 16;
    const std::vector<Request> reqs = at_once(trace());
    const Report tight = serve(m, reqs, o);
    EXPECT_GT(tight.preemptions, 0);
    EXPECT_GT(tight.peak_running, 1);
    expect_same_outputs(tight, serve(m, reqs, alone(o)), "tight pool vs alone");
  }
}

// The fast kernels, for each weight dtype whose GEMM rows do not depend on
// their neighbours here: sequences batched (every prompt in one chunk)
// give the bits they give alone.
TEST(ServeEngine, BatchingChangesNoBitsWithTheFastKernels) {
  int tested = 0;
  for (DType w : {DType::kF32, DType::kBF16}) {
    if (!kernels::linear_rows_independent(Backend::kAuto, w)) continue;
    for (auto [name, spec] : models()) {
      spec.weight_dtype = w;
      SCOPED_TRACE(std::string(name) + ", " + dtype_name(w) + " weights");
      Model m = make(spec);
      Options o;
      o.max_tokens_per_step = 1 << 20;
      o.memory_bytes = int64_t{1} << 24;
      const std::vector<Request> reqs = at_once(trace());
      const Report batched = serve(m, reqs, o);
      // Room for every prompt in the first step: all run together.
      EXPECT_EQ(batched.peak_running, static_cast<int64_t>(reqs.size()));
      expect_same_outputs(batched, serve(m, reqs, alone(o)), "batched vs alone");
      ++tested;
    }
  }
  if (tested == 0) GTEST_SKIP() << "this GEMM's rows depend on their neighbours (docs/GEMM.md)";
}

// At one budget a smaller cache per token admits at least as many
// sequences: MQA >= GQA >= MHA, and paged >= static.
TEST(ServeEngine, SmallerCachesAdmitMore) {
  std::vector<Request> reqs;
  for (int i = 0; i < 24; ++i) reqs.push_back({0.0, 4 + (i * 7) % 19, 2 + (i * 5) % 9});
  Options o;
  o.page_size = 4;
  o.max_tokens_per_step = 64;
  // MHA (4 kv heads of 8, bf16, 2 layers) holds 64 tokens in this budget.
  o.memory_bytes = 64 * 4 * (8 + 8) * 2 * 2;
  int64_t previous = 0;
  for (int64_t kv_heads : {4, 2, 1}) {
    ModelSpec spec;
    spec.attention = gqa_config(kv_heads);
    spec.layers = 2;
    Model m = make(spec);
    Options paged = o, fixed = o;
    fixed.cache = CacheMode::kStatic;
    const Report p = serve(m, reqs, paged), s = serve(m, reqs, fixed);
    SCOPED_TRACE("kv heads " + std::to_string(kv_heads));
    EXPECT_GE(p.peak_running, previous);
    EXPECT_GE(p.peak_running, s.peak_running);
    EXPECT_GE(p.mean_running, s.mean_running);
    previous = p.peak_running;
  }
  EXPECT_GT(previous, 4);  // MQA runs many at once
}

TEST(ServeEngine, ImpossibleBudgetsAreRefused) {
  ModelSpec spec;
  spec.attention = gqa_config(2);
  Model m = make(spec);
  Options o;
  o.page_size = 4;
  const int64_t page = static_cast<int64_t>(m.new_pool(1, 4, o.kv_dtype)->page_nbytes());
  o.memory_bytes = 3 * page;  // 12 token slots
  const std::vector<Request> reqs = {{0.0, 4, 2}, {0.0, 10, 4}};
  const Status st = check_feasible(m, reqs, o);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("request 1 (10 prompt + 4 output tokens) needs 4 pages"),
            std::string::npos)
      << st.message();
  EXPECT_EQ(run(m, reqs, o).status().code(), StatusCode::kInvalidArgument);
  o.cache = CacheMode::kStatic;
  o.memory_bytes = 12 * page / 4;  // 12 slots < the longest request's 13
  EXPECT_NE(check_feasible(m, reqs, o).message().find("a static cache slot of 13 tokens"),
            std::string::npos)
      << check_feasible(m, reqs, o).message();
  o.max_seq_len = 8;
  EXPECT_NE(check_feasible(m, reqs, o).message().find("more than the static max_seq_len 8"),
            std::string::npos);
  EXPECT_EQ(check_feasible(m, {{{-1.0, 4, 2}}}, o).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(check_feasible(m, {{{0.0, 4, 0}}}, o).code(), StatusCode::kInvalidArgument);
}

// The engine serves the per-layer features its layers compute alone (gate,
// sinks, every qk-norm, NoPE with temperature tuning), batched or not to
// the same bits with the reference kernels.
TEST(ServeEngine, PerLayerFeaturesServe) {
  ModelSpec spec;
  spec.attention = gqa_config(2);
  spec.attention.output_gate = true;
  spec.attention.sinks = true;
  spec.attention.qk_norm = QkNorm::kRmsOnePlus;
  spec.layers = 2;
  ModelSpec nope = spec;
  nope.attention.qk_norm = QkNorm::kL2;
  nope.attention.use_rope = false;
  nope.attention.temperature_tuning = true;
  nope.attention.floor_scale = 4.0;
  for (const ModelSpec& s : {spec, nope}) {
    Model m = make(s);
    Options o;
    o.run.backend = Backend::kReference;
    o.page_size = 2;
    o.max_tokens_per_step = 7;
    o.memory_bytes = static_cast<int64_t>(m.new_pool(1, 2, o.kv_dtype)->page_nbytes()) * 64;
    const Report batched = serve(m, at_once(trace()), o);
    const Report one_by_one = serve(m, at_once(trace()), alone(o));
    expect_same_outputs(batched, one_by_one, "batched vs alone");
  }
}

// gpt-oss's stack: alternating sliding (window 4) and full layers with
// sinks and biases, its MoE after each; Llama 4's: chunked RoPE layers and
// a NoPE layer with temperature tuning. One pool without a window serves
// them (each layer passes its own), to the bits of each sequence alone.
std::vector<Named> mixed_stacks() {
  AttentionConfig sliding = gqa_config(2);
  sliding.model_type = "gpt_oss";
  sliding.sinks = true;
  sliding.qkv_bias = sliding.o_bias = true;
  sliding.sliding_window = 4;
  AttentionConfig full = sliding;
  full.sliding_window = 0;
  ModelSpec gpt_oss;
  gpt_oss.layers = 4;
  for (const AttentionConfig& c : {sliding, full, sliding, full})
    gpt_oss.stack.push_back({LayerKind::kAttention, c, {}});
  gpt_oss.ffn = true;
  gpt_oss.moe = moe_config();
  gpt_oss.moe.model_type = "gpt_oss";
  gpt_oss.moe.naming = MoeWeightNaming::kGptOss;
  gpt_oss.moe.router_bias = gpt_oss.moe.expert_bias = true;
  gpt_oss.moe.norm_topk_prob = true;
  gpt_oss.moe.activation = MoeActivation::kGptOssSwiGlu;
  gpt_oss.moe.swiglu_limit = 7.0;
  gpt_oss.weight_dtype = DType::kF32;
  AttentionConfig chunked = gqa_config(2);
  chunked.chunk_size = 8;
  AttentionConfig nope = gqa_config(2);
  nope.use_rope = false;
  nope.temperature_tuning = true;
  nope.floor_scale = 4.0;
  ModelSpec llama4;
  llama4.layers = 3;
  for (const AttentionConfig& c : {chunked, chunked, nope})
    llama4.stack.push_back({LayerKind::kAttention, c, {}});
  return {{"gpt-oss stack + its MoE", gpt_oss}, {"llama 4 stack", llama4}};
}

TEST(ServeEngine, MixedStacksServeEverySequenceAsAlone) {
  for (const auto& [name, spec] : mixed_stacks()) {
    SCOPED_TRACE(name);
    Model m = make(spec);
    EXPECT_FALSE(m.pool_releases_pages());  // windows / chunks differ: the pool has none
    Options o;
    o.run.backend = Backend::kReference;
    o.page_size = 2;
    o.max_tokens_per_step = 7;
    o.memory_bytes = static_cast<int64_t>(m.new_pool(1, 2, o.kv_dtype)->page_nbytes()) * 16;
    const std::vector<Request> reqs = at_once(trace());
    const Report tight = serve(m, reqs, o);
    for (const RequestReport& r : tight.requests) EXPECT_GT(r.finish_s, 0.0);
    EXPECT_GT(tight.peak_running, 1);
    EXPECT_GT(tight.preemptions, 0);
    expect_same_outputs(tight, serve(m, reqs, alone(o)), "tight pool vs alone");
  }
  // One chunk for every layer: the pool has it and releases pages.
  ModelSpec chunked;
  chunked.attention = gqa_config(2);
  chunked.attention.chunk_size = 8;
  chunked.layers = 2;
  Model m = make(chunked);
  EXPECT_TRUE(m.pool_releases_pages());
  Options o;
  o.run.backend = Backend::kReference;
  o.memory_bytes = int64_t{1} << 22;
  expect_same_outputs(serve(m, at_once(trace()), o), serve(m, at_once(trace()), alone(o)),
                      "chunked, batched vs alone");
}

GatedDeltaNetConfig gdn_config() {
  GatedDeltaNetConfig c;
  c.hidden_size = 32;
  c.num_k_heads = 2;
  c.num_v_heads = 4;
  c.key_head_dim = 8;
  c.value_head_dim = 8;
  c.conv_kernel = 4;
  return c;
}

// Qwen3-Next's pattern: three Gated DeltaNet layers, then a full layer of
// gated attention with qk-norm and partial RoPE.
ModelSpec hybrid_stack() {
  AttentionConfig full = gqa_config(1);
  full.output_gate = true;
  full.qk_norm = QkNorm::kRms;
  full.rope.rotary_dim = 4;  // partial RoPE: 4 of 8 dims
  ModelSpec spec;
  spec.layers = 4;
  for (int i = 0; i < 3; ++i) spec.stack.push_back({LayerKind::kLinearAttention, {}, gdn_config()});
  spec.stack.push_back({LayerKind::kAttention, full, {}});
  spec.weight_dtype = DType::kF32;
  return spec;
}

// Outputs within `rel` of the reference's magnitude: a Gated DeltaNet
// prompt split into other chunks keeps its f32 state between the calls at
// other points, so chunking changes the rounding, not the value.
void expect_close_outputs(const Report& got, const Report& want, double rel) {
  ASSERT_EQ(got.requests.size(), want.requests.size());
  for (size_t i = 0; i < got.requests.size(); ++i) {
    const auto& a = got.requests[i].outputs;
    const auto& b = want.requests[i].outputs;
    ASSERT_EQ(a.size(), b.size()) << "request " << i;
    double scale = 0, err = 0;
    for (size_t k = 0; k < a.size(); ++k) {
      scale = std::max(scale, std::abs(static_cast<double>(b[k])));
      err = std::max(err, std::abs(static_cast<double>(a[k]) - b[k]));
    }
    EXPECT_LE(err, rel * scale) << "request " << i;
  }
}

TEST(ServeEngine, HybridStackServesEverySequenceAsAloneAndCountsItsStates) {
  Model m = make(hybrid_stack());
  EXPECT_EQ(m.linear_layers(), 3);
  const int64_t state = 3 * (gdn_config().state_values() + gdn_config().conv_state_values()) * 4;
  EXPECT_EQ(m.state_bytes_per_sequence(), state);
  Options o;
  o.run.backend = Backend::kReference;
  o.page_size = 2;
  o.max_tokens_per_step = 7;
  const int64_t page = static_cast<int64_t>(m.new_pool(1, 2, o.kv_dtype)->page_nbytes());
  // Room for 3 sequences' states and 16 pages: states and pages compete.
  o.memory_bytes = 3 * state + 16 * page;
  const std::vector<Request> reqs = at_once(trace());
  const Report tight = serve(m, reqs, o);
  EXPECT_EQ(tight.state_bytes_per_sequence, state);
  for (const RequestReport& r : tight.requests) EXPECT_GT(r.finish_s, 0.0);
  EXPECT_GT(tight.peak_running, 1);
  EXPECT_LE(tight.peak_reserved_bytes, static_cast<double>(o.memory_bytes));
  // Unchunked prompts, batched: the same bits as alone (each sequence's
  // Gated DeltaNet rows are one forward() call on its slot either way).
  Options wide = o;
  wide.max_tokens_per_step = 1 << 20;
  wide.memory_bytes = int64_t{1} << 24;
  expect_same_outputs(serve(m, reqs, wide), serve(m, reqs, alone(o)), "batched vs alone");
  // Chunked prompts and recompute preemption: within rounding.
  expect_close_outputs(tight, serve(m, reqs, alone(o)), 1e-4);
  // A budget of one sequence's state and a page less than the longest
  // request needs is refused, naming the state.
  o.memory_bytes = state + 10 * page;
  const Status st = check_feasible(m, reqs, o);
  EXPECT_NE(st.message().find("besides one sequence's linear-attention state"), std::string::npos)
      << st.message();
}

TEST(ServeEngine, StacksItCannotServeAreRefusedByName) {
  ModelSpec only_linear = hybrid_stack();
  only_linear.layers = 3;
  only_linear.stack.pop_back();
  auto m = Model::create(only_linear);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("no attention layer"), std::string::npos);
  ModelSpec shapes = hybrid_stack();
  shapes.stack[0] = {LayerKind::kAttention, gqa_config(2), {}};
  m = Model::create(shapes);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("one pool holds them all"), std::string::npos)
      << m.status().message();
  ModelSpec count = hybrid_stack();
  count.layers = 2;
  m = Model::create(count);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("stack has 4 layers but layers = 2"), std::string::npos);
}

}  // namespace
}  // namespace attnkit::serve
