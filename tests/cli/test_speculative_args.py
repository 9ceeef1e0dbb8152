"""--speculative-config (vLLM's flag) on plan, generate, serve and through `msinfer launch`,
and LLM(speculative_config=...): parsed once (SpeculativeConfig.parse, the argparse type), a
bad value a one-line error naming the key before anything runs, the JSON word intact on the
ranks' command line."""
import json
import os
import shlex
import subprocess

import pytest

from msinfer.cli.main import build_parser, main
from msinfer.engine_config import engine_config
from msinfer.errors import MsinferError
from msinfer.speculative_config import SpeculativeConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TP1 = os.path.join(ROOT, "strategies", "qwen2_tp1.yaml")
TP4 = os.path.join(ROOT, "strategies", "qwen2_tp4.yaml")
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'
PLAN = ["plan", "--model", "qwen2-0.5b", "--strategy", TP1, "--hardware", "cpu"]
COMMANDS = (PLAN, ["generate", "--model", "m", "--prompt", "hi"], ["serve", "--model", "m"])


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    """8 query heads over 2 KV heads, as test_launch_cli's (made once a session)."""
    return tiny_checkpoint(layers=2, hidden=64, heads=8, kv_heads=2, vocab=384, seed=1)[0]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_gets_the_parsed_config(command):
    args = build_parser().parse_args(command + ["--speculative-config", NGRAM])
    assert args.speculative_config == SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, prompt_lookup_max=2)
    assert build_parser().parse_args(command).speculative_config is None
    # vLLM's spelling of the method is taken, stored as ours
    args = build_parser().parse_args(command + ["--speculative-config=" + json.dumps(
        {"method": "draft", "model": "/d"})])
    assert args.speculative_config.method == "draft_model"


