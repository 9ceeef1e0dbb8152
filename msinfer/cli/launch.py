"""`msinfer launch`: check the plan, then start one process per device under mpirun or msrun.

    msinfer launch --nproc 4 --strategy strategies/qwen2_tp4.yaml -- generate --model DIR ...
    msinfer launch --nproc 4 --strategy strategies/qwen2_tp4.yaml -- commtest
    msinfer launch --nproc 4 --tensor-parallel-size 4 -- serve --model DIR   (vLLM's spelling)

The rank command after `--` is any msinfer subcommand; for the ones that build a model
(MODEL_COMMANDS) the planner runs first, on this machine, in the parallel mode the rank command
or the strategy asks for, so a plan that cannot work on the hardware (too big, bf16 on 310P,
pipeline stages on cards without P2P copy, semi_auto where it cannot run) is refused before any
process starts. mpirun brings the whole job down as soon as one rank exits with an error.

`--dry-run` prints the command and the environment each rank will run with: what the launcher
sets, and what msinfer's own start-up (msinfer.distributed.rank_environment) makes of it.
On Ascend, the ranks also get HCCL's timeouts fit for a serving job (HCCL_TIMEOUTS) unless the
environment sets them.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading

from ..errors import MsinferError, PlanRefused
from ..hardware import AUTO, HARDWARE_CHOICES
from ..parallel.distributed import (bridge_environment, detect_launcher, free_port,
                                    rank_environment, spans_hosts)

# The msinfer commands that run inside every rank of a job; those that build a model
# (MODEL_COMMANDS) are planned before anything starts.
RANK_COMMANDS = ("generate", "serve", "commtest")
MODEL_COMMANDS = ("generate", "serve")
# What the dry run shows of each rank's environment (MPI variables are summarised).
_SHOWN = ("RANK_TABLE_FILE", "RANK_ID", "RANK_SIZE", "DEVICE_ID", "MS_ROLE", "MS_WORKER_NUM",
          "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_NODE_ID", "MSINFER_MULTI_HOST",
          "HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT")
# HCCL's watchdogs, in seconds, as an Ascend job's ranks get them unless the environment sets
# them (hccl_timeouts; docs/environment.md, "HCCL timeouts"). HCCL's defaults suit training:
# connect 120 s, and a collective waits 1836 s for a peer, so one stuck chip holds a service
# for half an hour. msinfer serve's own watchdog (--stall-timeout, 60 s by default) is the
# first line; these are the backstop, and the only watchdog of jobs it does not watch
# (generate, commtest).
HCCL_TIMEOUTS = {
    # Setting up the links between devices, when a group is set up or first used: first-run
    # graph compiles and weight loading put the ranks there minutes apart (HCCL: 120..7200).
    "HCCL_CONNECT_TIMEOUT": "600",
    # A device waiting in a collective for its peers. The longest legitimate wait is warm-up:
    # each graph's collectives wait for the rank slowest to compile that graph (a minute or
    # two at first run); a stuck chip is given up on after under 6 minutes. 5 x 68 s, since
    # the 310P (300I Duo) rounds the value down to a multiple of 68 s.
    "HCCL_EXEC_TIMEOUT": "340",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    from .args import add_tensor_parallel_size

    p = subparsers.add_parser(
        "launch", help="check the plan, then run a sharded job under mpirun or msrun",
        description="Plan, then start NPROC ranks that each run the given msinfer command.")
    p.add_argument("--nproc", type=int, required=True, help="processes (= world_size)")
    p.add_argument("--strategy", default=None,
                   help="strategy YAML (or the rank command's --strategy)")
    add_tensor_parallel_size(p)
    p.add_argument("--hardware", default=None, choices=HARDWARE_CHOICES, metavar="NAME",
                   help="hardware profile, or auto: the Ascend chips npu-smi lists, else cpu "
                        "(default: the rank command's --hardware, else auto); the ranks get "
                        "the profile chosen")
    p.add_argument("--launcher", choices=("mpirun", "msrun"), default="mpirun")
    p.add_argument("--hostfile", help="mpirun hostfile for several servers")
    p.add_argument("--rank-table",
                   help="HCCL rank table: Ascend rank-table mode under mpirun (default: an "
                        "exported RANK_TABLE_FILE)")
    p.add_argument("--timeout", type=int, default=None,
                   help="stop the whole job after this many seconds")
    p.add_argument("--log-dir", default="msrun_log", help="msrun's worker logs")
    p.add_argument("--dry-run", action="store_true",
                   help="print the command and each rank's environment, do not run it")
    # dest not "command": that is the subcommand's name, which cli.main's errors begin with
    p.add_argument("rank_command", nargs=argparse.REMAINDER, metavar="-- generate ...",
                   help="the msinfer command every rank runs")
    # The sibling subcommands' parsers read the rank command: no import of msinfer.cli.
    p.set_defaults(func=run, rank_parsers=subparsers.choices)


def run(args: argparse.Namespace) -> int:
    from ..hardware import choose_hardware, get_profile

    rank_args = list(args.rank_command)
    if rank_args and rank_args[0] == "--":
        rank_args = rank_args[1:]
    # Chosen once here (npu-smi runs once) and given to every rank that takes --hardware.
    args.hardware, args.hardware_choice = choose_hardware(
        args.hardware or _option_value(rank_args, "--hardware") or AUTO)
    profile = get_profile(args.hardware)
    commands = [c for c in RANK_COMMANDS if c in args.rank_parsers]
    if not rank_args or rank_args[0] not in commands:
        raise MsinferError(f"give the rank command after --, one of {', '.join(commands)}; "
                           f"e.g. `msinfer launch --nproc 4 --strategy S -- generate --model "
                           f"DIR ...`")
    parser = args.rank_parsers[rank_args[0]]
    if args.hostfile and args.launcher == "msrun":
        raise MsinferError(f"--hostfile {args.hostfile} is for --launcher mpirun; msrun starts "
                           f"the workers of one host (run it on each host instead)")
    args.rank_table = args.rank_table or _option_value(rank_args, "--rank-table")
    rank_table = _rank_table(args, profile)
    tp = args.tensor_parallel_size and str(args.tensor_parallel_size)
    for option, value in (("--strategy", args.strategy), ("--tensor-parallel-size", tp),
                          ("--hardware", args.hardware), ("--rank-table", rank_table)):
        if value and _accepts(parser, option):
            rank_args = _with_option(rank_args, option, value)
    rank = parser.parse_args(rank_args[1:])
    if args.hardware_choice != "given" and rank_args[0] not in MODEL_COMMANDS:
        print(f"msinfer launch: hardware {args.hardware}, {args.hardware_choice}",
              file=sys.stderr, flush=True)
    _check_plan(args, rank_args[0], rank, profile)
    _check_hosts(args, profile)
    args.rank_env = hccl_timeouts(profile.device_target, os.environ)
    command = (_mpirun_command(args, rank_args) if args.launcher == "mpirun"
               else _msrun_command(args, rank_args))
    print("msinfer launch: " + shlex.join(command), file=sys.stderr, flush=True)
    if args.dry_run:
        print(shlex.join(command))
        for r in range(args.nproc):
            print(describe_rank_environment(r, _launcher_environment(args, r, command),
                                            profile.device_target, rank_table))
        return 0
    return _run(command, args.timeout, args.rank_env, stop_grace(rank))


def hccl_timeouts(device_target: str, env) -> dict[str, str]:
    """HCCL_TIMEOUTS, with the values `env` already sets (not empty) in their place; {} off
    Ascend (HCCL is Ascend's collective library)."""
    if device_target != "Ascend":
        return {}
    return {key: env.get(key) or value for key, value in HCCL_TIMEOUTS.items()}


def _rank_table(args, profile):
    """The rank table the ranks use: --rank-table, else an exported RANK_TABLE_FILE under
    mpirun on Ascend (rank-table mode either way); checked here, before anything starts."""
    table = args.rank_table
    if table and args.launcher == "msrun":
        raise MsinferError(
            f"--rank-table {table}: msrun builds the job itself (worker i on device i) and "
            f"does not initialise it from a rank table; use --launcher mpirun with a rank "
            f"table, or msrun without one")
    if table and profile.device_target != "Ascend":
        raise MsinferError(f"--rank-table {table}: rank tables set up HCCL on Ascend; "
                           f"--hardware {profile.name} runs on {profile.device_target}")
    if not table and args.launcher == "mpirun" and profile.device_target == "Ascend":
        table = os.environ.get("RANK_TABLE_FILE") or None
        if table:
            print(f"msinfer launch: rank-table mode with the exported RANK_TABLE_FILE {table}",
                  file=sys.stderr)
    if table:
        from ..parallel.ranktable import check_file
        problems = check_file(table, args.nproc, profile.devices_per_server)
        if problems:
            raise MsinferError(f"{table} is not a usable rank table:\n  " + "\n  ".join(problems))
        table = os.path.abspath(table)
    return table


def _check_hosts(args, profile):
    hosts = len({_mpirun_placement(args, r)[2] for r in range(args.nproc)})
    if hosts > 1 and not profile.multi_server:
        raise PlanRefused(f"--hostfile {args.hostfile} places the {args.nproc} ranks on {hosts} "
                          f"hosts, and {profile.title} runs collectives within one server only")


def _accepts(parser, option):
    return option in parser._option_string_actions


def _option_value(argv, option):
    """The value of `option` in a command line (`--x V` or `--x=V`), else None."""
    for i, word in enumerate(argv):
        if word == option and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(option + "="):
            return word.split("=", 1)[1]
    return None


def _with_option(argv, option, value):
    if option in argv or any(a.startswith(option + "=") for a in argv):
        return argv
    return argv + [option, value]


def _check_plan(args, command, rank, profile):
    from ..config import load_config
    from ..planning.planner import check_plan_or_raise, format_plan
    from .args import job_strategy, limits_from_args
    from .plan import with_hardware_choice

    strategy = job_strategy(getattr(rank, "strategy", None) or args.strategy,
                            (getattr(rank, "tensor_parallel_size", None)
                             or args.tensor_parallel_size))
    if args.nproc != strategy.world_size:
        raise MsinferError(f"--nproc {args.nproc} but {strategy.source} has world_size "
                           f"{strategy.world_size}")
    if command not in MODEL_COMMANDS:
        return
    config = load_config(rank.model, getattr(rank, "quantization", "auto"))
    plan = check_plan_or_raise(config, strategy, profile, limits_from_args(config, rank),
                               dtype=getattr(rank, "dtype", None),
                               parallel_mode=getattr(rank, "parallel_mode", None),
                               speculative=getattr(rank, "speculative_config", None))
    print(with_hardware_choice(format_plan(plan), profile.name, args.hardware_choice),
          file=sys.stderr, flush=True)


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
        # Rank 0's scheduler (CPU/GPU bridge) must listen on an address the other hosts reach.
        command += ["--hostfile", args.hostfile, "-x", "MSINFER_MULTI_HOST=1"]
    elif args.nproc > (os.cpu_count() or 1):
        command.append("--oversubscribe")
    if args.timeout:
        command += ["--timeout", str(args.timeout)]
    for key, value in args.rank_env.items():  # -x: to the ranks on other hosts too
        command += ["-x", f"{key}={value}"]
    return command + [sys.executable, "-m", "msinfer"] + rank_args


def _msrun_command(args, rank_args):
    msrun = shutil.which("msrun") or os.path.join(os.path.dirname(sys.executable), "msrun")
    if not os.path.exists(msrun):
        raise MsinferError("msrun not found: it comes with MindSpore")
    # msinfer/__main__.py (the package's, not this cli/ directory's: there is none here)
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "__main__.py")
    return [msrun, f"--worker_num={args.nproc}", f"--local_worker_num={args.nproc}",
            f"--master_port={free_port()}", f"--log_dir={args.log_dir}", "--join=True",
            f"--cluster_time_out={args.timeout or 600}", script] + rank_args


