"""What one rank of the engine allocates: the engine's limits, its weights, its workspace and
its KV cache pool, from the same formulas the planner reports and the engine sizes itself with.

Pure arithmetic over a ShardPlan and a hardware profile: no MindSpore, no tokenizer, so
`msinfer plan` runs on a machine where neither is installed.
"""
from __future__ import annotations

import dataclasses
import numbers
import re

from ..errors import MsinferError, positive_int
from ..hardware import DTYPE_BYTES
from ..quantization import stored_bytes
from .kv_layout import DEFAULT_BLOCK_SIZE, CacheLayout
from .workspace import largest_call_bytes

DEFAULT_MAX_LEN = 4096  # the longest sequence when none is asked for


DEFAULT_MAX_NUM_SEQS = 16


DEFAULT_MAX_PREFILL_TOKENS = 256


# Share of the memory weights and workspace leave that the KV cache takes by default (the
# rest absorbs what the workspace estimate misses), as vLLM's gpu_memory_utilization.
KV_CACHE_UTILIZATION = 0.9


GRAPH_SHAPES = ("dynamic", "static")  # EngineLimits.graph_shapes, the default first


@dataclasses.dataclass(frozen=True)
class EngineLimits:
    """The engine's knobs that decide its memory: the longest sequence, the KV block size, the
    prefill chunk, the sequences decoded together, and the KV cache budget (None: what is
    left on the device)."""

    max_len: int = DEFAULT_MAX_LEN
    block_size: int = DEFAULT_BLOCK_SIZE
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    kv_cache_memory: int = None
    # Explicit mode's graphs (planning/shapes.py): "dynamic", a few of dynamic shape whatever
    # max_len, or "static", one per call shape: many more to compile, calls a little faster
    # on the CPU backend (docs/engine.md, "Compiled graphs")
    graph_shapes: str = GRAPH_SHAPES[0]

    def __post_init__(self):
        for field in ("max_len", "block_size", "max_prefill_tokens", "max_num_seqs"):
            positive_int(getattr(self, field), field)
        if self.block_size < 2:
            # the reserved block holds padded tokens' writes and, apart, the zeros padded
            # context positions read (engine/model_runner.py)
            raise MsinferError(f"block_size must be at least 2, got {self.block_size}")
        if self.kv_cache_memory is not None:
            positive_int(self.kv_cache_memory, "kv_cache_memory")
        if self.graph_shapes not in GRAPH_SHAPES:
            raise MsinferError(f"graph_shapes must be one of {', '.join(GRAPH_SHAPES)}, got "
                               f"{self.graph_shapes!r}")

    @classmethod
    def for_model(cls, config, max_len=None, block_size=None, max_prefill_tokens=None,
                  max_num_seqs=None, kv_cache_memory=None, graph_shapes=None):
        """Defaults filled in; max_len at most the model's context (max_position_embeddings,
        or what its yarn rope scaling reaches: config.max_context_len); kv_cache_memory in
        bytes or as parse_bytes reads it ("2GiB")."""
        if max_len is None:
            max_len = default_max_len(config)
        positive_int(max_len, "max_len")
        if max_len > config.max_context_len:
            scaled = config.rope_scaling
            reach = (f" (rope_scaling yarn x{scaled.factor:g} of "
                     f"{scaled.original_max_position_embeddings}: {config.max_context_len})"
                     if config.max_context_len > config.max_position_embeddings else "")
            raise MsinferError(f"max_len {max_len} exceeds the model's "
                               f"max_position_embeddings {config.max_position_embeddings}"
                               f"{reach}")
        def given(value, default):
            return default if value is None else value

        if kv_cache_memory is not None:
            kv_cache_memory = parse_bytes(kv_cache_memory, "kv_cache_memory")
        max_prefill_tokens = given(max_prefill_tokens, DEFAULT_MAX_PREFILL_TOKENS)
        if isinstance(max_prefill_tokens, int) and isinstance(max_len, int):
            max_prefill_tokens = min(max_prefill_tokens, max_len)  # no chunk beyond a sequence
        return cls(max_len=max_len, block_size=given(block_size, DEFAULT_BLOCK_SIZE),
                   max_prefill_tokens=max_prefill_tokens,
                   max_num_seqs=given(max_num_seqs, DEFAULT_MAX_NUM_SEQS),
                   kv_cache_memory=kv_cache_memory,
                   graph_shapes=given(graph_shapes, GRAPH_SHAPES[0]))


@dataclasses.dataclass
class EngineMemory:
    """What one rank of the engine allocates, in bytes, and its KV cache layout."""

    weights_bytes: int
    workspace_bytes: int
    capacity_bytes: int
    layout: CacheLayout = None  # None: no KV block fits beside the weights and workspace
    kv_budget_bytes: int = 0

    @property
    def kv_cache_bytes(self):
        return self.layout.total_bytes if self.layout else 0


