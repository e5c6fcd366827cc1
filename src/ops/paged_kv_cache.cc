// PagedKVCache: the page allocator (free stack, reference counts,
// copy-on-write, window release) and attend(), which validates, writes the
// new K/V into their reserved slots and runs the attention kernel over the
// page tables. Every check and allocation of a call happens before its
// first write, so a failed call changes nothing.
//
// attend() groups its sequences by query count and runs one kernel call per
// group with batch-invariant plans (AttentionParams::batch_invariant; off
// only after set_batch_invariant(false)): a
// sequence's output then depends on its own tokens only, not on which other
// sequences share the step nor on how its prompt was chunked, and decode
// groups keep the decode walk (several kv heads per task) while prompt
// chunks keep prefill's tiling.
#include "attnkit/paged_kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "attnkit/kv_cache.h"
#include "attnkit/sparse_attention.h"
#include "core/check.h"
#include "core/checked_math.h"
#include "kernels/attention_params.h"
#include "kernels/dispatch.h"
#include "ops/attention_checks.h"
#include "ops/kv_quant.h"

namespace attnkit {
namespace {

constexpr int64_t kMaxInt32 = std::numeric_limits<int32_t>::max();
// The parent key of a prompt's first page.
constexpr uint64_t kRootKey = 0x6a09e667f3bcc908ull;

std::string str(int64_t x) { return std::to_string(x); }

// n values from src (f32, `stride` apart) to dst (f32 or bf16, contiguous;
// 8-bit: codes at dst, scales of `block` values each at `scales`).
void store_row(const float* src, int64_t stride, DType dtype, void* dst, int64_t n, int64_t block,
               float* scales) {
  if (is_kv_quantized(dtype)) {
    quantize_kv(src, stride, n, dtype, block, static_cast<uint8_t*>(dst), scales);
  } else if (dtype == DType::kBF16) {
    bf16* d = static_cast<bf16*>(dst);
    for (int64_t x = 0; x < n; ++x) d[x] = float_to_bf16(src[x * stride]);
  } else {
    float* d = static_cast<float*>(dst);
    for (int64_t x = 0; x < n; ++x) d[x] = src[x * stride];
  }
}

}  // namespace

struct PagedKVCache::AttendScratch {
  struct Group {
    size_t first, count;   // entries in q_start ... k_len
    int64_t rows, stride;  // queries per sequence, block table stride
  };
  std::vector<int64_t> order;  // sequence indices with queries, by query count
  std::vector<Group> groups;
  std::vector<int32_t> q_start, q_len, k_len, table;
  std::vector<kernels::AttentionParams> calls;
};

PagedKVCache::PagedKVCache() : scratch_(std::make_unique<AttendScratch>()) {}
PagedKVCache::PagedKVCache(PagedKVCache&&) noexcept = default;
PagedKVCache& PagedKVCache::operator=(PagedKVCache&&) noexcept = default;
PagedKVCache::~PagedKVCache() = default;

Result<PagedKVCache> PagedKVCache::create(const PagedKVCacheSpec& spec) {
  const std::string f = "PagedKVCache::create: spec.";
  auto at_least = [&](const char* name, int64_t value, int64_t min) -> Status {
    if (value >= min) return Status::Ok();
    return invalid_argument(f + name + " = " + str(value) + " must be >= " + str(min));
  };
  ATTNKIT_RETURN_IF_ERROR(at_least("num_layers", spec.num_layers, 1));
  ATTNKIT_RETURN_IF_ERROR(at_least("num_pages", spec.num_pages, 1));
  ATTNKIT_RETURN_IF_ERROR(at_least("page_size", spec.page_size, 1));
  ATTNKIT_RETURN_IF_ERROR(at_least("sliding_window", spec.sliding_window, 0));
  ATTNKIT_RETURN_IF_ERROR(at_least("chunk_size", spec.chunk_size, 0));
  if (spec.sliding_window > 0 && spec.chunk_size > 0)
    return invalid_argument(f + "sliding_window = " + str(spec.sliding_window) +
                            " and spec.chunk_size = " + str(spec.chunk_size) +
                            " are both set; a pool has at most one of them (a pool shared by "
                            "layers of different kinds leaves both 0 and passes each layer's "
                            "in the options)");
  if (spec.prefix_caching && (spec.sliding_window > 0 || spec.chunk_size > 0))
    return invalid_argument(f + "prefix_caching is on with spec." +
                            (spec.chunk_size > 0 ? "chunk_size = " + str(spec.chunk_size)
                                                 : "sliding_window = " + str(spec.sliding_window)) +
                            "; prefix caching needs both 0 (pages a window releases cannot be "
                            "taken over as a prefix)");
  if (spec.num_pages > kMaxInt32)
    return invalid_argument(f + "num_pages = " + str(spec.num_pages) + " must be <= " +
                            str(kMaxInt32) + " (page ids are int32, as in block tables)");
  if (spec.dtype != DType::kF32 && spec.dtype != DType::kBF16 && !is_kv_quantized(spec.dtype))
    return invalid_argument(f + "dtype = " + dtype_name(spec.dtype) +
                            " must be f32, bf16, int8 or fp8_e4m3");
  PagedKVCache pool;
  pool.spec_ = spec;
  PagedKVCacheSpec& s = pool.spec_;
  if (spec.kv_lora_rank != 0 || spec.qk_rope_head_dim != 0) {
    ATTNKIT_RETURN_IF_ERROR(at_least("kv_lora_rank", spec.kv_lora_rank, 1));
    ATTNKIT_RETURN_IF_ERROR(at_least("qk_rope_head_dim", spec.qk_rope_head_dim, 0));
    if (spec.num_kv_heads != 0 || spec.head_dim != 0 || spec.head_dim_v != 0)
      return invalid_argument(
          f + "num_kv_heads, head_dim and head_dim_v = " + str(spec.num_kv_heads) + ", " +
          str(spec.head_dim) + ", " + str(spec.head_dim_v) +
          " must be 0 with the latent layout (kv_lora_rank = " + str(spec.kv_lora_rank) +
          "): a latent row is the key and its first kv_lora_rank values the value");
    s.num_kv_heads = 1;
    s.head_dim = spec.kv_lora_rank + spec.qk_rope_head_dim;
    s.head_dim_v = spec.kv_lora_rank;
  } else {
    ATTNKIT_RETURN_IF_ERROR(at_least("num_kv_heads", spec.num_kv_heads, 1));
    ATTNKIT_RETURN_IF_ERROR(at_least("head_dim", spec.head_dim, 1));
    ATTNKIT_RETURN_IF_ERROR(at_least("head_dim_v", spec.head_dim_v, 0));
    if (s.head_dim_v == 0) s.head_dim_v = s.head_dim;
  }
  ATTNKIT_RETURN_IF_ERROR(at_least("index_head_dim", spec.index_head_dim, 0));
  if (spec.index_head_dim > 0 && (!s.latent() || spec.index_head_dim % kIndexerBlock != 0))
    return invalid_argument(f + "index_head_dim = " + str(spec.index_head_dim) +
                            " needs the latent layout (kv_lora_rank = " + str(spec.kv_lora_rank) +
                            ") and a multiple of " + str(kIndexerBlock) +
                            " (one fp8 scale per block)");
  int64_t rows;
  if (!checked_mul(s.num_pages, s.page_size, &rows))
    return resource_exhausted(f + "num_pages * page_size overflows 64 bits");
  // Token rows padded as KVCache pads them (kv_token_stride), 8-bit ones
  // with their scales.
  const int64_t block = s.latent() ? kLatentScaleBlock : 0;
  const KvRowLayout kl = kv_row_layout(s.num_kv_heads, s.head_dim, s.dtype, block);
  const KvRowLayout vl = kv_row_layout(s.num_kv_heads, s.head_dim_v, s.dtype, block);
  if (kl.row == 0 || vl.row == 0)
    return resource_exhausted(f + "num_kv_heads * head_dim overflows 64 bits");
  pool.k_token_stride_ = kl.row;
  pool.v_token_stride_ = vl.row;
  pool.k_scale_offset_ = kl.scale_offset;
  pool.v_scale_offset_ = vl.scale_offset;
  pool.k_scales_per_head_ = kl.scales_per_head;
  pool.v_scales_per_head_ = vl.scales_per_head;
  for (int64_t l = 0; l < s.num_layers; ++l) {
    auto k = Tensor::zeros(s.dtype, {rows, pool.k_token_stride_});
    if (!k.ok()) return Status(k.status().code(), "PagedKVCache::create: " + k.status().message());
    pool.k_.push_back(std::move(k).value());
    if (s.index_head_dim > 0) {
      auto codes = Tensor::zeros(DType::kFp8E4M3, {rows, s.index_head_dim});
      auto scales = Tensor::zeros(DType::kF32, {rows, s.index_head_dim / kIndexerBlock});
      for (const Result<Tensor>* t : {&codes, &scales})
        if (!t->ok())
          return Status(t->status().code(), "PagedKVCache::create: " + t->status().message());
      pool.index_codes_.push_back(std::move(codes).value());
      pool.index_scales_.push_back(std::move(scales).value());
    }
    if (s.latent()) continue;
    auto v = Tensor::zeros(s.dtype, {rows, pool.v_token_stride_});
    if (!v.ok()) return Status(v.status().code(), "PagedKVCache::create: " + v.status().message());
    pool.v_.push_back(std::move(v).value());
  }
  // A stack: page 0 is handed out first, so a fresh pool fills in address
  // order.
  for (int64_t p = s.num_pages - 1; p >= 0; --p) pool.free_.push_back(static_cast<int32_t>(p));
  pool.refs_.assign(static_cast<size_t>(s.num_pages), 0);
  if (s.prefix_caching) {
    pool.meta_.resize(static_cast<size_t>(s.num_pages));
    pool.page_tokens_.resize(static_cast<size_t>(rows));
  }
  return pool;
}

size_t PagedKVCache::page_nbytes() const {
  const int64_t per_token =
      spec_.num_kv_heads * (spec_.latent() ? spec_.head_dim : spec_.head_dim + spec_.head_dim_v);
  const int64_t scales =
      spec_.num_kv_heads * (k_scales_per_head_ + (spec_.latent() ? 0 : v_scales_per_head_));
  const int64_t index_key = spec_.index_head_dim + 4 * (spec_.index_head_dim / kIndexerBlock);
  return static_cast<size_t>(spec_.num_layers * spec_.page_size) *
         (static_cast<size_t>(per_token) * dtype_size(spec_.dtype) +
          static_cast<size_t>(scales) * sizeof(float) + static_cast<size_t>(index_key));
}

int64_t PagedKVCache::add_sequence() {
  Sequence seq;
  seq.written.assign(static_cast<size_t>(spec_.num_layers), 0);
  const int64_t id = next_id_++;
  sequences_.emplace(id, std::move(seq));
  return id;
}

Status PagedKVCache::check_prompt(const char* fn, std::span<const int32_t> prompt) const {
  const int64_t n = static_cast<int64_t>(prompt.size());
  if (n > kMaxInt32)
    return invalid_argument(std::string(fn) + ": prompt_token_ids has " + str(n) +
                            " tokens, more than " + str(kMaxInt32));
  for (int64_t i = 0; i < n; ++i)
    if (prompt[static_cast<size_t>(i)] < 0)
      return invalid_argument(std::string(fn) + ": prompt_token_ids[" + str(i) +
                              "] = " + str(prompt[static_cast<size_t>(i)]) + " must be >= 0");
  return Status::Ok();
}

// The longest run of cached pages the prompt starts with, at most
// prompt length - 1 tokens. Walks the chain from the first page: each page
// must be keyed under the key of this prefix, hold these token ids and name
// the page matched before as its parent, so a hash collision can never
// alias.
void PagedKVCache::match_prefix(std::span<const int32_t> prompt, std::vector<int32_t>* pages,
                                std::vector<ChainLink>* chain) const {
  const int64_t ps = spec_.page_size, n = static_cast<int64_t>(prompt.size());
  const size_t most = n > 0 ? static_cast<size_t>((n - 1) / ps) : 0;
  ChainLink parent{kRootKey, 0};
  for (size_t i = 0; i < most; ++i) {
    const int32_t* ids = prompt.data() + i * static_cast<size_t>(ps);
    const auto it = keyed_.find(page_hash(parent.key, ids));
    if (it == keyed_.end()) break;
    const int32_t page = it->second;
    const PageMeta& m = meta_[static_cast<size_t>(page)];
    if (m.parent_serial != parent.serial ||
        !std::equal(ids, ids + ps, page_tokens_.begin() + page * ps))
      break;
    pages->push_back(page);
    if (chain) chain->push_back(m.link);
    parent = m.link;
  }
}

Result<PrefixMatch> PagedKVCache::add_sequence(std::span<const int32_t> prompt_token_ids) {
  ATTNKIT_RETURN_IF_ERROR(check_prompt("PagedKVCache::add_sequence", prompt_token_ids));
  if (!spec_.prefix_caching) return PrefixMatch{add_sequence(), 0};
  Sequence seq;
  seq.tokens.assign(prompt_token_ids.begin(), prompt_token_ids.end());
  match_prefix(prompt_token_ids, &seq.pages, &seq.chain);
  for (int32_t page : seq.pages) {
    if (refs_[static_cast<size_t>(page)]++ == 0) lru_erase(page);
  }
  const int64_t cached = static_cast<int64_t>(seq.pages.size()) * spec_.page_size;
  seq.length = cached;
  seq.written.assign(static_cast<size_t>(spec_.num_layers), cached);
  ++stats_.queries;
  stats_.query_tokens += static_cast<int64_t>(prompt_token_ids.size());
  stats_.hits += cached > 0 ? 1 : 0;
  stats_.hit_pages += static_cast<int64_t>(seq.pages.size());
  stats_.hit_tokens += cached;
  const int64_t id = next_id_++;
  sequences_.emplace(id, std::move(seq));
  return PrefixMatch{id, cached};
}

Result<PrefixProbe> PagedKVCache::probe_prefix(std::span<const int32_t> prompt_token_ids) const {
  ATTNKIT_RETURN_IF_ERROR(check_prompt("PagedKVCache::probe_prefix", prompt_token_ids));
  PrefixProbe probe;
  if (!spec_.prefix_caching) return probe;
  std::vector<int32_t> pages;
  match_prefix(prompt_token_ids, &pages, nullptr);
  probe.cached_tokens = static_cast<int64_t>(pages.size()) * spec_.page_size;
  for (int32_t page : pages) probe.cached_free_pages += refs_[static_cast<size_t>(page)] == 0;
  return probe;
}

PrefixCacheStats PagedKVCache::prefix_cache_stats() const {
  PrefixCacheStats s = stats_;
  s.cached_pages = static_cast<int64_t>(keyed_.size());
  s.cached_free_pages = lru_size_;
  return s;
}

void PagedKVCache::reset_prefix_cache_stats() { stats_ = PrefixCacheStats{}; }

std::vector<int32_t> PagedKVCache::cached_free_pages() const {
  std::vector<int32_t> pages;
  for (int32_t p = lru_head_; p >= 0; p = meta_[static_cast<size_t>(p)].lru_next)
    pages.push_back(p);
  return pages;
}

// The key of a full page: its parent's key and its page_size token ids,
// two ids per round of splitmix64's finalizer (a bijection of 64 bits, so
// ids that differ in one round always give different states after it).
uint64_t PagedKVCache::page_hash(uint64_t parent_key, const int32_t* tokens) const {
  auto mix = [](uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
  };
  const int64_t ps = spec_.page_size;
  uint64_t h = mix(parent_key + 0x9e3779b97f4a7c15ull);
  int64_t j = 0;
  for (; j + 1 < ps; j += 2)
    h = mix(h ^ (static_cast<uint64_t>(static_cast<uint32_t>(tokens[j])) |
                 static_cast<uint64_t>(static_cast<uint32_t>(tokens[j + 1])) << 32));
  if (j < ps) h = mix(h ^ static_cast<uint64_t>(static_cast<uint32_t>(tokens[j])) ^ (1ull << 63));
  return h & key_mask_;
}

// Keys the sequence's pages that are full, written by every layer and of
// known token ids, in order, each under the chain of the ones before. A
// page whose key an equal page (same ids, same parent) holds already stays
// unkeyed and the chain goes on through that page; a key held by a page
// that does not match (a stale child of an evicted parent, or a collision)
// goes to the newer page.
void PagedKVCache::key_full_pages(Sequence* seq) {
  const int64_t ps = spec_.page_size;
  const int64_t written = *std::min_element(seq->written.begin(), seq->written.end());
  const size_t full = static_cast<size_t>(
      std::min<int64_t>(written, static_cast<int64_t>(seq->tokens.size())) / ps);
  while (seq->chain.size() < full) {
    const size_t i = seq->chain.size();
    const ChainLink parent = i > 0 ? seq->chain[i - 1] : ChainLink{kRootKey, 0};
    const int32_t* ids = seq->tokens.data() + i * static_cast<size_t>(ps);
    const uint64_t key = page_hash(parent.key, ids);
    const int32_t page = seq->pages[i];
    const auto it = keyed_.find(key);
    if (it != keyed_.end()) {
      const int32_t other = it->second;
      const PageMeta& m = meta_[static_cast<size_t>(other)];
      if (m.parent_serial == parent.serial &&
          std::equal(ids, ids + ps, page_tokens_.begin() + other * ps)) {
        seq->chain.push_back(m.link);
        continue;
      }
      forget(other);
    }
    if (meta_[static_cast<size_t>(page)].link.serial != 0) forget(page);
    PageMeta& m = meta_[static_cast<size_t>(page)];
    m.link = {key, next_serial_++};
    m.parent_serial = parent.serial;
    std::copy(ids, ids + ps, page_tokens_.begin() + page * ps);
    keyed_.emplace(key, page);
    seq->chain.push_back(m.link);
  }
}

Result<PagedKVCache::Sequence*> PagedKVCache::find(const char* fn, int64_t seq_id) {
  auto it = sequences_.find(seq_id);
  if (it == sequences_.end())
    return not_found(std::string(fn) + ": sequence " + str(seq_id) + " does not exist");
  return &it->second;
}

Result<const PagedKVCache::Sequence*> PagedKVCache::find(const char* fn, int64_t seq_id) const {
  auto it = sequences_.find(seq_id);
  if (it == sequences_.end())
    return not_found(std::string(fn) + ": sequence " + str(seq_id) + " does not exist");
  return &it->second;
}

Result<int64_t> PagedKVCache::length(int64_t seq_id) const {
  ATTNKIT_ASSIGN_OR_RETURN(const Sequence* seq, find("PagedKVCache::length", seq_id));
  return seq->length;
}

Result<int64_t> PagedKVCache::written(int64_t seq_id, int64_t layer) const {
  ATTNKIT_ASSIGN_OR_RETURN(const Sequence* seq, find("PagedKVCache::written", seq_id));
  if (layer < 0 || layer >= spec_.num_layers)
    return invalid_argument("PagedKVCache::written: layer = " + str(layer) + " must be in [0, " +
                            str(spec_.num_layers) + ")");
  return seq->written[static_cast<size_t>(layer)];
}

Result<std::vector<int32_t>> PagedKVCache::page_table(int64_t seq_id) const {
  ATTNKIT_ASSIGN_OR_RETURN(const Sequence* seq, find("PagedKVCache::page_table", seq_id));
  return seq->pages;
}

std::vector<int64_t> PagedKVCache::sequence_ids() const {
  std::vector<int64_t> ids;
  ids.reserve(sequences_.size());
  for (const auto& kv : sequences_) ids.push_back(kv.first);
  std::sort(ids.begin(), ids.end());
  return ids;
}

Result<TensorView> PagedKVCache::keys(int64_t layer) const {
  if (layer < 0 || layer >= spec_.num_layers)
    return invalid_argument("PagedKVCache::keys: layer = " + str(layer) + " must be in [0, " +
                            str(spec_.num_layers) + ")");
  TensorView v = make_view(k_[static_cast<size_t>(layer)].data(), spec_.dtype,
                           {spec_.num_pages * spec_.page_size, spec_.num_kv_heads, spec_.head_dim});
  v.strides[0] = k_token_stride_;
  return v;
}

Result<TensorView> PagedKVCache::values(int64_t layer) const {
  if (layer < 0 || layer >= spec_.num_layers)
    return invalid_argument("PagedKVCache::values: layer = " + str(layer) + " must be in [0, " +
                            str(spec_.num_layers) + ")");
  const size_t l = static_cast<size_t>(layer);
  const bool latent = spec_.latent();
  TensorView v =
      make_view(latent ? k_[l].data() : v_[l].data(), spec_.dtype,
                {spec_.num_pages * spec_.page_size, spec_.num_kv_heads, spec_.head_dim_v});
  v.strides[0] = latent ? k_token_stride_ : v_token_stride_;
  v.strides[1] = latent ? spec_.head_dim : spec_.head_dim_v;
  return v;
}

Result<TensorView> PagedKVCache::key_scales(int64_t layer) const {
  ATTNKIT_ASSIGN_OR_RETURN(TensorView k, keys(layer));
  if (!is_kv_quantized(spec_.dtype)) return TensorView{};
  TensorView v = make_view(static_cast<char*>(k.data) + k_scale_offset_, DType::kF32,
                           {k.shape[0], spec_.num_kv_heads, k_scales_per_head_});
  v.strides[0] = k_token_stride_ / 4;
  return v;
}

Result<TensorView> PagedKVCache::value_scales(int64_t layer) const {
  if (spec_.latent()) return key_scales(layer);  // the values are the keys' first columns
  ATTNKIT_ASSIGN_OR_RETURN(TensorView vals, values(layer));
  if (!is_kv_quantized(spec_.dtype)) return TensorView{};
  TensorView v = make_view(static_cast<char*>(vals.data) + v_scale_offset_, DType::kF32,
                           {vals.shape[0], spec_.num_kv_heads, v_scales_per_head_});
  v.strides[0] = v_token_stride_ / 4;
  return v;
}

Result<TensorView> PagedKVCache::index_keys(int64_t layer) const {
  if (layer < 0 || layer >= spec_.num_layers)
    return invalid_argument("PagedKVCache::index_keys: layer = " + str(layer) + " must be in [0, " +
                            str(spec_.num_layers) + ")");
  if (spec_.index_head_dim == 0) return TensorView{};
  return index_codes_[static_cast<size_t>(layer)].view();
}

Result<TensorView> PagedKVCache::index_scales(int64_t layer) const {
  if (layer < 0 || layer >= spec_.num_layers)
    return invalid_argument("PagedKVCache::index_scales: layer = " + str(layer) +
                            " must be in [0, " + str(spec_.num_layers) + ")");
  if (spec_.index_head_dim == 0) return TensorView{};
  return index_scales_[static_cast<size_t>(layer)].view();
}

// A page for a sequence to write: a plain free one, else the least
// recently freed cached page, unkeyed (evicted). The caller has counted
// free_pages().
int32_t PagedKVCache::take_page() {
  int32_t page;
  if (!free_.empty()) {
    page = free_.back();
    free_.pop_back();
  } else {
    page = lru_head_;
    lru_erase(page);
    unkey(page);
    ++stats_.evictions;
  }
  refs_[static_cast<size_t>(page)] = 1;
  return page;
}

// A page whose last holder goes: a keyed one joins the prefix cache (the
// LRU list's tail), any other the free stack.
void PagedKVCache::drop_page(int32_t page) {
  if (--refs_[static_cast<size_t>(page)] != 0) return;
  if (!meta_.empty() && meta_[static_cast<size_t>(page)].link.serial != 0)
    lru_push(page);
  else
    free_.push_back(page);
}

// A sequence's pages from `from` on, the last first: of one sequence's
// cached pages the deepest are evicted first, as a prefix without its
// first pages is never matched.
void PagedKVCache::drop_pages(const std::vector<int32_t>& pages, size_t from) {
  for (size_t p = pages.size(); p-- > from;)
    if (pages[p] >= 0) drop_page(pages[p]);
}

void PagedKVCache::lru_push(int32_t page) {
  PageMeta& m = meta_[static_cast<size_t>(page)];
  m.lru_prev = lru_tail_;
  m.lru_next = -1;
  if (lru_tail_ >= 0)
    meta_[static_cast<size_t>(lru_tail_)].lru_next = page;
  else
    lru_head_ = page;
  lru_tail_ = page;
  ++lru_size_;
}

void PagedKVCache::lru_erase(int32_t page) {
  PageMeta& m = meta_[static_cast<size_t>(page)];
  (m.lru_prev >= 0 ? meta_[static_cast<size_t>(m.lru_prev)].lru_next : lru_head_) = m.lru_next;
  (m.lru_next >= 0 ? meta_[static_cast<size_t>(m.lru_next)].lru_prev : lru_tail_) = m.lru_prev;
  m.lru_prev = m.lru_next = -1;
  --lru_size_;
}

// Drops a page's key (its content is about to change, or it is reused).
void PagedKVCache::unkey(int32_t page) {
  PageMeta& m = meta_[static_cast<size_t>(page)];
  keyed_.erase(m.link.key);
  m.link = {};
  m.parent_serial = 0;
}

// unkey() for a page in any state: a cached-free one moves to the free
// stack.
void PagedKVCache::forget(int32_t page) {
  if (refs_[static_cast<size_t>(page)] == 0) {
    lru_erase(page);
    free_.push_back(page);
  }
  unkey(page);
}

void PagedKVCache::copy_page(int32_t from, int32_t to, int64_t tokens) {
  const size_t elem = dtype_size(spec_.dtype);
  for (int64_t l = 0; l < spec_.num_layers; ++l) {
    const size_t li = static_cast<size_t>(l);
    const size_t row_bytes = static_cast<size_t>(k_token_stride_) * elem;
    char* k = static_cast<char*>(k_[li].data());
    std::memcpy(k + static_cast<size_t>(to * spec_.page_size) * row_bytes,
                k + static_cast<size_t>(from * spec_.page_size) * row_bytes,
                static_cast<size_t>(tokens) * row_bytes);
    // The indexer keys: two contiguous tensors of rows (codes, scales).
    for (const Tensor* t : {index_codes_.empty() ? nullptr : &index_codes_[li],
                            index_scales_.empty() ? nullptr : &index_scales_[li]}) {
      if (t == nullptr) continue;
      const size_t bytes = static_cast<size_t>(t->dim(1)) * dtype_size(t->dtype());
      char* base = static_cast<char*>(t->data());
      std::memcpy(base + static_cast<size_t>(to * spec_.page_size) * bytes,
                  base + static_cast<size_t>(from * spec_.page_size) * bytes,
                  static_cast<size_t>(tokens) * bytes);
    }
    if (spec_.latent()) continue;
    const size_t v_row_bytes = static_cast<size_t>(v_token_stride_) * elem;
    char* v = static_cast<char*>(v_[li].data());
    std::memcpy(v + static_cast<size_t>(to * spec_.page_size) * v_row_bytes,
                v + static_cast<size_t>(from * spec_.page_size) * v_row_bytes,
                static_cast<size_t>(tokens) * v_row_bytes);
  }
}

Status PagedKVCache::append(std::span<const int64_t> seq_ids,
                            std::span<const int64_t> num_new_tokens) {
  return append_impl(seq_ids, num_new_tokens, nullptr);
}

Status PagedKVCache::append(std::span<const int64_t> seq_ids,
                            std::span<const int64_t> num_new_tokens,
                            std::span<const int32_t> token_ids) {
  return append_impl(seq_ids, num_new_tokens, &token_ids);
}

Status PagedKVCache::append_impl(std::span<const int64_t> seq_ids,
                                 std::span<const int64_t> num_new_tokens,
                                 const std::span<const int32_t>* token_ids) {
  constexpr const char* fn = "PagedKVCache::append";
  const std::string f = fn;
  if (seq_ids.size() != num_new_tokens.size())
    return invalid_argument(f + ": seq_ids has " + str(static_cast<int64_t>(seq_ids.size())) +
                            " entries and num_new_tokens " +
                            str(static_cast<int64_t>(num_new_tokens.size())) +
                            "; they must be equal");
  const int64_t ps = spec_.page_size;
  int64_t needed = 0, tokens = 0;
  for (size_t i = 0; i < seq_ids.size(); ++i) {
    ATTNKIT_ASSIGN_OR_RETURN(Sequence * seq, find(fn, seq_ids[i]));
    for (size_t j = 0; j < i; ++j)
      if (seq_ids[j] == seq_ids[i])
        return invalid_argument(f + ": seq_ids[" + str(static_cast<int64_t>(i)) +
                                "] = " + str(seq_ids[i]) + " repeats seq_ids[" +
                                str(static_cast<int64_t>(j)) + "]; each sequence appears once");
    const int64_t n = num_new_tokens[i];
    if (n < 0)
      return invalid_argument(f + ": num_new_tokens[" + str(static_cast<int64_t>(i)) +
                              "] = " + str(n) + " must be >= 0");
    // The kernels count a sequence's keys in int32, as FlashAttention does.
    if (n > kMaxInt32 - seq->length)
      return out_of_range(f + ": sequence " + str(seq_ids[i]) + " would hold " + str(seq->length) +
                          " + " + str(n) + " tokens, more than " + str(kMaxInt32));
    if (n == 0) continue;
    const int64_t len = seq->length;
    needed += (len + n + ps - 1) / ps - static_cast<int64_t>(seq->pages.size());
    tokens += n;
    // A shared, partly filled last page is copied before the first write,
    // by each writer while others still hold it: when every holder writes
    // in this call, the last of them finds it its own and copies nothing.
    // Counted once per page, at its first writer in the call.
    if (len % ps == 0) continue;
    const int32_t page = seq->pages.back();
    const int64_t holders = refs_[static_cast<size_t>(page)];
    if (holders < 2) continue;
    bool first = true;
    int64_t writers = 0;
    for (size_t j = 0; j < seq_ids.size(); ++j) {
      if (num_new_tokens[j] <= 0) continue;
      const auto other = sequences_.find(seq_ids[j]);
      if (other == sequences_.end() || other->second.length % ps == 0 ||
          other->second.pages.back() != page)
        continue;
      first = first && j >= i;
      ++writers;
    }
    if (first) needed += writers == holders ? writers - 1 : writers;
  }
  if (token_ids != nullptr)
    ATTNKIT_RETURN_IF_ERROR(check_token_ids(seq_ids, num_new_tokens, *token_ids));
  if (needed > free_pages())
    return resource_exhausted(f + ": out of pages: " + str(tokens) + " new tokens need " +
                              str(needed) + " free pages of " + str(ps) + " tokens, and " +
                              str(free_pages()) + " of " + str(spec_.num_pages) +
                              " are free; nothing was reserved");
  size_t id_at = 0;  // the next sequence's first entry in token_ids
  for (size_t i = 0; i < seq_ids.size(); ++i) {
    const int64_t n = num_new_tokens[i];
    if (n == 0) continue;
    Sequence& seq = sequences_.find(seq_ids[i])->second;
    const int64_t len = seq.length;
    // A partly filled last page that others hold, or that is keyed (a
    // truncate cut into it; a later prompt may take it over), is not
    // written in place: copied while shared, else only unkeyed.
    if (len % ps != 0) {
      const int32_t last = seq.pages.back();
      if (refs_[static_cast<size_t>(last)] > 1) {
        const int32_t copy = take_page();
        copy_page(last, copy, len % ps);
        drop_page(last);
        seq.pages.back() = copy;
      } else if (!meta_.empty() && meta_[static_cast<size_t>(last)].link.serial != 0) {
        unkey(last);
      }
    }
    for (int64_t p = static_cast<int64_t>(seq.pages.size()); p * ps < len + n; ++p)
      seq.pages.push_back(take_page());
    seq.length = len + n;
    if (!meta_.empty()) record_tokens(&seq, len, n, token_ids, id_at);
    id_at += static_cast<size_t>(n);
  }
  return Status::Ok();
}

// append()'s token ids: each >= 0, as many as new tokens, and equal to the
// ids a sequence knows already at their positions (its prompt).
Status PagedKVCache::check_token_ids(std::span<const int64_t> seq_ids,
                                     std::span<const int64_t> num_new_tokens,
                                     std::span<const int32_t> token_ids) const {
  const std::string f = "PagedKVCache::append";
  int64_t total = 0;
  for (int64_t n : num_new_tokens) total += n;
  if (static_cast<int64_t>(token_ids.size()) != total)
    return invalid_argument(f + ": token_ids has " + str(static_cast<int64_t>(token_ids.size())) +
                            " entries; it must have sum(num_new_tokens) = " + str(total));
  size_t at = 0;
  for (size_t i = 0; i < seq_ids.size(); ++i) {
    const Sequence& seq = sequences_.find(seq_ids[i])->second;
    for (int64_t j = 0; j < num_new_tokens[i]; ++j, ++at) {
      const int32_t id = token_ids[at];
      if (id < 0)
        return invalid_argument(f + ": token_ids[" + str(static_cast<int64_t>(at)) +
                                "] = " + str(id) + " must be >= 0");
      const int64_t pos = seq.length + j;
      if (pos < static_cast<int64_t>(seq.tokens.size()) &&
          seq.tokens[static_cast<size_t>(pos)] != id)
        return invalid_argument(
            f + ": token_ids[" + str(static_cast<int64_t>(at)) + "] = " + str(id) +
            " differs from token " + str(seq.tokens[static_cast<size_t>(pos)]) + " at position " +
            str(pos) + " of sequence " + str(seq_ids[i]) + " (its prompt); they must be equal");
    }
  }
  return Status::Ok();
}

// The ids of tokens len ... len + n - 1 of a sequence, from token_ids at
// `at` when given. Without them, tokens past the known ids leave the
// sequence untracked: its later pages are never keyed.
void PagedKVCache::record_tokens(Sequence* seq, int64_t len, int64_t n,
                                 const std::span<const int32_t>* token_ids, size_t at) {
  const int64_t known = static_cast<int64_t>(seq->tokens.size());
  if (seq->untracked || known >= len + n) return;
  if (token_ids == nullptr || known < len) {
    seq->untracked = true;
    return;
  }
  const auto from = token_ids->begin() + static_cast<std::ptrdiff_t>(at) + (known - len);
  seq->tokens.insert(seq->tokens.end(), from, from + (len + n - known));
}

Result<int64_t> PagedKVCache::fork(int64_t seq_id) {
  constexpr const char* fn = "PagedKVCache::fork";
  ATTNKIT_ASSIGN_OR_RETURN(const Sequence* parent, find(fn, seq_id));
  for (int64_t l = 0; l < spec_.num_layers; ++l)
    if (parent->written[static_cast<size_t>(l)] != parent->length)
      return invalid_argument(std::string(fn) + ": sequence " + str(seq_id) + " has " +
                              str(parent->length - parent->written[static_cast<size_t>(l)]) +
                              " reserved tokens that layer " + str(l) +
                              " has not written; fork after every layer's attend()");
  Sequence child = *parent;
  // The child's tokens are the ones written so far: a prompt the parent has
  // yet to write is the parent's, and ids taken from it would key the
  // child's own rows under that prompt.
  if (static_cast<int64_t>(child.tokens.size()) > child.length)
    child.tokens.resize(static_cast<size_t>(child.length));
  for (int32_t page : child.pages)
    if (page >= 0) ++refs_[static_cast<size_t>(page)];
  const int64_t id = next_id_++;
  sequences_.emplace(id, std::move(child));
  return id;
}

Status PagedKVCache::remove(int64_t seq_id) {
  ATTNKIT_ASSIGN_OR_RETURN(Sequence * seq, find("PagedKVCache::remove", seq_id));
  drop_pages(seq->pages, 0);
  sequences_.erase(seq_id);
  return Status::Ok();
}

Status PagedKVCache::truncate(int64_t seq_id, int64_t new_length) {
  constexpr const char* fn = "PagedKVCache::truncate";
  ATTNKIT_ASSIGN_OR_RETURN(Sequence * seq, find(fn, seq_id));
  // The next query, at position new_length, must still find every token
  // its window (or its chunk, from the chunk's first token on) sees.
  const int64_t released_to = seq->released * spec_.page_size, C = spec_.chunk_size;
  const int64_t lowest = seq->released == 0 ? 0
                         : C > 0            ? (released_to + C - 1) / C * C
                                            : released_to + spec_.sliding_window - 1;
  if (new_length < lowest || new_length > seq->length)
    return invalid_argument(
        std::string(fn) + ": new_length = " + str(new_length) + " must be in [" + str(lowest) +
        ", length = " + str(seq->length) + "] for sequence " + str(seq_id) +
        (lowest > 0 ? std::string(C > 0 ? " (its chunks have" : " (its window has") +
                          " released the tokens before " + str(released_to) + ")"
                    : ""));
  const size_t keep = static_cast<size_t>((new_length + spec_.page_size - 1) / spec_.page_size);
  drop_pages(seq->pages, keep);
  seq->pages.resize(keep);
  seq->length = new_length;
  for (int64_t& w : seq->written) w = std::min(w, new_length);
  // The chain keeps the pages still full; ids past the new end are
  // forgotten (a rolled-back token's id is not the next one's), and a
  // sequence untracked past its known ids is tracked again when cut back
  // to them.
  const size_t full = static_cast<size_t>(new_length / spec_.page_size);
  if (seq->chain.size() > full) seq->chain.resize(full);
  if (new_length <= static_cast<int64_t>(seq->tokens.size())) {
    seq->tokens.resize(static_cast<size_t>(new_length));
    seq->untracked = false;
  }
  return Status::Ok();
}

// Pages whose tokens no later query of any layer can see: a query sits at a
// position >= the fewest tokens a layer has written, and sees W - 1 tokens
// back, or (chunks of C) back to the first token of its chunk.
void PagedKVCache::release_unseen(Sequence* seq) {
  const int64_t W = spec_.sliding_window, C = spec_.chunk_size;
  if (W == 0 && C == 0) return;
  const int64_t first_query = *std::min_element(seq->written.begin(), seq->written.end());
  const int64_t first_seen =
      C > 0 ? first_query / C * C : std::max<int64_t>(0, first_query - (W - 1));
  const int64_t release = first_seen / spec_.page_size;
  for (int64_t p = seq->released; p < release; ++p) {
    drop_page(seq->pages[static_cast<size_t>(p)]);
    seq->pages[static_cast<size_t>(p)] = -1;
  }
  seq->released = std::max(seq->released, release);
}

// The parts of a step attend() and store() share: the new K/V rows and
// the packed layout checked against the pool, ...
Status PagedKVCache::check_step(const char* fn, int64_t layer, const TensorView& k_new,
                                const TensorView& v_new, std::span<const int32_t> cu_seqlens,
                                std::span<const int64_t> seq_ids) const {
  const std::string f = fn;
  if (layer < 0 || layer >= spec_.num_layers)
    return invalid_argument(f + ": layer = " + str(layer) +
                            " must be in [0, num_layers = " + str(spec_.num_layers) + ")");
  ATTNKIT_RETURN_IF_ERROR(check::view(fn, "k_new", k_new, 3, {DType::kF32}));
  const bool latent = spec_.latent();
  if (latent && v_new.present())
    return invalid_argument(f +
                            ": v_new must be absent with the latent layout; the values are "
                            "the first kv_lora_rank = " +
                            str(spec_.kv_lora_rank) + " columns of k_new's rows");
  const int64_t total = k_new.shape[0];
  ATTNKIT_RETURN_IF_ERROR(
      check::dim(fn, "k_new", k_new, 1, "num_kv_heads", spec_.num_kv_heads, "spec().num_kv_heads"));
  ATTNKIT_RETURN_IF_ERROR(
      check::dim(fn, "k_new", k_new, 2, "head_dim", spec_.head_dim, "spec().head_dim"));
  if (!latent) {
    ATTNKIT_RETURN_IF_ERROR(check::view(fn, "v_new", v_new, 3, {DType::kF32}));
    ATTNKIT_RETURN_IF_ERROR(check::dim(fn, "v_new", v_new, 0, "total", total, "k_new.shape[0]"));
    ATTNKIT_RETURN_IF_ERROR(check::dim(fn, "v_new", v_new, 1, "num_kv_heads", spec_.num_kv_heads,
                                       "spec().num_kv_heads"));
    ATTNKIT_RETURN_IF_ERROR(
        check::dim(fn, "v_new", v_new, 2, "head_dim_v", spec_.head_dim_v, "spec().head_dim_v"));
  }
  if (total > kMaxInt32)
    return invalid_argument(f + ": k_new.shape[0] = " + str(total) +
                            " must be <= " + str(kMaxInt32));
  const int64_t n = static_cast<int64_t>(seq_ids.size());
  int32_t longest = 0;
  ATTNKIT_RETURN_IF_ERROR(
      check_cu_seqlens(fn, "cu_seqlens_q", cu_seqlens, n, total, "k_new.shape[0]", &longest));
  const size_t li = static_cast<size_t>(layer);
  for (int64_t s = 0; s < n; ++s) {
    ATTNKIT_ASSIGN_OR_RETURN(const Sequence* seq, find(fn, seq_ids[s]));
    for (int64_t t = 0; t < s; ++t)
      if (seq_ids[t] == seq_ids[s])
        return invalid_argument(f + ": seq_ids[" + str(s) + "] = " + str(seq_ids[s]) +
                                " repeats seq_ids[" + str(t) + "]; each sequence appears once");
    const int64_t rows = cu_seqlens[s + 1] - cu_seqlens[s];
    const int64_t pending = seq->length - seq->written[li];
    if (rows != pending)
      return invalid_argument(f + ": cu_seqlens_q gives sequence " + str(seq_ids[s]) + " " +
                              str(rows) + " new tokens, but it has " + str(pending) +
                              " reserved tokens that layer " + str(layer) +
                              " has not written; they must be equal (append() reserves, "
                              "attend() or store() writes them)");
  }
  const TensorView storage[] = {keys(layer).value(), values(layer).value()};
  for (const NamedView& x : {NamedView{"k_new", &k_new}, NamedView{"v_new", &v_new}})
    for (const TensorView& st : storage)
      if (check::overlaps(*x.view, st))
        return invalid_argument(f + ": " + x.name + " overlaps the pool's own storage");
  return Status::Ok();
}

// ... the new tokens' K/V copied into their slots (unwritten slots of this
// layer, which nothing reads until written() says so) ...
void PagedKVCache::write_step(int64_t layer, const TensorView& k_new, const TensorView& v_new,
                              std::span<const int32_t> cu_seqlens,
                              std::span<const int64_t> seq_ids) {
  const size_t li = static_cast<size_t>(layer);
  const int64_t ps = spec_.page_size, Hkv = spec_.num_kv_heads, D = spec_.head_dim,
                Dv = spec_.head_dim_v;
  const size_t elem = dtype_size(spec_.dtype);
  const int64_t block = spec_.latent() ? kLatentScaleBlock : 0;
  for (size_t s = 0; s < seq_ids.size(); ++s) {
    const Sequence& seq = sequences_.find(seq_ids[s])->second;
    for (int64_t t = seq.written[li]; t < seq.length; ++t) {
      const int64_t row = seq.pages[static_cast<size_t>(t / ps)] * ps + t % ps;
      const int64_t src = cu_seqlens[s] + (t - seq.written[li]);
      char* k_row =
          static_cast<char*>(k_[li].data()) + static_cast<size_t>(row * k_token_stride_) * elem;
      float* k_scales = reinterpret_cast<float*>(k_row + k_scale_offset_);
      for (int64_t h = 0; h < Hkv; ++h)
        store_row(k_new.ptr<const float>() + src * k_new.strides[0] + h * k_new.strides[1],
                  k_new.strides[2], spec_.dtype, k_row + static_cast<size_t>(h * D) * elem, D,
                  block, k_scales + h * k_scales_per_head_);
      if (spec_.latent()) continue;
      char* v_row =
          static_cast<char*>(v_[li].data()) + static_cast<size_t>(row * v_token_stride_) * elem;
      float* v_scales = reinterpret_cast<float*>(v_row + v_scale_offset_);
      for (int64_t h = 0; h < Hkv; ++h)
        store_row(v_new.ptr<const float>() + src * v_new.strides[0] + h * v_new.strides[1],
                  v_new.strides[2], spec_.dtype, v_row + static_cast<size_t>(h * Dv) * elem, Dv,
                  block, v_scales + h * v_scales_per_head_);
    }
  }
}

// ... and, once nothing can fail, the tokens counted as written and the
// pages a window no longer needs released.
void PagedKVCache::finish_step(int64_t layer, std::span<const int64_t> seq_ids) {
  for (int64_t id : seq_ids) {
    Sequence& seq = sequences_.find(id)->second;
    int64_t& written = seq.written[static_cast<size_t>(layer)];
    // Pages become keyable when the last layer to reach their end does:
    // look (O(layers)) only when this layer crossed a page end.
    const bool crossed = written / spec_.page_size != seq.length / spec_.page_size;
    written = seq.length;
    if (!meta_.empty() && crossed) key_full_pages(&seq);
    release_unseen(&seq);
  }
}

Status PagedKVCache::store(int64_t layer, const TensorView& k_new, const TensorView& v_new,
                           std::span<const int32_t> cu_seqlens, std::span<const int64_t> seq_ids) {
  ATTNKIT_RETURN_IF_ERROR(
      check_step("PagedKVCache::store", layer, k_new, v_new, cu_seqlens, seq_ids));
  write_step(layer, k_new, v_new, cu_seqlens, seq_ids);
  finish_step(layer, seq_ids);
  return Status::Ok();
}

// The checks attend() and attend_held() share: q, out, lse and options, and
// that no output overlaps an input or the pool (k_new and v_new may be
// absent).
Status PagedKVCache::check_queries(const char* fn, int64_t layer, const TensorView& q,
                                   const TensorView& out, const TensorView& lse,
                                   const AttentionOptions& options, const TensorView& k_new,
                                   const TensorView& v_new) const {
  const std::string f = fn;
  ATTNKIT_RETURN_IF_ERROR(check::view(fn, "q", q, 3, {DType::kF32}));
  ATTNKIT_RETURN_IF_ERROR(check::view(fn, "out", out, 3, {DType::kF32}));
  const int64_t total_q = q.shape[0], num_heads = q.shape[1];
  ATTNKIT_RETURN_IF_ERROR(check::dim(fn, "q", q, 2, "head_dim", spec_.head_dim, "spec().head_dim"));
  ATTNKIT_RETURN_IF_ERROR(
      check_head_layout(fn, num_heads, spec_.num_kv_heads, spec_.head_dim, spec_.head_dim_v));
  ATTNKIT_RETURN_IF_ERROR(check::dim(fn, "out", out, 0, "total_q", total_q, "q.shape[0]"));
  ATTNKIT_RETURN_IF_ERROR(check::dim(fn, "out", out, 1, "num_heads", num_heads, "q.shape[1]"));
  ATTNKIT_RETURN_IF_ERROR(
      check::dim(fn, "out", out, 2, "head_dim_v", spec_.head_dim_v, "spec().head_dim_v"));
  if (lse.present()) {
    ATTNKIT_RETURN_IF_ERROR(check::view(fn, "lse", lse, 2, {DType::kF32}));
    ATTNKIT_RETURN_IF_ERROR(check::dim(fn, "lse", lse, 0, "num_heads", num_heads, "q.shape[1]"));
    ATTNKIT_RETURN_IF_ERROR(check::dim(fn, "lse", lse, 1, "total_q", total_q, "q.shape[0]"));
  }
  ATTNKIT_RETURN_IF_ERROR(check_attention_options(fn, options));
  ATTNKIT_RETURN_IF_ERROR(check_sinks(fn, options.sinks, num_heads));
  if (spec_.chunk_size > 0 && options.chunk_size != 0 && options.chunk_size != spec_.chunk_size)
    return invalid_argument(f + ": options.chunk_size = " + str(options.chunk_size) +
                            " must be 0 or the pool's chunk_size = " + str(spec_.chunk_size) +
                            " (two chunk sizes do not make one chunk rule)");
  if (options.mask.present())
    return invalid_argument(f +
                            ": options.mask is not supported; attention over the pool is "
                            "causal (within the windows)");
  if (!options.seqlens_k.empty())
    return invalid_argument(f +
                            ": options.seqlens_k must be empty; every sequence's length() "
                            "gives its keys");
  ATTNKIT_RETURN_IF_ERROR(check_no_self_overlap(fn, "out", out));
  if (lse.present()) ATTNKIT_RETURN_IF_ERROR(check_no_self_overlap(fn, "lse", lse));
  const NamedView outputs[] = {{"out", &out}, {"lse", &lse}};
  const NamedView inputs[] = {
      {"q", &q}, {"k_new", &k_new}, {"v_new", &v_new}, {"options.sinks", &options.sinks}};
  ATTNKIT_RETURN_IF_ERROR(check_outputs_apart(fn, outputs, inputs));
  const TensorView storage[] = {keys(layer).value(), values(layer).value()};
  for (const NamedView& x : {outputs[0], outputs[1], inputs[0]})
    for (const TensorView& st : storage)
      if (check::overlaps(*x.view, st))
        return invalid_argument(f + ": " + x.name + " overlaps the pool's own storage");
  return Status::Ok();
}

// The kernel calls of a step, into scratch_->calls: one per distinct query
// count, sequences without queries left out (see the top of the file).
// Their tables live in members that only grow. attend(): each sequence's
// queries are its newest tokens, causal over its length; held: the queries
// follow the tokens `layer` has written and see all of them.
void PagedKVCache::plan_calls(int64_t layer, const TensorView& q, const TensorView& out,
                              const TensorView& lse, const AttentionOptions& options,
                              std::span<const int32_t> cu_seqlens_q,
                              std::span<const int64_t> seq_ids, bool held) {
  const bool latent = spec_.latent();
  const int64_t ps = spec_.page_size, n = static_cast<int64_t>(seq_ids.size());
  const size_t li = static_cast<size_t>(layer);
  AttendScratch& x = *scratch_;
  x.q_start.clear();
  x.q_len.clear();
  x.k_len.clear();
  x.table.clear();
  x.order.clear();
  for (int64_t s = 0; s < n; ++s)
    if (cu_seqlens_q[s + 1] > cu_seqlens_q[s]) x.order.push_back(s);
  std::stable_sort(x.order.begin(), x.order.end(), [&](int64_t a, int64_t b) {
    return cu_seqlens_q[a + 1] - cu_seqlens_q[a] < cu_seqlens_q[b + 1] - cu_seqlens_q[b];
  });
  kernels::AttentionParams base;
  base.seqlen_k = 0;
  base.num_heads = q.shape[1];
  base.num_kv_heads = spec_.num_kv_heads;
  base.head_dim = spec_.head_dim;
  base.head_dim_v = spec_.head_dim_v;
  base.q = q.ptr<const float>();
  base.q_stride = {0, q.strides[0], q.strides[1], q.strides[2]};
  base.k = k_[li].data();
  base.k_stride = {0, k_token_stride_, spec_.head_dim, 1};
  base.v = latent ? k_[li].data() : v_[li].data();
  base.v_stride =
      latent ? base.k_stride : kernels::Strides4{0, v_token_stride_, spec_.head_dim_v, 1};
  base.kv_dtype = spec_.dtype;
  if (is_kv_quantized(spec_.dtype)) {
    const TensorView ks = key_scales(layer).value(), vs = value_scales(layer).value();
    base.k_scale = ks.ptr<const float>();
    base.k_scale_stride = {0, ks.strides[0], ks.strides[1], ks.strides[2]};
    base.v_scale = vs.ptr<const float>();
    base.v_scale_stride = {0, vs.strides[0], vs.strides[1], vs.strides[2]};
    base.scale_block = latent ? kLatentScaleBlock : 0;
  }
  base.out = out.ptr<float>();
  base.out_stride = {0, out.strides[0], out.strides[1], out.strides[2]};
  if (lse.present()) {
    base.lse = lse.ptr<float>();
    base.lse_stride_head = lse.strides[0];
    base.lse_stride_row = lse.strides[1];
  }
  base.scale = options.softmax_scale > 0.0f
                   ? options.softmax_scale
                   : static_cast<float>(1.0 / std::sqrt(static_cast<double>(spec_.head_dim)));
  base.softcap = options.softcap;
  base.causal = !held;
  base.window_left = options.window_size.left;
  base.window_right = options.window_size.right;
  if (spec_.sliding_window > 0 &&
      (base.window_left < 0 || base.window_left > spec_.sliding_window - 1))
    base.window_left = spec_.sliding_window - 1;
  base.sparse = options.sparse;
  base.chunk_size = spec_.chunk_size > 0 ? spec_.chunk_size : options.chunk_size;
  if (options.sinks.present()) {
    base.sinks = options.sinks.ptr<const float>();
    base.sinks_stride = options.sinks.strides[0];
  }
  base.page_size = ps;
  base.batch_invariant = batch_invariant_;
  base.num_threads = options.num_threads;
  // Index arrays first (they may reallocate), then the params that point
  // into them.
  x.groups.clear();
  for (size_t i = 0; i < x.order.size();) {
    const int64_t rows = cu_seqlens_q[x.order[i] + 1] - cu_seqlens_q[x.order[i]];
    size_t end = i;
    int64_t stride = 1;
    while (end < x.order.size() &&
           cu_seqlens_q[x.order[end] + 1] - cu_seqlens_q[x.order[end]] == rows) {
      const Sequence& seq = sequences_.find(seq_ids[x.order[end]])->second;
      stride = std::max<int64_t>(stride, static_cast<int64_t>(seq.pages.size()));
      ++end;
    }
    x.groups.push_back({x.q_start.size(), end - i, rows, stride});
    for (; i < end; ++i) {
      const int64_t s = x.order[i];
      const Sequence& seq = sequences_.find(seq_ids[s])->second;
      x.q_start.push_back(cu_seqlens_q[s]);
      x.q_len.push_back(static_cast<int32_t>(rows));
      x.k_len.push_back(static_cast<int32_t>(held ? seq.written[li] : seq.length));
      x.table.insert(x.table.end(), seq.pages.begin(), seq.pages.end());
      x.table.resize(x.table.size() + static_cast<size_t>(stride) - seq.pages.size(), -1);
    }
  }
  x.calls.clear();
  size_t table_at = 0;
  for (const AttendScratch::Group& g : x.groups) {
    kernels::AttentionParams p = base;
    p.batch = static_cast<int64_t>(g.count);
    p.seqlen_q = g.rows;
    for (size_t i = 0; i < g.count; ++i)
      p.seqlen_k = std::max<int64_t>(p.seqlen_k, x.k_len[g.first + i]);
    p.q_start = x.q_start.data() + g.first;
    p.q_len = x.q_len.data() + g.first;
    p.k_len = x.k_len.data() + g.first;
    p.block_table = x.table.data() + table_at;
    p.block_table_stride = g.stride;
    table_at += g.count * static_cast<size_t>(g.stride);
    x.calls.push_back(p);
  }
}

Status PagedKVCache::attend(int64_t layer, const TensorView& q, const TensorView& k_new,
                            const TensorView& v_new, std::span<const int32_t> cu_seqlens_q,
                            std::span<const int64_t> seq_ids, const TensorView& out,
                            const AttentionOptions& options, const TensorView& lse) {
  constexpr const char* fn = "PagedKVCache::attend";
  ATTNKIT_RETURN_IF_ERROR(check_step(fn, layer, k_new, v_new, cu_seqlens_q, seq_ids));
  ATTNKIT_RETURN_IF_ERROR(check_queries(fn, layer, q, out, lse, options, k_new, v_new));
  ATTNKIT_RETURN_IF_ERROR(check::dim(fn, "q", q, 0, "total_q", k_new.shape[0], "k_new.shape[0]"));
  plan_calls(layer, q, out, lse, options, cu_seqlens_q, seq_ids, false);
  write_step(layer, k_new, v_new, cu_seqlens_q, seq_ids);
  ATTNKIT_RETURN_IF_ERROR(kernels::run_attention(scratch_->calls, options.backend));
  finish_step(layer, seq_ids);
  return Status::Ok();
}

Status PagedKVCache::attend_held(int64_t layer, const TensorView& q,
                                 std::span<const int32_t> cu_seqlens_q,
                                 std::span<const int64_t> seq_ids, const TensorView& out,
                                 const AttentionOptions& options, const TensorView& lse) {
  constexpr const char* fn = "PagedKVCache::attend_held";
  const std::string f = fn;
  if (layer < 0 || layer >= spec_.num_layers)
    return invalid_argument(f + ": layer = " + str(layer) +
                            " must be in [0, num_layers = " + str(spec_.num_layers) + ")");
  ATTNKIT_RETURN_IF_ERROR(check_queries(fn, layer, q, out, lse, options, {}, {}));
  if (options.causal)
    return invalid_argument(f +
                            ": options.causal must be false; the queries follow every held "
                            "token and see all of them");
  if (options.window_size.left >= 0 || options.window_size.right >= 0 ||
      options.sparse.kind != SparsePattern::Kind::kNone || options.chunk_size != 0)
    return invalid_argument(f +
                            ": options.window_size must be (-1, -1), options.sparse off and "
                            "options.chunk_size 0; the held tokens' positions are not known to "
                            "the pool");
  if (spec_.sliding_window > 0 || spec_.chunk_size > 0)
    return invalid_argument(f + ": the pool's " +
                            (spec_.chunk_size > 0
                                 ? "chunk_size = " + str(spec_.chunk_size)
                                 : "sliding_window = " + str(spec_.sliding_window)) +
                            " must be 0; such a pool releases pages by position");
  const int64_t total_q = q.shape[0], n = static_cast<int64_t>(seq_ids.size());
  if (total_q > kMaxInt32)
    return invalid_argument(f + ": q.shape[0] = " + str(total_q) + " must be <= " + str(kMaxInt32));
  int32_t longest = 0;
  ATTNKIT_RETURN_IF_ERROR(
      check_cu_seqlens(fn, "cu_seqlens_q", cu_seqlens_q, n, total_q, "q.shape[0]", &longest));
  for (int64_t s = 0; s < n; ++s) {
    ATTNKIT_RETURN_IF_ERROR(find(fn, seq_ids[s]).status());
    for (int64_t t = 0; t < s; ++t)
      if (seq_ids[t] == seq_ids[s])
        return invalid_argument(f + ": seq_ids[" + str(s) + "] = " + str(seq_ids[s]) +
                                " repeats seq_ids[" + str(t) + "]; each sequence appears once");
  }
  plan_calls(layer, q, out, lse, options, cu_seqlens_q, seq_ids, true);
  return kernels::run_attention(scratch_->calls, options.backend);
}

}  // namespace attnkit