# ---- the dry run: each rank's environment ----

def _launcher_environment(args, rank, command):
    """The variables the launcher gives rank `rank` (what mpirun or msrun export to it), on
    top of the launching shell's environment."""
    env = dict(os.environ, **args.rank_env)  # msrun's workers inherit them (_run)
    n = args.nproc
    if args.launcher == "msrun":
        # msrun's process manager (mindspore/parallel/cluster/process_entity/_api.py).
        port = next(a.split("=", 1)[1] for a in command if a.startswith("--master_port="))
        env.update(MS_ROLE="MS_WORKER", MS_WORKER_NUM=str(n), MS_SCHED_HOST="127.0.0.1",
                   MS_SCHED_PORT=port, MS_NODE_ID=str(rank), RANK_ID=str(rank),
                   DEVICE_ID=str(rank), RANK_SIZE=str(n))
        return env
    local_rank, local_size, _ = _mpirun_placement(args, rank)
    env.update(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_SIZE=str(n),
               OMPI_COMM_WORLD_LOCAL_RANK=str(local_rank),
               OMPI_COMM_WORLD_LOCAL_SIZE=str(local_size))
    for i, word in enumerate(command[:-1]):
        if word == "-x" and "=" in command[i + 1]:
            key, value = command[i + 1].split("=", 1)
            env[key] = value
    # What `import mindspore` does with them (mindspore.communication.management
    # _set_rank_from_mpi): the rank's code starts from there.
    env.update(RANK_ID=str(rank), DEVICE_ID=str(local_rank), RANK_SIZE=str(n))
    return env


