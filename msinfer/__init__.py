"""msinfer: sharded, compiled Qwen2 inference with MindSpore on Ascend inference cards."""
import os

from .errors import MsinferError, NonFiniteLogits, PlanRefused

# The C++ CPU kernels (layers/cpu_kernels) run OpenMP teams between MindSpore's own ops; an
# idle OpenMP thread that spins, libgomp's default, takes a core those ops need. libgomp
# reads this once, as it loads (with MindSpore, after this): measured under load, batch-16
# decode of a W8A8 Qwen2-0.5B shape took 220 ms of CPU per step instead of 303.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.2.0"

__all__ = ["LLM", "SamplingParams", "MsinferError", "PlanRefused", "NonFiniteLogits",
           "__version__"]


def __getattr__(name):
    # LLM pulls in MindSpore (seconds to import); the planner and rank-table tools do not need it.
    if name == "LLM":
        from .api import LLM
        return LLM
    if name == "SamplingParams":
        from .engine.sampling import SamplingParams
        return SamplingParams
    raise AttributeError(name)
