"""KVCache: decoding token by token (after chunked prefill) equals full
causal attention over the whole sequence, for MHA / GQA / MQA, float32,
bfloat16, int8 and fp8_e4m3 storage, with and without a sliding window;
failed calls change nothing."""
import numpy as np
import pytest
import torch

import attnkit
from torch_ref import (bf16_criterion, check_close, eight_bit_bound, kv_stored, randn, rng,
                       sdpa_bf16_naive, sdpa_bounds, sdpa_ref)



def bf16_round(x):
    return torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16).float().numpy()


def decode(cache, q, k, v, chunks, backend="auto"):
    """Feeds the sequence through cache.attend in the given chunk sizes and
    returns the concatenated outputs."""
    outs, t = [], 0
    for n in chunks:
        outs.append(cache.attend(q[:, t:t + n], k[:, t:t + n], v[:, t:t + n], backend=backend))
        t += n
    assert t == q.shape[1] and cache.length == t
    return np.concatenate(outs, axis=1)


VARIANTS = {"mha": (4, 4), "gqa": (6, 2), "mqa": (4, 1)}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("window", [0, 5])
def test_decode_equals_full_causal(variant, dtype, window, backend):
    num_heads, num_kv_heads = VARIANTS[variant]
    g = rng(hash((variant, dtype, window)) % 2**32)
    batch, n, d, dv = 2, 17, 16, 8
    q = randn(g, batch, n, num_heads, d)
    k = randn(g, batch, n, num_kv_heads, d)
    v = randn(g, batch, n, num_kv_heads, dv)
    cache = attnkit.KVCache(batch, 24, num_kv_heads, d, head_dim_v=dv, dtype=dtype,
                            sliding_window=window)
    # Prefill in uneven chunks (one longer than the window ring), then one
    # token at a time.
    chunks = [6, 1, 3] + [1] * (n - 10)
    got = decode(cache, q, k, v, chunks, backend)
    win = (window - 1, 0) if window else (-1, -1)
    exact = sdpa_ref(q, k, v, causal=True, window=win)[0]
    if dtype == "float32":
        check_close(f"{variant} f32 W={window}", got, exact, sdpa_bounds(q, k, v)["out"],
                    rel=1e-5)
    elif dtype in ("int8", "fp8_e4m3"):
        # Against attention over the values the cache holds (each token's row
        # of each kv head quantized with its own scale).
        ks, vs = kv_stored(k, dtype), kv_stored(v, dtype)
        want = sdpa_ref(q, ks, vs, causal=True, window=win)[0]
        # int8 decode rounds the weights to int16 (2^-15 of a row's largest).
        check_close(f"{variant} {dtype} W={window}", got, want,
                    eight_bit_bound(q, ks, vs, dtype), rel=1e-4 if dtype == "int8" else 1e-5)
    elif backend == "reference":
        # The reference reads the stored bf16 K/V exactly: attention over
        # the rounded values, within the fp32 bound.
        ks, vs = bf16_round(k), bf16_round(v)
        want = sdpa_ref(q, ks, vs, causal=True, window=win)[0]
        check_close(f"{variant} bf16 W={window}", got, want, sdpa_bounds(q, ks, vs)["out"],
                    rel=1e-5)
    else:
        # Fast kernels may also round q and the softmax weights to bf16.
        bf16_criterion(f"{variant} bf16 W={window}", got, exact,
                       sdpa_bf16_naive(q, k, v, causal=True, window=win),
                       sdpa_bounds(q, k, v)["out"])
    if dtype != "float32":
        assert np.abs(got - exact).max() > 1e-5  # storage really rounds


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "fp8_e4m3"])
def test_keys_values_hold_the_latest_tokens(dtype):
    g = rng(5)
    q, k, v = randn(g, 1, 9, 2, 4), randn(g, 1, 9, 1, 4), randn(g, 1, 9, 1, 6)
    cache = attnkit.KVCache(1, 16, 1, 4, head_dim_v=6, dtype=dtype, sliding_window=4)
    assert cache.slots == 3
    decode(cache, q, k, v, [2, 5, 1, 1])
    assert cache.stored == 3
    ks, vs = kv_stored(k, dtype), kv_stored(v, dtype)
    np.testing.assert_array_equal(cache.keys(), ks[:, -3:].astype(np.float32))
    np.testing.assert_array_equal(cache.values(), vs[:, -3:].astype(np.float32))
    assert cache.keys().dtype == np.float32
    item = {"float32": 4, "bfloat16": 2, "int8": 1, "fp8_e4m3": 1}[dtype]
    scales = 2 * 4 if item == 1 else 0  # one float32 per token row of K and of V
    assert cache.nbytes == 1 * 3 * 1 * ((4 + 6) * item + scales)
    assert cache.dtype == dtype


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_padded_rows_read_back_and_count(dtype):
    # 2 KiB token rows (2 x 256 float32, 4 x 256 bfloat16) are stored one
    # 64-byte line apart; keys()/values() and nbytes do not show it.
    heads = 2 if dtype == "float32" else 4
    item = 4 if dtype == "float32" else 2
    g = rng(8)
    q, k, v = randn(g, 2, 5, 8, 256), randn(g, 2, 5, heads, 256), randn(g, 2, 5, heads, 256)
    cache = attnkit.KVCache(2, 7, heads, 256, dtype=dtype)
    decode(cache, q, k, v, [3, 1, 1])
    ks, vs = (bf16_round(k), bf16_round(v)) if dtype == "bfloat16" else (k, v)
    np.testing.assert_array_equal(cache.keys(), ks)
    np.testing.assert_array_equal(cache.values(), vs)
    assert cache.nbytes == 2 * 7 * heads * 256 * 2 * item
    assert cache.storage_nbytes == cache.nbytes + 2 * 7 * 2 * 64


