import argparse
import filecmp
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tokenizers
from safetensors.numpy import load_file

from msinfer.config import PRESETS, ModelConfig
from msinfer.errors import MsinferError
from msinfer.cli.make_tiny_model import cli_arguments
from msinfer.cli.make_tiny_model import register as register_cli
from msinfer.tools.tiny_model import (SHAPE_PRESETS, default_intermediate, make_tiny_model,
                                      model_config_dict, to_bfloat16_bits, train_tokenizer)

SMALL = dict(layers=2, hidden=32, heads=4, kv_heads=2, vocab=300)
# Tests that only read a checkpoint take conftest's tiny_checkpoint(**arguments): one directory
# per distinct checkpoint a session. Those that test writing itself call make_tiny_model.


def read_json(path):
    with open(path) as f:
        return json.load(f)


def load_tensors(model_dir):
    """{name: array} over every safetensors file (float32 or float16: numpy has no bfloat16)."""
    tensors = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(model_dir, name)))
    return tensors


def parse_cli(argv):
    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers())
    return parser.parse_args(argv)


@pytest.mark.parametrize("style", ["4", "5"])
def test_config_reads_back_with_every_checkpoint_tensor(tiny_checkpoint, style):
    path, config = tiny_checkpoint(config_style=style, **SMALL)
    again = ModelConfig.from_model_dir(path)
    assert again.parameter_shapes() == config.parameter_shapes()
    assert (again.rope_theta, again.torch_dtype, again.intermediate_size) == (
        1000000.0, "float32", default_intermediate(32))
    shapes = {k: tuple(v.shape) for k, v in load_tensors(path).items()}
    assert shapes == config.parameter_shapes()


def test_config_styles_spell_rope_and_dtype_like_transformers_4_and_5(tiny_checkpoint):
    a, _ = tiny_checkpoint(config_style="4", dtype="bfloat16", **SMALL)
    b, _ = tiny_checkpoint(config_style="5", dtype="bfloat16", **SMALL)
    old, new = read_json(os.path.join(a, "config.json")), read_json(os.path.join(b, "config.json"))
    assert (old["rope_theta"], old["torch_dtype"]) == (1000000.0, "bfloat16")
    assert "rope_parameters" not in old and "dtype" not in old
    assert new["rope_parameters"] == {"rope_type": "default", "rope_theta": 1000000.0}
    assert new["dtype"] == "bfloat16" and "rope_theta" not in new and "torch_dtype" not in new
    assert old["architectures"] == new["architectures"] == ["Qwen2ForCausalLM"]


def test_default_intermediate_is_2_75_hidden_rounded_up_to_8():
    assert [default_intermediate(h) for h in (64, 896, 100)] == [176, 2464, 280]


def test_same_seed_gives_identical_files_and_another_seed_other_weights(tmp_path):
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        make_tiny_model(str(tmp_path / name), seed=seed, shards=2, **SMALL)
    files = sorted(os.listdir(tmp_path / "a"))
    assert filecmp.cmpfiles(tmp_path / "a", tmp_path / "b", files, shallow=False)[0] == files
    differ = filecmp.cmpfiles(tmp_path / "a", tmp_path / "c", files, shallow=False)[1]
    assert sorted(differ) == ["model-00001-of-00002.safetensors",
                              "model-00002-of-00002.safetensors"]


