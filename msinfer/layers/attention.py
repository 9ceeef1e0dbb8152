"""Attention over a paged KV cache: write this call's K/V, gather each group's context, attend.

A call works on G groups of Q queries, each group over its own gathered context of T cache
slots: a prefill chunk is G=1 (the chunk's tokens, possibly of several sequences, over the
concatenation of their contexts, with a mask keeping each token to its own sequence's earlier
positions); a decode step is G=batch, Q=1. The slot arithmetic is planning/kv_layout.py's.

Explicit mode holds each cache as rows of one head's vector, (slots x kv_heads, head_dim),
and reads the context by head (no Transpose: on the CPU backend its kernel keeps an int64 index
per element for the life of the graph); semi_auto keeps (slots, kv_heads, head_dim), whose head
axis MindSpore splits over the tensor ranks.
"""
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Zero

from .cpu_forms import Expand
from .parallel_context import SemiAutoLayout, shard


def new_cache(shape, dtype, name=None):
    """One layer's K or V cache, zeros, updated in place by the graphs: a Parameter when named
    (owned by a Cell: semi_auto), else a Tensor passed to the graphs as an argument."""
    zeros = Tensor(shape=shape, dtype=dtype, init=Zero())
    if name is None:
        return zeros.init_data()
    return Parameter(zeros, name=name, requires_grad=False)



