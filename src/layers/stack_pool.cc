#include "layers/stack_pool.h"

namespace attnkit::layers {

bool stack_shares_window(std::span<const AttentionLayer> attention) {
  for (const AttentionLayer& a : attention)
    if (a.config().sliding_window != attention[0].config().sliding_window ||
        a.config().chunk_size != attention[0].config().chunk_size)
      return false;
  return true;
}

Result<PagedKVCache> new_stack_pool(std::span<const AttentionLayer> attention,
                                    std::span<const LatentAttention> latent, int64_t num_pages,
                                    int64_t page_size, DType kv_dtype, bool prefix_caching) {
  if (!latent.empty()) {
    ATTNKIT_ASSIGN_OR_RETURN(PagedKVCache pool, latent[0].new_paged_cache(
                                                    num_pages, page_size,
                                                    static_cast<int64_t>(latent.size()), kv_dtype));
    if (!prefix_caching) return pool;
    // The same spec with prefix caching; spec() filled in the head fields,
    // which a latent spec leaves 0.
    PagedKVCacheSpec s = pool.spec();
    s.num_kv_heads = s.head_dim = s.head_dim_v = 0;
    s.prefix_caching = true;
    return PagedKVCache::create(s);
  }
  if (attention.empty())
    return invalid_argument("new_stack_pool: the stack has no attention layer to hold a pool for");
  const AttentionConfig& c = attention[0].config();
  PagedKVCacheSpec s;
  s.num_layers = static_cast<int64_t>(attention.size());
  s.num_pages = num_pages;
  s.page_size = page_size;
  s.num_kv_heads = c.num_kv_heads;
  s.head_dim = c.head_dim;
  s.dtype = kv_dtype;
  if (stack_shares_window(attention)) {
    s.sliding_window = c.sliding_window;
    s.chunk_size = c.chunk_size;
  }
  s.prefix_caching = prefix_caching;
  return PagedKVCache::create(s);
}

}  // namespace attnkit::layers