def _mpirun_placement(args, rank):
    """(local rank, ranks on that host, host number) as mpirun maps ranks by slot over the
    hostfile's hosts in order."""
    if not args.hostfile:
        return rank, args.nproc, 0
    slots = []
    try:
        with open(args.hostfile) as f:
            for line in f:
                words = line.split("#", 1)[0].split()
                if words:
                    found = [w.split("=", 1)[1] for w in words[1:] if w.startswith("slots=")]
                    slots.append(int(found[0]) if found else 1)
    except (OSError, ValueError) as e:
        raise MsinferError(f"--hostfile {args.hostfile}: cannot read it: {e}") from None
    first = 0
    for host, count in enumerate(slots):
        if rank < first + count:
            return rank - first, min(count, args.nproc - first), host
        first += count
    raise MsinferError(f"--hostfile {args.hostfile} has {first} slots for {args.nproc} ranks")


def describe_rank_environment(rank: int, env: dict[str, str], device_target: str,
                              rank_table: str | None) -> str:
    """One line: the launcher msinfer will detect in rank `rank` and the variables it runs
    with once msinfer's start-up has changed them."""
    launcher, table = detect_launcher(device_target, rank_table, env)
    changes = rank_environment(launcher, env, table)
    if launcher == "mpirun-bridge":
        host = "(rank-0-address)" if spans_hosts(env) else "127.0.0.1"
        changes.update(bridge_environment(rank, int(env["OMPI_COMM_WORLD_SIZE"]), host,
                                          "(rank-0-free-port)"))
    final = {k: v for k, v in {**env, **changes}.items() if v is not None}
    words = [f"{key}={final[key]}" for key in _SHOWN if key in final]
    mpi = sorted(k for k in env if k.startswith("OMPI_COMM_WORLD"))
    if mpi and all(changes.get(k, "") is None for k in mpi):
        words.append("OMPI_*=(removed)")
    elif mpi:
        words += [f"{k}={env[k]}" for k in mpi]
    return f"rank {rank} ({launcher}): " + " ".join(words)


