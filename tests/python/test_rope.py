"""RoPE against Hugging Face's formulas restated in float64 torch: rotate_half
for the half-split pairing, Meta's complex-number form for the interleaved
one, partial rotary, and the linear / llama3 / yarn inverse frequencies."""
import numpy as np
import pytest

import attnkit
from torch_ref import (EPS32, check_close, inv_freq_ref, randn, rng, rope_half_ref,
                       rope_interleaved_ref, t64)

SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 256,
     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
     "attention_factor": 1.25},
]


def rope_bound(x, rotary_dim, interleaved, attention_factor):
    """|f32 - f64| per element: each output is x_a cos -/+ x_b sin with cos,
    sin rounded to f32 (1 eps each), two products and one sum (3 eps), on
    magnitudes <= |x_a| + |x_b|, all times attention_factor."""
    x = np.abs(np.asarray(x, dtype=np.float64))
    r = x[..., :rotary_dim]
    if interleaved:
        partner = r.reshape(*r.shape[:-1], -1, 2)[..., ::-1].reshape(r.shape)
    else:
        partner = np.concatenate([r[..., rotary_dim // 2:], r[..., :rotary_dim // 2]], axis=-1)
    b = np.zeros_like(x)
    b[..., :rotary_dim] = 6 * EPS32 * (r + partner) * attention_factor
    return b


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: s and s.get("rope_type", s.get("type")))
@pytest.mark.parametrize("rotary", ["full", "partial"])
def test_inv_freq_matches_hf_formulas(scaling, rotary):
    head_dim = 64
    rotary_dim = head_dim if rotary == "full" else 32
    theta = 500000.0 if scaling and scaling.get("rope_type") == "llama3" else 10000.0
    rope = attnkit.Rope(head_dim, theta=theta, rotary_dim=rotary_dim, scaling=scaling)
    want, att = inv_freq_ref(rotary_dim, theta, scaling)
    assert rope.inv_freq.dtype == np.float64 and rope.inv_freq.shape == (rotary_dim // 2,)
    check_close("inv_freq", rope.inv_freq, want, 1e-14 * np.abs(want))
    assert abs(rope.attention_factor - att) <= 1e-14 * att
    if scaling:
        # The scaling really changes something (the test could fail).
        assert not np.allclose(rope.inv_freq, inv_freq_ref(rotary_dim, theta)[0]) or (
            att != 1.0)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_matches_torch(seed, interleaved):
    g = rng(seed)
    batch, seq, heads = int(g.integers(1, 3)), int(g.integers(1, 9)), int(g.integers(1, 4))
    head_dim = int(g.choice([8, 16, 64]))
    rotary_dim = head_dim if g.random() < 0.5 else int(g.choice([2, 4, head_dim // 2]))
    theta = float(g.choice([10000.0, 1e6]))
    scaling = SCALINGS[seed % len(SCALINGS)]
    x = randn(g, batch, seq, heads, head_dim)
    if g.random() < 0.5:
        positions = g.integers(0, 5000, size=seq)
    else:
        positions = g.integers(0, 5000, size=(batch, seq))
    x_before = x.copy()
    got = attnkit.apply_rope(x, positions, theta=theta, rotary_dim=rotary_dim,
                             interleaved=interleaved, scaling=scaling)
    np.testing.assert_array_equal(x, x_before)  # the input is not modified
    inv, att = inv_freq_ref(rotary_dim, theta, scaling)
    ref = rope_interleaved_ref if interleaved else rope_half_ref
    want = ref(t64(x), positions, inv, rotary_dim, att).numpy()
    check_close(f"rope interleaved={interleaved}", got, want,
                rope_bound(x, rotary_dim, interleaved, att), rel=1e-6)
    np.testing.assert_array_equal(got[..., rotary_dim:], x[..., rotary_dim:])


def test_pairings_differ_and_default_positions():
    """The two pairings give different results on the same input (so each
    test above pins its own), and positions=None means 0..seq-1."""
    g = rng(1)
    x = randn(g, 2, 5, 3, 8)
    half = attnkit.apply_rope(x, None)
    inter = attnkit.apply_rope(x, None, interleaved=True)
    assert np.abs(half - inter).max() > 0.1
    np.testing.assert_array_equal(half, attnkit.apply_rope(x, np.arange(5)))
    np.testing.assert_array_equal(half[:, 0], x[:, 0])  # position 0 is the identity


def test_rope_object_apply_and_config():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    rope = attnkit.Rope(16, theta=500000.0, rotary_dim=8, interleaved=True, scaling=scaling)
    cfg = rope.config
    assert cfg["head_dim"] == 16 and cfg["rotary_dim"] == 8 and cfg["interleaved"] is True
    assert cfg["scaling"]["rope_type"] == "llama3" and cfg["scaling"]["factor"] == 8.0
    g = rng(2)
    x = randn(g, 1, 4, 2, 16)
    pos = np.array([3, 70, 900, 12000])
    np.testing.assert_array_equal(
        rope.apply(x, pos),
        attnkit.apply_rope(x, pos, theta=500000.0, rotary_dim=8, interleaved=True,
                           scaling=scaling))


def test_strided_and_float64_inputs():
    g = rng(3)
    x = randn(g, 2, 6, 4, 16)
    want = attnkit.apply_rope(x, np.arange(6) * 7)
    xt = np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(attnkit.apply_rope(xt, np.arange(6) * 7), want)
    np.testing.assert_array_equal(attnkit.apply_rope(x.astype(np.float64), np.arange(6) * 7),
                                  want)
    assert attnkit.apply_rope(x.astype(np.float64), None).dtype == np.float32


def test_llama3_scaling_is_applied_in_rotation():
    """A llama3-scaled rotation matches torch with the scaled frequencies and
    differs from the unscaled one at long positions."""
    g = rng(4)
    scaling = SCALINGS[2]
    x = randn(g, 1, 3, 2, 32)
    pos = np.array([100, 1000, 10000])
    got = attnkit.apply_rope(x, pos, theta=500000.0, scaling=scaling)
    inv, _ = inv_freq_ref(32, 500000.0, scaling)
    want = rope_half_ref(t64(x), pos, inv, 32).numpy()
    check_close("llama3 rope", got, want, rope_bound(x, 32, False, 1.0))
    plain = attnkit.apply_rope(x, pos, theta=500000.0)
    assert np.abs(plain - got).max() > 1e-2
