"""The MoE feed-forward from a Hugging Face config (see docs/MOE.md)."""
import json as _json
import os as _os

from ._attnkit import MoE


def moe_from_config(config):
    """An attnkit.MoE for the MoE fields of a Hugging Face config.

    config: a config.json as a dict, a transformers config object (anything
        with to_dict()), or the path of a config.json. Families: mixtral,
        deepseek_v2, deepseek_v3, kimi_k2, and gpt_oss where the C++ reader
        (moe_config_from_json) reads it: its fused experts
        (mlp.experts.gate_up_proj [E, H, 2I], down_proj [E, I, H] and their
        biases, mlp.router.weight/bias) are repacked at load.

    Raises ValueError naming the offending field. Then:

        moe.load_weights(state_dict, prefix="model.layers.3.")
        out = moe.forward(x)                              # x [batch, seq, hidden]
        out, routing = moe.forward(x, return_routing=True)
        routing["expert_ids"], routing["weights"]          # [batch, seq, k]
        routing["tokens_per_expert"]                       # [n_routed_experts]
    """
    if isinstance(config, (str, _os.PathLike)):
        with open(config, encoding="utf-8") as f:
            config = _json.load(f)
    elif not isinstance(config, dict) and hasattr(config, "to_dict"):
        config = config.to_dict()
    if not isinstance(config, dict):
        raise ValueError("moe_from_config: config must be a dict, a transformers config or the "
                         f"path of a config.json, got {type(config).__name__}")
    return MoE.from_config_json(_json.dumps(config))
