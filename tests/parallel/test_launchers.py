"""How a rank finds out who started it, and what it changes in its environment before
MindSpore's init(): checked on CPU with environments set as each launcher sets them."""
import json
import os
import subprocess
import sys

import pytest

from msinfer.errors import MsinferError
from msinfer.parallel import ranktable
from msinfer.parallel.distributed import (bridge_environment, detect_launcher, rank0_host,
                                          rank_environment, spans_hosts)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def mpirun_env(rank, size, local_rank=None, local_size=None, **extra):
    """What OpenMPI's mpirun exports to rank `rank` (one host unless told otherwise)."""
    env = {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
           "OMPI_COMM_WORLD_LOCAL_RANK": str(rank if local_rank is None else local_rank),
           "OMPI_COMM_WORLD_LOCAL_SIZE": str(size if local_size is None else local_size),
           "OMPI_MCA_orte_hnp_uri": "x", "PMIX_RANK": str(rank), "PATH": "/usr/bin"}
    return dict(env, **extra)


def msrun_env(rank, size, **extra):
    """What msrun's process manager exports to worker `rank` of one host."""
    return dict({"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": str(size), "MS_SCHED_HOST": "127.0.0.1",
                 "MS_SCHED_PORT": "8118", "MS_NODE_ID": str(rank), "RANK_ID": str(rank),
                 "DEVICE_ID": str(rank), "RANK_SIZE": str(size)}, **extra)


@pytest.fixture
def table(tmp_path):
    """Four devices 4-7 of one server: the table's device ids are not the local ranks."""
    path = tmp_path / "hccl_4p_4567.json"
    ranktable.write(ranktable.build([4, 5, 6, 7], "192.0.2.10"), str(path))
    return str(path)


def test_no_launcher_is_a_single_process():
    assert detect_launcher("Ascend", env={"PATH": "/usr/bin"}) == ("single", None)
    # An exported RANK_TABLE_FILE alone (no RANK_ID) does not make a one-device run distributed.
    assert detect_launcher("Ascend", env={"RANK_TABLE_FILE": "/t.json"}) == ("single", None)


def test_msrun_needs_no_changes_and_refuses_an_explicit_rank_table(table):
    env = msrun_env(2, 4)
    assert detect_launcher("Ascend", env=env) == ("msrun", None)
    assert rank_environment("msrun", env) == {}  # msrun's DEVICE_ID (= local rank) stands
    with pytest.raises(MsinferError, match="msrun builds the job itself"):
        detect_launcher("Ascend", table, env=env)


def test_rank_table_process_takes_the_device_from_the_table(table):
    env = {"RANK_TABLE_FILE": table, "RANK_ID": "1", "RANK_SIZE": "4"}
    launcher, used = detect_launcher("Ascend", env=env)
    assert (launcher, used) == ("rank-table-process", table)
    assert rank_environment(launcher, env, used) == {
        "RANK_TABLE_FILE": os.path.abspath(table), "RANK_ID": "1", "RANK_SIZE": "4",
        "DEVICE_ID": "5"}
    # A DEVICE_ID the user set that agrees with the table is fine; one that does not is refused.
    assert rank_environment(launcher, dict(env, DEVICE_ID="5"), used)["DEVICE_ID"] == "5"
    with pytest.raises(MsinferError, match=r"DEVICE_ID=1 but .* puts rank 1 on device 5"):
        rank_environment(launcher, dict(env, DEVICE_ID="1"), used)


def test_an_explicit_rank_table_without_rank_id_or_launcher_is_refused(table):
    with pytest.raises(MsinferError, match="no RANK_ID and no launcher"):
        detect_launcher("Ascend", table, env={})


def test_mpirun_with_a_rank_table_uses_the_table_device_not_the_local_rank(table):
    # What the rank sees after `import mindspore`: DEVICE_ID/RANK_ID from OpenMPI's local rank.
    env = mpirun_env(2, 4, RANK_ID="2", DEVICE_ID="2", RANK_SIZE="4")
    launcher, used = detect_launcher("Ascend", table, env=env)
    assert launcher == "mpirun-ranktable"
    changes = rank_environment(launcher, env, used)
    assert changes["DEVICE_ID"] == "6" and changes["RANK_ID"] == "2"
    assert changes["RANK_SIZE"] == "4"
    assert changes["RANK_TABLE_FILE"] == os.path.abspath(table)
    # MindSpore's own mpirun mode must not see the job: every MPI variable goes.
    assert all(changes[k] is None for k in env if k.startswith(("OMPI_", "PMIX")))


