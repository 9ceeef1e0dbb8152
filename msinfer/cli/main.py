"""The `msinfer` command line: generate, serve, make-tiny-model, plan, ranktable, launch,
doctor, commtest.

One module of this package per subcommand, each defining its arguments beside the code they
drive (`register(subparsers)`); this file only assembles them. Modules that need MindSpore
import it inside their handlers: `plan` and `ranktable` stay fast and work on machines without
MindSpore.
"""
import argparse
import importlib
import os
import sys

from .. import __version__
from ..errors import MsinferError

SUBCOMMANDS = ("generate", "serve", "launch", "plan", "ranktable", "layouts", "doctor",
               "commtest", "make_tiny_model")


def build_parser():
    parser = argparse.ArgumentParser(
        prog="msinfer", description="Sharded, compiled Qwen2 inference with MindSpore.")
    parser.add_argument("--version", action="version", version=f"msinfer {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"{__package__}.{name}").register(subparsers)
    return parser


def main(argv=None):
    # MindSpore's own INFO/WARNING lines (plugin probing, cluster chatter) drown msinfer's
    # progress; keep its errors. GLOG_v is read when MindSpore is imported, so set it first.
    os.environ.setdefault("GLOG_v", "3")
    try:
        # An option's type may refuse its value with a MsinferError (--kv-cache-memory).
        args = build_parser().parse_args(argv)
    except MsinferError as e:
        words = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")]
        print(f"msinfer {words[0] if words else ''}: error: {e}".replace(" :", ":"),
              file=sys.stderr)
        return e.exit_code
    try:
        return args.func(args) or 0
    except MsinferError as e:
        print(f"msinfer {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


def run() -> None:
    """The process's entry point (`msinfer`, `python -m msinfer`): main(), then the exit. A
    rank of an mpirun job leaves skipping MindSpore's teardown (leave_if_mpirun_rank)."""
    from ..parallel.distributed import leave_if_mpirun_rank

    code = main()
    leave_if_mpirun_rank(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
