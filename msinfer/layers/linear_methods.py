"""How a linear layer holds and multiplies its weight: one method per quantization scheme.

A `ParallelLinear` keeps the split and the collective; its method keeps the tensors and the
math (vLLM's LinearMethodBase). Schemes are msModelSlim's names, as
quant_model_description.json gives them per tensor:

- FLOAT: the float weight: no method, ParallelLinear's own matmul.
- W8A8 (static): int8 weight (out, in), per-tensor activation scale/offset, int32 quant_bias
  with the float bias folded in, float32 deq_scale per output channel:
      x_q = clamp(round(x / input_scale + input_offset), -128, 127)
      y   = (x_q @ W_q.T + quant_bias) * deq_scale
- W8A8_DYNAMIC: per-token symmetric activation scale, per-channel weight scale (offset 0):
      s = max|x_t| / 127,  x_q = round(x_t / s),  y = (x_q @ W_q.T) * s * weight_scale
- W8A16: weight-only, W = (W_q - weight_offset) * weight_scale per output channel, or per
  group of `in / groups` inputs when weight_scale is (out, groups). Never materialised:
      y = (x @ W_q.T - rowsum(x) * offset) * scale    (per group, summed over groups)

Weights stay int8 on every hardware. On CPU the integer products are exact: int8 x int8
accumulated in float32 over runs of inputs short enough that every partial sum stays below
2**24 (IntegerMatmul), the runs summed in int32; on Ascend MindSpore's quantized matmul primitives
(`ascend_kernels`, the one place that picks them). A method's `TENSORS` are the checkpoint
suffixes it takes, in the order construct receives them.
"""
import mindspore as ms
from mindspore import nn, ops

# |x_q * W_q| <= 128 * 127: the sum of this many stays an exact float32 integer (< 2**24).
EXACT_FLOAT_INPUTS = (1 << 24) // (128 * 127)


class IntegerMatmul(nn.Cell):
    """x_q @ W_q.T of int8-valued operands, exact, as an int32 (rows, out): float32 products
    over runs of at most EXACT_FLOAT_INPUTS inputs (every partial sum an exact integer), the
    runs' results summed in int32. MindSpore's CPU int32 MatMul is exact too but 3x slower at
    16 rows (bench/quantized.py)."""

    def __init__(self, in_features):
        super().__init__()
        runs = next(n for n in range(1, in_features + 1)
                    if in_features % n == 0 and in_features // n <= EXACT_FLOAT_INPUTS)
        self.width = in_features // runs
        self.runs = runs
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x_q, weight):
        x_q = ops.cast(x_q, ms.float32)
        w = ops.cast(weight, ms.float32)  # one layer's transient cast, not a stored copy
        if self.runs == 1:
            return ops.cast(self.matmul(x_q, w), ms.int32)
        xs = ops.split(x_q, self.width, 1)
        ws = ops.split(w, self.width, 1)
        acc = ops.cast(self.matmul(xs[0], ws[0]), ms.int32)
        for i in range(1, self.runs):
            acc = acc + ops.cast(self.matmul(xs[i], ws[i]), ms.int32)
        return acc


class W8A8Method(nn.Cell):
    """Static per-tensor activation quantization (msModelSlim's W8A8 and W8A8S)."""

    TENSORS = ("weight", "deq_scale", "quant_bias", "input_scale", "input_offset")
    BIAS_FOLDED = True  # quant_bias holds the float bias: it is not added again

    def __init__(self, in_features, row_max=None):
        super().__init__()
        self.matmul = IntegerMatmul(in_features)

    def construct(self, x, weight, deq_scale, quant_bias, input_scale, input_offset):
        x_q = ops.clamp(ops.round(x / input_scale + input_offset), -128.0, 127.0)
        acc = self.matmul(x_q, weight) + quant_bias  # exact, as the device's int32 sum
        return ops.cast(ops.cast(acc, ms.float32) * deq_scale, x.dtype)


class W8A8DynamicMethod(nn.Cell):
    """Per-token symmetric activation quantization, per-channel weight scale. A row-parallel
    layer's rank holds a slice of each token's inputs: `row_max` (an AllReduce of the maxima
    over the tensor group) gives every rank the whole row's scale, as on one device."""

    TENSORS = ("weight", "weight_scale")
    BIAS_FOLDED = False

    def __init__(self, in_features, row_max=None):
        super().__init__()
        self.matmul = IntegerMatmul(in_features)
        self.row_max = row_max

    def construct(self, x, weight, weight_scale):
        x32 = ops.cast(x, ms.float32)
        largest = ops.amax(ops.abs(x32), -1, True)  # (tokens, 1)
        if self.row_max is not None:
            largest = self.row_max(largest)
        scale = ops.maximum(largest / 127.0, 1e-12)
        x_q = ops.clamp(ops.round(x32 / scale), -128.0, 127.0)
        acc = self.matmul(x_q, weight)
        return ops.cast(ops.cast(acc, ms.float32) * scale * weight_scale.reshape(1, -1), x.dtype)


