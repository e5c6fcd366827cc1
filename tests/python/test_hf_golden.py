"""attnkit.Model against Hugging Face transformers' own modeling code.

tests/data/hf_golden/<family>/ holds a tiny random checkpoint in Hugging
Face's file format (config.json, model.safetensors), the token ids to run
and the logits transformers computed for them (logits.npy). manifest.json
says which transformers and torch computed them, with which class and
dtype, and what transformers reported while loading: a text tensor it
missed or did not expect would mean our checkpoint names are not its own.
scripts/hf_golden.py writes the checkpoints and computes the logits
(transformers is not needed here); see its docstring to add a family.

test_model.py checks the same families against float64 decoders written
from reading transformers; this file checks that reading against the code
itself, run in float64 with eager attention and eager experts.
"""
import json
import os

import numpy as np
import pytest

import attnkit

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "hf_golden")
MANIFEST = json.load(open(os.path.join(DATA, "manifest.json")))
FAMILIES = sorted(MANIFEST["families"])

# Tensors a multimodal wrapper's checkpoint here leaves out on purpose: the
# vision tower and projector, which transformers initialises itself and
# text-only logits never read.
VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.")


def test_manifest_covers_every_checkpoint():
    dirs = sorted(d for d in os.listdir(DATA) if os.path.isdir(os.path.join(DATA, d)))
    assert dirs == FAMILIES
    assert MANIFEST["transformers"] and MANIFEST["torch"]


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_loaded_our_checkpoint_as_written(family):
    entry = MANIFEST["families"][family]
    assert "error" not in entry, entry.get("error")
    assert entry["dtype"] == "float64"
    assert entry["unexpected"] == [] and entry["mismatched"] == []
    assert [m for m in entry["missing"] if not m.startswith(VISION_PREFIXES)] == []


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers(family):
    d = os.path.join(DATA, family)
    tokens = np.load(os.path.join(d, "tokens.npy"))
    want = np.load(os.path.join(d, "logits.npy"))
    model = attnkit.Model.from_pretrained(d)
    got = model.forward(tokens)
    assert got.shape == want.shape
    # The issue's criterion: within 1e-4 of the logits' largest magnitude.
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= 1e-4, f"{family}: max error {err:.2e} of max |logit| (transformers " \
                        f"{MANIFEST['transformers']}, {MANIFEST['families'][family]['class']})"