def test_shards_hold_the_same_tensors_as_one_file_and_index_them(tiny_checkpoint):
    one_dir, _ = tiny_checkpoint(**SMALL)
    three_dir, _ = tiny_checkpoint(shards=3, **SMALL)
    one, three = load_tensors(one_dir), load_tensors(three_dir)
    assert one.keys() == three.keys()
    assert all(np.array_equal(one[k], three[k]) for k in one)

    index = read_json(os.path.join(three_dir, "model.safetensors.index.json"))
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in three.values())
    files = [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert sorted(set(index["weight_map"].values())) == files
    for filename in files:
        names = load_file(os.path.join(three_dir, filename)).keys()
        assert names and all(index["weight_map"][n] == filename for n in names)
    assert not os.path.exists(os.path.join(one_dir, "model.safetensors.index.json"))


def test_bfloat16_file_holds_float32_weights_rounded_to_nearest_even(tiny_checkpoint):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file as load_torch

    full = load_torch(os.path.join(tiny_checkpoint(**SMALL)[0], "model.safetensors"))
    half = load_torch(os.path.join(tiny_checkpoint(dtype="bfloat16", **SMALL)[0],
                                   "model.safetensors"))
    for name, value in full.items():
        assert half[name].dtype == torch.bfloat16
        assert torch.equal(half[name], value.to(torch.bfloat16)), name


def test_bfloat16_rounding_handles_ties_and_carries():
    above_tie = np.nextafter(np.float32(1.00390625), np.float32(2))
    values = np.array([1.0, 1.00390625, 1.01171875, above_tie, -2.5, 3.3895314e38, 0.0],
                      dtype=np.float32)
    # 1 + 2^-8 is a tie (rounds to even 1.0); 1 + 3*2^-8 ties up to 1 + 2^-6; just above a tie
    # rounds up; the largest finite bf16 stays finite.
    expected = [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0xC020, 0x7F7F, 0x0000]
    assert to_bfloat16_bits(values).tolist() == expected


def test_float16_weights_are_the_float32_ones_rounded(tiny_checkpoint):
    full = load_tensors(tiny_checkpoint(**SMALL)[0])
    half = load_tensors(tiny_checkpoint(dtype="float16", **SMALL)[0])
    assert all(half[k].dtype == np.float16 and np.array_equal(half[k], full[k].astype(np.float16))
               for k in full)


def test_weights_are_spread_norms_near_one_biases_non_zero(tiny_checkpoint):
    tensors = load_tensors(tiny_checkpoint(**SMALL)[0])
    norm = tensors["model.layers.0.input_layernorm.weight"]
    assert abs(norm.mean() - 1.0) < 0.1 and norm.std() > 0.01
    assert np.abs(tensors["model.layers.1.self_attn.k_proj.bias"]).min() > 0
    assert tensors["model.layers.0.mlp.down_proj.weight"].std() > 0.02


def test_tied_model_has_no_lm_head(tiny_checkpoint):
    path, _ = tiny_checkpoint(tie=True, **SMALL)
    assert "lm_head.weight" not in load_tensors(path)
    assert read_json(os.path.join(path, "config.json"))["tie_word_embeddings"] is True


def test_tokenizer_fits_the_model_vocab_and_names_eos_tokens(tiny_checkpoint):
    path, _ = tiny_checkpoint(**SMALL)
    tok = tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    assert tok.get_vocab_size() == SMALL["vocab"]
    eot, start, end = (tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    assert {eot, start, end} == set(range(tok.get_vocab_size() - 3, tok.get_vocab_size()))
    generation = read_json(os.path.join(path, "generation_config.json"))
    assert generation["eos_token_id"] == [end, eot] and generation["bos_token_id"] == eot
    config = read_json(os.path.join(path, "config.json"))
    assert config["eos_token_id"] == config["bos_token_id"] == eot
    text = "The old man writes about the garden."
    assert tok.decode(tok.encode(text).ids) == text
    assert len(tok.encode(text).ids) < len(text) * 2 // 3  # trained merges, not bytes


def test_the_tokenizer_covers_a_large_vocabulary_and_every_id_decodes_to_text(tmp_path):
    """Issue 35: --vocab 3000 wrote a 504-token tokenizer, and ids above it decoded to "".
    The trained merges and the special tokens' ids stay what they were at 512 (the same
    encoding, the same eos ids); the rest are letter strings."""
    make_tiny_model(str(tmp_path / "m"), layers=1, hidden=8, heads=2, kv_heads=1, vocab=3000)
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "m" / "tokenizer.json"))
    assert tok.get_vocab_size() == 3000
    assert all(tok.decode([i], skip_special_tokens=False) for i in range(3000))
    text = "The old man writes about the garden."
    small = tokenizers.Tokenizer.from_str(train_tokenizer(512).to_str())
    assert tok.encode(text).ids == small.encode(text).ids
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert tok.token_to_id(special) == small.token_to_id(special) < 512


