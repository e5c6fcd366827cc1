"""attnkit.sdpa and merge_attention_states against a float64 PyTorch
implementation written from FlashAttention's rules (torch 1.13 has no
F.scaled_dot_product_attention): GQA by repeat_interleave, an explicit
bottom-right causal/window mask, softcap, seqlens_k, bool/additive masks and
the Sparse Transformer patterns."""
import threading
import tracemalloc

import numpy as np
import pytest
import torch

import attnkit
from torch_ref import (EPS32, bf16_criterion, check_close, eight_bit_bound, kv_stored, randn,
                       rng, sdpa_bf16_naive, sdpa_bounds, sdpa_ref)


def random_case(seed):
    """A random attention problem: shapes, GQA grouping and options."""
    g = rng(seed)
    num_kv_heads = int(g.choice([1, 2, 3]))
    num_heads = num_kv_heads * int(g.choice([1, 2, 4]))
    batch = int(g.integers(1, 4))
    head_dim = int(g.choice([4, 8, 16, 24]))
    head_dim_v = head_dim if g.random() < 0.6 else int(g.choice([4, 12]))
    seqlen_q = int(g.integers(1, 10))
    seqlen_k = int(g.integers(1, 20))
    opts = {}
    if g.random() < 0.5:
        opts["causal"] = True
    r = g.random()
    if r < 0.2:
        opts["window_size"] = (int(g.integers(0, 6)), -1)
    elif r < 0.3:
        opts["window_size"] = (int(g.integers(0, 6)), int(g.integers(0, 4)))
    elif r < 0.35:
        opts["window_size"] = (-1, int(g.integers(0, 4)))
    if g.random() < 0.3:
        opts["softcap"] = float(g.uniform(1.0, 10.0))
    if g.random() < 0.4:
        opts["seqlens_k"] = g.integers(0, seqlen_k + 1, size=batch)
    if g.random() < 0.3:
        opts["softmax_scale"] = float(g.uniform(0.05, 1.0))
    q = randn(g, batch, seqlen_q, num_heads, head_dim)
    k = randn(g, batch, seqlen_k, num_kv_heads, head_dim)
    v = randn(g, batch, seqlen_k, num_kv_heads, head_dim_v)
    return q, k, v, opts


def ref_of(q, k, v, opts, mask=None, sparse=None):
    return sdpa_ref(q, k, v, softmax_scale=opts.get("softmax_scale"),
                    causal=opts.get("causal", False), window=opts.get("window_size", (-1, -1)),
                    softcap=opts.get("softcap", 0.0), seqlens_k=opts.get("seqlens_k"),
                    mask=mask, sparse=sparse)


def check_all(tag, got, want, bounds):
    out, lse, probs = got
    check_close(f"{tag} out", out, want[0], bounds["out"], rel=1e-5)
    check_close(f"{tag} lse", lse, want[1], bounds["lse"])
    check_close(f"{tag} probs", probs, want[2], bounds["probs"])


@pytest.mark.parametrize("seed", range(24))
def test_random_against_torch(seed, backend):
    q, k, v, opts = random_case(seed)
    got = attnkit.sdpa(q, k, v, return_lse=True, return_probs=True, backend=backend, **opts)
    bounds = sdpa_bounds(q, k, v, opts.get("softmax_scale"))
    check_all(f"seed {seed} {opts}", got, ref_of(q, k, v, opts), bounds)
    assert got[0].dtype == np.float32 and got[0].shape == q.shape[:3] + v.shape[3:]
    assert got[1].shape == (q.shape[0], q.shape[2], q.shape[1])


