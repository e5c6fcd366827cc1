"""AttentionLayer against PyTorch float64: nn.MultiheadAttention (weights
copied into an "mha" variant layer), a GQA/MQA layer written in plain torch
ops, and Llama / Mistral / Qwen2 / Qwen3 / Gemma-2 attention written from
their Hugging Face equations, built by attnkit.from_config from HF-style
config dicts and loaded with HF weight names. Then decoding with a KV cache
(f32 and bf16, with and without a sliding window) against the full causal
forward."""
import numpy as np
import pytest
import torch

import attnkit
from torch_ref import (bf16_criterion, check_close, hf_attention_ref, kv_stored,
                       layer_tolerance, randn, random_weights, rng, t64)


# --------------------------------------------------------------------------
# nn.MultiheadAttention
# --------------------------------------------------------------------------

def torch_mha(embed_dim, num_heads, seed):
    torch.manual_seed(seed)
    mha = torch.nn.MultiheadAttention(embed_dim, num_heads, bias=True, batch_first=True,
                                      dtype=torch.float64)
    with torch.no_grad():  # nn's default biases are zero; make them count
        mha.in_proj_bias.normal_(0.0, 0.5)
        mha.out_proj.bias.normal_(0.0, 0.5)
        # Round to float32 values so both sides see the same weights.
        for p in mha.parameters():
            p.copy_(p.float().double())
    return mha


def mha_state_dict(mha):
    """nn.MultiheadAttention's packed in_proj as HF-style q/k/v/o names."""
    w = mha.in_proj_weight.detach().float().numpy()
    b = mha.in_proj_bias.detach().float().numpy()
    e = mha.embed_dim
    return {"q_proj.weight": w[:e], "k_proj.weight": w[e:2 * e], "v_proj.weight": w[2 * e:],
            "q_proj.bias": b[:e], "k_proj.bias": b[e:2 * e], "v_proj.bias": b[2 * e:],
            "o_proj.weight": mha.out_proj.weight.detach().float().numpy(),
            "o_proj.bias": mha.out_proj.bias.detach().float().numpy()}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("cross", [False, True])
def test_multihead_attention_outputs_and_weights(seed, cross, backend):
    e, h = 24, 4
    mha = torch_mha(e, h, seed)
    layer = attnkit.attention_from_variant("mha", e, h, bias=True)
    layer.load_state_dict(mha_state_dict(mha))
    g = rng(seed)
    q = randn(g, 2, 5, e)
    kv = randn(g, 2, 7, e) if cross else q
    v = randn(g, 2, 7, e) if cross else q
    want, want_w = mha(t64(q), t64(kv), t64(v), need_weights=True, average_attn_weights=False)
    got, got_w = layer.forward_qkv(q, kv, v, need_weights=True, backend=backend)
    want = want.detach().numpy()
    check_close("MHA out", got, want, layer_tolerance(want), rel=1e-5)
    check_close("MHA weights", got_w, want_w.detach().numpy(), 1e-5)
    # Self-attention through forward() is the same computation.
    if not cross:
        check_close("MHA forward", layer.forward(q, backend=backend), want,
                    layer_tolerance(want))


