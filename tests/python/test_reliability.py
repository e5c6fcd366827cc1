"""Hostile and extreme inputs through the Python API (docs/RELIABILITY.md):
sizes beyond memory or beyond 64 bits, integers beyond int64, subnormal
softcaps, windows near INT64_MAX, empty calls, non-finite inputs reaching
only the rows that see them, +-1e30 logits, and layers called from several
Python threads with their own caches. Every failure must be an exception
naming the argument, never a crash, and must change nothing."""
import threading

import numpy as np
import pytest

import attnkit

INT64_MAX = 2**63 - 1


def rand(g, *shape):
    return g.standard_normal(shape).astype(np.float32)


def test_sizes_beyond_memory_raise_memory_error():
    with pytest.raises(MemoryError, match=r"^KVCache: keys"):
        attnkit.KVCache(2**20, 2**40, 2**10, 2**10)  # 2^80 elements: overflows
    with pytest.raises(MemoryError, match=r"^KVCache: keys"):
        attnkit.KVCache(1, 2**40, 8, 2**16, dtype="bfloat16")  # 2^60 bytes: cannot exist


@pytest.mark.parametrize("kwargs", [
    dict(batch_size=2**64), dict(max_seq_len=-2**70), dict(head_dim=2**63),
    dict(sliding_window=2**64),
])
def test_integers_beyond_int64_raise_and_do_not_wrap(kwargs):
    args = dict(batch_size=1, max_seq_len=4, num_kv_heads=1, head_dim=8)
    args.update(kwargs)
    # pybind11 refuses the conversion (TypeError); attnkit's own parsing
    # raises ValueError. Either way nothing wraps around to a small size.
    with pytest.raises((TypeError, ValueError, OverflowError)):
        attnkit.KVCache(**args)


def test_sdpa_integer_options_beyond_int64():
    g = np.random.default_rng(1)
    q, k = rand(g, 1, 2, 2, 8), rand(g, 1, 3, 1, 8)
    with pytest.raises(ValueError, match=r"window_size"):
        attnkit.sdpa(q, k, k, window_size=(2**64, 0))
    with pytest.raises((TypeError, ValueError, OverflowError)):
        attnkit.sdpa(q, k, k, num_threads=2**40)
    with pytest.raises(ValueError, match=r"seqlens_k"):
        attnkit.sdpa(q, k, k, seqlens_k=[2**40])


