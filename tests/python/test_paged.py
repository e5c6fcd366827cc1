"""Serving-style attention against PyTorch float64: sdpa_varlen on packed
sequences, PagedKVCache + batch_attention over random traces of adds,
appends, forks, truncates and removes, MLA's latent pool, the layers'
forward_batch, and the errors of each."""
import numpy as np
import pytest

import attnkit
from torch_ref import (bf16_criterion, check_close, eight_bit_bound, kv_stored, layer_tolerance,
                       random_weights, randn, rng, sdpa_bf16_naive, sdpa_bounds, sdpa_ref)


def offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


# ---- sdpa_varlen -------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (4, 1)])
def test_varlen_equals_each_sequence_alone(causal, heads, backend):
    num_heads, num_kv_heads = heads
    g = rng(11 + num_heads + 3 * num_kv_heads + causal)
    q_lens, k_lens = [3, 1, 0, 9, 5], [7, 12, 4, 9, 2]  # empty, decode, more queries than keys
    d, dv = 16, 8
    q = randn(g, sum(q_lens), num_heads, d)
    k = randn(g, sum(k_lens), num_kv_heads, d)
    v = randn(g, sum(k_lens), num_kv_heads, dv)
    cq, ck = offsets(q_lens), offsets(k_lens)
    out, lse = attnkit.sdpa_varlen(q, k, v, cq, ck, max(q_lens), max(k_lens), causal=causal,
                                   window_size=(4, -1), softcap=3.0, return_lse=True,
                                   backend=backend)
    assert out.shape == (sum(q_lens), num_heads, dv) and lse.shape == (num_heads, sum(q_lens))
    for s in range(len(q_lens)):
        qs, ks, vs = (x[None, o[s]:o[s + 1]] for x, o in ((q, cq), (k, ck), (v, ck)))
        want_out, want_lse, _ = sdpa_ref(qs, ks, vs, causal=causal, window=(4, -1), softcap=3.0)
        bound = sdpa_bounds(qs, ks, vs)
        check_close(f"out {s}", out[cq[s]:cq[s + 1]], want_out[0], bound["out"])
        check_close(f"lse {s}", lse[:, cq[s]:cq[s + 1]], want_lse[0], bound["lse"])


def test_varlen_bf16_and_probs():
    g = rng(5)
    q_lens, k_lens = [4, 2], [6, 9]
    q, k, v = randn(g, 6, 4, 8), randn(g, 15, 2, 8), randn(g, 15, 2, 8)
    cq, ck = offsets(q_lens), offsets(k_lens)
    out = attnkit.sdpa_varlen(q, k, v, cq, ck, causal=True, kv_dtype="bfloat16")
    _, probs = attnkit.sdpa_varlen(q, k, v, cq, ck, causal=True, return_probs=True)
    assert probs.shape == (2, 4, 4, 9)
    for s in range(2):
        qs, ks, vs = q[None, cq[s]:cq[s + 1]], k[None, ck[s]:ck[s + 1]], v[None, ck[s]:ck[s + 1]]
        exact, _, p = sdpa_ref(qs, ks, vs, causal=True)
        bf16_criterion(f"bf16 {s}", out[None, cq[s]:cq[s + 1]], exact,
                       sdpa_bf16_naive(qs, ks, vs, causal=True), sdpa_bounds(qs, ks, vs)["out"])
        padded = np.zeros((4, 4, 9))
        padded[:, :q_lens[s], :k_lens[s]] = p[0]
        check_close(f"probs {s}", probs[s], padded, sdpa_bounds(qs, ks, vs)["probs"])


def test_varlen_rejects_bad_offsets():
    q, k = np.zeros((4, 2, 8), np.float32), np.zeros((5, 2, 8), np.float32)
    with pytest.raises(ValueError, match=r"sdpa_varlen: cu_seqlens_k\[2\] = 3 must be >= "
                                         r"cu_seqlens_k\[1\] = 4"):
        attnkit.sdpa_varlen(q, k, k, [0, 2, 4], [0, 4, 3])
    with pytest.raises(ValueError, match=r"max_seqlen_q = 1 is less than the longest sequence, 2"):
        attnkit.sdpa_varlen(q, k, k, [0, 2, 4], [0, 4, 5], 1)


