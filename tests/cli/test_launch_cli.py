"""`msinfer launch` decides before anything starts: the plan is checked on this machine, and
a plan that cannot run is refused without spawning a rank."""
import os

import pytest

from msinfer.cli.main import main
from msinfer.tools.tiny_model import make_tiny_model

pytestmark = pytest.mark.waits  # it mostly waits: the third xdist worker runs it (conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TP4 = os.path.join(ROOT, "strategies", "qwen2_tp4.yaml")


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    """8 query heads over 2 KV heads: test_parity's GQA checkpoint (made once a session)."""
    return tiny_checkpoint(layers=2, hidden=64, heads=8, kv_heads=2, vocab=384, seed=1)[0]


def test_dry_run_prints_the_mpirun_command_after_the_plan(model_dir, capsys):
    code = main(["launch", "--nproc", "4", "--strategy", TP4, "--dry-run", "--",
                 "generate", "--model", model_dir, "--prompt", "hi"])
    out, err = capsys.readouterr()
    assert code == 0
    assert "FITS" in err  # the planner ran
    command = out.splitlines()[0].split()
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


# ---- every launcher on Atlas 300I Duo: the environment each rank gets ----

TP8 = os.path.join(ROOT, "strategies", "qwen2_tp8.yaml")


def dry_run(capsys, *launch, rank=("generate", "--prompt", "hi")):
    """(exit code, launch command, {rank: (launcher, {variable: value})}, stderr)."""
    code = main(["launch", *launch, "--dry-run", "--", *rank])
    out, err = capsys.readouterr()
    lines = out.splitlines()
    ranks = {}
    for line in lines[1:]:
        head, _, words = line.partition(": ")
        number, launcher = head.split()[1], head.split()[2].strip("()")
        ranks[int(number)] = (launcher, dict(w.split("=", 1) for w in words.split()))
    return code, (lines[0].split() if lines else []), ranks, err


@pytest.fixture
def table_4567(tmp_path):
    from msinfer.parallel import ranktable
    path = str(tmp_path / "hccl_4p_4567.json")
    ranktable.write(ranktable.build([4, 5, 6, 7], "192.0.2.10"), path)
    return path


def test_mpirun_on_atlas_without_a_table_gives_each_rank_its_local_device(model_dir, capsys):
    code, command, ranks, err = dry_run(
        capsys, "--nproc", "4", "--strategy", TP4, "--hardware", "atlas-300i-duo",
        rank=("generate", "--model", model_dir, "--prompt", "hi"))
    assert code == 0 and "FITS" in err and "explicit mode" in err
    assert "--rank-table" not in command
    for r in range(4):
        launcher, env = ranks[r]
        assert launcher == "mpirun-native"
        assert env["DEVICE_ID"] == env["RANK_ID"] == env["OMPI_COMM_WORLD_RANK"] == str(r)
        assert "RANK_TABLE_FILE" not in env


@pytest.mark.parametrize("how", ["--rank-table", "exported RANK_TABLE_FILE",
                                 "the rank command's --rank-table"])
def test_mpirun_on_atlas_with_a_rank_table_puts_each_rank_on_the_table_device(
        model_dir, table_4567, capsys, monkeypatch, how):
    launch = ["--nproc", "4", "--strategy", TP4, "--hardware", "atlas-300i-duo"]
    rank = ("generate", "--model", model_dir, "--prompt", "hi")
    if how == "--rank-table":
        launch += ["--rank-table", table_4567]
    elif how == "exported RANK_TABLE_FILE":
        monkeypatch.setenv("RANK_TABLE_FILE", table_4567)
    else:
        rank += ("--rank-table", table_4567)
    code, command, ranks, err = dry_run(capsys, *launch, rank=rank)
    assert code == 0
    # The ranks are told the table explicitly, so hosts that do not inherit the shell get it.
    given = command[command.index("--rank-table") + 1]
    assert os.path.abspath(given) == os.path.abspath(table_4567)
    for r in range(4):
        launcher, env = ranks[r]
        assert launcher == "mpirun-ranktable"
        assert env["DEVICE_ID"] == str(4 + r)  # the table's device, not the local rank r
        assert env["RANK_ID"] == str(r) and env["RANK_SIZE"] == "4"
        assert env["RANK_TABLE_FILE"] == os.path.abspath(table_4567)
        assert env["OMPI_*"] == "(removed)"


