"""The C++ routed-experts kernel (layers/cpu_kernels/moe_experts.cc, run by layers/moe.py on
CPU) against numpy: random routing with k = 1..4, experts this rank does not hold, widths
that are not whole vectors, calls longer than its 256-token pass, 1 and 2 threads, float32 and
float16, in one compiled graph of dynamic shape per dtype."""
import numpy as np
import pytest

from msinfer import hardware

pytestmark = pytest.mark.skipif(not hardware.kernel_compiler_available(), reason="no g++")

HIDDEN, WIDTH, EXPERTS = 40, 24, 6  # 40: two 16-lane vectors and 8 columns short of one


def reference(x, ids, weights, gate_up, down):
    """sum over each token's held experts of weight x down(silu(gate x) * up x), float64."""
    x, weights, gate_up, down = (a.astype(np.float64) for a in (x, weights, gate_up, down))
    out = np.zeros_like(x)
    for t in range(len(x)):
        for e, w in zip(ids[t], weights[t]):
            if 0 <= e < len(gate_up):
                gate, up = np.split(gate_up[e] @ x[t], 2)
                out[t] += w * ((gate / (1 + np.exp(-gate)) * up) @ down[e])
    return out


@pytest.fixture(scope="module")
def experts_op():
    """{dtype name: a compiled graph running the layer's kernel op, dynamic in every axis the
    layer's calls vary (tokens, k)}."""
    import mindspore as ms
    from mindspore import Tensor, nn

    from msinfer.layers.moe import experts_kernel
    from msinfer.parallel.distributed import set_graph_mode

    set_graph_mode("CPU")

    class Experts(nn.Cell):
        def __init__(self, dtype):
            super().__init__()
            self.op = experts_kernel(dtype)

        def construct(self, *args):
            return self.op(*args)

    cells = {}
    for name, dtype in (("float32", ms.float32), ("float16", ms.float16)):
        cell = Experts(dtype)
        cell.set_inputs(Tensor(shape=[None, HIDDEN], dtype=dtype),
                        Tensor(shape=[None, None], dtype=ms.int32),
                        Tensor(shape=[None, None], dtype=dtype),
                        Tensor(shape=[EXPERTS, 2 * WIDTH, HIDDEN], dtype=dtype),
                        Tensor(shape=[EXPERTS, WIDTH, HIDDEN], dtype=dtype),
                        Tensor(shape=[1], dtype=ms.int32))
        cells[name] = cell
    return cells


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_kernel_sums_each_tokens_held_routed_experts_as_numpy(experts_op, dtype):
    from mindspore import Tensor

    rng = np.random.default_rng(0)
    gate_up = (rng.standard_normal((EXPERTS, 2 * WIDTH, HIDDEN)) / 4).astype(dtype)
    down = (rng.standard_normal((EXPERTS, WIDTH, HIDDEN)) / 3).astype(dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=2e-3, atol=2e-3)
    # tokens: one (decode), a few, more than one expert's tile of 4, more than one pass
    for tokens, k, threads in ((1, 1, 1), (1, 4, 2), (5, 2, 2), (37, 3, 1), (37, 4, 2),
                               (300, 2, 2)):
        x = rng.standard_normal((tokens, HIDDEN)).astype(dtype)
        # experts -2 .. 7 of 6 held: about a fifth of the pairs are other ranks' experts
        ids = rng.integers(-2, EXPERTS + 2, size=(tokens, k)).astype(np.int32)
        weights = rng.uniform(0.1, 1.0, size=(tokens, k)).astype(dtype)
        got = experts_op[dtype](Tensor(x), Tensor(ids), Tensor(weights), Tensor(gate_up),
                                Tensor(down), Tensor(np.array([threads], np.int32))).asnumpy()
        assert got.shape == (tokens, HIDDEN) and got.dtype == np.dtype(dtype)
        np.testing.assert_allclose(got.astype(np.float64),
                                   reference(x, ids, weights, gate_up, down), **tol,
                                   err_msg=f"{tokens} tokens, k={k}, {threads} threads")


def test_a_call_whose_experts_are_all_elsewhere_gives_zeros(experts_op):
    from mindspore import Tensor

    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, HIDDEN)).astype(np.float32)
    ids = np.full((3, 2), EXPERTS, np.int32)
    got = experts_op["float32"](
        Tensor(x), Tensor(ids), Tensor(np.ones((3, 2), np.float32)),
        Tensor(np.ones((EXPERTS, 2 * WIDTH, HIDDEN), np.float32)),
        Tensor(np.ones((EXPERTS, WIDTH, HIDDEN), np.float32)),
        Tensor(np.array([2], np.int32))).asnumpy()
    assert np.array_equal(got, np.zeros((3, HIDDEN), np.float32))
