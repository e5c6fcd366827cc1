"""attnkit: attention variants of large language models (MHA, MQA, GQA, MLA) on the CPU.

Arrays are numpy, laid out [batch, seq, heads, head_dim] like FlashAttention;
argument names follow FlashAttention, config fields and weight names follow
Hugging Face. float32 inputs are used in place (any strides); other dtypes
are converted. Every invalid argument raises ValueError with a message that
names it (I/O failures: OSError).

    out = attnkit.sdpa(q, k, v, causal=True)
    weights = attnkit.load_safetensors("model.safetensors")
"""
from . import _attnkit
from ._attnkit import (KVCache, Rope, apply_rope, load_safetensors, merge_attention_states,
                       save_safetensors, sdpa)
from .moe import moe_from_config

__version__ = "0.1.0"

__all__ = [
    "__version__", "KVCache", "Rope", "apply_rope", "load_safetensors", "merge_attention_states",
    "moe_from_config", "save_safetensors", "sdpa",
]

# Classes and functions bound by the other areas (MLA, MoE) are public too.
for _name in dir(_attnkit):
    if not _name.startswith("_") and _name not in globals():
        globals()[_name] = getattr(_attnkit, _name)
        __all__.append(_name)
del _name