@pytest.mark.parametrize("seed", range(6))
def test_bf16_kv_storage(seed, backend):
    """kv_dtype='bfloat16' rounds K/V to nearest-even bf16 (as torch's
    .to(torch.bfloat16)). Asking for probs runs the reference kernel, which
    reads the rounded values exactly: the fp32 bound against float64
    attention over them. Without probs the fast kernels may also round q and
    the softmax weights: FlashAttention's 2x-naive-twin rule."""
    q, k, v, opts = random_case(100 + seed)
    kb = torch.from_numpy(k).to(torch.bfloat16).float().numpy()
    vb = torch.from_numpy(v).to(torch.bfloat16).float().numpy()
    assert not np.array_equal(kb, k)  # the rounding is really exercised
    got = attnkit.sdpa(q, k, v, kv_dtype="bfloat16", return_lse=True, return_probs=True,
                       backend=backend, **opts)
    check_all("bf16 kv", got, ref_of(q, kb, vb, opts),
              sdpa_bounds(q, kb, vb, opts.get("softmax_scale")))
    out = attnkit.sdpa(q, k, v, kv_dtype="bfloat16", backend=backend, **opts)
    exact = ref_of(q, k, v, opts)[0]
    naive = sdpa_bf16_naive(q, k, v, opts.get("softmax_scale"), opts.get("causal", False),
                            opts.get("window_size", (-1, -1)), opts.get("softcap", 0.0),
                            opts.get("seqlens_k"))
    bf16_criterion("bf16 kv fast", out, exact, naive,
                   sdpa_bounds(q, k, v, opts.get("softmax_scale"))["out"])


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("seed", range(4))
def test_eight_bit_kv_storage(dtype, seed, backend):
    """kv_dtype='int8' / 'fp8_e4m3' quantizes each row of each kv head as an
    8-bit KVCache stores it: against float64 attention over the stored
    values, with the 8-bit paths' terms in the bound."""
    q, k, v, opts = random_case(200 + seed)
    ks, vs = kv_stored(k, dtype), kv_stored(v, dtype)
    got = attnkit.sdpa(q, k, v, kv_dtype=dtype, backend=backend, **opts)
    want = ref_of(q, ks, vs, opts)[0]
    check_close(f"{dtype} kv", got, want,
                eight_bit_bound(q, ks, vs, dtype, opts.get("softmax_scale")))
    assert np.abs(got - ref_of(q, k, v, opts)[0]).max() > 1e-5  # the storage really rounds


