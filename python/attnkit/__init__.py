"""attnkit: attention variants of large language models (MHA, MQA, GQA, MLA) on the CPU."""
from ._attnkit import (KVCache, Rope, apply_rope, load_safetensors, merge_attention_states,
                       save_safetensors, sdpa)

__version__ = "0.1.0"

__all__ = ["__version__", "KVCache", "Rope", "apply_rope", "load_safetensors",
           "merge_attention_states", "save_safetensors", "sdpa"]
