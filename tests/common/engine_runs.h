// Serving a trace through attnkit::Engine to the end and recording what
// each request got, for the engine tests over any StepModel: the
// synthetic fixture (tests/serve/engine_test.cc) and real checkpoints
// (tests/serve/model_engine_test.cc). Both compare runs bit for bit, so
// they share one way of recording them.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "attnkit/serve.h"
#include "attnkit/step_model.h"

namespace attnkit_test {

// What the engine gave each request: its tokens and, per token, the logits
// it was sampled from.
struct Served {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::vector<float>> logits;  // [tokens, vocab] per request
  attnkit::EngineStats stats;
};

// Every request added at once (a sequence's company then depends on the
// scheduler alone; arrival times are not used), stepped to the end; greedy
// sampling, with each logits row recorded: the sampler runs once per
// token, in the order of the step's outputs that carry one.
inline Served serve_all(attnkit::StepModel& m, const std::vector<attnkit::serve::Request>& reqs,
                        attnkit::EngineOptions o) {
  Served out;
  std::vector<std::vector<float>> rows;
  o.sample = [&rows](std::span<const float> logits) {
    rows.emplace_back(logits.begin(), logits.end());
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  };
  auto e = attnkit::Engine::create(m, o);
  EXPECT_TRUE(e.ok()) << e.status().to_string();
  if (!e.ok()) return out;
  out.tokens.resize(reqs.size());
  out.logits.resize(reqs.size());
  for (const attnkit::serve::Request& r : reqs) {
    auto id = e->add_request(r.prompt_token_ids, r.output_tokens);
    EXPECT_TRUE(id.ok()) << id.status().to_string();
  }
  while (e->has_unfinished()) {
    rows.clear();
    auto step = e->step();
    EXPECT_TRUE(step.ok()) << step.status().to_string();
    if (!step.ok()) return out;
    size_t k = 0;
    for (const attnkit::StepOutput& s : *step)
      for (int32_t t : s.new_token_ids) {
        const auto r = static_cast<size_t>(s.request_id);
        out.tokens[r].push_back(t);
        out.logits[r].insert(out.logits[r].end(), rows[k].begin(), rows[k].end());
        ++k;
      }
    EXPECT_EQ(k, rows.size());
  }
  out.stats = e->stats();
  return out;
}

// The same for prompts that all want `output_tokens` tokens.
inline Served serve_all(attnkit::StepModel& m, const std::vector<std::vector<int32_t>>& prompts,
                        int64_t output_tokens, const attnkit::EngineOptions& o) {
  std::vector<attnkit::serve::Request> reqs;
  for (const std::vector<int32_t>& p : prompts) {
    reqs.emplace_back();
    reqs.back().prompt_token_ids = p;
    reqs.back().output_tokens = output_tokens;
  }
  return serve_all(m, reqs, o);
}

// The same tokens, and logits equal to the bit.
inline void expect_same(const Served& got, const Served& want, const std::string& what) {
  ASSERT_EQ(got.tokens.size(), want.tokens.size());
  for (size_t i = 0; i < got.tokens.size(); ++i) {
    EXPECT_EQ(got.tokens[i], want.tokens[i]) << what << ", request " << i;
    const auto& a = got.logits[i];
    const auto& b = want.logits[i];
    ASSERT_EQ(a.size(), b.size()) << what << ", request " << i;
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)))
        << what << ", request " << i;
  }
}

}  // namespace attnkit_test
