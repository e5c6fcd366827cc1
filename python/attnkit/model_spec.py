"""The model description of a Hugging Face config (see docs/MODELS.md)."""
import json as _json
import os as _os

from ._attnkit import _model_spec_from_json


def model_spec_from_config(config):
    """What every decoder layer of a Hugging Face model is, read once.

    config: a config.json as a dict, its JSON text, a transformers config
        object (anything with to_dict()), or the path of a config.json. A
        multimodal wrapper (gemma3, llama4) is read through its text_config.

    Returns a dict: model_type, wrapper_model_type, num_layers, hidden_size,
    vocab_size, max_position_embeddings, tie_word_embeddings, rms_norm_eps,
    quantization {quant_method, modules_not_to_convert}, and layers, one dict
    per layer with its kind ("attention", "latent_attention",
    "linear_attention"), window (0 = none), chunk (0 = none), rope (None for
    NoPE and linear layers, else theta, rotary_dim, pairing, scaling), the
    kind's sizes, and ffn (kind "dense" with intermediate_size, or "moe"
    with the expert counts). Raises ValueError naming the offending field.

        spec = attnkit.model_spec_from_config(json.load(open("config.json")))
        [layer["window"] for layer in spec["layers"]]
    """
    if isinstance(config, str) and config.lstrip().startswith("{"):
        text = config
    elif isinstance(config, (str, _os.PathLike)):
        with open(config, encoding="utf-8") as f:
            text = f.read()
    elif isinstance(config, dict):
        text = _json.dumps(config)
    elif hasattr(config, "to_dict"):
        text = _json.dumps(config.to_dict())
    else:
        raise ValueError("model_spec_from_config: config must be a dict, JSON text, a "
                         "transformers config or the path of a config.json, got "
                         f"{type(config).__name__}")
    return _model_spec_from_json(text)