# ---- the pool and batch_attention -----------------------------------------------

class DenseHistory:
    """Every sequence's K/V history per layer, as the pool holds them."""

    def __init__(self, layers, dtype):
        self.layers, self.dtype, self.seqs = layers, dtype, {}

    def add(self, sid):
        self.seqs[sid] = [([], []) for _ in range(self.layers)]

    def fork(self, parent, child):
        self.seqs[child] = [(list(k), list(v)) for k, v in self.seqs[parent]]

    def truncate(self, sid, n):
        for k, v in self.seqs[sid]:
            del k[n:], v[n:]

    def extend(self, sid, layer, k_rows, v_rows, latent_dv=0):
        """k_rows [n, kv heads, d] and v_rows [n, kv heads, dv]; a latent pool
        (latent_dv > 0) takes v_rows None: its values are the stored latent
        rows' first latent_dv columns."""
        k, v = self.seqs[sid][layer]
        # 8-bit: one scale per head row, or per 64 channels of a latent row.
        ks = kv_stored(k_rows, self.dtype, 64 if latent_dv else None)
        k.extend(ks)
        v.extend(ks[..., :latent_dv] if latent_dv else kv_stored(v_rows, self.dtype))
        return np.stack(k)[None], np.stack(v)[None]


SHAPES = {"gqa": dict(num_kv_heads=2, head_dim=16, head_dim_v=8, heads=6),
          "mqa": dict(num_kv_heads=1, head_dim=8, head_dim_v=8, heads=4),
          "mla": dict(kv_lora_rank=12, qk_rope_head_dim=4, heads=8)}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("dtype", ["float32", "int8", "fp8_e4m3"])
def test_random_trace_equals_dense_histories(shape, page_size, window, dtype, backend):
    spec = dict(SHAPES[shape])
    heads = spec.pop("heads")
    if shape == "mla" and window:
        pytest.skip("MLA layers have no window")
    if dtype != "float32" and page_size != 4:
        pytest.skip("8-bit pools: one page size")
    cache = attnkit.PagedKVCache(num_layers=2, num_pages=200 // page_size + 8,
                                 page_size=page_size, sliding_window=window, kv_dtype=dtype,
                                 **spec)
    latent = cache.kv_lora_rank > 0
    hkv, d, dv = cache.num_kv_heads, cache.head_dim, cache.head_dim_v
    g = rng(hash((shape, page_size, window)) % 2**32)
    model = DenseHistory(2, dtype)
    for step in range(14):
        ids = cache.sequence_ids()
        if len(ids) < 4 and g.random() < 0.6:
            model.add(cache.add_sequence())
        elif ids and g.random() < 0.2:
            parent = int(g.choice(ids))
            model.fork(parent, cache.fork(parent))
        elif len(ids) > 2 and g.random() < 0.2:
            victim = int(g.choice(ids))
            cache.remove(victim)
            del model.seqs[victim]
        ids = cache.sequence_ids()
        counts = [int(g.choice([0, 1, 1, 3, 7])) for _ in ids]
        try:
            cache.append(ids, counts)
        except MemoryError as e:
            assert "out of pages" in str(e)
            victim = int(g.choice(ids))
            cache.remove(victim)
            del model.seqs[victim]
            continue
        cu = offsets(counts)
        for layer in range(2):
            q = randn(g, int(cu[-1]), heads, d)
            k = randn(g, int(cu[-1]), hkv, d)
            v = None if latent else randn(g, int(cu[-1]), hkv, dv)
            out = attnkit.batch_attention(q, k, v, cu, ids, cache, layer, backend=backend)
            for s, sid in enumerate(ids):
                if counts[s] == 0:
                    continue
                rows = slice(cu[s], cu[s + 1])
                ks, vs = model.extend(sid, layer, k[rows], None if latent else v[rows],
                                      dv if latent else 0)
                win = (window - 1, -1) if window else (-1, -1)
                want = sdpa_ref(q[None, rows], ks, vs, causal=True, window=win)[0][0]
                bound = (sdpa_bounds(q[None, rows], ks, vs)["out"] if dtype == "float32" else
                         eight_bit_bound(q[None, rows], ks, vs, dtype))
                check_close(f"step {step} seq {sid} layer {layer}", out[rows], want, bound)
        if g.random() < 0.15 and ids:
            sid = int(g.choice(ids))
            released = cache.page_table(sid).count(-1)
            lowest = released * page_size + window - 1 if released else 0
            n = max(lowest, cache.length(sid) - int(g.integers(0, 4)))
            cache.truncate(sid, n)
            model.truncate(sid, n)


