// Bindings for serving-style attention: class PagedKVCache (the paged pool
// shared by a model's layers), batch_attention (one step over the pool) and
// sdpa_varlen (FlashAttention's varlen attention over packed sequences).
// Inputs are viewed in place where they can be (numpy_util.h); compute runs
// without the GIL.
#include "paged.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/paged_kv_cache.h"
#include "attnkit/tensor.h"
#include "bindings.h"
#include "kv_cache.h"
#include "numpy_util.h"

namespace attnkit::python {

PyPagedKVCache& paged_cache_arg(py::handle cache, const char* fn) {
  if (!py::isinstance<PyPagedKVCache>(cache))
    raise_value_error(fn, "cache must be a PagedKVCache, got " +
                              py::repr(py::type::handle_of(cache)).cast<std::string>());
  return *cache.cast<PyPagedKVCache*>();
}

std::vector<int64_t> int64_list(py::handle obj, const char* fn, const char* name) {
  if (py::isinstance<py::int_>(obj))
    raise_value_error(fn, std::string(name) + " must be a sequence of ints, got an int");
  // [] is a valid empty step (numpy would make it float64).
  if (py::isinstance<py::sequence>(obj) && !py::isinstance<py::str>(obj) && py::len(obj) == 0)
    return {};
  return int64_values(obj, {fn, name, 1, 1, "[n]"});
}

std::vector<int32_t> offsets_arg(py::handle obj, const char* fn, const char* name) {
  std::vector<int32_t> out;
  for (int64_t x : int64_list(obj, fn, name)) {
    if (x < std::numeric_limits<int32_t>::min() || x > std::numeric_limits<int32_t>::max())
      raise_value_error(fn, std::string(name) + " holds " + std::to_string(x) +
                                ", which does not fit int32 offsets");
    out.push_back(static_cast<int32_t>(x));
  }
  return out;
}

namespace {

// Token ids: ints that fit int32 (the C++ call checks that they are >= 0).
std::vector<int32_t> token_list(py::handle obj, const char* fn, const char* name) {
  std::vector<int32_t> out;
  for (int64_t x : int64_list(obj, fn, name)) {
    if (x < std::numeric_limits<int32_t>::min() || x > std::numeric_limits<int32_t>::max())
      raise_value_error(fn, std::string(name) + " holds " + std::to_string(x) +
                                ", which does not fit an int32 token id");
    out.push_back(static_cast<int32_t>(x));
  }
  return out;
}

// A float32 copy [num_pages * page_size, heads, dim] of a layer's storage
// (bf16 widened exactly, 8-bit types dequantized).
py::array storage_copy(PyPagedKVCache& c, int64_t layer, bool keys) {
  // Copied holding the GIL and the pool: nothing that holds the pool waits
  // for the GIL.
  std::lock_guard<std::mutex> lock(c.mu);
  const TensorView data = value_or_throw(keys ? c.pool.keys(layer) : c.pool.values(layer));
  const TensorView scales =
      value_or_throw(keys ? c.pool.key_scales(layer) : c.pool.value_scales(layer));
  if (!scales.present()) return copy_to_numpy(data);
  // One scale per head row, or per kLatentScaleBlock channels of a latent row.
  return dequantize_to_numpy(data, scales,
                             c.pool.spec().latent() ? kLatentScaleBlock : data.shape[2]);
}

py::object batch_attention_py(py::object q, py::object k_new, py::object v_new,
                              py::object cu_seqlens_q, py::object seq_ids, py::object cache,
                              int64_t layer, std::optional<double> softmax_scale, double softcap,
                              py::object window_size, py::object sparse, bool return_lse,
                              const std::string& backend, int num_threads, py::object sinks,
                              int64_t chunk_size) {
  constexpr const char* kFn = "batch_attention";
  PyPagedKVCache& c = paged_cache_arg(cache, kFn);
  const bool latent = c.pool.spec().latent();
  const InputArray qi = f32_input(q, {kFn, "q", 3, 3, "[total_q, num_heads, head_dim]"});
  const InputArray ki = f32_input(k_new, {kFn, "k_new", 3, 3, "[total_q, num_kv_heads, head_dim]"});
  InputArray vi;
  if (!v_new.is_none())
    vi = f32_input(v_new, {kFn, "v_new", 3, 3, "[total_q, num_kv_heads, head_dim_v]"});
  else if (!latent)
    raise_value_error(kFn, "v_new is None; only a latent (MLA) pool takes no v_new");
  const std::vector<int32_t> cu = offsets_arg(cu_seqlens_q, kFn, "cu_seqlens_q");
  const std::vector<int64_t> ids = int64_list(seq_ids, kFn, "seq_ids");
  AttentionOptions opt;
  opt.softmax_scale = parse_softmax_scale(softmax_scale, kFn);
  opt.softcap = static_cast<float>(softcap);
  opt.window_size = parse_window_size(window_size, kFn);
  opt.sparse = parse_sparse(sparse, kFn);
  opt.backend = parse_backend(backend, kFn);
  opt.num_threads = num_threads;
  InputArray si;
  parse_sinks_and_chunk(sinks, chunk_size, kFn, &opt, &si);
  const int64_t total = qi.view.shape[0], heads = qi.view.shape[1];
  TensorView out, lse;
  py::array out_a = new_array(DType::kF32, {total, heads, c.pool.spec().head_dim_v}, &out);
  py::array lse_a;
  if (return_lse) lse_a = new_array(DType::kF32, {heads, total}, &lse);
  const Status st = locked(c.mu, [&] {
    return c.pool.attend(layer, qi.view, ki.view, vi.view, cu, ids, out, opt, lse);
  });
  throw_if_error(st);
  if (!return_lse) return out_a;
  return py::make_tuple(out_a, lse_a);
}

py::object attend_held_py(PyPagedKVCache& c, int64_t layer, py::object q, py::object cu_seqlens_q,
                          py::object seq_ids, std::optional<double> softmax_scale, double softcap,
                          bool return_lse, const std::string& backend, int num_threads,
                          py::object sinks) {
  constexpr const char* kFn = "PagedKVCache.attend_held";
  const InputArray qi = f32_input(q, {kFn, "q", 3, 3, "[total_q, num_heads, head_dim]"});
  const std::vector<int32_t> cu = offsets_arg(cu_seqlens_q, kFn, "cu_seqlens_q");
  const std::vector<int64_t> ids = int64_list(seq_ids, kFn, "seq_ids");
  AttentionOptions opt;
  opt.softmax_scale = parse_softmax_scale(softmax_scale, kFn);
  opt.softcap = static_cast<float>(softcap);
  opt.backend = parse_backend(backend, kFn);
  opt.num_threads = num_threads;
  InputArray si;
  parse_sinks_and_chunk(sinks, 0, kFn, &opt, &si);
  const int64_t total = qi.view.shape[0], heads = qi.view.shape[1];
  TensorView out, lse;
  py::array out_a = new_array(DType::kF32, {total, heads, c.pool.spec().head_dim_v}, &out);
  py::array lse_a;
  if (return_lse) lse_a = new_array(DType::kF32, {heads, total}, &lse);
  const Status st =
      locked(c.mu, [&] { return c.pool.attend_held(layer, qi.view, cu, ids, out, opt, lse); });
  throw_if_error(st);
  if (!return_lse) return out_a;
  return py::make_tuple(out_a, lse_a);
}

py::object sdpa_varlen_py(py::object q, py::object k, py::object v, py::object cu_seqlens_q,
                          py::object cu_seqlens_k, py::object max_seqlen_q, py::object max_seqlen_k,
                          std::optional<double> softmax_scale, bool causal, py::object window_size,
                          double softcap, bool return_lse, py::object mask, py::object sparse,
                          bool return_probs, const std::string& kv_dtype,
                          const std::string& backend, int num_threads, py::object sinks,
                          int64_t chunk_size) {
  constexpr const char* kFn = "sdpa_varlen";
  const InputArray qi = f32_input(q, {kFn, "q", 3, 3, "[total_q, num_heads, head_dim]"});
  const InputArray ki = f32_input(k, {kFn, "k", 3, 3, "[total_k, num_kv_heads, head_dim]"});
  const InputArray vi = f32_input(v, {kFn, "v", 3, 3, "[total_k, num_kv_heads, head_dim_v]"});
  const std::vector<int32_t> cu_q = offsets_arg(cu_seqlens_q, kFn, "cu_seqlens_q");
  const std::vector<int32_t> cu_k = offsets_arg(cu_seqlens_k, kFn, "cu_seqlens_k");
  const DType kv = parse_cache_dtype(kv_dtype, kFn, "kv_dtype", false);
  // Offsets the library will reject size nothing here: probs and the
  // max_seqlen bounds wait for offsets that start at 0, never decrease and
  // end at the row count (the rule sdpa_varlen states), so that bad offsets
  // get the library's message naming them rather than numpy's "array is too
  // big" or a complaint about max_seqlen.
  const int64_t totals[2] = {qi.view.shape[0], ki.view.shape[0]};
  const std::vector<int32_t>* cus[2] = {&cu_q, &cu_k};
  bool in_order = !cu_q.empty() && cu_k.size() == cu_q.size();
  for (int a = 0; a < 2 && in_order; ++a) {
    const std::vector<int32_t>& cu = *cus[a];
    in_order = cu.front() == 0 && cu.back() == totals[a] && std::is_sorted(cu.begin(), cu.end());
  }
  // The longest sequences, and FlashAttention's max_seqlen bounds checked
  // against them (they only size buffers there).
  int64_t longest[2] = {0, 0};
  py::object given[2] = {max_seqlen_q, max_seqlen_k};
  const char* names[2] = {"max_seqlen_q", "max_seqlen_k"};
  for (int a = 0; a < 2 && in_order; ++a) {
    for (size_t s = 1; s < cus[a]->size(); ++s)
      longest[a] = std::max<int64_t>(longest[a], int64_t{(*cus[a])[s]} - (*cus[a])[s - 1]);
    if (given[a].is_none()) continue;
    const int64_t bound = checked_int(given[a], kFn, names[a]);
    if (bound < longest[a])
      raise_value_error(kFn, std::string(names[a]) + " = " + std::to_string(bound) +
                                 " is less than the longest sequence, " +
                                 std::to_string(longest[a]));
  }
  InputArray mi;
  AttentionOptions opt = parse_sdpa_options(kFn, softmax_scale, causal, window_size, softcap, mask,
                                            sparse, backend, num_threads, &mi);
  InputArray si;
  parse_sinks_and_chunk(sinks, chunk_size, kFn, &opt, &si);
  const int64_t total_q = qi.view.shape[0], heads = qi.view.shape[1];
  const int64_t n = cu_q.empty() ? 0 : static_cast<int64_t>(cu_q.size()) - 1;
  TensorView out, lse, probs;
  py::array out_a = new_array(DType::kF32, {total_q, heads, vi.view.shape[2]}, &out);
  py::array lse_a, probs_a;
  if (return_lse) lse_a = new_array(DType::kF32, {heads, total_q}, &lse);
  if (return_probs && in_order)
    probs_a = new_array(DType::kF32, {n, heads, longest[0], longest[1]}, &probs);
  Status st;
  {
    py::gil_scoped_release nogil;
    if (kv == DType::kBF16) {
      Result<Tensor> kb = Tensor::zeros(DType::kBF16, ki.view.shape.data(), 3);
      Result<Tensor> vb = Tensor::zeros(DType::kBF16, vi.view.shape.data(), 3);
      st = !kb.ok() ? kb.status() : !vb.ok() ? vb.status() : Status::Ok();
      if (st.ok()) {
        round_to_bf16(ki.view, kb->ptr<bf16>());
        round_to_bf16(vi.view, vb->ptr<bf16>());
        st = sdpa_varlen(qi.view, kb->view(), vb->view(), cu_q, cu_k, out, opt, lse, probs);
      }
    } else {
      st = sdpa_varlen(qi.view, ki.view, vi.view, cu_q, cu_k, out, opt, lse, probs);
    }
  }
  throw_if_error(st);
  if (return_probs && !in_order)  // sdpa_varlen accepted offsets the check above did not
    throw std::logic_error("sdpa_varlen: probs were not sized; report this as a bug");
  if (!return_lse && !return_probs) return out_a;
  if (return_lse && return_probs) return py::make_tuple(out_a, lse_a, probs_a);
  return py::make_tuple(out_a, return_lse ? lse_a : probs_a);
}

constexpr const char* kPagedDoc = R"doc(
A paged KV pool shared by the layers of a model (vLLM's PagedAttention):
num_pages pages of page_size token slots for each of num_layers layers.
A page of a layer holds keys [page_size, num_kv_heads, head_dim] and values
[page_size, num_kv_heads, head_dim_v], or, with kv_lora_rank > 0 (MLA),
one latent row [page_size, kv_lora_rank + qk_rope_head_dim] per token,
as kv_dtype "float32", "bfloat16", "int8" or "fp8_e4m3" (the 8-bit types
keep one float32 scale per token row of a kv head, or per 64 channels of a
latent row; keys() and values() return code * scale as float32).

    cache = attnkit.PagedKVCache(num_layers=2, num_pages=512, page_size=16,
                                 num_kv_heads=8, head_dim=128)
    a = cache.add_sequence(); b = cache.add_sequence()
    cache.append([a, b], [37, 1])      # reserve this step's slots, all layers
    out = attnkit.batch_attention(q, k_new, v_new, [0, 37, 38], [a, b], cache, layer=0)
    c = cache.fork(a); cache.remove(b); cache.length(a); cache.free_pages()

append() is all or nothing: when the free pages do not suffice it raises
MemoryError ("out of pages ...") and reserves nothing. fork() shares every
page (the partly filled last page is copied on the first append that
writes into it). With sliding_window W, pages no later query can see are
released; with chunk_size C (chunked local attention on every layer),
the pages of finished chunks. A pool shared by layers of different kinds
leaves both 0 and passes each layer's window_size / chunk_size to
batch_attention. docs/PAGED.md has the layout, the lifecycle and the
formulas.
)doc";

constexpr const char* kBatchAttentionDoc = R"doc(
One step of attention over a PagedKVCache (FlashInfer's batch prefill with
a paged KV cache), mixing prompts, prompt chunks, decodes and multi-token
steps in one call:

