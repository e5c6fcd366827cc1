// attnkit/paged_kv_cache.h — a paged KV pool shared by the layers of a
// model, for continuous batching (vLLM's PagedAttention, FlashInfer's and
// FlashAttention's page tables), and attention over it.
//
// The pool holds num_pages pages of page_size tokens for each of num_layers
// layers. Page p of layer l stores, for its page_size token slots,
//   keys   [page_size, num_kv_heads, head_dim]      (values likewise, head_dim_v)
// or, for MLA's latent layout (kv_lora_rank > 0), one tensor
//   latent [page_size, kv_lora_rank + qk_rope_head_dim]
// whose first kv_lora_rank columns are the values (the absorbed form's
// key is the whole row, its value the latent c).
//
// One allocation decision serves every layer: a sequence owns a list of
// pages (its page table), and token t of the sequence lives in slot
// t % page_size of page table[t / page_size] in every layer. A sequence
// wastes less than one page; dense caches reserve max_seq_len per sequence.
//
// Lifecycle (all sequence operations are O(pages touched), never O(pool)):
//   add_sequence()        a new, empty sequence; returns its id
//   append(ids, counts)   reserves the next counts[i] token slots of each
//                         sequence in every layer, all or nothing: if the
//                         free pages do not suffice it fails with
//                         kResourceExhausted naming the pages needed and
//                         free, and changes nothing. length(id) counts the
//                         reserved tokens at once.
//   attend(layer, ...)    writes the K/V of exactly the tokens reserved and
//                         not yet written in `layer`, then attends their
//                         queries causally over the whole sequence
//   attend_held(layer, ...) queries that are not in the pool over the
//                         tokens it holds (context parallelism's partial
//                         attention); writes and changes nothing
//   fork(id)              a new sequence sharing every page of id
//                         (reference counts); the first append that would
//                         write into a shared, partly filled last page copies
//                         it first (copy-on-write), so beams and parallel
//                         samples share their prefix without copying it
//   remove(id)            returns the pages whose count drops to zero
//   truncate(id, n)       forgets tokens n ... (rejected speculative tokens)
// With a sliding window of W (each token sees itself and the W - 1 before
// it), or chunks of C (each token sees its own chunk's tokens up to
// itself), pages whose tokens no later query can see are released as soon
// as every layer has written past them. Freed pages are reused; a page is
// never visible to two sequences unless one was forked from the other, or
// took it over from the prefix cache.
//
// Prefix caching (spec.prefix_caching, docs/PAGED.md "Prefix caching"):
// the pool keeps, for each full page that every layer has written and
// whose token ids it knows, a key chained over the whole prefix (hash of
// the parent page's key and this page's page_size token ids, vLLM's block
// hash). A page whose last holder goes stays in the pool as a cached-free
// page: free_pages() counts it, and append() (for new pages or a
// copy-on-write copy) evicts the least recently freed one only when no
// plain free page is left.
//   add_sequence(prompt)  takes over the longest run of cached pages that
//                         matches the prompt's first pages (page aligned,
//                         at most prompt length - 1 tokens, so the last
//                         token is always computed); returns the tokens it
//                         covers: length and every layer's written count
//                         start there, and the pool remembers the prompt's
//                         ids so append() of its tokens needs none
//   append(ids, counts, token_ids)  the same reservation, recording the
//                         token ids of the new tokens (decoded tokens)
//   probe_prefix(prompt)  what add_sequence(prompt) would take, for
//                         admission control; changes nothing
// A sequence never writes into a keyed page another may read: a shared or
// keyed partly filled page is copied or unkeyed first (copy-on-write).
//
// A pool is not thread-safe; attend() itself runs on num_threads threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/status.h"
#include "attnkit/tensor.h"

