"""`msinfer generate` and the API from a user's side: output formats, sampling controls, and
bad input (a clear message naming the file or value, exit code 2, no traceback)."""
import json
import os

import pytest

from msinfer import LLM, SamplingParams
from msinfer.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

@pytest.fixture(scope="module")
def model_dir(small_checkpoint):
    return small_checkpoint  # conftest's: read only (copy_model before changing it)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, max_num_seqs=4, max_len=96)


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def copy_model(model_dir, tmp_path):
    import shutil
    target = tmp_path / "copy"
    shutil.copytree(model_dir, target)
    return target


def test_json_output_has_one_object_per_prompt(model_dir, capsys):
    code, out, err = run_cli(capsys, "generate", "--model", model_dir, "--prompt", "Hello there",
                             "--prompt-ids", "1,2,3", "--max-tokens", "5", "--max-len", "64",
                             "--ignore-eos", "--json")
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["prompt"] for line in lines] == ["Hello there", [1, 2, 3]]
    for line in lines:
        assert len(line["token_ids"]) == 5
        assert isinstance(line["text"], str)
    assert "loading weights" in err  # progress goes to stderr, results to stdout


def test_chat_prompt_renders_the_template(model_dir, llm, capsys):
    code, out, err = run_cli(capsys, "generate", "--model", model_dir, "--prompt", "hi",
                             "--chat", "--max-tokens", "3", "--max-len", "96", "--json")
    assert code == 0, err
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert "<|im_start|>user" in rendered
    expected = llm.generate([rendered], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert json.loads(out)["token_ids"] == expected.token_ids


def test_same_seed_same_output_and_another_seed_differs(llm):
    prompts = ["The cat sat", "on the mat and"]

    def sample(seed):
        params = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=seed,
                                ignore_eos=True)
        return [o.token_ids for o in llm.generate(prompts, params)]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_stop_string_ends_the_text_before_it(llm):
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    full = llm.generate(["A story"], greedy)[0]
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
    assert stop.strip(), "the random model's text should have content to stop at"
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,))
    stopped = llm.generate(["A story"], params)[0]
    assert stopped.finish_reason == "stop"
    assert stop not in stopped.text
    assert full.text.startswith(stopped.text)
    assert len(stopped.token_ids) < len(full.token_ids)


def test_stop_token_id_and_eos_end_generation(llm):
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    full = llm.generate([[10, 11, 12]], greedy)[0]
    third = full.token_ids[2]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                            stop_token_ids=(third,))
    out = llm.generate([[10, 11, 12]], params)[0]
    assert out.token_ids == full.token_ids[:full.token_ids.index(third) + 1]
    assert out.finish_reason == "stop"


def test_more_prompts_than_max_num_seqs_run_as_slots_free_up(llm):
    prompts = [[i + 1, i + 2] for i in range(6)]  # max_num_seqs is 4
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    together = [o.token_ids for o in llm.generate(prompts, greedy)]
    alone = [llm.generate([p], greedy)[0].token_ids for p in prompts]
    assert together == alone


