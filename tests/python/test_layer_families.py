"""The attention layers of gpt-oss, Gemma 3, Llama 4 and Qwen3-Next against a
PyTorch float64 port written here from the authors' modeling code
(transformers models/{gpt_oss,gemma3,llama4,qwen3_next}): sinks, YaRN with
truncate false, Gemma's (1 + w) norms and local RoPE base, Llama 4's
interleaved RoPE, L2 norm after it, chunked attention and NoPE temperature
tuning, Qwen3-Next's [query | gate] rows and partial RoPE. Each layer kind
runs as a prefill and as prefill-then-decode through a KVCache, built from
an attnkit config dict; from_config(cfg, layer_index), through the C++
config reader, is held to the same port."""
import math

import numpy as np
import pytest
import torch

import attnkit
from torch_ref import check_close, layer_tolerance, randn, random_weights, rng, t64

# ---- the families' configs, as their config.json gives them ----------------

BASE = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "num_hidden_layers": 4}

CONFIGS = {
    "gpt_oss": dict(BASE, model_type="gpt_oss", head_dim=8, attention_bias=True,
                    sliding_window=4, rope_theta=150000.0,
                    layer_types=["sliding_attention", "full_attention"] * 2,
                    rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                  "beta_slow": 1.0, "truncate": False,
                                  "original_max_position_embeddings": 10800}),
    "gemma3_text": dict(BASE, model_type="gemma3_text", head_dim=16, query_pre_attn_scalar=12,
                        sliding_window=5, sliding_window_pattern=2, rope_theta=1e6,
                        rope_local_base_freq=10000.0,
                        rope_scaling={"rope_type": "linear", "factor": 8.0}),
    "llama4_text": dict(BASE, model_type="llama4_text", head_dim=8, rope_theta=500000.0,
                        rms_norm_eps=1e-5, use_qk_norm=True, attention_chunk_size=5,
                        no_rope_layers=[1, 0, 1, 0], attn_temperature_tuning=True,
                        floor_scale=3, attn_scale=0.1, rope_scaling=None),
    "qwen3_next": dict(BASE, model_type="qwen3_next", head_dim=16, rope_theta=10000.0,
                       partial_rotary_factor=0.25, full_attention_interval=2,
                       layer_types=["linear_attention", "full_attention"] * 2),
}


def layer_kind(cfg, i):
    """The facts of layer i that differ per layer, by each family's rule."""
    m = cfg["model_type"]
    if m == "gpt_oss":
        return {"sliding": cfg["layer_types"][i] == "sliding_attention", "rope": True}
    if m == "gemma3_text":
        return {"sliding": (i + 1) % cfg["sliding_window_pattern"] != 0, "rope": True}
    if m == "llama4_text":
        return {"sliding": False, "rope": bool(cfg["no_rope_layers"][i])}
    return {"sliding": False, "rope": True}


def attnkit_config(cfg, i):
    """The attnkit config dict of layer i (what from_config must give)."""
    m, kind = cfg["model_type"], layer_kind(cfg, i)
    d = cfg["head_dim"]
    c = {"model_type": m, "hidden_size": cfg["hidden_size"],
         "num_heads": cfg["num_attention_heads"], "num_kv_heads": cfg["num_key_value_heads"],
         "head_dim": d, "rms_norm_eps": cfg["rms_norm_eps"], "use_rope": kind["rope"]}
    rope = {"head_dim": d, "theta": cfg["rope_theta"], "scaling": cfg.get("rope_scaling")}
    if m == "gpt_oss":
        c.update(qkv_bias=True, o_bias=True, sinks=True,
                 sliding_window=cfg["sliding_window"] if kind["sliding"] else 0)
    elif m == "gemma3_text":
        c.update(qk_norm="rms_one_plus", softmax_scale=cfg["query_pre_attn_scalar"] ** -0.5,
                 sliding_window=cfg["sliding_window"] if kind["sliding"] else 0)
        if kind["sliding"]:
            rope.update(theta=cfg["rope_local_base_freq"], scaling=None)
    elif m == "llama4_text":
        rope["interleaved"] = True
        if kind["rope"]:
            c.update(qk_norm="l2", chunk_size=cfg["attention_chunk_size"])
        else:
            c.update(temperature_tuning=True, floor_scale=float(cfg["floor_scale"]),
                     attn_scale=cfg["attn_scale"])
    else:
        c.update(qk_norm="rms_one_plus", output_gate=True)
        rope["rotary_dim"] = int(d * cfg["partial_rotary_factor"])
    c["rope"] = rope if kind["rope"] else None
    return c


