// serve::run: an Engine driven through a trace of timed requests, the
// measurement behind `attnkit serve-bench`; and the synthetic traces.
#include <algorithm>
#include <cmath>
#include <functional>
#include <queue>
#include <string>
#include <utility>

#include "attnkit/serve.h"

namespace attnkit::serve {
namespace {

uint64_t mix(uint64_t z) {  // splitmix64's finaliser
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Token `position` of the stream (kind, a, b): a seeded hash below vocab.
int32_t token(const TraceOptions& o, uint64_t kind, int64_t a, int64_t b, int64_t position) {
  const uint64_t key =
      mix(o.seed * 0x100000001B3ull + kind * 0xD6E8FEB86659FD93ull +
          static_cast<uint64_t>(a) * 0x9E3779B97F4A7C15ull +
          static_cast<uint64_t>(b) * 0xC2B2AE3D27D4EB4Full + static_cast<uint64_t>(position));
  return static_cast<int32_t>(key % static_cast<uint64_t>(std::max<int64_t>(o.vocab_size, 1)));
}

}  // namespace

std::vector<int64_t> prompt_lengths(std::span<const Request> requests) {
  std::vector<int64_t> out(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    const Request& r = requests[i];
    out[i] = static_cast<int64_t>(r.prompt_token_ids.size());
    if (r.continues && r.after >= 0 && static_cast<size_t>(r.after) < i)
      out[i] +=
          out[static_cast<size_t>(r.after)] + requests[static_cast<size_t>(r.after)].output_tokens;
  }
  return out;
}

std::vector<Request> synthetic_trace(const TraceOptions& o) {
  uint64_t state = mix(o.seed * 0xD1B54A32D192ED03ull + 17);
  const auto uniform01 = [&state] {  // in (0, 1]
    state += 0x9E3779B97F4A7C15ull;
    return (static_cast<double>(mix(state) >> 11) + 1.0) * 0x1.0p-53;
  };
  const auto between = [&](int64_t lo, int64_t hi) {
    const double span = static_cast<double>(hi - lo + 1);
    return lo + std::min(hi - lo, static_cast<int64_t>(uniform01() * span));
  };
  const int64_t groups = std::max<int64_t>(o.prefix_groups, 1);
  std::vector<Request> out;
  double t = 0.0;
  for (int64_t c = 0; c < o.requests; ++c) {
    if (std::isfinite(o.rate)) t += -std::log(uniform01()) / o.rate;  // exponential gaps
    for (int64_t k = 0; k < std::max<int64_t>(o.turns, 1); ++k) {
      Request r;
      r.arrival_s = k == 0 ? t : 0.0;
      const int64_t own = between(o.prompt_min, o.prompt_max);
      r.output_tokens = between(o.output_min, o.output_max);
      if (k == 0)
        for (int64_t p = 0; p < o.shared_prefix; ++p)
          r.prompt_token_ids.push_back(token(o, 1, c % groups, 0, p));
      for (int64_t p = 0; p < own; ++p) r.prompt_token_ids.push_back(token(o, 2, c, k, p));
      if (k > 0) {
        r.after = static_cast<int64_t>(out.size()) - 1;
        r.continues = true;
      }
      out.push_back(std::move(r));
    }
  }
  return out;
}

EngineOptions options_for_trace(EngineOptions options, std::span<const Request> requests) {
  if (options.cache != CacheMode::kStatic || options.max_seq_len > 0) return options;
  const std::vector<int64_t> lengths = prompt_lengths(requests);
  int64_t longest = 1;
  for (size_t i = 0; i < requests.size(); ++i)
    longest = std::max(longest, lengths[i] + requests[i].output_tokens - 1);
  options.max_seq_len = longest;
  return options;
}

Status check_feasible(const StepModel& model, std::span<const Request> requests,
                      const EngineOptions& options) {
  const EngineOptions o = options_for_trace(options, requests);
  const std::vector<int64_t> lengths = prompt_lengths(requests);
  const int64_t vocab = model.vocab_size();
  ATTNKIT_ASSIGN_OR_RETURN(const EngineBudget b, Engine::plan_budget(model, o));
  const std::string memory = std::to_string(o.kv_memory) + " bytes";
  for (size_t i = 0; i < requests.size(); ++i) {
    const Request& r = requests[i];
    const std::string what = "request " + std::to_string(i);
    if (!(r.arrival_s >= 0.0) || !std::isfinite(r.arrival_s) || r.output_tokens < 1 ||
        r.prompt_token_ids.empty())
      return invalid_argument(what + ": arrival_s " + std::to_string(r.arrival_s) + ", " +
                              std::to_string(r.prompt_token_ids.size()) +
                              " prompt tokens, output_tokens " + std::to_string(r.output_tokens) +
                              ": arrival must be finite and >= 0, token counts >= 1");
    if (r.after >= static_cast<int64_t>(i) || r.after < -1 || (r.continues && r.after < 0))
      return invalid_argument(what + ": after = " + std::to_string(r.after) +
                              " must name an earlier request (or be -1 without continues)");
    for (int32_t t : r.prompt_token_ids)
      if (t < 0 || t >= vocab)
        return invalid_argument(what + ": prompt token " + std::to_string(t) +
                                " is outside the model's vocabulary [0, " + std::to_string(vocab) +
                                ")");
    const int64_t need = lengths[i] + r.output_tokens - 1;
    const std::string sizes = what + " (" + std::to_string(lengths[i]) + " prompt + " +
                              std::to_string(r.output_tokens) + " output tokens)";
    if (o.cache == CacheMode::kPaged && (need + o.page_size - 1) / o.page_size > b.pages)
      return invalid_argument(
          sizes + " needs " + std::to_string((need + o.page_size - 1) / o.page_size) +
          " pages of " + std::to_string(o.page_size) + " tokens (" + std::to_string(b.page_bytes) +
          " bytes each), but the budget of " + memory + " holds " + std::to_string(b.pages) +
          (b.state_bytes > 0 ? " besides one sequence's linear-attention state of " +
                                   std::to_string(b.state_bytes) + " bytes"
                             : std::string()));
    if (o.cache == CacheMode::kStatic && need > b.max_seq_len)
      return invalid_argument(sizes + " needs " + std::to_string(need) +
                              " token slots, more than the static max_seq_len " +
                              std::to_string(b.max_seq_len));
  }
  if (o.cache == CacheMode::kStatic && b.slots < 1)
    return invalid_argument("a static cache slot of " + std::to_string(b.max_seq_len) +
                            " tokens needs " +
                            std::to_string(b.max_seq_len * b.bytes_per_token + b.state_bytes) +
                            " bytes, more than the budget of " + memory);
  return Status::Ok();
}

Result<Report> run(StepModel& model, std::span<const Request> requests,
                   const EngineOptions& options,
                   const std::function<void(int64_t, int64_t)>& on_progress) {
  ATTNKIT_RETURN_IF_ERROR(check_feasible(model, requests, options));
  const EngineOptions o = options_for_trace(options, requests);
  ATTNKIT_ASSIGN_OR_RETURN(Engine e, Engine::create(model, o));
  const int64_t n = static_cast<int64_t>(requests.size());
  Report rep;
  rep.requests.resize(requests.size());
  std::vector<std::vector<int64_t>> followers(requests.size());
  // Arrived-or-not requests whose predecessor finished: (arrival, index),
  // earliest first, trace order among equals.
  using Due = std::pair<double, int64_t>;
  std::priority_queue<Due, std::vector<Due>, std::greater<>> due;
  for (int64_t i = 0; i < n; ++i) {
    const Request& r = requests[static_cast<size_t>(i)];
    if (r.after < 0)
      due.push({r.arrival_s, i});
    else
      followers[static_cast<size_t>(r.after)].push_back(i);
  }
  if (!due.empty()) {
    rep.start_s = due.top().first;
    e.advance_clock(rep.start_s);
  }
  std::vector<int64_t> trace_index;  // by engine request id
  // The whole prompts of the requests others continue.
  std::vector<std::vector<int32_t>> full_prompts(requests.size());
  std::vector<int32_t> prompt;
  int64_t finished = 0;
  while (finished < n) {
    while (!due.empty() && due.top().first <= e.clock_s()) {
      const auto [arrival, i] = due.top();
      due.pop();
      const Request& r = requests[static_cast<size_t>(i)];
      prompt.clear();
      if (r.continues) {
        // The conversation so far: after's whole prompt, then its tokens.
        const size_t a = static_cast<size_t>(r.after);
        prompt = full_prompts[a];
        prompt.insert(prompt.end(), rep.requests[a].token_ids.begin(),
                      rep.requests[a].token_ids.end());
      }
      prompt.insert(prompt.end(), r.prompt_token_ids.begin(), r.prompt_token_ids.end());
      if (!followers[static_cast<size_t>(i)].empty()) full_prompts[static_cast<size_t>(i)] = prompt;
      ATTNKIT_RETURN_IF_ERROR(e.add_request(prompt, r.output_tokens, {}, arrival).status());
      trace_index.push_back(i);
    }
    if (!e.has_unfinished()) {
      if (due.empty()) return internal_error("serve::run: requests wait on none that runs");
      e.advance_clock(due.top().first);  // idle: jump to the next arrival
      continue;
    }
    ATTNKIT_ASSIGN_OR_RETURN(const std::vector<StepOutput> outs, e.step());
    int64_t done = 0;
    for (const StepOutput& s : outs) {
      const int64_t i = trace_index[static_cast<size_t>(s.request_id)];
      RequestReport& rr = rep.requests[static_cast<size_t>(i)];
      rr.token_ids.insert(rr.token_ids.end(), s.new_token_ids.begin(), s.new_token_ids.end());
      if (!s.finished) continue;
      rr.status = s.status;
      ATTNKIT_ASSIGN_OR_RETURN(rr.metrics, e.metrics(s.request_id));
      for (int64_t f : followers[static_cast<size_t>(i)])
        due.push({rr.metrics.finish_s + requests[static_cast<size_t>(f)].arrival_s, f});
      ++done;
    }
    finished += done;
    if (on_progress && done > 0) on_progress(finished, n);
  }
  rep.stats = e.stats();
  rep.end_s = e.clock_s();
  const EngineStats& st = rep.stats;
  if (st.busy_s > 0) {
    rep.mean_running = st.running_s / st.busy_s;
    rep.mean_used_bytes = st.used_byte_s / st.busy_s;
    rep.mean_reserved_bytes = st.reserved_byte_s / st.busy_s;
  }
  rep.kv_bytes_per_token = e.budget().bytes_per_token;
  rep.state_bytes_per_sequence = e.budget().state_bytes;
  rep.pool_releases_pages = model.pool_releases_pages();
  rep.pool_pages = e.budget().pages;
  rep.max_running = o.cache == CacheMode::kStatic ? e.budget().slots : 0;
  rep.max_seq_len = o.cache == CacheMode::kStatic ? o.max_seq_len : 0;
  rep.prefix_hit_rate = st.prompt_tokens_admitted > 0
                            ? static_cast<double>(st.prompt_tokens_cached) /
                                  static_cast<double>(st.prompt_tokens_admitted)
                            : 0.0;
  return rep;
}

}  // namespace attnkit::serve
