"""attnkit.Model against a float64 decoder written here from Hugging Face's
modeling files (LlamaModel, MistralModel, Qwen2/Qwen3Model, MixtralModel,
Qwen2MoeModel, Qwen3MoeModel, Qwen3NextModel, Gemma2Model, Gemma3TextModel,
DeepseekV2/V3Model, GptOssModel, Llama4TextModel; DeepSeek-V3.2 from
DeepSeek's inference/model.py, its lightning indexer scored by
test_sparse_attention.py's float64 reference), on tiny random checkpoints
written by a safetensors writer of this file: config.json + model.safetensors
or a sharded model.safetensors.index.json. Nothing here calls attnkit except
to load and run the model under test. Bad checkpoints and bad token ids raise
ValueError naming what is wrong."""
import json
import math
import os
import struct

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import attnkit
from test_sparse_attention import _indexer_reference, _nearest_e4m3
from torch_ref import check_close, inv_freq_ref, rotate_half

VOCAB = 97
HIDDEN = 64


# --------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------

def write_safetensors(path, tensors):
    """{name: float32 numpy array or torch bf16 tensor} -> a .safetensors file."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor):  # bf16: its 16-bit patterns
            data = t.contiguous().view(torch.int16).numpy().tobytes()
            dtype, shape = "BF16", list(t.shape)
        else:
            data = np.ascontiguousarray(t, dtype=np.float32).tobytes()
            dtype, shape = "F32", list(t.shape)
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def write_checkpoint(path, config, weights, shards=1, bf16=False):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    stored = {n: torch.from_numpy(w).to(torch.bfloat16) if bf16 else w
              for n, w in weights.items()}
    if shards == 1:
        write_safetensors(os.path.join(path, "model.safetensors"), stored)
        return
    names = sorted(stored)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: stored[n] for n in names[s::shards]}
        write_safetensors(os.path.join(path, file), part)
        weight_map.update({n: file for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def base_config(model_type, **extra):
    c = {"model_type": model_type, "vocab_size": VOCAB, "hidden_size": HIDDEN,
         "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
         "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "max_position_embeddings": 256, "tie_word_embeddings": False}
    c.update(extra)
    return c


def head_dim(c):
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def is_gemma(c):
    return c["model_type"] in ("gemma2", "gemma3_text")


def zero_centred(c):
    """Norms stored as w and applied as 1 + w (Gemma's, Qwen3NextRMSNorm)."""
    return is_gemma(c) or c["model_type"] == "qwen3_next"


def is_linear(c, i):
    """Qwen3-Next's Gated DeltaNet layers."""
    return c.get("layer_types", [""] * (i + 1))[i] == "linear_attention"


def moe_layer(c, i):
    t = c["model_type"]
    if t == "mixtral":
        return True
    if t in ("qwen2_moe", "qwen3_moe", "qwen3_next"):
        return i not in c.get("mlp_only_layers", []) and (i + 1) % c.get(
            "decoder_sparse_step", 1) == 0
    return False


def is_deepseek(c):
    return c["model_type"] in ("deepseek_v2", "deepseek_v3", "deepseek_v32")


def is_llama4(c):
    return c["model_type"] == "llama4_text"


def llama4_moe_layer(c, i):
    """Llama4TextConfig: every interleave_moe_layer_step-th layer from step - 1."""
    step = c.get("interleave_moe_layer_step", 1)
    return i % step == step - 1


def llama4_rope_layer(c, i):
    """Llama4TextConfig's no_rope_layers default: NoPE on every 4th layer."""
    return (i + 1) % c.get("no_rope_layer_interval", 4) != 0


def llama4_ffn_shapes(c, f, i):
    H = c["hidden_size"]
    if not llama4_moe_layer(c, i):
        I = c["intermediate_size_mlp"]
        return {f + "gate_proj.weight": (I, H), f + "up_proj.weight": (I, H),
                f + "down_proj.weight": (H, I)}
    E, I = c["num_local_experts"], c["intermediate_size"]
    return {f + "router.weight": (E, H), f + "experts.gate_up_proj": (E, H, 2 * I),
            f + "experts.down_proj": (E, I, H), f + "shared_expert.gate_proj.weight": (I, H),
            f + "shared_expert.up_proj.weight": (I, H),
            f + "shared_expert.down_proj.weight": (H, I)}


def mla_shapes(c, a):
    H, nh = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    r, qr = c["kv_lora_rank"], c["q_lora_rank"]
    q = ({a + "q_a_proj.weight": (qr, H), a + "q_a_layernorm.weight": (qr,),
          a + "q_b_proj.weight": (nh * qk, qr)} if qr else {a + "q_proj.weight": (nh * qk, H)})
    if c.get("index_n_heads"):  # DeepSeek-V3.2's lightning indexer
        hi, di = c["index_n_heads"], c["index_head_dim"]
        q.update({a + "indexer.wq_b.weight": (hi * di, qr), a + "indexer.wk.weight": (di, H),
                  a + "indexer.k_norm.weight": (di,), a + "indexer.k_norm.bias": (di,),
                  a + "indexer.weights_proj.weight": (hi, H)})
    return {**q, a + "kv_a_proj_with_mqa.weight": (r + c["qk_rope_head_dim"], H),
            a + "kv_a_layernorm.weight": (r,),
            a + "kv_b_proj.weight": (nh * (c["qk_nope_head_dim"] + c["v_head_dim"]), r),
            a + "o_proj.weight": (H, nh * c["v_head_dim"])}


def deepseek_ffn_shapes(c, p, i):
    H, m = c["hidden_size"], p + "mlp."
    if i < c["first_k_dense_replace"]:
        I = c["intermediate_size"]
        return {m + "gate_proj.weight": (I, H), m + "up_proj.weight": (I, H),
                m + "down_proj.weight": (H, I)}
    E, Im, S = c["n_routed_experts"], c["moe_intermediate_size"], c["n_shared_experts"]
    out = {m + "gate.weight": (E, H)}
    if c.get("topk_method") == "noaux_tc":
        out[m + "gate.e_score_correction_bias"] = (E,)
    for e in range(E):
        out.update({f"{m}experts.{e}.gate_proj.weight": (Im, H),
                    f"{m}experts.{e}.up_proj.weight": (Im, H),
                    f"{m}experts.{e}.down_proj.weight": (H, Im)})
    out.update({m + "shared_experts.gate_proj.weight": (Im * S, H),
                m + "shared_experts.up_proj.weight": (Im * S, H),
                m + "shared_experts.down_proj.weight": (H, Im * S)})
    return out


def linear_attn_shapes(c, la):
    """Qwen3NextGatedDeltaNet's parameters under la = '...linear_attn.'."""
    H, hk, hv = c["hidden_size"], c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv, K = c["linear_key_head_dim"], c["linear_value_head_dim"], c["linear_conv_kernel_dim"]
    return {la + "in_proj_qkvz.weight": (2 * hk * dk + 2 * hv * dv, H),
            la + "in_proj_ba.weight": (2 * hv, H),
            la + "conv1d.weight": (2 * hk * dk + hv * dv, 1, K),
            la + "A_log": (hv,), la + "dt_bias": (hv,), la + "norm.weight": (dv,),
            la + "out_proj.weight": (H, hv * dv)}


def random_weights(c, seed):
    """HF names -> float32 arrays: matrices ~ N(0, 1/in), norm gains 1 +
    N(0, 0.3) (zero-centred norms' stored w ~ N(0, 0.3)), biases and the
    Gated DeltaNet's A_log, dt_bias N(0, 0.5), its conv N(0, 1/kernel)."""
    g = np.random.default_rng(seed)
    H, V, I = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
    nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], head_dim(c)
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, H)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        norms = ["input_layernorm", "post_attention_layernorm"]
        if is_gemma(c):
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        for n in norms:
            shapes[p + n + ".weight"] = (H,)
        a = p + "self_attn."
        if is_linear(c, i):
            shapes.update(linear_attn_shapes(c, p + "linear_attn."))
        elif is_deepseek(c):
            shapes.update(mla_shapes(c, a))
            shapes.update(deepseek_ffn_shapes(c, p, i))
            continue
        qrows = nh * hd * (2 if c["model_type"] == "qwen3_next" else 1)  # [query | gate]
        if not is_linear(c, i):
            shapes.update({a + "q_proj.weight": (qrows, H), a + "k_proj.weight": (nkv * hd, H),
                           a + "v_proj.weight": (nkv * hd, H), a + "o_proj.weight": (H, nh * hd)})
        if c["model_type"] in ("qwen2", "qwen2_moe", "gpt_oss"):
            shapes.update({a + "q_proj.bias": (nh * hd,), a + "k_proj.bias": (nkv * hd,),
                           a + "v_proj.bias": (nkv * hd,)})
        if is_llama4(c):
            shapes.update(llama4_ffn_shapes(c, p + "feed_forward.", i))
            continue
        if c["model_type"] == "gpt_oss":
            E, m = c["num_local_experts"], p + "mlp."
            shapes.update({a + "o_proj.bias": (H,), a + "sinks": (nh,),
                           m + "router.weight": (E, H), m + "router.bias": (E,),
                           m + "experts.gate_up_proj": (E, H, 2 * I),
                           m + "experts.gate_up_proj_bias": (E, 2 * I),
                           m + "experts.down_proj": (E, I, H), m + "experts.down_proj_bias": (E, H)})
            continue
        if c["model_type"] in ("qwen3", "qwen3_moe", "gemma3_text") or (
                c["model_type"] == "qwen3_next" and not is_linear(c, i)):
            shapes.update({a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)})
        if c["model_type"] == "mixtral":
            E, m = c["num_local_experts"], p + "block_sparse_moe."
            shapes[m + "gate.weight"] = (E, H)
            for e in range(E):
                shapes.update({f"{m}experts.{e}.w1.weight": (I, H),
                               f"{m}experts.{e}.w3.weight": (I, H),
                               f"{m}experts.{e}.w2.weight": (H, I)})
        elif moe_layer(c, i):
            E, Im, m = c["num_experts"], c["moe_intermediate_size"], p + "mlp."
            shapes[m + "gate.weight"] = (E, H)
            for e in range(E):
                shapes.update({f"{m}experts.{e}.gate_proj.weight": (Im, H),
                               f"{m}experts.{e}.up_proj.weight": (Im, H),
                               f"{m}experts.{e}.down_proj.weight": (H, Im)})
            S = c.get("shared_expert_intermediate_size", 0)
            if S:  # Qwen2-MoE / Qwen3-Next: one sigmoid-gated shared expert
                shapes.update({m + "shared_expert.gate_proj.weight": (S, H),
                               m + "shared_expert.up_proj.weight": (S, H),
                               m + "shared_expert.down_proj.weight": (H, S),
                               m + "shared_expert_gate.weight": (1, H)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                           p + "mlp.down_proj.weight": (H, I)})
    out = {}
    for name, shape in shapes.items():
        if name.endswith("linear_attn.norm.weight"):  # applied as w, never 1 + w
            w = 1.0 + 0.3 * g.standard_normal(shape)
        elif name.endswith("conv1d.weight"):
            w = g.standard_normal(shape) / math.sqrt(shape[-1])
        elif name.endswith("norm.weight"):
            w = (0.0 if zero_centred(c) else 1.0) + 0.3 * g.standard_normal(shape)
        elif len(shape) == 1:
            w = 0.5 * g.standard_normal(shape)
        elif name.endswith("embed_tokens.weight"):
            w = g.standard_normal(shape)
        else:
            w = g.standard_normal(shape) / math.sqrt(shape[1])
        out[name] = w.astype(np.float32)
    return out