def test_msrun_on_atlas_gives_worker_i_device_i(model_dir, capsys):
    code, command, ranks, _ = dry_run(
        capsys, "--launcher", "msrun", "--nproc", "4", "--strategy", TP4,
        "--hardware", "atlas-300i-duo", rank=("generate", "--model", model_dir, "--prompt", "hi"))
    assert code == 0
    port = next(w.split("=")[1] for w in command if w.startswith("--master_port="))
    for r in range(4):
        launcher, env = ranks[r]
        assert launcher == "msrun"
        assert env["DEVICE_ID"] == env["MS_NODE_ID"] == str(r)
        assert (env["MS_ROLE"], env["MS_WORKER_NUM"], env["MS_SCHED_PORT"]) == (
            "MS_WORKER", "4", port)


def test_a_rank_table_under_msrun_is_refused_not_ignored(model_dir, table_4567, capsys):
    code, command, _, err = dry_run(
        capsys, "--launcher", "msrun", "--nproc", "4", "--strategy", TP4, "--hardware",
        "atlas-300i-duo", "--rank-table", table_4567,
        rank=("generate", "--model", model_dir, "--prompt", "hi"))
    assert code == 2 and command == []
    assert "msrun builds the job itself" in err


def test_a_rank_table_that_does_not_match_the_job_is_refused_before_launch(model_dir, tmp_path,
                                                                           capsys):
    from msinfer.parallel import ranktable
    path = str(tmp_path / "two.json")
    ranktable.write(ranktable.build([0, 1], "192.0.2.10"), path)
    code, command, _, err = dry_run(
        capsys, "--nproc", "4", "--strategy", TP4, "--hardware", "atlas-300i-duo",
        "--rank-table", path, rank=("generate", "--model", model_dir, "--prompt", "hi"))
    assert code == 2 and command == []
    assert "the table has 2 devices but the strategy's world_size is 4" in err


def test_hostfile_spreads_ranks_and_exports_the_multi_host_flag(model_dir, tmp_path, capsys):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two servers\n192.0.2.10 slots=4\n192.0.2.11 slots=4\n")
    launch = ["--nproc", "8", "--strategy", TP8, "--hostfile", str(hostfile)]
    rank = ("generate", "--model", model_dir, "--prompt", "hi")
    # 300I Duo runs collectives within one server only: refused before anything starts.
    code, command, _, err = dry_run(capsys, *launch, "--hardware", "atlas-300i-duo", rank=rank)
    assert code == 1 and command == []
    assert "on 2 hosts" in err and "within one server only" in err
    code, command, ranks, _ = dry_run(capsys, *launch, "--hardware", "atlas-800i-a2", rank=rank)
    assert code == 0
    assert "MSINFER_MULTI_HOST=1" in command
    for r in range(8):
        launcher, env = ranks[r]
        assert launcher == "mpirun-native"
        assert env["DEVICE_ID"] == env["OMPI_COMM_WORLD_LOCAL_RANK"] == str(r % 4)
        assert env["MSINFER_MULTI_HOST"] == "1"
    # On CPU the bridge's scheduler then listens on rank 0's address, not on loopback.
    code, _, ranks, _ = dry_run(capsys, *launch, "--hardware", "cpu", rank=rank)
    assert code == 0
    assert {ranks[r][1]["MS_SCHED_HOST"] for r in range(8)} == {"(rank-0-address)"}
    assert [ranks[r][1]["MS_NODE_ID"] for r in range(8)] == [str(r) for r in range(8)]


def test_mpirun_on_cpu_bridges_every_rank_to_a_loopback_scheduler(model_dir, capsys):
    code, _, ranks, _ = dry_run(capsys, "--nproc", "4", "--strategy", TP4,
                                rank=("generate", "--model", model_dir, "--prompt", "hi"))
    assert code == 0
    for r in range(4):
        launcher, env = ranks[r]
        assert launcher == "mpirun-bridge"
        assert (env["MS_ROLE"], env["MS_NODE_ID"], env["MS_SCHED_HOST"]) == (
            "MS_WORKER", str(r), "127.0.0.1")
        assert env["OMPI_*"] == "(removed)"


