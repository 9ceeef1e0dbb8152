"""User-facing errors: raised for bad input, printed by the CLI without a traceback."""


class MsinferError(Exception):
    """A problem the user can fix (bad file, bad value, impossible plan). CLI exit code 2."""

    exit_code = 2


class PlanRefused(MsinferError):
    """A legal request that the hardware cannot run (does not fit, no bf16, no P2P). Exit 1."""

    exit_code = 1



class NonFiniteLogits(MsinferError):
    """Requests whose logits came out NaN or inf (LLM.generate raises it once every prompt has
    finished; `outputs` holds them all, the failed ones with finish_reason "error")."""

    exit_code = 1

    def __init__(self, message, outputs=None):
        super().__init__(message)
        self.outputs = outputs

def positive_int(value: object, where: str) -> int:
    """`value` when it is an integer >= 1 (not a bool), else MsinferError naming `where`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise MsinferError(f"{where} must be a positive integer, got {value!r}")
    return value
