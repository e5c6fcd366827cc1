"""attnkit.GatedDeltaNet against PyTorch in float64: Qwen3-Next's Gated
DeltaNet written here with torch ops (F.conv1d for the causal conv, the
recurrent form of the gated delta rule), on seeded random weights: a
prefill longer than a chunk, prefill then decode, batch > 1, and errors."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import attnkit

CFG = dict(hidden_size=40, num_k_heads=2, num_v_heads=4, key_head_dim=16, value_head_dim=24,
           conv_kernel=4, rms_norm_eps=1e-6)


def make_weights(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    H, hk, hv = cfg["hidden_size"], cfg["num_k_heads"], cfg["num_v_heads"]
    dk, dv, K = cfg["key_head_dim"], cfg["value_head_dim"], cfg["conv_kernel"]
    kd, vd = hk * dk, hv * dv

    def u(*shape, lo=-1.0, hi=1.0):
        return (torch.rand(*shape, generator=g, dtype=torch.float64) * (hi - lo) + lo).float()

    s = 2 / H ** 0.5
    return {
        "in_proj_qkvz.weight": u(2 * kd + 2 * vd, H, lo=-s, hi=s),
        "in_proj_ba.weight": u(2 * hv, H, lo=-s, hi=s),
        "conv1d.weight": u(2 * kd + vd, 1, K, lo=-0.7, hi=0.7),
        "A_log": u(hv, lo=-1.2, hi=2.5),
        "dt_bias": u(hv, lo=-4.0, hi=1.0),
        "norm.weight": u(dv, lo=0.5, hi=1.5),
        "out_proj.weight": u(H, vd, lo=-vd ** -0.5, hi=vd ** -0.5),
    }


class TorchGatedDeltaNet:
    """The layer in float64, continuing sequences across calls."""

    def __init__(self, cfg, w, batch):
        self.c = cfg
        self.w = {k: v.double() for k, v in w.items()}
        hk, hv = cfg["num_k_heads"], cfg["num_v_heads"]
        dk, dv, K = cfg["key_head_dim"], cfg["value_head_dim"], cfg["conv_kernel"]
        self.conv = torch.zeros(batch, 2 * hk * dk + hv * dv, K - 1, dtype=torch.float64)
        self.S = torch.zeros(batch, hv, dk, dv, dtype=torch.float64)

    def __call__(self, x):
        c, w = self.c, self.w
        hk, hv = c["num_k_heads"], c["num_v_heads"]
        dk, dv, K = c["key_head_dim"], c["value_head_dim"], c["conv_kernel"]
        r = hv // hk
        B, T, _ = x.shape
        x = torch.as_tensor(x).double()
        qkvz = (x @ w["in_proj_qkvz.weight"].T).view(B, T, hk, 2 * dk + 2 * r * dv)
        ba = (x @ w["in_proj_ba.weight"].T).view(B, T, hk, 2 * r)
        q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=-1)
        b, a = torch.split(ba, [r, r], dim=-1)
        v = v.reshape(B, T, hv * dv)
        z = z.reshape(B, T, hv, dv)
        b, a = b.reshape(B, T, hv), a.reshape(B, T, hv)
        mixed = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v], dim=-1).transpose(1, 2)
        full = torch.cat([self.conv, mixed], dim=-1)
        self.conv = full[:, :, -(K - 1):].clone()
        mixed = F.silu(F.conv1d(full, w["conv1d.weight"], groups=full.shape[1]))
        mixed = mixed.transpose(1, 2)
        q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], dim=-1)
        q = q.reshape(B, T, hk, dk)
        k = k.reshape(B, T, hk, dk)
        v = v.reshape(B, T, hv, dv)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk ** -0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        g = -w["A_log"].exp() * F.softplus(a + w["dt_bias"])
        beta = b.sigmoid()
        o = torch.zeros(B, T, hv, dv, dtype=torch.float64)
        for t in range(T):
            for h in range(hv):
                kh = h // r
                S = self.S[:, h] * g[:, t, h].exp()[:, None, None]
                kv = torch.einsum("bij,bi->bj", S, k[:, t, kh])
                delta = (v[:, t, h] - kv) * beta[:, t, h, None]
                S = S + k[:, t, kh, :, None] * delta[:, None, :]
                self.S[:, h] = S
                o[:, t, h] = torch.einsum("bij,bi->bj", S, q[:, t, kh])
        o = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + c["rms_norm_eps"])
        o = o * w["norm.weight"] * F.silu(z)
        return (o.reshape(B, T, hv * dv) @ w["out_proj.weight"].T).numpy()


def assert_close(got, want, what):
    bound = 1e-4 * np.abs(want).max()
    err = np.abs(got - want)
    i = np.unravel_index(err.argmax(), err.shape)
    assert err.max() <= bound, f"{what}: worst {i} got {got[i]} want {want[i]} bound {bound}"


def make_layer(seed=1):
    w = make_weights(CFG, seed)
    layer = attnkit.GatedDeltaNet(CFG)
    prefix = "model.layers.0.linear_attn."
    layer.load_state_dict({prefix + k: v.numpy() for k, v in w.items()}, prefix)
    return layer, w


def test_prefill_longer_than_a_chunk(backend):
    layer, w = make_layer()
    x = np.random.default_rng(0).uniform(-1, 1, (2, 150, 40)).astype(np.float32)
    assert_close(layer.forward(x, backend=backend), TorchGatedDeltaNet(CFG, w, 2)(x), "prefill")


def test_prefill_then_decode(backend):
    layer, w = make_layer(2)
    ref = TorchGatedDeltaNet(CFG, w, 3)
    state = layer.new_state(3)
    rng = np.random.default_rng(1)
    for seq in (70, 1, 1, 5, 1):
        x = rng.uniform(-1, 1, (3, seq, 40)).astype(np.float32)
        assert_close(layer.forward(x, state, backend=backend), ref(x), f"call of {seq}")
    assert_close(state.recurrent_state, ref.S.numpy(), "recurrent state")
    assert_close(state.conv_state, ref.conv.transpose(1, 2).numpy(), "conv state")


def test_hf_config_names_and_errors():
    hf = dict(hidden_size=40, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=24, linear_conv_kernel_dim=4)
    layer = attnkit.GatedDeltaNet(hf)
    assert layer.config["num_v_heads"] == 4 and not layer.loaded
    with pytest.raises(ValueError, match="num_v_heads = 3"):
        attnkit.GatedDeltaNet(dict(CFG, num_v_heads=3))
    with pytest.raises(ValueError, match="unknown key 'vocab_size'"):
        attnkit.GatedDeltaNet(dict(CFG, vocab_size=10))
    w = {k: v.numpy() for k, v in make_weights(CFG, 3).items()}
    w["A_log"][1] = np.nan
    with pytest.raises(ValueError, match=r"A_log\[1\]"):
        layer.load_state_dict(w)
    layer, _ = make_layer()
    state = layer.new_state(2)
    x = np.zeros((1, 3, 40), np.float32)
    with pytest.raises(ValueError, match="state holds 2 sequences"):
        layer.forward(x, state)
    assert not state.recurrent_state.any()