@pytest.mark.parametrize("launcher", ["mpirun", "msrun"])
def test_ascend_ranks_get_serving_hccl_timeouts_unless_the_environment_sets_them(
        model_dir, capsys, monkeypatch, launcher):
    """HCCL's defaults let a stuck chip hold a service for 30 minutes; launch gives the ranks
    shorter ones (HCCL_TIMEOUTS), keeps the user's, and sets none off Ascend."""
    from msinfer.cli.launch import HCCL_TIMEOUTS

    launch = ["--launcher", launcher, "--nproc", "4", "--strategy", TP4]
    rank = ("generate", "--model", model_dir, "--prompt", "hi")
    monkeypatch.delenv("HCCL_CONNECT_TIMEOUT", raising=False)
    monkeypatch.delenv("HCCL_EXEC_TIMEOUT", raising=False)
    assert HCCL_TIMEOUTS == {"HCCL_CONNECT_TIMEOUT": "600", "HCCL_EXEC_TIMEOUT": "340"}
    code, command, ranks, _ = dry_run(capsys, *launch, "--hardware", "atlas-300i-duo",
                                      rank=rank)
    assert code == 0
    for r in range(4):
        env = ranks[r][1]
        assert (env["HCCL_CONNECT_TIMEOUT"], env["HCCL_EXEC_TIMEOUT"]) == ("600", "340")
    if launcher == "mpirun":  # exported with -x, so ranks on other hosts get them too
        assert "HCCL_EXEC_TIMEOUT=340" in command and "HCCL_CONNECT_TIMEOUT=600" in command
    monkeypatch.setenv("HCCL_EXEC_TIMEOUT", "1836")
    code, command, ranks, _ = dry_run(capsys, *launch, "--hardware", "atlas-300i-duo",
                                      rank=rank)
    assert code == 0
    for r in range(4):
        env = ranks[r][1]
        assert (env["HCCL_CONNECT_TIMEOUT"], env["HCCL_EXEC_TIMEOUT"]) == ("600", "1836")
    if launcher == "mpirun":
        assert "HCCL_EXEC_TIMEOUT=1836" in command
    monkeypatch.delenv("HCCL_EXEC_TIMEOUT")
    code, command, ranks, _ = dry_run(capsys, *launch, "--hardware", "cpu", rank=rank)
    assert code == 0
    assert not [w for w in command if w.startswith("HCCL_")]
    assert not [k for r in range(4) for k in ranks[r][1] if k.startswith("HCCL_")]


# ---- the parallel mode is known before anything starts ----

def test_semi_auto_with_replicated_kv_heads_is_refused_before_spawning(model_dir, tmp_path,
                                                                      capsys):
    """The README's tp4 example on 300I Duo: 2 KV heads at tensor 4 are replicated, which only
    the explicit mode runs. Explicit is the default; semi_auto, asked for by the rank command
    or by the strategy, is refused by the launcher's planner, not by every rank after init."""
    launch = ["--nproc", "4", "--hardware", "atlas-300i-duo"]
    rank = ("generate", "--model", model_dir, "--prompt", "hi")
    code, _, _, err = dry_run(capsys, *launch, "--strategy", TP4, rank=rank)
    assert code == 0 and "explicit mode" in err
    code, command, _, err = dry_run(capsys, *launch, "--strategy", TP4,
                                    rank=rank + ("--parallel-mode", "semi_auto"))
    assert code == 1 and command == []
    assert "parallel mode semi_auto: tensor=4 exceeds the 2 KV heads" in err
    semi_auto = tmp_path / "tp4_semi_auto.yaml"
    semi_auto.write_text(open(TP4).read() + "parallel_mode: semi_auto\n")
    code, command, _, err = dry_run(capsys, *launch, "--strategy", str(semi_auto), rank=rank)
    assert code == 1 and command == [] and "only in the explicit mode" in err


def test_rank_commands_run_in_every_rank_and_only_model_commands_are_planned(tmp_path, capsys):
    code, command, ranks, err = dry_run(capsys, "--nproc", "4", "--strategy", TP4,
                                        rank=("commtest", "--max-bytes", "1K"))
    assert code == 0 and "FITS" not in err  # nothing to plan
    assert command[command.index("-m"):][:5] == ["-m", "msinfer", "commtest", "--max-bytes",
                                                 "1K"]
    assert len(ranks) == 4
    for not_a_rank_command in (("launch",), ("ranktable", "check", "t.json")):
        code, _, _, err = dry_run(capsys, "--nproc", "4", "--strategy", TP4,
                                  rank=not_a_rank_command)
        assert code == 2 and "give the rank command after --, one of generate" in err


def test_a_rank_table_is_refused_for_cpu(model_dir, table_4567, capsys):
    code, _, _, err = dry_run(capsys, "--nproc", "4", "--strategy", TP4, "--rank-table",
                              table_4567, rank=("generate", "--model", model_dir, "--prompt", "hi"))
    assert code == 2 and "rank tables set up HCCL on Ascend" in err


FAKE_JOB = r"""
import os, signal, subprocess, sys, time
# Like mpirun: ranks in process groups of their own; the launcher program itself ignores
# SIGTERM here and exits with its ranks' status once they are done.
behaviour = sys.argv[1]
rank = ("import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n" if behaviour == "drain" else
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n") + \
       "print('up', flush=True)\ntime.sleep(120)\n"
signal.signal(signal.SIGTERM, signal.SIG_IGN)
ranks = [subprocess.Popen([sys.executable, "-c", rank], process_group=0, stdout=subprocess.PIPE)
         for _ in range(2)]
for r in ranks:
    r.stdout.readline()
print("ready", flush=True)
sys.exit(max(r.wait() for r in ranks))
"""


