"""`msinfer plan`: is this (model, strategy, hardware) legal, and does it fit? Runs without
MindSpore, tokenizers or jinja2 installed."""
import json

from ..config import load_config
from ..hardware import DTYPE_BYTES, PROFILES, get_profile
from ..parallel.strategy import PARALLEL_MODES, load_strategy
from ..planning.planner import format_plan, make_plan
from .args import add_engine_arguments, add_model_and_strategy, limits_from_args


def _run(args):
    config = load_config(args.model)
    strategy = load_strategy(args.strategy)
    profile = get_profile(args.hardware)
    plan = make_plan(config, strategy, profile, limits_from_args(config, args), args.dtype,
                     args.parallel_mode)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    return 0 if plan.fits else 1


def register(subparsers):
    parser = subparsers.add_parser(
        "plan", help="check a strategy against a model and hardware before launch",
        description="Says whether a shard plan is legal on the hardware and whether it fits: "
                    "memory per device, collectives per token, dtype, decode speed bound. "
                    "Exit 0 when it fits, 1 when it does not fit or is refused, 2 for bad input.")
    add_model_and_strategy(parser)
    parser.add_argument("--hardware", required=True, choices=sorted(PROFILES),
                        help="hardware profile")
    add_engine_arguments(parser)
    parser.add_argument("--parallel-mode", choices=PARALLEL_MODES, default=None,
                        help="default: the strategy's parallel_mode, else explicit")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES),
                        help="compute dtype (default: the hardware's policy)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=_run)
