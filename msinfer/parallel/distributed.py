"""One `init_distributed()` for every way msinfer is started.

Which launcher started this process is read from the environment it set (`detect_launcher`);
what each rank then changes in its environment before MindSpore's `init()` is one pure
function of that environment (`rank_environment`), so it is tested on CPU with environments
set as each launcher sets them, and `msinfer launch --dry-run` prints it per rank.

- single: world size 1, no communication at all;
- msrun (MindSpore's launcher): it set MS_ROLE, MS_WORKER_NUM, DEVICE_ID (= local rank) and
  friends, so `init()` is enough. msrun builds the job itself and does not use a rank table to
  initialise it, so an explicit `--rank-table` under msrun is refused, not ignored;
- mpirun-bridge (CPU, GPU): MindSpore's `init()` refuses OpenMPI's environment on CPU, so mpirun
  only spawns the ranks. Rank 0 starts MindSpore's scheduler on a free port (on its own
  address when the ranks span hosts), mpi4py carries the address to the others, every rank
  scrubs the OMPI_*/PMIX*/OPAL_* variables and joins MindSpore's dynamic cluster as worker
  `rank`;
- mpirun-ranktable (Ascend, with `--rank-table` or an exported RANK_TABLE_FILE): mpirun only
  spawns; each rank sets RANK_TABLE_FILE, RANK_ID, RANK_SIZE and DEVICE_ID from the table and
  clears OMPI_*, since MindSpore's own mpirun mode must not see a rank table. MindSpore sets
  DEVICE_ID to the MPI local rank when it is imported; the table's device id replaces it and is
  the one handed to `set_device`;
- rank-table-process (no launcher, RANK_ID and a rank table set per process, as
  launch/ranktable_qwen2.sh does): the same, rank from RANK_ID;
- mpirun-native (Ascend, no rank table): MindSpore's own mpirun mode, device = MPI local rank.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
from typing import TYPE_CHECKING, Mapping

from .. import log
from ..errors import MsinferError

if TYPE_CHECKING:
    import numpy as np

    from .strategy import ShardPlan

_MPI_PREFIXES = ("OMPI_", "PMIX", "OPAL_", "PMI_")
_SCHEDULER = (
    "import mindspore as ms\n"
    "ms.set_device('CPU')\n"
    "from mindspore.communication import init\n"
    "init()\n"
)
LAUNCHERS = ("single", "msrun", "mpirun-bridge", "mpirun-ranktable", "mpirun-native",
             "rank-table-process")


@dataclasses.dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    launcher: str  # one of LAUNCHERS
    device_id: int = 0


def mpi_world(env: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """(rank, size) when started by mpirun (OpenMPI or a PMI launcher), else None."""
    env = os.environ if env is None else env
    for rank_key, size_key in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("PMIX_RANK", "PMI_SIZE"), ("PMI_RANK", "PMI_SIZE")):
        if rank_key in env and size_key in env:
            return int(env[rank_key]), int(env[size_key])
    return None


def processes_on_host(env: Mapping[str, str] | None = None) -> int:
    """How many ranks of this job share this host (1 when started alone)."""
    env = os.environ if env is None else env
    for key in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        if env.get(key, "").isdigit():
            return int(env[key])
    if env.get("MS_ROLE") and env.get("MS_WORKER_NUM", "").isdigit():
        return int(env["MS_WORKER_NUM"])  # msrun on one host (its default)
    return 1


def _local_rank(env):
    for key in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"):
        if env.get(key, "").isdigit():
            return int(env[key])
    return 0


def detect_launcher(device_target: str, rank_table: str | None = None,
                    env: Mapping[str, str] | None = None) -> tuple[str, str | None]:
    """(launcher, rank table it uses) from the environment the launcher set.

    rank_table: the one given explicitly (--rank-table); otherwise an exported RANK_TABLE_FILE
    counts where a rank table decides the devices (mpirun on Ascend, one process per device
    with RANK_ID). MsinferError for a table msinfer would otherwise ignore."""
    env = os.environ if env is None else env
    table = rank_table or env.get("RANK_TABLE_FILE") or None
    if env.get("MS_ROLE") and env.get("MS_WORKER_NUM"):
        if rank_table:
            raise MsinferError(
                f"--rank-table {rank_table}: msrun builds the job itself (device = local rank) "
                f"and does not initialise it from a rank table; drop --rank-table, or start "
                f"the ranks with mpirun (msinfer launch --launcher mpirun --rank-table ...)")
        return "msrun", None
    world = mpi_world(env)
    if world is None:
        if table and "RANK_ID" in env:
            return "rank-table-process", table
        if rank_table:
            raise MsinferError(
                f"--rank-table {rank_table}: no RANK_ID and no launcher: a rank table runs one "
                f"process per device, each with RANK_ID set (launch/ranktable_qwen2.sh), or "
                f"under msinfer launch --rank-table")
        return "single", None
    if device_target == "Ascend":
        return ("mpirun-ranktable", table) if table else ("mpirun-native", None)
    if rank_table:
        raise MsinferError(f"--rank-table {rank_table}: rank tables set up HCCL on Ascend; on "
                           f"{device_target} the ranks join MindSpore's own cluster instead")
    return "mpirun-bridge", None


def rank_environment(launcher: str, env: Mapping[str, str],
                     rank_table: str | None = None) -> dict[str, str | None]:
    """What this rank changes in its environment before init(): {name: value, or None to
    remove it}. The bridge's scheduler address is added at run time (`bridge_environment`)."""
    changes: dict[str, str | None] = {}
    if launcher in ("mpirun-bridge", "mpirun-ranktable"):  # mpirun only spawned this process
        changes.update({key: None for key in env if key.startswith(_MPI_PREFIXES)})
    if launcher in ("mpirun-ranktable", "rank-table-process"):
        changes.update(_rank_table_environment(launcher, env, rank_table))
    elif launcher == "mpirun-native":
        # MindSpore's mpirun mode: rank r on the device of its local rank (what MindSpore also
        # sets when imported; said here so that the device does not hang on import order).
        changes["DEVICE_ID"] = str(_local_rank(env))
    return changes


