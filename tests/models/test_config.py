"""Reading Hugging Face Qwen2/Qwen2.5/Qwen3 configs in both spellings, and refusing the ones
msinfer cannot run."""
import dataclasses
import json
import re

import pytest

from msinfer.config import PRESETS, ModelConfig, RopeScaling, load_config
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


def test_published_parameter_counts():
    counts = {name: config.num_parameters() for name, config in PRESETS.items()
              if not name.endswith("-yarn") and config.quantization is None}
    assert counts == {"qwen2-0.5b": 494_032_768, "qwen2-1.5b": 1_543_714_304,
                      "qwen2-7b": 7_615_616_512, "qwen2-72b": 72_706_203_648,
                      # Qwen2.5 (same layout as Qwen2): 7B as Qwen2-7B, 72B as Qwen2-72B
                      "qwen2.5-7b": 7_615_616_512, "qwen2.5-14b": 14_770_033_664,
                      "qwen2.5-32b": 32_763_876_352, "qwen2.5-72b": 72_706_203_648,
                      # Qwen3: the model cards' 0.6B (0.44B without the tied embedding), 8.2B,
                      # 14.8B, 32.8B
                      "qwen3-0.6b": 596_049_920, "qwen3-8b": 8_190_735_360,
                      "qwen3-14b": 14_768_307_200, "qwen3-32b": 32_762_123_264,
                      # MoE: the model cards' 30.5B (3.3B activated) and 57B (14B activated)
                      "qwen3-30b-a3b": 30_532_122_624, "qwen2-57b-a14b": 57_408_658_944}
    assert 596_049_920 - 151936 * 1024 == 440_467_456
    active = {name: PRESETS[name].num_active_parameters()
              for name in ("qwen3-30b-a3b", "qwen2-57b-a14b", "qwen2-7b")}
    assert active == {"qwen3-30b-a3b": 3_353_032_704, "qwen2-57b-a14b": 14_249_270_784,
                      "qwen2-7b": 7_615_616_512}
    # A quantized preset (-w8a8, -w8a16) has its float model's parameters
    for name, config in PRESETS.items():
        if config.quantization is not None:
            assert config.num_parameters() == counts[name.rsplit("-", 1)[0]], name


def test_qwen3_presets_carry_head_dim_128_whatever_hidden_over_heads():
    for name, hidden_over_heads in (("qwen3-0.6b", 64), ("qwen3-8b", 128), ("qwen3-14b", 128),
                                    ("qwen3-32b", 80)):
        config = PRESETS[name]
        assert config.hidden_size // config.num_heads == hidden_over_heads
        assert (config.head_dim, config.num_kv_heads, config.max_context_len) == (128, 8, 40960)
        assert config.model_type == "qwen3" and not config.qkv_bias and config.qk_norm
    shapes = PRESETS["qwen3-0.6b"].parameter_shapes()
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (2048, 1024)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (1024, 2048)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (128,)
    assert "lm_head.weight" not in shapes and "model.layers.0.self_attn.q_proj.bias" not in shapes


def test_qwen25_presets_native_32k_and_yarn_131k():
    for size in ("7b", "14b", "32b", "72b"):
        native, yarn = PRESETS[f"qwen2.5-{size}"], PRESETS[f"qwen2.5-{size}-yarn"]
        assert native.max_context_len == 32768 and native.rope_scaling is None
        assert yarn.max_context_len == 131072
        assert yarn.rope_scaling == RopeScaling("yarn", 4.0, 32768)
        assert native.parameter_shapes() == yarn.parameter_shapes()


QWEN3 = dict(BASE, model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=32,
             attention_bias=False, tie_word_embeddings=False)


def test_qwen3_config_reads_head_dim_and_names_its_norms():
    config = ModelConfig.from_dict(QWEN3)
    assert (config.model_type, config.head_dim, config.q_size, config.kv_size) == (
        "qwen3", 32, 256, 64)
    shapes = config.parameter_shapes()
    assert shapes["model.layers.1.self_attn.k_norm.weight"] == (32,)
    assert shapes["model.layers.1.self_attn.o_proj.weight"] == (64, 256)
    assert not [n for n in shapes if n.endswith(".bias")]
    assert len(shapes) == 2 * 11 + 3  # 9 of Qwen2's 12 per layer (no biases), 2 norms