@pytest.mark.parametrize("mask_kind", ["bool", "float", "per_head_float"])
def test_multihead_attention_masks(mask_kind, backend):
    """key_padding_mask and attn_mask, translated to attnkit's convention
    (True = attend) and compared with torch's (True = masked)."""
    e, h, b, sq, sk = 16, 2, 3, 4, 6
    mha = torch_mha(e, h, 7)
    layer = attnkit.attention_from_variant("mha", e, h)
    layer.load_state_dict(mha_state_dict(mha))
    g = rng(8)
    q, k, v = randn(g, b, sq, e), randn(g, b, sk, e), randn(g, b, sk, e)
    real = np.ones((b, sk), dtype=bool)
    real[0, 4:] = False
    real[2, [1, 3]] = False
    if mask_kind == "bool":
        keep = g.random((sq, sk)) < 0.7
        keep[:, 0] = True  # every row keeps a real key (torch gives NaN otherwise)
        torch_mask, our_mask = torch.from_numpy(~keep), keep
    elif mask_kind == "float":
        our_mask = randn(g, sq, sk)
        torch_mask = t64(our_mask)
    else:
        our_mask = randn(g, b, h, sq, sk)
        torch_mask = t64(our_mask).reshape(b * h, sq, sk)
    want, want_w = mha(t64(q), t64(k), t64(v), key_padding_mask=torch.from_numpy(~real),
                       attn_mask=torch_mask, need_weights=True, average_attn_weights=False)
    got, got_w = layer.forward_qkv(q, k, v, mask=our_mask, key_padding_mask=real,
                                   need_weights=True, backend=backend)
    want = want.detach().numpy()
    check_close(f"MHA {mask_kind} mask out", got, want, layer_tolerance(want), rel=1e-5)
    check_close(f"MHA {mask_kind} mask weights", got_w, want_w.detach().numpy(), 1e-5)
    assert np.all(got_w[0, :, :, 4:] == 0) and np.all(got_w[2, :, :, [1, 3]] == 0)
    # key_padding_mask alone (viewed in place, no combination).
    want = mha(t64(q), t64(k), t64(v), key_padding_mask=torch.from_numpy(~real),
               need_weights=False)[0].detach().numpy()
    check_close("MHA padding only", layer.forward_qkv(q, k, v, key_padding_mask=real), want,
                layer_tolerance(want))


def test_multihead_attention_causal():
    """forward_qkv(causal=True) equals torch's upper-triangular attn_mask."""
    e, h, s = 16, 4, 6
    mha = torch_mha(e, h, 3)
    layer = attnkit.attention_from_variant("mha", e, h)
    layer.load_state_dict(mha_state_dict(mha))
    x = randn(rng(3), 2, s, e)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
    want = mha(t64(x), t64(x), t64(x), attn_mask=causal, need_weights=False)[0].detach().numpy()
    check_close("MHA causal", layer.forward_qkv(x, x, x, causal=True), want,
                layer_tolerance(want))


# --------------------------------------------------------------------------
# GQA / MQA in plain torch ops
# --------------------------------------------------------------------------

def torch_gqa(sd, query, key, value, num_heads, num_kv_heads, mask=None):
    """The seeds' grouped-query attention: project, repeat_interleave K/V,
    softmax(q k^T / sqrt(d)) v, o_proj. mask: bool [b, h, sq, sk] True = keep."""
    lin = lambda n, x: x @ t64(sd[n + ".weight"]).T + t64(sd[n + ".bias"])  # noqa: E731
    b, sq, e = query.shape
    sk, d = key.shape[1], e // num_heads
    q = lin("q_proj", t64(query)).view(b, sq, num_heads, d).transpose(1, 2)
    k = lin("k_proj", t64(key)).view(b, sk, num_kv_heads, d).transpose(1, 2)
    v = lin("v_proj", t64(value)).view(b, sk, num_kv_heads, d).transpose(1, 2)
    k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
    v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = q @ k.transpose(-1, -2) / d ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~torch.from_numpy(mask), -float("inf"))
    o = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, sq, e)
    return lin("o_proj", o).numpy()


@pytest.mark.parametrize("variant,num_heads,num_kv_heads",
                         [("gqa-2", 8, 2), ("mqa", 4, 1), ("gqa-4", 4, 4), ("mha", 6, 6)])
