"""LatentAttention (MLA) against PyTorch in float64.

The reference below is written from the DeepSeek-V2 paper's equations as
restated in shared/reference/mla.md (sections 2-4): query path through
q_a_proj / RMSNorm / q_b_proj (or q_proj), kv_a_proj_with_mqa split
[latent | rope key], RMSNorm on the latent only, per-head
kv_b_proj = [W_UK_h ; W_UV_h], interleaved RoPE (DeepSeek's complex
multiplication) on the rope part of each query head and on the one shared
rope key, softmax scale (d_n + d_r)^-1/2 * mscale(mscale_all_dim)^2, YaRN's
frequency ramp, causal attention, o_proj. It shares no code with attnkit.

Every dimension differs from every other (hidden 44, heads 3, q_lora 20,
kv_lora 24, nope 10, rope 6, v 14 -> d_qk 16, latent row 30, H*d_qk 48,
H*(d_n+d_v) 72, H*d_v 42), so a transposed or mis-split weight cannot pass.

Bound: the issue's relative error, max|got - want| <= 1e-5 * max|want|.
The fp32 pipeline's own error is ~ eps32 * sqrt(reduction length) per stage
(~1e-6 here); every plausible bug (pairing, scale, split order, missing
norm) is O(1e-1).
"""
import copy
import json
import math

import numpy as np
import pytest
import torch

from attnkit import _attnkit
from torch_ref import check_close, kv_stored, rng, t64

REL = 1e-5

BASE = {
    "model_type": "deepseek_v3",
    "hidden_size": 44,
    "num_attention_heads": 3,
    "q_lora_rank": 20,
    "kv_lora_rank": 24,
    "qk_nope_head_dim": 10,
    "qk_rope_head_dim": 6,
    "v_head_dim": 14,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 1024,
    "attention_bias": False,
    "rope_scaling": None,
}

# orig 256 and beta 4/1 over 3 pairs give ramps 0, 0.5, 1: one pair kept,
# one blended, one interpolated.
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
        "beta_fast": 4, "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 0.8}
# mscale != mscale_all_dim: Hugging Face multiplies cos/sin by the ratio of
# the two mscales (1 in released configs, not here).
YARN_RATIO = dict(YARN, mscale=1.0, mscale_all_dim=0.707)


def config(q_lora=True, scaling=None, **over):
    c = copy.deepcopy(BASE)
    c["q_lora_rank"] = 20 if q_lora else None
    c["rope_scaling"] = copy.deepcopy(scaling)
    c.update(over)
    return c


def make_layer(cfg):
    return _attnkit.LatentAttention.from_config_json(json.dumps(cfg))


def random_weights(cfg, seed):
    g = rng(seed)
    H, d = cfg["num_attention_heads"], cfg["hidden_size"]
    dq, dc = cfg["q_lora_rank"] or 0, cfg["kv_lora_rank"]
    dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]

    def mat(o, i):
        return (g.uniform(-1, 1, (o, i)) / math.sqrt(i)).astype(np.float32)

    w = {}
    if dq:
        w["q_a_proj.weight"] = mat(dq, d)
        w["q_a_layernorm.weight"] = g.uniform(0.5, 1.5, dq).astype(np.float32)
        w["q_b_proj.weight"] = mat(H * (dn + dr), dq)
    else:
        w["q_proj.weight"] = mat(H * (dn + dr), d)
    w["kv_a_proj_with_mqa.weight"] = mat(dc + dr, d)
    w["kv_a_layernorm.weight"] = g.uniform(0.5, 1.5, dc).astype(np.float32)
    w["kv_b_proj.weight"] = mat(H * (dn + dv), dc)
    w["o_proj.weight"] = mat(d, H * dv)
    return w


# --------------------------------------------------------------------------
# The float64 reference, from the equations
# --------------------------------------------------------------------------