namespace attnkit {

struct PagedKVCacheSpec {
  int64_t num_layers = 1;
  int64_t num_pages = 0;
  int64_t page_size = 16;  // tokens per page, >= 1
  // MHA / MQA / GQA layout (kv_lora_rank == 0).
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t head_dim_v = 0;  // 0 = head_dim
  // MLA latent layout: kv_lora_rank >= 1 and qk_rope_head_dim >= 0; then
  // num_kv_heads, head_dim and head_dim_v must be 0 (they are 1,
  // kv_lora_rank + qk_rope_head_dim and kv_lora_rank).
  int64_t kv_lora_rank = 0;
  int64_t qk_rope_head_dim = 0;
  // kF32, kBF16, kI8 or kFp8E4M3. The 8-bit types quantize each token's
  // row of each kv head (latent layout: each block of 64 channels of the
  // latent row) once, when attend() or store() writes it, with one fp32
  // scale, kept in the token's row after its codes (as KVCache does:
  // include/attnkit/kv_cache.h).
  DType dtype = DType::kF32;
  int64_t sliding_window = 0;  // 0 = none, else W >= 1 for every layer
  // Chunked local attention on every layer (Llama 4): 0 = none, else C >= 1;
  // the pages of a finished chunk are released as a window releases pages.
  // At most one of sliding_window and chunk_size is set. A pool shared by
  // layers of different kinds leaves both 0 and each attend() call passes
  // its layer's window_size / chunk_size in its options.
  int64_t chunk_size = 0;
  // DeepSeek sparse attention (latent layout only): 0 = none, else each
  // token slot of each layer also holds the lightning indexer's key,
  // index_head_dim fp8 E4M3 codes and index_head_dim / 128 f32 scales
  // (index_head_dim a multiple of 128), in the same pages: freed, forked
  // and copied on write with the latent rows. Written by the layer
  // (LatentAttention::forward_batch) through index_keys() /
  // index_scales(); attend() and store() do not touch them.
  int64_t index_head_dim = 0;
  // Automatic prefix caching (see the top of this file). A pool with a
  // sliding_window or chunk_size refuses it: the pages a window releases
  // are gone, so a prefix of them cannot be taken over.
  bool prefix_caching = false;

  bool latent() const { return kv_lora_rank > 0; }
};

// add_sequence(prompt)'s answer: the new sequence and how many of the
// prompt's first tokens it took from the prefix cache (a multiple of
// page_size; 0 without prefix caching or without a hit). The caller
// computes tokens cached_tokens ... prompt length - 1 only.
struct PrefixMatch {
  int64_t seq_id = -1;
  int64_t cached_tokens = 0;
};

// probe_prefix(prompt)'s answer: what add_sequence(prompt) would take now,
// and how many of those pages are cached-free (taking them lowers
// free_pages() by that many). An engine's admission needs
//   ceil(prompt length / page_size) - cached_tokens / page_size new pages
// (for the whole prompt; fewer for a first chunk) <= free_pages() -
// cached_free_pages.
struct PrefixProbe {
  int64_t cached_tokens = 0;
  int64_t cached_free_pages = 0;
};

// Counters of the prefix cache since the pool was made (or
// reset_prefix_cache_stats()); the last two are the state now.
struct PrefixCacheStats {
  int64_t queries = 0;            // add_sequence(prompt) calls with prefix caching on
  int64_t query_tokens = 0;       // their prompts' tokens
  int64_t hits = 0;               // calls that took at least one page
  int64_t hit_pages = 0;          // pages taken over
  int64_t hit_tokens = 0;         // tokens taken over (hit_tokens / query_tokens: the hit rate)
  int64_t evictions = 0;          // cached-free pages unkeyed to be reused
  int64_t cached_pages = 0;       // keyed pages now, held or cached-free
  int64_t cached_free_pages = 0;  // keyed pages no sequence holds (counted in free_pages())
  bool operator==(const PrefixCacheStats&) const = default;
};

class PagedKVCache {
 public:
  static Result<PagedKVCache> create(const PagedKVCacheSpec& spec);