@pytest.mark.parametrize("value, message", [
    ('{"method": "ngram", "num_spec_tokens": 4}',
     "unknown key 'num_spec_tokens' (did you mean 'num_speculative_tokens'?)"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens 0 must be"),
    ('{"method": "eagle"}', "method 'eagle': one of ngram, suffix, draft_model"),
    ('{"method": "draft_model"}', 'method "draft_model" needs "model"'),
    ('{"num_speculative_tokens": 4}', '"method" is required'),
    ("{method: ngram}", "not JSON"),
    ('["ngram"]', "expected a JSON object, got list"),
])
def test_a_bad_value_is_a_one_line_error_naming_the_key(value, message, capsys):
    for command in COMMANDS:
        assert main(command + ["--speculative-config", value]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"msinfer {command[0]}: error: --speculative-config: ")
        assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_plan_says_what_speculation_does(capsys):
    assert main(PLAN + ["--speculative-config", NGRAM]) == 0
    out = capsys.readouterr().out
    assert "  speculate  ngram: up to 3 tokens proposed per sequence and step" in out
    assert "one forward of 4 positions" in " ".join(out.split())
    assert main(PLAN + ["--json", "--speculative-config", NGRAM]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["speculative"]["method"] == "ngram"
    assert report["speculative"]["num_speculative_tokens"] == 3
    assert main(PLAN) == 0
    assert "speculate" not in capsys.readouterr().out


@pytest.mark.parametrize("launcher", ["mpirun", "msrun"])
def test_launch_forwards_the_json_as_one_word_and_plans_with_it(model_dir, launcher, capsys):
    code = main(["launch", "--launcher", launcher, "--nproc", "4", "--strategy", TP4,
                 "--hardware", "cpu", "--dry-run", "--", "serve", "--model", model_dir,
                 "--speculative-config", NGRAM])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "speculate  ngram" in err  # the plan launch checked
    words = shlex.split(out.splitlines()[0])
    assert words[words.index("--speculative-config") + 1] == NGRAM


def test_semi_auto_with_speculation_is_refused_by_the_plan_and_before_launch(model_dir,
                                                                             capsys):
    semi_auto = ["--hardware", "atlas-300i-duo", "--parallel-mode", "semi_auto"]
    assert main(["plan", "--model", "qwen2-0.5b", "-tp", "2", *semi_auto]) == 0
    assert main(["plan", "--model", "qwen2-0.5b", "-tp", "2", *semi_auto,
                 "--speculative-config", NGRAM]) == 1
    assert "speculative decoding runs in parallel_mode explicit only" in capsys.readouterr().out
    code = main(["launch", "--nproc", "4", "--strategy", TP4, "--dry-run", "--", "serve",
                 "--model", model_dir, *semi_auto, "--speculative-config", NGRAM])
    out, err = capsys.readouterr()
    assert code == 1 and "mpirun" not in out
    assert "speculative decoding runs in parallel_mode explicit only" in err


def test_launch_refuses_a_bad_value_before_any_rank_starts(model_dir, capsys):
    code = main(["launch", "--nproc", "4", "--strategy", TP4, "--hardware", "cpu",
                 "--dry-run", "--", "generate", "--model", model_dir, "--prompt", "hi",
                 "--speculative-config", '{"method": "ngram", "lookup": 3}'])
    out, err = capsys.readouterr()
    assert code == 2 and "mpirun" not in out
    assert "msinfer launch: error: --speculative-config: unknown key 'lookup'" in err


@pytest.mark.multirank
def test_the_json_reaches_every_rank_intact_under_mpirun(model_dir, tmp_path, capsys):
    """The command launch builds, run by mpirun for real with the rank's program swapped for
    one that writes down its arguments: quotes, spaces and braces arrive as they were given."""
    from msinfer.cli import launch

    built = {}

    def run(command, timeout, env, grace=None):
        built["command"] = command
        return 0
    original = launch._run
    try:
        launch._run = run
        assert main(["launch", "--nproc", "4", "--strategy", TP4, "--hardware", "cpu", "--",
                     "serve", "--model", model_dir, "--speculative-config", NGRAM]) == 0
    finally:
        launch._run = original
    capsys.readouterr()
    command = built["command"]
    at = command.index("-m")
    write_argv = ("import json, os, sys; open(os.path.join(sys.argv[1], "
                  "os.environ['OMPI_COMM_WORLD_RANK']), 'w').write(json.dumps(sys.argv[2:]))")
    done = subprocess.run(command[:at] + ["-c", write_argv, str(tmp_path)] + command[at + 2:],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(tmp_path)) == ["0", "1", "2", "3"]
    for rank in range(4):
        argv = json.loads((tmp_path / str(rank)).read_text())
        assert argv[argv.index("--speculative-config") + 1] == NGRAM
        assert build_parser().parse_args(argv).speculative_config.num_speculative_tokens == 3


def test_serve_and_generate_give_the_engine_the_config(model_dir, monkeypatch):
    import msinfer.api
    import msinfer.server.api_server

    seen = []

    class Recorder:
        def __init__(self, engine_config):
            seen.append(engine_config.speculative)
            raise MsinferError("recorded")  # generate stops here

    monkeypatch.setattr(msinfer.api, "LLM", Recorder)
    monkeypatch.setattr(msinfer.server.api_server, "serve", lambda llm, options: 0)
    main(["serve", "--model", model_dir, "--speculative-config", NGRAM])
    main(["generate", "--model", model_dir, "--prompt", "hi", "--speculative-config", NGRAM])
    assert seen == [SpeculativeConfig.parse(NGRAM)] * 2


def test_llm_takes_speculative_config_and_hands_it_to_the_engine(small_checkpoint):
    settings = {"method": "suffix", "num_speculative_tokens": 5}
    assert engine_config(small_checkpoint, speculative_config=settings).speculative == \
        SpeculativeConfig(method="suffix", num_speculative_tokens=5)
    assert engine_config(small_checkpoint, speculative_config=json.dumps(settings)) == \
        engine_config(small_checkpoint, speculative_config=settings)
    assert engine_config(small_checkpoint).speculative is None
    pytest.importorskip("mindspore")
    from msinfer import LLM

    with pytest.raises(MsinferError, match="unknown key 'k'"):  # before anything loads
        LLM(small_checkpoint, speculative_config={"method": "ngram", "k": 2})
    llm = LLM(small_checkpoint, max_model_len=64, max_num_seqs=2, max_prefill_tokens=16,
              kv_cache_memory="64KiB", speculative_config=settings)
    assert llm.engine.config.speculative == llm.engine_config.speculative == \
        SpeculativeConfig.parse(settings)
    assert llm.engine.speculation.config == llm.engine_config.speculative
