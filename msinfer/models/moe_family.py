"""What Qwen2-MoE and Qwen3-MoE (models/qwen2_moe.py, qwen3_moe.py) share over their dense
families: a layer's MLP is dense or sparse by the config (ModelConfig.is_sparse_layer), the
weight names follow each layer's class, and a sparse layer's stacked experts are shaped at
load as layers/moe.py takes them.

A layer class stands for every layer of its kind: its Cells take their shard styles from the
first layer of that kind (strategy.first_layer), as a dense model's take them from layer 0.
"""
import numpy as np

from ..layers.cpu_forms import matmul_forms
from ..layers.mlp import SwiGLU
from ..layers.moe import SparseMoE, uses_moe_primitives
from ..parallel.strategy import first_layer
from . import qwen2

# A sparse layer's MLP weights, in the order its construct takes them.
SPARSE_MLP_WEIGHTS = ("mlp.gate.weight", "mlp.experts.gate_up_proj.weight",
                      "mlp.experts.down_proj.weight")
SHARED_EXPERT_WEIGHTS = ("mlp.shared_expert.gate_up_proj.weight",
                         "mlp.shared_expert.down_proj.weight", "mlp.shared_expert_gate.weight")
_STACKED = ("mlp.experts.gate_up_proj.weight", "mlp.experts.down_proj.weight")
# The shared expert is a dense MLP: held (in, out) where the dense one is (qwen2.IN_OUT_WEIGHTS)
_SHARED_IN_OUT = SHARED_EXPERT_WEIGHTS[:2]


def dense_mlp(ctx):
    return SwiGLU(ctx, f"model.layers.{first_layer(ctx.config, sparse=False)}.mlp")


def sparse_mlp(ctx):
    return SparseMoE(ctx, f"model.layers.{first_layer(ctx.config)}.mlp")


def layer_classes(config, dense, sparse) -> tuple:
    return tuple(sparse if config.is_sparse_layer(n) else dense
                 for n in range(config.num_layers))


def weight_names(config, classes) -> list:
    """Every weight the model takes, each once, in load order."""
    return qwen2.weight_names(
        config, lambda n: [f"model.layers.{n}.{w}" for w in classes[n].WEIGHTS])


def weight_layout(ctx, name, array):
    """A loaded weight in the layout this process's graphs take: a sparse layer's stacked
    experts (loaded as their parts' rows one after another) as (experts, 2I, hidden) for
    gate/up ((experts, hidden, 2I) where the MoE primitives run them) and (experts, I, hidden)
    for down (layers/moe.py); the shared expert's projections as the dense MLP's; the rest as
    the dense family's."""
    if name.endswith(_STACKED):
        experts = len(ctx.plan.local_experts(name, ctx.tensor_rank))
        stacked = array.reshape(experts, -1, array.shape[-1])
        if name.endswith(_STACKED[1]) or uses_moe_primitives():  # as x @ W per expert
            return np.ascontiguousarray(stacked.transpose(0, 2, 1))
        return stacked
    forms = matmul_forms(ctx)
    if forms is not None and forms.in_out and name.endswith(_SHARED_IN_OUT):
        return np.ascontiguousarray(array.T)
    return qwen2.weight_layout(ctx, name, array)