def test_mpirun_with_an_exported_rank_table_file_runs_rank_table_mode(table):
    """The decision for native mpirun plus an exported RANK_TABLE_FILE: the table is used
    (rank-table mode), as if given with --rank-table."""
    env = mpirun_env(3, 4, RANK_TABLE_FILE=table)
    launcher, used = detect_launcher("Ascend", env=env)
    assert (launcher, used) == ("mpirun-ranktable", table)
    assert rank_environment(launcher, env, used)["DEVICE_ID"] == "7"


def test_mpirun_on_ascend_without_a_table_is_mindspore_native_mode():
    env = mpirun_env(5, 8, local_rank=1, local_size=4)
    assert detect_launcher("Ascend", env=env) == ("mpirun-native", None)
    changes = rank_environment("mpirun-native", env)
    assert changes == {"DEVICE_ID": "1"}  # its local rank's device; MPI variables stay


def test_mpirun_on_cpu_bridges_to_mindspore_cluster_and_refuses_a_rank_table(table):
    env = mpirun_env(1, 4)
    assert detect_launcher("CPU", env=env) == ("mpirun-bridge", None)
    assert detect_launcher("CPU", env=dict(env, RANK_TABLE_FILE=table)) == ("mpirun-bridge", None)
    changes = rank_environment("mpirun-bridge", env)
    assert {k for k, v in changes.items() if v is None} == {
        "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_MCA_orte_hnp_uri", "PMIX_RANK"}
    assert bridge_environment(1, 4, "127.0.0.1", 9000) == {
        "MS_WORKER_NUM": "4", "MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": "9000",
        "MS_ROLE": "MS_WORKER", "MS_NODE_ID": "1"}
    with pytest.raises(MsinferError, match="rank tables set up HCCL on Ascend"):
        detect_launcher("CPU", table, env=env)


def test_bridge_listens_on_loopback_on_one_host_and_on_the_host_address_across_hosts():
    one_host = mpirun_env(0, 4)
    assert not spans_hosts(one_host)
    assert rank0_host(one_host) == "127.0.0.1"
    # `msinfer launch --hostfile` exports MSINFER_MULTI_HOST=1; mpirun's local size says it too.
    for env in (mpirun_env(0, 8, MSINFER_MULTI_HOST="1"), mpirun_env(0, 8, local_size=4)):
        assert spans_hosts(env)
        assert rank0_host(env) == ranktable.host_ip()


def test_the_handoff_listens_where_the_scheduler_is_reached_unless_told_otherwise():
    # msrun across hosts (or the bridge once joined) says so by its scheduler's address
    assert rank0_host({"MS_SCHED_HOST": "127.0.0.1"}) == "127.0.0.1"
    assert rank0_host({"MS_SCHED_HOST": "10.0.0.7"}) == ranktable.host_ip()
    told = {"MSINFER_HANDOFF_HOST": "localhost", "MSINFER_MULTI_HOST": "1"}
    assert rank0_host(told, override="MSINFER_HANDOFF_HOST") == "127.0.0.1"
    assert rank0_host(told) == ranktable.host_ip()  # the override only where asked for


def test_device_id_from_the_table_wins_over_the_one_mindspore_read_from_mpi(table, tmp_path):
    """In a real process: `import mindspore` under mpirun sets DEVICE_ID and its device id to
    the MPI local rank (1); msinfer's start-up must end with the table's device (5) both in
    DEVICE_ID and in MindSpore's context."""
    script = (
        "import json, os, sys\n"
        "import mindspore as ms\n"
        "seen = os.environ.get('DEVICE_ID')\n"
        "from msinfer.parallel.distributed import prepare_rank, set_graph_mode\n"
        "launcher, device, _ = prepare_rank('Ascend', sys.argv[1])\n"
        "set_graph_mode('CPU', device)\n"
        "print(json.dumps([seen, launcher, device, os.environ['DEVICE_ID'],\n"
        "                  ms.get_context('device_id'),\n"
        "                  sorted(k for k in os.environ if k.startswith('OMPI_'))]))\n")
    env = dict(os.environ, PYTHONPATH=ROOT, GLOG_v="3", **mpirun_env(1, 4))
    done = subprocess.run([sys.executable, "-c", script, table], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    seen, launcher, device, exported, context_device, mpi_left = json.loads(
        done.stdout.strip().splitlines()[-1])
    assert seen == "1"  # MindSpore's import put the local rank there
    assert (launcher, device, exported, context_device) == ("mpirun-ranktable", 5, "5", 5)
    assert mpi_left == []
