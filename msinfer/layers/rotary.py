"""Rotary position embedding: HF's rotate-half form, cos/sin tables computed on the host."""
import numpy as np
from mindspore import nn, ops

from .cpu_forms import Expand, uses_cpu_forms
from .parallel_context import SemiAutoLayout, shard


def rotary_tables(head_dim, theta, max_len):
    """cos/sin of HF's default rotary embedding, one row per position."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32)
                                / head_dim))
    freqs = np.outer(np.arange(max_len, dtype=np.float32), inv_freq)
    angles = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


class Rotary(nn.Cell):
    """HF's rotate-half rotary embedding of (tokens, heads, head_dim) by cos/sin of
    (tokens, 1, head_dim)."""

    def __init__(self, ctx):
        super().__init__()
        heads = SemiAutoLayout(ctx.plan).per_head(3, 1) if ctx.mode == "semi_auto" else None
        whole = (1, 1, 1)
        self.slice = shard(ctx, ops.StridedSlice(), heads)
        self.neg = shard(ctx, ops.Neg(), heads)
        self.concat = shard(ctx, ops.Concat(-1), heads, heads)
        self.mul_cos = shard(ctx, ops.Mul(), heads, whole)
        self.mul_sin = shard(ctx, ops.Mul(), heads, whole)
        self.add = shard(ctx, ops.Add(), heads, heads)
        self.expand = Expand(uses_cpu_forms(ctx))

    def construct(self, x, cos, sin):
        tokens, heads, dim = x.shape
        half = dim // 2
        first = self.slice(x, (0, 0, 0), (tokens, heads, half), (1, 1, 1))
        second = self.slice(x, (0, 0, half), (tokens, heads, dim), (1, 1, 1))
        rotated = self.concat((self.neg(second), first))
        return self.add(self.mul_cos(x, self.expand(cos, x.shape)),
                        self.mul_sin(rotated, self.expand(sin, x.shape)))
