"""attnkit: attention variants of large language models (MHA, MQA, GQA, MLA) on the CPU.

Arrays are numpy, laid out [batch, seq, heads, head_dim] like FlashAttention;
argument names follow FlashAttention, config fields and weight names follow
Hugging Face. float32 inputs are used in place (any strides); other dtypes
are converted. Every invalid argument raises ValueError with a message that
names it (I/O failures: OSError).

    out = attnkit.sdpa(q, k, v, causal=True)
    # gpt-oss's sinks (one logit per query head), Llama 4's chunked layers:
    out = attnkit.sdpa(q, k, v, causal=True, sinks=sinks, chunk_size=8192)
    layer = attnkit.from_config(json.load(open("config.json")))
    layer.load_state_dict(attnkit.load_safetensors("model.safetensors"),
                          prefix="model.layers.0.self_attn.")
    y = layer.forward(x)
"""
# Imported under private names so that dir(attnkit) lists the package's
# own API only.
import json as _json
import os as _os

from . import _attnkit
from ._attnkit import (AttentionLayer, KVCache, PagedKVCache, Rope, apply_rope,
                       batch_attention, load_safetensors, merge_attention_states,
                       save_safetensors, sdpa, sdpa_varlen)
from .model_spec import model_spec_from_config
from .moe import moe_from_config

__version__ = "0.1.0"

# model_type values whose attention is DeepSeek's multi-head latent attention.
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2")


def _config_dict(config, fn):
    """A Hugging Face config as a dict: a dict, an object with to_dict()
    (a transformers config), or the path of a config.json."""
    if isinstance(config, dict):
        return config
    if hasattr(config, "to_dict"):
        return config.to_dict()
    if isinstance(config, (str, _os.PathLike)):
        with open(config, encoding="utf-8") as f:
            return _json.load(f)
    raise ValueError(f"{fn}: config must be a dict, a transformers config or the path of a "
                     f"config.json, got {type(config).__name__}")


def from_config(config, layer_index=0):
    """The attention layer of a Hugging Face model config.

    config: a config.json as a dict (or a transformers config object, or the
        path of a config.json).
    layer_index: which layer's settings to use where they differ per layer
        (Mistral/Gemma-2/Gemma 3/gpt-oss/Qwen2 sliding-window layers,
        Llama 4's chunked RoPE and global NoPE layers, Qwen3-Next's
        full-attention layers, layer_types).

    Returns an AttentionLayer for the softmax-attention families the C++
    config reader knows (attention_config_from_json: llama, mistral,
    mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe, gemma2, and where it reads
    them gpt_oss, gemma3_text / gemma3, llama4_text / llama4 and
    qwen3_next's full-attention layers; no model_type: llama's shape) or,
    for deepseek_v2 / deepseek_v3 / deepseek_v32 / kimi_k2, a LatentAttention
    (MLA; deepseek_v32 adds DeepSeek sparse attention, docs/MLA.md).
    Any other model_type, or a layer that is not softmax attention, raises
    ValueError naming it. The layer expects Hugging Face weight names
    (q_proj.weight, ..., q_norm.weight, sinks); load them with
    layer.load_state_dict(state_dict, prefix="model.layers.N.self_attn.").
    forward(x [batch, seq, hidden]) -> [batch, seq, hidden].
    Raises ValueError naming the offending field.
    """
    config = _config_dict(config, "from_config")
    text = _json.dumps(config)
    if config.get("model_type") in MLA_MODEL_TYPES:
        latent = getattr(_attnkit, "LatentAttention", None)
        if latent is None:
            raise NotImplementedError(
                f"from_config: model_type '{config['model_type']}' uses multi-head latent "
                "attention, and this build of attnkit has no LatentAttention binding")
        # MLA layers are uniform across layers: layer_index selects nothing.
        return latent.from_config_json(text)
    return AttentionLayer.from_config_json(text, layer_index)


def attention_from_variant(variant, d_model, num_heads, bias=True):
    """The seeds' unified constructor: an AttentionLayer for "mha"
    (num_kv_heads = num_heads), "mqa" (1) or "gqa-N" (N kv heads), with
    head_dim = d_model // num_heads, no RoPE, not causal, and biases on all
    four projections when bias is True (nn.Linear's default).

    Load the weights (q_proj/k_proj/v_proj/o_proj .weight/.bias) with
    load_state_dict before the first forward. Use forward_qkv(query, key, value, ...) for
    the nn.MultiheadAttention-style call or forward(x) for self-attention.
    """
    return AttentionLayer.from_variant(variant, d_model, num_heads, bias)


__all__ = [
    "__version__", "AttentionLayer", "KVCache", "MLA_MODEL_TYPES", "PagedKVCache", "Rope",
    "apply_rope", "attention_from_variant", "batch_attention", "from_config", "load_safetensors",
    "merge_attention_states", "model_spec_from_config", "moe_from_config", "save_safetensors",
    "sdpa", "sdpa_varlen",
]

# Classes and functions bound by the other areas (MLA, MoE) are public too.
for _name in dir(_attnkit):
    if not _name.startswith("_") and _name not in globals():
        globals()[_name] = getattr(_attnkit, _name)
        __all__.append(_name)
del _name
