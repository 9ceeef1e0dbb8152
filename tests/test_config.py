"""Reading Hugging Face Qwen2 configs in both spellings, and refusing the ones msinfer cannot run."""
import json

import pytest

from msinfer.config import PRESETS, ModelConfig, load_config
from msinfer.errors import MsinferError

BASE = {"model_type": "qwen2", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 176,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "eos_token_id": 7}


def write_config(tmp_path, raw):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return str(tmp_path)


def test_transformers_4_and_5_spellings_read_the_same():
    v4 = ModelConfig.from_dict(dict(BASE, rope_theta=1e6, torch_dtype="bfloat16"))
    v5 = ModelConfig.from_dict(dict(BASE, rope_parameters={"rope_type": "default",
                                                           "rope_theta": 1e6},
                                    dtype="bfloat16"))
    assert v4 == v5
    assert (v4.rope_theta, v4.torch_dtype) == (1e6, "bfloat16")


def test_derived_sizes_are_computed_once_in_the_config():
    config = ModelConfig.from_dict(BASE)
    assert (config.head_dim, config.kv_groups, config.q_size, config.kv_size) == (8, 4, 64, 16)
    explicit = ModelConfig.from_dict(dict(BASE, head_dim=16))
    assert explicit.q_size == 128  # a config's own head_dim wins over hidden / heads


def test_tied_checkpoint_has_no_lm_head_and_untied_one_does():
    tied = ModelConfig.from_dict(BASE).parameter_shapes()
    untied = ModelConfig.from_dict(dict(BASE, tie_word_embeddings=False)).parameter_shapes()
    assert "lm_head.weight" not in tied
    assert untied["lm_head.weight"] == (1000, 64)
    assert tied["model.layers.1.self_attn.k_proj.bias"] == (16,)
    assert len(untied) == len(tied) + 1 == 2 * 12 + 3


def test_published_qwen2_parameter_counts():
    counts = {name: config.num_parameters() for name, config in PRESETS.items()}
    assert counts == {"qwen2-0.5b": 494_032_768, "qwen2-1.5b": 1_543_714_304,
                      "qwen2-7b": 7_615_616_512, "qwen2-72b": 72_706_203_648}


def test_unknown_model_type_names_the_file(tmp_path):
    model_dir = write_config(tmp_path, dict(BASE, model_type="llama"))
    with pytest.raises(MsinferError, match=r"config.json: model_type 'llama' is not supported"):
        load_config(model_dir)


def test_missing_key_names_the_file_and_key(tmp_path):
    raw = dict(BASE)
    del raw["num_attention_heads"]
    with pytest.raises(MsinferError, match=r"config.json: missing required key\(s\): "
                                           r"num_attention_heads"):
        load_config(write_config(tmp_path, raw))


@pytest.mark.parametrize("change, message", [
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
    ({"hidden_size": 60}, "hidden_size=60 is not divisible by num_attention_heads=8"),
    ({"vocab_size": "big"}, "vocab_size must be a positive integer, got 'big'"),
    ({"rope_scaling": {"type": "yarn", "factor": 4}}, "rope scaling 'yarn' is not supported"),
])
def test_inconsistent_config_is_refused_with_the_values(tmp_path, change, message):
    with pytest.raises(MsinferError, match=message):
        load_config(write_config(tmp_path, dict(BASE, **change)))


def test_config_that_is_not_json_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(MsinferError, match="config.json: not valid JSON"):
        load_config(str(tmp_path))


def test_preset_names_load_without_files():
    assert load_config("qwen2-72b").num_layers == 80
    with pytest.raises(MsinferError, match="not a built-in model .*qwen2-0.5b"):
        load_config("qwen2-9000b")