def test_reset_and_reuse():
    g = rng(6)
    q, k, v = randn(g, 1, 5, 2, 8), randn(g, 1, 5, 2, 8), randn(g, 1, 5, 2, 8)
    cache = attnkit.KVCache(1, 8, 2, 8)
    first = decode(cache, q, k, v, [2, 3])
    cache.reset()
    assert cache.length == 0 and cache.keys().shape == (1, 0, 2, 8)
    # The same calls after reset() give the same bits; a different chunking
    # may take another tile plan, so it agrees to rounding only.
    np.testing.assert_array_equal(decode(cache, q, k, v, [2, 3]), first)
    cache.reset()
    np.testing.assert_allclose(decode(cache, q, k, v, [5]), first, rtol=1e-5, atol=1e-6)


def test_overflow_and_bad_input_leave_cache_unchanged():
    g = rng(7)
    q, k, v = randn(g, 1, 6, 2, 8), randn(g, 1, 6, 1, 8), randn(g, 1, 6, 1, 8)
    cache = attnkit.KVCache(1, 5, 1, 8)
    decode(cache, q[:, :4], k[:, :4], v[:, :4], [4])
    keys, values = cache.keys(), cache.values()
    with pytest.raises(ValueError, match="max_seq_len"):
        cache.attend(q[:, 4:6], k[:, 4:6], v[:, 4:6])
    with pytest.raises(ValueError, match="k_new"):
        cache.attend(q[:, 4:5], k[:, 4:5, :, :4], v[:, 4:5])
    with pytest.raises(ValueError, match="q"):
        cache.attend(q[0], k[:, 4:5], v[:, 4:5])
    assert cache.length == 4
    np.testing.assert_array_equal(cache.keys(), keys)
    np.testing.assert_array_equal(cache.values(), values)
    # And the cache still works.
    out = cache.attend(q[:, 4:5], k[:, 4:5], v[:, 4:5])
    want = sdpa_ref(q[:, :5], k[:, :5], v[:, :5], causal=True)[0][:, 4:5]
    check_close("after errors", out, want, sdpa_bounds(q, k, v)["out"])


def test_cache_options_softcap_and_scale():
    g = rng(8)
    q, k, v = randn(g, 1, 7, 4, 8), randn(g, 1, 7, 2, 8), randn(g, 1, 7, 2, 8)
    cache = attnkit.KVCache(1, 7, 2, 8)
    outs = [cache.attend(q[:, :3], k[:, :3], v[:, :3], softmax_scale=0.5, softcap=2.0)]
    for t in range(3, 7):
        outs.append(cache.attend(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], softmax_scale=0.5,
                                 softcap=2.0))
    want = sdpa_ref(q, k, v, softmax_scale=0.5, softcap=2.0, causal=True)[0]
    check_close("softcap decode", np.concatenate(outs, 1), want,
                sdpa_bounds(q, k, v, softmax_scale=0.5)["out"])
