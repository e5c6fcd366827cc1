"""attnkit.model_spec_from_config: the per-layer description of the
published configs in tests/data/configs, and its errors."""
import json
import os

import pytest

import attnkit

CONFIGS = os.path.join(os.path.dirname(__file__), os.pardir, "data", "configs")


def load(name):
    with open(os.path.join(CONFIGS, name), encoding="utf-8") as f:
        return json.load(f)


def test_gpt_oss_windows_sinks_and_experts():
    spec = attnkit.model_spec_from_config(load("gpt-oss-20b.json"))
    assert spec["model_type"] == "gpt_oss"
    assert spec["num_layers"] == len(spec["layers"]) == 24
    assert spec["quantization"]["quant_method"] == "mxfp4"
    for i, layer in enumerate(spec["layers"]):
        assert layer["kind"] == "attention"
        assert layer["window"] == (128 if i % 2 == 0 else 0)
        assert layer["chunk"] == 0
        assert layer["sinks"] is True
        assert layer["rope"]["theta"] == 150000.0
        assert layer["rope"]["scaling"] == "yarn"
        assert layer["ffn"] == {"kind": "moe", "hidden_act": "silu", "n_routed_experts": 32,
                                "num_experts_per_tok": 4, "moe_intermediate_size": 2880,
                                "n_shared_experts": 0}


def test_gemma3_wrapper_from_json_text_and_path():
    path = os.path.join(CONFIGS, "gemma-3-4b-it.json")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for config in (text, path):
        spec = attnkit.model_spec_from_config(config)
        assert spec["wrapper_model_type"] == "gemma3"
        assert spec["model_type"] == "gemma3_text"
        layers = spec["layers"]
        assert len(layers) == 34
        for i, layer in enumerate(layers):
            local = (i + 1) % 6 != 0
            assert layer["window"] == (1024 if local else 0)
            assert layer["rope"]["theta"] == (10000.0 if local else 1e6)
            assert layer["rope"]["scaling"] == ("default" if local else "linear")
            assert layer["qk_norm"] == "rms_one_plus"


def test_qwen3_next_linear_and_gated_layers():
    spec = attnkit.model_spec_from_config(load("Qwen3-Next-80B-A3B-Instruct.json"))
    kinds = [layer["kind"] for layer in spec["layers"]]
    assert kinds == (["linear_attention"] * 3 + ["attention"]) * 12
    full = spec["layers"][3]
    assert full["output_gate"] is True
    assert full["rope"]["rotary_dim"] == 64
    linear = spec["layers"][0]
    assert linear["rope"] is None
    assert linear["state_values"] == 32 * 128 * 128


def test_llama4_chunked_and_nope_layers():
    config = load("Llama-4-Scout-17B-16E.json")
    # Until Rope accepts llama3 scaling with equal band factors (Scout's), use
    # Llama 3.1's high_freq_factor; the layer rules do not depend on it.
    config["text_config"]["rope_scaling"]["high_freq_factor"] = 4.0
    spec = attnkit.model_spec_from_config(config)
    for i, layer in enumerate(spec["layers"]):
        rope = (i + 1) % 4 != 0
        assert layer["chunk"] == (8192 if rope else 0)
        assert (layer["rope"] is not None) == rope
        assert layer["temperature_tuning"] == (not rope)
        if rope:
            assert layer["rope"]["pairing"] == "interleaved"


def test_deepseek_v3_latent_layers_and_dense_prefix():
    spec = attnkit.model_spec_from_config(load("DeepSeek-V3.json"))
    assert {layer["kind"] for layer in spec["layers"]} == {"latent_attention"}
    assert [layer["ffn"]["kind"] for layer in spec["layers"][:4]] == ["dense"] * 3 + ["moe"]
    assert spec["layers"][0]["kv_lora_rank"] == 512


@pytest.mark.parametrize("patch, needle", [
    ({"layer_types": ["full_attention"]}, "layer_types has 1 entries"),
    ({"sliding_window": "128"}, "sliding_window = \"128\" must be an integer"),
    ({"hidden_size": 2880.5}, "hidden_size = 2880.5 must be an integer"),
])
def test_errors_name_the_field(patch, needle):
    config = load("gpt-oss-20b.json")
    config.update(patch)
    with pytest.raises(ValueError) as e:
        attnkit.model_spec_from_config(config)
    assert str(e.value).startswith("model_spec_from_config: ")
    assert needle in str(e.value)


def test_text_config_must_be_an_object():
    config = load("gemma-3-4b-it.json")
    config["text_config"] = [1]
    with pytest.raises(ValueError, match="text_config = \\[1\\] must be an object"):
        attnkit.model_spec_from_config(config)
    with pytest.raises(ValueError, match="must be a dict"):
        attnkit.model_spec_from_config(42)
    # An integral float is an integer.
    config = load("Meta-Llama-3-8B.json")
    config["hidden_size"] = 4096.0
    assert attnkit.model_spec_from_config(config)["hidden_size"] == 4096