# MindSpore's cluster code logs INFO lines at exit whatever GLOG_v says; below the level the
# user asked for, they are dropped on the way through.
_MINDSPORE_CHATTER = re.compile(r"^\[(INFO|WARNING|DEBUG)\] [A-Z_]+\(\d+,")


def _pump(source, sink):
    quiet = os.environ.get("GLOG_v", "2") >= "3"
    for line in source:
        if not (quiet and _MINDSPORE_CHATTER.match(line)):
            sink.write(line)
            sink.flush()


# After asking the job to stop (SIGTERM), how long it may take: at least STOP_GRACE_SECONDS;
# a server drains its requests (serve's --shutdown-timeout, 30 s by default), then its ranks
# leave together (an idle dp2 x tp2 job exits about 5 s after the signal, on a loaded 2-core
# machine): it gets its --shutdown-timeout and STOP_MARGIN_SECONDS.
STOP_GRACE_SECONDS = 45
STOP_MARGIN_SECONDS = 15


def stop_grace(rank: argparse.Namespace) -> float:
    """The seconds a job whose ranks run the command parsed as `rank` has to stop."""
    drain = getattr(rank, "shutdown_timeout", None)
    if drain is None:
        return STOP_GRACE_SECONDS
    return max(STOP_GRACE_SECONDS, drain + STOP_MARGIN_SECONDS)


