"""`msinfer doctor`: can this box run this plan? Devices, software, launch set-up, model,
logs."""
from ..tools.doctor import DEFAULT_ASCEND_ROOT, run
from .args import add_hardware_argument


def register(subparsers):
    p = subparsers.add_parser(
        "doctor", help="check this box (devices, software, launch setup, model, logs)",
        description="Checks whether this box can run this plan: each check passes, warns, "
                    "fails or is skipped, with one line saying what to do. Exit 1 if a check "
                    "fails, 2 for bad input.")
    add_hardware_argument(p)
    p.add_argument("--strategy", help="strategy YAML the box must serve")
    p.add_argument("--rank-table", help="HCCL rank table to check (default: RANK_TABLE_FILE)")
    p.add_argument("--model", help="model directory or preset: plan it on this hardware")
    p.add_argument("--logs", metavar="DIR", help="scan plog / device logs for known failures")
    p.add_argument("--ascend-root", default=DEFAULT_ASCEND_ROOT,
                   help=f"where driver, firmware and CANN are installed "
                        f"(default {DEFAULT_ASCEND_ROOT})")
    p.add_argument("--hccn-conf", default="/etc/hccn.conf",
                   help="device NIC addresses, for multi-server rank tables")
    p.add_argument("--skip", action="append", default=[], metavar="NAME",
                   help="skip checks whose name starts with NAME (repeatable)")
    p.add_argument("--json", action="store_true",
                   help='print {"ok": bool, "checks": [{"name", "status", "detail"}]}')
    p.set_defaults(func=run)
