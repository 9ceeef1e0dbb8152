"""How this process takes part in the model (`ParallelContext`), and semi_auto's layouts.

explicit mode: each rank holds its slices and the layers call collectives themselves.
semi_auto mode: every primitive of the model gets an `in_strategy` through `shard()`, from
`SemiAutoLayout` (which reads the shard plan); MindSpore inserts the collectives and
redistributions.
"""
import dataclasses

import mindspore as ms
from mindspore import ops


@dataclasses.dataclass(frozen=True)
class ParallelContext:
    """How this process takes part in the model: its shard plan, mode and tensor group."""

    config: object  # msinfer.config.ModelConfig
    plan: object  # msinfer.parallel.strategy.ShardPlan
    mode: str = "explicit"  # or "semi_auto"
    tensor_rank: int = 0
    group: str = None  # communication group of this rank's tensor-parallel peers
    dtype: object = None  # mindspore dtype of the weights and compute
    # The explicit-mode graph of dynamic shape a Cell is built for (planning.shapes.Graph):
    # what it decides when built that a graph of static shape decides from its shapes; None
    # for static shapes (semi_auto)
    graph: object = None

    @property
    def explicit_collectives(self) -> bool:
        return self.mode == "explicit" and self.plan.tensor > 1

    def all_reduce(self):
        return ops.AllReduce(group=self.group) if self.group else ops.AllReduce()

    @property
    def gather_by_all_reduce(self) -> bool:
        """MindSpore's CPU backend runs AllGather on the world group only; in a sub-group
        (data replicas) a gather is an AllReduce of zero-padded blocks instead."""
        return self.group is not None and ms.get_context("device_target") == "CPU"


class SemiAutoLayout:
    """The in_strategy of every primitive of the model under semi_auto, from the shard plan.

    Two kinds of tensors, two layouts. Dense activations are (tokens, features): tokens split
    over the `data` replicas, features as the linear layer that made them leaves them.
    Attention and the KV cache work per KV head: the head axis is split over the tensor ranks
    (`heads`), tokens are whole, because the cache holds every token of every sequence and
    ScatterUpdate cannot split the slot axis it writes; the data replicas compute attention
    alike. MindSpore redistributes between the two (an AllGather of tokens over the replicas).
    The fused q/k/v and gate/up outputs are seen as (tokens, rank blocks, block width): each
    rank's block of the full Parameter is its [q; k; v] (or [gate; up]) slice.
    """

    def __init__(self, plan):
        d = plan.data
        self.data = d
        self.heads = plan.tensor if _split(plan, "self_attn.qkv_proj") else 1
        self.mlp = plan.tensor if _split(plan, "mlp.gate_up_proj") else 1

    def rows(self, rank):
        """A dense activation of this rank: tokens split over the data replicas."""
        return (self.data,) + (1,) * (rank - 1)

    def per_head(self, rank, axis):
        """An attention tensor with its KV-head (or rank-block) axis at `axis`."""
        return tuple(self.heads if i == axis else 1 for i in range(rank))

    def mlp_blocks(self):
        """(tokens, rank blocks, width) of the gate/up output."""
        return (self.data, self.mlp, 1)


def _split(plan, module):
    return plan.style(f"model.layers.0.{module}.weight") == "colwise"


def shard(ctx, primitive, *strategy):
    """`primitive`, with `strategy` as its in_strategy in semi_auto mode (shard() does nothing
    stand-alone, and explicit mode never asks MindSpore to lay anything out)."""
    if ctx.mode == "semi_auto":
        primitive.shard(tuple(strategy))
    return primitive