def hf_weights(cfg, seed):
    g = rng(seed)
    e, h, hk, d = (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                   cfg["head_dim"])
    qrows = h * d * (2 if cfg["model_type"] == "qwen3_next" else 1)
    shapes = {"q_proj.weight": (qrows, e), "k_proj.weight": (hk * d, e),
              "v_proj.weight": (hk * d, e), "o_proj.weight": (e, h * d)}
    if cfg.get("attention_bias"):
        shapes.update({"q_proj.bias": (qrows,), "k_proj.bias": (hk * d,),
                       "v_proj.bias": (hk * d,), "o_proj.bias": (e,)})
    if cfg["model_type"] in ("gemma3_text", "qwen3_next"):
        shapes.update({"q_norm.weight": (d,), "k_norm.weight": (d,)})
    if cfg["model_type"] == "gpt_oss":
        shapes["sinks"] = (h,)
    sd = random_weights(g, shapes)
    sd["q_proj.weight"] *= 3.0  # a peaked softmax, so positions and masks show
    if "q_norm.weight" in sd:  # zero-centred, as Gemma and Qwen3-Next store them
        sd["q_norm.weight"] -= 1.0
        sd["k_norm.weight"] -= 1.0
    return sd


# ---- the float64 port ----------------------------------------------------------

def inv_freq(cfg, kind, rotary_dim):
    """(inv_freq, cos/sin factor) as transformers' rope init functions."""
    m = cfg["model_type"]
    theta = cfg["rope_local_base_freq"] if m == "gemma3_text" and kind["sliding"] \
        else cfg["rope_theta"]
    scaling = None if m == "gemma3_text" and kind["sliding"] else cfg.get("rope_scaling")
    base = theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    if not scaling:
        return base, 1.0
    if scaling["rope_type"] == "linear":
        return base / scaling["factor"], 1.0
    factor, orig = scaling["factor"], scaling["original_max_position_embeddings"]

    def correction(rotations):
        return rotary_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = correction(scaling["beta_fast"]), correction(scaling["beta_slow"])
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    freq = base / factor * (1 - extrapolation) + base * extrapolation
    return freq, 0.1 * math.log(factor) + 1.0


