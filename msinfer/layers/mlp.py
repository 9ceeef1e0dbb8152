"""The SwiGLU MLP, down(silu(gate(x)) * up(x)), with gate/up fused into one column-parallel
matmul and down row-parallel (one AllReduce), as a decoder layer (or a MoE's shared expert)
uses it.

Three forms of one computation, by mode and processor:
- explicit mode on CPU, weight first (hardware.cpu_matmul_forms): (W @ x.T) from gate/up to
  down, one Transpose of the output for the MLP;
- explicit mode otherwise: this rank's one block of gate/up, x @ W;
- semi_auto: full-shape gate/up seen as (tokens, rank blocks, block width), each rank's block
  its [gate; up] slice.
"""
from mindspore import nn, ops
from mindspore.ops.auto_generate import SiLU  # the primitive behind ops.silu (not in ops)

from .cpu_forms import matmul_forms
from .linear import ParallelLinear
from .parallel_context import SemiAutoLayout, shard


class SwiGLU(nn.Cell):
    """The MLP of `prefix` (e.g. "model.layers.0.mlp"): its `gate_up_proj` and `down_proj`
    weights are arguments (checkpoint names prefix.gate_proj/up_proj fused, prefix.down_proj).
    `reduce` False: the output of a split MLP stays this rank's partial sum."""

    def __init__(self, ctx, prefix="model.layers.0.mlp", intermediate=None, reduce=True):
        super().__init__()
        config, plan = ctx.config, ctx.plan
        forms = matmul_forms(ctx)
        mlp = dict(in_out=forms is not None and forms.in_out,
                   weight_first=forms.mlp_weight_first if forms else None)
        self.gate_up_proj = ParallelLinear(ctx, prefix + ".gate_up_proj", **mlp)
        self.down_proj = ParallelLinear(ctx, prefix + ".down_proj", reduce=reduce, **mlp)
        self.explicit = ctx.mode == "explicit"
        semi_auto = ctx.mode == "semi_auto"
        layout = SemiAutoLayout(plan) if semi_auto else None
        if self.explicit:
            self.intermediate = plan.local_shape(prefix + ".down_proj.weight")[1]
            self.blocks = 1
        else:
            self.intermediate = intermediate or config.intermediate_size
            self.blocks = layout.mlp
        self.block = self.intermediate // self.blocks  # width within one block of gate/up
        # The form: fixed for a graph of dynamic shape, else by its rows when it compiles
        self.weight_first = ctx.graph.weight_first if ctx.graph is not None else None
        blocks = layout.mlp_blocks() if semi_auto else None
        self.split_gate_up = shard(ctx, ops.StridedSlice(), blocks)
        self.silu = shard(ctx, SiLU(), blocks)
        self.gate = shard(ctx, ops.Mul(), blocks, blocks)
        self.mlp_out = ops.Transpose()  # explicit mode only (the weight-first chain)
        self.halves_of_rows = ops.Split(0, 2)
        self.halves_of_columns = ops.Split(-1, 2)

    def construct(self, x, w_gate_up, w_down):
        weight_first = self.weight_first
        if weight_first is None:  # a graph of static shape: by its rows
            weight_first = self.gate_up_proj.weight_first_for(x.shape[0])
        if weight_first:  # explicit mode on CPU: one block
            # Transposed from gate/up to down, so one Transpose (of the output) for the MLP.
            gate_up = self.gate_up_proj.transposed(x, w_gate_up)  # (2 x intermediate, tokens)
            gate, up = self.halves_of_rows(gate_up)
            act = self.gate(self.silu(gate), up)
            return self.mlp_out(self.down_proj.transposed(act, w_down, x_transposed=True),
                                (1, 0))
        if self.explicit:  # one block
            gate, up = self.halves_of_columns(self.gate_up_proj(x, w_gate_up))
            return self.down_proj(self.gate(self.silu(gate), up), w_down)
        tokens = x.shape[0]
        gate_up = self.gate_up_proj(x, w_gate_up).reshape(tokens, self.blocks, -1)
        act = self.gate(self.silu(self._part(gate_up, 0)), self._part(gate_up, self.block))
        return self.down_proj(act.reshape(tokens, -1), w_down)

    def _part(self, gate_up, start):
        """Columns [start, start + block) of every rank block of the fused gate/up output."""
        tokens, blocks, _ = gate_up.shape
        return self.split_gate_up(gate_up, (0, 0, start),
                                  (tokens, blocks, start + self.block), (1, 1, 1))
