// Decode throughput of attnkit::Model over the paged pool, as the serving
// engine drives it: `seqs` sequences each prefilled with `context` random
// tokens in one step, then `steps` decode steps of one token per sequence
// (Model::forward_step). Prints the median step time and the last-token
// logits per second (seqs / step). Public API only.
//
//   build/bench/model_step_bench DIR [seqs=16] [context=128] [steps=5] [kv=bf16|f32]
//
// DIR is a checkpoint directory (scripts/model_bench.py writes random ones).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "attnkit/model.h"

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int fail(const attnkit::Status& st) {
  std::fprintf(stderr, "model_step_bench: %s\n", st.message().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace attnkit;
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: model_step_bench DIR [seqs=16] [context=128] [steps=5] [kv=bf16|f32]\n");
    return 2;
  }
  const int64_t seqs = argc > 2 ? std::atoll(argv[2]) : 16;
  const int64_t context = argc > 3 ? std::atoll(argv[3]) : 128;
  const int64_t steps = argc > 4 ? std::atoll(argv[4]) : 5;
  const DType kv = argc > 5 && std::string(argv[5]) == "f32" ? DType::kF32 : DType::kBF16;
  if (seqs < 1 || context < 1 || steps < 1) {
    std::fprintf(stderr, "model_step_bench: seqs, context and steps must be >= 1\n");
    return 2;
  }
  const double t0 = now_s();
  auto model = Model::from_pretrained(argv[1]);
  if (!model.ok()) return fail(model.status());
  const double load_s = now_s() - t0;
  constexpr int64_t kPage = 16;
  auto pool = model->new_pool(seqs * ((context + steps + kPage - 1) / kPage), kPage, kv, false);
  auto states = model->new_state_pool(0);
  if (!pool.ok()) return fail(pool.status());
  if (!states.ok()) return fail(states.status());
  std::vector<int64_t> ids(static_cast<size_t>(seqs));
  for (int64_t& id : ids) {
    id = pool->add_sequence();
    // Linear-attention layers (Qwen3-Next) keep a state slot under the same id.
    if (Status st = states->add_sequence(id); !st.ok()) return fail(st);
  }
  std::mt19937 rng(1);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(model->vocab_size() - 1));
  std::vector<float> logits(static_cast<size_t>(seqs * model->vocab_size()));
  // One step of n tokens per sequence; returns its seconds (or < 0 on error).
  auto step = [&](int64_t n) -> double {
    std::vector<int32_t> tokens(static_cast<size_t>(seqs * n)), cu(static_cast<size_t>(seqs + 1));
    for (int32_t& t : tokens) t = token(rng);
    for (int64_t s = 0; s <= seqs; ++s) cu[static_cast<size_t>(s)] = static_cast<int32_t>(s * n);
    const double start = now_s();
    Status st = pool->append(ids, std::vector<int64_t>(static_cast<size_t>(seqs), n));
    if (st.ok()) st = model->forward_step(tokens, cu, ids, *pool, *states, logits, {});
    if (!st.ok()) {
      fail(st);
      return -1.0;
    }
    return now_s() - start;
  };
  const double prefill_s = step(context);
  if (prefill_s < 0) return 1;
  std::vector<double> decode;
  for (int64_t i = 0; i < steps; ++i) {
    const double s = step(1);
    if (s < 0) return 1;
    decode.push_back(s);
  }
  std::sort(decode.begin(), decode.end());
  const double median = decode[decode.size() / 2];
  std::printf(
      "{\"dir\": \"%s\", \"layers\": %lld, \"weight_bytes\": %zu, \"kv\": \"%s\", \"seqs\": %lld, "
      "\"context\": %lld, \"load_s\": %.3f, \"prefill_s\": %.3f, \"prefill_tokens_per_s\": %.1f, "
      "\"decode_step_s\": %.4f, \"decode_logits_per_s\": %.1f}\n",
      argv[1], static_cast<long long>(model->num_layers()), model->weight_bytes(),
      kv == DType::kBF16 ? "bf16" : "f32", static_cast<long long>(seqs),
      static_cast<long long>(context), load_s, prefill_s,
      static_cast<double>(seqs * context) / prefill_s, median, static_cast<double>(seqs) / median);
  return 0;
}