    q      [total_q, num_heads, head_dim]
    k_new  [total_q, num_kv_heads, head_dim]   (latent pool: [total_q, 1,
                                                kv_lora_rank + qk_rope_head_dim])
    v_new  [total_q, num_kv_heads, head_dim_v] (latent pool: None)
    ->     out [total_q, num_heads, head_dim_v] float32 (and lse [num_heads,
           total_q] with return_lse)

Sequence seq_ids[s] owns rows cu_seqlens_q[s] ... cu_seqlens_q[s + 1] - 1:
the tokens it reserved with cache.append() that `layer` has not written yet.
Their K/V are written into the pool, then each query attends causally to
every earlier token of its sequence and the new ones up to itself (within
the pool's sliding window and window_size, and the chunk: the pool's
chunk_size or, in a pool without one, chunk_size). sinks: float
[num_heads], as in sdpa. A sequence's output does not depend on the other
sequences of the step.
)doc";

constexpr const char* kAttendHeldDoc = R"doc(
Attention of queries that are not tokens of the pool over the tokens
`layer` holds for each sequence: q [total_q, num_heads, head_dim], sequence
seq_ids[s] owning rows cu_seqlens_q[s] ... cu_seqlens_q[s + 1] - 1, and
every query sees every token of its sequence that `layer` has written (no
mask). Nothing is written or changed. -> out [total_q, num_heads,
head_dim_v] float32 (and lse [num_heads, total_q] with return_lse; -inf
for a sequence with no tokens). This is a rank's partial attention in
context parallelism: combine the ranks' (out, lse) with
attnkit.dist.merge_partial_attention (pass sinks, float [num_heads], to
one rank only: the merge counts every rank's). Pools with a
sliding_window or chunk_size are rejected.
)doc";

constexpr const char* kVarlenDoc = R"doc(
FlashAttention's flash_attn_varlen_func: attention over sequences of
different lengths packed along one token axis.

