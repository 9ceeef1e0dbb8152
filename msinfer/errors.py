"""User-facing errors: raised for bad input, printed by the CLI without a traceback."""


class MsinferError(Exception):
    """A problem the user can fix (bad file, bad value, impossible plan). CLI exit code 2."""

    exit_code = 2


class PlanRefused(MsinferError):
    """A legal request that the hardware cannot run (does not fit, no bf16, no P2P). Exit 1."""

    exit_code = 1
