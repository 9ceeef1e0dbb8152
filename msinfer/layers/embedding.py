"""The token embedding, split by vocabulary rows (`vocab`) or whole on every rank; a
quantized checkpoint's 16-bit table (linear_methods.table_dtype) read by a kernel that
upcasts the rows it gathers."""
from mindspore import nn, ops

from .linear_methods import TableRows, table_dtype
from .parallel_context import ParallelContext


class ParallelEmbedding(nn.Cell):
    """Token embedding; with the `vocab` style each rank holds a block of rows, looks up the
    ids that fall in its block (zeros elsewhere) and the AllReduce assembles the result."""

    def __init__(self, ctx: ParallelContext, name: str):
        super().__init__()
        weight_name = name + ".weight"
        self.gather = ops.Gather()
        dtype = table_dtype(ctx)
        self.table_rows = TableRows(dtype) if dtype is not None else None
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
            return self.rows(weight, ids)
        inside = ops.logical_and(ids >= self.vocab_start, ids < self.vocab_end)
        local_ids = ops.where(inside, ids - self.vocab_start, ops.zeros_like(ids))
        rows = self.rows(weight, local_ids)
        rows = rows * ops.expand_dims(inside, -1).astype(rows.dtype)
        return self.reduce(rows)

    def rows(self, weight, ids):
        if self.table_rows is not None:
            return self.table_rows(weight, ids)
        return self.gather(weight, ids, 0)