def rope(x, pos, cfg, kind):
    """x [b, s, h, d]; half-split pairs (i, i + r/2) or, for Llama 4,
    interleaved (2i, 2i + 1), on the first r features."""
    d = x.shape[-1]
    r = int(d * cfg.get("partial_rotary_factor", 1.0))
    freq, att = inv_freq(cfg, kind, r)
    ang = torch.as_tensor(pos, dtype=torch.float64)[:, None] * freq[None, :]
    cos, sin = (torch.cos(ang) * att)[None, :, None, :], (torch.sin(ang) * att)[None, :, None, :]
    rot, rest = x[..., :r], x[..., r:]
    if cfg["model_type"] == "llama4_text":
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)
    else:
        a, b = rot[..., :r // 2], rot[..., r // 2:]
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
    return torch.cat([out, rest], -1)


def rms(x, eps, gain=None):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if gain is None else y * gain


def port(cfg, sd, x, i):
    """Layer i of the family's attention over x [b, s, hidden], positions 0..s-1."""
    m, kind = cfg["model_type"], layer_kind(cfg, i)
    x = t64(x)
    b, s, _ = x.shape
    h, hk, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]

    def lin(name, inp):
        y = inp @ t64(sd[name + ".weight"]).T
        return y + t64(sd[name + ".bias"]) if name + ".bias" in sd else y

    q = lin("q_proj", x)
    gate = None
    if m == "qwen3_next":  # view(b, s, h, 2d) then chunk: [query | gate] per head
        q, gate = torch.chunk(q.view(b, s, h, 2 * d), 2, dim=-1)
        gate = gate.reshape(b, s, h * d)
    q = q.reshape(b, s, h, d)
    k = lin("k_proj", x).view(b, s, hk, d)
    v = lin("v_proj", x).view(b, s, hk, d)
    if "q_norm.weight" in sd:  # Gemma3RMSNorm / Qwen3NextRMSNorm: (1 + w)
        q = rms(q, eps, 1.0 + t64(sd["q_norm.weight"]))
        k = rms(k, eps, 1.0 + t64(sd["k_norm.weight"]))
    pos = np.arange(s)
    if kind["rope"]:
        q, k = rope(q, pos, cfg, kind), rope(k, pos, cfg, kind)
    if m == "llama4_text" and kind["rope"] and cfg["use_qk_norm"]:
        q, k = rms(q, eps), rms(k, eps)  # Llama4TextL2Norm, after RoPE
    if m == "llama4_text" and not kind["rope"] and cfg["attn_temperature_tuning"]:
        scale = torch.log1p(torch.floor((torch.arange(s, dtype=torch.float64) + 1.0)
                                        / cfg["floor_scale"])) * cfg["attn_scale"] + 1.0
        q = q * scale[None, :, None, None]
    scaling = cfg["query_pre_attn_scalar"] ** -0.5 if m == "gemma3_text" else d ** -0.5
    rep = h // hk
    kk = k.repeat_interleave(rep, dim=2)
    vv = v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scaling
    qi, ki = torch.arange(s)[:, None], torch.arange(s)[None, :]
    keep = ki <= qi
    if kind["sliding"]:
        keep &= ki > qi - cfg["sliding_window"]
    if m == "llama4_text" and kind["rope"]:
        c = cfg["attention_chunk_size"]
        keep &= (ki // c) == (qi // c)
    scores = scores.masked_fill(~keep, float("-inf"))
    if m == "gpt_oss":  # the sink joins the softmax, then its column is dropped
        sinks = t64(sd["sinks"]).view(1, h, 1, 1).expand(b, h, s, 1)
        logits = torch.cat([scores, sinks], -1)
        logits = logits - logits.max(-1, keepdim=True).values
        p = torch.softmax(logits, -1)[..., :-1]
    else:
        p = torch.softmax(scores, -1)
    o = torch.einsum("bhqk,bkhd->bqhd", p, vv).reshape(b, s, h * d)
    if gate is not None:
        o = o * torch.sigmoid(gate)
    return lin("o_proj", o).numpy()


# Both kinds of each family (Qwen3-Next's layer 0 is linear attention).
LAYERS = [("gpt_oss", 0), ("gpt_oss", 1), ("gemma3_text", 0), ("gemma3_text", 1),
          ("llama4_text", 0), ("llama4_text", 1), ("qwen3_next", 1), ("qwen3_next", 3)]


@pytest.mark.parametrize("family,layer_index", LAYERS)
def test_family_layer_against_torch(family, layer_index, backend):
    cfg = CONFIGS[family]
    layer = attnkit.AttentionLayer(attnkit_config(cfg, layer_index))
    sd = hf_weights(cfg, 17 + layer_index)
    assert sorted(layer.weight_names()) == sorted(sd)
    layer.load_state_dict({"model.layers.1.self_attn." + k: v for k, v in sd.items()},
                          prefix="model.layers.1.self_attn.")
    x = randn(rng(layer_index + 3), 2, 13, cfg["hidden_size"])
    want = port(cfg, sd, x, layer_index)
    tol = 1e-4 * np.abs(want).max()
    check_close(f"{family} layer {layer_index}", layer.forward(x, backend=backend), want, tol)
    # Prefill 6 tokens, then decode one at a time through the layer's cache.
    cache = layer.new_cache(2, 13)
    steps = [layer.forward(x[:, :6], cache=cache, backend=backend)]
    for t in range(6, 13):
        steps.append(layer.forward(x[:, t:t + 1], cache=cache, backend=backend))
    check_close(f"{family} layer {layer_index} decode", np.concatenate(steps, 1), want, tol)


def test_port_sees_the_features():
    """Each feature moves the port's output beyond the tolerance, so the
    comparison above can fail: sinks, chunk, temperature, gate, 1 + w."""
    x = randn(rng(0), 1, 13, 32)
    def no_sinks(c, sd):
        sd["sinks"] = sd["sinks"] * 0 - 60.0  # exp(-60): no weight in any denominator

    def no_gate(c, sd):
        w = sd["q_proj.weight"].reshape(4, 2, 16, 32)
        w[:, 1] = 1e3  # sigmoid(gate) = 1 almost everywhere
        sd["q_proj.weight"] = w.reshape(128, 32)

    changes = [("gpt_oss", 0, no_sinks),
               ("llama4_text", 0, lambda c, sd: c.update(attention_chunk_size=100)),
               ("llama4_text", 1, lambda c, sd: c.update(attn_temperature_tuning=False)),
               ("gemma3_text", 0, lambda c, sd: c.update(rope_local_base_freq=1e6)),
               ("qwen3_next", 1, no_gate)]
    for family, i, change in changes:
        cfg = CONFIGS[family]
        sd = hf_weights(cfg, 5)
        want = port(cfg, sd, x, i)
        cfg2, sd2 = dict(cfg), {k: v.copy() for k, v in sd.items()}
        change(cfg2, sd2)
        assert np.abs(port(cfg2, sd2, x, i) - want).max() > 1e-2 * np.abs(want).max(), family


def test_config_dict_keys_and_errors():
    c = attnkit_config(CONFIGS["qwen3_next"], 1)
    layer = attnkit.AttentionLayer(c)
    got = layer.config
    assert got["qk_norm"] == "rms_one_plus" and got["output_gate"] and got["chunk_size"] is None
    assert attnkit.AttentionLayer(got).config == got  # round trip
    assert attnkit.AttentionLayer(dict(c, qk_norm=True)).config["qk_norm"] == "rms"
    assert attnkit.AttentionLayer(dict(c, qk_norm=None)).config["qk_norm"] is None
    l4 = attnkit.AttentionLayer(attnkit_config(CONFIGS["llama4_text"], 0)).config
    assert l4["qk_norm"] == "l2" and l4["chunk_size"] == 5 and l4["rope"]["interleaved"]
    with pytest.raises(ValueError, match=r"config\['qk_norm'\] = 'rms2' must be None"):
        attnkit.AttentionLayer(dict(c, qk_norm="rms2"))
    for bad in (0, -3):
        with pytest.raises(ValueError, match=rf"config\['chunk_size'\] = {bad} must be > 0"):
            attnkit.AttentionLayer(dict(c, chunk_size=bad))
    # A q_proj without the gate rows; non-finite or mis-shaped sinks.
    sd = hf_weights(CONFIGS["qwen3_next"], 1)
    sd["q_proj.weight"] = sd["q_proj.weight"][:64]
    with pytest.raises(ValueError, match=r"q_proj.weight.*output_gate"):
        layer.load_state_dict(sd)
    g = attnkit.AttentionLayer(attnkit_config(CONFIGS["gpt_oss"], 0))
    sd = hf_weights(CONFIGS["gpt_oss"], 1)
    g.load_state_dict(sd)
    before = g.forward(np.ones((1, 3, 32), np.float32))
    for sinks, pattern in ((np.zeros(5, np.float32), r"sinks"),
                           (np.array([0, np.inf, 0, 0], np.float32), r"sinks\[1\] = inf")):
        with pytest.raises(ValueError, match=pattern):
            g.load_state_dict(dict(sd, sinks=sinks, **{"q_proj.weight": sd["q_proj.weight"] * 2}))
    np.testing.assert_array_equal(g.forward(np.ones((1, 3, 32), np.float32)), before)


@pytest.mark.parametrize("family,layer_index", LAYERS)
def test_from_config_against_torch(family, layer_index):
    cfg = CONFIGS[family]
    layer = attnkit.from_config(cfg, layer_index=layer_index)
    sd = hf_weights(cfg, 29 + layer_index)
    layer.load_state_dict(sd)
    x = randn(rng(layer_index), 2, 13, cfg["hidden_size"])
    want = port(cfg, sd, x, layer_index)
    check_close(f"from_config {family} layer {layer_index}", layer.forward(x), want,
                1e-4 * np.abs(want).max())


@pytest.mark.parametrize("outer,inner", [("gemma3", "gemma3_text"), ("llama4", "llama4_text")])
@pytest.mark.parametrize("layer_index", [0, 1])
def test_from_config_reads_the_multimodal_wrappers(outer, inner, layer_index):
    """gemma3 / llama4 configs nest the text model's fields in text_config."""
    wrapped = attnkit.from_config({"model_type": outer, "text_config": CONFIGS[inner]},
                                  layer_index=layer_index).config
    plain = attnkit.from_config(CONFIGS[inner], layer_index=layer_index).config
    wrapped.pop("model_type")
    plain.pop("model_type")
    assert wrapped == plain