  PagedKVCache(PagedKVCache&&) noexcept;
  PagedKVCache& operator=(PagedKVCache&&) noexcept;
  ~PagedKVCache();

  // The spec with head_dim_v (and, for the latent layout, the head
  // fields) filled in.
  const PagedKVCacheSpec& spec() const { return spec_; }

  // A new empty sequence. Ids are never reused within a pool.
  int64_t add_sequence();

  // A new sequence for a prompt of token ids (>= 0). With prefix caching
  // it takes over the longest cached prefix of whole pages, at most
  // prompt.size() - 1 tokens (a prompt of exactly k pages reuses k - 1:
  // its last token must be computed for its logits), and the pool keeps
  // the prompt's ids for keying (append() needs no ids for them). Without
  // prefix caching: an empty sequence, cached_tokens 0. O(pages matched).
  Result<PrefixMatch> add_sequence(std::span<const int32_t> prompt_token_ids);
  // What add_sequence(prompt_token_ids) would take, changing nothing and
  // counting nothing (admission control before the request is added).
  // The same checks and O(pages matched) cost.
  Result<PrefixProbe> probe_prefix(std::span<const int32_t> prompt_token_ids) const;

  // Reserves num_new_tokens[i] slots at the end of sequence seq_ids[i] for
  // every layer (see the lifecycle above). The ids must exist and be
  // distinct; counts >= 0. Copy-on-write copies happen here.
  Status append(std::span<const int64_t> seq_ids, std::span<const int64_t> num_new_tokens);
  // append() that also gives the new tokens' ids, packed in seq_ids order
  // (sum(num_new_tokens) entries, each >= 0), so their pages can be keyed
  // once full and written by every layer. Ids at positions the sequence
  // knows already (its prompt) must equal them. Without prefix caching
  // they are checked and ignored. A sequence appended without ids past
  // the ids it knows is never keyed from there on.
  Status append(std::span<const int64_t> seq_ids, std::span<const int64_t> num_new_tokens,
                std::span<const int32_t> token_ids);

  // A new sequence sharing every page of seq_id. The parent must have
  // written all its reserved tokens in every layer. The child knows the ids
  // of the tokens written so far, not the rest of the parent's prompt.
  Result<int64_t> fork(int64_t seq_id);

  Status remove(int64_t seq_id);

  // Forgets the tokens of seq_id from new_length on (rejected speculative
  // tokens, a rolled-back step): pages past it return to the pool (keyed
  // ones to the prefix cache), every layer's written count and the known
  // token ids are clamped to it. A keyed page cut into stays as others
  // read it: the next append copies it (or unkeys it when no one else
  // holds it) before writing. new_length <= length,
  // and after a window has released pages, the next query (at position
  // new_length) must not need them: new_length >= first held token + W - 1
  // (chunks of C: new_length >= the first held token rounded up to a
  // multiple of C).
  Status truncate(int64_t seq_id, int64_t new_length);

  Result<int64_t> length(int64_t seq_id) const;
  // Tokens of seq_id that layer has written so far (<= length).
  Result<int64_t> written(int64_t seq_id, int64_t layer) const;
  // The pages holding seq_id's tokens in order; -1 marks pages released
  // because a sliding window no longer sees them.
  Result<std::vector<int32_t>> page_table(int64_t seq_id) const;
  std::vector<int64_t> sequence_ids() const;  // ascending
  int64_t num_sequences() const { return static_cast<int64_t>(sequences_.size()); }

  // Plain free pages plus cached-free ones (which an append may evict).
  // Whether attend() plans batch-invariant (the default, and what a new
  // pool does): a row's output bits depend on its own sequence's tokens
  // only, never on which sequences share the call, how the prompt was
  // chunked, what came from the prefix cache, or the thread count (fp32
  // and bf16 K/V; docs/PERFORMANCE.md "Batch invariance" says what 8-bit
  // K/V and windows keep). Off, attend() plans as sdpa does and may split a
  // long sequence's keys across threads: decode attention at 16K keys ran
  // 1.4-1.7x faster in the paired benchmark there, and outputs then agree
  // with the invariant ones to rounding only. May change between calls.
  bool batch_invariant() const { return batch_invariant_; }
  void set_batch_invariant(bool on) { batch_invariant_ = on; }

