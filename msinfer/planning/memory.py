"""What one rank of the engine allocates within its limits (engine_config.EngineLimits): its
weights, its workspace and its KV cache pool, from the same formulas the planner reports and
the engine sizes itself with.

Pure arithmetic over a ShardPlan and a hardware profile: no MindSpore, no tokenizer, so
`msinfer plan` runs on a machine where neither is installed.
"""
from __future__ import annotations

import dataclasses

from ..hardware import DTYPE_BYTES, int8_kernels_available
from ..quantization import stored_bytes
from .kv_layout import CacheLayout
from .workspace import largest_call_bytes

# Share of the memory weights and workspace leave that the KV cache takes by default (the
# rest absorbs what the workspace estimate misses), as vLLM's gpu_memory_utilization.
KV_CACHE_UTILIZATION = 0.9


@dataclasses.dataclass
class EngineMemory:
    """What one rank of the engine allocates, in bytes, and its KV cache layout."""

    weights_bytes: int
    workspace_bytes: int
    capacity_bytes: int
    layout: CacheLayout = None  # None: no KV block fits beside the weights and workspace
    kv_budget_bytes: int = 0
    # speculative decoding's draft model, whole on every rank: its weights, and its KV cache
    # of the target's blocks (so the target's share of the budget is smaller)
    draft_weights_bytes: int = 0
    draft_block_bytes: int = 0

    @property
    def kv_cache_bytes(self):
        return self.layout.total_bytes if self.layout else 0

    @property
    def draft_kv_bytes(self):
        return self.layout.num_blocks * self.draft_block_bytes if self.layout else 0


TABLES = ("model.embed_tokens.weight", "lm_head.weight")


def held_table_bytes(config, profile, dtype_bytes):
    """Bytes per element of the embedding and lm_head: a quantized checkpoint's 16-bit
    tables stay 16-bit where the CPU kernels read them (layers/linear_methods.table_dtype:
    float32 compute on a host that builds int8_linear.cc), else the compute dtype's."""
    if (config.quantization is not None and profile.device_target == "CPU"
            and dtype_bytes == 4 and config.torch_dtype in ("float16", "bfloat16")
            and int8_kernels_available()):
        return 2
    return dtype_bytes


def engine_memory(shard_plan, profile, dtype, limits, tensor_rank=0, strict=True, draft=None,
                  verify_rows=0):
    """The engine's allocations on tensor rank `tensor_rank`: its weight slices, the workspace
    of its largest call, and the KV cache pool sized from the budget (kv_cache_memory, else
    KV_CACHE_UTILIZATION of what weights and workspace leave of the device, or of this rank's
    share of the host on CPU), never more than max_num_seqs sequences of max_model_len can use.
    `draft`: speculative decoding's draft model's ModelConfig (its weights, and a KV cache of
    as many blocks, share the budget); `verify_rows`: logits rows a verification may ask
    (speculative decoding). `strict`: raise when not even one block fits (the engine); else
    layout None (the planner)."""
    config = shard_plan.config
    dtype_bytes = DTYPE_BYTES[dtype]
    weights = 0
    table_bytes = held_table_bytes(config, profile, dtype_bytes)
    for name in config.parameter_shapes():
        sizes = [s.stop - s.start for s in shard_plan.slices(name, tensor_rank)]
        rows, cols = sizes[0], (sizes[1] if len(sizes) > 1 else 1)
        # int8 weights and their scales in a quantized checkpoint (quantization.py)
        weights += stored_bytes(config.quantization, name, rows, cols,
                                table_bytes if name in TABLES else dtype_bytes)
    draft_weights = draft_block = 0
    if draft is not None:
        draft_weights = sum(stored_bytes(draft.quantization, name, shape[0],
                                         shape[1] if len(shape) > 1 else 1, dtype_bytes)
                            for name, shape in draft.parameter_shapes().items())
        draft_block = CacheLayout.bytes_per_block(draft.num_layers, draft.num_kv_heads,
                                                  draft.head_dim, limits.block_size,
                                                  dtype_bytes)
    workspace = workspace_bytes(shard_plan, profile, dtype_bytes, limits, verify_rows)
    capacity = profile.usable_bytes
    if profile.shared_host_memory:
        capacity //= shard_plan.world_size
    budget = limits.kv_cache_memory
    if budget is None:
        budget = int(max(0, capacity - weights - draft_weights - workspace)
                     * KV_CACHE_UTILIZATION)
    cap = limits.max_num_seqs * -(-limits.max_model_len // limits.block_size)
    args = (config.num_layers, shard_plan.local_kv_heads, config.head_dim, limits.block_size,
            dtype_bytes)
    per_block = CacheLayout.bytes_per_block(*args)
    target_budget = budget * per_block // (per_block + draft_block)  # each block in both
    layout = None
    if strict or target_budget >= 2 * per_block:
        layout = CacheLayout.from_budget(target_budget, *args, max_blocks=cap)
    return EngineMemory(weights_bytes=weights, workspace_bytes=workspace,
                        capacity_bytes=capacity, layout=layout, kv_budget_bytes=budget,
                        draft_weights_bytes=draft_weights, draft_block_bytes=draft_block)


def workspace_bytes(shard_plan, profile, dtype_bytes, limits, verify_rows=0):
    """Runtime reserve plus the activations of `min_layers_per_graph` decoder layers (two on
    CPU) of the engine's largest call (a prefill chunk of max_prefill_tokens, or a decode step
    of max_num_seqs sequences, over max_model_len of context; an upper estimate:
    workspace.py), which bounds every compiled graph's activations (a graph runs no more
    layers than fit), plus float32 logits of max_num_seqs rows (or `verify_rows`, with
    speculative decoding, if more) over the whole vocabulary."""
    largest = largest_call_bytes(shard_plan, dtype_bytes, limits,
                                 layers=profile.min_layers_per_graph)
    logits = max(limits.max_num_seqs, verify_rows) * shard_plan.config.vocab_size * 4
    return profile.runtime_reserve_bytes + largest + logits


def draft_config(speculative):
    """The ModelConfig of speculative decoding's draft model (read from its directory), or
    None (no speculation, or a method without a model): engine_memory's `draft`."""
    if speculative is None or not speculative.model:
        return None
    from ..config import ModelConfig

    return ModelConfig.from_model_dir(speculative.model)


def verify_rows(speculative, limits):
    """The logits rows a verification may ask (engine_memory's `verify_rows`; 0 without
    speculation): a verification is a prefill chunk whose every position has logits, so at
    most max_prefill_tokens rows."""
    return 0 if speculative is None else limits.max_prefill_tokens
