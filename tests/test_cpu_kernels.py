"""The CPU batch-1 matmul kernel: built from source, exact against numpy, used where chosen."""
import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor, nn

from msinfer import cpu_kernels
from msinfer.distributed import set_graph_mode


@pytest.fixture(scope="module")
def row_matmul():
    set_graph_mode("CPU")
    op = cpu_kernels.row_matmul()
    assert op is not None, "g++ is part of the project's set-up; the kernel must build"
    return op


class Apply(nn.Cell):
    def __init__(self, op):
        super().__init__()
        self.op = op

    def construct(self, x, w):
        return self.op(x, w)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("out_features, in_features", [(128, 64), (301, 37), (2048, 896)])
def test_row_times_weight_matches_numpy(row_matmul, threads, out_features, in_features):
    cpu_kernels.set_threads(threads)
    rng = np.random.default_rng(out_features + threads)
    x = rng.standard_normal((1, in_features), dtype=np.float32)
    w = rng.standard_normal((out_features, in_features), dtype=np.float32)
    y = Apply(row_matmul)(Tensor(x), Tensor(w)).asnumpy()
    assert y.shape == (1, out_features)
    np.testing.assert_allclose(y, x @ w.T, rtol=1e-5, atol=1e-4)


def test_layers_use_the_kernel_only_where_it_is_faster(row_matmul):
    from msinfer.config import ModelConfig
    from msinfer.parallel_layers import ParallelContext, ParallelLinear
    from msinfer.strategy import Strategy

    config = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=16)
    plan = Strategy.default().resolve(config)

    def layer(name, dtype=ms.float32, mode="explicit"):
        ctx = ParallelContext(config=config, plan=plan, mode=mode, dtype=dtype)
        return ParallelLinear(ctx, name)

    assert layer("model.layers.0.mlp.up_proj").row_matmul is not None  # out 176 >= in 64
    assert layer("model.layers.0.mlp.down_proj").row_matmul is None  # out 64 < in 176
    assert layer("model.layers.0.mlp.up_proj", dtype=ms.float16).row_matmul is None
    assert layer("model.layers.0.mlp.up_proj", mode="semi_auto").row_matmul is None
