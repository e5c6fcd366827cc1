// Engine: the scheduler of attnkit/serve.h over one paged pool and the
// linear layers' state slots. docs/SERVING.md describes each decision.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <utility>

#include "attnkit/serve.h"

namespace attnkit {
namespace {

// Free pages kept back from admissions while others run (vLLM's 1 %).
constexpr double kWatermark = 0.01;

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The KV pages and the linear layers' state slots share kv_memory: a
// running sequence costs its pages and state_bytes. The pool has the pages
// the budget holds beside one sequence's state; while n sequences run, at
// most this many of them may be in use.
int64_t pages_for(const EngineBudget& b, int64_t memory, int64_t running) {
  return std::clamp<int64_t>((memory - running * b.state_bytes) / b.page_bytes, 0, b.pages);
}

Result<EngineBudget> budget_for(const StepModel& model, const EngineOptions& o) {
  const auto bad = [](const std::string& what) {
    return invalid_argument("Engine::create: " + what);
  };
  if (o.page_size < 1) return bad("page_size = " + std::to_string(o.page_size) + " must be >= 1");
  if (o.kv_memory < 1) return bad("kv_memory = " + std::to_string(o.kv_memory) + " must be >= 1");
  if (o.max_tokens_per_step < 1)
    return bad("max_tokens_per_step = " + std::to_string(o.max_tokens_per_step) + " must be >= 1");
  if (o.max_seqs < 1) return bad("max_seqs = " + std::to_string(o.max_seqs) + " must be >= 1");
  if (o.cache == CacheMode::kStatic && o.max_seq_len < 1)
    return bad("max_seq_len = " + std::to_string(o.max_seq_len) +
               " must be >= 1 with the static cache (the slots each sequence reserves)");
  if (o.cache == CacheMode::kStatic && o.prefix_caching)
    return bad("prefix_caching needs the paged cache, not the static one");
  if (o.prefix_caching && model.state_bytes_per_sequence() > 0)
    return bad(
        "prefix_caching with linear-attention layers: a cached prefix of pages cannot restore "
        "their per-sequence state");
  // One page of a one-page pool gives the per-page bytes of every layer.
  ATTNKIT_ASSIGN_OR_RETURN(PagedKVCache probe, model.new_pool(1, o.page_size, o.kv_dtype, false));
  EngineBudget b;
  b.page_bytes = static_cast<int64_t>(probe.page_nbytes());
  b.bytes_per_token = b.page_bytes / o.page_size;
  b.state_bytes = model.state_bytes_per_sequence();
  if (o.cache == CacheMode::kPaged) {
    b.pages = std::max<int64_t>(0, (o.kv_memory - b.state_bytes) / b.page_bytes);
    return b;
  }
  b.max_seq_len = o.max_seq_len;
  b.slots = o.kv_memory / (b.max_seq_len * b.bytes_per_token + b.state_bytes);
  b.pages = b.slots * ceil_div(b.max_seq_len, o.page_size);
  return b;
}

Status check_sizes(const EngineBudget& b, const EngineOptions& o, int64_t prompt,
                   int64_t max_tokens) {
  const std::string fn = "Engine::add_request: ";
  if (prompt < 1) return invalid_argument(fn + "prompt_token_ids is empty; it needs >= 1 token");
  if (max_tokens < 1 || max_tokens > (int64_t{1} << 40))
    return invalid_argument(fn + "max_tokens = " + std::to_string(max_tokens) +
                            " must be >= 1 and <= 2^40");
  // Its last token is never fed back, so it needs no slot.
  const int64_t need = prompt + max_tokens - 1;
  const std::string what = std::to_string(prompt) + " prompt tokens + max_tokens " +
                           std::to_string(max_tokens) + " - 1 = " + std::to_string(need) +
                           " token slots";
  const std::string memory = std::to_string(o.kv_memory) + " bytes";
  if (o.cache == CacheMode::kPaged && ceil_div(need, o.page_size) > b.pages)
    return invalid_argument(
        fn + what + " need " + std::to_string(ceil_div(need, o.page_size)) + " pages of " +
        std::to_string(o.page_size) + " tokens (" + std::to_string(b.page_bytes) +
        " bytes each), but kv_memory = " + memory + " holds " + std::to_string(b.pages) +
        (b.state_bytes > 0 ? " besides one sequence's linear-attention state of " +
                                 std::to_string(b.state_bytes) + " bytes"
                           : std::string()));
  if (o.cache == CacheMode::kStatic && need > b.max_seq_len)
    return invalid_argument(fn + what + " are more than the static max_seq_len " +
                            std::to_string(b.max_seq_len));
  return Status::Ok();
}

}  // namespace

// Per request: where it stands.
struct Engine::Req {
  std::vector<int32_t> tokens;  // the prompt, then the generated tokens
  int64_t prompt = 0, max_tokens = 0;
  int64_t pool_id = -1;  // -1 = not in the pool
  int64_t computed = 0;  // tokens whose K/V the pool holds
  bool finished = false;
  EventCallback on_event;
  RequestMetrics m;
  Status status;
};

Engine::Engine(Engine&&) noexcept = default;
Engine& Engine::operator=(Engine&&) noexcept = default;
Engine::~Engine() = default;

Engine::Req& Engine::req(int64_t id) { return reqs_[static_cast<size_t>(id)]; }

Result<EngineBudget> Engine::plan_budget(const StepModel& model, const EngineOptions& options) {
  return budget_for(model, options);
}

Result<Engine> Engine::create(StepModel& model, const EngineOptions& options) {
  ATTNKIT_ASSIGN_OR_RETURN(const EngineBudget b, budget_for(model, options));
  if (options.cache == CacheMode::kPaged && b.pages < 1)
    return invalid_argument("Engine::create: kv_memory = " + std::to_string(options.kv_memory) +
                            " bytes holds no page of " + std::to_string(b.page_bytes) + " bytes" +
                            (b.state_bytes > 0
                                 ? " beside one sequence's linear-attention state of " +
                                       std::to_string(b.state_bytes) + " bytes"
                                 : std::string()));
  if (options.cache == CacheMode::kStatic && b.slots < 1)
    return invalid_argument(
        "Engine::create: a static cache slot of " + std::to_string(b.max_seq_len) +
        " tokens needs " + std::to_string(b.max_seq_len * b.bytes_per_token + b.state_bytes) +
        " bytes, more than kv_memory = " + std::to_string(options.kv_memory) + " bytes");
  Engine e;
  e.model_ = &model;
  e.options_ = options;
  e.vocab_ = model.vocab_size();
  e.budget_ = b;
  ATTNKIT_ASSIGN_OR_RETURN(
      PagedKVCache pool,
      model.new_pool(b.pages, options.page_size, options.kv_dtype, options.prefix_caching));
  ATTNKIT_ASSIGN_OR_RETURN(LinearStatePool states, model.new_state_pool(0));
  pool.set_batch_invariant(options.batch_invariant);
  e.pool_.emplace(std::move(pool));
  e.states_.emplace(std::move(states));
  return e;
}

Result<int64_t> Engine::add_request(std::span<const int32_t> prompt_token_ids, int64_t max_tokens,
                                    EventCallback on_event, std::optional<double> arrival_s) {
  ATTNKIT_RETURN_IF_ERROR(
      check_sizes(budget_, options_, static_cast<int64_t>(prompt_token_ids.size()), max_tokens));
  for (size_t i = 0; i < prompt_token_ids.size(); ++i)
    if (prompt_token_ids[i] < 0 || prompt_token_ids[i] >= vocab_)
      return invalid_argument("Engine::add_request: prompt_token_ids[" + std::to_string(i) +
                              "] = " + std::to_string(prompt_token_ids[i]) +
                              " is outside the model's vocabulary [0, " + std::to_string(vocab_) +
                              ")");
  const double arrival = arrival_s.value_or(clock_);
  if (!std::isfinite(arrival) || arrival < 0 || arrival > clock_)
    return invalid_argument("Engine::add_request: arrival_s = " + std::to_string(arrival) +
                            " must be finite, >= 0 and <= the clock " + std::to_string(clock_));
  Req r;
  r.tokens.assign(prompt_token_ids.begin(), prompt_token_ids.end());
  r.prompt = static_cast<int64_t>(prompt_token_ids.size());
  r.max_tokens = max_tokens;
  r.on_event = std::move(on_event);
  r.m.arrival_s = arrival;
  r.m.prompt_tokens = r.prompt;
  const int64_t id = static_cast<int64_t>(reqs_.size());
  reqs_.push_back(std::move(r));
  waiting_.push_back(id);
  return id;
}

void Engine::advance_clock(double t) {
  if (t > clock_) clock_ = t;
}

Result<RequestMetrics> Engine::metrics(int64_t request_id) const {
  if (request_id < 0 || request_id >= static_cast<int64_t>(reqs_.size()))
    return invalid_argument("Engine::metrics: request_id = " + std::to_string(request_id) +
                            " is not a request of this engine (0 ... " +
                            std::to_string(static_cast<int64_t>(reqs_.size()) - 1) + ")");
  return reqs_[static_cast<size_t>(request_id)].m;
}

int64_t Engine::known(int64_t id) const {
  return static_cast<int64_t>(reqs_[static_cast<size_t>(id)].tokens.size());
}

// Pages the sequences may use while `running` of them hold state.
int64_t Engine::free_pages(int64_t running) const {
  return std::min(pool_->free_pages(),
                  pages_for(budget_, options_.kv_memory, running) - pool_->pages_in_use());
}

// Reserves `want` more token slots of id (all or nothing):
// kResourceExhausted when the pool, or the budget left beside the running
// sequences' states, has too few pages.
Status Engine::reserve(int64_t id, int64_t want) {
  const int64_t pid = req(id).pool_id;
  // kStatic: the pool holds exactly the slots' pages, whose states were
  // counted in budget_.slots.
  if (budget_.state_bytes > 0 && options_.cache == CacheMode::kPaged) {
    ATTNKIT_ASSIGN_OR_RETURN(const int64_t held, pool_->length(pid));
    const int64_t ps = options_.page_size;
    const int64_t extra = ceil_div(held + want, ps) - ceil_div(held, ps);
    if (extra > free_pages(static_cast<int64_t>(running_.size())))
      return resource_exhausted("Engine: the budget beside the states holds no more pages");
  }
  const std::span<const int64_t> ids(&pid, 1), counts(&want, 1);
  if (!options_.prefix_caching) return pool_->append(ids, counts);
  // The new tokens' ids, so that their pages are keyed once full.
  const Req& r = req(id);
  return pool_->append(ids, counts,
                       std::span<const int32_t>(r.tokens).subspan(static_cast<size_t>(r.computed),
                                                                  static_cast<size_t>(want)));
}

// id joins the pool and, with linear layers, the state slots (same id).
// With prefix caching it takes over the longest cached prefix of what it
// knows (computed starts there).
Status Engine::enter(int64_t id) {
  Req& r = req(id);
  if (options_.prefix_caching) {
    ATTNKIT_ASSIGN_OR_RETURN(const PrefixMatch m, pool_->add_sequence(r.tokens));
    r.pool_id = m.seq_id;
    r.computed = m.cached_tokens;
  } else {
    r.pool_id = pool_->add_sequence();
  }
  if (states_->num_layers() == 0) return Status::Ok();
  const Status st = states_->add_sequence(r.pool_id);
  if (!st.ok()) {
    (void)pool_->remove(r.pool_id);
    r.pool_id = -1;
    r.computed = 0;
  }
  return st;
}

// id's pages and state slot are freed.
void Engine::leave(int64_t id) {
  Req& r = req(id);
  (void)pool_->remove(r.pool_id);  // the id is in the pool: cannot fail
  if (states_->num_layers() > 0) (void)states_->remove(r.pool_id);
  r.pool_id = -1;
}

void Engine::preempt(int64_t id) {
  leave(id);
  req(id).computed = 0;
  ++req(id).m.preemptions;
  ++stats_.preemptions;
  waiting_.push_front(id);
}

// Running sequences, oldest first, get their next tokens; when the pool is
// out of pages the most recently admitted one is preempted.
Status Engine::schedule_running(int64_t& budget, bool& preempted) {
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    const int64_t id = running_[i];
    const int64_t want = std::min(known(id) - req(id).computed, budget);
    Status st = reserve(id, want);
    while (!st.ok() && st.code() == StatusCode::kResourceExhausted && running_.back() != id) {
      preempt(running_.back());
      running_.pop_back();
      preempted = true;
      st = reserve(id, want);
    }
    if (!st.ok()) {
      if (st.code() != StatusCode::kResourceExhausted)
        return Status(st.code(), "Engine::step: append: " + st.message());
      // It is the most recent running sequence itself: it waits.
      preempt(id);
      running_.pop_back();
      preempted = true;
      break;
    }
    scheduled_.push_back(id);
    counts_.push_back(want);
    budget -= want;
    ++i;
  }
  return Status::Ok();
}

