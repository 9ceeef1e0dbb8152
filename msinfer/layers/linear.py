"""Layers that carry their own sharding, so the model file only composes them.

A layer is built from the style the shard plan gives its weight (`colwise`, `rowwise`,
`vocab`, `colwise_gather`, `replicate`); the style decides the collective that follows the
matmul, in one place. Layers hold primitives, not weights: the weights are arguments, so one
compiled graph of a decoder layer serves every layer of the model.

- explicit mode: the weights are this rank's slices; data moves only through collectives
  (AllReduce after row-parallel and vocab-parallel layers, AllGather after the vocab-split
  lm_head). No device-to-device copy anywhere, which is what Atlas 300I Duo requires.
- semi_auto mode: the weights are full-shape Parameters of the whole-model Cell and every
  primitive of the model gets an `in_strategy` through `shard()`, from `SemiAutoLayout` (which
  reads the shard plan); MindSpore inserts the collectives and redistributions.
At tensor degree 1 every collective is skipped, so one code path serves 1 and N ranks.
"""
import dataclasses

import mindspore as ms
from mindspore import nn, ops

from ..hardware import cpu_matmul_forms


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


def cpu_kernel_forms(ctx) -> bool:
    """Explicit mode on the CPU backend takes the forms measured better there: the weight
    layouts and product orders of hardware.cpu_matmul_forms (faster), and elementwise operands
    broadcast explicitly (`Expand`: leaner). Elsewhere the checkpoint's layout, x @ W.T and
    implicit broadcasting: semi_auto's strategies are written for them, and no device was at
    hand to measure."""
    return ctx.mode == "explicit" and ms.get_context("device_target") == "CPU"


def matmul_forms(ctx):
    """This process's hardware.CpuMatmulForms, or None where the checkpoint's forms hold."""
    return cpu_matmul_forms() if cpu_kernel_forms(ctx) else None


class Expand(nn.Cell):
    """An elementwise operand broadcast to the other operand's shape before the op, where
    `dense` (cpu_kernel_forms) and the op is large. MindSpore's CPU Add/Mul/RealDiv with a
    broadcast operand keep two int64 indices per output element for as long as their graph
    lives (16 bytes per element, 4x a float32 output; a scalar operand is exempt): measured, a
    (1, 2, 7, 256, 512) score-plus-mask Add holds 29 MB per compiled instance, the same Add
    after BroadcastTo 0.3 MB; a 256-token chunk's graphs held ~55 MB of them per layer. Small
    ops keep implicit broadcasting: a BroadcastTo is one more kernel launch, and nine per layer
    made 0.5B-shape batch-1 decode ~3% slower."""

    MIN_ELEMENTS = 1 << 12  # an op this large keeps 64 KiB of indices

    def __init__(self, dense):
        super().__init__()
        self.dense = dense

    def construct(self, operand, shape):
        elements = 1
        for size in shape:  # static shapes: decided when the graph compiles
            elements *= size
        if self.dense and elements >= self.MIN_ELEMENTS:
            return ops.broadcast_to(operand, shape)
        return operand


def shard(ctx, primitive, *strategy):
    """`primitive`, with `strategy` as its in_strategy in semi_auto mode (shard() does nothing
    stand-alone, and explicit mode never asks MindSpore to lay anything out)."""
    if ctx.mode == "semi_auto":
        primitive.shard(tuple(strategy))
    return primitive


