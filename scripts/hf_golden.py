#!/usr/bin/python3
"""Logits from Hugging Face transformers itself, kept as test data, so that
attnkit.Model is held to the authors' code and not only to the float64
decoders that tests/python/test_model.py writes from reading it.

Two steps, on two machines:

    # 1. here (numpy, the built module): tiny random checkpoints, one per
    #    family of tests/python/test_model.py, in Hugging Face's own file
    #    format, and the token ids to run
    PYTHONPATH=build/python /usr/bin/python3 scripts/hf_golden.py write tests/data/hf_golden

    # 2. wherever a recent transformers is installed (no attnkit needed):
    #    each checkpoint loaded by transformers' Auto classes in float64 with
    #    eager attention, its logits saved beside it, and what transformers
    #    reported while loading (missing / unexpected tensors) in manifest.json
    python3 scripts/hf_golden.py logits tests/data/hf_golden

tests/python/test_hf_golden.py then loads each checkpoint with attnkit and
compares. A checkpoint that transformers loads with a missing or unexpected
text tensor fails that test: our names would then not be Hugging Face's.
"""
import json
import os
import sys

import numpy as np

TOKENS_SHAPE = (2, 11)


def write(out):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))
    import test_model as tm  # the families, their random weights and the writer

    families = dict(tm.FAMILIES)
    del families["llama_tied"]  # qwen2, gemma2 and gemma3 tie their embeddings too
    # Not yet run through transformers: deepseek_v32, whose definition is
    # DeepSeek's own inference code (test_model.py's reference follows it).
    families.pop("deepseek_v32", None)
    # transformers' GptOssExperts clamps at a fixed 7.0 whatever the config's
    # swiglu_limit says (checked with transformers 5.17.0: our float64
    # reference agrees with its logits to 1e-7 at 7.0, not at 1.0); OpenAI's
    # reference code and attnkit read the field. The published checkpoints
    # say 7.0, where both agree, so the checkpoint here says 7.0 too.
    families["gpt_oss"] = dict(families["gpt_oss"], swiglu_limit=7.0)
    os.makedirs(out, exist_ok=True)
    for name, c in sorted(families.items()):
        weights = tm.random_weights(c, seed=100 + len(name))
        d = os.path.join(out, name)
        tm.write_checkpoint(d, c, weights)
        tokens = np.random.default_rng(len(name)).integers(0, c["vocab_size"], TOKENS_SHAPE)
        np.save(os.path.join(d, "tokens.npy"), tokens.astype(np.int64))
    # Gemma 3's multimodal wrapper (Gemma3ForConditionalGeneration): the text
    # model's tensors under model.language_model. (transformers >= 4.52's
    # names), a tiny SigLIP tower in the config that transformers initialises
    # itself and that text-only logits never read.
    g = families["gemma3_text"]
    weights = tm.random_weights(g, seed=131)
    wrapped = {n.replace("model.", "model.language_model.", 1): w for n, w in weights.items()}
    wrapper = {"model_type": "gemma3", "text_config": dict(g), "mm_tokens_per_image": 4,
               "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32,
                                 "intermediate_size": 32, "num_hidden_layers": 1,
                                 "num_attention_heads": 2, "image_size": 28,
                                 "patch_size": 14}}
    d = os.path.join(out, "gemma3_wrapper")
    tm.write_checkpoint(d, wrapper, wrapped)
    tokens = np.random.default_rng(31).integers(0, g["vocab_size"], TOKENS_SHAPE)
    np.save(os.path.join(d, "tokens.npy"), tokens.astype(np.int64))


def load_hf(d, dtype, experts_eager):
    """The checkpoint in d as transformers builds it, in dtype, eager attention
    (and eager experts: transformers 5's grouped matrix products take no
    float64)."""
    import torch
    import transformers

    cfg = json.load(open(os.path.join(d, "config.json")))
    auto = (transformers.AutoModelForImageTextToText if "text_config" in cfg else
            transformers.AutoModelForCausalLM)
    torch.manual_seed(0)  # the vision towers transformers initialises
    kwargs = {"attn_implementation": "eager", "output_loading_info": True}
    if experts_eager:
        kwargs["experts_implementation"] = "eager"
    try:
        return auto.from_pretrained(d, dtype=dtype, **kwargs)
    except TypeError:  # transformers < 4.56 names it torch_dtype
        return auto.from_pretrained(d, torch_dtype=dtype, **kwargs)


def run_hf(d, tokens):
    """Logits in float64 where transformers computes in float64, else in
    float32 (its rounding, 1e-7 relative, is far below the tests' 1e-4)."""
    import torch

    errors = []
    for dtype, experts_eager in ((torch.float64, True), (torch.float64, False),
                                 (torch.float32, False)):
        try:
            model, info = load_hf(d, dtype, experts_eager)
            model.eval()
            with torch.no_grad():
                out = model(input_ids=tokens).logits
            return model, info, out, str(dtype).replace("torch.", ""), errors
        except Exception as e:  # the next form; each failure is recorded
            errors.append("%s experts_eager=%s: %s" % (dtype, experts_eager, e))
    raise RuntimeError("\n".join(errors))


def logits(out):
    import torch
    import transformers

    manifest = {"transformers": transformers.__version__, "torch": torch.__version__,
                "families": {}}
    for name in sorted(os.listdir(out)):
        d = os.path.join(out, name)
        if not os.path.isfile(os.path.join(d, "config.json")):
            continue
        entry = manifest["families"].setdefault(name, {})
        try:
            tokens = torch.from_numpy(np.load(os.path.join(d, "tokens.npy")))
            model, info, got, dtype, tried = run_hf(d, tokens)
            np.save(os.path.join(d, "logits.npy"), got.to(torch.float64).numpy())
            entry.update({"class": type(model).__name__, "dtype": dtype, "failed_forms": tried,
                          "missing": sorted(info.get("missing_keys", [])),
                          "unexpected": sorted(info.get("unexpected_keys", [])),
                          "mismatched": sorted(str(m) for m in info.get("mismatched_keys", []))})
        except Exception as e:  # recorded: the test then names the family
            import traceback
            entry["error"] = "".join(traceback.format_exception(e))[-4000:]
        print(name, {k: (v if k != "missing" else len(v)) for k, v in entry.items()
                     if k != "error"}, "ERROR" if "error" in entry else "", flush=True)
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("write", "logits"):
        sys.exit(__doc__)
    {"write": write, "logits": logits}[sys.argv[1]](sys.argv[2])
