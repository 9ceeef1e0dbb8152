"""Rotary position embedding: HF's rotate-half form, cos/sin tables computed on the host
(default, or static YaRN: HF transformers' `_compute_yarn_parameters`)."""
import math

import numpy as np
from mindspore import nn, ops

from .cpu_forms import Expand
from .parallel_context import SemiAutoLayout, shard


def rotary_tables(head_dim, theta, max_len, scaling=None):
    """cos/sin of HF's rotary embedding, one row per position: the default one, or with
    `scaling` (config.RopeScaling, yarn) its blended frequencies and cos/sin multiplied by its
    attention factor, as transformers computes them (in float32)."""
    inv_freq, attention_factor = default_inv_freq(head_dim, theta), 1.0
    if scaling is not None:
        inv_freq, attention_factor = yarn_inv_freq(head_dim, theta, scaling)
    freqs = np.outer(np.arange(max_len, dtype=np.float32), inv_freq)
    angles = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    if attention_factor != 1.0:
        cos, sin = cos * np.float32(attention_factor), sin * np.float32(attention_factor)
    return cos, sin


def default_inv_freq(head_dim, theta):
    return 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32)
                            / head_dim))


def yarn_inv_freq(head_dim, theta, scaling):
    """(inv_freq, attention_factor) of static YaRN, step for step as transformers'
    `_compute_yarn_parameters`: the frequencies of dimensions that turn fewer than beta_slow
    times over the original context are interpolated (divided by factor), those that turn
    more than beta_fast times kept, a linear ramp between; cos and sin are scaled by
    0.1 ln(factor) + 1 (or the mscale ratio, or the config's attention_factor)."""
    factor = scaling.factor
    base, dim = theta, head_dim

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = scaling.attention_factor
    if attention_factor is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention_factor = float(get_mscale(factor, scaling.mscale)
                                     / get_mscale(factor, scaling.mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = scaling.beta_fast or 32
    beta_slow = scaling.beta_slow or 1
    original = scaling.original_max_position_embeddings

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                   / np.float32(high - low), 0, 1).astype(np.float32)
    pos_freqs = (base ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))).astype(
        np.float32)
    extrapolation = (1.0 / pos_freqs).astype(np.float32)
    interpolation = (1.0 / (np.float32(factor) * pos_freqs)).astype(np.float32)
    keep = (1 - ramp).astype(np.float32)  # inv_freq_extrapolation_factor
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    return inv_freq.astype(np.float32), attention_factor


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
        self.expand = Expand(ctx)
        # Explicit mode halves by Split: StridedSlice ends built from x.shape are three
        # kernels each at every call of a graph of dynamic shape.
        self.halves = ops.Split(-1, 2) if ctx.mode == "explicit" else None

    def construct(self, x, cos, sin):
        shape = x.shape
        if self.halves is not None:
            first, second = self.halves(x)
        else:
            tokens, heads, dim = shape
            half = dim // 2
            first = self.slice(x, (0, 0, 0), (tokens, heads, half), (1, 1, 1))
            second = self.slice(x, (0, 0, half), (tokens, heads, dim), (1, 1, 1))
        rotated = self.concat((self.neg(second), first))
        return self.add(self.mul_cos(x, self.expand(cos, shape)),
                        self.mul_sin(rotated, self.expand(sin, shape)))
