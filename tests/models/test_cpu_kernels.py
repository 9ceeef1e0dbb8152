"""The C++ kernel build (layers/cpu_kernels): a kernel compiles once into the cache and
runs as a MindSpore aot op inside a compiled graph, with static and dynamic shapes."""
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from msinfer.layers import cpu_kernels
from msinfer.hardware import int8_kernels_available, kernel_compiler_available

pytestmark = pytest.mark.skipif(not kernel_compiler_available(), reason="no g++")


@pytest.mark.skipif(not int8_kernels_available(), reason="int8_linear.cc needs AVX512-VNNI")
def test_a_kernel_builds_once_and_runs_in_graphs_of_static_and_dynamic_shape(tmp_path,
                                                                              monkeypatch):
    import mindspore as ms
    from mindspore import Tensor, nn

    monkeypatch.setenv("MSINFER_KERNEL_CACHE", str(tmp_path))
    cpu_kernels.library.cache_clear()
    path = cpu_kernels.library("int8_linear")
    name = os.path.basename(path)
    assert os.path.dirname(path) == str(tmp_path)
    assert sorted(os.listdir(tmp_path)) == [name, name + ".lock"]  # and no temporary file
    cpu_kernels.library.cache_clear()
    assert cpu_kernels.library("int8_linear") == path  # found, not built again

    ms.set_context(mode=ms.GRAPH_MODE)

    class Product(nn.Cell):  # x @ w.T of a float16 w
        def __init__(self):
            super().__init__()
            self.op = cpu_kernels.custom_op("int8_linear", "F16WeightMatmul",
                                            ("F32_Default", "F16_Default"), ms.float32)

        def construct(self, x, w):
            return self.op(x, w) + 1.0

    w = np.array([[1.0, -2.0, 0.5], [0.25, 0.0, 4.0]], np.float16)
    static = Product()
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.testing.assert_array_equal(static(Tensor(x), Tensor(w)).asnumpy(), x @ w.T + 1)
    dynamic = Product()
    dynamic.set_inputs(Tensor(shape=[None, 3], dtype=ms.float32),
                       Tensor(shape=[2, 3], dtype=ms.float16))
    for rows in (4, 2, 7):
        x = np.random.default_rng(rows).standard_normal((rows, 3)).astype(np.float32)
        np.testing.assert_allclose(dynamic(Tensor(x), Tensor(w)).asnumpy(),
                                   x @ w.T.astype(np.float32) + 1, rtol=1e-6)


def test_a_kernel_that_does_not_compile_is_refused_naming_its_source(tmp_path, monkeypatch):
    monkeypatch.setenv("MSINFER_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_kernels, "HERE", str(tmp_path))
    (tmp_path / "broken.cc").write_text("this is not C++\n")
    cpu_kernels.library.cache_clear()
    with pytest.raises(cpu_kernels.MsinferError, match=r"broken\.cc failed"):
        cpu_kernels.library("broken")
    # no partial library left (its lock file stays)
    assert [n for n in os.listdir(tmp_path / "cache") if not n.endswith(".lock")] == []
    cpu_kernels.library.cache_clear()


def test_ranks_asking_at_once_build_a_kernel_once(tmp_path, monkeypatch):
    """The ranks of a job on one host ask for a kernel at once: one runs the compiler, the
    others wait for its library."""
    calls = tmp_path / "calls"
    compiler = tmp_path / "slow-g++"  # a compiler that takes its time
    compiler.write_text(f'#!/bin/sh\necho run >> {calls}\nsleep 0.5\n'
                        'while [ "$1" != "-o" ]; do shift; done\necho built > "$2"\n')
    compiler.chmod(0o755)
    monkeypatch.setattr(cpu_kernels.hardware, "KERNEL_COMPILER", str(compiler))
    monkeypatch.setenv("MSINFER_KERNEL_CACHE", str(tmp_path / "cache"))
    with ThreadPoolExecutor(4) as ranks:  # flock: each open file its own lock holder
        paths = set(ranks.map(cpu_kernels.library.__wrapped__, ["moe_experts"] * 4))
    assert len(paths) == 1 and open(paths.pop()).read() == "built\n"
    assert calls.read_text() == "run\n"
