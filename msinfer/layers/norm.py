"""RMSNorm in float32, as HF's Qwen2RMSNorm (and Qwen3's, also per head over q and k)."""
import mindspore as ms
from mindspore import Tensor, nn, ops

from .cpu_forms import Expand
from .parallel_context import SemiAutoLayout, shard


class RMSNorm(nn.Cell):
    """HF's Qwen2RMSNorm over the feature axis of (tokens, features), in float32; `per_head`:
    over the head_dim axis of (tokens, heads, head_dim), one weight of head_dim for every head
    (Qwen3's q_norm and k_norm, laid out under semi_auto as the attention's heads are)."""

    def __init__(self, ctx, per_head=False):
        super().__init__()
        rows = None
        if ctx.mode == "semi_auto":
            layout = SemiAutoLayout(ctx.plan)
            rows = layout.per_head(3, 1) if per_head else layout.rows(2)
        self.eps = Tensor(ctx.config.rms_norm_eps, ms.float32)
        self.to_float = shard(ctx, ops.Cast(), rows)
        self.square = shard(ctx, ops.Mul(), rows, rows)
        self.mean = shard(ctx, ops.ReduceMean(keep_dims=True), rows)
        self.add_eps = shard(ctx, ops.Add(), rows, ())
        self.rsqrt = shard(ctx, ops.Rsqrt(), rows)
        self.normalize = shard(ctx, ops.Mul(), rows, rows)
        self.to_dtype = shard(ctx, ops.Cast(), rows)
        self.scale = shard(ctx, ops.Mul(), (1,), rows)
        self.expand = Expand(ctx)

    def construct(self, x, weight):
        shape = x.shape  # once: in a graph of dynamic shape each use is a kernel
        xf = self.to_float(x, ms.float32)
        variance = self.mean(self.square(xf, xf), -1)
        inverse = self.expand(self.rsqrt(self.add_eps(variance, self.eps)), shape)
        y = self.normalize(xf, inverse)
        return self.scale(self.expand(weight, shape), self.to_dtype(y, x.dtype))