def engine_memory(shard_plan, profile, dtype, limits, tensor_rank=0, strict=True):
    """The engine's allocations on tensor rank `tensor_rank`: its weight slices, the workspace
    of its largest call, and the KV cache pool sized from the budget (kv_cache_memory, else
    KV_CACHE_UTILIZATION of what weights and workspace leave of the device, or of this rank's
    share of the host on CPU), never more than max_num_seqs sequences of max_len can use.
    `strict`: raise when not even one block fits (the engine); else layout None (the planner).
    """
    config = shard_plan.config
    dtype_bytes = DTYPE_BYTES[dtype]
    weights = 0
    for name in config.parameter_shapes():
        sizes = [s.stop - s.start for s in shard_plan.slices(name, tensor_rank)]
        rows, cols = sizes[0], (sizes[1] if len(sizes) > 1 else 1)
        # int8 weights and their scales in a quantized checkpoint (quantization.py)
        weights += stored_bytes(config.quantization, name, rows, cols, dtype_bytes)
    workspace = workspace_bytes(shard_plan, profile, dtype_bytes, limits)
    capacity = profile.usable_bytes
    if profile.shared_host_memory:
        capacity //= shard_plan.world_size
    budget = limits.kv_cache_memory
    if budget is None:
        budget = int(max(0, capacity - weights - workspace) * KV_CACHE_UTILIZATION)
    cap = limits.max_num_seqs * -(-limits.max_len // limits.block_size)
    args = (config.num_layers, shard_plan.local_kv_heads, config.head_dim, limits.block_size,
            dtype_bytes)
    per_block = CacheLayout.bytes_per_block(*args)
    layout = None
    if strict or budget >= 2 * per_block:
        layout = CacheLayout.from_budget(budget, *args, max_blocks=cap)
    return EngineMemory(weights_bytes=weights, workspace_bytes=workspace,
                        capacity_bytes=capacity, layout=layout, kv_budget_bytes=budget)


def workspace_bytes(shard_plan, profile, dtype_bytes, limits):
    """Runtime reserve plus the activations of `min_layers_per_graph` decoder layers (two on
    CPU) of the engine's largest call (a prefill chunk of max_prefill_tokens, or a decode step
    of max_num_seqs sequences, over max_len of context; an upper estimate: workspace.py), which
    bounds every compiled graph's activations (a graph runs no more layers than fit), plus
    float32 logits of max_num_seqs rows over the whole vocabulary."""
    largest = largest_call_bytes(shard_plan, dtype_bytes, limits.max_len,
                                 limits.max_prefill_tokens, limits.max_num_seqs,
                                 layers=profile.min_layers_per_graph)
    logits = limits.max_num_seqs * shard_plan.config.vocab_size * 4
    return profile.runtime_reserve_bytes + largest + logits


def default_max_len(config) -> int:
    """The longest sequence when none is asked for: DEFAULT_MAX_LEN, or fewer when the
    model's max_position_embeddings is smaller."""
    return min(config.max_position_embeddings, DEFAULT_MAX_LEN)


def parse_bytes(text, what="--kv-cache-memory"):
    """A byte count from an int or a string: '2147483648', '512MiB', '2GiB', '1.5GB', '64KiB'
    (binary units KiB/MiB/GiB/TiB, decimal kB/MB/GB/TB, B; case-insensitive) -> int bytes.
    The one parser of --kv-cache-memory (the CLI's argparse type) and of
    LLM(kv_cache_memory=...); `what` names the value in the error."""
    if isinstance(text, bool):
        raise MsinferError(f"{what} {text!r}: expected bytes like 2147483648, 512MiB or 2GiB")
    if isinstance(text, numbers.Integral):
        value, factor, whole = int(text), 1, True
    else:
        match = _BYTES.match(str(text))
        if match is None:
            raise MsinferError(f"{what} {text!r}: expected bytes like 2147483648, 512MiB or "
                               f"2GiB")
        number, unit = match.group(1), (match.group(2) or "b").lower()
        factor, whole = _BYTE_UNITS[unit], "." not in number and "e" not in number.lower()
        value = int(number) if whole else float(number)
    result = value * factor if whole else int(value * factor)
    if result < 1:
        raise MsinferError(f"{what} {text!r}: must be at least one byte")
    return result


_BYTE_UNITS = {"b": 1, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40,
               "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12}
_BYTES = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+)\s*"
                    r"(b|kib|mib|gib|tib|kb|mb|gb|tb)?\s*$", re.IGNORECASE)