@pytest.mark.parametrize("kwargs, message", [
    (dict(hidden=30, heads=4), "hidden=30 is not divisible by heads=4"),
    (dict(hidden=12, heads=4), "head size hidden/heads=3 must be even"),
    (dict(heads=4, kv_heads=3), "heads=4 is not a multiple of kv_heads=3"),
    (dict(vocab=100), "vocab=100 must be at least 259"),
    (dict(dtype="int8"), "dtype='int8' must be one of"),
    (dict(layers=0), "layers=0 must be a positive integer"),
    (dict(config_style="6"), "config_style='6'"),
    (dict(layers=1, shards=99), "shards=99 is more than the checkpoint's 15 tensors"),
])
def test_bad_arguments_are_refused_before_writing(tmp_path, kwargs, message):
    with pytest.raises(MsinferError, match=message):
        make_tiny_model(str(tmp_path / "m"), **{**SMALL, **kwargs})
    assert not os.path.exists(tmp_path / "m")


def test_non_empty_directory_is_refused(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(MsinferError, match="is not empty"):
        make_tiny_model(str(tmp_path), **SMALL)


def test_preset_has_qwen2_0_5b_shape_without_generating_it():
    kwargs = cli_arguments(parse_cli(["make-tiny-model", "d", "--preset", "qwen2-0.5b-shape"]))
    assert kwargs == SHAPE_PRESETS["qwen2-0.5b-shape"]
    raw = model_config_dict(dtype="float32", config_style="4", bos_token_id=0, eos_token_id=0,
                            **kwargs)
    config = ModelConfig.from_dict(raw)
    assert config.parameter_shapes() == PRESETS["qwen2-0.5b"].parameter_shapes()
    assert config.max_position_embeddings == PRESETS["qwen2-0.5b"].max_position_embeddings


def test_cli_flags_override_the_preset_and_tie_can_be_switched_off():
    args = parse_cli(["make-tiny-model", "d", "--preset", "qwen2-0.5b-shape", "--layers", "2",
                      "--no-tie", "--dtype", "bfloat16", "--config-style", "5"])
    kwargs = cli_arguments(args)
    assert (kwargs["layers"], kwargs["tie"], kwargs["dtype"], kwargs["hidden"]) == (
        2, False, "bfloat16", 896)
    assert kwargs["config_style"] == "5"


def test_cli_progress_through_a_pipe_is_a_line_now_and_then_not_a_redraw(tmp_path):
    """`make-tiny-model | tail` or a CI log: whole lines, the last one saying it is done."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [sys.executable, "-m", "msinfer", "make-tiny-model", str(tmp_path / "m"), "--layers", "4",
         "--hidden", "16", "--heads", "2", "--kv-heads", "1", "--vocab", "300", "--tie",
         "--shards", "2"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=root))
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr and "wrote" in done.stdout
    progress = [line for line in done.stderr.splitlines() if "writing weights" in line]
    assert progress[-1].split("] ")[1].startswith("writing weights: 50/50, ")
    assert len(progress) < 50  # not one per tensor
    assert os.path.exists(tmp_path / "m" / "model-00002-of-00002.safetensors")


def test_progress_logs_every_few_seconds_and_the_last_step(monkeypatch):
    import logging
    import threading

    from msinfer import log
    clock = iter([0.0] + [0.5 * i for i in range(1, 101)])  # 100 steps over 50 s
    # `time` is every thread's: under xdist a thread an earlier test left in this worker (a
    # client's, an engine's) may read the clock and log too, so only this thread's count.
    this, real = threading.get_ident(), log.time.monotonic
    monkeypatch.setattr(log.time, "monotonic",
                        lambda: next(clock) if threading.get_ident() == this else real())
    records = []
    catch = logging.Handler()
    catch.emit = lambda record: record.thread == this and records.append(record)
    logger, level = log.get(), log.get().level
    logger.addHandler(catch)
    logger.setLevel("INFO")
    try:
        progress = log.Progress("writing", 100, every=10.0)
        for i in range(1, 101):
            progress.step(i)
    finally:
        logger.removeHandler(catch)
        logger.setLevel(level)
    lines = [r.getMessage() for r in records]
    assert [line.split(",")[0] for line in lines] == [
        "writing: 20/100", "writing: 40/100", "writing: 60/100", "writing: 80/100",
        "writing: 100/100"]


@pytest.mark.parametrize("style", ["4", "5"])
@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transformers_loads_it_and_runs_a_forward_pass(tiny_checkpoint, style, shards, dtype):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path, config = tiny_checkpoint(config_style=style, shards=shards, dtype=dtype,
                                   tie=shards == 2, **SMALL)
    model = transformers.Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32)
    rope = getattr(model.config, "rope_parameters", None) or vars(model.config)  # 5.x or 4.x
    assert rope["rope_theta"] == 1000000.0
    assert model.config.tie_word_embeddings is (shards == 2)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (2, 24, config.vocab_size)
    # Loaded weights are the file's, not a fresh init: compare one tensor.
    from safetensors.torch import load_file as load_torch
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    on_disk = {}
    for f in files:
        on_disk.update(load_torch(os.path.join(path, f)))
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight,
                       on_disk["model.layers.1.mlp.up_proj.weight"].float())
    # Clear greedy choices: the top two logits are rarely close.
    top2 = logits.topk(2, dim=-1).values
    gaps = (top2[..., 0] - top2[..., 1]).flatten()
    assert gaps.min() > 1e-4 and gaps.median() > 0.05


def test_family_qwen3_is_what_transformers_loads_as_qwen3_with_its_head_dim(tiny_checkpoint):
    """--family qwen3: Qwen3ForCausalLM takes every tensor (q/k norms, no q/k/v bias), with a
    head_dim apart from hidden / heads, and computes with the file's weights."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path, config = tiny_checkpoint(family="qwen3", head_dim=16, dtype="bfloat16", tie=True,
                                   **SMALL)
    raw = read_json(os.path.join(path, "config.json"))
    assert (raw["model_type"], raw["architectures"], raw["head_dim"], raw["attention_bias"]) == (
        "qwen3", ["Qwen3ForCausalLM"], 16, False)
    assert config.q_size == 4 * 16 != config.hidden_size
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    norm = model.model.layers[1].self_attn.k_norm.weight
    assert tuple(norm.shape) == (16,) and not torch.equal(norm, torch.ones(16))
    with torch.no_grad():
        logits = model(torch.arange(1, 20)[None]).logits
    assert logits.shape == (1, 19, config.vocab_size)


