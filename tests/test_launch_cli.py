"""`msinfer launch` decides before anything starts: the plan is checked on this machine, and
a plan that cannot run is refused without spawning a rank."""
import os

import pytest

from msinfer.cli import main
from msinfer.tiny_model import make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TP4 = os.path.join(ROOT, "strategies", "qwen2_tp4.yaml")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("m"))
    make_tiny_model(path, layers=1, hidden=64, heads=8, kv_heads=2, vocab=512)
    return path


def test_dry_run_prints_the_mpirun_command_after_the_plan(model_dir, capsys):
    code = main(["launch", "--nproc", "4", "--strategy", TP4, "--dry-run", "--",
                 "generate", "--model", model_dir, "--prompt", "hi"])
    out, err = capsys.readouterr()
    assert code == 0
    assert "FITS" in err  # the planner ran
    command = out.strip().split()
    assert command[command.index("-n") + 1] == "4"
    # every rank runs `python -m msinfer generate ...` with the launch's strategy and hardware
    rank_command = command[command.index("-m"):]
    assert rank_command == ["-m", "msinfer", "generate", "--model", model_dir, "--prompt", "hi",
                            "--strategy", TP4, "--hardware", "cpu"]


def test_a_plan_that_cannot_shard_the_model_is_refused_before_launch(tmp_path, capsys):
    make_tiny_model(str(tmp_path), layers=1, hidden=48, heads=6, kv_heads=2, vocab=512)
    code = main(["launch", "--nproc", "4", "--strategy", TP4, "--dry-run", "--",
                 "generate", "--model", str(tmp_path), "--prompt", "hi"])
    out, err = capsys.readouterr()
    assert code == 1
    assert "6 attention heads do not split into 4" in err
    assert "mpirun" not in out


def test_nproc_must_equal_the_strategy_world_size(model_dir, capsys):
    code = main(["launch", "--nproc", "2", "--strategy", TP4, "--dry-run", "--",
                 "generate", "--model", model_dir, "--prompt", "hi"])
    assert code == 2
    assert "--nproc 2 but" in capsys.readouterr().err


def test_msrun_launcher_runs_the_package_entry_point(model_dir, capsys):
    code = main(["launch", "--launcher", "msrun", "--nproc", "4", "--strategy", TP4,
                 "--dry-run", "--", "generate", "--model", model_dir, "--prompt", "hi"])
    out, _ = capsys.readouterr()
    assert code == 0
    assert "--worker_num=4" in out and os.path.join("msinfer", "__main__.py") in out