// Waiting requests are admitted in order while the token budget, max_seqs
// and the pool (with the prompt pages promised to the running sequences,
// and the watermark) allow.
Status Engine::admit(int64_t& budget) {
  const int64_t ps = options_.page_size;
  const int64_t watermark =
      static_cast<int64_t>(std::ceil(kWatermark * static_cast<double>(budget_.pages)));
  int64_t promised = 0;
  for (int64_t id : running_) {
    ATTNKIT_ASSIGN_OR_RETURN(const int64_t held, pool_->length(req(id).pool_id));
    promised += ceil_div(known(id), ps) - ceil_div(held, ps);
  }
  while (budget > 0 && !waiting_.empty() &&
         static_cast<int64_t>(running_.size()) < options_.max_seqs) {
    const int64_t id = waiting_.front();
    const int64_t total = ceil_div(known(id), ps);
    // New pages it needs: all of them, less the cached prefix it would take
    // over; taking cached-free pages lowers the free count by as many.
    int64_t need = total, taken_free = 0;
    if (options_.prefix_caching) {
      ATTNKIT_ASSIGN_OR_RETURN(const PrefixProbe probe, pool_->probe_prefix(req(id).tokens));
      need -= probe.cached_tokens / ps;
      taken_free = probe.cached_free_pages;
    }
    const int64_t n = static_cast<int64_t>(running_.size());
    if (options_.cache == CacheMode::kStatic) {
      if (n >= budget_.slots) break;
    } else if (free_pages(n + 1) - taken_free - promised - need <
               (running_.empty() ? 0 : watermark)) {
      break;
    }
    if (!enter(id).ok()) break;
    Req& r = req(id);
    // A prefix taken from the cache is not computed again.
    const int64_t cached = r.computed;
    const int64_t want = std::min(known(id) - cached, budget);
    running_.push_back(id);
    if (!reserve(id, want).ok()) {
      running_.pop_back();
      leave(id);
      r.computed = 0;
      break;
    }
    waiting_.pop_front();
    if (r.m.admitted_s < 0) r.m.admitted_s = clock_;
    stats_.prompt_tokens_admitted += r.prompt;
    stats_.prompt_tokens_cached += std::min(cached, r.prompt);
    r.m.cached_tokens += cached;
    scheduled_.push_back(id);
    counts_.push_back(want);
    budget -= want;
    promised += total - ceil_div(cached + want, ps);
  }
  return Status::Ok();
}

