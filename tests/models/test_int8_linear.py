"""The CPU kernels of quantized checkpoints (layers/cpu_kernels/int8_linear.cc), run as the
linear methods run them (compiled graphs, rows dynamic), against numpy: the int8 x int8
products exact (int64 in numpy), the float ones to float32's rounding; and the MindSpore
forms that other hosts keep, which the kernels must agree with."""
import ml_dtypes
import numpy as np
import pytest

from msinfer.layers import cpu_kernels
from msinfer import hardware
from msinfer.hardware import int8_kernels_available

pytestmark = pytest.mark.skipif(not int8_kernels_available(), reason="no g++ or no AVX512-VNNI")

ROWS = (1, 3, 13, 16, 67, 300)  # one graph of dynamic rows runs them all


@pytest.fixture(scope="module")
def ms():
    import mindspore

    mindspore.set_context(mode=mindspore.GRAPH_MODE)
    return mindspore


def dynamic(ms, cell, *args):
    """`cell` compiled once with its first input's rows dynamic, called on `args` (numpy;
    the first a list of row counts' inputs): its outputs as numpy."""
    from mindspore import Tensor

    first = args[0][0]
    cell.set_inputs(Tensor(shape=[None, first.shape[1]], dtype=ms.float32),
                    *(Tensor(shape=list(a.shape), dtype=ms.tensor(a).dtype) for a in args[1:]))
    rest = [Tensor.from_numpy(np.ascontiguousarray(a)) for a in args[1:]]
    return [cell(Tensor(x), *rest).asnumpy() for x in args[0]]


def quantized(x, divisor, offset):
    """clamp(round(x / divisor + offset)) in float32, round half to even (MindSpore's)."""
    return np.clip(np.round(x / divisor + offset), -128, 127).astype(np.int64)


def test_w8a8_products_are_exact_at_any_rows_and_width(ms):
    from msinfer.layers.linear_methods import KernelW8A8DynamicMethod, KernelW8A8Method

    rng = np.random.default_rng(0)
    for k, out in ((203, 37), (64, 5), (4864, 9)):  # a tail, one block, down_proj's width
        w = rng.integers(-128, 128, (out, k)).astype(np.int8)
        xs = [rng.standard_normal((rows, k)).astype(np.float32) * 3 for rows in ROWS]
        deq = (rng.random(out) * 1e-3).astype(np.float32)
        bias = rng.integers(-5000, 5000, out).astype(np.int32)
        scale, offset = np.float32([0.021]), np.float32([-3.0])
        found = dynamic(ms, KernelW8A8Method(k), xs, w, deq, bias, scale, offset)
        for x, y in zip(xs, found):
            exact = quantized(x, scale, offset) @ w.astype(np.int64).T + bias
            np.testing.assert_array_equal(y, exact.astype(np.float32) * deq)
        weight_scale = (rng.random((out, 1)) * 1e-2).astype(np.float32)
        found = dynamic(ms, KernelW8A8DynamicMethod(k), xs, w, weight_scale)
        for x, y in zip(xs, found):
            s = np.maximum(np.abs(x).max(-1, keepdims=True) / np.float32(127), 1e-12)
            exact = quantized(x, s, 0) @ w.astype(np.int64).T
            np.testing.assert_array_equal(y, exact.astype(np.float32) * s * weight_scale.T)
    # The extremes over 4,864 inputs, past float32's exact integers (2**24).
    k = 4864
    x = np.full((3, k), -128, np.float32)
    w = np.full((5, k), -128, np.int8)
    x[1], w[1:] = rng.integers(-128, 128, k), rng.integers(-128, 128, (4, k))
    x[2, ::2] = 127
    one = np.float32([1.0])
    [y] = dynamic(ms, KernelW8A8Method(k), [x], w, np.ones(5, np.float32),
                  np.zeros(5, np.int32), one, np.float32([0.0]))
    np.testing.assert_array_equal(y, (x.astype(np.int64) @ w.astype(np.int64).T)
                                  .astype(np.float32))