def _rank_table_environment(launcher, env, path):
    from .ranktable import device_for_rank, load

    world = mpi_world(env)
    if world:
        rank, size = world
    else:
        rank = env["RANK_ID"]
        size = sum(len(server["device"]) for server in load(path)["server_list"])
    device = device_for_rank(path, rank)
    given = env.get("DEVICE_ID")
    if launcher == "rank-table-process" and given is not None and given != str(device.device_id):
        raise MsinferError(
            f"DEVICE_ID={given} but {path} puts rank {device.rank} on device "
            f"{device.device_id}; unset DEVICE_ID (the table decides) or fix the table")
    return {"RANK_TABLE_FILE": os.path.abspath(path), "RANK_ID": str(device.rank),
            "RANK_SIZE": str(size), "DEVICE_ID": str(device.device_id)}


def spans_hosts(env: Mapping[str, str] | None = None) -> bool:
    """Whether the ranks of an mpirun job are on more than one host: MSINFER_MULTI_HOST=1 (what
    `msinfer launch --hostfile` exports), or fewer ranks on this host than in the job."""
    env = os.environ if env is None else env
    if env.get("MSINFER_MULTI_HOST", "") not in ("", "0"):
        return True
    world = mpi_world(env)
    return world is not None and processes_on_host(env) < world[1]


def bridge_environment(rank: int, size: int, host: str, port: int | str) -> dict[str, str]:
    """The dynamic-cluster variables rank `rank` of the mpirun bridge joins with."""
    return {"MS_WORKER_NUM": str(size), "MS_SCHED_HOST": host, "MS_SCHED_PORT": str(port),
            "MS_ROLE": "MS_WORKER", "MS_NODE_ID": str(rank)}


def apply_environment(changes: Mapping[str, str | None]) -> None:
    for key, value in changes.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def prepare_rank(device_target: str, rank_table: str | None = None) -> tuple[str, int, int]:
    """Detect the launcher and change this process's environment as it needs, before init():
    (launcher, device id, ranks on this host). The device id is the final DEVICE_ID, which
    replaces the MPI local rank MindSpore put there when it was imported."""
    launcher, rank_table = detect_launcher(device_target, rank_table)
    sharing = processes_on_host()
    if launcher == "mpirun-bridge":
        _join_dynamic_cluster()
    elif launcher != "single":
        apply_environment(rank_environment(launcher, os.environ, rank_table))
    device_id = os.environ.get("DEVICE_ID", "0")
    if not device_id.isdigit():
        raise MsinferError(f"DEVICE_ID={device_id!r}: a device id is a non-negative integer")
    return launcher, int(device_id), sharing


