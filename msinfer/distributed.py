"""One `init_distributed()` for every way msinfer is started.

- alone: world size 1, no communication at all;
- msrun (MindSpore's launcher): it already set MS_ROLE and friends, so `init()` is enough;
- mpirun on CPU (and GPU): MindSpore's `init()` refuses OpenMPI's environment on CPU, so
  mpirun only spawns the ranks. Rank 0 starts MindSpore's scheduler on a free port, mpi4py
  carries its address to the others, every rank scrubs the OMPI_*/PMIX*/OPAL_* variables and
  joins MindSpore's dynamic cluster as worker `rank`;
- mpirun on Ascend with a rank table: mpirun only spawns; each rank sets RANK_TABLE_FILE,
  RANK_ID, RANK_SIZE and DEVICE_ID from the table and clears OMPI_*, since MindSpore's own
  mpirun mode must not see a rank table;
- mpirun on Ascend without a rank table: MindSpore's native mpirun mode (`init()` as is).
"""
import dataclasses
import os
import signal
import socket
import subprocess
import sys

from . import log
from .errors import MsinferError

_MPI_PREFIXES = ("OMPI_", "PMIX", "OPAL_", "PMI_")
_SCHEDULER = (
    "import mindspore as ms\n"
    "ms.set_device('CPU')\n"
    "from mindspore.communication import init\n"
    "init()\n"
)


@dataclasses.dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    launcher: str  # "single", "msrun", "mpirun-bridge", "mpirun-ranktable", "mpirun-native"
    device_id: int = 0


def mpi_world():
    """(rank, size) when started by mpirun (OpenMPI or a PMI launcher), else None."""
    env = os.environ
    for rank_key, size_key in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("PMIX_RANK", "PMI_SIZE"), ("PMI_RANK", "PMI_SIZE")):
        if rank_key in env and size_key in env:
            return int(env[rank_key]), int(env[size_key])
    return None


def processes_on_host():
    """How many ranks of this job share this host (1 when started alone)."""
    env = os.environ
    for key in ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        if env.get(key, "").isdigit():
            return int(env[key])
    if env.get("MS_ROLE") and env.get("MS_WORKER_NUM", "").isdigit():
        return int(env["MS_WORKER_NUM"])  # msrun on one host (its default)
    return 1


def detect_launcher(device_target, rank_table=None):
    if os.environ.get("MS_ROLE") and os.environ.get("MS_WORKER_NUM"):
        return "msrun"
    if mpi_world() is None:
        return "rank-table-process" if rank_table and os.environ.get("RANK_ID") else "single"
    if device_target == "Ascend":
        return "mpirun-ranktable" if rank_table else "mpirun-native"
    return "mpirun-bridge"


def init_distributed(device_target, expected_world_size=1, rank_table=None):
    """Set up this process's device (GRAPH_MODE) and communication; return who it is.

    The launcher decides the device id (rank table, msrun's DEVICE_ID), and MindSpore takes
    the device only once, so the device is set here, between preparing the environment and
    `init()`. Checks that the world size equals the strategy's (`expected_world_size`) and
    raises a clear MsinferError when not, before any model is built.
    """
    rank_table = (rank_table or os.environ.get("MSINFER_RANK_TABLE")
                  or os.environ.get("RANK_TABLE_FILE"))
    launcher = detect_launcher(device_target, rank_table)
    if launcher == "single":
        if expected_world_size != 1:
            raise MsinferError(
                f"the strategy needs {expected_world_size} processes but this one was started "
                f"alone; start it with `msinfer launch --nproc {expected_world_size}`, mpirun "
                "or msrun")
        set_graph_mode(device_target)
        return DistInfo(rank=0, world_size=1, launcher="single")

    from mindspore.communication import get_group_size, get_rank, init
    sharing = processes_on_host()
    if launcher == "mpirun-bridge":
        _join_dynamic_cluster()
    elif launcher in ("mpirun-ranktable", "rank-table-process"):
        _use_rank_table(rank_table)
    elif launcher == "mpirun-native":
        os.environ.pop("RANK_TABLE_FILE", None)  # MindSpore's mpirun mode must not see one
    device_id = int(os.environ.get("DEVICE_ID", 0))
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


def set_graph_mode(device_target, device_id=0, processes_on_host=1):
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
    threads = int(os.environ.get("MSINFER_CPU_THREADS", max(1, cores // processes_on_host)))
    ms.device_context.cpu.op_tuning.threads_num(threads)


def _scrub_mpi_environment():
    for key in [k for k in os.environ if k.startswith(_MPI_PREFIXES)]:
        del os.environ[key]


def free_port():
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
        address = ("127.0.0.1", free_port())
        if size > 1 and os.environ.get("MSINFER_MULTI_HOST"):
            address = (socket.gethostbyname(socket.gethostname()), address[1])
    host, port = comm.bcast(address, root=0)
    _scrub_mpi_environment()
    cluster = {"MS_WORKER_NUM": str(size), "MS_SCHED_HOST": host, "MS_SCHED_PORT": str(port)}
    if rank == 0:
        _start_scheduler(dict(os.environ, MS_ROLE="MS_SCHED", **cluster))
    os.environ.update(cluster, MS_ROLE="MS_WORKER", MS_NODE_ID=str(rank))


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


def _use_rank_table(path):
    from .ranktable import device_for_rank

    world = mpi_world()
    rank = world[0] if world else int(os.environ["RANK_ID"])
    device = device_for_rank(path, rank)
    _scrub_mpi_environment()
    os.environ.update(RANK_TABLE_FILE=os.path.abspath(path), RANK_ID=str(rank),
                      DEVICE_ID=str(device.device_id))
    if world:
        os.environ["RANK_SIZE"] = str(world[1])


def job_seed(info):
    """A random seed that every rank of the job agrees on (rank 0's, shared by AllReduce).

    Requests without a seed still have to sample the same token on every rank, or the ranks
    would feed different ids into the next step's collectives."""
    import numpy as np

    seed = int.from_bytes(os.urandom(3), "little")  # < 2**24: exact in float32
    if info.world_size == 1:
        return seed
    # float32: MindSpore's CPU AllReduce takes no int32
    mine = np.array([seed if info.rank == 0 else 0], np.float32)
    return int(_over_the_job("AllReduce", mine)[0])


def tensor_group(info, plan):
    """Create and name the communication group of this rank's tensor-parallel peers.

    None when the tensor group is the whole job (data = 1), or when there is nothing to
    communicate (tensor = 1). Ranks of one tensor group are consecutive."""
    if plan.data == 1 or plan.tensor == 1:
        return None
    from mindspore.communication import create_group

    replica = plan.data_rank(info.rank)
    name = f"msinfer_tensor_{replica}"
    create_group(name, list(range(replica * plan.tensor, (replica + 1) * plan.tensor)))
    return name


def all_gather_rows(rows):
    """Every rank's (n, width) float32 array stacked in rank order, on every rank."""
    return _over_the_job("AllGather", rows)


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
