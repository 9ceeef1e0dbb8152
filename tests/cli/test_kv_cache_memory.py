"""--kv-cache-memory is parsed once (cli/args.py's argparse type over engine_config.parse_bytes):
plan, launch, generate and serve all get an int of bytes from 2147483648, 2GiB or 512MiB, and
LLM(kv_cache_memory="2GiB") reads the same strings."""
import json
import os

import pytest

from msinfer.cli.main import build_parser, main
from msinfer.config import load_config
from msinfer.errors import MsinferError
from msinfer.engine_config import EngineLimits, parse_bytes
from msinfer.tools.tiny_model import make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TP1 = os.path.join(ROOT, "strategies", "qwen2_tp1.yaml")
TP4 = os.path.join(ROOT, "strategies", "qwen2_tp4.yaml")
GiB = 2 ** 30


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("kv") / "model")
    make_tiny_model(path, layers=2, hidden=64, heads=8, kv_heads=2, vocab=512, max_position=256)
    return path


@pytest.mark.parametrize("text, expected", [
    ("2147483648", 2 * GiB), (2147483648, 2 * GiB), ("2GiB", 2 * GiB), ("2gib", 2 * GiB),
    ("512MiB", 512 * 2 ** 20), (" 64 KiB ", 65536), ("1.5GB", 1_500_000_000),
    ("0.5GiB", GiB // 2), ("1TiB", 2 ** 40), ("100B", 100), ("1e9", 10 ** 9),
    ("123456789012345678", 123456789012345678),  # exact: no float on the way
])
def test_parse_bytes_reads_plain_bytes_and_units(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text, needle", [
    ("lots", "expected bytes like"), ("2GiBs", "expected bytes like"), ("", "expected"),
    ("-1", "expected"), ("0", "at least one byte"), ("0.1", "at least one byte"),
    (True, "expected"),
])
def test_parse_bytes_refuses_with_the_option_name(text, needle):
    with pytest.raises(MsinferError, match=needle) as e:
        parse_bytes(text)
    assert "--kv-cache-memory" in str(e.value)


@pytest.mark.parametrize("command", [
    ["plan", "--model", "qwen2-0.5b", "--strategy", TP1, "--hardware", "cpu"],
    ["generate", "--model", "m", "--prompt", "hi"],
    ["serve", "--model", "m"],
])
@pytest.mark.parametrize("value", ["2147483648", "2GiB", "2048MiB"])
def test_every_command_gets_an_int_of_bytes(command, value):
    args = build_parser().parse_args(command + ["--kv-cache-memory", value])
    assert args.kv_cache_memory == 2 * GiB and type(args.kv_cache_memory) is int


def test_a_bad_value_is_a_one_line_error_before_anything_runs(capsys):
    for command in (["serve", "--model", "nowhere"], ["generate", "--model", "nowhere"],
                    ["plan", "--model", "qwen2-0.5b", "--strategy", TP1, "--hardware", "cpu"]):
        assert main(command + ["--kv-cache-memory", "2 gigs"]) == 2
        err = capsys.readouterr().err
        assert f"msinfer {command[0]}: error: --kv-cache-memory '2 gigs': expected bytes" in err
        assert "Traceback" not in err


def plan_json(capsys, *extra):
    code = main(["plan", "--model", "qwen2-0.5b", "--strategy", TP1, "--hardware", "cpu",
                 "--json", *extra])
    return code, json.loads(capsys.readouterr().out)


def test_plan_sizes_the_same_pool_from_bytes_or_units(capsys):
    _, by_bytes = plan_json(capsys, "--kv-cache-memory", "536870912")
    _, by_unit = plan_json(capsys, "--kv-cache-memory", "512MiB")
    assert by_bytes["devices"] == by_unit["devices"]
    assert 0.99 * 2 ** 29 < by_unit["devices"][0]["kv_cache_bytes"] <= 2 ** 29


def test_serve_passes_bytes_to_the_engine(model_dir, monkeypatch):
    """The bug: serve handed the raw string to EngineLimits, which refused '2GiB'."""
    import msinfer.api
    import msinfer.server.api_server

    seen = {}

    class Recorder:
        def __init__(self, engine_config):
            seen["kv_cache_memory"] = engine_config.limits.kv_cache_memory
            self.limits = engine_config.limits

    monkeypatch.setattr(msinfer.api, "LLM", Recorder)
    monkeypatch.setattr(msinfer.server.api_server, "serve", lambda llm, options: 0)
    assert main(["serve", "--model", model_dir, "--kv-cache-memory", "2GiB"]) == 0
    assert seen["kv_cache_memory"] == 2 * GiB


def test_launch_plans_with_the_parsed_value_and_refuses_a_bad_one(model_dir, capsys):
    code = main(["launch", "--nproc", "4", "--strategy", TP4, "--hardware", "cpu", "--dry-run",
                 "--", "serve", "--model", model_dir, "--kv-cache-memory", "64KiB"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "KV cache = " in err and "FITS" in err
    assert "--kv-cache-memory 64KiB" in out  # each rank parses it with the same type
    code = main(["launch", "--nproc", "4", "--strategy", TP4, "--hardware", "cpu", "--dry-run",
                 "--", "serve", "--model", model_dir, "--kv-cache-memory", "lots"])
    out, err = capsys.readouterr()
    assert code == 2 and "--kv-cache-memory 'lots'" in err and "mpirun" not in out


def test_engine_limits_and_llm_take_the_same_strings(model_dir, capfd):
    config = load_config(model_dir)
    assert EngineLimits.for_model(config, kv_cache_memory="2GiB").kv_cache_memory == 2 * GiB
    assert EngineLimits.for_model(config, kv_cache_memory=2 * GiB).kv_cache_memory == 2 * GiB
    with pytest.raises(MsinferError, match="kv_cache_memory 'much'"):
        EngineLimits.for_model(config, kv_cache_memory="much")
    pytest.importorskip("mindspore")
    from msinfer import LLM

    llm = LLM(model_dir, max_len=64, max_num_seqs=2, max_prefill_tokens=16,
              kv_cache_memory="64KiB")
    assert llm.limits.kv_cache_memory == 65536
    assert llm.memory.layout.total_bytes <= 65536
    err = capfd.readouterr().err
    assert "hardware cpu (detected (--hardware auto): no npu-smi on PATH" in err
