"""attnkit.MoE against Mixtral- and DeepSeek-V3-style blocks written here in
PyTorch float64: the router as in transformers (softmax top-k renormalised;
sigmoid + e_score_correction_bias, groups scored by their two best experts,
top-k within the kept groups, renormalised and scaled), then a dense loop
that runs every expert on every token and weights it by the routing (0 when
not chosen). Random weights under Hugging Face names. The tolerance is the
issue's 1e-5 relative to the largest output; the routing must match exactly,
so each test first asserts that no top-k or group decision of its random
data is a near tie (margin > 1e-5, far above fp32 rounding of the logits).
"""
import json

import numpy as np
import pytest
import torch

import attnkit

REL_TOL = 1e-5
MARGIN = 1e-5


def silu_mlp(h, wg, wu, wd):
    return torch.nn.functional.silu(h @ wg.T) * (h @ wu.T) @ wd.T


def t64(a):
    return torch.from_numpy(np.asarray(a, dtype=np.float64))


def ranked(v):
    """Indices by decreasing value, equal values in increasing index order
    (attnkit's documented tie rule; torch.topk leaves ties unspecified)."""
    return torch.sort(v, dim=-1, descending=True, stable=True).indices


def boundary_margin(v, k):
    s = torch.sort(v, dim=-1, descending=True).values
    if k >= v.shape[-1]:
        return float("inf")
    gaps = s[:, k - 1] - s[:, k]
    return float(gaps[torch.isfinite(gaps)].min()) if torch.isfinite(gaps).any() else float("inf")


def mixtral_reference(x, sd, prefix, num_experts, top_k):
    blk = prefix + "block_sparse_moe."
    hidden = x.shape[-1]
    h = t64(x).reshape(-1, hidden)
    probs = torch.softmax(h @ t64(sd[blk + "gate.weight"]).T, dim=-1)
    idx = ranked(probs)[:, :top_k]
    w = probs.gather(1, idx)
    w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(h)
    for e in range(num_experts):
        y = silu_mlp(h, *(t64(sd[f"{blk}experts.{e}.{n}.weight"]) for n in ("w1", "w3", "w2")))
        out += (w * (idx == e)).sum(-1, keepdim=True) * y
    return out.reshape(x.shape), idx, w, boundary_margin(probs, top_k)


