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

Weights stay int8 on every hardware; `method_class` picks each scheme's form per hardware,
in one place:
- CPU with g++ and AVX512-VNNI: C++ kernels (cpu_kernels/int8_linear.cc) that read the int8 weight as it is
  (int8 x int8 summed exactly in int32 by AVX512-VNNI), and hold the checkpoint's FLOAT
  embedding and lm_head in its 16-bit dtype (`table_dtype`), upcast exactly as they are read;
- other CPUs: the MindSpore forms below, the reference: integer products exact as int8 x
  int8 accumulated in float32 over runs of inputs short enough that every partial sum stays
  below 2**24 (IntegerMatmul), the runs summed in int32; the tables in float32;
- Ascend: MindSpore's quantized matmul primitives (`ascend_kernels`).
A method's `TENSORS` are the checkpoint suffixes it takes, in the order construct receives
them.
"""
import mindspore as ms
from mindspore import nn, ops

from .. import hardware
from ..errors import MsinferError
from ..quantization import ALIASES, ASCEND_SCHEMES
from . import cpu_kernels

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


class TokenScale(nn.Cell):
    """W8A8_DYNAMIC's per-token scale of float32 x, max|x_t| / 127, (tokens, 1); `row_max`
    (a row-parallel layer's) takes the maximum over the tensor group's slices of the row."""

    def __init__(self, row_max=None):
        super().__init__()
        self.row_max = row_max

    def construct(self, x32):
        largest = ops.amax(ops.abs(x32), -1, True)
        if self.row_max is not None:
            largest = self.row_max(largest)
        return ops.maximum(largest / 127.0, 1e-12)


class W8A8DynamicMethod(nn.Cell):
    """Per-token symmetric activation quantization, per-channel weight scale. A row-parallel
    layer's rank holds a slice of each token's inputs: `row_max` (an AllReduce of the maxima
    over the tensor group) gives every rank the whole row's scale, as on one device."""

    TENSORS = ("weight", "weight_scale")
    BIAS_FOLDED = False

    def __init__(self, in_features, row_max=None):
        super().__init__()
        self.matmul = IntegerMatmul(in_features)
        self.token_scale = TokenScale(row_max)

    def construct(self, x, weight, weight_scale):
        x32 = ops.cast(x, ms.float32)
        scale = self.token_scale(x32)
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
    method above is its reference.

    semi_auto (`strategy`: the matmul in_strategy ((d, k), (n, k)) of the weight's style):
    QuantV2 splits x as the matmul does, its per-tensor scale and offset whole;
    QuantBatchMatmul takes the weight's split, and MindSpore lays deq_scale and quant_bias
    out as the output's columns. A row-parallel layer (k > 1) gives QuantBatchMatmul no
    bias: MindSpore sums the ranks' partial products after it, so a bias given to it would
    be added k times; quant_bias * deq_scale is added to the sum instead (the same value,
    rounded once more than the device's int32 addition)."""

    def __init__(self, in_features, row_max=None, strategy=None):
        super().__init__(in_features)
        from mindspore.ops.auto_generate import QuantBatchMatmul, QuantV2
        self.reciprocal = ops.Reciprocal()
        self.quant = QuantV2()
        self.qbmm = QuantBatchMatmul(transpose_x2=True, dtype=ms.float16)
        self.bias_after_sum = None
        if strategy is not None:
            (d, k), (n, _) = strategy
            self.reciprocal.shard(((1,),))
            self.quant.shard(((d, k), (1,), (1,)))
            if k == 1:
                self.qbmm.shard(((d, k), (n, k), (n,), (n,)))
            else:
                self.qbmm.shard(((d, k), (n, k), (n,)))
                self.bias_after_sum = QuantBiasAfterSum(d)

    def construct(self, x, weight, deq_scale, quant_bias, input_scale, input_offset):
        x_q = self.quant(x, self.reciprocal(input_scale), input_offset, False, "ROUND", ms.int8)
        if self.bias_after_sum is None:
            return self.qbmm(x_q, weight, deq_scale, None, quant_bias)
        return self.bias_after_sum(self.qbmm(x_q, weight, deq_scale, None, None), quant_bias,
                                   deq_scale)


class QuantBiasAfterSum(nn.Cell):
    """y + quant_bias * deq_scale for a row-parallel W8A8 layer under semi_auto, y its
    (tokens split `data`, columns whole) summed output: (acc + quant_bias) * deq_scale
    with the bias outside the sum over ranks."""

    def __init__(self, data):
        super().__init__()
        self.cast_bias = ops.Cast().shard(((1,),))
        self.mul = ops.Mul().shard(((1,), (1,)))
        self.cast_out = ops.Cast().shard(((1,),))
        self.add = ops.Add().shard(((data, 1), (1,)))

    def construct(self, y, quant_bias, deq_scale):
        bias = self.mul(self.cast_bias(quant_bias, ms.float32), deq_scale)
        return self.add(y, self.cast_out(bias, y.dtype))


class AscendW8A16Method(W8A16Method):
    """W8A16 on Ascend: WeightQuantBatchMatmul (the device adds antiquant_offset, so it
    takes the negated offset). Not run here (no CANN). semi_auto (`strategy` as
    AscendW8A8Method's): the weight's split, and MindSpore lays the per-channel scale and
    offset out as the output's columns; a split input axis needs nothing more (the offset
    applies per weight element, before the products are summed)."""

    def __init__(self, in_features, row_max=None, strategy=None):
        super().__init__(in_features)
        from mindspore.ops.auto_generate import WeightQuantBatchMatmul
        self.wqbmm = WeightQuantBatchMatmul(transpose_weight=True, antiquant_group_size=0)
        self.neg = ops.Neg()
        if strategy is not None:
            (d, k), (n, _) = strategy
            self.neg.shard(((n,),))
            self.wqbmm.shard(((d, k), (n, k), (n,), (n,)))

    def construct(self, x, weight, weight_scale, weight_offset):
        if weight_scale.shape[1] > 1:  # group-wise: the CPU form until checked on a device
            return super().construct(x, weight, weight_scale, weight_offset)
        return self.wqbmm(x, weight, weight_scale.reshape(-1),
                          self.neg(weight_offset.reshape(-1)))


def kernel_op(function, inputs):
    """Function `function` of cpu_kernels/int8_linear.cc as a MindSpore op of float32 result;
    `inputs` its inputs' MindSpore DataType names."""
    return cpu_kernels.custom_op("int8_linear", function, inputs, ms.float32)


class KernelW8A8Method(nn.Cell):
    """W8A8 on CPU in one C++ kernel: quantize, exact int32 product, + quant_bias,
    * deq_scale."""

    TENSORS, BIAS_FOLDED = W8A8Method.TENSORS, W8A8Method.BIAS_FOLDED

    def __init__(self, in_features, row_max=None):
        super().__init__()
        self.op = kernel_op("W8A8Matmul", ("F32_Default", "I8_Default", "F32_Default",
                                           "I32_Default", "F32_Default", "F32_Default"))

    def construct(self, x, weight, deq_scale, quant_bias, input_scale, input_offset):
        y = self.op(ops.cast(x, ms.float32), weight, deq_scale, quant_bias,
                    ops.cast(input_scale, ms.float32), ops.cast(input_offset, ms.float32))
        return ops.cast(y, x.dtype)


class KernelW8A8DynamicMethod(nn.Cell):
    """W8A8_DYNAMIC on CPU: the per-token scale as above (the row's maximum may need the
    tensor group's), then one C++ kernel: quantize, exact int32 product, * scales."""

    TENSORS, BIAS_FOLDED = W8A8DynamicMethod.TENSORS, W8A8DynamicMethod.BIAS_FOLDED

    def __init__(self, in_features, row_max=None):
        super().__init__()
        self.token_scale = TokenScale(row_max)
        self.op = kernel_op("W8A8DynamicMatmul", ("F32_Default", "I8_Default", "F32_Default",
                                                  "F32_Default"))

    def construct(self, x, weight, weight_scale):
        x32 = ops.cast(x, ms.float32)
        scale = self.token_scale(x32)
        y = self.op(x32, weight, scale, ops.cast(weight_scale, ms.float32).reshape(-1))
        return ops.cast(y, x.dtype)


class KernelW8A16Method(nn.Cell):
    """W8A16 on CPU in one C++ kernel: int8 weights widened in registers, never stored."""

    TENSORS, BIAS_FOLDED = W8A16Method.TENSORS, W8A16Method.BIAS_FOLDED

    def __init__(self, in_features, row_max=None):
        super().__init__()
        self.op = kernel_op("W8A16Matmul", ("F32_Default", "I8_Default", "F32_Default",
                                            "F32_Default"))

    def construct(self, x, weight, weight_scale, weight_offset):
        y = self.op(ops.cast(x, ms.float32), weight, ops.cast(weight_scale, ms.float32),
                    ops.cast(weight_offset, ms.float32))
        return ops.cast(y, x.dtype)


class TableMethod(nn.Cell):
    """x @ W.T of a 16-bit weight (a quantized checkpoint's FLOAT lm_head, `table_dtype`) and
    float32 x, the weight upcast exactly as it is read: float32's numerics at half its bytes.
    `transposed` gives y.T, as ParallelLinear's weight-first form does."""

    TENSORS = ("weight",)
    BIAS_FOLDED = False

    def __init__(self, dtype):
        super().__init__()
        name = "BF16" if dtype == ms.bfloat16 else "F16"
        inputs = ("F32_Default", "BF16_Default" if dtype == ms.bfloat16 else "F16_Default")
        self.op = kernel_op(f"{name}WeightMatmul", inputs)
        self.op_transposed = kernel_op(f"{name}WeightMatmulT", inputs)

    def construct(self, x, weight):
        return self.op(ops.cast(x, ms.float32), weight)

    def transposed(self, x, weight):
        return self.op_transposed(ops.cast(x, ms.float32), weight)


class TableRows(nn.Cell):
    """Rows `ids` of a 16-bit table (a quantized checkpoint's FLOAT embedding,
    `table_dtype`) as float32."""

    def __init__(self, dtype):
        super().__init__()
        name = "BF16" if dtype == ms.bfloat16 else "F16"
        self.op = kernel_op(f"{name}Rows", ("BF16_Default" if dtype == ms.bfloat16
                                             else "F16_Default", "I32_Default"))

    def construct(self, table, ids):
        return self.op(table, ops.cast(ids, ms.int32))


# The MindSpore forms: CPU without g++, and every scheme's reference.
CPU_METHODS = {"W8A8": W8A8Method, "W8A8S": W8A8Method,
               "W8A8_DYNAMIC": W8A8DynamicMethod, "W8A16": W8A16Method}


def ascend_kernels():
    """The schemes whose Ascend kernels replace the CPU method (W8A8_DYNAMIC keeps the CPU
    form until its per-token kernel is checked on a device): quantization.ASCEND_SCHEMES."""
    methods = {"W8A8": AscendW8A8Method, "W8A16": AscendW8A16Method}
    return {s: methods[ALIASES.get(s, s)] for s in ASCEND_SCHEMES + tuple(ALIASES)}


def cpu_kernel_methods():
    return {"W8A8": KernelW8A8Method, "W8A8S": KernelW8A8Method,
            "W8A8_DYNAMIC": KernelW8A8DynamicMethod, "W8A16": KernelW8A16Method}


def uses_cpu_kernels() -> bool:
    """Whether this process runs the C++ kernels: on CPU, where the host can build them."""
    return ms.get_context("device_target") == "CPU" and hardware.int8_kernels_available()


def semi_auto_method(scheme):
    """The method of `scheme` under semi_auto: MindSpore shards only its Ascend quantized
    matmuls, so semi_auto takes their forms on every device (they run on Ascend only)."""
    methods = ascend_kernels()
    if scheme not in methods:
        raise MsinferError(f"{scheme} has no Ascend kernel in msinfer (its CPU form is "
                           f"explicit mode's only); semi_auto lays out W8A8, W8A8S and W8A16")
    return methods[scheme]


def full_tensors(scheme, shape, dtype):
    """(suffix, shape, dtype) of each tensor a linear of `scheme` takes, for a whole (out,
    in) weight `shape`, in the dtypes the loader gives them (models/quant_loader.py): the
    weight int8, deq_scale float32, quant_bias int32, the others `dtype`; scales per
    channel."""
    out = shape[0]
    specs = {"weight": (tuple(shape), ms.int8), "deq_scale": ((out,), ms.float32),
             "quant_bias": ((out,), ms.int32), "input_scale": ((1,), dtype),
             "input_offset": ((1,), dtype), "weight_scale": ((out, 1), dtype),
             "weight_offset": ((out, 1), dtype)}
    return [(suffix,) + specs[suffix] for suffix in CPU_METHODS[scheme].TENSORS]


def method_class(scheme):
    """The method of msModelSlim scheme `scheme` on this process's device."""
    if ms.get_context("device_target") == "Ascend" and scheme in ascend_kernels():
        return ascend_kernels()[scheme]
    if uses_cpu_kernels():
        return cpu_kernel_methods()[scheme]
    return CPU_METHODS[scheme]


def table_dtype(ctx):
    """The dtype a quantized checkpoint's FLOAT embedding and lm_head are held in: the
    checkpoint's own 16-bit dtype where the C++ kernels read it (explicit mode, float32
    compute, CPU with g++), else None (ctx.dtype, as any float weight). msModelSlim writes
    them in its source's dtype: held in float32 the tied 151,936 x 896 table of Qwen2-0.5B's
    shape alone outweighed all its int8 projections."""
    if ctx.mode != "explicit" or ctx.dtype != ms.float32 or not uses_cpu_kernels():
        return None
    if ctx.config.quantization is None:
        return None
    return {"float16": ms.float16, "bfloat16": ms.bfloat16}.get(ctx.config.torch_dtype)


def tensor_suffixes(scheme):
    """The checkpoint suffixes a linear of `scheme` takes, in order (FLOAT: its weight)."""
    return ("weight",) if scheme == "FLOAT" else CPU_METHODS[scheme].TENSORS