  int64_t free_pages() const { return static_cast<int64_t>(free_.size()) + lru_size_; }
  int64_t pages_in_use() const { return spec_.num_pages - free_pages(); }
  // Bytes of K/V values one page holds across all layers (the KV memory
  // formula per page: num_layers * page_size * (keys + values per token) *
  // dtype size, plus the 8-bit types' fp32 scales; row padding excluded),
  // and the whole pool's.
  size_t page_nbytes() const;
  size_t nbytes() const { return page_nbytes() * static_cast<size_t>(spec_.num_pages); }

  PrefixCacheStats prefix_cache_stats() const;
  void reset_prefix_cache_stats();  // the counters; the cache itself stays
  // The cached-free pages, least recently freed (next evicted) first. For
  // inspection and tests: O(cached-free pages).
  std::vector<int32_t> cached_free_pages() const;

  // Storage of one layer, for inspection and tests (strided views):
  //   keys   [num_pages * page_size, num_kv_heads, head_dim]
  //   values [num_pages * page_size, num_kv_heads, head_dim_v]
  // (token slot s of page p is row p * page_size + s). The latent layout
  // has keys [num_pages * page_size, 1, kv_lora_rank + qk_rope_head_dim]
  // and values = the first kv_lora_rank columns of the same rows.
  Result<TensorView> keys(int64_t layer) const;
  Result<TensorView> values(int64_t layer) const;
  // The 8-bit types' scales of the same rows, [num_pages * page_size,
  // num_kv_heads, scales per head] f32 (1 per head; the latent layout:
  // ceil((kv_lora_rank + qk_rope_head_dim) / 64), values sharing the keys');
  // an absent view for f32 and bf16.
  Result<TensorView> key_scales(int64_t layer) const;
  Result<TensorView> value_scales(int64_t layer) const;
  // The indexer keys of the same rows (spec.index_head_dim > 0, else an
  // absent view): codes [num_pages * page_size, index_head_dim] fp8_e4m3
  // and scales [num_pages * page_size, index_head_dim / 128] f32,
  // contiguous and writable.
  Result<TensorView> index_keys(int64_t layer) const;
  Result<TensorView> index_scales(int64_t layer) const;

  // Batch attention over the pool, one call per layer and step (FlashInfer's
  // BatchPrefillWithPagedKVCache). For the n = seq_ids.size() sequences:
  //   q      [total_q, num_heads, head_dim]       f32
  //   k_new  [total_q, num_kv_heads, head_dim]    f32 (latent: [total_q, 1,
  //                                               kv_lora_rank + qk_rope_head_dim])
  //   v_new  [total_q, num_kv_heads, head_dim_v]  f32 (latent: absent)
  //   out    [total_q, num_heads, head_dim_v]     f32, written
  //   lse    [num_heads, total_q]                 f32, optional, written
  // Sequence s owns rows [cu_seqlens_q[s], cu_seqlens_q[s + 1]) of them
  // (n + 1 offsets from 0 to total_q); its n_s rows are the n_s newest
  // reserved tokens, positions length - n_s ... length - 1, which must be
  // exactly the tokens `layer` has not written yet. Their K/V are written
  // to their slots, then each query attends causally to every earlier token
  // of its sequence and the new ones up to itself (within the pool's window
  // and options.window_size, whichever is narrower). One call may mix whole
  // prompts, prompt chunks, single decode tokens and multi-token steps.
  // From options: softmax_scale, softcap, window_size, chunk_size (0 or,
  // in a pool with chunks, the pool's), sinks, sparse (absolute
  // positions), backend, num_threads; a mask or seqlens_k is an error and
  // causal is implied. The pool's chunk_size applies to every call. A failed call changes nothing
  // (no length, page or written count; the slots it may have filled were unwritten).
  Status attend(int64_t layer, const TensorView& q, const TensorView& k_new,
                const TensorView& v_new, std::span<const int32_t> cu_seqlens_q,
                std::span<const int64_t> seq_ids, const TensorView& out,
                const AttentionOptions& options = {}, const TensorView& lse = {});