def test_pool_bookkeeping_and_repr():
    cache = attnkit.PagedKVCache(num_layers=2, num_pages=8, page_size=4, num_kv_heads=2,
                                 head_dim=8, kv_dtype="bfloat16")
    a = cache.add_sequence()
    cache.append([a], [6])
    assert cache.length(a) == 6 and cache.written(a, 0) == 0 and cache.pages_in_use() == 2
    assert cache.page_nbytes == 2 * 4 * 2 * (8 + 8) * 2
    assert repr(cache).startswith("PagedKVCache(sequences=1, pages_in_use=2/8, page_size=4")
    with pytest.raises(MemoryError, match=r"out of pages: 40 new tokens need 10 free pages of 4 "
                                          r"tokens, and 6 of 8 are free; nothing was reserved"):
        cache.append([a], [40])
    assert cache.length(a) == 6
    with pytest.raises(ValueError, match=r"PagedKVCache.fork: sequence 0 has 6 reserved tokens "
                                         r"that layer 0 has not written"):
        cache.fork(a)
    q = np.zeros((6, 4, 8), np.float32)
    kv = np.zeros((6, 2, 8), np.float32)
    with pytest.raises(ValueError, match=r"cu_seqlens_q gives sequence 0 5 new tokens, but it "
                                         r"has 6 reserved tokens"):
        attnkit.batch_attention(q[:5], kv[:5], kv[:5], [0, 5], [a], cache, 0)
    with pytest.raises(ValueError, match=r"sequence 7 does not exist"):
        cache.length(7)
    cache.store(0, kv, kv, [0, 6], [a])
    assert cache.written(a, 0) == 6
    np.testing.assert_array_equal(cache.keys(0).shape, (32, 2, 8))


def test_attend_held_sees_every_held_token_and_changes_nothing():
    g = rng(12)
    cache = attnkit.PagedKVCache(num_layers=2, num_pages=8, page_size=4, num_kv_heads=2,
                                 head_dim=8, head_dim_v=6)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append([a, b], [7, 3])
    k, v = randn(g, 10, 2, 8), randn(g, 10, 2, 6)
    cache.store(1, k, v, [0, 7, 10], [a, b])
    q = randn(g, 3, 4, 8)
    out, lse = cache.attend_held(1, q, [0, 2, 3], [a, b], softcap=2.0, return_lse=True)
    for rows, keys in ((slice(0, 2), slice(0, 7)), (slice(2, 3), slice(7, 10))):
        want, want_lse, _ = sdpa_ref(q[None, rows], k[None, keys], v[None, keys], softcap=2.0)
        bound = sdpa_bounds(q[None, rows], k[None, keys], v[None, keys])
        check_close("out", out[rows], want[0], bound["out"])
        check_close("lse", lse[:, rows], want_lse[0], bound["lse"])
    # Layer 0 holds nothing yet: zeros and -inf; nothing was written.
    out0, lse0 = cache.attend_held(0, q, [0, 2, 3], [a, b], return_lse=True)
    assert not out0.any() and np.isneginf(lse0).all()
    assert cache.written(a, 0) == 0 and cache.written(a, 1) == 7 and cache.length(a) == 7
    with pytest.raises(ValueError, match=r"PagedKVCache.attend_held: cu_seqlens_q\[2\] = 2 must "
                                         r"equal q.shape\[0\] = 3"):
        cache.attend_held(1, q, [0, 1, 2], [a, b])
    window = attnkit.PagedKVCache(num_pages=4, page_size=4, num_kv_heads=2, head_dim=8,
                                  sliding_window=3)
    w = window.add_sequence()
    with pytest.raises(ValueError, match=r"the pool's sliding_window = 3 must be 0"):
        window.attend_held(0, q[:1], [0, 1], [w])