def yarn_mscale(factor, m):
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def inv_freq(cfg):
    """theta^(-2i/d_r); with YaRN, pairs below the beta_fast boundary keep
    their frequency, pairs above beta_slow's are divided by the factor, and
    a linear ramp blends those between (mla.md section 2)."""
    dr, theta = cfg["qk_rope_head_dim"], cfg["rope_theta"]
    f = theta ** (-torch.arange(0, dr, 2, dtype=torch.float64) / dr)
    rs = cfg["rope_scaling"]
    if not rs:
        return f
    orig = rs["original_max_position_embeddings"]

    def corr(n_rot):
        return dr * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(corr(rs["beta_fast"])), 0)
    high = min(math.ceil(corr(rs["beta_slow"])), dr - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dr // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return f / rs["factor"] * (1 - keep) + f * keep


def amplitude(cfg):
    rs = cfg["rope_scaling"]
    if rs and rs.get("mscale") and rs.get("mscale_all_dim"):
        return yarn_mscale(rs["factor"], rs["mscale"]) / yarn_mscale(rs["factor"], rs["mscale_all_dim"])
    return 1.0


def softmax_scale(cfg):
    s = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5
    rs = cfg["rope_scaling"]
    if rs and rs.get("mscale_all_dim"):
        s *= yarn_mscale(rs["factor"], rs["mscale_all_dim"]) ** 2
    return s


def rope_interleaved(x, pos, cfg):
    """x [..., S, d_r] with pairs (2i, 2i+1) as complex numbers, times
    amplitude * e^(i pos f_i). pos broadcasts against x's leading dims."""
    f = inv_freq(cfg)
    ang = t64(pos)[..., None] * f  # [.., S, d_r/2]
    rot = torch.polar(torch.full_like(ang, amplitude(cfg)), ang)
    z = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(z * rot).reshape(x.shape)


def rope_half_split(x, pos, cfg):
    """Hugging Face's rotate_half pairing (rope_interleave = false): feature
    i rotates with feature i + d_r/2, x*cos + rotate_half(x)*sin with
    rotate_half(x) = [-x2, x1], times the same amplitude."""
    ang = t64(pos)[..., None] * inv_freq(cfg)  # [.., S, d_r/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1) * amplitude(cfg)
    sin = torch.cat([ang.sin(), ang.sin()], -1) * amplitude(cfg)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def rope(x, pos, cfg):
    return (rope_interleaved if cfg.get("rope_interleave", True) else rope_half_split)(x, pos, cfg)


def rmsnorm(x, g, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * g


def mla_ref(cfg, w, x, pos):
    """x [B, S, d] float32 numpy, pos [S] or [B, S]; full causal attention.
    Returns (out [B, S, d], latent rows [B, S, d_c + d_r])."""
    W = {k: t64(v) for k, v in w.items()}
    H, dc = cfg["num_attention_heads"], cfg["kv_lora_rank"]
    dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    eps = cfg["rms_norm_eps"]
    X = t64(x)
    B, S, _ = X.shape
    if cfg["q_lora_rank"]:
        q = rmsnorm(X @ W["q_a_proj.weight"].T, W["q_a_layernorm.weight"], eps) @ W["q_b_proj.weight"].T
    else:
        q = X @ W["q_proj.weight"].T
    q = q.view(B, S, H, dn + dr).transpose(1, 2)  # [B, H, S, d_qk]
    q_nope, q_pe = q[..., :dn], q[..., dn:]
    pos_b = np.broadcast_to(np.asarray(pos), (B, S))
    q_pe = rope(q_pe, pos_b[:, None, :], cfg)  # per head
    kv_a = X @ W["kv_a_proj_with_mqa.weight"].T
    c_kv = rmsnorm(kv_a[..., :dc], W["kv_a_layernorm.weight"], eps)  # latent only
    k_pe = rope(kv_a[..., dc:], pos_b, cfg)  # [B, S, d_r], one per token
    kv = (c_kv @ W["kv_b_proj.weight"].T).view(B, S, H, dn + dv).transpose(1, 2)
    k_nope, v = kv[..., :dn], kv[..., dn:]
    k = torch.cat([k_nope, k_pe[:, None].expand(B, H, S, dr)], -1)
    qf = torch.cat([q_nope, q_pe], -1)
    scores = qf @ k.transpose(-1, -2) * softmax_scale(cfg)
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    o = torch.softmax(scores, -1) @ v  # [B, H, S, d_v]
    out = o.transpose(1, 2).reshape(B, S, H * dv) @ W["o_proj.weight"].T
    return out.numpy(), torch.cat([c_kv, k_pe], -1).numpy()


def check_rel(name, got, want):
    bound = REL * np.abs(want).max()
    err = check_close(name, got, want, bound)
    return err / np.abs(want).max()


# --------------------------------------------------------------------------
# Exactness
# --------------------------------------------------------------------------

VARIANTS = [(q, s) for q in (True, False) for s in (None, "yarn", "yarn_ratio")]


@pytest.mark.parametrize("q_lora,scaling", VARIANTS)
@pytest.mark.parametrize("form", ["naive", "absorbed", "auto"])
def test_forward_matches_torch(q_lora, scaling, form, backend):
    cfg = config(q_lora, {None: None, "yarn": YARN, "yarn_ratio": YARN_RATIO}[scaling])
    w = random_weights(cfg, 1 + 2 * q_lora + len(str(scaling)))
    layer = make_layer(cfg)
    layer.load_state_dict(w)
    x = rng(5).uniform(-1, 1, (2, 7, 44)).astype(np.float32)
    pos = np.arange(300, 307)  # past YaRN's original context
    want, _ = mla_ref(cfg, w, x, pos)
    got = layer.forward(x, positions=pos, form=form, backend=backend)
    check_rel(f"{form} q_lora={q_lora} scaling={scaling} backend={backend}", got, want)


def test_strided_x_reads_as_its_values(backend):
    """The layer addresses x as one dense block: a strided float32 view (every
    other token, a transposed batch) must give what its contiguous copy gives,
    and both must match the float64 reference."""
    cfg = config(True, None)
    w = random_weights(cfg, 41)
    layer = make_layer(cfg)
    layer.load_state_dict(w)
    big = rng(42).uniform(-1, 1, (7, 2, 2 * 44)).astype(np.float32)
    x = big.transpose(1, 0, 2)[:, :, ::2]
    assert not x.flags.c_contiguous
    pos = np.arange(7)
    got = layer.forward(x, positions=pos, backend=backend)
    np.testing.assert_array_equal(got, layer.forward(np.ascontiguousarray(x), positions=pos,
                                                     backend=backend))
    want, _ = mla_ref(cfg, w, x, pos)
    check_rel(f"strided x backend={backend}", got, want)


@pytest.mark.parametrize("scaling", [None, "yarn"])
def test_rope_interleave_false_uses_the_half_split_pairing(scaling, backend):
    """DeepSeek-V3 configs may say rope_interleave: false; Hugging Face then
    rotates (i, i + d_r/2) pairs. Prefill, then decode through the cache in
    both forms, against the float64 reference with that pairing."""
    cfg = config(True, {None: None, "yarn": YARN}[scaling], rope_interleave=False)
    w = random_weights(cfg, 31)
    layer = make_layer(cfg)
    assert layer.config["rope_interleave"] is False
    layer.load_state_dict(w)
    B, S = 2, 9
    x = rng(32).uniform(-1, 1, (B, S, 44)).astype(np.float32)
    want, latent = mla_ref(cfg, w, x, np.arange(S))
    for form in ("naive", "absorbed"):
        check_rel(f"half-split {form} {backend}", layer.forward(x, form=form, backend=backend), want)
    cache = layer.new_cache(B, S)
    got = np.zeros_like(x)
    got[:, :5] = layer.forward(x[:, :5], cache=cache, form="naive", backend=backend)
    for t in range(5, S):
        got[:, t:t + 1] = layer.forward(x[:, t:t + 1], cache=cache, form="absorbed", backend=backend)
    check_rel(f"half-split prefill + decode {backend}", got, want)
    # The interleaved layer computes a different function of the same weights.
    interleaved = make_layer(dict(cfg, rope_interleave=True))
    interleaved.load_state_dict(w)
    diff = np.abs(interleaved.forward(x) - want).max() / np.abs(want).max()
    assert diff > 1e-2


def test_softmax_scale_and_config_roundtrip():
    for scaling in (None, YARN, YARN_RATIO):
        cfg = config(True, scaling)
        layer = make_layer(cfg)
        assert layer.softmax_scale == pytest.approx(softmax_scale(cfg), rel=1e-15)
        assert layer.config["qk_rope_head_dim"] == 6
    assert make_layer(config(False)).config["q_lora_rank"] is None


def test_naive_equals_absorbed_per_batch_positions(backend):
    cfg = config(True, YARN)
    w = random_weights(cfg, 9)
    layer = make_layer(cfg)
    layer.load_state_dict(w)
    g = rng(10)
    x = g.uniform(-1, 1, (3, 5, 44)).astype(np.float32)
    pos = g.integers(0, 2000, (3, 5))
    naive = layer.forward(x, positions=pos, form="naive", backend=backend)
    absorbed = layer.forward(x, positions=pos, form="absorbed", backend=backend)
    check_rel("absorbed vs naive", absorbed, naive.astype(np.float64))
    want, _ = mla_ref(cfg, w, x, pos)
    check_rel("naive vs torch, [batch, seq] positions", naive, want)


@pytest.mark.parametrize("q_lora", [True, False])
@pytest.mark.parametrize("start", [0, 1000])
def test_chunked_prefill_then_decode_equals_full_causal(q_lora, start, backend):
    """Prefill in chunks (the second one at cache offset 4), then decode
    token by token; forms alternate so each reads what the other wrote.
    `start` shifts every position (a sequence continuing past 1000)."""
    cfg = config(q_lora, YARN)
    w = random_weights(cfg, 20 + q_lora)
    layer = make_layer(cfg)
    layer.load_state_dict(w)
    B, S = 2, 13
    x = rng(11).uniform(-1, 1, (B, S, 44)).astype(np.float32)
    want, latent = mla_ref(cfg, w, x, np.arange(start, start + S))
    cache = layer.new_cache(B, 16)
    assert cache.length == 0
    chunks = [(0, 4, "naive"), (4, 10, "absorbed"), (10, 11, "auto"), (11, 12, "naive"),
              (12, 13, "absorbed")]
    got = np.zeros_like(x)
    for t0, t1, form in chunks:
        pos = None if start == 0 else np.arange(start + t0, start + t1)
        got[:, t0:t1] = layer.forward(x[:, t0:t1], positions=pos, cache=cache, form=form,
                                       backend=backend)
        assert cache.length == t1
    check_rel(f"chunked prefill + decode, q_lora={q_lora} start={start} {backend}", got, want)
    # The cache holds exactly [RMSNorm(latent) ; RoPE(rope key)] per token.
    assert cache.values_per_token == 24 + 6
    assert cache.nbytes == B * 16 * (24 + 6) * 4
    check_rel("cache rows", cache.latent(), latent)


def test_cache_sizes_and_bf16():
    layer = make_layer(config(True, YARN))
    w = random_weights(config(True, YARN), 3)
    layer.load_state_dict(w)
    c32 = layer.new_cache(3, 10)
    c16 = layer.new_cache(3, 10, dtype="bfloat16")
    assert (c32.values_per_token, c32.nbytes) == (30, 3 * 10 * 30 * 4)
    assert (c16.values_per_token, c16.nbytes, c16.dtype) == (30, 3 * 10 * 30 * 2, "bfloat16")
    x = rng(4).uniform(-1, 1, (3, 6, 44)).astype(np.float32)
    out = {}
    for form in ("naive", "absorbed"):
        for backend in ("reference", "auto"):
            c16.reset()
            out[form, backend] = layer.forward(x, cache=c16, form=form, backend=backend)
    # The reference kernel widens bf16 K/V exactly, so both forms read the
    # same rounded latents and agree to fp32 rounding.
    ref = out["naive", "reference"].astype(np.float64)
    check_rel("bf16 cache: absorbed vs naive (reference)", out["absorbed", "reference"], ref)
    # Fast kernels may round the scaled queries and the softmax weights to
    # bf16 too (2^-9 relative each, vdpbf16ps); through the softmax and the
    # output projections that stays within 2^-6 of the output's scale.
    for key in [("naive", "auto"), ("absorbed", "auto")]:
        check_close(f"bf16 cache {key}", out[key], ref, 2.0 ** -6 * np.abs(ref).max())
    # 8-bit latent caches hold the f32 cache's rows quantized per 64 channels
    # (one block here: 30 values) and decode within their reach of it.
    c32.reset()
    want = layer.forward(x, cache=c32)
    for dtype, reach in (("int8", 0.03), ("fp8_e4m3", 0.15)):
        c8 = layer.new_cache(3, 10, dtype=dtype)
        assert (c8.nbytes, c8.dtype) == (3 * 10 * (30 + 4), dtype)
        got = layer.forward(x, cache=c8)
        np.testing.assert_array_equal(c8.latent(), kv_stored(c32.latent(), dtype, 64)
                                      .astype(np.float32))
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert 1e-4 < err < reach, (dtype, err)
    # DeepSeek-V3 shapes: 576 values per token, whatever the head count.
    v3 = make_layer(dict(BASE, hidden_size=7168, num_attention_heads=128, q_lora_rank=1536,
                         kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                         v_head_dim=128))
    assert v3.new_cache(1, 4, dtype="bfloat16").nbytes == 4 * 576 * 2
    assert v3.new_cache(1, 1).values_per_token == 576


def test_cache_restored_from_saved_rows_continues_exactly():
    cfg = config(True, YARN)
    layer = make_layer(cfg)
    layer.load_state_dict(random_weights(cfg, 8))
    x = rng(12).uniform(-1, 1, (2, 6, 44)).astype(np.float32)
    a, b = layer.new_cache(2, 8), layer.new_cache(2, 8)
    layer.forward(x[:, :5], cache=a)
    b.append(a.latent())
    assert b.length == 5
    np.testing.assert_array_equal(layer.forward(x[:, 5:], cache=a),
                                  layer.forward(x[:, 5:], cache=b))
    with pytest.raises(ValueError, match="max_seq_len = 8"):
        b.append(a.latent())
    with pytest.raises(ValueError, match="values_per_token"):
        b.append(np.zeros((2, 1, 29), np.float32))
    assert b.length == 6


def test_torch_state_dict_with_prefix():
    cfg = config(False, None)
    w = random_weights(cfg, 30)
    sd = {"model.layers.0.self_attn." + k: torch.from_numpy(v) for k, v in w.items()}
    sd["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(3, 3)  # another module: ignored
    layer = make_layer(cfg)
    layer.load_state_dict(sd, prefix="model.layers.0.self_attn")
    x = rng(6).uniform(-1, 1, (1, 4, 44)).astype(np.float32)
    want, _ = mla_ref(cfg, w, x, np.arange(4))
    check_rel("prefixed torch state dict", layer(x), want)
    assert layer.weight_names() == ["q_proj.weight", "kv_a_proj_with_mqa.weight",
                                    "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"]


# --------------------------------------------------------------------------
# Released configs
# --------------------------------------------------------------------------

RELEASED = {
    # name: (config fields, softmax scale from mla.md section 2)
    "DeepSeek-V2-Lite": (dict(hidden_size=2048, num_attention_heads=16, q_lora_rank=None,
                              rope_theta=10000, rope_scaling=dict(YARN, factor=40, beta_fast=32,
                              original_max_position_embeddings=4096, mscale=0.707,
                              mscale_all_dim=0.707)), 0.114721),
    "DeepSeek-V3": (dict(hidden_size=7168, num_attention_heads=128, q_lora_rank=1536,
                         rope_theta=10000, rope_scaling=dict(YARN, factor=40, beta_fast=32,
                         original_max_position_embeddings=4096, mscale=1.0,
                         mscale_all_dim=1.0)), 0.135234),
    "Kimi-K2": (dict(model_type="kimi_k2", hidden_size=7168, num_attention_heads=64,
                     q_lora_rank=1536, rope_theta=50000.0, rope_scaling=dict(YARN, factor=32.0,
                     beta_fast=1.0, beta_slow=1.0, original_max_position_embeddings=4096,
                     mscale=1.0, mscale_all_dim=1.0)), 0.130861),
}


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_released_configs(name):
    fields, sigma = RELEASED[name]
    cfg = dict(BASE, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    cfg.update(fields)
    layer = make_layer(cfg)
    assert layer.softmax_scale == pytest.approx(sigma, abs=5e-7)
    assert layer.new_cache(1, 1).values_per_token == 576
    assert layer.choose_form(4096, 0) == "naive"  # prefill
    assert layer.choose_form(1, 4096) == "absorbed"  # decode


# --------------------------------------------------------------------------
# Bad input: clear errors naming the field, nothing written
# --------------------------------------------------------------------------

@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads", "q_lora_rank",
                                   "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                   "v_head_dim"])
def test_missing_fields(field):
    cfg = config()
    del cfg[field]
    with pytest.raises(ValueError, match=field):
        make_layer(cfg)


@pytest.mark.parametrize("over,needle", [
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim = 7 must be even"),
    (dict(kv_lora_rank=0), "kv_lora_rank = 0"),
    (dict(kv_lora_rank=None), "kv_lora_rank"),
    (dict(q_lora_rank=-4), "q_lora_rank = -4"),
    (dict(v_head_dim=0), "v_head_dim = 0"),
    (dict(qk_nope_head_dim=2.5), "qk_nope_head_dim"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_scaling.type"),
    (dict(rope_scaling={"type": "yarn"}), "rope_scaling.factor"),
])
def test_bad_configs(over, needle):
    with pytest.raises(ValueError, match=needle):
        make_layer(config(**over))


def test_bad_weights_change_nothing():
    cfg = config(True, YARN)
    w = random_weights(cfg, 40)
    layer = make_layer(cfg)
    x = rng(1).uniform(-1, 1, (1, 3, 44)).astype(np.float32)
    with pytest.raises(ValueError, match=r"call load_state_dict first"):
        layer.forward(x)  # no weights yet
    layer.load_state_dict(w)
    before = layer.forward(x)
    other = random_weights(cfg, 41)
    for name, bad in [("kv_b_proj.weight", other["kv_b_proj.weight"].T),
                      ("q_b_proj.weight", other["q_b_proj.weight"][:-1]),
                      ("kv_a_proj_with_mqa.weight", other["kv_a_proj_with_mqa.weight"][:24])]:
        sd = dict(other)
        sd[name] = np.ascontiguousarray(bad)
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            layer.load_state_dict(sd)
    sd = dict(other)
    del sd["kv_a_layernorm.weight"]
    with pytest.raises(ValueError, match="kv_a_layernorm"):
        layer.load_state_dict(sd)
    sd = dict(other)
    sd["q_proj.weight"] = np.zeros((48, 44), np.float32)  # q_lora config: unexpected
    with pytest.raises(ValueError, match="q_proj"):
        layer.load_state_dict(sd)
    np.testing.assert_array_equal(layer.forward(x), before)


def test_cache_overflow_and_bad_calls_write_nothing():
    cfg = config(False, None)
    layer = make_layer(cfg)
    layer.load_state_dict(random_weights(cfg, 50))
    x = rng(2).uniform(-1, 1, (2, 5, 44)).astype(np.float32)
    cache = layer.new_cache(2, 6)
    layer.forward(x[:, :4], cache=cache)
    snapshot = cache.latent()
    with pytest.raises(ValueError, match="max_seq_len = 6"):
        layer.forward(x[:, :3], cache=cache)
    with pytest.raises(ValueError, match="batch_size"):
        layer.forward(x[:1, :1], cache=cache)
    with pytest.raises(ValueError, match="hidden_size"):
        layer.forward(x[:, :1, :40], cache=cache)
    with pytest.raises(ValueError, match="positions"):
        layer.forward(x[:, :1], positions=[-3], cache=cache)
    with pytest.raises(ValueError, match="form"):
        layer.forward(x[:, :1], cache=cache, form="fast")
    assert cache.length == 4
    np.testing.assert_array_equal(cache.latent(), snapshot)
    with pytest.raises(ValueError, match="max_seq_len"):
        layer.new_cache(1, 0)
    # The cache still continues the sequence exactly.
    want, _ = mla_ref(cfg, random_weights(cfg, 50), x[:, :5], np.arange(5))
    got = layer.forward(x[:, 4:5], cache=cache)
    check_rel("decode after rejected calls", got, want[:, 4:5])