def test_qwen3_shape_preset_is_qwen3_0_6b_without_generating_it():
    kwargs = cli_arguments(parse_cli(["make-tiny-model", "d", "--preset", "qwen3-0.6b-shape"]))
    raw = model_config_dict(dtype="float32", config_style="4", bos_token_id=0, eos_token_id=0,
                            **kwargs)
    config = ModelConfig.from_dict(raw)
    assert config.parameter_shapes() == PRESETS["qwen3-0.6b"].parameter_shapes()
    assert config.max_position_embeddings == 40960
    args = parse_cli(["make-tiny-model", "d", "--family", "qwen3", "--head-dim", "32"])
    assert cli_arguments(args) == {"family": "qwen3", "head_dim": 32}


@pytest.mark.parametrize("kwargs, message", [
    (dict(family="llama"), "family='llama' must be one of qwen2, qwen3"),
    (dict(family="qwen3", head_dim=15), "head_dim=15 must be even"),
    (dict(hidden=30, heads=4), r"hidden=30 is not divisible by heads=4 \(or give head_dim\)"),
])
def test_bad_family_arguments_are_refused(tmp_path, kwargs, message):
    with pytest.raises(MsinferError, match=message):
        make_tiny_model(str(tmp_path / "m"), **{**SMALL, **kwargs})
