"""The forms explicit mode takes on MindSpore's CPU backend, where they were measured better:
weight layouts and product orders by processor (hardware.cpu_matmul_forms), and large
elementwise operands broadcast explicitly (`Expand`)."""
import mindspore as ms
from mindspore import nn, ops

from ..hardware import cpu_matmul_forms


def uses_cpu_forms(ctx) -> bool:
    """Explicit mode on the CPU backend takes the forms measured better there: the weight
    layouts and product orders of hardware.cpu_matmul_forms (faster), and elementwise operands
    broadcast explicitly (`Expand`: leaner). Elsewhere the checkpoint's layout, x @ W.T and
    implicit broadcasting: semi_auto's strategies are written for them, and no device was at
    hand to measure."""
    return ctx.mode == "explicit" and ms.get_context("device_target") == "CPU"


def matmul_forms(ctx):
    """This process's hardware.CpuMatmulForms, or None where the checkpoint's forms hold."""
    return cpu_matmul_forms() if uses_cpu_forms(ctx) else None


class Expand(nn.Cell):
    """An elementwise operand broadcast to the other operand's shape before the op, where
    uses_cpu_forms and the op is large. MindSpore's CPU Add/Mul/RealDiv with a broadcast
    operand keep two int64 indices per output element for as long as their graph lives (16
    bytes per element, 4x a float32 output; a scalar operand is exempt): measured, a
    (1, 2, 7, 256, 512) score-plus-mask Add holds 29 MB per compiled instance, the same Add
    after BroadcastTo 0.3 MB; a 256-token chunk's graphs held ~55 MB of them per layer. Small
    ops keep implicit broadcasting: a BroadcastTo is one more kernel launch, and nine per layer
    made 0.5B-shape batch-1 decode ~3% slower.

    In a graph of dynamic shape (ctx.graph) an operand whose shape is not known when it
    compiles (a dynamic chunk's or lm_head's rows, a dynamic context) is always broadcast
    (planning/shapes.ExplicitGraphs)."""

    MIN_ELEMENTS = 1 << 12  # an op this large keeps 64 KiB of indices

    def __init__(self, ctx, grows_with_context=False):
        super().__init__()
        self.dense = uses_cpu_forms(ctx)
        graph = ctx.graph
        self.static = graph is None or (graph.rows > 0 and (graph.context > 0
                                                             or not grows_with_context))

    def construct(self, operand, shape):
        if not self.dense:
            return operand
        if not self.static:
            return ops.broadcast_to(operand, shape)
        elements = 1
        for size in shape:  # static shapes: decided when the graph compiles
            elements *= size
        if elements >= self.MIN_ELEMENTS:
            return ops.broadcast_to(operand, shape)
        return operand