def init_distributed(device_target: str, expected_world_size: int = 1,
                     rank_table: str | None = None) -> DistInfo:
    """Set up this process's device (GRAPH_MODE) and communication; return who it is.

    The launcher decides the device id (rank table, msrun's DEVICE_ID, the MPI local rank),
    and MindSpore takes the device only once, so the device is set here, between preparing
    the environment and `init()`. Checks that the world size equals the strategy's
    (`expected_world_size`) and raises a clear MsinferError when not, before any model is
    built.
    """
    launcher, device_id, sharing = prepare_rank(device_target, rank_table)
    if launcher == "single":
        if expected_world_size != 1:
            raise MsinferError(
                f"the strategy needs {expected_world_size} processes but this one was started "
                f"alone; start it with `msinfer launch --nproc {expected_world_size}`, mpirun "
                "or msrun")
        set_graph_mode(device_target, device_id)
        return DistInfo(rank=0, world_size=1, launcher="single", device_id=device_id)

    from mindspore.communication import get_group_size, get_rank, init
    set_graph_mode(device_target, device_id, sharing)
    init()
    info = DistInfo(rank=get_rank(), world_size=get_group_size(), launcher=launcher,
                    device_id=device_id)
    log.setup(info.rank, info.world_size)
    if info.world_size != expected_world_size:
        raise MsinferError(
            f"the strategy needs world size {expected_world_size}, but the job has "
            f"{info.world_size} processes ({launcher}); start {expected_world_size} ranks")
    log.get().info("joined %d-rank job via %s", info.world_size, launcher)
    return info


_cpu_threads = None  # the threads set_graph_mode gave MindSpore's CPU kernels


def cpu_threads() -> int:
    """How many threads MindSpore's CPU kernels run on in this process (set_graph_mode's share;
    this process's cores where it has not set one), for the kernels of msinfer's own
    (layers/cpu_kernels) to run on as many."""
    return _cpu_threads or len(os.sched_getaffinity(0))


def set_graph_mode(device_target: str, device_id: int = 0, processes_on_host: int = 1) -> None:
    """GRAPH_MODE on the device; on CPU, share the host's cores among its ranks.

    MindSpore's CPU kernels default to a pool of 25-30 threads per process: on a small host,
    and worse with several ranks on it, they then fight over cores. MSINFER_CPU_THREADS
    overrides the share."""
    import mindspore as ms

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device(device_target, device_id)
    if device_target != "CPU":
        return
    from mindspore._c_expression import RuntimeConf
    if RuntimeConf.get_instance().is_op_threads_num_configured():
        return  # once per process: a second LLM in the same process keeps the first's
    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // processes_on_host)
    if os.environ.get("MSINFER_CPU_THREADS"):
        threads = os.environ["MSINFER_CPU_THREADS"]
        if not threads.isdigit() or int(threads) < 1:
            raise MsinferError(f"MSINFER_CPU_THREADS={threads!r}: give a positive integer")
        threads = int(threads)
    ms.device_context.cpu.op_tuning.threads_num(threads)
    global _cpu_threads
    _cpu_threads = threads