def test_gqa_mqa_against_torch(variant, num_heads, num_kv_heads, backend):
    e = 32 if num_heads != 6 else 24
    layer = attnkit.attention_from_variant(variant, e, num_heads)
    cfg = layer.config
    assert cfg["num_kv_heads"] == num_kv_heads and cfg["head_dim"] == e // num_heads
    assert not cfg["causal"] and not cfg["use_rope"]
    g = rng(num_heads * 10 + num_kv_heads)
    kv_out = num_kv_heads * (e // num_heads)
    sd = random_weights(g, {"q_proj.weight": (e, e), "q_proj.bias": (e,),
                            "k_proj.weight": (kv_out, e), "k_proj.bias": (kv_out,),
                            "v_proj.weight": (kv_out, e), "v_proj.bias": (kv_out,),
                            "o_proj.weight": (e, e), "o_proj.bias": (e,)})
    layer.load_state_dict(sd)
    x = randn(g, 2, 6, e)
    want = torch_gqa(sd, x, x, x, num_heads, num_kv_heads)
    check_close(f"{variant} forward", layer.forward(x, backend=backend), want,
                layer_tolerance(want), rel=1e-5)
    k, v = randn(g, 2, 9, e), randn(g, 2, 9, e)
    keep = g.random((2, num_heads, 6, 9)) < 0.6
    keep[..., 0] = True
    want = torch_gqa(sd, x, k, v, num_heads, num_kv_heads, mask=keep)
    check_close(f"{variant} cross + mask", layer.forward_qkv(x, k, v, mask=keep, backend=backend),
                want, layer_tolerance(want), rel=1e-5)


# --------------------------------------------------------------------------
# Hugging Face families from config dicts
# --------------------------------------------------------------------------

BASE = {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 2,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "num_hidden_layers": 4,
        "rope_theta": 10000.0}

FAMILIES = {
    "llama": dict(BASE, model_type="llama", rope_theta=500000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 64}),
    "mistral": dict(BASE, model_type="mistral", sliding_window=4),
    "qwen2": dict(BASE, model_type="qwen2", num_key_value_heads=3),
    "qwen3": dict(BASE, model_type="qwen3", head_dim=16, rope_theta=1000000.0),
    "gemma2": dict(BASE, model_type="gemma2", head_dim=12, query_pre_attn_scalar=16,
                   attn_logit_softcapping=5.0, sliding_window=3),
    "partial_rotary": dict(BASE, model_type="llama", partial_rotary_factor=0.5,
                           rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                         "original_max_position_embeddings": 128}),
}

PREFIX = "model.layers.1.self_attn."


def hf_weights(cfg, seed):
    """Random HF-named weights for one layer, unprefixed."""
    g = rng(seed)
    e, h = cfg["hidden_size"], cfg["num_attention_heads"]
    hk = cfg.get("num_key_value_heads", h)
    d = cfg.get("head_dim") or e // h
    shapes = {"q_proj.weight": (h * d, e), "k_proj.weight": (hk * d, e),
              "v_proj.weight": (hk * d, e), "o_proj.weight": (e, h * d)}
    if cfg["model_type"] == "qwen2" or cfg.get("attention_bias"):
        shapes.update({"q_proj.bias": (h * d,), "k_proj.bias": (hk * d,), "v_proj.bias": (hk * d,)})
    if cfg.get("attention_bias"):
        shapes["o_proj.bias"] = (e,)
    if cfg["model_type"] == "qwen3":
        shapes.update({"q_norm.weight": (d,), "k_norm.weight": (d,)})
    return random_weights(g, shapes)


def full_state_dict(sd):
    """As a whole-model checkpoint would have it: prefixed, with other
    modules' tensors (some not even float) around the layer's."""
    out = {PREFIX + k: v for k, v in sd.items()}
    out["model.layers.1.mlp.gate_proj.weight"] = np.zeros((3, 3), np.float32)
    out["model.embed_tokens.weight"] = np.zeros((5, 2), np.float16)
    out["model.layers.1.self_attn_extra.step"] = np.array(1)  # shares the prefix text only
    out["model.layers.10.self_attn.q_proj.weight"] = np.array(["not a weight"])
    out["model.step"] = np.array(3, dtype=np.int64)
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("layer_index", [0, 1])
def test_hf_families_against_torch(family, layer_index, backend):
    cfg = FAMILIES[family]
    layer = attnkit.from_config(cfg, layer_index=layer_index)
    sd = hf_weights(cfg, hash(family) % 2**32)
    assert sorted(layer.weight_names()) == sorted(sd)
    # The prefix is joined with '.', as in the C++ loader: with or without it.
    layer.load_state_dict(full_state_dict(sd), prefix=PREFIX if layer_index else PREFIX[:-1])
    g = rng(layer_index)
    x = randn(g, 2, 9, cfg["hidden_size"])
    want, _ = hf_attention_ref(cfg, sd, x, layer_index=layer_index)
    got = layer.forward(x, backend=backend)
    check_close(f"{family} layer {layer_index}", got, want, layer_tolerance(want), rel=1e-5)
    # Explicit per-batch positions (e.g. left-padded batches).
    pos = np.stack([np.arange(9) + 3, np.arange(9) + 100])
    for b in range(2):
        want_b, _ = hf_attention_ref(cfg, sd, x[b:b + 1], positions=pos[b], layer_index=layer_index)
        got_b = layer.forward(x, positions=pos, backend=backend)[b:b + 1]
        check_close(f"{family} positions", got_b, want_b, layer_tolerance(want_b), rel=1e-5)