class _Stop(Exception):
    """SIGTERM to the launcher: stop the job as Ctrl-C does."""


def _run(command, timeout, rank_env, grace=None):
    # msrun starts each worker with the `python` found on PATH: make it this interpreter.
    env = dict(os.environ, **rank_env, PATH=os.path.dirname(sys.executable) + os.pathsep +
               os.environ.get("PATH", ""))
    # Own process group, so an interrupt or a timeout takes every rank down with the launcher;
    # and a launcher killed outright (SIGKILL, no chance to stop it) takes mpirun/msrun along.
    process = subprocess.Popen(command, start_new_session=True, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               preexec_fn=die_with_parent)
    pumps = [threading.Thread(target=_pump, args=(process.stdout, sys.stdout), daemon=True),
             threading.Thread(target=_pump, args=(process.stderr, sys.stderr), daemon=True)]
    for pump in pumps:
        pump.start()

    def stop_on_sigterm(signum, frame):
        raise _Stop()

    previous = signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        code = process.wait(timeout=timeout)
    except (KeyboardInterrupt, _Stop, subprocess.TimeoutExpired) as stop:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop is enough
        code = _stop(process, grace)
        if isinstance(stop, subprocess.TimeoutExpired):
            print(f"msinfer launch: job stopped after --timeout {timeout}s", file=sys.stderr)
            return 124
        if code is None:
            return 130 if isinstance(stop, KeyboardInterrupt) else 143
    finally:
        signal.signal(signal.SIGTERM, previous)
    for pump in pumps:
        pump.join(timeout=5)
    return code


def die_with_parent():
    """In a child before exec: SIGTERM to it when the process that started it dies (Linux's
    PR_SET_PDEATHSIG); elsewhere nothing."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _stop(process, grace=None):
    """SIGTERM to every rank of the job on this host, then `grace` seconds (default
    STOP_GRACE_SECONDS) to finish (a server drains); the job's exit code when it did, else
    None after killing it all.

    The ranks (the launcher's children) are signalled themselves, not through mpirun: mpirun
    puts each rank in a process group of its own, and on a signal of its own it tears the job
    down rather than let it drain. What the ranks started (the CPU bridge's scheduler) ends
    with them. The job started a session of its own: what is left of it is killed at the end."""
    for pid, parent in _session_members(process.pid):
        if parent == process.pid:
            _signal(pid, signal.SIGTERM)
    try:
        return process.wait(timeout=STOP_GRACE_SECONDS if grace is None else grace)
    except subprocess.TimeoutExpired:
        for pid, _ in _session_members(process.pid):
            _signal(pid, signal.SIGKILL)
        process.wait()
        return None


def _session_members(session):
    """(pid, parent pid) of the processes in session `session` (from /proc)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        # After the name: state, ppid, pgrp, session. A zombie is gone already.
        if int(fields[3]) == session and fields[0] != "Z":
            members.append((int(entry), int(fields[1])))
    return members


def _signal(pid, sig):
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass