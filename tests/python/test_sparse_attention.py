"""sdpa(key_indices=): attention over per-query key indices (DeepSeek-V3.2's
DSA, FlashMLA's sparse interface) against a float64 numpy loop."""
import numpy as np
import pytest
import torch

import attnkit


def reference(q, k, v, idx, scale):
    b_, t_, h_, _ = q.shape
    g = h_ // k.shape[2]
    out = np.zeros(q.shape[:3] + (v.shape[3],))
    for b in range(b_):
        for i in range(t_):
            keys = [j for j in idx[b, i] if j >= 0]
            for h in range(h_):
                s = np.array([scale * q[b, i, h] @ k[b, j, h // g] for j in keys], dtype=np.float64)
                p = np.exp(s - s.max())
                out[b, i, h] = (p[:, None] * v[b, keys, h // g]).sum(0) / p.sum()
    return out


@pytest.mark.parametrize("backend", ["fast", "reference"])
def test_key_indices_match_float64(backend):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 3, 4, 16)).astype(np.float32)
    k = rng.standard_normal((2, 30, 2, 16)).astype(np.float32)
    v = rng.standard_normal((2, 30, 2, 8)).astype(np.float32)
    idx = np.stack([rng.permutation(28 + i)[:5] for _ in range(2) for i in range(3)])
    idx = idx.reshape(2, 3, 5).astype(np.int32)
    idx[0, 1, 4] = -1
    out = attnkit.sdpa(q, k, v, causal=True, key_indices=idx, backend=backend)
    want = reference(q.astype(np.float64), k, v, idx, 16 ** -0.5)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-5)


def test_bad_key_indices_name_the_argument():
    q = np.zeros((1, 2, 2, 8), np.float32)
    k = np.zeros((1, 6, 1, 8), np.float32)
    idx = np.array([[[0, 6], [1, 2]]], np.int32)  # 6 is past the keys
    with pytest.raises(ValueError, match="key_indices"):
        attnkit.sdpa(q, k, k, key_indices=idx)
    with pytest.raises(ValueError, match="key_indices"):
        attnkit.sdpa(q, k, k, key_indices=np.zeros((1, 3, 2), np.int32))


def _v32_config(**over):
    cfg = dict(model_type="deepseek_v32", hidden_size=64, num_attention_heads=2, q_lora_rank=32,
               kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
               index_n_heads=2, index_head_dim=128, index_topk=4, num_hidden_layers=1)
    cfg.update(over)
    return cfg


V32_SHAPES = {"q_a_proj.weight": (32, 64), "q_a_layernorm.weight": (32,),
              "q_b_proj.weight": (32, 32), "kv_a_proj_with_mqa.weight": (24, 64),
              "kv_a_layernorm.weight": (16,), "kv_b_proj.weight": (32, 16),
              "o_proj.weight": (64, 16), "indexer.wq_b.weight": (256, 32),
              "indexer.wk.weight": (128, 64), "indexer.k_norm.weight": (128,),
              "indexer.k_norm.bias": (128,), "indexer.weights_proj.weight": (2, 64)}


def _v32_weights(rng):
    return {n: (rng.standard_normal(s) * 0.2).astype(np.float32) for n, s in V32_SHAPES.items()}


def test_deepseek_v32_layer_runs_sparse_and_dense_equal_when_topk_covers_all():
    rng = np.random.default_rng(0)
    sd = _v32_weights(rng)
    x = rng.standard_normal((1, 10, 64)).astype(np.float32)
    sparse = attnkit.from_config(_v32_config(index_topk=4))
    wide = attnkit.from_config(_v32_config(index_topk=64))
    dense = attnkit.from_config(_v32_config(model_type="deepseek_v3"))
    assert "indexer.wq_b.weight" in sparse.weight_names()
    sparse.load_state_dict(sd)
    wide.load_state_dict(sd)
    dense.load_state_dict({n: w for n, w in sd.items() if not n.startswith("indexer.")})
    y_dense = dense.forward(x)
    np.testing.assert_array_equal(wide.forward(x), y_dense)  # top-k >= visible: dense, bit for bit
    y_sparse = sparse.forward(x)
    # Rows that see <= 4 keys attend to all of them (on the sparse path, so
    # equal to fp32 rounding, not bit for bit).
    np.testing.assert_allclose(y_sparse[:, :4], y_dense[:, :4], rtol=0, atol=1e-6)
    assert np.abs(y_sparse[:, 4:] - y_dense[:, 4:]).max() > 1e-4  # the rest attend to 4 keys


def test_deepseek_v32_config_errors_name_the_field():
    with pytest.raises(ValueError, match="index_topk"):
        attnkit.from_config(_v32_config(index_topk=0))
    with pytest.raises(ValueError, match="q_lora_rank"):
        attnkit.from_config(_v32_config(q_lora_rank=None))
    with pytest.raises(ValueError, match="index_head_dim"):
        attnkit.from_config(_v32_config(index_head_dim=64))


# --- the lightning indexer against torch float64 -------------------------

def _e4m3_table():
    """The value of every fp8 E4M3 (OCP "fn") code, NaN for 0x7f / 0xff:
    sign, 4 exponent bits (bias 7), 3 mantissa bits, subnormals at
    exponent 0."""
    vals = np.empty(256)
    for c in range(256):
        sign = -1.0 if c & 0x80 else 1.0
        e, m = (c >> 3) & 0xF, c & 0x7
        if e == 0xF and m == 0x7:
            vals[c] = np.nan
        elif e == 0:
            vals[c] = sign * m / 8 * 2.0 ** -6
        else:
            vals[c] = sign * (1 + m / 8) * 2.0 ** (e - 7)
    return vals


E4M3 = _e4m3_table()


def _nearest_e4m3(x):
    """The code nearest each value of x (|x| <= 448), ties to the even
    code (an even mantissa), as IEEE rounding does."""
    finite = np.where(np.isnan(E4M3), np.inf, E4M3)
    dist = np.abs(x.reshape(-1, 1) - finite.reshape(1, -1))
    best = dist.min(axis=1, keepdims=True)
    cand = dist == best
    # Among tied codes prefer an even one; +0 over -0 for an exact zero.
    even = cand & (np.arange(256) % 2 == 0)
    pick = np.where(even.any(axis=1, keepdims=True), even, cand)
    return pick.argmax(axis=1).astype(np.uint8).reshape(x.shape)


@pytest.mark.parametrize("ue8m0", [True, False])
def test_indexer_quantize_matches_block_fp8(ue8m0):
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((2, 3, 256)) * rng.uniform(0.01, 30, (2, 3, 1))).astype(np.float32)
    x[1, 2, 128:] = 0  # an all-zero block takes the 1e-4 floor
    codes, scales = attnkit.indexer_quantize(x, ue8m0=ue8m0)
    assert codes.dtype == np.uint8 and codes.shape == x.shape and scales.shape == (2, 3, 2)
    blocks = x.astype(np.float64).reshape(2, 3, 2, 128)
    amax = np.maximum(np.abs(blocks).max(axis=-1), 1e-4)
    want_scale = amax / 448
    if ue8m0:
        want_scale = 2.0 ** np.ceil(np.log2(want_scale))
    np.testing.assert_allclose(scales, want_scale, rtol=2 ** -23, atol=0)
    # Codes: the nearest E4M3 of x / scale (the scale as returned, in f32).
    scaled = (blocks.astype(np.float32) / scales[..., None].astype(np.float32)).astype(np.float64)
    np.testing.assert_array_equal(codes.reshape(2, 3, 2, 128), _nearest_e4m3(scaled))
    # Dequantized values within half an E4M3 step (3 mantissa bits) of x.
    deq = E4M3[codes].reshape(2, 3, 2, 128) * scales[..., None]
    assert np.all(np.abs(deq - blocks) <= 2 ** -4 * np.abs(blocks) + 2 ** -10 * scales[..., None])


def test_indexer_quantize_refuses_bad_input():
    with pytest.raises(ValueError, match="indexer_quantize.*x"):
        attnkit.indexer_quantize(np.full((2, 128), np.nan, np.float32))
    with pytest.raises(ValueError, match="indexer_quantize.*128"):
        attnkit.indexer_quantize(np.zeros((2, 64), np.float32))


def _indexer_reference(qc, qs, w, kc, ks, topk):
    """torch float64: score(t, s) = sum_h w_t,h ReLU(q_t,h . k_s) over the
    dequantized codes, bottom-right causal, then the min(topk, visible)
    best keys (a higher score first, ties to the lower key) in key order."""
    q = torch.from_numpy(E4M3[qc] * np.repeat(qs, 128, axis=-1))  # [B, T, H, D]
    k = torch.from_numpy(E4M3[kc] * np.repeat(ks, 128, axis=-1))  # [B, S, D]
    w = torch.from_numpy(w.astype(np.float64))
    dots = torch.einsum("bthd,bsd->bths", q, k).clamp_min(0)
    scores = torch.einsum("bth,bths->bts", w, dots)
    B, T, S = scores.shape
    visible = torch.arange(S)[None, :] <= (S - T + torch.arange(T))[:, None]
    scores = scores.masked_fill(~visible, -np.inf)
    idx = np.full((B, T, topk), -1, np.int32)
    for b in range(B):
        for t in range(T):
            n = int(visible[t].sum())
            order = sorted(range(n), key=lambda s: (-scores[b, t, s].item(), s))
            idx[b, t, :min(topk, n)] = sorted(order[:topk])
    return idx, scores.numpy()


def _indexer_inputs(rng, B, T, S, H, D=128):
    qc, qs = attnkit.indexer_quantize(rng.standard_normal((B, T, H, D)).astype(np.float32))
    kc, ks = attnkit.indexer_quantize(rng.standard_normal((B, S, D)).astype(np.float32))
    w = rng.standard_normal((B, T, H)).astype(np.float32)
    return qc, qs, w, kc, ks


@pytest.mark.parametrize("backend", ["fast", "reference"])
@pytest.mark.parametrize("B,T,S,H,topk", [(2, 5, 40, 4, 7), (1, 1, 300, 8, 64), (1, 9, 9, 2, 16)])
def test_lightning_indexer_topk_matches_torch_float64(backend, B, T, S, H, topk):
    rng = np.random.default_rng(B * 1000 + S)
    qc, qs, w, kc, ks = _indexer_inputs(rng, B, T, S, H)
    idx, scores = attnkit.lightning_indexer_topk(qc, qs, w, kc, ks, topk, return_scores=True,
                                                 backend=backend)
    want_idx, want = _indexer_reference(qc, qs, w, kc, ks, topk)
    assert idx.dtype == np.int32 and idx.shape == (B, T, topk)
    assert np.array_equal(np.isinf(scores), np.isinf(want))
    # Bound: fp32 sums of D products per head, then of H heads, each term at
    # most |w_h| |q_h . k| in magnitude.
    qa = np.abs(E4M3[qc] * np.repeat(qs, 128, axis=-1))
    ka = np.abs(E4M3[kc] * np.repeat(ks, 128, axis=-1))
    mag = np.einsum("bth,bthd,bsd->bts", np.abs(w.astype(np.float64)), qa, ka)
    tol = 2 * (128 + H) * 2.0 ** -24 * mag
    fin = np.isfinite(want)
    err = np.abs(scores[fin] - want[fin])
    assert np.all(err <= tol[fin]), f"worst {err.max()} vs bound {tol[fin][err.argmax()]}"
    if backend == "reference" or np.array_equal(idx, want_idx):
        np.testing.assert_array_equal(idx, want_idx)
        return
    # The fast kernel may swap keys whose scores are within its rounding:
    # each chosen key must score at least the best left out, less the bound.
    for b in range(B):
        for t in range(T):
            chosen = [s for s in idx[b, t] if s >= 0]
            assert len(chosen) == (want_idx[b, t] >= 0).sum()
            left = [s for s in range(S) if fin[b, t, s] and s not in chosen]
            if left:
                assert min(want[b, t, chosen]) >= max(want[b, t, left]) - tol[b, t].max()


def test_indexer_top_k_drives_sdpa_key_indices():
    """The indices go straight into sdpa(key_indices=): the result equals
    attention masked to the chosen keys."""
    rng = np.random.default_rng(5)
    qc, qs, w, kc, ks = _indexer_inputs(rng, 1, 4, 24, 2)
    idx = attnkit.lightning_indexer_topk(qc, qs, w, kc, ks, 6)
    q = rng.standard_normal((1, 4, 4, 16)).astype(np.float32)
    k = rng.standard_normal((1, 24, 1, 16)).astype(np.float32)
    v = rng.standard_normal((1, 24, 1, 8)).astype(np.float32)
    mask = np.zeros((1, 1, 4, 24), bool)
    for t in range(4):
        mask[0, 0, t, idx[0, t][idx[0, t] >= 0]] = True
    out = attnkit.sdpa(q, k, v, causal=True, key_indices=idx)
    np.testing.assert_allclose(out, attnkit.sdpa(q, k, v, causal=True, mask=mask), atol=1e-6,
                               rtol=0)


def test_lightning_indexer_topk_bad_input_names_the_argument():
    rng = np.random.default_rng(1)
    qc, qs, w, kc, ks = _indexer_inputs(rng, 1, 2, 8, 2)
    with pytest.raises(ValueError, match="topk"):
        attnkit.lightning_indexer_topk(qc, qs, w, kc, ks, 0)
    with pytest.raises(ValueError, match="q_codes"):
        attnkit.lightning_indexer_topk(qc.astype(np.float32), qs, w, kc, ks, 4)
    with pytest.raises(ValueError, match="weights"):
        attnkit.lightning_indexer_topk(qc, qs, w[:, :, :1], kc, ks, 4)
    with pytest.raises(ValueError, match="k_scales"):
        attnkit.lightning_indexer_topk(qc, qs, w, kc, -ks, 4)


def test_deepseek_v32_forward_batch_over_a_paged_pool_equals_forward():
    """Sparse attention over the paged pool (indexer keys in the pages,
    sequences of different lengths in mixed steps, pages of 3) gives each
    sequence what forward() gives it whole."""
    rng = np.random.default_rng(4)
    layer = attnkit.from_config(_v32_config(index_topk=4))
    layer.load_state_dict(_v32_weights(rng))
    steps = [[5, 2, 0], [1, 3, 6], [1, 1, 1], [2, 0, 3], [1, 1, 1]]
    lengths = np.sum(steps, axis=0)
    xs = [rng.standard_normal((int(n), 64)).astype(np.float32) for n in lengths]
    cache = layer.new_paged_cache(num_pages=40, page_size=3)
    ids = [cache.add_sequence() for _ in range(3)]
    outs, done = [[] for _ in ids], [0, 0, 0]
    for counts in steps:
        cache.append(ids, counts)
        x = np.concatenate([xs[s][done[s]:done[s] + counts[s]] for s in range(3)])
        cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        y = layer.forward_batch(x, cu, ids, cache, 0)
        for s in range(3):
            outs[s].append(y[cu[s]:cu[s + 1]])
            done[s] += counts[s]
    for s in range(3):
        want = layer.forward(xs[s][None])[0]
        got = np.concatenate(outs[s])
        # fp32 projections batched differently: a few ulps of the output scale.
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