def test_a_server_job_gets_its_drain_and_a_margin_to_stop():
    """The launcher's grace holds a server's stop bound (docs/serving-reliability.md): its
    --shutdown-timeout and STOP_MARGIN_SECONDS, never less than STOP_GRACE_SECONDS."""
    from msinfer.cli import launch as launch_cli
    from msinfer.cli.main import build_parser

    def grace(*argv):
        return launch_cli.stop_grace(build_parser().parse_args(list(argv)))
    assert grace("serve", "--model", "m", "--shutdown-timeout", "120") == 135
    assert grace("serve", "--model", "m") == launch_cli.STOP_GRACE_SECONDS == 45
    assert grace("generate", "--model", "m", "--prompt", "hi") == 45


@pytest.mark.parametrize("behaviour", ["drain", "hang"])
def test_stopping_a_job_signals_each_rank_and_waits_for_it(behaviour, monkeypatch):
    """SIGTERM or Ctrl-C to `msinfer launch`: each rank gets SIGTERM itself (mpirun would tear
    the job down instead of letting a server drain); a job that ends in the grace period
    gives its own exit code, one that does not is killed whole."""
    import subprocess
    import sys
    import time

    from msinfer.cli import launch as launch_cli

    monkeypatch.setattr(launch_cli, "STOP_GRACE_SECONDS", 3)
    job = subprocess.Popen([sys.executable, "-c", FAKE_JOB, behaviour], start_new_session=True,
                           stdout=subprocess.PIPE, text=True)
    assert job.stdout.readline().strip() == "ready"
    ranks = [pid for pid, _ in launch_cli._session_members(job.pid) if pid != job.pid]
    assert len(ranks) == 2
    start = time.monotonic()
    code = launch_cli._stop(job)
    if behaviour == "drain":
        assert code == 0 and time.monotonic() - start < 3
    else:
        assert code is None and time.monotonic() - start >= 3
    deadline = time.monotonic() + 5  # a killed process takes a moment to go
    while launch_cli._session_members(job.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert launch_cli._session_members(job.pid) == []  # nothing of the job is left


def test_a_launcher_killed_outright_takes_its_job_along(tmp_path):
    """SIGKILL gives `msinfer launch` no chance to stop its job: mpirun, in a session of its
    own, would run on. Started with die_with_parent, it gets SIGTERM (on which mpirun tears
    the job down) when the launcher dies."""
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "child"
    launcher = subprocess.Popen([sys.executable, "-c", f"""
import subprocess, sys, time
from msinfer.cli.launch import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                         start_new_session=True, preexec_fn=die_with_parent)
open({str(pid_file)!r}, "w").write(str(child.pid))
time.sleep(60)
"""], env=dict(os.environ, PYTHONPATH=ROOT))
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        with open(f"/proc/{child}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # dead, not yet reaped
                break
        time.sleep(0.05)
    else:
        assert not os.path.exists(f"/proc/{child}"), "the child outlived its launcher"


def test_tensor_parallel_size_stands_for_the_shipped_strategy(model_dir, capsys):
    """vLLM's --tensor-parallel-size N, on launch or in the rank command, plans and runs the
    shipped strategies/qwen2_tpN.yaml plan; with a strategy file too, or a size not shipped,
    or another --nproc, it is refused before launch."""
    rank = ("generate", "--model", model_dir, "--prompt", "hi")
    code, command, _, err = dry_run(capsys, "--nproc", "4", "-tp", "4", "--hardware", "cpu",
                                    rank=rank)
    assert code == 0 and "FITS" in err and "tensor 4" in err
    assert command[command.index("-m"):] == ["-m", "msinfer", *rank, "--tensor-parallel-size",
                                             "4", "--hardware", "cpu"]
    code, command, _, err = dry_run(capsys, "--nproc", "4", "--hardware", "cpu",
                                    rank=(*rank, "--tensor-parallel-size", "4"))
    assert code == 0 and "FITS" in err and "--strategy" not in command
    for launch, message in (
            (("--nproc", "2", "-tp", "4"), "--nproc 2 but <default tensor=4 data=1> has "
                                           "world_size 4"),
            (("--nproc", "4", "-tp", "4", "--strategy", TP4), "give a strategy file or "
                                                              "tensor_parallel_size 4, not both"),
            (("--nproc", "3", "-tp", "3"), "tensor_parallel_size 3: a shipped strategy exists"),
            (("--nproc", "4"), "give --strategy FILE or --tensor-parallel-size N")):
        code, _, _, err = dry_run(capsys, *launch, "--hardware", "cpu", rank=rank)
        assert code != 0 and message in err, err
