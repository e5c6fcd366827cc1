"""sdpa(key_indices=): attention over per-query key indices (DeepSeek-V3.2's
DSA, FlashMLA's sparse interface) against a float64 numpy loop."""
import numpy as np
import pytest

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