# --------------------------------------------------------------------------
# The float64 reference decoder (from the HF modeling files)
# --------------------------------------------------------------------------

def rms(x, w, eps, gemma):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * (1.0 + w) if gemma else y * w


def layer_kind(c, i):
    """(sliding window or 0, rope theta) of layer i."""
    t, window = c["model_type"], c.get("sliding_window") or 0
    if "layer_types" in c:
        sliding = c["layer_types"][i] == "sliding_attention"
    elif t == "gemma2":
        sliding = i % 2 == 0
    elif t == "gemma3_text":
        sliding = (i + 1) % c.get("sliding_window_pattern", 6) != 0
    elif t in ("mistral", "mixtral"):
        sliding = window > 0
    else:
        sliding = False
    theta = c["rope_theta"]
    if t == "gemma3_text" and sliding:
        theta = c.get("rope_local_base_freq", 10000.0)
    return (window if sliding else 0), theta


def attention_ref(c, w, p, x, i):
    """x [b, s, H] -> [b, s, H]: HF's eager attention of layer i."""
    b, s, _ = x.shape
    nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], head_dim(c)

    def lin(name):
        y = x @ w[p + name + ".weight"].T
        return y + w[p + name + ".bias"] if p + name + ".bias" in w else y

    gated = c["model_type"] == "qwen3_next"
    if gated:  # Qwen3NextAttention: q_proj gives [query | gate] per head
        q, gate = lin("q_proj").view(b, s, nh, 2 * hd).chunk(2, dim=-1)
        gate = gate.reshape(b, s, nh * hd)
    else:
        q = lin("q_proj").view(b, s, nh, hd)
    k = lin("k_proj").view(b, s, nkv, hd)
    v = lin("v_proj").view(b, s, nkv, hd)
    if p + "q_norm.weight" in w:
        q = rms(q, w[p + "q_norm.weight"], c["rms_norm_eps"], zero_centred(c))
        k = rms(k, w[p + "k_norm.weight"], c["rms_norm_eps"], zero_centred(c))
    window, theta = layer_kind(c, i)
    if is_llama4(c):
        return llama4_attention_ref(c, w, p, q, k, v, i)
    # Partial RoPE (Qwen3-Next): the first int(hd * factor) dims rotate.
    rd = int(hd * c.get("partial_rotary_factor", 0.25 if gated else 1.0))
    inv, factor = inv_freq_ref(rd, theta, c.get("rope_scaling"), c["max_position_embeddings"])
    freqs = torch.arange(s, dtype=torch.float64)[:, None] * torch.from_numpy(inv)[None, :]
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos()[None, :, None, :] * factor, emb.sin()[None, :, None, :] * factor
    q = torch.cat((q[..., :rd] * cos + rotate_half(q[..., :rd]) * sin, q[..., rd:]), -1)
    k = torch.cat((k[..., :rd] * cos + rotate_half(k[..., :rd]) * sin, k[..., rd:]), -1)
    k = k.repeat_interleave(nh // nkv, dim=2)
    v = v.repeat_interleave(nh // nkv, dim=2)
    scale = c["query_pre_attn_scalar"] ** -0.5 if is_gemma(c) else hd ** -0.5
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    cap = c.get("attn_logit_softcapping") or 0.0
    if cap:
        scores = torch.tanh(scores / cap) * cap
    qi = torch.arange(s)[:, None]
    ki = torch.arange(s)[None, :]
    visible = ki <= qi
    if window:
        visible &= qi - ki < window
    scores = scores.masked_fill(~visible, float("-inf"))
    if p + "sinks" in w:  # gpt-oss: a per-head logit joins each softmax, then is dropped
        sink = w[p + "sinks"].view(1, nh, 1, 1).expand(b, nh, s, 1)
        probs = torch.softmax(torch.cat((scores, sink), -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    o = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, nh * hd)
    if gated:
        o = o * torch.sigmoid(gate)
    o = o @ w[p + "o_proj.weight"].T
    return o + w[p + "o_proj.bias"] if p + "o_proj.bias" in w else o


def llama4_attention_ref(c, w, p, q, k, v, i):
    """Llama4TextAttention from the projections q [b, s, nh, hd], k, v:
    RoPE layers rotate the pairs (2i, 2i + 1) (view_as_complex), then the
    weightless L2 qk-norm, and attend within their attention_chunk_size
    chunk; NoPE layers scale q by the temperature log1p(floor((pos + 1) /
    floor_scale)) * attn_scale + 1 and attend causally."""
    b, s, nh, hd = q.shape
    rope = llama4_rope_layer(c, i)
    pos = torch.arange(s, dtype=torch.float64)
    if rope:
        q, k = rope_pairs(q, c["rope_theta"]), rope_pairs(k, c["rope_theta"])
        if c.get("use_qk_norm", True):
            eps = c["rms_norm_eps"]
            q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps)
            k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps)
    elif c.get("attn_temperature_tuning", True):
        t = torch.log1p(torch.floor((pos + 1.0) / c["floor_scale"])) * c["attn_scale"] + 1.0
        q = q * t[None, :, None, None]
    nkv = k.shape[2]
    k = k.repeat_interleave(nh // nkv, dim=2)
    v = v.repeat_interleave(nh // nkv, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * hd ** -0.5
    qi, ki = torch.arange(s)[:, None], torch.arange(s)[None, :]
    visible = ki <= qi
    if rope:
        visible &= (ki // c["attention_chunk_size"]) == (qi // c["attention_chunk_size"])
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
    o = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, nh * hd)
    return o @ w[p + "o_proj.weight"].T


def llama4_moe_ref(c, w, f, x):
    """Llama4TextMoe: the top-k router logits through a sigmoid scale each
    chosen expert's INPUT; experts x @ W with gate_up_proj's first half the
    gate and second half the up (chunk(2)); plus the shared expert."""
    E, k, I = c["num_local_experts"], c["num_experts_per_tok"], c["intermediate_size"]
    logits = x @ w[f + "router.weight"].T
    top_v, top_i = logits.topk(k, dim=-1)
    y = mlp_ref(c, w, f + "shared_expert.", x)
    for e in range(E):
        scale = (torch.sigmoid(top_v) * (top_i == e)).sum(-1, keepdim=True)  # 0 if not chosen
        gu = (x * scale) @ w[f + "experts.gate_up_proj"][e]
        gate, up = gu[..., :I], gu[..., I:]
        y = y + (up * gate * torch.sigmoid(gate)) @ w[f + "experts.down_proj"][e]
    return y


def gated_deltanet_ref(c, w, la, x):
    """Qwen3NextGatedDeltaNet over whole sequences from a zero state, the
    gated delta rule in its recurrent form: x [b, s, H] -> [b, s, H]."""
    b, s, _ = x.shape
    hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv, K = c["linear_key_head_dim"], c["linear_value_head_dim"], c["linear_conv_kernel_dim"]
    r = hv // hk
    # Projections grouped per key head: [q | k | v of its r value heads | z of the same].
    qkvz = (x @ w[la + "in_proj_qkvz.weight"].T).view(b, s, hk, 2 * dk + 2 * r * dv)
    q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], -1)
    ba = (x @ w[la + "in_proj_ba.weight"].T).view(b, s, hk, 2 * r)
    beta = torch.sigmoid(ba[..., :r].reshape(b, s, hv))
    a = ba[..., r:].reshape(b, s, hv)
    mixed = torch.cat((q.reshape(b, s, -1), k.reshape(b, s, -1), v.reshape(b, s, -1)), -1)
    # Causal depthwise conv over time (K - 1 zeros before the first token), then SiLU.
    conv = F.conv1d(F.pad(mixed.transpose(1, 2), (K - 1, 0)), w[la + "conv1d.weight"],
                    groups=mixed.shape[-1])
    mixed = F.silu(conv).transpose(1, 2)
    q, k, v = torch.split(mixed, [hk * dk, hk * dk, hv * dv], -1)
    q, k, v = q.reshape(b, s, hk, dk), k.reshape(b, s, hk, dk), v.reshape(b, s, hv, dv)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dk ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    g = -w[la + "A_log"].exp() * F.softplus(a + w[la + "dt_bias"])
    S = torch.zeros(b, hv, dk, dv, dtype=torch.float64)
    o = torch.zeros(b, s, hv, dv, dtype=torch.float64)
    for t in range(s):
        for h in range(hv):
            kt, qt = k[:, t, h // r], q[:, t, h // r]
            St = S[:, h] * g[:, t, h].exp()[:, None, None]
            delta = (v[:, t, h] - torch.einsum("bij,bi->bj", St, kt)) * beta[:, t, h, None]
            S[:, h] = St + kt[:, :, None] * delta[:, None, :]
            o[:, t, h] = torch.einsum("bij,bi->bj", S[:, h], qt)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + c["rms_norm_eps"])
    o = o * w[la + "norm.weight"] * F.silu(z.reshape(b, s, hv, dv))
    return o.reshape(b, s, hv * dv) @ w[la + "out_proj.weight"].T


def rope_pairs(x, theta):
    """RoPE rotating the pairs (2i, 2i + 1) of x [b, s, h, d] at positions
    0..s-1 (DeepSeek's interleaved layout; HF permutes both q and k to the
    half-split order first, which leaves every q.k unchanged)."""
    s, d = x.shape[1], x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(s, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1).flatten(-2)


def hadamard(n):
    """Sylvester's Hadamard matrix of order n (a power of 2) times n^-1/2,
    the rotation DeepSeek's rotate_activation applies."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h * n ** -0.5


def fp8_blocks(x):
    """DeepSeek's act_quant with scale_fmt "ue8m0": per block of 128 values
    of x [..., D] float64, scale = 2^ceil(log2(max(amax, 1e-4) / 448)) and the
    nearest E4M3 codes of x / scale -> (codes [..., D], scales [..., D/128])."""
    blocks = x.numpy().reshape(*x.shape[:-1], -1, 128)
    scale = 2.0 ** np.ceil(np.log2(np.maximum(np.abs(blocks).max(-1), 1e-4) / 448))
    return _nearest_e4m3(blocks / scale[..., None]).reshape(x.shape), scale


def dsa_selection(c, w, a, x, cq):
    """DeepSeek-V3.2's lightning indexer (inference/model.py's Indexer, at
    its half-split RoPE fix): indexer queries from the normed compressed
    query cq, one LayerNorm'd key per token, RoPE (pairs (i, i + d_r/2)) on
    the first d_r features, the Hadamard rotation, fp8 blocks; head weights
    weights_proj(x) Hi^-1/2 Di^-1/2. The scores and the top-k are
    test_sparse_attention.py's float64 reference: [b, s, index_topk] key
    indices, -1 where a query sees fewer keys."""
    b, s, _ = x.shape
    hi, di, dr = c["index_n_heads"], c["index_head_dim"], c["qk_rope_head_dim"]
    q = (cq @ w[a + "indexer.wq_b.weight"].T).view(b, s, hi, di)
    k = F.layer_norm(x @ w[a + "indexer.wk.weight"].T, (di,), w[a + "indexer.k_norm.weight"],
                     w[a + "indexer.k_norm.bias"], 1e-6).view(b, s, 1, di)
    inv = 1.0 / c["rope_theta"] ** (torch.arange(0, dr, 2, dtype=torch.float64) / dr)
    ang = torch.arange(s, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = torch.cat((ang, ang), -1).cos()[:, None], torch.cat((ang, ang), -1).sin()[:, None]
    rot = hadamard(di)
    q, k = [torch.cat((t[..., :dr] * cos + rotate_half(t[..., :dr]) * sin, t[..., dr:]), -1) @ rot
            for t in (q, k)]
    qc, qs = fp8_blocks(q)
    kc, ks = fp8_blocks(k[:, :, 0])
    weights = (x @ w[a + "indexer.weights_proj.weight"].T) * (hi * di) ** -0.5
    return _indexer_reference(qc, qs, weights.numpy(), kc, ks, c["index_topk"])[0]


def mla_ref(c, w, a, x):
    """DeepseekV2/V3Attention (no rope_scaling) in float64; DeepSeek-V3.2
    attends only to the keys its indexer selects."""
    b, s, _ = x.shape
    nh, dn, dr, dv = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                      c["v_head_dim"])
    eps = c["rms_norm_eps"]
    if c["q_lora_rank"]:
        cq = rms(x @ w[a + "q_a_proj.weight"].T, w[a + "q_a_layernorm.weight"], eps, False)
        q = (cq @ w[a + "q_b_proj.weight"].T).view(b, s, nh, dn + dr)
    else:
        q = (x @ w[a + "q_proj.weight"].T).view(b, s, nh, dn + dr)
    q_nope, q_pe = q[..., :dn], q[..., dn:]
    ckv = x @ w[a + "kv_a_proj_with_mqa.weight"].T
    latent, k_pe = ckv[..., :c["kv_lora_rank"]], ckv[..., c["kv_lora_rank"]:]
    kv = (rms(latent, w[a + "kv_a_layernorm.weight"], eps, False) @ w[a + "kv_b_proj.weight"].T
          ).view(b, s, nh, dn + dv)
    k_nope, v = kv[..., :dn], kv[..., dn:]
    q_pe = rope_pairs(q_pe, c["rope_theta"])
    k_pe = rope_pairs(k_pe.view(b, s, 1, dr), c["rope_theta"]).expand(b, s, nh, dr)
    qf, kf = torch.cat((q_nope, q_pe), -1), torch.cat((k_nope, k_pe), -1)
    scores = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * (dn + dr) ** -0.5
    mask = torch.ones(s, s, dtype=torch.bool).tril().expand(b, 1, s, s).clone()
    if c.get("index_n_heads"):
        idx = dsa_selection(c, w, a, x, cq)
        picked = torch.zeros(b, 1, s, s, dtype=torch.bool)
        for bi in range(b):
            for t in range(s):
                picked[bi, 0, t, [int(j) for j in idx[bi, t] if j >= 0]] = True
        mask &= picked
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
    o = torch.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, s, nh * dv)
    return o @ w[a + "o_proj.weight"].T


def gpt_oss_moe_ref(c, w, m, x):
    """GptOssMLP: softmax over the top-k router logits (router has a bias);
    each expert x @ W + b with gate and up interleaved in the columns, gate
    clamped above, up clamped both ways at swiglu_limit,
    down((up + 1) * gate * sigmoid(1.702 gate))."""
    E, k, lim = c["num_local_experts"], c["num_experts_per_tok"], c["swiglu_limit"]
    logits = x @ w[m + "router.weight"].T + w[m + "router.bias"]
    top_v, top_i = logits.topk(k, dim=-1)
    top_w = torch.softmax(top_v, -1)
    y = torch.zeros_like(x)
    for e in range(E):
        gu = x @ w[m + "experts.gate_up_proj"][e] + w[m + "experts.gate_up_proj_bias"][e]
        gate, up = gu[..., 0::2].clamp(max=lim), gu[..., 1::2].clamp(-lim, lim)
        out = ((up + 1) * gate * torch.sigmoid(1.702 * gate)) @ w[m + "experts.down_proj"][e]
        out = out + w[m + "experts.down_proj_bias"][e]
        y = y + (top_w * (top_i == e)).sum(-1, keepdim=True) * out
    return y


def deepseek_moe_ref(c, w, m, x):
    """DeepseekV3MoE: sigmoid scores, noaux_tc group limit (a group's score
    is the sum of its two best biased scores), top-k by biased score,
    weights the unbiased scores, renormalised, times routed_scaling_factor;
    DeepseekV2MoE's greedy: top-k of the softmax. Plus the shared experts."""
    E, k = c["n_routed_experts"], c["num_experts_per_tok"]
    logits = x @ w[m + "gate.weight"].T
    if c["topk_method"] == "noaux_tc":
        G, TG = c["n_group"], c["topk_group"]
        scores = torch.sigmoid(logits)
        choice = scores + w[m + "gate.e_score_correction_bias"]
        groups = choice.view(*choice.shape[:-1], G, E // G).topk(2, dim=-1)[0].sum(-1)
        keep = torch.zeros_like(groups).scatter(-1, groups.topk(TG, dim=-1)[1], 1.0)
        allowed = keep.repeat_interleave(E // G, dim=-1).bool()
        top_i = choice.masked_fill(~allowed, float("-inf")).topk(k, dim=-1)[1]
    else:
        scores = torch.softmax(logits, -1)
        top_i = scores.topk(k, dim=-1)[1]
    top_w = scores.gather(-1, top_i)
    if c["norm_topk_prob"]:
        top_w = top_w / (top_w.sum(-1, keepdim=True) + 1e-20)
    top_w = top_w * c["routed_scaling_factor"]
    y = mlp_ref(c, w, m + "shared_experts.", x)
    for e in range(E):
        weight = (top_w * (top_i == e)).sum(-1, keepdim=True)
        y = y + weight * mlp_ref(c, w, f"{m}experts.{e}.", x)
    return y


def act(c, x):
    if is_gemma(c):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    return x * torch.sigmoid(x)


def mlp_ref(c, w, p, x):
    return (act(c, x @ w[p + "gate_proj.weight"].T) * (x @ w[p + "up_proj.weight"].T)) @ w[
        p + "down_proj.weight"].T


def moe_ref(c, w, p, x):
    """Mixtral / Qwen2-MoE / Qwen3-MoE / Qwen3-Next: softmax over the router
    logits, top-k, renormalised (Mixtral always, the Qwens when
    norm_topk_prob), plus the Qwens' sigmoid-gated shared expert."""
    mixtral = c["model_type"] == "mixtral"
    m = p + ("block_sparse_moe." if mixtral else "mlp.")
    E = c["num_local_experts" if mixtral else "num_experts"]
    probs = torch.softmax(x @ w[m + "gate.weight"].T, -1)
    top_w, top_i = torch.topk(probs, c["num_experts_per_tok"], dim=-1)
    if mixtral or c.get("norm_topk_prob", False):
        top_w = top_w / top_w.sum(-1, keepdim=True)
    y = torch.zeros_like(x)
    for e in range(E):
        e_p = f"{m}experts.{e}."
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        out = (act(c, x @ w[e_p + names[0] + ".weight"].T) * (x @ w[e_p + names[1] + ".weight"].T)
               ) @ w[e_p + names[2] + ".weight"].T
        weight = (top_w * (top_i == e)).sum(-1, keepdim=True)
        y = y + weight * out
    if m + "shared_expert_gate.weight" in w:  # Qwen2-MoE / Qwen3-Next
        y = y + torch.sigmoid(x @ w[m + "shared_expert_gate.weight"].T) * mlp_ref(
            c, w, m + "shared_expert.", x)
    return y


def decoder_ref(c, weights, tokens):
    """tokens [b, s] -> float64 logits [b, s, vocab]."""
    w = {n: torch.from_numpy(a.astype(np.float64)) for n, a in weights.items()}
    eps, gemma, zc = c["rms_norm_eps"], is_gemma(c), zero_centred(c)
    h = w["model.embed_tokens.weight"][torch.from_numpy(np.asarray(tokens, np.int64))]
    if gemma:  # the normalizer is a tensor of the embedding's dtype
        h = h * float(np.float32(math.sqrt(c["hidden_size"])))
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"], eps, zc)
        if is_linear(c, i):
            a = gated_deltanet_ref(c, w, p + "linear_attn.", x)
        elif is_deepseek(c):
            a = mla_ref(c, w, p + "self_attn.", x)
        else:
            a = attention_ref(c, w, p + "self_attn.", x, i)
        if gemma:
            a = rms(a, w[p + "post_attention_layernorm.weight"], eps, True)
            x = rms(h + a, w[p + "pre_feedforward_layernorm.weight"], eps, True)
        else:
            x = rms(h + a, w[p + "post_attention_layernorm.weight"], eps, zc)
        h = h + a
        if is_llama4(c):
            ff = p + "feed_forward."
            f = llama4_moe_ref(c, w, ff, x) if llama4_moe_layer(c, i) else mlp_ref(c, w, ff, x)
        elif c["model_type"] == "gpt_oss":
            f = gpt_oss_moe_ref(c, w, p + "mlp.", x)
        elif is_deepseek(c) and i >= c["first_k_dense_replace"]:
            f = deepseek_moe_ref(c, w, p + "mlp.", x)
        else:
            f = moe_ref(c, w, p, x) if moe_layer(c, i) else mlp_ref(c, w, p + "mlp.", x)
        if gemma:
            f = rms(f, w[p + "post_feedforward_layernorm.weight"], eps, True)
        h = h + f
    h = rms(h, w["model.norm.weight"], eps, zc)
    head = w["model.embed_tokens.weight" if c["tie_word_embeddings"] else "lm_head.weight"]
    logits = h @ head.T
    cap = c.get("final_logit_softcapping") or 0.0
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits.numpy()


def check_logits(name, got, want, rel=1e-4):
    """The issue's criterion: |got - want| <= 1e-4 max|want|."""
    return check_close(name, got, want, rel * np.abs(want).max())


# --------------------------------------------------------------------------
# Families
# --------------------------------------------------------------------------

FAMILIES = {
    "llama": base_config("llama"),
    "llama_tied": base_config("llama", tie_word_embeddings=True),
    "mistral": base_config("mistral", sliding_window=5),
    "qwen2": base_config("qwen2", tie_word_embeddings=True, use_sliding_window=False),
    "qwen3": base_config("qwen3", head_dim=32, attention_bias=False),
    "mixtral": base_config("mixtral", num_local_experts=4, num_experts_per_tok=2,
                           sliding_window=None),
    "qwen3_moe": base_config("qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=48, norm_topk_prob=True,
                             mlp_only_layers=[1], decoder_sparse_step=1),
    "gemma2": base_config("gemma2", num_hidden_layers=2, head_dim=16, sliding_window=4,
                          query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
                          final_logit_softcapping=20.0, tie_word_embeddings=True,
                          hidden_activation="gelu_pytorch_tanh"),
    "gemma3_text": base_config("gemma3_text", head_dim=16, sliding_window=4,
                               query_pre_attn_scalar=16, rope_local_base_freq=100.0,
                               rope_theta=10000.0, sliding_window_pattern=2,
                               tie_word_embeddings=True, rope_scaling=None,
                               hidden_activation="gelu_pytorch_tanh"),
    "deepseek_v3": base_config("deepseek_v3", num_key_value_heads=4, q_lora_rank=24,
                               kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                               v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
                               moe_intermediate_size=32, n_shared_experts=1,
                               first_k_dense_replace=1, n_group=4, topk_group=2,
                               topk_method="noaux_tc", scoring_func="sigmoid",
                               norm_topk_prob=True, routed_scaling_factor=2.5,
                               rope_interleave=True, rope_scaling=None, rms_norm_eps=1e-6),
    # DeepSeek-V3's shape plus the lightning indexer (2 heads of 128): each
    # query attends to its best 4 keys of up to 11, so most rows are sparse.
    "deepseek_v32": base_config("deepseek_v32", num_key_value_heads=4, q_lora_rank=24,
                                kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=32, n_shared_experts=1,
                                first_k_dense_replace=1, n_group=4, topk_group=2,
                                topk_method="noaux_tc", scoring_func="sigmoid",
                                norm_topk_prob=True, routed_scaling_factor=2.5,
                                rope_interleave=True, rope_scaling=None, rms_norm_eps=1e-6,
                                index_n_heads=2, index_head_dim=128, index_topk=4),
    # Alternating windows, sinks, biases, YaRN RoPE, the clamped SwiGLU experts.
    "gpt_oss": base_config("gpt_oss", head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                           sliding_window=4, swiglu_limit=1.0, attention_bias=True,
                           layer_types=["sliding_attention", "full_attention",
                                        "sliding_attention"],
                           rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                         "beta_slow": 1.0, "truncate": True,
                                         "original_max_position_embeddings": 64}),
    # Linear (Gated DeltaNet), gated full attention with partial RoPE, MoE
    # with the gated shared expert, a dense layer; zero-centred norms.
    "qwen3_next": base_config("qwen3_next", head_dim=16, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=32, shared_expert_intermediate_size=32,
                              norm_topk_prob=True, mlp_only_layers=[2], decoder_sparse_step=1,
                              partial_rotary_factor=0.25,
                              layer_types=["linear_attention", "full_attention",
                                           "linear_attention"],
                              linear_num_key_heads=2, linear_num_value_heads=4,
                              linear_key_head_dim=16, linear_value_head_dim=12,
                              linear_conv_kernel_dim=4, rms_norm_eps=1e-6),
    # Chunked attention (chunk 4) with interleaved RoPE and L2 qk-norm on
    # layers 0-2, NoPE with temperature tuning on layer 3; top-1 experts on
    # layers 1 and 3 (input-scaled), dense intermediate_size_mlp on 0 and 2.
    "llama4_text": base_config("llama4_text", num_hidden_layers=4, head_dim=16,
                               intermediate_size=32, intermediate_size_mlp=96,
                               num_local_experts=4, num_experts_per_tok=1,
                               interleave_moe_layer_step=2, attention_chunk_size=4,
                               use_qk_norm=True, attn_temperature_tuning=True, floor_scale=4,
                               attn_scale=0.1, rope_scaling=None, rope_theta=10000.0),
    # qkv biases, no renormalising, a shared expert twice a routed one's width.
    "qwen2_moe": base_config("qwen2_moe", num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=24, shared_expert_intermediate_size=48,
                             norm_topk_prob=False, use_sliding_window=False),
    # V2-Lite's shape: q_proj without the low-rank query, greedy softmax routing.
    "deepseek_v2": base_config("deepseek_v2", num_key_value_heads=4, q_lora_rank=None,
                               kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                               v_head_dim=12, n_routed_experts=6, num_experts_per_tok=2,
                               moe_intermediate_size=32, n_shared_experts=2,
                               first_k_dense_replace=1, topk_method="greedy",
                               scoring_func="softmax", norm_topk_prob=False,
                               routed_scaling_factor=1.5, rope_scaling=None, rms_norm_eps=1e-6),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_forward_matches_reference(tmp_path, family):
    c = FAMILIES[family]
    weights = random_weights(c, seed=len(family))
    write_checkpoint(str(tmp_path), c, weights)
    model = attnkit.Model.from_pretrained(str(tmp_path))
    assert model.vocab_size == VOCAB and model.num_layers == c["num_hidden_layers"]
    assert model.model_type == c["model_type"]
    tokens = np.random.default_rng(7).integers(0, VOCAB, size=(2, 11))
    got = model.forward(tokens)
    assert got.dtype == np.float32 and got.shape == (2, 11, VOCAB)
    check_logits(family, got, decoder_ref(c, weights, tokens))


def test_one_dimensional_tokens_and_reference_backend(tmp_path):
    c = FAMILIES["qwen3"]
    weights = random_weights(c, seed=3)
    write_checkpoint(str(tmp_path), c, weights)
    model = attnkit.Model.from_pretrained(str(tmp_path), backend="reference")
    tokens = np.array([5, 0, 96, 41, 7], dtype=np.int32)
    got = model.forward(tokens)
    assert got.shape == (5, VOCAB)
    check_logits("qwen3 [seq]", got, decoder_ref(c, weights, tokens[None])[0])


def test_sharded_checkpoint_equals_single_file(tmp_path):
    c = FAMILIES["mixtral"]
    weights = random_weights(c, seed=11)
    write_checkpoint(str(tmp_path / "one"), c, weights)
    write_checkpoint(str(tmp_path / "three"), c, weights, shards=3)
    assert not os.path.exists(tmp_path / "three" / "model.safetensors")
    tokens = np.random.default_rng(1).integers(0, VOCAB, size=(1, 9))
    one = attnkit.Model.from_pretrained(str(tmp_path / "one")).forward(tokens)
    three = attnkit.Model.from_pretrained(str(tmp_path / "three")).forward(tokens)
    np.testing.assert_array_equal(one, three)
    check_logits("mixtral sharded", three, decoder_ref(c, weights, tokens))


@pytest.mark.parametrize("family", ["llama", "qwen3_next", "llama4_text"])
def test_bf16_checkpoint_stays_bf16(tmp_path, family):
    """bf16 weights run as bf16 GEMMs (inputs rounded to bf16, fp32 sums):
    against the reference on the same bf16 weights the error is that of
    rounding activations to bf16 (2^-9 relative per rounding), far above
    fp32's; half the weight bytes of the f32 checkpoint (Qwen3-Next's and
    Llama 4's fused experts and Gated DeltaNet projections included)."""
    c = FAMILIES[family]
    weights = random_weights(c, seed=5)
    rounded = {n: torch.from_numpy(w).to(torch.bfloat16).float().numpy()
               for n, w in weights.items()}
    write_checkpoint(str(tmp_path / "f32"), c, rounded)
    write_checkpoint(str(tmp_path / "bf16"), c, weights, bf16=True)
    m32 = attnkit.Model.from_pretrained(str(tmp_path / "f32"))
    m16 = attnkit.Model.from_pretrained(str(tmp_path / "bf16"))
    assert m16.weight_bytes < 0.52 * m32.weight_bytes  # the norms' gains stay f32
    tokens = np.random.default_rng(2).integers(0, VOCAB, size=(1, 8))
    want = decoder_ref(c, rounded, tokens)
    check_logits("f32 copy of bf16 weights", m32.forward(tokens), want)
    check_logits("bf16 weights", m16.forward(tokens), want, rel=3e-2)


# --------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------

@pytest.fixture
def llama_dir(tmp_path):
    c = base_config("llama", num_hidden_layers=2)
    return tmp_path, c, random_weights(c, seed=9)


def load_error(path):
    with pytest.raises(ValueError) as e:
        attnkit.Model.from_pretrained(str(path))
    return str(e.value)


def test_missing_tensor_is_named(llama_dir):
    path, c, w = llama_dir
    del w["model.layers.1.self_attn.k_proj.weight"]
    write_checkpoint(str(path), c, w)
    msg = load_error(path)
    assert "Model.from_pretrained" in msg and "layer 1" in msg
    assert "model.layers.1.self_attn.k_proj.weight" in msg and "missing" in msg


def test_extra_tensor_is_named(llama_dir):
    path, c, w = llama_dir
    w["model.layers.0.mlp.extra.weight"] = np.zeros((2, 2), np.float32)
    write_checkpoint(str(path), c, w)
    assert "model.layers.0.mlp.extra.weight" in load_error(path)


def test_lm_head_in_tied_checkpoint_is_extra(llama_dir):
    path, c, w = llama_dir
    write_checkpoint(str(path), dict(c, tie_word_embeddings=True), w)
    assert "lm_head.weight" in load_error(path)


def test_misshaped_tensor_names_both_shapes(llama_dir):
    path, c, w = llama_dir
    w["model.layers.0.mlp.up_proj.weight"] = np.zeros((95, HIDDEN), np.float32)
    write_checkpoint(str(path), c, w)
    msg = load_error(path)
    assert "model.layers.0.mlp.up_proj.weight" in msg
    assert "[95, 64]" in msg and "[96, 64]" in msg


def test_truncated_shard_is_named(llama_dir):
    path, c, w = llama_dir
    write_checkpoint(str(path), c, w, shards=2)
    shard = path / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    assert "model-00002-of-00002.safetensors" in load_error(path)


def test_index_naming_a_missing_shard(llama_dir):
    path, c, w = llama_dir
    write_checkpoint(str(path), c, w, shards=2)
    os.remove(path / "model-00001-of-00002.safetensors")
    msg = load_error(path)
    assert "model-00001-of-00002.safetensors" in msg and "missing" in msg


def test_unsupported_family_is_refused(tmp_path):
    c = base_config("llama")
    write_checkpoint(str(tmp_path), dict(c, model_type="gpt2", n_embd=64, n_layer=2, n_head=4),
                     {})
    assert "gpt2" in load_error(tmp_path)


def test_no_checkpoint(tmp_path):
    write_checkpoint(str(tmp_path), base_config("llama"), {})
    os.remove(tmp_path / "model.safetensors")
    assert "model.safetensors" in load_error(tmp_path)


def test_token_outside_vocabulary(llama_dir):
    path, c, w = llama_dir
    write_checkpoint(str(path), c, w)
    model = attnkit.Model.from_pretrained(str(path))
    for bad in (VOCAB, -1):
        with pytest.raises(ValueError, match=rf"Model.forward: token_ids\[0, 2\] = {bad} "):
            model.forward(np.array([[1, 2, bad]]))
    with pytest.raises(ValueError, match="token_ids"):
        model.forward(np.zeros((1, 2, 3), np.int64))
    with pytest.raises(ValueError, match="token_ids"):
        model.forward(np.array([0.5, 1.0]))


def test_batch_rows_are_independent_sequences(tmp_path):
    """Each row of a batch is its own sequence: the same logits as the row
    run alone (within the fp32 pipeline's rounding)."""
    c = FAMILIES["gemma3_text"]
    weights = random_weights(c, seed=13)
    write_checkpoint(str(tmp_path), c, weights)
    model = attnkit.Model.from_pretrained(str(tmp_path))
    tokens = np.random.default_rng(4).integers(0, VOCAB, size=(3, 9))
    batch = model.forward(tokens)
    for r in range(3):
        check_logits(f"row {r}", batch[r], model.forward(tokens[r]), rel=1e-5)


def test_hybrid_and_llama4_bad_tensors_are_named(tmp_path):
    """Qwen3-Next's linear-attention and gated-shared-expert tensors and
    Llama 4's fused experts are read strictly: missing, extra and
    mis-shaped tensors are named (a down_proj stored nn.Linear-style,
    [E, H, I], is the likely mistake)."""
    c = FAMILIES["qwen3_next"]
    w = random_weights(c, seed=21)
    del w["model.layers.2.linear_attn.A_log"]
    write_checkpoint(str(tmp_path / "a"), c, w)
    msg = load_error(tmp_path / "a")
    assert "layer 2" in msg and "model.layers.2.linear_attn.A_log" in msg
    w = random_weights(c, seed=21)
    w["model.layers.1.mlp.shared_expert_gate.weight"] = np.zeros((HIDDEN,), np.float32)
    write_checkpoint(str(tmp_path / "b"), c, w)
    msg = load_error(tmp_path / "b")
    assert "model.layers.1.mlp.shared_expert_gate.weight" in msg and "[1, 64]" in msg
    w = random_weights(c, seed=21)
    w["model.layers.0.self_attn.q_proj.weight"] = np.zeros((8, HIDDEN), np.float32)
    write_checkpoint(str(tmp_path / "c"), c, w)
    assert "model.layers.0.self_attn.q_proj.weight" in load_error(tmp_path / "c")

    c = FAMILIES["llama4_text"]
    E, I = c["num_local_experts"], c["intermediate_size"]
    w = random_weights(c, seed=22)
    w["model.layers.1.feed_forward.experts.down_proj"] = np.zeros((E, HIDDEN, I), np.float32)
    write_checkpoint(str(tmp_path / "d"), c, w)
    msg = load_error(tmp_path / "d")
    assert "model.layers.1.feed_forward.experts.down_proj" in msg
    assert f"[{E}, {HIDDEN}, {I}]" in msg and f"[{E}, {I}, {HIDDEN}]" in msg
    w = random_weights(c, seed=22)
    w["model.layers.3.feed_forward.experts.gate_up_proj_bias"] = np.zeros((E, 2 * I), np.float32)
    write_checkpoint(str(tmp_path / "e"), c, w)
    assert "model.layers.3.feed_forward.experts.gate_up_proj_bias" in load_error(tmp_path / "e")
    w = random_weights(c, seed=22)
    del w["model.layers.0.feed_forward.up_proj.weight"]
    write_checkpoint(str(tmp_path / "f"), c, w)
    assert "model.layers.0.feed_forward.up_proj.weight" in load_error(tmp_path / "f")


def test_llama4_multimodal_checkpoint_loads_its_text_model(tmp_path):
    """Llama4ForConditionalGeneration's checkpoint (model_type llama4, the
    text model's config in text_config, its tensors under language_model.,
    a vision tower beside them) loads the text model: the same logits as
    the Llama4ForCausalLM checkpoint. Another wrapper (gemma3) is refused
    by name, and so is a tensor outside language_model. and the vision parts."""
    c = FAMILIES["llama4_text"]
    weights = random_weights(c, seed=24)
    write_checkpoint(str(tmp_path / "text"), c, weights)
    wrapped = {"language_model." + n: w for n, w in weights.items()}
    wrapped["vision_model.patch_embedding.linear.weight"] = np.zeros((8, 4), np.float32)
    wrapped["multi_modal_projector.linear_1.weight"] = np.zeros((HIDDEN, 8), np.float32)
    wrapper = {"model_type": "llama4", "text_config": dict(c), "vision_config": {}}
    write_checkpoint(str(tmp_path / "wrapped"), wrapper, wrapped, shards=2)
    tokens = np.random.default_rng(6).integers(0, VOCAB, size=(1, 9))
    text = attnkit.Model.from_pretrained(str(tmp_path / "text")).forward(tokens)
    model = attnkit.Model.from_pretrained(str(tmp_path / "wrapped"))
    assert model.model_type == "llama4_text"
    np.testing.assert_array_equal(model.forward(tokens), text)
    check_logits("llama4 wrapper", text, decoder_ref(c, weights, tokens))

    wrapped["image_newline"] = np.zeros((HIDDEN,), np.float32)
    write_checkpoint(str(tmp_path / "extra"), wrapper, wrapped)
    assert "image_newline" in load_error(tmp_path / "extra")
    m = base_config("mistral")
    write_checkpoint(str(tmp_path / "mistral3"), {"model_type": "mistral3", "text_config": m}, {})
    msg = load_error(tmp_path / "mistral3")
    assert "mistral3" in msg and "multimodal wrapper" in msg


# Gemma3ForConditionalGeneration's names for the text model's tensors, as
# transformers' _checkpoint_conversion_mapping relates them: before 4.52
# language_model.model.* and language_model.lm_head.weight, since then
# model.language_model.* and lm_head.weight; the vision tower and the
# projector beside them.
GEMMA3_SCHEMES = {
    "language_model.model": (("model.", "language_model.model."),
                             ("lm_head.", "language_model.lm_head."),
                             ("vision_tower.vision_model.", "multi_modal_projector.")),
    "model.language_model": (("model.", "model.language_model."), ("lm_head.", "lm_head."),
                             ("model.vision_tower.vision_model.",
                              "model.multi_modal_projector.")),
}


def gemma3_wrapped(weights, scheme):
    """The text model's tensors under a Gemma3ForConditionalGeneration
    scheme's names, and a vision tower and projector beside them."""
    (text_from, text_to), (head_from, head_to), (vision, projector) = GEMMA3_SCHEMES[scheme]
    out = {}
    for n, w in weights.items():
        if n.startswith(text_from):
            out[text_to + n[len(text_from):]] = w
        else:
            out[head_to + n[len(head_from):]] = w
    out[vision + "embeddings.patch_embedding.weight"] = np.ones((8, 3, 2, 2), np.float32)
    out[vision + "encoder.layers.0.self_attn.q_proj.weight"] = np.ones((8, 8), np.float32)
    out[projector + "mm_input_projection_weight"] = np.ones((8, HIDDEN), np.float32)
    out[projector + "mm_soft_emb_norm.weight"] = np.ones((8,), np.float32)
    return out


@pytest.mark.parametrize("scheme", sorted(GEMMA3_SCHEMES))
@pytest.mark.parametrize("tied", [True, False])
def test_gemma3_multimodal_checkpoint_loads_its_text_model(tmp_path, scheme, tied):
    """A gemma3 wrapper checkpoint (text model in text_config, tensors under
    either naming scheme, a vision tower and projector beside them) gives
    the logits of the gemma3_text checkpoint of the same weights, bit for
    bit, and those match the float64 decoder."""
    c = dict(FAMILIES["gemma3_text"], tie_word_embeddings=tied)
    weights = random_weights(c, seed=25)
    write_checkpoint(str(tmp_path / "text"), c, weights)
    # Without its model_type, text_config is read as the wrapper's text family.
    text_config = {k: v for k, v in c.items() if k != "model_type"}
    wrapper = {"model_type": "gemma3", "text_config": text_config,
               "vision_config": {"model_type": "siglip_vision_model"}, "mm_tokens_per_image": 4}
    write_checkpoint(str(tmp_path / "wrapped"), wrapper, gemma3_wrapped(weights, scheme), shards=2)
    tokens = np.random.default_rng(8).integers(0, VOCAB, size=(2, 9))
    text = attnkit.Model.from_pretrained(str(tmp_path / "text"))
    model = attnkit.Model.from_pretrained(str(tmp_path / "wrapped"))
    assert model.model_type == "gemma3_text" and model.weight_bytes == text.weight_bytes
    np.testing.assert_array_equal(model.forward(tokens), text.forward(tokens))
    check_logits(f"gemma3 wrapper ({scheme})", model.forward(tokens),
                 decoder_ref(c, weights, tokens))


def test_gemma3_wrapper_stays_strict(tmp_path):
    """Only the vision tower and projector prefixes are skipped, exactly;
    a stray tensor, a missing one and one tensor under both schemes are
    named by the checkpoint's own names."""
    c = FAMILIES["gemma3_text"]
    weights = random_weights(c, seed=26)
    wrapper = {"model_type": "gemma3", "text_config": dict(c)}
    old = gemma3_wrapped(weights, "language_model.model")

    def error(name, tensors):
        write_checkpoint(str(tmp_path / name), wrapper, tensors)
        return load_error(tmp_path / name)

    msg = error("stray", dict(old, **{"language_model.model.extra.weight": np.zeros(2, np.float32)}))
    assert '"language_model.model.extra.weight"' in msg and "gemma3_text" in msg
    msg = error("near", dict(old, **{"vision_towers.x": np.zeros(2, np.float32)}))
    assert '"vision_towers.x"' in msg
    missing = dict(old)
    del missing["language_model.model.layers.1.mlp.up_proj.weight"]
    msg = error("missing", missing)
    assert "model.layers.1.mlp.up_proj.weight" in msg and "missing" in msg
    assert "gemma3 checkpoint" in msg
    both = dict(old, **{"model.language_model.norm.weight": weights["model.norm.weight"]})
    msg = error("both", both)
    assert '"language_model.model.norm.weight"' in msg
    assert '"model.language_model.norm.weight"' in msg and "two naming schemes" in msg


@pytest.mark.parametrize("method", ["mxfp4", "fp8"])
def test_quantized_checkpoint_is_refused_naming_method_and_way_out(tmp_path, method):
    """gpt-oss as released: MXFP4 experts, quantization_config in
    config.json. Refused before any tensor is read, with the method and
    the way out (a bf16 dequantized checkpoint)."""
    c = dict(FAMILIES["gpt_oss"], quantization_config={
        "quant_method": method, "modules_to_not_convert": ["model.layers.*.self_attn"]})
    write_checkpoint(str(tmp_path), c, {})
    msg = load_error(tmp_path)
    assert f'Model.from_pretrained: quantization_config.quant_method = "{method}"' in msg
    assert "bf16 dequantized checkpoint" in msg


def test_deepseek_v32_top_k_is_in_force(tmp_path, backend):
    """The same weights with index_topk covering every key (the dense MLA of
    DeepSeek-V3) give other logits from the 5th position on, the same
    before it: the sparse model's agreement with its reference is the
    indexer's selection at work, not dense attention. Both backends.

    Near-ties: a top-k whose k-th and (k+1)-th scores lie within the
    scoring's rounding could be broken differently by attnkit's fp32 and
    the reference's float64. For this seed (and test_forward_matches_
    reference's) the smallest nonzero gap at the cut is 2.6e-3 of the row's
    largest |score|, against an fp32 scoring error below 2e-5 of it; exact
    ties (score 0 where ReLU clears every head's q.k) go to the lower key
    in both."""
    c = FAMILIES["deepseek_v32"]
    weights = random_weights(c, seed=27)
    write_checkpoint(str(tmp_path / "sparse"), c, weights)
    write_checkpoint(str(tmp_path / "wide"), dict(c, index_topk=64), weights)
    tokens = np.random.default_rng(9).integers(0, VOCAB, size=(1, 11))
    sparse = attnkit.Model.from_pretrained(str(tmp_path / "sparse"), backend=backend)
    wide = attnkit.Model.from_pretrained(str(tmp_path / "wide"), backend=backend).forward(tokens)
    got = sparse.forward(tokens)
    check_logits("sparse reference", got, decoder_ref(c, weights, tokens))
    check_logits("positions 0-3", got[:, :4], wide[:, :4], rel=1e-5)
    assert np.abs(got[:, 4:] - wide[:, 4:]).max() > 1e-2 * np.abs(wide).max()
    check_logits("dense reference", wide, decoder_ref(dict(c, index_topk=64), weights, tokens))


def test_qwen3_next_forward_in_pieces_equals_one_call(tmp_path):
    """The linear layers' state carries across forward()'s positions: a
    sequence's logits do not depend on the rows batched beside it, and the
    first 5 positions of an 11-token row equal a 5-token call (causal)."""
    c = FAMILIES["qwen3_next"]
    weights = random_weights(c, seed=23)
    write_checkpoint(str(tmp_path), c, weights)
    model = attnkit.Model.from_pretrained(str(tmp_path))
    tokens = np.random.default_rng(5).integers(0, VOCAB, size=(2, 11))
    full = model.forward(tokens)
    check_logits("prefix", model.forward(tokens[:1, :5])[0], full[0, :5], rel=1e-5)
    check_logits("row 1 alone", model.forward(tokens[1]), full[1], rel=1e-5)
