"""`msinfer layouts`: every semi_auto primitive's in_strategy checked against MindSpore's
rules, on CPU."""
from ..hardware import PROFILES
from ..tools.layouts import format_report, run, to_json
from .args import add_model_and_strategy


def _run(args):
    report = run(args.model, args.strategy, args.hardware)
    print(to_json(report) if args.json else format_report(report))
    return 1 if "refused" in report or report["violations"] else 0


def register(subparsers):
    parser = subparsers.add_parser(
        "layouts", help="check every semi_auto primitive's in_strategy against MindSpore's "
                        "rules, on CPU",
        description="Builds the semi_auto model stand-alone on CPU (reduced sizes that keep "
                    "every split's divisibility), compiles a decode step and a prefill chunk, "
                    "reads each primitive call's input shapes and in_strategy from the "
                    "compiled graph and checks them with MindSpore 2.10's rules. Exit 0 clean, "
                    "1 with every violation named (or a plan semi_auto refuses), 2 bad input.")
    add_model_and_strategy(parser)
    parser.add_argument("--hardware", default="cpu", choices=sorted(PROFILES),
                        help="hardware profile: its compute dtype (default cpu)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=_run)
