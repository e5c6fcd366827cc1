#!/usr/bin/env python3
"""Load time and forward time of attnkit.Model on a random checkpoint.

Writes a Llama checkpoint of random weights (config.json + model.safetensors,
bf16 or f32) into --dir unless it is there already, then times
Model.from_pretrained and Model.forward on [1, --tokens] prompts (median of
--repeats). Shapes: "tiny" (hidden 64, GQA 4/2, vocab 97) or "llama3-8b"
(Llama-3-8B's layers: hidden 4096, 32 heads, 8 kv heads, intermediate
14336, vocab 128256) with --layers layers. Prints one JSON object.

    /usr/bin/python3 scripts/model_bench.py --shape llama3-8b --layers 2 \\
        --dir /tmp/llama3_8b_2layers --tokens 128
"""
import argparse
import json
import os
import statistics
import struct
import time

import numpy as np
import torch

import attnkit

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=97),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256),
}


def write_checkpoint(path, shape, layers, dtype):
    c = dict(SHAPES[shape], model_type="llama", num_hidden_layers=layers, rms_norm_eps=1e-5,
             rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False)
    H, I, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = H // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,),
              "lm_head.weight": (V, H)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
                       p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
                       p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                       p + "mlp.down_proj.weight": (H, I)})
    gen = torch.Generator().manual_seed(0)
    header, offset = {}, 0
    for name, s in shapes.items():
        n = int(np.prod(s)) * (2 if dtype == "bf16" else 4)
        header[name] = {"dtype": "BF16" if dtype == "bf16" else "F32", "shape": list(s),
                        "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name, s in shapes.items():
            if len(s) == 1:
                t = torch.ones(s)
            else:
                t = torch.randn(s, generator=gen) / s[1] ** 0.5
            t = t.to(torch.bfloat16).view(torch.int16) if dtype == "bf16" else t
            f.write(t.numpy().tobytes())
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f)


def median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    ap.add_argument("--dir", default="/tmp/attnkit_model_bench")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    if not os.path.exists(os.path.join(a.dir, "config.json")):
        write_checkpoint(a.dir, a.shape, a.layers, a.dtype)
    load_s = median_time(lambda: attnkit.Model.from_pretrained(a.dir), a.repeats)
    model = attnkit.Model.from_pretrained(a.dir)
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, size=(1, a.tokens))
    model.forward(tokens[:, :1])  # warm-up: oneDNN's kernels are JIT-compiled on first use
    prefill_s = median_time(lambda: model.forward(tokens), a.repeats)
    one_s = median_time(lambda: model.forward(tokens[:, :1]), a.repeats)
    print(json.dumps({"shape": a.shape, "layers": a.layers, "dtype": a.dtype,
                      "weight_bytes": model.weight_bytes, "load_ms": round(load_s * 1e3, 3),
                      "tokens": a.tokens, "forward_ms": round(prefill_s * 1e3, 3),
                      "forward_tokens_per_s": round(a.tokens / prefill_s, 1),
                      "forward_1_token_ms": round(one_s * 1e3, 3),
                      "threads": os.environ.get("ATTNKIT_NUM_THREADS", "all cores")}))


if __name__ == "__main__":
    main()
