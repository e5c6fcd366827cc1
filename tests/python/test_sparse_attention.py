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


def _v32_config(**over):
    cfg = dict(model_type="deepseek_v32", hidden_size=64, num_attention_heads=2, q_lora_rank=32,
               kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
               index_n_heads=2, index_head_dim=128, index_topk=4, num_hidden_layers=1)
    cfg.update(over)
    return cfg


def test_deepseek_v32_layer_runs_sparse_and_dense_equal_when_topk_covers_all():
    rng = np.random.default_rng(0)
    shapes = {"q_a_proj.weight": (32, 64), "q_a_layernorm.weight": (32,),
              "q_b_proj.weight": (32, 32), "kv_a_proj_with_mqa.weight": (24, 64),
              "kv_a_layernorm.weight": (16,), "kv_b_proj.weight": (32, 16),
              "o_proj.weight": (64, 16), "indexer.wq_b.weight": (256, 32),
              "indexer.wk.weight": (128, 64), "indexer.k_norm.weight": (128,),
              "indexer.k_norm.bias": (128,), "indexer.weights_proj.weight": (2, 64)}
    sd = {n: (rng.standard_normal(s) * 0.2).astype(np.float32) for n, s in shapes.items()}
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
