"""Layers that carry their own sharding, so the model file only composes them.

Each layer is built from its checkpoint name and asks the shard plan how that weight is split
(`colwise`, `rowwise`, `vocab`, `colwise_gather`, `replicate`). That style decides both the
parameter's shape and the collective that follows the matmul, in one place:

- explicit mode: the parameter holds this rank's slice; data moves only through collectives
  (AllReduce after row-parallel and vocab-parallel layers, AllGather after the vocab-split
  lm_head). No device-to-device copy anywhere, which is what Atlas 300I Duo requires.
- semi_auto mode: the parameter has its full shape and the primitive gets the plan's
  `in_strategy` through `shard()`; MindSpore inserts the collectives.
At tensor degree 1 every collective is skipped, so one code path serves 1 and N ranks.
"""
import dataclasses
import functools

from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Zero


@dataclasses.dataclass(frozen=True)
class ParallelContext:
    """How this process takes part in the model: its shard plan, mode and tensor group."""

    config: object  # msinfer.config.ModelConfig
    plan: object  # msinfer.strategy.ShardPlan
    mode: str = "explicit"  # or "semi_auto"
    tensor_rank: int = 0
    group: str = None  # communication group of this rank's tensor-parallel peers
    dtype: object = None  # mindspore dtype of the weights and compute

    @property
    def explicit_collectives(self):
        return self.mode == "explicit" and self.plan.tensor > 1

    @functools.cached_property
    def _full_shapes(self):
        return self.config.parameter_shapes()

    def parameter_shape(self, name):
        if self.mode == "explicit":
            return tuple(self.plan.local_shape(name))
        return tuple(self._full_shapes[name])

    def new_parameter(self, name):
        """An uninitialised parameter for checkpoint tensor `name`; the loader fills it."""
        shape = self.parameter_shape(name)
        return Parameter(Tensor(shape=shape, dtype=self.dtype, init=Zero()),
                         name=name, requires_grad=False)

    def all_reduce(self):
        return ops.AllReduce(group=self.group) if self.group else ops.AllReduce()

    def all_gather(self):
        return ops.AllGather(group=self.group) if self.group else ops.AllGather()

    @property
    def gather_by_all_reduce(self):
        """MindSpore's CPU backend runs AllGather on the world group only; in a sub-group
        (data replicas) a gather is an AllReduce of zero-padded blocks instead."""
        import mindspore as ms
        return self.group is not None and ms.get_context("device_target") == "CPU"


class ParallelLinear(nn.Cell):
    """y = x @ W.T (+ b), W stored (out, in) as in the checkpoint, split per the plan."""

    def __init__(self, ctx, name, bias=False, weight=None):
        """`weight`: an existing parameter to share (the tied lm_head uses the embedding's)."""
        super().__init__()
        self.style = ctx.plan.style(name + ".weight")
        self.weight = weight if weight is not None else ctx.new_parameter(name + ".weight")
        self.checkpoint_names = {} if weight is not None else {name + ".weight": self.weight}
        self.bias = None
        if bias:
            self.bias = ctx.new_parameter(name + ".bias")
            self.checkpoint_names[name + ".bias"] = self.bias
        self.matmul = ops.MatMul(transpose_b=True)
        self.add = ops.Add()
        self.reduce = self.gather = None
        if ctx.explicit_collectives and self.style == "rowwise":
            self.reduce = ctx.all_reduce()
        if ctx.explicit_collectives and self.style == "colwise_gather":
            self.tensor = ctx.plan.tensor
            self.tensor_rank = ctx.tensor_rank
            self.gather_by_all_reduce = ctx.gather_by_all_reduce
            self.gather = ctx.all_reduce() if self.gather_by_all_reduce else ctx.all_gather()
        if ctx.mode == "semi_auto":
            self.matmul.shard(ctx.plan.in_strategy(name + ".weight"))
            if bias:
                self.add.shard(ctx.plan.in_strategy(name + ".bias"))

    def construct(self, x):
        y = self.matmul(x, self.weight)
        if self.bias is not None:
            y = self.add(y, self.bias)
        if self.reduce is not None:
            y = self.reduce(y)
        if self.gather is not None and self.gather_by_all_reduce:
            zeros = ops.zeros_like(y)
            blocks = [y if r == self.tensor_rank else zeros for r in range(self.tensor)]
            y = self.gather(ops.concat(blocks, 1))
        elif self.gather is not None:
            # AllGather stacks the ranks' (rows, vocab/tp) blocks along dim 0; put them side
            # by side so column block r holds vocab rows [r*V/tp, (r+1)*V/tp).
            rows, cols = y.shape
            y = self.gather(y).reshape(self.tensor, rows, cols)
            y = y.transpose(1, 0, 2).reshape(rows, self.tensor * cols)
        return y


class ParallelEmbedding(nn.Cell):
    """Token embedding; with the `vocab` style each rank holds a block of rows, looks up the
    ids that fall in its block (zeros elsewhere) and the AllReduce assembles the result."""

    def __init__(self, ctx, name):
        super().__init__()
        weight_name = name + ".weight"
        self.style = ctx.plan.style(weight_name)
        self.weight = ctx.new_parameter(weight_name)
        self.checkpoint_names = {weight_name: self.weight}
        self.gather = ops.Gather()
        self.reduce = None
        if ctx.explicit_collectives and self.style == "vocab":
            self.reduce = ctx.all_reduce()
            rows = self.weight.shape[0]
            self.vocab_start = ctx.tensor_rank * rows
            self.vocab_end = self.vocab_start + rows
        if ctx.mode == "semi_auto":
            self.gather.shard(ctx.plan.in_strategy(weight_name))

    def construct(self, ids):
        if self.reduce is None:
            return self.gather(self.weight, ids, 0)
        inside = ops.logical_and(ids >= self.vocab_start, ids < self.vocab_end)
        local_ids = ops.where(inside, ids - self.vocab_start, ops.zeros_like(ids))
        rows = self.gather(self.weight, local_ids, 0)
        rows = rows * ops.expand_dims(inside, -1).astype(rows.dtype)
        return self.reduce(rows)


def checkpoint_parameters(cell):
    """{checkpoint name: Parameter} for every layer below `cell` (tied weights appear once)."""
    found = {}
    for _, sub in cell.cells_and_names():
        found.update(getattr(sub, "checkpoint_names", {}))
    return found