// One forward pass over every scheduled token.
Status Engine::forward() {
  tokens_.clear();
  cu_.assign(1, 0);
  ids_.clear();
  for (size_t k = 0; k < scheduled_.size(); ++k) {
    const Req& r = req(scheduled_[k]);
    const auto first = r.tokens.begin() + r.computed;
    tokens_.insert(tokens_.end(), first, first + counts_[k]);
    stats_.prompt_tokens_computed += std::clamp<int64_t>(r.prompt - r.computed, 0, counts_[k]);
    cu_.push_back(cu_.back() + static_cast<int32_t>(counts_[k]));
    ids_.push_back(r.pool_id);
  }
  logits_.resize(scheduled_.size() * static_cast<size_t>(vocab_));
  stats_.tokens_computed += static_cast<int64_t>(tokens_.size());
  const double t0 = now_s();
  const Status st =
      model_->forward_step(tokens_, cu_, ids_, *pool_, *states_, logits_, options_.run);
  stats_.forward_s += now_s() - t0;
  return st;
}

// Tokens and events, then finished requests leave.
void Engine::collect(double dt, std::vector<StepOutput>& out) {
  std::vector<int64_t> done;
  for (size_t k = 0; k < scheduled_.size(); ++k) {
    const int64_t id = scheduled_[k];
    Req& r = req(id);
    r.computed += counts_[k];
    StepOutput o;
    o.request_id = id;
    if (r.computed == known(id)) {
      const std::span<const float> row(logits_.data() + k * static_cast<size_t>(vocab_),
                                       static_cast<size_t>(vocab_));
      const int32_t t =
          options_.sample
              ? options_.sample(row)
              : static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
      const auto emit = [&](RequestEvent::Kind kind, int32_t token) {
        if (r.on_event) r.on_event({kind, id, token, clock_});
      };
      if (t < 0 || t >= vocab_) {
        r.status = invalid_argument("Engine::step: sample returned token " + std::to_string(t) +
                                    " for request " + std::to_string(id) +
                                    ", outside the vocabulary [0, " + std::to_string(vocab_) + ")");
        o.status = r.status;
        o.finished = true;
      } else {
        if (r.m.first_token_s < 0) {
          r.m.first_token_s = clock_;
          emit(RequestEvent::Kind::kFirstToken, -1);
        }
        r.tokens.push_back(t);
        ++r.m.output_tokens;
        o.new_token_ids.push_back(t);
        emit(RequestEvent::Kind::kToken, t);
        o.finished = r.m.output_tokens == r.max_tokens;
      }
      if (o.finished) {
        r.m.finish_s = clock_;
        emit(RequestEvent::Kind::kFinish, -1);
        done.push_back(id);
      }
    }
    out.push_back(std::move(o));
  }
  account(dt);
  for (int64_t id : done) {
    Req& r = req(id);
    leave(id);
    r.finished = true;
    std::vector<int32_t>().swap(r.tokens);
    r.on_event = nullptr;
    running_.erase(std::find(running_.begin(), running_.end(), id));
  }
}

