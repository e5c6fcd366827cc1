"""Attention sinks (gpt-oss) and chunked local attention (Llama 4) through
every attention entry point -- sdpa, sdpa_varlen, KVCache, PagedKVCache and
batch_attention -- against a float64 PyTorch implementation written here
the way the model code states it: append the sink logit as one more
column, softmax, drop that column; and mask keys outside the query's chunk.
"""
import numpy as np
import pytest
import torch

import attnkit
from torch_ref import EPS32, check_close, randn, rng


def ref_attention(q, k, v, causal=False, chunk=0, sinks=None, positions=None):
    """float64 attention of q [Sq, H, D] over k, v [Sk, Hkv, D(v)].
    positions: key position of each query row (default bottom-right:
    Sk - Sq + i). Returns out [Sq, H, Dv] and lse [H, Sq]."""
    q, k, v = (torch.from_numpy(np.asarray(x, dtype=np.float64)) for x in (q, k, v))
    sq, h, d = q.shape
    sk, hkv = k.shape[0], k.shape[1]
    k = k.repeat_interleave(h // hkv, dim=1)
    v = v.repeat_interleave(h // hkv, dim=1)
    s = torch.einsum("ihd,jhd->hij", q, k) / np.sqrt(d)
    p = torch.arange(sq).view(sq, 1) + (sk - sq) if positions is None else torch.tensor(
        np.asarray(positions, dtype=np.int64)).view(sq, 1)
    j = torch.arange(sk).view(1, sk)
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        keep &= j <= p
    if chunk > 0:
        keep &= torch.div(j, chunk, rounding_mode="floor") == torch.div(
            p, chunk, rounding_mode="floor")
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        sink = torch.from_numpy(np.asarray(sinks, dtype=np.float64)).view(h, 1, 1)
        s = torch.cat([s, sink.expand(h, sq, 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    w = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)  # all -inf rows: 0
    if sinks is not None:
        w = w[..., :-1]
    out = torch.einsum("hij,jhd->ihd", w, v)
    return out.numpy(), lse.numpy()


def bound_for(want, keys):
    """fp32 accumulation over `keys` terms of unit-scale values: a few
    hundred ulps of slack, relative to the magnitude."""
    return 64 * EPS32 * (keys + 8) * (1.0 + np.abs(np.nan_to_num(want, neginf=0.0)))


SINK_VALUES = [-30.0, -1.0, 0.0, 2.5, 40.0]


@pytest.mark.parametrize("backend", ["reference", "fast"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 37), (9, 9), (5, 23), (12, 4)])
@pytest.mark.parametrize("chunk", [0, 1, 4, 16, 17, 1000])
def test_sdpa_sinks_and_chunks_match_torch(backend, seqlen_q, seqlen_k, chunk):
    g = rng(seqlen_q * 1000 + seqlen_k * 10 + chunk)
    batch, h, hkv, d, dv = 2, 6, 2, 16, 8
    q = randn(g, batch, seqlen_q, h, d)
    k = randn(g, batch, seqlen_k, hkv, d)
    v = randn(g, batch, seqlen_k, hkv, dv)
    sinks = np.array([SINK_VALUES[x % 5] + 0.25 * x for x in range(h)], dtype=np.float32)
    for causal in (False, True):
        for use_sinks in (False, True):
            s = sinks if use_sinks else None
            out, lse = attnkit.sdpa(q, k, v, causal=causal, chunk_size=chunk, sinks=s,
                                    return_lse=True, backend=backend)
            for b in range(batch):
                want, want_lse = ref_attention(q[b], k[b], v[b], causal, chunk, s)
                check_close(f"out b{b} causal={causal} sinks={use_sinks}", out[b], want,
                            bound_for(want, seqlen_k))
                check_close(f"lse b{b}", lse[b], want_lse, bound_for(want_lse, seqlen_k))


def test_sdpa_empty_rows_with_sinks_give_the_sink():
    g = rng(5)
    q, k, v = randn(g, 1, 6, 2, 8), randn(g, 1, 3, 2, 8), randn(g, 1, 3, 2, 8)
    sinks = np.array([-2.0, 7.0], dtype=np.float32)
    for backend in ("reference", "fast"):
        out, lse = attnkit.sdpa(q, k, v, causal=True, sinks=sinks, return_lse=True,
                                backend=backend)
        # Rows 0..2 sit before key 0: out 0, lse = the head's sink.
        assert np.all(out[0, :3] == 0.0)
        assert np.array_equal(lse[0, :, :3], np.repeat(sinks[:, None], 3, axis=1))
        probs = attnkit.sdpa(q, k, v, causal=True, sinks=sinks, return_probs=True)[1]
        want, _ = ref_attention(q[0], k[0], v[0], True, 0, sinks)
        check_close("out", out[0], want, bound_for(want, 3))
        # probs exclude the sink: rows sum to less than 1.
        assert np.all(probs[0, :, 3:].sum(-1) < 1.0)


def test_sdpa_varlen_sinks_and_chunks():
    g = rng(11)
    h, hkv, d = 4, 2, 8
    q_lens, k_lens = [3, 1, 0, 7], [10, 5, 4, 7]
    cu_q, cu_k = np.cumsum([0] + q_lens), np.cumsum([0] + k_lens)
    q = randn(g, cu_q[-1], h, d)
    k = randn(g, cu_k[-1], hkv, d)
    v = randn(g, cu_k[-1], hkv, d)
    sinks = np.array([0.5, -3.0, 4.0, 1.0], dtype=np.float32)
    out, lse = attnkit.sdpa_varlen(q, k, v, cu_q, cu_k, causal=True, chunk_size=3, sinks=sinks,
                                   return_lse=True)
    for s in range(len(q_lens)):
        if q_lens[s] == 0:
            continue
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        want, want_lse = ref_attention(q[rows], k[keys], v[keys], True, 3, sinks)
        check_close(f"out seq {s}", out[rows], want, bound_for(want, k_lens[s]))
        check_close(f"lse seq {s}", lse[:, rows], want_lse, bound_for(want_lse, k_lens[s]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_kv_cache_chunked_decode_matches_full_chunked_attention(dtype, chunk):
    g = rng(chunk)
    n, h, hkv, d = 20, 4, 2, 8
    q, k, v = randn(g, 1, n, h, d), randn(g, 1, n, hkv, d), randn(g, 1, n, hkv, d)
    sinks = np.array([1.0, -1.0, 3.0, 0.0], dtype=np.float32)
    cache = attnkit.KVCache(1, n, hkv, d, dtype=dtype, chunk_size=chunk)
    assert cache.chunk_size == chunk and cache.slots == chunk
    # The fast bf16 kernels may round q and the weights to bf16 (vdpbf16ps;
    # their bound is tested in C++): bf16 runs the reference here, whose only
    # rounding is the storage's.
    backend = "reference" if dtype == "bfloat16" else "auto"
    outs, t = [], 0
    for step in [7, 1, 1, 4, 1, 1, 5]:
        outs.append(cache.attend(q[:, t:t + step], k[:, t:t + step], v[:, t:t + step],
                                 sinks=sinks, backend=backend))
        t += step
    out = np.concatenate(outs, axis=1)
    kk, vv = k, v
    if dtype == "bfloat16":  # the oracle reads K/V as the cache stores them
        kk = torch.from_numpy(k).bfloat16().float().numpy()
        vv = torch.from_numpy(v).bfloat16().float().numpy()
    want, _ = ref_attention(q[0], kk[0], vv[0], True, chunk, sinks)
    check_close("out", out[0], want, bound_for(want, n))


def test_paged_chunks_and_sinks_per_call():
    g = rng(21)
    h, hkv, d, chunk = 4, 2, 8, 5
    sinks = np.array([2.0, -2.0, 0.0, 6.0], dtype=np.float32)
    # A chunked pool, and a plain pool given the chunk per call: the same
    # attention; the chunked pool releases finished chunks' pages.
    chunked = attnkit.PagedKVCache(num_pages=40, page_size=2, num_kv_heads=hkv, head_dim=d,
                                   chunk_size=chunk)
    plain = attnkit.PagedKVCache(num_pages=40, page_size=2, num_kv_heads=hkv, head_dim=d)
    assert chunked.chunk_size == chunk and plain.chunk_size == 0
    ids = [(chunked.add_sequence(), plain.add_sequence()) for _ in range(2)]
    hist_q = [[], []]
    hist_k, hist_v = [[], []], [[], []]
    for step in [[9, 3], [1, 1], [4, 1], [1, 6]]:
        for pool, which in ((chunked, 0), (plain, 1)):
            pool.append([i[which] for i in ids], step)
        total = sum(step)
        q, k, v = randn(g, total, h, d), randn(g, total, hkv, d), randn(g, total, hkv, d)
        cu = np.cumsum([0] + step)
        got_c = attnkit.batch_attention(q, k, v, cu, [i[0] for i in ids], chunked, 0,
                                        sinks=sinks)
        got_p = attnkit.batch_attention(q, k, v, cu, [i[1] for i in ids], plain, 0,
                                        chunk_size=chunk, sinks=sinks)
        for s in range(2):
            rows = slice(cu[s], cu[s + 1])
            hist_q[s].append(q[rows])
            hist_k[s].append(k[rows])
            hist_v[s].append(v[rows])
            kk, vv = np.concatenate(hist_k[s]), np.concatenate(hist_v[s])
            want, _ = ref_attention(q[rows], kk, vv, True, chunk, sinks)
            check_close(f"chunked pool seq {s}", got_c[rows], want, bound_for(want, len(kk)))
            check_close(f"plain pool seq {s}", got_p[rows], want, bound_for(want, len(kk)))
    # Pages before the current chunk are released in the chunked pool only.
    table = chunked.page_table(ids[0][0])
    assert table[0] == -1 and -1 not in plain.page_table(ids[0][1])


def test_bad_sinks_and_chunks_raise_value_error_naming_them():
    g = rng(3)
    q, k, v = randn(g, 1, 2, 4, 8), randn(g, 1, 3, 2, 8), randn(g, 1, 3, 2, 8)
    with pytest.raises(ValueError, match="chunk_size = -1"):
        attnkit.sdpa(q, k, v, chunk_size=-1)
    with pytest.raises(ValueError, match=r"sinks\.shape\[0\]"):
        attnkit.sdpa(q, k, v, sinks=np.zeros(3, dtype=np.float32))
    with pytest.raises(ValueError, match=r"sinks\[1\] = nan must be finite"):
        attnkit.sdpa(q, k, v, sinks=np.array([0, np.nan, 0, 0], dtype=np.float32))
    with pytest.raises(ValueError, match="sinks"):
        attnkit.sdpa(q, k, v, sinks=np.zeros((2, 2), dtype=np.float32))
    with pytest.raises(ValueError, match="spec.chunk_size = -2"):
        attnkit.KVCache(1, 8, 2, 8, chunk_size=-2)
    with pytest.raises(ValueError, match="are both set"):
        attnkit.PagedKVCache(num_pages=4, num_kv_heads=2, head_dim=8, sliding_window=4,
                             chunk_size=4)
    cache = attnkit.KVCache(1, 8, 2, 8, chunk_size=4)
    with pytest.raises(ValueError, match="options.chunk_size = 3 must be 0 or spec.chunk_size"):
        cache.attend(q, k[:, :2], v[:, :2], chunk_size=3)
    assert cache.length == 0