  // Attention of queries that are not tokens of the pool over the tokens
  // `layer` has written for each sequence: every query row sees every one
  // of them (no mask: the queries stand after them), nothing is written and
  // nothing changes. This is the partial attention of context parallelism
  // (docs/DISTRIBUTED.md): a rank holding a share of a sequence's tokens
  // attends the new tokens over its share, and dist::merge_partial_attention
  // combines the ranks' (out, lse). q, out and lse as in attend(); a
  // sequence with no written tokens gives out 0 and lse -inf. From options:
  // softmax_scale, softcap, sinks (pass them to one rank's call only, as
  // the merge counts every call's), backend, num_threads; causal, a window,
  // a chunk, a sparse pattern, a mask or seqlens_k is an error (the held
  // tokens' positions are not the pool's to know), and so is a pool with a
  // sliding_window or chunk_size (it releases pages by position).
  Status attend_held(int64_t layer, const TensorView& q, std::span<const int32_t> cu_seqlens_q,
                     std::span<const int64_t> seq_ids, const TensorView& out,
                     const AttentionOptions& options = {}, const TensorView& lse = {});

  // attend() without the attention: writes the K/V of exactly the reserved
  // tokens `layer` has not written (same k_new, v_new and cu_seqlens
  // layout), to restore a saved cache or a prefix computed elsewhere.
  Status store(int64_t layer, const TensorView& k_new, const TensorView& v_new,
               std::span<const int32_t> cu_seqlens, std::span<const int64_t> seq_ids);

 private:
  // A keyed page's place in its chain: its key and the serial number of its
  // keying (the page's parent is named by serial, which no other keying
  // ever reuses, so a page evicted and keyed again is a different parent).
  struct ChainLink {
    uint64_t key = 0;
    uint64_t serial = 0;
  };
  // Per page, with prefix caching.
  struct PageMeta {
    ChainLink link;              // serial 0: not keyed
    uint64_t parent_serial = 0;  // 0: the first page of a prompt
    int32_t lru_prev = -1, lru_next = -1;
  };

  struct Sequence {
    int64_t length = 0;
    int64_t released = 0;          // leading pages released by the window (-1 in pages)
    std::vector<int32_t> pages;    // ceil(length / page_size) entries
    std::vector<int64_t> written;  // per layer: tokens whose K/V are written
    // Prefix caching: the token ids known (from position 0; may run past
    // length: the prompt), and per leading page the chain link it was keyed
    // under (its own key, or an equal page's when one was keyed first).
    std::vector<int32_t> tokens;
    std::vector<ChainLink> chain;
    bool untracked = false;  // appended past its known ids: never keyed again
  };

  struct AttendScratch;  // attend()'s per-call tables, kept so steps do not allocate