// The step's memory and concurrency, weighted by its time.
void Engine::account(double dt) {
  int64_t used_tokens = 0;
  for (int64_t id : running_) used_tokens += req(id).computed;
  const int64_t n = static_cast<int64_t>(running_.size());
  const double states = static_cast<double>(n * budget_.state_bytes);
  const double used = static_cast<double>(used_tokens * budget_.bytes_per_token) + states;
  const double reserved =
      states + (options_.cache == CacheMode::kStatic
                    ? static_cast<double>(n * options_.max_seq_len * budget_.bytes_per_token)
                    : static_cast<double>(pool_->pages_in_use() * budget_.page_bytes));
  const int64_t in_step = static_cast<int64_t>(scheduled_.size());
  stats_.peak_running = std::max(stats_.peak_running, in_step);
  stats_.peak_used_bytes = std::max(stats_.peak_used_bytes, used);
  stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, reserved);
  stats_.running_s += static_cast<double>(in_step) * dt;
  stats_.used_byte_s += used * dt;
  stats_.reserved_byte_s += reserved * dt;
}

Result<std::vector<StepOutput>> Engine::step() {
  std::vector<StepOutput> out;
  if (!has_unfinished()) return out;
  const double t0 = now_s();
  int64_t budget = options_.max_tokens_per_step;
  bool preempted = false;
  scheduled_.clear();
  counts_.clear();
  ATTNKIT_RETURN_IF_ERROR(schedule_running(budget, preempted));
  if (!preempted) ATTNKIT_RETURN_IF_ERROR(admit(budget));
  if (scheduled_.empty()) return internal_error("Engine::step: a step scheduled nothing");
  const Status st = forward();
  if (!st.ok()) {
    // What the pass wrote is unknown: every scheduled sequence is
    // recomputed from its tokens (none is lost), newest first so that the
    // queue keeps admission order.
    for (size_t k = scheduled_.size(); k-- > 0;) {
      const int64_t id = scheduled_[k];
      preempt(id);
      --stats_.preemptions;
      --req(id).m.preemptions;
      running_.erase(std::find(running_.begin(), running_.end(), id));
    }
    return st;
  }
  // The clock of the tokens this step produced: its end.
  const double dt = now_s() - t0;
  clock_ += dt;
  stats_.busy_s += dt;
  ++stats_.steps;
  collect(dt, out);
  stats_.wall_s += now_s() - t0;
  return out;
}

}  // namespace attnkit