@pytest.mark.parametrize("groups", [1, 7])
def test_w8a16_matches_the_dequantized_product(ms, groups):
    from msinfer.layers.linear_methods import KernelW8A16Method

    rng = np.random.default_rng(groups)
    # 7 groups of 29: a tail in each; 2100 inputs: the kernel's passes of 1024 and a tail
    for k, out in ((203, 38), (2100, 10)):
        w = rng.integers(-128, 128, (out, k)).astype(np.int8)
        scale = (rng.random((out, groups)) * 1e-2).astype(np.float32)
        offset = rng.integers(-8, 8, (out, groups)).astype(np.float32)
        xs = [rng.standard_normal((rows, k)).astype(np.float32) for rows in ROWS]
        weight = ((w.reshape(out, groups, -1) - offset[..., None].astype(np.float64))
                  * scale[..., None]).reshape(out, k)
        for x, y in zip(xs, dynamic(ms, KernelW8A16Method(k), xs, w, scale, offset)):
            exact = x.astype(np.float64) @ weight.T
            np.testing.assert_allclose(y, exact, rtol=1e-5, atol=1e-5 * np.abs(exact).max())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_tables_are_read_as_their_exact_float32_values(ms, dtype):
    from mindspore import Tensor, nn

    from msinfer.layers.linear_methods import TableMethod, TableRows

    ms_dtype, np_dtype = getattr(ms, dtype), getattr(ml_dtypes, dtype, np.float16)
    rng = np.random.default_rng(1)
    table = rng.standard_normal((203, 45)).astype(np_dtype)
    xs = [rng.standard_normal((rows, 45)).astype(np.float32) for rows in ROWS]

    class Transposed(nn.Cell):
        def __init__(self):
            super().__init__()
            self.method = TableMethod(ms_dtype)

        def construct(self, x, weight):
            return self.method.transposed(x, weight)
    wide = table.astype(np.float64)
    for x, y, y_t in zip(xs, dynamic(ms, TableMethod(ms_dtype), xs, table),
                         dynamic(ms, Transposed(), xs, table)):
        exact = x.astype(np.float64) @ wide.T
        np.testing.assert_allclose(y, exact, rtol=1e-5, atol=1e-5 * np.abs(exact).max())
        np.testing.assert_array_equal(y_t, y.T)
    ids = np.array([[202, 0], [7, 7]], np.int32)
    rows = TableRows(ms_dtype)(Tensor.from_numpy(table), Tensor(ids)).asnumpy()
    np.testing.assert_array_equal(rows, table[ids].astype(np.float32))
    with pytest.raises(RuntimeError):
        TableRows(ms_dtype)(Tensor.from_numpy(table), Tensor(np.int32([203]))).asnumpy()


def test_without_gxx_the_mindspore_forms_run_and_agree_with_the_kernels(ms, monkeypatch):
    """Where the host cannot build the kernels (no g++, or no AVX512-VNNI), method_class
    keeps the MindSpore forms and the tables stay in the compute dtype; those forms give
    what the kernels give."""
    from types import SimpleNamespace

    from mindspore import Tensor

    from msinfer.layers import linear_methods as methods

    ctx = SimpleNamespace(config=SimpleNamespace(quantization=object(), torch_dtype="bfloat16"),
                          mode="explicit", dtype=ms.float32)
    assert methods.table_dtype(ctx) == ms.bfloat16
    rng = np.random.default_rng(2)
    k, out = 150, 21
    x = Tensor(rng.standard_normal((6, k)).astype(np.float32))
    w = Tensor(rng.integers(-128, 128, (out, k)).astype(np.int8))
    w8a8 = (w, Tensor((rng.random(out) * 1e-3).astype(np.float32)),
            Tensor(rng.integers(-99, 99, out).astype(np.int32)), Tensor(np.float32([0.02])),
            Tensor(np.float32([1.0])))
    dynamic_scale = (w, Tensor((rng.random((out, 1)) * 1e-2).astype(np.float32)))
    w8a16 = (w, Tensor((rng.random((out, 3)) * 1e-2).astype(np.float32)),
             Tensor(rng.integers(-3, 3, (out, 3)).astype(np.float32)))
    cases = {"W8A8": w8a8, "W8A8_DYNAMIC": dynamic_scale, "W8A16": w8a16}
    kernels = {scheme: methods.method_class(scheme)(k)(x, *args).asnumpy()
               for scheme, args in cases.items()}
    assert methods.method_class("W8A8") is methods.KernelW8A8Method
    monkeypatch.setattr(hardware, "processor_flags", lambda: {"avx512f", "avx2"})
    assert methods.method_class("W8A8") is methods.W8A8Method
    monkeypatch.undo()
    monkeypatch.setattr(hardware, "kernel_compiler_available", lambda: False)
    assert methods.table_dtype(ctx) is None
    for scheme, args in cases.items():
        method = methods.method_class(scheme)
        assert method is methods.CPU_METHODS[scheme]
        found = method(k)(x, *args).asnumpy()
        if scheme == "W8A16":
            np.testing.assert_allclose(found, kernels[scheme], rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(found, kernels[scheme])