@pytest.mark.parametrize("change, message", [
    ({"attention_bias": True}, "config.json: attention_bias true is not supported for qwen3"),
    ({"use_sliding_window": True}, "config.json: use_sliding_window true is not supported"),
    ({"architectures": ["Qwen3MoeForCausalLM"]},
     r"config.json: architectures \['Qwen3MoeForCausalLM'\] is not supported for model_type "
     r"'qwen3' \(msinfer runs Qwen2ForCausalLM \(model_type qwen2\), Qwen3ForCausalLM"),
])
def test_qwen3_features_msinfer_does_not_run_are_refused_by_field(tmp_path, change, message):
    with pytest.raises(MsinferError, match=message):
        load_config(write_config(tmp_path, dict(QWEN3, **change)))


def test_yarn_in_both_spellings_reads_the_same():
    yarn = {"factor": 4.0, "original_max_position_embeddings": 128}
    v4 = ModelConfig.from_dict(dict(BASE, rope_theta=1e6, rope_scaling=dict(yarn, type="yarn")))
    v5 = ModelConfig.from_dict(dict(BASE, rope_parameters=dict(yarn, rope_type="yarn",
                                                               rope_theta=1e6)))
    assert v4 == v5
    assert v4.rope_scaling == RopeScaling("yarn", 4.0, 128)
    assert v4.max_position_embeddings == 512 and v4.max_context_len == 512  # max of both
    wide = ModelConfig.from_dict(dict(BASE, max_position_embeddings=32768,
                                      rope_scaling={"type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 32768}))
    assert wide.max_context_len == 131072  # Qwen2.5's README recipe


def test_yarn_defaults_are_transformers():
    """No original_max_position_embeddings: max_position_embeddings; no factor: their ratio;
    a top-level original_max_position_embeddings wins."""
    config = ModelConfig.from_dict(dict(BASE, rope_scaling={"type": "yarn", "factor": 2.0}))
    assert config.rope_scaling.original_max_position_embeddings == 512
    config = ModelConfig.from_dict(dict(BASE, rope_scaling={
        "rope_type": "yarn", "original_max_position_embeddings": 128}))
    assert config.rope_scaling.factor == 4.0
    config = ModelConfig.from_dict(dict(BASE, original_max_position_embeddings=64,
                                        rope_scaling={"type": "yarn", "factor": 2.0,
                                                      "original_max_position_embeddings": 128}))
    assert config.rope_scaling.original_max_position_embeddings == 64


def test_unknown_model_type_names_the_file(tmp_path):
    model_dir = write_config(tmp_path, dict(BASE, model_type="llama"))
    with pytest.raises(MsinferError, match=r"config.json: model_type 'llama' is not supported "
                                           r"\(msinfer runs Qwen2ForCausalLM \(model_type "
                                           r"qwen2\), Qwen3ForCausalLM \(model_type qwen3\), "
                                           r"Qwen2MoeForCausalLM \(model_type qwen2_moe\), "
                                           r"Qwen3MoeForCausalLM \(model_type qwen3_moe\)\)"):
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
    ({"rope_scaling": {"type": "linear", "factor": 4}},
     r"config.json: rope_scaling.type 'linear' is not supported \(msinfer runs rope types "
     r"default, yarn\)"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e6}},
     "config.json: rope_parameters.rope_type 'llama3' is not supported"),
    ({"rope_scaling": {"type": "yarn", "factor": 0.5}},
     "config.json: rope_scaling.factor must be a number of at least 1, got 0.5"),
    ({"architectures": ["Qwen2ForSequenceClassification"]},
     r"config.json: architectures \['Qwen2ForSequenceClassification'\] is not supported"),
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


# ---- EngineConfig: one builder of the engine's settings, vLLM's names and the older ones ----

def test_engine_config_takes_vllm_names_and_the_older_ones_alike(tmp_path):
    from msinfer.engine_config import engine_config

    model = write_config(tmp_path, BASE)
    new = engine_config(model, max_model_len=64, max_num_seqs=2, kv_cache_memory="64KiB")
    old = engine_config(model, max_len=64, max_num_seqs=2, kv_cache_memory=65536)
    assert new == old and new.max_model_len == new.limits.max_model_len == 64
    assert new.limits.kv_cache_memory == 65536 and new.limits.max_prefill_tokens == 64
    assert engine_config(model).max_model_len == min(BASE["max_position_embeddings"], 4096)
    assert engine_config(model, tensor_parallel_size=4).parallel.tensor_parallel_size == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        new.limits.max_num_seqs = 3


@pytest.mark.parametrize("settings,message", [
    (dict(max_len=64, max_model_len=128), "max_model_len 128 and its older name max_len 64"),
    (dict(max_model_lenn=64), "unknown engine setting 'max_model_lenn' (did you mean "
                              "'max_model_len'?)"),
    (dict(max_model_len=10 ** 6), "max_model_len 1000000 exceeds the model's"),
    (dict(max_num_seqs=0), "max_num_seqs must be a positive integer, got 0"),
    (dict(tensor_parallel_size=3), "tensor_parallel_size 3: a shipped strategy exists for 1, "
                                   "2, 4, 8"),
    (dict(tensor_parallel_size=True), "tensor_parallel_size must be a positive integer"),
    (dict(tensor_parallel_size=2, strategy="s.yaml"), "give a strategy file or "
                                                      "tensor_parallel_size 2, not both"),
    (dict(hardware="tpu"), "hardware 'tpu': one of auto"),
    (dict(graph_shapes="some"), "graph_shapes must be one of dynamic, static"),
])
def test_engine_config_refuses_bad_settings_by_name(tmp_path, settings, message):
    from msinfer.engine_config import engine_config

    with pytest.raises(MsinferError, match=re.escape(message)):
        engine_config(write_config(tmp_path, BASE), **settings)


def test_cli_flags_and_their_aliases_build_the_same_engine_config(tmp_path):
    """generate and serve build LLM from one EngineConfig.from_args; --max-len and vLLM's
    --max-model-len are one flag, --tensor-parallel-size / -tp one more."""
    from msinfer.cli.main import build_parser
    from msinfer.engine_config import EngineConfig

    model = write_config(tmp_path, BASE)
    parser = build_parser()
    configs = [EngineConfig.from_args(parser.parse_args([command, "--model", model, *flags]))
               for command in ("generate", "serve")
               for flags in (["--max-len", "96", "-tp", "2"],
                             ["--max-model-len", "96", "--tensor-parallel-size", "2"])]
    assert all(c == configs[0] for c in configs[:2]) and configs[0].max_model_len == 96
    assert configs[0].parallel.tensor_parallel_size == 2 and configs[0].compile_cache is None
    serve = EngineConfig.from_args(parser.parse_args(
        ["serve", "--model", model, "--no-compile-cache", "--no-prefix-caching"]))
    assert serve.compile_cache is False and serve.enable_prefix_caching is False


@pytest.mark.parametrize("tensor", [1, 2, 4, 8])
def test_tensor_parallel_size_is_the_shipped_strategy(tensor):
    """--tensor-parallel-size N runs Strategy.default(tensor=N): the same shard plan as
    strategies/qwen2_tpN.yaml, slice for slice."""
    import os

    from msinfer.parallel.strategy import Strategy, load_strategy

    config = load_config("qwen2-72b")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    shipped = load_strategy(os.path.join(root, "strategies", f"qwen2_tp{tensor}.yaml"))
    plans = [s.resolve(config, "explicit") for s in (shipped, Strategy.default(tensor=tensor))]
    for name in config.parameter_shapes():
        for rank in range(tensor):
            assert plans[0].slices(name, rank) == plans[1].slices(name, rank), (name, rank)