  PagedKVCache();
  Status check_step(const char* fn, int64_t layer, const TensorView& k_new, const TensorView& v_new,
                    std::span<const int32_t> cu_seqlens, std::span<const int64_t> seq_ids) const;
  void write_step(int64_t layer, const TensorView& k_new, const TensorView& v_new,
                  std::span<const int32_t> cu_seqlens, std::span<const int64_t> seq_ids);
  void finish_step(int64_t layer, std::span<const int64_t> seq_ids);
  Status check_queries(const char* fn, int64_t layer, const TensorView& q, const TensorView& out,
                       const TensorView& lse, const AttentionOptions& options,
                       const TensorView& k_new, const TensorView& v_new) const;
  void plan_calls(int64_t layer, const TensorView& q, const TensorView& out, const TensorView& lse,
                  const AttentionOptions& options, std::span<const int32_t> cu_seqlens_q,
                  std::span<const int64_t> seq_ids, bool held);
  void release_unseen(Sequence* seq);
  int32_t take_page();
  void drop_page(int32_t page);
  void drop_pages(const std::vector<int32_t>& pages, size_t from);
  void lru_push(int32_t page);
  void lru_erase(int32_t page);
  void unkey(int32_t page);
  void forget(int32_t page);
  void key_full_pages(Sequence* seq);
  uint64_t page_hash(uint64_t parent_key, const int32_t* tokens) const;
  Status check_prompt(const char* fn, std::span<const int32_t> prompt) const;
  void match_prefix(std::span<const int32_t> prompt, std::vector<int32_t>* pages,
                    std::vector<ChainLink>* chain) const;
  Status append_impl(std::span<const int64_t> seq_ids, std::span<const int64_t> num_new_tokens,
                     const std::span<const int32_t>* token_ids);
  Status check_token_ids(std::span<const int64_t> seq_ids, std::span<const int64_t> num_new_tokens,
                         std::span<const int32_t> token_ids) const;
  void record_tokens(Sequence* seq, int64_t len, int64_t n,
                     const std::span<const int32_t>* token_ids, size_t at);
  void copy_page(int32_t from, int32_t to, int64_t tokens);
  Result<Sequence*> find(const char* fn, int64_t seq_id);
  Result<const Sequence*> find(const char* fn, int64_t seq_id) const;

  PagedKVCacheSpec spec_;
  bool batch_invariant_ = true;
  int64_t k_token_stride_ = 0, v_token_stride_ = 0;  // elements between token rows
  // 8-bit types: bytes from a row's start to its scales, scales per head.
  int64_t k_scale_offset_ = 0, v_scale_offset_ = 0, k_scales_per_head_ = 0, v_scales_per_head_ = 0;
  std::vector<Tensor> k_, v_;  // per layer (v_ empty when latent)
  std::vector<int32_t> free_;  // a stack: the next page to hand out last
  std::vector<int32_t> refs_;  // per page: sequences that hold it
  std::unordered_map<int64_t, Sequence> sequences_;
  int64_t next_id_ = 0;
  // Prefix caching (empty without): per page its chain link and LRU links,
  // its token ids [num_pages * page_size]; key -> page; the LRU list of
  // cached-free pages (head: next evicted).
  std::vector<PageMeta> meta_;
  std::vector<int32_t> page_tokens_;
  std::unordered_map<uint64_t, int32_t> keyed_;
  int32_t lru_head_ = -1, lru_tail_ = -1;
  int64_t lru_size_ = 0;
  uint64_t next_serial_ = 1;
  uint64_t key_mask_ = ~uint64_t{0};  // narrowed by tests to force key collisions
  PrefixCacheStats stats_;
  friend struct PagedKVCacheTesting;
  std::unique_ptr<AttendScratch> scratch_;
  // Per layer when spec_.index_head_dim > 0: the indexer keys' codes and scales.
  std::vector<Tensor> index_codes_, index_scales_;
};

// attnkit.batch_attention's C++ name: cache.attend(layer, ...).
inline Status batch_attention(const TensorView& q, const TensorView& k_new, const TensorView& v_new,
                              std::span<const int32_t> cu_seqlens_q,
                              std::span<const int64_t> seq_ids, PagedKVCache& cache, int64_t layer,
                              const TensorView& out, const AttentionOptions& options = {},
                              const TensorView& lse = {}) {
  return cache.attend(layer, q, k_new, v_new, cu_seqlens_q, seq_ids, out, options, lse);
}

}  // namespace attnkit