def deepseek_v3_reference(x, sd, prefix, cfg):
    blk = prefix + "mlp."
    E, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    G, kg = cfg["n_group"], cfg["topk_group"]
    hidden = x.shape[-1]
    h = t64(x).reshape(-1, hidden)
    scores = torch.sigmoid(h @ t64(sd[blk + "gate.weight"]).T)
    choice = scores + t64(sd[blk + "gate.e_score_correction_bias"])[None, :]
    group_scores = choice.view(-1, G, E // G).topk(2, dim=-1).values.sum(-1)
    margin = boundary_margin(group_scores, kg)
    keep = torch.zeros_like(group_scores).scatter_(1, ranked(group_scores)[:, :kg], 1.0)
    keep = keep.bool().unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
    choice = choice.masked_fill(~keep, float("-inf"))
    margin = min(margin, boundary_margin(choice, k))
    idx = ranked(choice)[:, :k]
    w = scores.gather(1, idx)
    if cfg["norm_topk_prob"]:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = w * cfg["routed_scaling_factor"]
    out = torch.zeros_like(h)
    for e in range(E):
        y = silu_mlp(h, *(t64(sd[f"{blk}experts.{e}.{n}_proj.weight"]) for n in ("gate", "up", "down")))
        out += (w * (idx == e)).sum(-1, keepdim=True) * y
    out += silu_mlp(h, *(t64(sd[f"{blk}shared_experts.{n}_proj.weight"]) for n in ("gate", "up", "down")))
    return out.reshape(x.shape), idx, w, margin


def random_state_dict(rng, prefix, family, E, hidden, inter, shared_inter=0, bias_scale=0.3):
    sd = {}

    def uni(shape, fan_in):
        b = 1.0 / np.sqrt(fan_in)
        return rng.uniform(-b, b, size=shape).astype(np.float32)

    gate = (rng.standard_normal((E, hidden)) * 2.0 / np.sqrt(hidden)).astype(np.float32)
    if family == "mixtral":
        blk = prefix + "block_sparse_moe."
        sd[blk + "gate.weight"] = gate
        for e in range(E):
            sd[f"{blk}experts.{e}.w1.weight"] = uni((inter, hidden), hidden)
            sd[f"{blk}experts.{e}.w3.weight"] = uni((inter, hidden), hidden)
            sd[f"{blk}experts.{e}.w2.weight"] = uni((hidden, inter), inter)
    else:
        blk = prefix + "mlp."
        sd[blk + "gate.weight"] = gate
        sd[blk + "gate.e_score_correction_bias"] = rng.uniform(
            -bias_scale, bias_scale, size=E).astype(np.float32)
        for e in range(E):
            sd[f"{blk}experts.{e}.gate_proj.weight"] = uni((inter, hidden), hidden)
            sd[f"{blk}experts.{e}.up_proj.weight"] = uni((inter, hidden), hidden)
            sd[f"{blk}experts.{e}.down_proj.weight"] = uni((hidden, inter), inter)
        sd[blk + "shared_experts.gate_proj.weight"] = uni((shared_inter, hidden), hidden)
        sd[blk + "shared_experts.up_proj.weight"] = uni((shared_inter, hidden), hidden)
        sd[blk + "shared_experts.down_proj.weight"] = uni((hidden, shared_inter), shared_inter)
    # Weights of other modules in the same layer must be ignored.
    sd[prefix + "self_attn.o_proj.weight"] = np.zeros((hidden, hidden), np.float32)
    return sd


def assert_matches(out, routing, ref_out, ref_idx, ref_w, num_experts):
    ref_out = ref_out.numpy()
    scale = np.abs(ref_out).max()
    err = np.abs(out.astype(np.float64) - ref_out)
    worst = np.unravel_index(err.argmax(), err.shape)
    assert err.max() <= REL_TOL * scale, (
        f"out{worst}: {out[worst]} vs {ref_out[worst]}, |diff| {err.max():.3g} > "
        f"{REL_TOL} * max|ref| {scale:.3g}")
    k = ref_idx.shape[-1]
    ids = routing["expert_ids"].reshape(-1, k)
    np.testing.assert_array_equal(ids, ref_idx.numpy())
    np.testing.assert_allclose(routing["weights"].reshape(-1, k), ref_w.numpy(), rtol=1e-6, atol=0)
    np.testing.assert_array_equal(
        routing["tokens_per_expert"], np.bincount(ref_idx.numpy().ravel(), minlength=num_experts))
    return err.max() / scale


MIXTRAL_CONFIG = {
    "model_type": "mixtral", "hidden_size": 32, "intermediate_size": 24,
    "num_local_experts": 8, "num_experts_per_tok": 2, "hidden_act": "silu",
    "router_aux_loss_coef": 0.02,
}

DEEPSEEK_V3_CONFIG = {
    "model_type": "deepseek_v3", "hidden_size": 40, "moe_intermediate_size": 16,
    "n_routed_experts": 16, "n_shared_experts": 2, "num_experts_per_tok": 4,
    "n_group": 4, "topk_group": 2, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "hidden_act": "silu",
    "intermediate_size": 64, "first_k_dense_replace": 1,
}


def test_mixtral_block_matches_dense_torch_loop():
    rng = np.random.default_rng(1)
    prefix = "model.layers.3."
    sd = random_state_dict(rng, prefix, "mixtral", 8, 32, 24)
    x = rng.standard_normal((2, 11, 32)).astype(np.float32)
    moe = attnkit.moe_from_config(MIXTRAL_CONFIG)
    assert moe.config["norm_topk_prob"] and moe.config["n_routed_experts"] == 8
    moe.load_weights(sd, prefix=prefix)
    out, routing = moe.forward(x, return_routing=True)
    assert out.dtype == np.float32 and out.shape == x.shape
    assert routing["expert_ids"].shape == (2, 11, 2)
    ref_out, ref_idx, ref_w, margin = mixtral_reference(x, sd, prefix, 8, 2)
    assert margin > MARGIN
    # The reference's stable sort agrees with torch.topk on this tie-free data.
    assert torch.equal(ref_idx, torch.topk(torch.softmax(
        t64(x).reshape(-1, 32) @ t64(sd[prefix + "block_sparse_moe.gate.weight"]).T, -1), 2).indices)
    assert_matches(out, routing, ref_out, ref_idx, ref_w, 8)
    np.testing.assert_allclose(routing["weights"].sum(-1), 1.0, rtol=1e-6)
    # Without return_routing: just the output, the same values.
    np.testing.assert_array_equal(moe(x), out)


def test_deepseek_v3_block_matches_dense_torch_loop():
    cfg = DEEPSEEK_V3_CONFIG
    rng = np.random.default_rng(2)
    prefix = "model.layers.7."
    sd = random_state_dict(rng, prefix, "deepseek", 16, 40, 16, shared_inter=32)
    x = rng.standard_normal((3, 7, 40)).astype(np.float32)
    moe = attnkit.moe_from_config(cfg)
    moe.load_weights(sd, prefix=prefix)
    out, routing = moe.forward(x, return_routing=True)
    ref_out, ref_idx, ref_w, margin = deepseek_v3_reference(x, sd, prefix, cfg)
    assert margin > MARGIN
    assert_matches(out, routing, ref_out, ref_idx, ref_w, 16)
    np.testing.assert_allclose(routing["weights"].sum(-1), 2.5, rtol=1e-6)
    # The group limit and the bias both change decisions on this data.
    groups = routing["expert_ids"].reshape(-1, 4) // 4
    assert all(len(set(g)) <= 2 for g in groups.tolist())
    plain = torch.topk(torch.sigmoid(t64(x).reshape(-1, 40) @ t64(sd[prefix + "mlp.gate.weight"]).T), 4)
    assert not torch.equal(torch.sort(plain.indices).values, torch.sort(ref_idx).values)


def test_exact_ties_go_to_the_lowest_expert_id():
    rng = np.random.default_rng(3)
    sd = random_state_dict(rng, "", "mixtral", 8, 32, 24)
    v = rng.uniform(0.5, 1.0, size=32).astype(np.float32)
    gate = np.tile(0.25 * v, (8, 1))
    gate[[2, 5, 6]] = v  # three identical rows: bit-identical logits, the largest
    gate[0] = -v
    sd["block_sparse_moe.gate.weight"] = gate
    x = rng.uniform(0.1, 1.0, size=(1, 6, 32)).astype(np.float32)
    moe = attnkit.moe_from_config(MIXTRAL_CONFIG)
    moe.load_weights(sd)
    out, routing = moe.forward(x, return_routing=True)
    np.testing.assert_array_equal(routing["expert_ids"], np.tile([2, 5], (1, 6, 1)))
    np.testing.assert_array_equal(routing["weights"], np.full((1, 6, 2), 0.5, np.float32))
    ref_out, ref_idx, ref_w, _ = mixtral_reference(x, sd, "", 8, 2)
    assert_matches(out, routing, ref_out, ref_idx, ref_w, 8)


def test_token_alone_on_an_expert_and_experts_without_tokens():
    rng = np.random.default_rng(4)
    sd = random_state_dict(rng, "", "mixtral", 8, 32, 24)
    gate = np.zeros((8, 32), np.float32)
    for e in range(8):
        gate[e, e] = 4.0  # expert e reads feature e
    sd["block_sparse_moe.gate.weight"] = gate
    x = np.full((1, 9, 32), 0.05, np.float32)
    for t in range(9):
        x[0, t, 0 if t % 2 else 1] = 1.0   # every token: experts 0 and 1 ...
        x[0, t, 2] = 0.5                   # ... except token 4, which takes 7 instead of 2
    x[0, 4, 2] = 0.0
    x[0, 4, 7] = 0.9
    moe = attnkit.moe_from_config(MIXTRAL_CONFIG)
    moe.load_weights(sd)
    out, routing = moe.forward(x, return_routing=True)
    counts = routing["tokens_per_expert"]
    assert counts[7] == 1 and counts[3] == counts[4] == counts[5] == counts[6] == 0
    ref_out, ref_idx, ref_w, margin = mixtral_reference(x, sd, "", 8, 2)
    assert margin > MARGIN
    assert_matches(out, routing, ref_out, ref_idx, ref_w, 8)


def test_bad_configs_raise_value_error_naming_the_field():
    bad = [
        ({**DEEPSEEK_V3_CONFIG, "num_experts_per_tok": 17}, "num_experts_per_tok = 17"),
        ({**DEEPSEEK_V3_CONFIG, "n_group": 3}, "n_group = 3 must divide n_routed_experts = 16"),
        ({**DEEPSEEK_V3_CONFIG, "topk_group": 5}, "topk_group = 5"),
        ({**DEEPSEEK_V3_CONFIG, "scoring_func": "tanh"}, 'scoring_func = "tanh"'),
        ({**DEEPSEEK_V3_CONFIG, "topk_method": "best"}, 'topk_method = "best"'),
        ({**MIXTRAL_CONFIG, "hidden_act": "gelu"}, 'hidden_act = "gelu"'),
        ({**MIXTRAL_CONFIG, "num_experts_per_tok": None}, "num_experts_per_tok is null"),
    ]
    for cfg, needle in bad:
        with pytest.raises(ValueError) as info:
            attnkit.moe_from_config(cfg)
        assert needle in str(info.value), str(info.value)
    with pytest.raises(ValueError, match="must be a dict"):
        attnkit.moe_from_config(42)


def test_bad_weights_and_inputs_raise_and_change_nothing():
    rng = np.random.default_rng(5)
    sd = random_state_dict(rng, "", "mixtral", 8, 32, 24)
    moe = attnkit.moe_from_config(MIXTRAL_CONFIG)
    assert not moe.loaded
    x = rng.standard_normal((1, 3, 32)).astype(np.float32)
    with pytest.raises(ValueError, match="not loaded"):
        moe.forward(x)
    missing = dict(sd)
    del missing["block_sparse_moe.experts.7.w2.weight"]
    with pytest.raises(ValueError, match="block_sparse_moe.experts.7.w2.weight"):
        moe.load_weights(missing)
    assert not moe.loaded
    moe.load_weights(sd)
    before = moe.forward(x)
    wrong = dict(sd)
    wrong["block_sparse_moe.experts.1.w1.weight"] = np.zeros((25, 32), np.float32)
    with pytest.raises(ValueError, match=r"experts\.1\.w1\.weight"):
        moe.load_weights(wrong)
    extra = dict(sd)
    extra["block_sparse_moe.experts.8.w1.weight"] = np.zeros((24, 32), np.float32)
    with pytest.raises(ValueError, match="unexpected weight"):
        moe.load_weights(extra)
    np.testing.assert_array_equal(moe.forward(x), before)
    np.testing.assert_array_equal(moe.weight("block_sparse_moe.gate.weight"),
                                  sd["block_sparse_moe.gate.weight"])
    with pytest.raises(ValueError, match=r"x.shape\[2\] \(hidden_size\) = 31"):
        moe.forward(np.zeros((1, 3, 31), np.float32))
    with pytest.raises(ValueError, match="rank"):
        moe.forward(np.zeros((3, 32), np.float32))
    nan_x = x.copy()
    nan_x[0, 2, 0] = np.nan
    with pytest.raises(ValueError, match="token 2"):
        moe.forward(nan_x)


def test_config_from_a_path_and_the_parsed_fields(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(DEEPSEEK_V3_CONFIG))
    moe = attnkit.moe_from_config(str(path))
    cfg = moe.config
    assert cfg["scoring_func"] == "sigmoid" and cfg["topk_method"] == "noaux_tc"
    assert (cfg["n_group"], cfg["topk_group"], cfg["n_shared_experts"]) == (4, 2, 2)
    assert cfg["routed_scaling_factor"] == 2.5 and cfg["naming"] == "deepseek"
    names = moe.weight_names()
    assert names[:3] == ["mlp.gate.weight", "mlp.gate.e_score_correction_bias",
                         "mlp.experts.0.gate_proj.weight"]
    assert names[-1] == "mlp.shared_experts.down_proj.weight"
    assert len(names) == 2 + 3 * 16 + 3


# gpt-oss: a torch float64 port of transformers' GptOssMLP (modeling_gpt_oss.py).
GPT_OSS = {"model_type": "gpt_oss", "hidden_size": 16, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 4, "num_local_experts": 6,
           "num_experts_per_tok": 2, "intermediate_size": 12, "num_hidden_layers": 2,
           "swiglu_limit": 0.6}  # gpt-oss: 7.0; small here so the clamps engage


def gpt_oss_reference(x, sd, prefix, k, limit):
    x = t64(x).reshape(-1, x.shape[-1])
    logits = x @ t64(sd[prefix + "mlp.router.weight"]).T + t64(sd[prefix + "mlp.router.bias"])
    top, idx = torch.topk(logits, k, dim=-1)
    weights = torch.softmax(top, dim=-1)
    out = torch.zeros_like(x)
    gu_w, gu_b = t64(sd[prefix + "mlp.experts.gate_up_proj"]), t64(
        sd[prefix + "mlp.experts.gate_up_proj_bias"])
    dn_w, dn_b = t64(sd[prefix + "mlp.experts.down_proj"]), t64(
        sd[prefix + "mlp.experts.down_proj_bias"])
    for t in range(x.shape[0]):
        for j in range(k):
            e = int(idx[t, j])
            gate_up = x[t] @ gu_w[e] + gu_b[e]
            gate, up = gate_up[::2].clamp(max=limit), gate_up[1::2].clamp(-limit, limit)
            glu = gate * torch.sigmoid(gate * 1.702)
            out[t] += weights[t, j] * (((up + 1) * glu) @ dn_w[e] + dn_b[e])
    return out.numpy(), idx.numpy()


def test_gpt_oss_block_matches_the_torch_port():
    moe = attnkit.moe_from_config(GPT_OSS)
    c = moe.config
    assert c["naming"] == "gpt_oss" and c["activation"] == "gpt_oss_swiglu"
    assert c["router_bias"] and c["expert_bias"] and c["swiglu_limit"] == 0.6
    g = np.random.default_rng(3)
    E, H, I = 6, 16, 12
    prefix = "model.layers.0."
    sd = {prefix + "mlp.router.weight": g.standard_normal((E, H)),
          prefix + "mlp.router.bias": 0.5 * g.standard_normal(E),
          prefix + "mlp.experts.gate_up_proj": g.standard_normal((E, H, 2 * I)) / 2,
          prefix + "mlp.experts.gate_up_proj_bias": 0.5 * g.standard_normal((E, 2 * I)),
          prefix + "mlp.experts.down_proj": g.standard_normal((E, I, H)) / 4,
          prefix + "mlp.experts.down_proj_bias": 0.5 * g.standard_normal((E, H))}
    sd = {n: v.astype(np.float32) for n, v in sd.items()}
    assert sorted(prefix + n for n in moe.weight_names()) == sorted(sd)
    moe.load_weights(sd, prefix)
    x = g.standard_normal((2, 7, H)).astype(np.float32)
    out, routing = moe.forward(x, return_routing=True)
    want, idx = gpt_oss_reference(x, sd, prefix, 2, 0.6)
    np.testing.assert_array_equal(routing["expert_ids"].reshape(-1, 2), idx)
    assert np.abs(out.reshape(-1, H) - want).max() <= 1e-5 * np.abs(want).max()
    # nn.Linear's layout for gate_up_proj is refused by name.
    bad = dict(sd, **{prefix + "mlp.experts.gate_up_proj":
                      np.zeros((E, 2 * I, H), np.float32)})
    with pytest.raises(ValueError, match=r"mlp.experts.gate_up_proj"):
        moe.load_weights(bad, prefix)
    np.testing.assert_array_equal(moe.forward(x), out)