# ---- layers ---------------------------------------------------------------------

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "rope_theta": 10000.0, "max_position_embeddings": 512}
DEEPSEEK = {"model_type": "deepseek_v3", "hidden_size": 48, "num_attention_heads": 4,
            "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 4, "v_head_dim": 8, "rope_theta": 10000.0}


def weight_shapes(config):
    """{name: shape} of the attention weights a config's layer expects."""
    hid, h = config["hidden_size"], config["num_attention_heads"]
    if config["model_type"] != "deepseek_v3":
        hkv, d = config["num_key_value_heads"], hid // h
        return {"q_proj.weight": (h * d, hid), "k_proj.weight": (hkv * d, hid),
                "v_proj.weight": (hkv * d, hid), "o_proj.weight": (hid, h * d)}
    dq, dc = config["q_lora_rank"], config["kv_lora_rank"]
    dn, dr, dv = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    return {"q_a_proj.weight": (dq, hid), "q_a_layernorm.weight": (dq,),
            "q_b_proj.weight": (h * (dn + dr), dq), "kv_a_proj_with_mqa.weight": (dc + dr, hid),
            "kv_a_layernorm.weight": (dc,), "kv_b_proj.weight": (h * (dn + dv), dc),
            "o_proj.weight": (hid, h * dv)}


@pytest.mark.parametrize("config", [LLAMA, DEEPSEEK], ids=["llama", "deepseek_v3"])
def test_forward_batch_equals_forward_per_sequence(config):
    """Each sequence through forward_batch, batched with others in mixed
    steps, against the same layer's forward() on the whole sequence."""
    layer = attnkit.from_config(config)
    g = rng(3)
    layer.load_state_dict(random_weights(g, weight_shapes(config)))
    hidden = config["hidden_size"]
    steps = [[5, 2, 0], [1, 3, 4], [1, 1, 1], [2, 0, 3], [1, 1, 1]]
    lengths = np.sum(steps, axis=0)
    xs = [randn(g, int(n), hidden) for n in lengths]
    cache = layer.new_paged_cache(num_pages=40, page_size=3)
    ids = [cache.add_sequence() for _ in range(3)]
    outs, done = [[] for _ in ids], [0, 0, 0]
    for counts in steps:
        cache.append(ids, counts)
        x = np.concatenate([xs[s][done[s]:done[s] + counts[s]] for s in range(3)])
        y = layer.forward_batch(x, offsets(counts), ids, cache, 0)
        cu = offsets(counts)
        for s in range(3):
            outs[s].append(y[cu[s]:cu[s + 1]])
            done[s] += counts[s]
    for s in range(3):
        want = layer.forward(xs[s][None])[0]
        got = np.concatenate(outs[s])
        check_close(f"sequence {s}", got, want, layer_tolerance(want))


def test_forward_batch_rejects_a_pool_of_another_shape():
    layer = attnkit.from_config(LLAMA)
    g = rng(1)
    layer.load_state_dict(random_weights(g, weight_shapes(LLAMA)))
    other = attnkit.PagedKVCache(num_pages=4, num_kv_heads=1, head_dim=16)
    sid = other.add_sequence()
    other.append([sid], [2])
    with pytest.raises(ValueError, match=r"AttentionLayer.forward_batch: cache spec.num_kv_heads "
                                         r"= 1 must equal config\(\).num_kv_heads = 2"):
        layer.forward_batch(np.zeros((2, 64), np.float32), [0, 2], [sid], other, 0)
    with pytest.raises(ValueError, match=r"cache must be a PagedKVCache"):
        layer.forward_batch(np.zeros((2, 64), np.float32), [0, 2], [sid], None, 0)


def _kv_of(tokens, positions, width, salt):
    """A fixed function of (token id, position): the same token at the same
    position gets the same K/V in every pool, as a model's would."""
    g = np.random.default_rng([salt])
    table = g.uniform(-1, 1, (64, 64, width)).astype(np.float32)
    return table[np.asarray(tokens) % 64, np.asarray(positions) % 64]


def _prefill(cache, sid, tokens, first, heads=4, kv_heads=2, dim=8):
    """Attends tokens[first:] of sequence sid (appended already); returns out."""
    pos = np.arange(first, len(tokens))
    tok = np.asarray(tokens)[first:]
    q = _kv_of(tok, pos, heads * dim, 1).reshape(-1, heads, dim)
    k = _kv_of(tok, pos, kv_heads * dim, 2).reshape(-1, kv_heads, dim)
    v = _kv_of(tok, pos, kv_heads * dim, 3).reshape(-1, kv_heads, dim)
    return attnkit.batch_attention(q, k, v, [0, len(tok)], [sid], cache, 0)


def test_prefix_caching_reuses_a_prompt_and_gives_the_same_bits():
    args = dict(num_layers=1, num_pages=16, page_size=4, num_kv_heads=2, head_dim=8)
    cache = attnkit.PagedKVCache(prefix_caching=True, **args)
    assert cache.prefix_caching
    prompt = [5, 9, 1, 7, 3, 3, 8, 2, 6, 4, 11]
    a, cached = cache.add_sequence(prompt)
    assert cached == 0
    cache.append([a], [len(prompt)])  # the prompt's ids are known: none needed
    _prefill(cache, a, prompt, 0)
    cache.append([a], [1], token_ids=[12])
    _prefill(cache, a, prompt + [12], len(prompt))  # 12 tokens: 3 full pages keyed
    cache.remove(a)
    assert cache.cached_free_pages() and cache.free_pages() == 16

    assert cache.probe_prefix(prompt + [12, 40]) == (12, 3)
    b, cached = cache.add_sequence(prompt + [12, 40])
    assert cached == 12
    cache.append([b], [1])
    out = _prefill(cache, b, prompt + [12, 40], 12)
    # The same tokens computed in a pool without prefix caching.
    fresh = attnkit.PagedKVCache(**args)
    f = fresh.add_sequence()
    assert fresh.add_sequence(prompt)[1] == 0
    fresh.append([f], [12])
    _prefill(fresh, f, prompt + [12], 0)
    fresh.append([f], [1])
    want = _prefill(fresh, f, prompt + [12, 40], 12)
    np.testing.assert_array_equal(out, want)
    stats = cache.prefix_cache_stats()
    assert stats["queries"] == 2 and stats["hits"] == 1 and stats["hit_tokens"] == 12
    assert stats["query_tokens"] == 11 + 13 and stats["evictions"] == 0
    assert fresh.prefix_cache_stats()["cached_pages"] == 0
    cache.reset_prefix_cache_stats()
    assert cache.prefix_cache_stats()["queries"] == 0

    with pytest.raises(ValueError, match=r"PagedKVCache: spec.prefix_caching is on with "
                                         r"spec.sliding_window = 8"):
        attnkit.PagedKVCache(prefix_caching=True, sliding_window=8, **args)
    with pytest.raises(ValueError, match=r"PagedKVCache.add_sequence: prompt_token_ids\[1\] = -3 "
                                         r"must be >= 0"):
        cache.add_sequence([1, -3])
    with pytest.raises(ValueError, match=r"token_ids holds 4294967296"):
        cache.append([b], [1], token_ids=[2**32])
    with pytest.raises(ValueError, match=r"PagedKVCache.append: token_ids has 2 entries; it must "
                                         r"have sum\(num_new_tokens\) = 1"):
        cache.append([b], [1], token_ids=[1, 2])
