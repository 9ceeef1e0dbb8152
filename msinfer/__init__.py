"""msinfer: sharded, compiled Qwen2 inference with MindSpore on Ascend inference cards."""
from .errors import MsinferError, NonFiniteLogits, PlanRefused

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