class W8A16Method(nn.Cell):
    """Weight-only int8, per channel or per group of inputs (weight_scale (out, groups))."""

    TENSORS = ("weight", "weight_scale", "weight_offset")
    BIAS_FOLDED = False

    def __init__(self, in_features, row_max=None):
        super().__init__()
        self.matmul = ops.MatMul(transpose_b=True)
        self.batch_matmul = ops.BatchMatMul(transpose_b=True)

    def construct(self, x, weight, weight_scale, weight_offset):
        groups = weight_scale.shape[1]
        w = ops.cast(weight, x.dtype)  # one layer's transient cast, not a stored copy
        if groups == 1:
            acc = self.matmul(x, w) - ops.sum(x, -1, True) * weight_offset.reshape(1, -1)
            return acc * weight_scale.reshape(1, -1)
        tokens, out = x.shape[0], w.shape[0]
        xg = x.reshape(tokens, groups, -1).transpose(1, 0, 2)  # (groups, tokens, size)
        wg = w.reshape(out, groups, -1).transpose(1, 0, 2)  # (groups, out, size)
        acc = self.batch_matmul(xg, wg)  # (groups, tokens, out)
        acc = acc - ops.sum(xg, -1, True) * weight_offset.T.reshape(groups, 1, out)
        return ops.sum(acc * weight_scale.T.reshape(groups, 1, out), 0)


class AscendW8A8Method(W8A8Method):
    """W8A8 on Ascend: QuantV2 (x -> int8) and QuantBatchMatmul (int32 accumulation,
    + quant_bias, * deq_scale as the device's int64 scale). Not run here (no CANN): the CPU
    method above is its reference."""

    def __init__(self, in_features, row_max=None):
        super().__init__(in_features)
        from mindspore.ops.auto_generate import QuantBatchMatmul, QuantV2
        self.quant = QuantV2()
        self.qbmm = QuantBatchMatmul(transpose_x2=True, dtype=ms.float16)

    def construct(self, x, weight, deq_scale, quant_bias, input_scale, input_offset):
        x_q = self.quant(x, 1.0 / input_scale, input_offset, False, "ROUND", ms.int8)
        return self.qbmm(x_q, weight, deq_scale, None, quant_bias)


class AscendW8A16Method(W8A16Method):
    """W8A16 on Ascend: WeightQuantBatchMatmul (the device adds antiquant_offset, so it
    takes the negated offset). Not run here (no CANN)."""

    def __init__(self, in_features, row_max=None):
        super().__init__(in_features)
        from mindspore.ops.auto_generate import WeightQuantBatchMatmul
        self.wqbmm = WeightQuantBatchMatmul(transpose_weight=True, antiquant_group_size=0)

    def construct(self, x, weight, weight_scale, weight_offset):
        if weight_scale.shape[1] > 1:  # group-wise: the CPU form until checked on a device
            return super().construct(x, weight, weight_scale, weight_offset)
        return self.wqbmm(x, weight, weight_scale.reshape(-1), -weight_offset.reshape(-1))


CPU_METHODS = {"W8A8": W8A8Method, "W8A8S": W8A8Method,
               "W8A8_DYNAMIC": W8A8DynamicMethod, "W8A16": W8A16Method}


def ascend_kernels():
    """The schemes whose Ascend kernels replace the CPU method (W8A8_DYNAMIC keeps the CPU
    form until its per-token kernel is checked on a device)."""
    return {"W8A8": AscendW8A8Method, "W8A8S": AscendW8A8Method, "W8A16": AscendW8A16Method}


def method_class(scheme):
    """The method of msModelSlim scheme `scheme` on this process's device."""
    if ms.get_context("device_target") == "Ascend" and scheme in ascend_kernels():
        return ascend_kernels()[scheme]
    return CPU_METHODS[scheme]


def tensor_suffixes(scheme):
    """The checkpoint suffixes a linear of `scheme` takes, in order (FLOAT: its weight)."""
    return ("weight",) if scheme == "FLOAT" else CPU_METHODS[scheme].TENSORS
