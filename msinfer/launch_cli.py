"""`msinfer launch`: check the plan, then start one process per device under mpirun or msrun.

    msinfer launch --nproc 4 --strategy strategies/qwen2_tp4.yaml -- generate --model DIR ...
    msinfer launch --nproc 4 --strategy strategies/qwen2_tp4.yaml -- commtest

The planner runs first, on this machine, so a plan that cannot work on the hardware (too big,
bf16 on 310P, pipeline stages on cards without P2P copy) is refused before any process
starts. Every rank then runs `python -m msinfer generate ...`; mpirun brings the whole job
down as soon as one rank exits with an error.
"""
import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading

from .distributed import free_port
from .errors import MsinferError

# The msinfer commands every rank runs, and whether each runs a model (planned first).
RANK_COMMANDS = {"generate": True, "commtest": False}


def register_cli(subparsers):
    p = subparsers.add_parser(
        "launch", help="check the plan, then run a sharded job under mpirun or msrun",
        description="Plan, then start NPROC ranks that each run the given msinfer command.")
    p.add_argument("--nproc", type=int, required=True, help="processes (= world_size)")
    p.add_argument("--strategy", required=True, help="strategy YAML")
    p.add_argument("--hardware", default="cpu", help="hardware profile (default: cpu)")
    p.add_argument("--launcher", choices=("mpirun", "msrun"), default="mpirun")
    p.add_argument("--hostfile", help="mpirun hostfile for several servers")
    p.add_argument("--rank-table", help="HCCL rank table: Ascend rank-table mode under mpirun")
    p.add_argument("--timeout", type=int, default=None,
                   help="stop the whole job after this many seconds")
    p.add_argument("--log-dir", default="msrun_log", help="msrun's worker logs")
    p.add_argument("--dry-run", action="store_true", help="print the command, do not run it")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- generate|commtest ...",
                   help="the msinfer command every rank runs")
    p.set_defaults(func=run)


def run(args):
    rank_args = list(args.command)
    if rank_args and rank_args[0] == "--":
        rank_args = rank_args[1:]
    if not rank_args or rank_args[0] not in RANK_COMMANDS:
        raise MsinferError(f"give the rank command ({', '.join(RANK_COMMANDS)}) after --, e.g. "
                           "`msinfer launch --nproc 4 --strategy S -- generate --model DIR ...`")
    rank_args = _with_option(rank_args, "--strategy", args.strategy)
    rank_args = _with_option(rank_args, "--hardware", args.hardware)
    if args.rank_table:
        rank_args = _with_option(rank_args, "--rank-table", args.rank_table)
    rank_command = _parse_rank_command(rank_args)
    if RANK_COMMANDS[rank_args[0]]:
        _check_plan(args, rank_command)
    else:
        _check_world_size(args, rank_command)
    command = (_mpirun_command(args, rank_args) if args.launcher == "mpirun"
               else _msrun_command(args, rank_args))
    print("msinfer launch: " + shlex.join(command), file=sys.stderr, flush=True)
    if args.dry_run:
        print(shlex.join(command))
        return 0
    return _run(command, args.timeout)


def _with_option(argv, option, value):
    if option in argv or any(a.startswith(option + "=") for a in argv):
        return argv
    return argv + [option, value]


def _parse_rank_command(rank_args):
    from .cli import build_parser
    return build_parser().parse_args(rank_args)


def _check_world_size(args, rank_command):
    from .strategy import load_strategy

    strategy = load_strategy(rank_command.strategy)
    if args.nproc != strategy.world_size:
        raise MsinferError(f"--nproc {args.nproc} but {strategy.source} has world_size "
                           f"{strategy.world_size}")
    return strategy


def _check_plan(args, generate):
    from .config import load_config
    from .hardware import get_profile
    from .plan import DEFAULT_MAX_LEN, check_plan_or_raise, format_plan

    strategy = _check_world_size(args, generate)
    config = load_config(generate.model)
    max_len = generate.max_len or min(config.max_position_embeddings, DEFAULT_MAX_LEN)
    plan = check_plan_or_raise(config, strategy, get_profile(generate.hardware),
                               batch=generate.max_batch, max_len=max_len, dtype=generate.dtype)
    print(format_plan(plan), file=sys.stderr, flush=True)


def _mpirun_command(args, rank_args):
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise MsinferError("mpirun not found on PATH: install OpenMPI (Debian: openmpi-bin) "
                           "or use --launcher msrun")
    command = [mpirun, "-n", str(args.nproc), "--bind-to", "none",
               "-x", "PYTHONUNBUFFERED=1"]
    if os.geteuid() == 0:
        command.append("--allow-run-as-root")
    if args.hostfile:
        command += ["--hostfile", args.hostfile]
    elif args.nproc > (os.cpu_count() or 1):
        command.append("--oversubscribe")
    if args.timeout:
        command += ["--timeout", str(args.timeout)]
    return command + [sys.executable, "-m", "msinfer"] + rank_args


def _msrun_command(args, rank_args):
    msrun = shutil.which("msrun") or os.path.join(os.path.dirname(sys.executable), "msrun")
    if not os.path.exists(msrun):
        raise MsinferError("msrun not found: it comes with MindSpore")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__main__.py")
    return [msrun, f"--worker_num={args.nproc}", f"--local_worker_num={args.nproc}",
            f"--master_port={free_port()}", f"--log_dir={args.log_dir}", "--join=True",
            f"--cluster_time_out={args.timeout or 600}", script] + rank_args


# MindSpore's cluster code logs INFO lines at exit whatever GLOG_v says; below the level the
# user asked for, they are dropped on the way through.
_MINDSPORE_CHATTER = re.compile(r"^\[(INFO|WARNING|DEBUG)\] [A-Z_]+\(\d+,")


def _pump(source, sink):
    quiet = os.environ.get("GLOG_v", "2") >= "3"
    for line in source:
        if not (quiet and _MINDSPORE_CHATTER.match(line)):
            sink.write(line)
            sink.flush()


def _run(command, timeout):
    # msrun starts each worker with the `python` found on PATH: make it this interpreter.
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep +
               os.environ.get("PATH", ""))
    # Own process group, so an interrupt or a timeout takes every rank down with the launcher.
    process = subprocess.Popen(command, start_new_session=True, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pumps = [threading.Thread(target=_pump, args=(process.stdout, sys.stdout), daemon=True),
             threading.Thread(target=_pump, args=(process.stderr, sys.stderr), daemon=True)]
    for pump in pumps:
        pump.start()
    try:
        code = process.wait(timeout=timeout)
        for pump in pumps:
            pump.join(timeout=5)
        return code
    except (KeyboardInterrupt, subprocess.TimeoutExpired) as stop:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        if isinstance(stop, subprocess.TimeoutExpired):
            print(f"msinfer launch: job stopped after --timeout {timeout}s", file=sys.stderr)
            return 124
        return 130
