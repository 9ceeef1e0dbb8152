"""`--hardware auto`, the default of serve, generate, launch, doctor and commtest (plan takes it
but still asks for --hardware): the profile of the Ascend chips `npu-smi info` lists, else cpu,
and the choice shown with the plan. A fake `npu-smi` first on PATH prints the real-format
outputs of tests/fixtures/npu_smi (as tests/tools/test_doctor.py does)."""
import json
import os
import stat

import pytest

from msinfer import hardware
from msinfer.cli.main import build_parser, main
from msinfer.errors import MsinferError
from msinfer.tools.tiny_model import make_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "npu_smi")
TP4 = os.path.join(ROOT, "strategies", "qwen2_tp4.yaml")
TP8 = os.path.join(ROOT, "strategies", "qwen2_tp8.yaml")

with open(os.path.join(FIXTURES, "a2_2chips.txt")) as f:
    A2_TABLE = f.read()  # an Atlas 800I A2 (910B2) box


@pytest.fixture
def npu_smi(tmp_path, monkeypatch):
    """npu_smi(text=None, fixture=None, exit_code=0): an `npu-smi` on an otherwise empty PATH
    (plus the interpreter's directory) printing that; npu_smi(None) leaves no npu-smi."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for key in ("RANK_TABLE_FILE", "MSINFER_RANK_TABLE", "ASCEND_RT_VISIBLE_DEVICES"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin")

    def use(fixture=None, text=None, exit_code=0):
        script = bin_dir / "npu-smi"
        if fixture is None and text is None:
            if script.exists():
                script.unlink()
            return
        source = os.path.join(FIXTURES, fixture) if fixture else str(tmp_path / "table.txt")
        if text is not None:
            (tmp_path / "table.txt").write_text(text)
        script.write_text(f'#!/bin/sh\n[ "$1" = info ] || exit 2\ncat "{source}"\n'
                          f'exit {exit_code}\n')
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return use


def test_no_npu_smi_is_cpu(npu_smi):
    npu_smi(None)
    name, how = hardware.detect_hardware()
    assert name == "cpu" and "no npu-smi on PATH" in how
    assert hardware.get_profile("auto").name == "cpu"
    assert hardware.choose_hardware("atlas-300i-duo") == ("atlas-300i-duo", "given")


def test_300i_duo_and_800i_a2_chips_are_recognised(npu_smi):
    npu_smi("duo_4cards.txt")
    name, how = hardware.detect_hardware()
    assert name == "atlas-300i-duo"
    assert "npu-smi 25.2.0 lists 8 310P3 chips on 4 cards" in how
    npu_smi("a2_2chips.txt")
    assert hardware.detect_hardware()[0] == "atlas-800i-a2"


def test_an_ascend_host_whose_npu_smi_fails_is_an_error_not_cpu(npu_smi):
    npu_smi(text="dcmi module initialize failed. ret is -8005\n", exit_code=255)
    with pytest.raises(MsinferError, match="exit 255.*give --hardware"):
        hardware.detect_hardware()
    npu_smi(text=A2_TABLE.replace("910B2", "XPU9 "))
    with pytest.raises(MsinferError, match="XPU9 chips, which no profile describes"):
        hardware.detect_hardware()


@pytest.mark.parametrize("command", [
    ["serve", "--model", "m"], ["generate", "--model", "m", "--prompt", "x"],
    ["launch", "--nproc", "1", "--strategy", "s"], ["doctor"], ["commtest"]])
def test_auto_is_the_default_where_there_is_one(command):
    args = build_parser().parse_args(command)
    assert args.hardware in ("auto", None)  # launch: the rank command's, else auto


def test_plan_still_asks_for_hardware_and_takes_auto(npu_smi, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "--model", "qwen2-72b", "--strategy", TP8])
    capsys.readouterr()
    npu_smi("duo_4cards.txt")
    code = main(["plan", "--model", "qwen2-72b", "--strategy", TP8, "--hardware", "auto"])
    out = capsys.readouterr().out
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("msinfer plan: qwen2-72b on 8 x atlas-300i-duo")
    assert lines[1] == ("  hardware   atlas-300i-duo: detected (--hardware auto): npu-smi 25.2.0 "
                        "lists 8 310P3 chips on 4 cards")
    main(["plan", "--model", "qwen2-72b", "--strategy", TP8, "--hardware", "auto", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["hardware"] == "atlas-300i-duo"
    assert report["hardware_choice"].startswith("detected (--hardware auto)")
    main(["plan", "--model", "qwen2-72b", "--strategy", TP8, "--hardware", "atlas-300i-duo"])
    assert "  hardware   " not in capsys.readouterr().out  # given: the first line names it


def test_launch_detects_once_and_gives_the_ranks_the_profile(npu_smi, tmp_path, capsys):
    model = str(tmp_path / "m")
    make_tiny_model(model, layers=1, hidden=64, heads=8, kv_heads=2, vocab=512)
    npu_smi("duo_4cards.txt")
    code = main(["launch", "--nproc", "4", "--strategy", TP4, "--dry-run", "--",
                 "generate", "--model", model, "--prompt", "hi"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "  hardware   atlas-300i-duo: detected (--hardware auto)" in err
    assert "float16" in err  # the 310P's dtype, planned for the detected chips
    assert out.splitlines()[0].endswith("--hardware atlas-300i-duo")
    # the rank command's own --hardware is the launch's when the launch gives none
    npu_smi(None)
    code = main(["launch", "--nproc", "4", "--strategy", TP4, "--dry-run", "--",
                 "generate", "--model", model, "--prompt", "hi", "--hardware", "atlas-800i-a2"])
    out, err = capsys.readouterr()
    assert code == 0 and "4 x atlas-800i-a2" in err and "  hardware   " not in err


def test_doctor_defaults_to_the_detected_chips(npu_smi, capsys):
    npu_smi("duo_4cards.txt")
    main(["doctor", "--json", "--skip", "software", "--skip", "launch"])
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert checks["devices.npu-smi"]["status"] == "pass"
    npu_smi(None)
    main(["doctor", "--json", "--skip", "software", "--skip", "launch"])
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert "detected: no npu-smi on PATH" in checks["devices"]["detail"]
