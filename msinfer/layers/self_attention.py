"""A decoder layer's self-attention: the fused q/k/v projection (column-parallel) cut into q,
k and v, rotary embedding, paged attention over the KV cache, and o_proj (row-parallel: one
AllReduce). Two steps, so that a family can act between them (Qwen3 norms q and k per head):
`qkv` and `attend`.

Explicit mode holds this rank's one block of the fused output ([q; k; v] of its heads) and cuts
it with constant bounds; semi_auto holds the full shape, seen as (tokens, rank blocks, block
width), each rank's block its [q; k; v] slice.
"""
from mindspore import nn, ops

from .attention import PagedAttention
from .cpu_forms import matmul_forms
from .linear import ParallelLinear
from .parallel_context import SemiAutoLayout, shard
from .rotary import Rotary


class SelfAttention(nn.Cell):
    def __init__(self, ctx, bias=True, prefix="model.layers.0.self_attn"):
        super().__init__()
        config, plan = ctx.config, ctx.plan
        forms = matmul_forms(ctx)
        in_out = forms is not None and forms.in_out
        self.qkv_proj = ParallelLinear(ctx, prefix + ".qkv_proj", bias=bias, in_out=in_out)
        self.o_proj = ParallelLinear(ctx, prefix + ".o_proj", in_out=in_out)
        self.rotary = Rotary(ctx)
        self.head_dim = config.head_dim
        self.explicit = ctx.mode == "explicit"
        semi_auto = ctx.mode == "semi_auto"
        if self.explicit:  # this rank's slices: one block of the fused output
            self.heads, self.kv_heads = plan.local_heads, plan.local_kv_heads
            self.blocks = 1
        else:  # full shapes, laid out by MindSpore; the fused output is one block per rank
            self.heads, self.kv_heads = config.num_heads, config.num_kv_heads
            self.blocks = SemiAutoLayout(plan).heads
        # Widths within one block of the fused output.
        self.q_block = self.heads * self.head_dim // self.blocks
        self.kv_block = self.kv_heads * self.head_dim // self.blocks
        self.attention = PagedAttention(ctx, self.heads, self.kv_heads, self.head_dim)
        self.split_qkv = shard(ctx, ops.StridedSlice(),
                               SemiAutoLayout(plan).per_head(3, 1) if semi_auto else None)
        # Explicit mode cuts its one block with constant begins and ends (all rows: the mask
        # bit of axis 0): in a graph of dynamic shape an end built from x.shape is a Shape, a
        # RealTupleGetItem and a RealMakeTuple kernel each call.
        self.columns = ops.StridedSlice(begin_mask=1, end_mask=1)

    def qkv(self, x, w_qkv, b_qkv):
        """q (tokens, heads, head_dim), k and v (tokens, kv_heads, head_dim) of the normed x
        (b_qkv None: no bias)."""
        qkv = self.qkv_proj(x, w_qkv, b_qkv)
        d = self.head_dim
        if self.explicit:  # this rank's one block, cut by columns over all rows
            q_end, k_end = self.q_block, self.q_block + self.kv_block
            q = self.columns(qkv, (0, 0), (1, q_end), (1, 1))
            k = self.columns(qkv, (0, q_end), (1, k_end), (1, 1))
            v = self.columns(qkv, (0, k_end), (1, k_end + self.kv_block), (1, 1))
            return (q.reshape(-1, self.heads, d), k.reshape(-1, self.kv_heads, d),
                    v.reshape(-1, self.kv_heads, d))
        tokens = x.shape[0]
        qkv = qkv.reshape(tokens, self.blocks, -1)
        q = self._block_part(qkv, 0, self.q_block).reshape(tokens, self.heads, d)
        k = self._block_part(qkv, self.q_block, self.kv_block)
        v = self._block_part(qkv, self.q_block + self.kv_block, self.kv_block)
        return q, k.reshape(tokens, self.kv_heads, d), v.reshape(tokens, self.kv_heads, d)

    def attend(self, q, k, v, cos, sin, k_cache, v_cache, write_rows, context_rows, mask, w_o):
        """Rotary on q and k, paged attention (this call's K/V written first), o_proj."""
        q = self.rotary(q, cos, sin)
        k = self.rotary(k, cos, sin)
        out = self.attention(q, k, v, k_cache, v_cache, write_rows, context_rows, mask)
        return self.o_proj(out, w_o)

    def _block_part(self, qkv, start, width):
        """Columns [start, start + width) of every rank block of the fused q/k/v output."""
        tokens, blocks, _ = qkv.shape
        return self.split_qkv(qkv, (0, 0, start), (tokens, blocks, start + width), (1, 1, 1))