    q  [total_q, num_heads, head_dim], k [total_k, num_kv_heads, head_dim],
    v  [total_k, num_kv_heads, head_dim_v]
    cu_seqlens_q, cu_seqlens_k: n + 1 offsets (0 first, total last)
    -> out [total_q, num_heads, head_dim_v] float32
       (+ lse [num_heads, total_q] with return_lse,
        + probs [n, num_heads, max_seqlen_q, max_seqlen_k] with return_probs)

Each sequence is an sdpa() batch item of its own lengths: bottom-right
causal alignment, window_size, chunk_size, sinks, softcap, sparse, and
masks broadcast to [n, num_heads, max_seqlen_q, max_seqlen_k] (as in
sdpa). max_seqlen_q / max_seqlen_k are
accepted for FlashAttention compatibility and checked against the offsets.
)doc";

}  // namespace

void bind_paged(py::module_& m) {
  py::class_<PyPagedKVCache>(m, "PagedKVCache", kPagedDoc)
      .def(py::init([](int64_t num_layers, int64_t num_pages, int64_t page_size,
                       int64_t num_kv_heads, int64_t head_dim, std::optional<int64_t> head_dim_v,
                       const std::string& kv_dtype, int64_t sliding_window, int64_t kv_lora_rank,
                       int64_t qk_rope_head_dim, int64_t chunk_size, bool prefix_caching) {
             PagedKVCacheSpec spec;
             spec.num_layers = num_layers;
             spec.num_pages = num_pages;
             spec.page_size = page_size;
             spec.num_kv_heads = num_kv_heads;
             spec.head_dim = head_dim;
             spec.head_dim_v = head_dim_v.value_or(0);
             spec.kv_lora_rank = kv_lora_rank;
             spec.qk_rope_head_dim = qk_rope_head_dim;
             spec.dtype = parse_cache_dtype(kv_dtype, "PagedKVCache", "kv_dtype");
             spec.sliding_window = sliding_window;
             spec.chunk_size = chunk_size;
             spec.prefix_caching = prefix_caching;
             return std::make_unique<PyPagedKVCache>(value_or_throw(PagedKVCache::create(spec)));
           }),
           py::kw_only(), py::arg("num_layers") = 1, py::arg("num_pages"),
           py::arg("page_size") = 16, py::arg("num_kv_heads") = 0, py::arg("head_dim") = 0,
           py::arg("head_dim_v") = py::none(), py::arg("kv_dtype") = "float32",
           py::arg("sliding_window") = 0, py::arg("kv_lora_rank") = 0,
           py::arg("qk_rope_head_dim") = 0, py::arg("chunk_size") = 0,
           py::arg("prefix_caching") = false)
      .def(
          "add_sequence",
          [](PyPagedKVCache& c, py::object prompt_token_ids) -> py::object {
            if (prompt_token_ids.is_none())
              return py::int_(locked(c.mu, [&] { return c.pool.add_sequence(); }));
            const std::vector<int32_t> prompt =
                token_list(prompt_token_ids, "PagedKVCache.add_sequence", "prompt_token_ids");
            const PrefixMatch match =
                value_or_throw(locked(c.mu, [&] { return c.pool.add_sequence(prompt); }));
            return py::make_tuple(match.seq_id, match.cached_tokens);
          },
          py::arg("prompt_token_ids") = py::none(),
          "A new sequence; returns its id (ids are never reused). With prompt_token_ids "
          "(a list of token ids), returns (id, cached_tokens): with prefix_caching the sequence "
          "starts with the longest cached page-aligned prefix of the prompt (at most len - 1 "
          "tokens), and only tokens cached_tokens ... len - 1 remain to compute.")
      .def(
          "append",
          [](PyPagedKVCache& c, py::object seq_ids, py::object num_new_tokens,
             py::object token_ids) {
            const auto ids = int64_list(seq_ids, "PagedKVCache.append", "seq_ids");
            const auto n = int64_list(num_new_tokens, "PagedKVCache.append", "num_new_tokens");
            if (token_ids.is_none()) {
              throw_if_error(locked(c.mu, [&] { return c.pool.append(ids, n); }));
              return;
            }
            const std::vector<int32_t> t =
                token_list(token_ids, "PagedKVCache.append", "token_ids");
            throw_if_error(locked(c.mu, [&] { return c.pool.append(ids, n, t); }));
          },
          py::arg("seq_ids"), py::arg("num_new_tokens"), py::arg("token_ids") = py::none(),
          "Reserves num_new_tokens[i] slots at the end of sequence seq_ids[i] in every layer, "
          "all or nothing (MemoryError when out of pages, changing nothing). token_ids: the new "
          "tokens' ids packed in seq_ids order (sum(num_new_tokens) of them), so that prefix "
          "caching can key their pages; ids of a prompt given to add_sequence need not be "
          "repeated.")
      .def(
          "probe_prefix",
          [](PyPagedKVCache& c, py::object prompt_token_ids) {
            const std::vector<int32_t> prompt =
                token_list(prompt_token_ids, "PagedKVCache.probe_prefix", "prompt_token_ids");
            const PrefixProbe p =
                value_or_throw(locked(c.mu, [&] { return c.pool.probe_prefix(prompt); }));
            return py::make_tuple(p.cached_tokens, p.cached_free_pages);
          },
          py::arg("prompt_token_ids"),
          "What add_sequence(prompt_token_ids) would take now, changing nothing: "
          "(cached_tokens, cached_free_pages), the latter the pages taking them removes from "
          "free_pages() (for admission control).")
      .def(
          "prefix_cache_stats",
          [](PyPagedKVCache& c) {
            const PrefixCacheStats s = locked(c.mu, [&] { return c.pool.prefix_cache_stats(); });
            py::dict d;
            d["queries"] = s.queries;
            d["query_tokens"] = s.query_tokens;
            d["hits"] = s.hits;
            d["hit_pages"] = s.hit_pages;
            d["hit_tokens"] = s.hit_tokens;
            d["evictions"] = s.evictions;
            d["cached_pages"] = s.cached_pages;
            d["cached_free_pages"] = s.cached_free_pages;
            return d;
          },
          "The prefix cache's counters as a dict: queries, query_tokens, hits, hit_pages, "
          "hit_tokens (hit_tokens / query_tokens is the hit rate), evictions, and the "
          "cached_pages and cached_free_pages held now.")
      .def(
          "reset_prefix_cache_stats",
          [](PyPagedKVCache& c) { locked(c.mu, [&] { c.pool.reset_prefix_cache_stats(); }); },
          "Zeroes the prefix cache's counters; the cached pages stay.")
      .def(
          "cached_free_pages",
          [](PyPagedKVCache& c) {
            return locked(c.mu, [&] { return c.pool.cached_free_pages(); });
          },
          "The cached-free pages, the next to be evicted first.")
      .def(
          "fork",
          [](PyPagedKVCache& c, int64_t id) {
            return value_or_throw(locked(c.mu, [&] { return c.pool.fork(id); }));
          },
          py::arg("seq_id"), "A new sequence sharing every page of seq_id; returns its id.")
      .def(
          "remove",
          [](PyPagedKVCache& c, int64_t id) {
            throw_if_error(locked(c.mu, [&] { return c.pool.remove(id); }));
          },
          py::arg("seq_id"), "Removes the sequence; pages no other sequence holds are freed.")
      .def(
          "truncate",
          [](PyPagedKVCache& c, int64_t id, int64_t n) {
            throw_if_error(locked(c.mu, [&] { return c.pool.truncate(id, n); }));
          },
          py::arg("seq_id"), py::arg("new_length"),
          "Forgets the sequence's tokens from new_length on (rejected speculative tokens).")
      .def(
          "store",
          [](PyPagedKVCache& c, int64_t layer, py::object k_new, py::object v_new,
             py::object cu_seqlens, py::object seq_ids) {
            constexpr const char* kFn = "PagedKVCache.store";
            const InputArray ki =
                f32_input(k_new, {kFn, "k_new", 3, 3, "[total, num_kv_heads, head_dim]"});
            InputArray vi;
            if (!v_new.is_none())
              vi = f32_input(v_new, {kFn, "v_new", 3, 3, "[total, num_kv_heads, head_dim_v]"});
            const auto cu = offsets_arg(cu_seqlens, kFn, "cu_seqlens");
            const auto ids = int64_list(seq_ids, kFn, "seq_ids");
            throw_if_error(
                locked(c.mu, [&] { return c.pool.store(layer, ki.view, vi.view, cu, ids); }));
          },
          py::arg("layer"), py::arg("k_new"), py::arg("v_new"), py::arg("cu_seqlens"),
          py::arg("seq_ids"),
          "Writes the reserved tokens' K/V of `layer` without attending (a restored or shared "
          "prefix); the same layout as batch_attention's k_new and v_new.")
      .def("attend_held", &attend_held_py, py::arg("layer"), py::arg("q"), py::arg("cu_seqlens_q"),
           py::arg("seq_ids"), py::kw_only(), py::arg("softmax_scale") = py::none(),
           py::arg("softcap") = 0.0, py::arg("return_lse") = false, py::arg("backend") = "auto",
           py::arg("num_threads") = 0, py::arg("sinks") = py::none(), kAttendHeldDoc)
      .def(
          "length",
          [](PyPagedKVCache& c, int64_t id) {
            return value_or_throw(locked(c.mu, [&] { return c.pool.length(id); }));
          },
          py::arg("seq_id"), "Tokens the sequence holds, reserved ones included.")
      .def(
          "written",
          [](PyPagedKVCache& c, int64_t id, int64_t layer) {
            return value_or_throw(locked(c.mu, [&] { return c.pool.written(id, layer); }));
          },
          py::arg("seq_id"), py::arg("layer"), "Tokens of the sequence `layer` has written.")
      .def(
          "page_table",
          [](PyPagedKVCache& c, int64_t id) {
            return value_or_throw(locked(c.mu, [&] { return c.pool.page_table(id); }));
          },
          py::arg("seq_id"), "The sequence's pages in order (-1: released by the window).")
      .def("sequence_ids",
           [](PyPagedKVCache& c) { return locked(c.mu, [&] { return c.pool.sequence_ids(); }); })
      .def("free_pages",
           [](PyPagedKVCache& c) { return locked(c.mu, [&] { return c.pool.free_pages(); }); })
      .def("pages_in_use",
           [](PyPagedKVCache& c) { return locked(c.mu, [&] { return c.pool.pages_in_use(); }); })
      .def(
          "keys", [](PyPagedKVCache& c, int64_t layer) { return storage_copy(c, layer, true); },
          py::arg("layer"),
          "A float32 copy of the layer's keys [num_pages * page_size, num_kv_heads, head_dim].")
      .def(
          "values", [](PyPagedKVCache& c, int64_t layer) { return storage_copy(c, layer, false); },
          py::arg("layer"),
          "A float32 copy of the layer's values [num_pages * page_size, num_kv_heads, "
          "head_dim_v].")
      .def_property_readonly("num_layers",
                             [](PyPagedKVCache& c) { return c.pool.spec().num_layers; })
      .def_property_readonly("num_pages", [](PyPagedKVCache& c) { return c.pool.spec().num_pages; })
      .def_property_readonly("page_size", [](PyPagedKVCache& c) { return c.pool.spec().page_size; })
      .def_property_readonly("num_kv_heads",
                             [](PyPagedKVCache& c) { return c.pool.spec().num_kv_heads; })
      .def_property_readonly("head_dim", [](PyPagedKVCache& c) { return c.pool.spec().head_dim; })
      .def_property_readonly("head_dim_v",
                             [](PyPagedKVCache& c) { return c.pool.spec().head_dim_v; })
      .def_property_readonly("kv_lora_rank",
                             [](PyPagedKVCache& c) { return c.pool.spec().kv_lora_rank; })
      .def_property_readonly("qk_rope_head_dim",
                             [](PyPagedKVCache& c) { return c.pool.spec().qk_rope_head_dim; })
      .def_property_readonly("sliding_window",
                             [](PyPagedKVCache& c) { return c.pool.spec().sliding_window; })
      .def_property_readonly("prefix_caching",
                             [](PyPagedKVCache& c) { return c.pool.spec().prefix_caching; })
      .def_property_readonly("chunk_size",
                             [](PyPagedKVCache& c) { return c.pool.spec().chunk_size; })
      .def_property_readonly(
          "kv_dtype", [](PyPagedKVCache& c) { return cache_dtype_name(c.pool.spec().dtype); })
      .def_property_readonly(
          "page_nbytes", [](PyPagedKVCache& c) { return c.pool.page_nbytes(); },
          "bytes of K/V values one page holds across all layers")
      .def_property_readonly(
          "nbytes", [](PyPagedKVCache& c) { return c.pool.nbytes(); },
          "bytes of K/V values the whole pool holds")
      .def("__repr__", [](PyPagedKVCache& c) {
        return locked(c.mu, [&] {
          const PagedKVCacheSpec& s = c.pool.spec();
          return "PagedKVCache(sequences=" + std::to_string(c.pool.num_sequences()) +
                 ", pages_in_use=" + std::to_string(c.pool.pages_in_use()) + "/" +
                 std::to_string(s.num_pages) + ", page_size=" + std::to_string(s.page_size) +
                 ", num_layers=" + std::to_string(s.num_layers) +
                 (s.latent() ? ", kv_lora_rank=" + std::to_string(s.kv_lora_rank) +
                                   ", qk_rope_head_dim=" + std::to_string(s.qk_rope_head_dim)
                             : ", num_kv_heads=" + std::to_string(s.num_kv_heads) +
                                   ", head_dim=" + std::to_string(s.head_dim) +
                                   ", head_dim_v=" + std::to_string(s.head_dim_v)) +
                 ", kv_dtype='" + cache_dtype_name(s.dtype) + "'" +
                 (s.sliding_window > 0 ? ", sliding_window=" + std::to_string(s.sliding_window)
                                       : "") +
                 (s.chunk_size > 0 ? ", chunk_size=" + std::to_string(s.chunk_size) : "") + ")";
        });
      });

  m.def("batch_attention", &batch_attention_py, py::arg("q"), py::arg("k_new"), py::arg("v_new"),
        py::arg("cu_seqlens_q"), py::arg("seq_ids"), py::arg("cache"), py::arg("layer"),
        py::kw_only(), py::arg("softmax_scale") = py::none(), py::arg("softcap") = 0.0,
        py::arg("window_size") = py::make_tuple(-1, -1), py::arg("sparse") = py::none(),
        py::arg("return_lse") = false, py::arg("backend") = "auto", py::arg("num_threads") = 0,
        py::arg("sinks") = py::none(), py::arg("chunk_size") = 0, kBatchAttentionDoc);
  m.def("sdpa_varlen", &sdpa_varlen_py, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("max_seqlen_q") = py::none(),
        py::arg("max_seqlen_k") = py::none(), py::kw_only(), py::arg("softmax_scale") = py::none(),
        py::arg("causal") = false, py::arg("window_size") = py::make_tuple(-1, -1),
        py::arg("softcap") = 0.0, py::arg("return_lse") = false, py::arg("mask") = py::none(),
        py::arg("sparse") = py::none(), py::arg("return_probs") = false,
        py::arg("kv_dtype") = "float32", py::arg("backend") = "auto", py::arg("num_threads") = 0,
        py::arg("sinks") = py::none(), py::arg("chunk_size") = 0, kVarlenDoc);
}

}  // namespace attnkit::python
