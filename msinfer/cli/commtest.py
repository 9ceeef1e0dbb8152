"""`msinfer commtest`: time and check the job's collectives, inside every rank."""
from ..tools.commtest import DTYPES, run
from .args import add_hardware_argument


def register(subparsers):
    p = subparsers.add_parser(
        "commtest", help="time and check AllReduce/AllGather on the job's groups (every rank)",
        description="Run inside every rank (msinfer launch --nproc N -- commtest). Rank 0 "
                    "prints per size: avg time, algorithm and bus bandwidth (nccl-tests "
                    "definitions) and a success/failed check. Exit 1 if a check fails.")
    p.add_argument("--strategy", default=None,
                   help="strategy YAML: its tensor groups are measured too (default: the "
                        "world only)")
    add_hardware_argument(p)
    p.add_argument("--model", default=None,
                   help="model directory or preset: also estimate the time its collectives "
                        "take per decoded token from the measured sizes")
    p.add_argument("--rank-table", default=None, help="HCCL rank table (rank-table mode)")
    p.add_argument("--min-bytes", default="8", help="smallest message (default 8, as hccl_test)")
    p.add_argument("--max-bytes", default=None,
                   help="largest message, K/M/G = KiB/MiB/GiB (default 64M as hccl_test; "
                        "1M on --hardware cpu, where every byte crosses host sockets)")
    p.add_argument("--factor", type=int, default=2, help="size step factor (default 2)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="element type (default: the hardware's compute dtype)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per size (default 20)")
    p.add_argument("--warmup", type=int, default=5,
                   help="untimed calls first, at least one (it compiles); default 5")
    p.add_argument("--pairs", action="store_true",
                   help="also measure same-card vs cross-card pairs with two chips per card "
                        "(devices 2k and 2k+1 share a card); on by default on a 300I Duo")
    p.add_argument("--json", action="store_true", help="rank 0 prints one JSON object instead")
    p.add_argument("--output", metavar="FILE", help="rank 0 also writes the JSON to FILE")
    p.set_defaults(func=run)