def test_subnormal_softcap_is_rejected_and_flt_min_accepted():
    g = np.random.default_rng(2)
    q, k, v = rand(g, 1, 2, 1, 4), rand(g, 1, 5, 1, 4), rand(g, 1, 5, 1, 4)
    q[0, 0] = 0.0  # scores of exactly 0: 0 * (1 / subnormal) would be NaN
    with pytest.raises(ValueError, match=r"sdpa: softcap = 1e-40 is subnormal"):
        attnkit.sdpa(q, k, v, softcap=1e-40)
    cache = attnkit.KVCache(1, 4, 1, 4)
    with pytest.raises(ValueError, match=r"softcap = 1e-40 is subnormal"):
        cache.attend(q, k[:, :2], v[:, :2], softcap=1e-40)
    assert cache.length == 0
    out = attnkit.sdpa(q, k, v, softcap=float(np.finfo(np.float32).tiny))
    assert np.isfinite(out).all()
    # Scores of 0 stay 0 under any cap: row 0 is the plain mean of v.
    np.testing.assert_allclose(out[0, 0, 0], v[0, :, 0].mean(axis=0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_windows_near_int64_max_mean_unlimited(backend):
    g = np.random.default_rng(3)
    q, k, v = rand(g, 1, 4, 2, 8), rand(g, 1, 600, 1, 8), rand(g, 1, 600, 1, 8)
    full = attnkit.sdpa(q, k, v, backend=backend)
    causal = attnkit.sdpa(q, k, v, causal=True, backend=backend)
    np.testing.assert_array_equal(
        attnkit.sdpa(q, k, v, window_size=(INT64_MAX, INT64_MAX), backend=backend), full)
    np.testing.assert_array_equal(
        attnkit.sdpa(q, k, v, window_size=(INT64_MAX, 0), backend=backend), causal)


def test_empty_calls_return_empty_results():
    g = np.random.default_rng(4)
    k = rand(g, 2, 3, 1, 4)
    out, lse = attnkit.sdpa(np.zeros((2, 0, 2, 4), np.float32), k, k, return_lse=True)
    assert out.shape == (2, 0, 2, 4) and lse.shape == (2, 2, 0)
    out = attnkit.sdpa(rand(g, 2, 3, 2, 4), np.zeros((2, 0, 1, 4), np.float32),
                       np.zeros((2, 0, 1, 4), np.float32))
    np.testing.assert_array_equal(out, 0.0)  # no keys: 0, never NaN


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_non_finite_inputs_reach_only_the_rows_that_see_them(backend):
    g = np.random.default_rng(5)
    b, sq, sk, h, hkv, d = 2, 3, 700, 4, 2, 8
    q, k, v = rand(g, b, sq, h, d), rand(g, b, sk, hkv, d), rand(g, b, sk, hkv, d)
    q[0, 0, 3, 1] = np.nan         # its own row only
    k[1, 698, 0, 2] = np.nan       # rows of item 1, heads 0-1, that reach key 698 (i >= 1)
    k[0, 100, 1, 0] = np.inf       # masked for item 0 by seqlens_k = 50: reaches nothing
    v[0, 20, 1, 3] = np.nan        # item 0, heads 2-3: every row sees key 20
    out = attnkit.sdpa(q, k, v, causal=True, seqlens_k=[50, 700], backend=backend)
    expect = np.zeros((b, sq, h), bool)
    expect[0, 0, 3] = True
    expect[1, 1:, 0:2] = True
    expect[0, :, 2:4] = True
    np.testing.assert_array_equal(np.isnan(out).any(axis=-1), expect)
    assert np.isfinite(out[~expect]).all()


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_logits_of_1e30_stay_finite(backend):
    # Scores up to 1.9e30 after scaling, exact in fp32 (powers of two times
    # small integers): each row averages its tied largest keys.
    q = (np.arange(2 * 5 * 2) % 3 - 1).astype(np.float32).reshape(2, 5, 2, 1) * 2.0**21
    k = (np.arange(2 * 700) % 5 - 2).astype(np.float32).reshape(2, 700, 1, 1) * 2.0**19 * 0.75
    v = np.random.default_rng(6).uniform(-1, 1, (2, 700, 1, 4)).astype(np.float32)
    out, lse = attnkit.sdpa(q, k, v, softmax_scale=2.0**60, return_lse=True, backend=backend)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    s = q[..., 0][:, :, :, None] * k[:, :, 0, 0][:, None, None, :]  # [b, sq, h, sk]
    top = s == s.max(axis=-1, keepdims=True)
    want = (top[..., None] * v[:, None, None, :, 0, :]).sum(axis=3) / top.sum(axis=-1)[..., None]
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def test_layers_from_python_threads_with_their_own_caches():
    cfg = dict(model_type="llama", hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
               rms_norm_eps=1e-6, rope_theta=10000.0)
    layer = attnkit.from_config(cfg)
    g = np.random.default_rng(7)
    shapes = {"q_proj.weight": (32, 32), "k_proj.weight": (16, 32), "v_proj.weight": (16, 32),
              "o_proj.weight": (32, 32)}
    layer.load_state_dict({name: (0.2 * g.standard_normal(shape)).astype(np.float32)
                           for name, shape in shapes.items()})
    xs = [rand(g, 2, 12, 32) for _ in range(4)]

    def session(x, num_threads):
        cache = layer.new_cache(2, 12)
        outs = [layer.forward(x[:, :6], cache=cache, num_threads=num_threads)]
        outs += [layer.forward(x[:, t:t + 1], cache=cache, num_threads=num_threads)
                 for t in range(6, 12)]
        return np.concatenate(outs, axis=1)

    serial = [session(x, 1) for x in xs]
    got = [None] * 4
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, session(xs[i], 1 + i % 3)))
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        # Results do not depend on the thread count, nor on what runs beside.
        np.testing.assert_array_equal(got[i], serial[i])