def free_port() -> int:
    """A TCP port on this host that nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join_dynamic_cluster():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    address = None
    if rank == 0:
        address = (rank0_host(), free_port())
    host, port = comm.bcast(address, root=0)
    apply_environment(rank_environment("mpirun-bridge", os.environ))
    cluster = bridge_environment(rank, size, host, port)
    if rank == 0:
        worker_only = ("MS_ROLE", "MS_NODE_ID")
        _start_scheduler({**os.environ, **{k: v for k, v in cluster.items()
                                           if k not in worker_only}, "MS_ROLE": "MS_SCHED"})
    apply_environment(cluster)


def rank0_host(env: Mapping[str, str] | None = None, override: str | None = None) -> str:
    """Where rank 0 listens for the other ranks of its job (the bridge's scheduler, the
    server's hand-off channel): loopback when every rank is on this host, else this host's
    address as the others reach it (the source address of its default route).

    The job spans hosts when `spans_hosts` says so, or when MindSpore's scheduler is not on
    loopback (MS_SCHED_HOST: msrun across hosts, or the bridge's scheduler once joined).
    override: an environment variable that, when set, names the host instead (its address is
    returned)."""
    env = os.environ if env is None else env
    if override and env.get(override):
        return socket.gethostbyname(env[override])
    if spans_hosts(env) or not env.get("MS_SCHED_HOST", "127.0.0.1").startswith("127."):
        from .ranktable import host_ip
        return host_ip()
    return "127.0.0.1"


def _start_scheduler(env):
    def die_with_parent():
        # If rank 0 dies, so does its scheduler: no orphan keeps the port or the job alive.
        import ctypes
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    scheduler = subprocess.Popen([sys.executable, "-c", _SCHEDULER], env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 preexec_fn=die_with_parent)
    # No kill at exit: the scheduler leaves by itself once every worker has unregistered,
    # and killing it earlier makes the slower ranks fail their unregistration.
    return scheduler


def job_seed(info: DistInfo) -> int:
    """A random seed that every rank of the job agrees on (rank 0's).

    Requests without a seed still have to sample the same token on every rank, or the ranks
    would feed different ids into the next step's collectives."""
    seed = int.from_bytes(os.urandom(3), "little")  # < 2**24, as broadcast_from_rank0 needs
    return broadcast_from_rank0(info, [seed])[0]


def replica_seed(seed: int, replica: int) -> int:
    """The seed of data replica `replica`'s engine: the job's seed (below 2**24) with the
    replica above it. Its ranks share it (they must sample alike); replicas do not, or the
    k-th unseeded request on every replica would draw the same stream (n=2 across two
    replicas gave identical choices). Replica 0 keeps the job's seed."""
    return seed + (replica << 24)


def broadcast_from_rank0(info: DistInfo, values: list[int]) -> list[int]:
    """Rank 0's `values` on every rank of the job, through one AllReduce over the job to
    which the other ranks add zeros (the values they pass only give the length).

    Only for a few small non-negative integers below 2**24: they travel as float32 (MindSpore's
    CPU AllReduce takes no int32), which carries exactly the integers up to 2**24. Alone
    (world size 1) no collective runs."""
    values = [int(v) for v in values]
    if info.rank == 0 and not all(0 <= v < 1 << 24 for v in values):
        raise ValueError(f"broadcast_from_rank0 carries integers in 0..2**24-1 exactly, "
                         f"not {values}")
    if info.world_size == 1:
        return values
    import numpy as np

    mine = np.array(values if info.rank == 0 else [0] * len(values), np.float32)
    return [int(v) for v in _over_the_job("AllReduce", mine)]


def tensor_group(info: DistInfo, shard_plan: ShardPlan) -> str | None:
    """Create and name the communication group of this rank's tensor-parallel peers.

    None when the tensor group is the whole job (data = 1), or when there is nothing to
    communicate (tensor = 1). Ranks of one tensor group are consecutive."""
    tensor = shard_plan.tensor
    if shard_plan.data == 1 or tensor == 1:
        return None
    from mindspore.communication import create_group

    replica = shard_plan.data_rank(info.rank)
    name = f"msinfer_tensor_{replica}"
    create_group(name, list(range(replica * tensor, (replica + 1) * tensor)))
    return name


def leave_mpirun_job(code: int) -> None:
    """End this rank of an mpirun job now with `code`, skipping MindSpore's teardown; every
    rank of the job must call it.

    mpirun aborts every rank the moment one exits non-zero, and a rank stopped in the middle
    of MindSpore's teardown can crash (seen in CI: a segfault in a cluster thread that turned
    the job's exit 1 into 139). So every rank leaves with the same code, together: MPI's
    finalize is a fence over the job, and nothing of MindSpore runs after it."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    MPI = sys.modules.get("mpi4py.MPI")  # the bridge's; importing it here would start MPI
    if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()
    os._exit(code)


def leave_if_mpirun_rank(code: int) -> None:
    """A process that is a rank of an mpirun job (MPI started by the bridge) leaves through
    leave_mpirun_job, skipping MindSpore's teardown (the same segfault in a cluster thread
    turned a served job's clean Ctrl-C, every rank's exit 0, into 139); any other process
    returns. For the process's entry point only, once its work is done on every rank."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        leave_mpirun_job(code)


def all_gather_rows(rows: np.ndarray) -> np.ndarray:
    """Every rank's (n, width) float32 array stacked in rank order, on every rank."""
    return _over_the_job("AllGather", rows)


def all_gather_json(info: DistInfo, obj) -> list:
    """Every rank's `obj` (anything `json.dumps` writes), in rank order, on every rank, as
    `json.loads` reads it back (so also alone: dict keys become strings).

    Two AllGathers over the job: each rank's byte count, then every rank's UTF-8 JSON padded
    to the longest. MindSpore's CPU collectives take float32, so each byte travels as one
    float32 (0..255 exactly) and each count as two (below 2**24 each): the job moves
    world_size x longest x 4 bytes to every rank. Alone (world size 1) no collective runs."""
    import json

    import numpy as np

    data = json.dumps(obj).encode()
    if info.world_size == 1:
        return [json.loads(data)]
    counts = all_gather_rows(np.array([divmod(len(data), 1 << 24)], np.float32))
    counts = [int(high) * (1 << 24) + int(low) for high, low in counts]
    row = np.zeros((1, max(counts)), np.float32)
    row[0, :len(data)] = np.frombuffer(data, np.uint8)
    rows = all_gather_rows(row)
    return [json.loads(rows[r, :n].astype(np.uint8).tobytes()) for r, n in enumerate(counts)]


def _over_the_job(collective, array):
    """One collective (an `ops` primitive name) over the whole job, on a host array."""
    from mindspore import Tensor, nn, ops

    class Collective(nn.Cell):
        def __init__(self):
            super().__init__()
            self.op = getattr(ops, collective)()

        def construct(self, x):
            return self.op(x)

    return Collective()(Tensor(array)).asnumpy()
