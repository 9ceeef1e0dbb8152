"""The parallel linear layer: column-, row- and vocabulary-split matmuls and their collectives.

A layer is built from the style the shard plan gives its weight (`colwise`, `rowwise`,
`colwise_gather`, `replicate`); the style decides the collective that follows the matmul, in
one place. Layers hold primitives, not weights: the weights are arguments, so one compiled
graph of a decoder layer serves every layer of the model.

- explicit mode: the weights are this rank's slices; data moves only through collectives
  (AllReduce after row-parallel layers, AllGather after the vocab-split lm_head). No
  device-to-device copy anywhere, which is what Atlas 300I Duo requires.
- semi_auto mode: the weights are full-shape Parameters and the matmul gets its in_strategy
  from the plan; MindSpore inserts the collectives and redistributions.
At tensor degree 1 every collective is skipped, so one code path serves 1 and N ranks.
"""
from mindspore import nn, ops

from ..hardware import rows_within
from .cpu_forms import Expand
from .linear_methods import TableMethod, method_class, semi_auto_method, table_dtype
from .parallel_context import ParallelContext


class ParallelLinear(nn.Cell):
    """y = x @ W.T (+ b), W stored (out, in) as in the checkpoint, split per the plan; or
    y = x @ W with W stored (in, out) when `in_out`. `transposed` gives y.T = W @ x.T (W
    stored (out, in)), which callers take for x of `weight_first` = (first, last) rows (last
    None: no bound). The last two are explicit mode on CPU (hardware.cpu_matmul_forms).
    `reduce` False: a row-parallel output stays partial (a caller that sums several partials
    reduces them once, as a MoE layer its experts and shared expert)."""

    def __init__(self, ctx: ParallelContext, name: str, bias: bool = False, in_out=False,
                 weight_first=None, reduce=True):
        super().__init__()
        style = ctx.plan.style(name + ".weight")
        # A quantized checkpoint's scheme (layers/linear_methods.py): its tensors and math;
        # None for a float weight (the matmuls below, in the forms they are asked for).
        self.method = quantized_method(ctx, name)
        self.bias_folded = self.method is not None and self.method.BIAS_FOLDED
        self.table = isinstance(self.method, TableMethod)  # one weight, not a tuple
        self.matmul = ops.MatMul(transpose_b=not in_out)
        self.weight_first_range = weight_first  # (first, last) rows, or None
        self.weight_first = ops.MatMul(transpose_b=True)
        self.weight_times = ops.MatMul()
        self.add = ops.Add()
        self.expand = Expand(ctx)
        self.reduce = None
        self.vocab_gather = None
        if reduce and ctx.explicit_collectives and style == "rowwise":
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
        """weight: a Tensor, or a quantized method's tuple of tensors (its TENSORS)."""
        if self.method is None:
            y = self.matmul(x, weight)
        elif self.table:
            y = self.method(x, weight)
        else:
            y = self.method(x, *weight)
        if bias is not None and not self.bias_folded:
            y = self.add(y, self.expand(bias, y.shape))
        if self.reduce is not None:
            y = self.reduce(y)
        if self.vocab_gather is not None:
            y = self._gather_columns(y)
        return y

    def weight_first_for(self, rows):
        """Whether x of `rows` rows takes (W @ x.T).T (static: decided when compiling)."""
        if self.method is not None:
            return False
        return rows_within(rows, self.weight_first_range)

    def transposed(self, x, weight, x_transposed=False):
        """y.T = W @ x.T, (out, rows), from x (rows, in) or, `x_transposed`, from x.T (in,
        rows); reduced or gathered as y is. The caller keeps it transposed as far as it can:
        on CPU a Transpose keeps an int64 index per element for the life of its graph, so a
        chain of weight-first layers transposes once, and the lm_head's is done on the host.
        No bias."""
        if self.method is not None:  # a quantized weight has one form: x @ W_q.T
            x = x.transpose(1, 0) if x_transposed else x
            if self.table:  # its kernel writes y.T itself
                return self.transposed_result(self.method.transposed(x, weight))
            y = self.method(x, *weight)
            return self.transposed_result(y.transpose(1, 0))
        y = self.weight_times(weight, x) if x_transposed else self.weight_first(weight, x)
        return self.transposed_result(y)

    def transposed_result(self, y):
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


def quantized_method(ctx, name):
    """The linear method of `name`'s scheme in a quantized checkpoint, None for FLOAT (and
    the lm_head's 16-bit table, where linear_methods.table_dtype holds it so)."""
    quantization = ctx.config.quantization
    if name == "lm_head" and table_dtype(ctx) is not None:
        return TableMethod(table_dtype(ctx))
    if quantization is None:
        return None
    scheme = quantization.scheme_at(name)  # in the layer `name` says (the layer's kind's)
    if scheme == "FLOAT":
        return None
    if ctx.mode == "semi_auto":
        return semi_auto_method(scheme)(ctx.plan.local_shape(name + ".weight")[1],
                                        strategy=ctx.plan.in_strategy(name + ".weight"))
    row_max = None
    if ctx.explicit_collectives and ctx.plan.style(name + ".weight") == "rowwise":
        row_max = RowMax(ctx)
    return method_class(scheme)(ctx.plan.local_shape(name + ".weight")[1], row_max=row_max)


class RowMax(nn.Cell):
    """The maximum over the tensor group of each rank's (rows, 1) column: each rank puts its
    column at its place among zeros and an AllReduce sums them (MindSpore's CPU AllReduce
    only sums; AllGather runs on the world group only)."""

    def __init__(self, ctx):
        super().__init__()
        self.tensor, self.tensor_rank = ctx.plan.tensor, ctx.tensor_rank
        self.sum = ctx.all_reduce()

    def construct(self, column):
        zeros = ops.zeros_like(column)
        blocks = [column if r == self.tensor_rank else zeros for r in range(self.tensor)]
        return ops.amax(self.sum(ops.concat(blocks, 1)), -1, True)