class ParallelLinear(nn.Cell):
    """y = x @ W.T (+ b), W stored (out, in) as in the checkpoint, split per the plan; or
    y = x @ W with W stored (in, out) when `in_out`. `transposed` gives y.T = W @ x.T (W
    stored (out, in)), which callers take for x of `weight_first` = (first, last) rows (last
    None: no bound). The last two are explicit mode on CPU (hardware.cpu_matmul_forms)."""

    def __init__(self, ctx: ParallelContext, name: str, bias: bool = False, in_out=False,
                 weight_first=None):
        super().__init__()
        style = ctx.plan.style(name + ".weight")
        self.matmul = ops.MatMul(transpose_b=not in_out)
        self.weight_first_range = weight_first  # (first, last) rows, or None
        self.weight_first = ops.MatMul(transpose_b=True)
        self.weight_times = ops.MatMul()
        self.add = ops.Add()
        self.expand = Expand(cpu_kernel_forms(ctx))
        self.reduce = None
        self.vocab_gather = None
        if ctx.explicit_collectives and style == "rowwise":
            self.reduce = ctx.all_reduce()
        if ctx.explicit_collectives and style == "colwise_gather":
            self.tensor = ctx.plan.tensor
            self.tensor_rank = ctx.tensor_rank
            self.by_all_reduce = ctx.gather_by_all_reduce
            if self.by_all_reduce:
                self.vocab_gather = ctx.all_reduce()
            else:
                self.vocab_gather = (ops.AllGather(group=ctx.group) if ctx.group
                                     else ops.AllGather())
        if ctx.mode == "semi_auto":
            self.matmul.shard(ctx.plan.in_strategy(name + ".weight"))
            if bias:
                self.add.shard(ctx.plan.in_strategy(name + ".bias"))

    def construct(self, x, weight, bias=None):
        y = self.matmul(x, weight)
        if bias is not None:
            y = self.add(y, self.expand(bias, y.shape))
        if self.reduce is not None:
            y = self.reduce(y)
        if self.vocab_gather is not None:
            y = self._gather_columns(y)
        return y

    def weight_first_for(self, rows):
        """Whether x of `rows` rows takes (W @ x.T).T (static: decided when compiling)."""
        if self.weight_first_range is None:
            return False
        first, last = self.weight_first_range
        return rows >= first and (last is None or rows <= last)

    def transposed(self, x, weight, x_transposed=False):
        """y.T = W @ x.T, (out, rows), from x (rows, in) or, `x_transposed`, from x.T (in,
        rows); reduced or gathered as y is. The caller keeps it transposed as far as it can:
        on CPU a Transpose keeps an int64 index per element for the life of its graph, so a
        chain of weight-first layers transposes once, and the lm_head's is done on the host.
        No bias."""
        y = self.weight_times(weight, x) if x_transposed else self.weight_first(weight, x)
        if self.reduce is not None:
            y = self.reduce(y)
        if self.vocab_gather is not None:
            y = self._gather_rows(y)
        return y

    def _gather_columns(self, y):
        """Each rank holds a block of columns (vocabulary rows of the lm_head); put them side
        by side so column block r comes from tensor rank r."""
        rows, cols = y.shape
        if self.by_all_reduce:
            return self._sum_blocks(y, 1)
        # AllGather stacks the ranks' (rows, cols) blocks along dim 0.
        y = self.vocab_gather(y).reshape(self.tensor, rows, cols)
        return y.transpose(1, 0, 2).reshape(rows, self.tensor * cols)

    def _gather_rows(self, y_t):
        """_gather_columns of y.T: rank r's block of rows is rows block r."""
        if self.by_all_reduce:
            return self._sum_blocks(y_t, 0)
        return self.vocab_gather(y_t)  # AllGather stacks the ranks' blocks along dim 0

    def _sum_blocks(self, y, axis):
        """The ranks' blocks side by side along `axis` by an AllReduce: each rank puts its
        block at its place among zeros."""
        zeros = ops.zeros_like(y)
        blocks = [y if r == self.tensor_rank else zeros for r in range(self.tensor)]
        return self.vocab_gather(ops.concat(blocks, axis))


class ParallelEmbedding(nn.Cell):
    """Token embedding; with the `vocab` style each rank holds a block of rows, looks up the
    ids that fall in its block (zeros elsewhere) and the AllReduce assembles the result."""

    def __init__(self, ctx: ParallelContext, name: str):
        super().__init__()
        weight_name = name + ".weight"
        self.gather = ops.Gather()
        self.reduce = None
        if ctx.explicit_collectives and ctx.plan.style(weight_name) == "vocab":
            self.reduce = ctx.all_reduce()
            rows = ctx.plan.local_shape(weight_name)[0]
            self.vocab_start = ctx.tensor_rank * rows
            self.vocab_end = self.vocab_start + rows
        if ctx.mode == "semi_auto":
            self.gather.shard(ctx.plan.in_strategy(weight_name))

    def construct(self, ids, weight):
        if self.reduce is None:
            return self.gather(weight, ids, 0)
        inside = ops.logical_and(ids >= self.vocab_start, ids < self.vocab_end)
        local_ids = ops.where(inside, ids - self.vocab_start, ops.zeros_like(ids))
        rows = self.gather(weight, local_ids, 0)
        rows = rows * ops.expand_dims(inside, -1).astype(rows.dtype)
        return self.reduce(rows)