def test_family_settings_reach_the_config():
    assert attnkit.from_config(FAMILIES["mistral"]).config["sliding_window"] == 4
    assert attnkit.from_config(FAMILIES["gemma2"], layer_index=0).config["sliding_window"] == 3
    assert attnkit.from_config(FAMILIES["gemma2"], layer_index=1).config["sliding_window"] == 0
    q3 = attnkit.from_config(FAMILIES["qwen3"]).config
    assert q3["qk_norm"] and q3["head_dim"] == 16 and not q3["qkv_bias"]
    q2 = attnkit.from_config(FAMILIES["qwen2"]).config
    assert q2["qkv_bias"] and not q2["o_bias"] and q2["num_kv_heads"] == 3
    llama = attnkit.from_config(FAMILIES["llama"]).config
    assert llama["rope"]["scaling"]["rope_type"] == "llama3" and llama["causal"]
    assert attnkit.from_config(FAMILIES["partial_rotary"]).config["rope"]["rotary_dim"] == 4


def test_config_dict_round_trip_and_path(tmp_path):
    """AttentionLayer(layer.config) rebuilds the same layer; from_config also
    takes the path of a config.json."""
    import json
    cfg = FAMILIES["gemma2"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    layer = attnkit.from_config(str(path))
    sd = hf_weights(cfg, 4)
    layer.load_state_dict(sd)
    twin = attnkit.AttentionLayer(layer.config)
    assert twin.config == layer.config
    twin.load_state_dict(layer.state_dict())
    x = randn(rng(4), 1, 5, cfg["hidden_size"])
    np.testing.assert_array_equal(twin.forward(x), layer.forward(x))
    # A changed field changes the layer (softcap 5 -> off).
    changed = attnkit.AttentionLayer(dict(layer.config, softcap=0.0))
    with pytest.raises(ValueError, match="no weights loaded"):
        changed.forward(x)
    changed.load_state_dict(sd)
    assert np.abs(changed.forward(x) - layer.forward(x)).max() > 1e-3


def test_weights_from_torch_float64_float16_and_safetensors(tmp_path):
    """load_state_dict takes torch tensors and float16/float64 arrays, and a
    safetensors round trip of the weights gives the same layer."""
    cfg = FAMILIES["qwen2"]
    sd = hf_weights(cfg, 5)
    x = randn(rng(5), 1, 6, cfg["hidden_size"])
    ref = attnkit.from_config(cfg)
    ref.load_state_dict(sd)
    want = ref.forward(x)
    for conv in (torch.from_numpy, lambda a: a.astype(np.float64)):
        layer = attnkit.from_config(cfg)
        layer.load_state_dict({k: conv(v) for k, v in sd.items()})
        np.testing.assert_array_equal(layer.forward(x), want)
    half = {k: v.astype(np.float16) for k, v in sd.items()}
    layer = attnkit.from_config(cfg)
    layer.load_state_dict(half)
    for name, w in layer.state_dict().items():
        np.testing.assert_array_equal(w, half[name].astype(np.float32))
    attnkit.save_safetensors(tmp_path / "w.safetensors", {PREFIX + k: v for k, v in sd.items()})
    layer = attnkit.from_config(cfg)
    layer.load_state_dict(attnkit.load_safetensors(tmp_path / "w.safetensors"), prefix=PREFIX)
    np.testing.assert_array_equal(layer.forward(x), want)


def test_non_contiguous_and_float64_inputs_match():
    cfg = FAMILIES["llama"]
    layer = attnkit.from_config(cfg)
    layer.load_state_dict(hf_weights(cfg, 6))
    x = randn(rng(6), 2, 5, cfg["hidden_size"])
    want = layer.forward(x, backend="reference")
    wide = np.zeros((2, 5, 2 * cfg["hidden_size"]), np.float32)
    wide[..., ::2] = x
    seq_major = x.transpose(1, 0, 2).copy().transpose(1, 0, 2)
    for variant in (x.astype(np.float64), wide[..., ::2], seq_major):
        np.testing.assert_array_equal(layer.forward(variant, backend="reference"), want)


# --------------------------------------------------------------------------
# Decoding with a KV cache
# --------------------------------------------------------------------------

def decode_all(layer, cache, x, chunks, backend="auto"):
    outs, t = [], 0
    for n in chunks:
        outs.append(layer.forward(x[:, t:t + n], cache=cache, backend=backend))
        t += n
    assert cache.length == t == x.shape[1]
    return np.concatenate(outs, axis=1)


@pytest.mark.parametrize("family,kv_heads", [("llama", 2), ("llama", 6), ("llama", 1),
                                             ("mistral", 2), ("qwen3", 2)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_equals_full_causal(family, kv_heads, dtype, backend):
    cfg = dict(FAMILIES[family], num_key_value_heads=kv_heads)
    layer = attnkit.from_config(cfg)
    sd = hf_weights(cfg, kv_heads)
    layer.load_state_dict(sd)
    g = rng(kv_heads + 17)
    x = randn(g, 2, 13, cfg["hidden_size"])
    full = layer.forward(x, backend=backend)
    cache = layer.new_cache(2, 16, dtype=dtype)
    assert cache.dtype == dtype and cache.sliding_window == (cfg.get("sliding_window") or 0)
    got = decode_all(layer, cache, x, [5, 2] + [1] * 6, backend)
    want, _ = hf_attention_ref(cfg, sd, x)
    tol = layer_tolerance(want)
    check_close(f"{family}/{kv_heads} full", full, want, tol, rel=1e-5)
    if dtype == "float32":
        check_close(f"{family}/{kv_heads} decode f32", got, want, tol, rel=1e-5)
    else:
        # K/V stored in bf16 (and, on fast kernels, q and the softmax
        # weights rounded too): FlashAttention's 2x-naive-twin rule.
        naive, _ = hf_attention_ref(cfg, sd, x, bf16_naive=True)
        bf16_criterion(f"{family}/{kv_heads} decode bf16", got, want, naive, tol)
        assert np.abs(got - full).max() > 1e-5 * np.abs(want).max()  # really bf16


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3"])
def test_eight_bit_cache_holds_the_quantized_keys(dtype, backend):
    """An 8-bit cache holds exactly the f32 cache's K/V quantized per token
    row of each kv head, and decodes within the quantization's reach of the
    f32 cache (bench/kv_quant_accuracy measures that reach; docs/QUANTIZATION.md)."""
    cfg = dict(FAMILIES["llama"], num_key_value_heads=2)
    layer = attnkit.from_config(cfg)
    layer.load_state_dict(hf_weights(cfg, 2))
    x = randn(rng(23), 2, 13, cfg["hidden_size"])
    c32, c8 = layer.new_cache(2, 16), layer.new_cache(2, 16, dtype=dtype)
    want = decode_all(layer, c32, x, [5, 2] + [1] * 6, backend)
    got = decode_all(layer, c8, x, [5, 2] + [1] * 6, backend)
    np.testing.assert_array_equal(c8.keys(), kv_stored(c32.keys(), dtype).astype(np.float32))
    np.testing.assert_array_equal(c8.values(), kv_stored(c32.values(), dtype).astype(np.float32))
    assert c8.nbytes == c32.nbytes // 4 + 2 * 2 * 16 * 2 * 4  # plus a scale per head row
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert 1e-4 < err < (0.03 if dtype == "int8" else 0.15), err


def test_sliding_window_cache_is_a_ring():
    """Mistral with window 4 keeps 3 tokens; prefill chunks longer than the
    ring, then token by token, still match the full sequence."""
    cfg = FAMILIES["mistral"]
    layer = attnkit.from_config(cfg)
    sd = hf_weights(cfg, 9)
    layer.load_state_dict(sd)
    cache = layer.new_cache(1, 64)
    assert cache.slots == 3
    x = randn(rng(9), 1, 20, cfg["hidden_size"])
    got = decode_all(layer, cache, x, [7, 5] + [1] * 8)
    want, (_, k, _) = hf_attention_ref(cfg, sd, x)
    check_close("mistral ring", got, want, layer_tolerance(want), rel=1e-5)
    check_close("ring keys", cache.keys(), k[:, -3:], 1e-5 * np.abs(k).max())
    assert cache.nbytes == 1 * 3 * 2 * (8 + 8) * 4


def test_cache_positions_continue_and_reset():
    cfg = FAMILIES["llama"]
    layer = attnkit.from_config(cfg)
    layer.load_state_dict(hf_weights(cfg, 10))
    x = randn(rng(10), 1, 6, cfg["hidden_size"])
    cache = layer.new_cache(1, 6)
    first = decode_all(layer, cache, x, [3, 3])
    cache.reset()
    np.testing.assert_array_equal(decode_all(layer, cache, x, [3, 3]), first)
    # Explicit positions equal to the implicit ones give the same result.
    cache.reset()
    a = layer.forward(x[:, :3], positions=np.arange(3), cache=cache)
    b = layer.forward(x[:, 3:], positions=np.arange(3, 6), cache=cache)
    np.testing.assert_array_equal(np.concatenate([a, b], 1), first)


# --------------------------------------------------------------------------
# from_config dispatch and package surface
# --------------------------------------------------------------------------

DEEPSEEK = {"model_type": "deepseek_v3", "hidden_size": 44, "num_attention_heads": 3,
            "q_lora_rank": 20, "kv_lora_rank": 24, "qk_nope_head_dim": 10,
            "qk_rope_head_dim": 6, "v_head_dim": 14, "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 1024, "attention_bias": False}


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3", "kimi_k2"])
def test_from_config_dispatches_mla(model_type):
    layer = attnkit.from_config(dict(DEEPSEEK, model_type=model_type))
    assert type(layer).__name__ == "LatentAttention"
    assert not isinstance(layer, attnkit.AttentionLayer)
    assert type(attnkit.from_config(FAMILIES["llama"])) is attnkit.AttentionLayer


@pytest.mark.parametrize("model_type", ["gpt2", "bert", "falcon", "gemma"])
def test_from_config_rejects_families_it_does_not_implement(model_type):
    with pytest.raises(ValueError, match=rf'model_type = "{model_type}" is not supported; '
                                         r'accepted: "llama", "mistral"'):
        attnkit.from_config(dict(FAMILIES["llama"], model_type=model_type))
    # A multimodal wrapper is read through its text_config, which must be there.
    with pytest.raises(ValueError, match="text_config is missing"):
        attnkit.from_config(dict(FAMILIES["llama"], model_type="gemma3"))


def test_dir_lists_the_api_only():
    # The modules the package uses are imported under private names.
    public = {n for n in dir(attnkit) if not n.startswith("_")}
    assert not public & {"json", "os", "sys"}
    assert public - set(attnkit.__all__) <= {"model_spec", "moe", "plot"}  # its own submodules


def test_cache_reprs_show_their_length():
    layer = attnkit.from_config(FAMILIES["llama"])
    cache = layer.new_cache(batch_size=1, max_seq_len=8)
    assert repr(cache).startswith("KVCache(length=0, batch_size=1, max_seq_len=8,")
    cache.attend(*(np.zeros((1, 3, h, 8), np.float32) for h in (6, 2, 2)))
    assert repr(cache).startswith("KVCache(length=3,")
    mla = attnkit.from_config(DEEPSEEK)
    latent = mla.new_cache(1, 8)
    assert repr(latent).startswith("LatentCache(length=0, batch_size=1, max_seq_len=8,")


def test_package_surface():
    import os
    import re
    cmake = open(os.path.join(os.path.dirname(__file__), "..", "..", "CMakeLists.txt")).read()
    assert attnkit.__version__ == re.search(r"project\(attnkit VERSION (\S+)", cmake).group(1)
    for name in attnkit.__all__:
        assert getattr(attnkit, name) is not None, name
        if callable(getattr(attnkit, name)):
            assert getattr(attnkit, name).__doc__, f"{name} has no docstring"
    for name in ("sdpa", "apply_rope", "from_config", "attention_from_variant",
                 "load_safetensors", "save_safetensors", "merge_attention_states"):
        assert name in attnkit.__all__
    for cls, methods in ((attnkit.AttentionLayer, ("forward", "forward_qkv", "load_state_dict",
                                                   "new_cache", "state_dict")),
                         (attnkit.KVCache, ("attend", "keys", "values", "reset")),
                         (attnkit.Rope, ("apply",))):
        for m in methods:
            assert getattr(cls, m).__doc__, f"{cls.__name__}.{m} has no docstring"