@pytest.mark.parametrize("mask_shape", [(1, 1, 5, 7), (2, 4, 5, 7), (2, 1, 1, 7), (1, 4, 5, 1),
                                        (5, 7), (7,)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_explicit_masks_broadcast(mask_shape, kind, backend):
    """Rank-1..4 masks broadcast like numpy (trailing axes aligned)."""
    g = rng(hash((mask_shape, kind)) % 2**32)
    q, k, v = randn(g, 2, 5, 4, 8), randn(g, 2, 7, 2, 8), randn(g, 2, 7, 2, 8)
    if kind == "bool":
        mask = g.random(mask_shape) < 0.7
    else:
        mask = randn(g, *mask_shape, scale=2.0)
        mask[g.random(mask_shape) < 0.2] = -np.inf
    got = attnkit.sdpa(q, k, v, mask=mask, causal=True, return_lse=True, return_probs=True,
                       backend=backend)
    want = sdpa_ref(q, k, v, causal=True, mask=mask)
    check_all(f"mask {mask_shape} {kind}", got, want, sdpa_bounds(q, k, v, mask=mask))


def test_zero_stride_mask_is_used_in_place(backend):
    """np.broadcast_to gives stride-0 axes; they are valid mask strides."""
    g = rng(7)
    q, k, v = randn(g, 3, 4, 2, 8), randn(g, 3, 6, 2, 8), randn(g, 3, 6, 2, 8)
    base = g.random((4, 6)) < 0.6
    base[:, 0] = True
    mask = np.broadcast_to(base, (3, 2, 4, 6))
    assert mask.strides[0] == 0
    got = attnkit.sdpa(q, k, v, mask=mask, backend=backend)
    check_close("broadcast mask", got, sdpa_ref(q, k, v, mask=base)[0],
                sdpa_bounds(q, k, v)["out"], rel=1e-5)


@pytest.mark.parametrize("sparse", [
    {"kind": "strided", "stride": 3},
    {"kind": "strided", "stride": 2, "block_size": 2},
    {"kind": "fixed", "stride": 4, "summary": 1},
    {"kind": "fixed", "stride": 3, "summary": 2, "block_size": 2},
])
@pytest.mark.parametrize("causal", [False, True])
def test_sparse_patterns(sparse, causal, backend):
    g = rng(11)
    q, k, v = randn(g, 2, 13, 2, 8), randn(g, 2, 13, 1, 8), randn(g, 2, 13, 1, 8)
    got = attnkit.sdpa(q, k, v, sparse=sparse, causal=causal, return_lse=True,
                       return_probs=True, backend=backend)
    want = sdpa_ref(q, k, v, causal=causal, sparse=sparse)
    check_all(f"sparse {sparse}", got, want, sdpa_bounds(q, k, v))
    # The pattern really removes keys (so the test could fail on a no-op).
    assert (want[2] == 0).sum() > (sdpa_ref(q, k, v, causal=causal)[2] == 0).sum()


def test_rows_without_keys_are_zero_not_nan(backend):
    """seqlens_k = 0 and fully masked rows give out 0, lse -inf, probs 0;
    NaN/Inf stored in padding keys never leak."""
    g = rng(3)
    q, k, v = randn(g, 2, 3, 2, 8), randn(g, 2, 5, 2, 8), randn(g, 2, 5, 2, 8)
    k[0, 2:] = np.nan
    v[0, 2:] = np.inf
    out, lse, probs = attnkit.sdpa(q, k, v, seqlens_k=[2, 0], return_lse=True,
                                   return_probs=True, backend=backend)
    assert np.isfinite(out).all()
    assert np.all(out[1] == 0) and np.all(np.isneginf(lse[1])) and np.all(probs[1] == 0)
    want = sdpa_ref(q[:1], k[:1, :2], v[:1, :2])
    check_close("padded batch 0", out[:1], want[0], sdpa_bounds(q, k[:, :2], v[:, :2])["out"])
    mask = np.ones((1, 1, 3, 5), dtype=bool)
    mask[..., 1, :] = False
    out = attnkit.sdpa(q[1:], k[1:], v[1:], mask=mask, backend=backend)
    assert np.all(out[:, 1] == 0) and np.all(out[:, 0] != 0)


@pytest.mark.parametrize("seed", range(4))
def test_merge_attention_states(seed):
    """Attention over keys [0, s) merged with keys [s, n) equals attention
    over all n keys (a split-KV decode)."""
    g = rng(seed)
    q, k, v = randn(g, 2, 3, 4, 8), randn(g, 2, 11, 2, 8), randn(g, 2, 11, 2, 6)
    s = int(g.integers(1, 10))
    oa, la = attnkit.sdpa(q, k[:, :s], v[:, :s], return_lse=True)
    ob, lb = attnkit.sdpa(q, k[:, s:], v[:, s:], return_lse=True)
    out, lse = attnkit.merge_attention_states(oa, la, ob, lb)
    want = sdpa_ref(q, k, v)
    bounds = sdpa_bounds(q, k, v)
    check_close("merged out", out, want[0], 2 * bounds["out"], rel=1e-5)
    check_close("merged lse", lse, want[1], 2 * bounds["lse"])


def test_merge_with_empty_side():
    """A side with lse = -inf (no keys) contributes nothing; both empty -> 0."""
    g = rng(5)
    q, k, v = randn(g, 1, 2, 2, 4), randn(g, 1, 5, 2, 4), randn(g, 1, 5, 2, 4)
    oa, la = attnkit.sdpa(q, k, v, return_lse=True)
    ob, lb = attnkit.sdpa(q, k, v, seqlens_k=[0], return_lse=True)
    out, lse = attnkit.merge_attention_states(oa, la, ob, lb)
    np.testing.assert_array_equal(out, oa)
    np.testing.assert_array_equal(lse, la)
    out, lse = attnkit.merge_attention_states(ob, lb, ob, lb)
    assert np.all(out == 0) and np.all(np.isneginf(lse))


def test_return_forms():
    g = rng(1)
    q, k, v = randn(g, 1, 2, 2, 4), randn(g, 1, 3, 1, 4), randn(g, 1, 3, 1, 4)
    assert isinstance(attnkit.sdpa(q, k, v), np.ndarray)
    out, lse = attnkit.sdpa(q, k, v, return_lse=True, backend="reference")
    assert lse.shape == (1, 2, 2)
    out2, probs = attnkit.sdpa(q, k, v, return_probs=True, backend="reference")
    assert probs.shape == (1, 2, 2, 3)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=0, atol=4 * 3 * EPS32)
    assert len(attnkit.sdpa(q, k, v, return_lse=True, return_probs=True)) == 3
    np.testing.assert_array_equal(out, out2)


def test_strided_and_converted_inputs_match_contiguous_float32():
    """Transposed/sliced float32 views (used in place), float64 and
    negative-stride arrays (converted) give exactly the contiguous result."""
    g = rng(9)
    q, k, v = randn(g, 2, 5, 4, 8), randn(g, 2, 6, 2, 8), randn(g, 2, 6, 2, 8)
    want = attnkit.sdpa(q, k, v, causal=True, backend="reference")
    # Heads-major storage, viewed as [batch, seq, heads, dim].
    q_t = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    # Every other element of a wider buffer.
    k_wide = np.zeros((2, 6, 2, 16), dtype=np.float32)
    k_wide[..., ::2] = k
    k_s = k_wide[..., ::2]
    v_rev = np.ascontiguousarray(v[:, ::-1])[:, ::-1]  # negative stride on seq
    assert not q_t.flags.c_contiguous and not k_s.flags.c_contiguous and v_rev.strides[1] < 0
    for args in [(q_t, k_s, v_rev), (q.astype(np.float64), k.astype(np.float64), v.tolist())]:
        got = attnkit.sdpa(*args, causal=True, backend="reference")
        np.testing.assert_array_equal(got, want)


def test_contiguous_float32_input_is_not_copied():
    """The big q (256-wide heads, 16 MiB) must not be copied: peak traced
    numpy allocation during the call stays near the small output. A float64
    q of the same shape does need a float32 copy, which the same measurement
    sees (so the check can fail)."""
    g = rng(2)
    q = randn(g, 1, 64, 16, 256)  # 4 MiB
    q = np.concatenate([q] * 4, axis=1)  # [1, 256, 16, 256] = 16 MiB
    k, v = randn(g, 1, 8, 1, 256), randn(g, 1, 8, 1, 1)
    q_strided = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)

    def peak(qq):
        tracemalloc.start()
        try:
            attnkit.sdpa(qq, k, v)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    out_bytes = q.shape[0] * q.shape[1] * q.shape[2] * 1 * 4
    assert peak(q) < out_bytes + q.nbytes // 8
    assert peak(q_strided) < out_bytes + q.nbytes // 8
    assert peak(q.astype(np.float64)) >= q.nbytes


def test_concurrent_calls_agree():
    """Calls from several Python threads (which run while the others hold no
    GIL) give the single-threaded result."""
    g = rng(4)
    q, k, v = randn(g, 2, 16, 4, 16), randn(g, 2, 32, 2, 16), randn(g, 2, 32, 2, 16)
    want = attnkit.sdpa(q, k, v, causal=True, num_threads=1)
    results = [None] * 4

    def work(i):
        results[i] = attnkit.sdpa(q, k, v, causal=True, num_threads=1)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        np.testing.assert_array_equal(r, want)
