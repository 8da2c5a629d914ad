"""ModelConfig parsing: families, rope variants, EOS ids, and clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from model_svc.config import ModelConfig, RopeScaling
from model_svc.layers import _inv_freq
from model_svc.loader import BUNDLED_MODEL_DIR
from tests.model.tiny_models import tiny_hf_config

transformers = pytest.importorskip("transformers")


def test_bundled_stories_config():
    config = ModelConfig.from_pretrained(BUNDLED_MODEL_DIR)
    assert config.family == "llama" and config.architecture == "LlamaForCausalLM"
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (512, 64, 5)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 4, 8)
    assert config.tie_word_embeddings and not config.attention_bias and not config.qk_norm
    assert config.rope_theta == 10000.0 and config.rope_scaling == RopeScaling()
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1
    assert config.torch_dtype == torch.float32 and config.rms_norm_eps == 1e-5


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_families_from_hf_config(family):
    config = ModelConfig.from_hf_config(tiny_hf_config(family, rope_theta=5000.0))
    assert config.family == family and config.head_dim == 64 and config.num_key_value_heads == 2
    assert config.rope_theta == 5000.0
    assert config.attention_bias == (family == "qwen2") and not config.o_proj_bias
    assert config.qk_norm == (family == "qwen3")


def test_dict_and_object_agree():
    hf_config = tiny_hf_config("qwen3")
    assert ModelConfig.from_hf_config(hf_config) == ModelConfig.from_hf_config(hf_config.to_dict())


def test_transformers4_style_dict():
    """4.x configs: rope_theta at top level, scaling in rope_scaling (maybe under 'type')."""
    raw = tiny_hf_config("llama").to_dict()
    raw.pop("rope_parameters", None)
    raw.update(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 4.0}, torch_dtype="bfloat16")
    raw.pop("dtype", None)
    config = ModelConfig.from_hf_config(raw)
    assert config.rope_theta == 500000.0 and config.rope_scaling.rope_type == "linear"
    assert config.rope_scaling.factor == 4.0 and config.torch_dtype == torch.bfloat16


def test_eos_ids_merge_generation_config(tmp_path):
    raw = tiny_hf_config("llama").to_dict()
    raw["eos_token_id"] = 2
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == (2, 7)


@pytest.mark.parametrize(
    "scaling",
    [
        dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=256,
        ),
        dict(rope_type="linear", factor=2.0),
    ],
)
def test_rope_inv_freq_matches_transformers(scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = tiny_hf_config("llama", rope_scaling=scaling)
    config = ModelConfig.from_hf_config(hf_config)
    assert config.rope_scaling.rope_type == scaling["rope_type"]
    expected, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config, "cpu")
    torch.testing.assert_close(_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling), expected)


def test_to_hf_dict_round_trip():
    for family in ("llama", "qwen2", "qwen3", "mistral"):
        config = ModelConfig.from_hf_config(tiny_hf_config(family))
        assert ModelConfig.from_hf_config(config.to_hf_dict()) == config
        cls = type(tiny_hf_config(family))
        assert ModelConfig.from_hf_config(cls(**config.to_hf_dict())) == config


def test_unknown_family_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        ModelConfig.from_hf_config(transformers.GPT2Config())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "my_new_arch"}))
    with pytest.raises(ValueError, match="my_new_arch"):
        ModelConfig.from_pretrained(tmp_path)


def test_unsupported_rope_type():
    raw = tiny_hf_config("llama").to_dict()
    raw["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0}
    with pytest.raises(ValueError, match="unsupported rope_type 'yarn'"):
        ModelConfig.from_hf_config(raw)


def test_sliding_windows_as_transformers_decides_them():
    """Mistral slides every layer; Qwen2/Qwen3 only with use_sliding_window, the layers from
    max_window_layers on or those layer_types names; Llama never. Round trips keep them."""
    cases = [
        (tiny_hf_config("mistral", sliding_window=256), (256, 256)),
        (tiny_hf_config("mistral", sliding_window=None), ()),
        (tiny_hf_config("qwen2", use_sliding_window=True, sliding_window=256, max_window_layers=0), (256, 256)),
        (tiny_hf_config("qwen3", use_sliding_window=True, sliding_window=64, max_window_layers=1), (0, 64)),
        (tiny_hf_config("qwen3", use_sliding_window=True, sliding_window=64, max_window_layers=2), ()),
        (tiny_hf_config("qwen2", use_sliding_window=False, sliding_window=256, max_window_layers=0), ()),
        (
            tiny_hf_config(
                "qwen3", use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention", "full_attention"]
            ),
            (8, 0),
        ),
    ]
    for hf_config, windows in cases:
        for source in (hf_config, hf_config.to_dict()):  # the transformers object and a plain dict
            config = ModelConfig.from_hf_config(source)
            assert config.layer_windows == windows, (hf_config.model_type, source)
            assert [config.layer_window(i) for i in range(2)] == list(windows or (0, 0))
            assert ModelConfig.from_hf_config(config.to_hf_dict()) == config
            assert ModelConfig.from_hf_config(type(hf_config)(**config.to_hf_dict())) == config


def test_bad_sliding_settings():
    raw = tiny_hf_config("qwen3").to_dict()
    raw.update(layer_types=["sliding_attention", "full_attention"], use_sliding_window=False)
    with pytest.raises(ValueError, match="no sliding window|use_sliding_window"):
        ModelConfig.from_hf_config(raw)
    raw.update(layer_types=["sliding_attention"], use_sliding_window=True, sliding_window=8)
    with pytest.raises(ValueError, match="each of the 2 layers"):
        ModelConfig.from_hf_config(raw)
    with pytest.raises(ValueError, match="at least 1"):
        ModelConfig.from_hf_config({**tiny_hf_config("mistral").to_dict(), "sliding_window": 0})


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        ModelConfig.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_config_json_reads_as_its_config_class_does(family, tmp_path):
    """Written by save_pretrained (which leaves out values equal to the base defaults) or in
    full: from_pretrained gives what transformers' own config class gives."""
    hf_config = tiny_hf_config(family)
    full, saved = tmp_path / "full", tmp_path / "saved"
    full.mkdir()
    (full / "config.json").write_text(json.dumps(hf_config.to_dict()))
    hf_config.save_pretrained(saved)
    for directory in (full, saved):
        expected = ModelConfig.from_hf_config(transformers.AutoConfig.from_pretrained(directory))
        assert ModelConfig.from_pretrained(directory) == expected, directory.name


def test_a_key_left_to_the_family_default_comes_from_transformers(tmp_path):
    raw = tiny_hf_config("qwen3").to_dict()
    del raw["head_dim"]  # Qwen3Config's default is 128, not hidden_size / heads
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert ModelConfig.from_pretrained(tmp_path).head_dim == transformers.Qwen3Config().head_dim == 128


def test_a_complete_config_json_does_not_import_transformers():
    """transformers' import takes seconds of every start-up (bench/results/startup_h200.md)."""
    import subprocess
    import sys

    code = (
        "import sys; from model_svc.config import ModelConfig; from model_svc.loader import BUNDLED_MODEL_DIR; "
        "ModelConfig.from_pretrained(BUNDLED_MODEL_DIR); print('transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"
