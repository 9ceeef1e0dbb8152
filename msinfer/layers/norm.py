"""RMSNorm in float32, as HF's Qwen2RMSNorm."""
import mindspore as ms
from mindspore import Tensor, nn, ops

from .cpu_forms import Expand, uses_cpu_forms
from .parallel_context import SemiAutoLayout, shard


class RMSNorm(nn.Cell):
    """HF's Qwen2RMSNorm over the feature axis of (tokens, features), in float32."""

    def __init__(self, ctx):
        super().__init__()
        rows = SemiAutoLayout(ctx.plan).rows(2) if ctx.mode == "semi_auto" else None
        self.eps = Tensor(ctx.config.rms_norm_eps, ms.float32)
        self.to_float = shard(ctx, ops.Cast(), rows)
        self.square = shard(ctx, ops.Mul(), rows, rows)
        self.mean = shard(ctx, ops.ReduceMean(keep_dims=True), rows)
        self.add_eps = shard(ctx, ops.Add(), rows, ())
        self.rsqrt = shard(ctx, ops.Rsqrt(), rows)
        self.normalize = shard(ctx, ops.Mul(), rows, rows)
        self.to_dtype = shard(ctx, ops.Cast(), rows)
        self.scale = shard(ctx, ops.Mul(), (1,), rows)
        self.expand = Expand(uses_cpu_forms(ctx))

    def construct(self, x, weight):
        xf = self.to_float(x, ms.float32)
        variance = self.mean(self.square(xf, xf), -1)
        inverse = self.expand(self.rsqrt(self.add_eps(variance, self.eps)), xf.shape)
        y = self.normalize(xf, inverse)
        return self.scale(self.expand(weight, x.shape), self.to_dtype(y, x.dtype))