class PagedAttention(nn.Cell):
    """softmax(q k^T / sqrt(d) + mask) v for `heads` query heads over `kv_heads` KV heads
    (grouped: query head j uses KV head j // (heads / kv_heads)), with this call's K/V written
    to the caches first."""

    def __init__(self, ctx, heads, kv_heads, head_dim):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.groups = heads // kv_heads
        self.scale = Tensor(head_dim ** -0.5, ctx.dtype or ms.float32)
        self.rows_by_head = ctx.mode == "explicit"  # context_rows: CacheLayout.rows_by_head
        semi_auto = ctx.mode == "semi_auto"
        layout = SemiAutoLayout(ctx.plan) if semi_auto else None

        def per_head(rank, axis=1):
            return layout.per_head(rank, axis) if semi_auto else None

        self.write_rows = shard(ctx, ops.ScatterUpdate(), per_head(3), (1,), per_head(3))
        self.read_rows = shard(ctx, ops.Gather(), per_head(3), (1,))
        self.keys_by_head = shard(ctx, ops.Transpose(), per_head(4, 2))
        self.queries_by_head = shard(ctx, ops.Transpose(), per_head(5, 2))
        self.scale_queries = shard(ctx, ops.Mul(), per_head(4), ())
        self.scores = shard(ctx, ops.BatchMatMul(transpose_b=True), per_head(4), per_head(4))
        self.scores_to_float = shard(ctx, ops.Cast(), per_head(4))
        self.add_mask = shard(ctx, ops.Add(), per_head(5), (1, 1, 1, 1, 1))
        self.softmax = shard(ctx, ops.Softmax(-1), per_head(4))
        self.probs_to_dtype = shard(ctx, ops.Cast(), per_head(4))
        self.weighted_values = shard(ctx, ops.BatchMatMul(), per_head(4), per_head(4))
        self.tokens_first = shard(ctx, ops.Transpose(), per_head(5, 1))
        self.expand = Expand(ctx, grows_with_context=True)  # the mask (G, Q, T) to the scores
        # Explicit mode's graphs are each built for one kind of call; its prefill chunks
        # attend by _attend_chunk. semi_auto's (kind None) tell by the mask's shape.
        self.kind = ctx.graph.kind if ctx.graph is not None else None
        dtype = ctx.dtype or ms.float32
        # Explicit mode's prefill chunks in float16 only (no semi_auto layout): a K/V that
        # overflows float16 is what _finite_context keeps to its own sequence; float32 and
        # bfloat16 (float32's range) do not overflow, and the check is ~15 of a layer's
        # ~90 kernel launches.
        self.isolate_sequences = dtype == ms.float16
        self.is_finite = ops.IsFinite()
        self.logical_not = ops.LogicalNot()
        self.logical_or = ops.LogicalOr()
        self.any_over = ops.ReduceAny(keep_dims=True)
        self.fill = ops.MaskedFill()
        self.zero = Tensor(0.0, dtype)
        self.nan = Tensor(float("nan"), dtype)
        self.visible_of = ops.Greater()
        self.bad_to_float = ops.Cast()
        self.count_seen = ops.BatchMatMul()
        self.any_seen = ops.Greater()

    def construct(self, q, k, v, k_cache, v_cache, write_rows, context_rows, mask):
        """q: (N, heads, head_dim), k and v: (N, kv_heads, head_dim) with N = G*Q tokens;
        write_rows: (N,) slots of the tokens' own K/V; context_rows: the T context slots of
        each group, (G*T,); in explicit mode, whose caches are (slots x kv, head_dim), the rows
        of those (CacheLayout.head_rows, N*kv; rows_by_head, G*kv*T); mask: (G, Q, T), 0 where
        a query may look and a large negative number elsewhere. Returns (N, heads*head_dim)."""
        # Write this call's K/V, then read the context (which includes them) after the writes.
        if self.rows_by_head:  # the caches are rows of one head's vector (kv_layout.py)
            k = k.reshape(-1, self.head_dim)
            v = v.reshape(-1, self.head_dim)
        k_written = self.write_rows(k_cache, write_rows, k)
        v_written = self.write_rows(v_cache, write_rows, v)
        keys = self.read_rows(ops.depend(k_cache, k_written), context_rows, 0)
        values = self.read_rows(ops.depend(v_cache, v_written), context_rows, 0)
        if self.kind == "prefill":
            return self._attend_chunk(q, keys, values, mask)
        return self._attend(q, keys, values, mask)

    def _finite_context(self, keys, values, mask):
        """A prefill chunk's context, (G, kv, T, d) keys and values, with its non-finite
        elements zeroed, and which queries see (mask 0) a position that had one: (G, Q, 1).

        A chunk packs several sequences side by side, each masked from the others' positions
        with probability exactly 0; but 0 x inf is NaN, so one sequence's overflowed K/V (a
        float16 overflow) would turn every other sequence of the chunk into NaN. Zeroed, they
        contribute 0; and the queries that may see them (their own sequence's) are set to NaN
        after attending, as attending to them would have made them, so that sequence still
        fails (LLMEngine: finish reason "error") and no other does. Decode steps need none of
        it: each group reads only its own positions and the zero slot (model_runner.py)."""
        bad_keys = self.logical_not(self.is_finite(keys))
        bad_values = self.logical_not(self.is_finite(values))
        keys = self.fill(keys, bad_keys, self.zero)
        values = self.fill(values, bad_values, self.zero)
        bad = self.logical_or(self.any_over(bad_keys, (1, 3)),
                              self.any_over(bad_values, (1, 3)))  # (G, 1, T, 1)
        visible = self.bad_to_float(self.visible_of(mask, -1.0), ms.float32)  # (G, Q, T)
        seen = self.count_seen(visible, self.bad_to_float(bad.reshape(1, -1, 1), ms.float32))
        return keys, values, self.any_seen(seen, 0.0)  # (G, Q, 1)

    def _attend_chunk(self, q, keys, values, mask):
        """`_attend` for a prefill chunk in explicit mode: one group (G=1) of Q queries over
        T context slots, with no shape arithmetic. In a graph of dynamic shape every shape
        built from mask.shape is kernels launched at every call (a Shape, a RealTupleGetItem
        per axis used, a RealMakeTuple per shape built): ~25 of a layer's ~125 launches."""
        d, kv, groups = self.head_dim, self.kv_heads, self.groups
        keys, values = keys.reshape(1, kv, -1, d), values.reshape(1, kv, -1, d)
        poisoned = None
        if self.isolate_sequences:
            keys, values, poisoned = self._finite_context(keys, values, mask)
        # Each KV head's queries in one row block: (1, kv, groups x Q, d).
        q = self.queries_by_head(q.reshape(1, -1, kv, groups, d), (0, 2, 3, 1, 4))
        scores = self.scores(self.scale_queries(q.reshape(1, kv, -1, d), self.scale), keys)
        if scores.dtype != ms.float32:
            scores = self.scores_to_float(scores, ms.float32)
        # The mask (1, Q, T) tiled to every row block: a dense operand (Expand's reason),
        # of a shape fixed by constants.
        scores = self.add_mask(scores, ops.tile(ops.expand_dims(mask, 1), (1, kv, groups, 1)))
        probs = self.softmax(scores)
        if probs.dtype != values.dtype:
            probs = self.probs_to_dtype(probs, values.dtype)
        out = self.weighted_values(probs, values).reshape(1, kv, groups, -1, d)
        out = self.tokens_first(out, (0, 3, 1, 2, 4)).reshape(-1, self.heads * d)
        if poisoned is None:
            return out
        # What a query saw of a non-finite K/V, it gets back.
        return self.fill(out, ops.broadcast_to(poisoned.reshape(-1, 1), (-1, self.heads * d)),
                         self.nan)

    def _attend(self, q, keys, values, mask):
        groups, queries, context = mask.shape
        d, kv = self.head_dim, self.kv_heads
        if self.rows_by_head:
            keys = keys.reshape(groups, kv, context, d)
            values = values.reshape(groups, kv, context, d)
        else:
            keys = self.keys_by_head(keys.reshape(groups, context, kv, d), (0, 2, 1, 3))
            values = self.keys_by_head(values.reshape(groups, context, kv, d), (0, 2, 1, 3))
        many = queries > 1  # semi_auto's prefill (explicit mode's: _attend_chunk)
        # Query head j uses KV head j // groups: put each KV head's queries in one row block
        # (with one query per group, as in decode, that is a reshape: no Transpose to launch).
        q = q.reshape(groups, queries, kv, self.groups, d)
        if many:
            q = self.queries_by_head(q, (0, 2, 3, 1, 4))
        q = q.reshape(groups, kv, self.groups * queries, d)
        # The scores are the big tensor here: scale q, not them; softmax in float32.
        scores = self.scores(self.scale_queries(q, self.scale), keys)
        if scores.dtype != ms.float32:
            scores = self.scores_to_float(scores, ms.float32)
        scores = scores.reshape(groups, kv, self.groups, queries, context)
        scores = self.add_mask(scores, self.expand(mask.reshape(groups, 1, 1, queries, context),
                                                   scores.shape))
        probs = self.softmax(scores.reshape(groups, kv, self.groups * queries, context))
        if probs.dtype != values.dtype:
            probs = self.probs_to_dtype(probs, values.dtype)
        out = self.weighted_values(probs, values)  # (G, kv, groups*Q, d)
        out = out.reshape(groups, kv, self.groups, queries, d)
        if many:
            out = self.tokens_first(out, (0, 3, 1, 2, 4))
        return out.reshape(groups * queries, self.heads * d)
