"""`msinfer plan`: is this (model, strategy, hardware) legal, and does it fit? Runs without
MindSpore, tokenizers or jinja2 installed."""
import json

from ..config import load_config
from ..hardware import DTYPE_BYTES, choose_hardware, get_profile
from ..parallel.strategy import PARALLEL_MODES
from ..planning.planner import format_plan, make_plan
from .args import (add_engine_arguments, add_hardware_argument, add_model_and_strategy,
                   job_strategy, limits_from_args)


def _run(args):
    config = load_config(args.model, args.quantization)
    strategy = job_strategy(args.strategy, args.tensor_parallel_size)
    name, how = choose_hardware(args.hardware)
    plan = make_plan(config, strategy, get_profile(name), limits_from_args(config, args),
                     args.dtype, args.parallel_mode, args.speculative_config)
    if args.json:
        print(json.dumps({**plan.to_dict(), "hardware_choice": how}, indent=2))
    else:
        print(with_hardware_choice(format_plan(plan), name, how))
    return 0 if plan.fits else 1


def with_hardware_choice(text, name, how):
    """A plan's text with a line saying how --hardware auto chose its hardware (after the
    first line, which names it); unchanged when the hardware was given."""
    if how == "given":
        return text
    first, _, rest = text.partition("\n")
    return f"{first}\n  hardware   {name}: {how}\n{rest}"


def register(subparsers):
    parser = subparsers.add_parser(
        "plan", help="check a strategy against a model and hardware before launch",
        description="Says whether a shard plan is legal on the hardware and whether it fits: "
                    "memory per device, collectives per token, dtype, decode speed bound. "
                    "Exit 0 when it fits, 1 when it does not fit or is refused, 2 for bad input.")
    add_model_and_strategy(parser, tensor_parallel=True)
    # Required: a plan is often made for another machine than this one; `auto` plans for
    # this host's chips.
    add_hardware_argument(parser, required=True)
    add_engine_arguments(parser)
    parser.add_argument("--parallel-mode", choices=PARALLEL_MODES, default=None,
                        help="default: the strategy's parallel_mode, else explicit")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES),
                        help="compute dtype (default: the hardware's policy)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=_run)