@pytest.mark.parametrize("argv, message", [
    (["--prompt", ""], "empty"),
    (["--prompt-ids", "1,2,3", "--max-tokens", "70", "--max-len", "64"],
     "prompt of 3 tokens + max_tokens 70 = 73 exceeds the longest sequence, max_model_len 64"),
    (["--prompt", "hi", "--kv-cache-memory", "lots"], "--kv-cache-memory 'lots'"),
    (["--prompt", "hi", "--max-num-seqs", "0"], "max_num_seqs must be a positive integer"),
    (["--prompt", "hi", "--max-len", "100000"], "exceeds the model's max_position_embeddings"),
    (["--prompt-ids", "1,x"], "--prompt-ids '1,x'"),
    (["--prompt-ids", "99999"], "token id 99999 is outside the vocabulary"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature=-1.0"),
    (["--prompt", "hi", "--strategy", "strategies/qwen2_tp4.yaml"],
     "needs 4 processes but this one was started alone"),
])
def test_bad_request_is_refused_with_a_clear_message(model_dir, capsys, argv, message):
    argv = [os.path.join(ROOT, a) if a.startswith("strategies/") else a for a in argv]
    code, out, err = run_cli(capsys, "generate", "--model", model_dir, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_semi_auto_on_cpu_is_refused_by_the_plan_check_before_any_rank_starts(model_dir,
                                                                            capsys):
    tp4 = os.path.join(ROOT, "strategies", "qwen2_tp4.yaml")
    code, _, err = run_cli(capsys, "generate", "--model", model_dir, "--prompt", "hi",
                           "--strategy", tp4, "--parallel-mode", "semi_auto")
    assert code == 1  # refused by the planner, as `msinfer plan` refuses it
    assert "parallel mode semi_auto needs Ascend or GPU" in err
    assert "started alone" not in err  # refused before init_distributed looked for ranks


def test_a_kv_cache_smaller_than_one_max_len_sequence_is_refused_by_the_plan(model_dir,
                                                                            capsys):
    code, _, err = run_cli(capsys, "generate", "--model", model_dir, "--prompt-ids", "1,2",
                           "--max-len", "64", "--block-size", "4", "--kv-cache-memory", "8KiB")
    assert code == 1  # a legal request the memory cannot hold, as `msinfer plan` says
    assert ("kv_cache_memory 8192 bytes holds a KV cache of 12 tokens per rank, less than one "
            "sequence of max-model-len 64") in err
    code, _, err = run_cli(capsys, "generate", "--model", model_dir, "--prompt", "hi",
                           "--kv-cache-memory", "100")
    assert code == 1 and "holds a KV cache of 0 tokens" in err


def test_missing_config_json_names_the_file(tmp_path, capsys):
    code, _, err = run_cli(capsys, "generate", "--model", str(tmp_path), "--prompt", "hi")
    assert code == 2
    assert os.path.join(str(tmp_path), "config.json") in err and "not found" in err


def test_config_missing_a_key_names_it(model_dir, tmp_path, capsys):
    target = copy_model(model_dir, tmp_path)
    config = json.loads((target / "config.json").read_text())
    del config["hidden_size"]
    (target / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(capsys, "generate", "--model", str(target), "--prompt", "hi")
    assert code == 2
    assert "config.json: missing required key(s): hidden_size" in err


def test_truncated_safetensors_file_is_named(model_dir, tmp_path, capsys):
    target = copy_model(model_dir, tmp_path)
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    code, _, err = run_cli(capsys, "generate", "--model", str(target), "--prompt", "hi")
    assert code == 2
    assert str(weights) in err and "truncated" in err
    assert "Traceback" not in err


def test_tensor_of_the_wrong_shape_names_tensor_file_and_shapes(model_dir, tmp_path, capsys):
    target = copy_model(model_dir, tmp_path)
    config = json.loads((target / "config.json").read_text())
    config["intermediate_size"] += 8  # the file's MLP tensors no longer fit the config
    (target / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(capsys, "generate", "--model", str(target), "--prompt", "hi")
    assert code == 2
    inter = config["intermediate_size"]
    assert "model.layers.0.mlp.gate_proj.weight has shape" in err
    assert f"expected [{inter}, 64]" in err and str(target / "model.safetensors") in err


def test_missing_tokenizer_says_token_ids_still_work(model_dir, tmp_path, capsys):
    target = copy_model(model_dir, tmp_path)
    os.remove(target / "tokenizer.json")
    code, _, err = run_cli(capsys, "generate", "--model", str(target), "--prompt", "hi")
    assert code == 2 and "tokenizer.json" in err
    code, out, err = run_cli(capsys, "generate", "--model", str(target), "--prompt-ids", "4,5",
                             "--max-tokens", "3", "--max-len", "32", "--json")
    assert code == 0, err
    assert len(json.loads(out)["token_ids"]) <= 3
