"""What MindSpore 2.10 does with quantized semi_auto on CPU: a minimal reproduction.

    python bench/semi_auto_quantized.py          # starts itself under msrun, 2 ranks

Three findings, each printed with MindSpore's own words:

1. The quantized matmuls MindSpore can shard are Ascend kernels. Its auto-parallel front end
   has operator infos for QuantV2, QuantBatchMatmul and WeightQuantBatchMatmul
   (libmindspore_frontend.so: QuantV2Info, QuantBatchMatmulInfo, WeightQuantBatchMatmulInfo),
   the primitives msinfer's Ascend methods use (layers/linear_methods.py); stand-alone on
   CPU, QuantBatchMatmul on int8 tensors has no kernel.
2. msinfer's CPU form of W8A8 (round, clip, int8 x int8 MatMul, + quant_bias, * deq_scale),
   given the column-parallel in_strategy semi_auto would give it (x whole, weight, quant_bias
   and deq_scale split by output), does not compile for two ranks: MindSpore refuses
   semi_auto_parallel on CPU at compile time, whatever the primitives.
3. But a stand-alone GRAPH_MODE compile of QuantV2 + QuantBatchMatmul carrying shard()
   strategies writes the graph after the opt_a pass group (each primitive, its input shapes,
   its in_strategy) before it fails at kernel selection ("Unsupported op [QuantV2] on CPU"):
   what `msinfer layouts` reads, so a quantized model's semi_auto layout is checked on CPU
   (docs/quantization.md, "semi_auto") though it runs on Ascend only.
"""
import os
import subprocess
import sys
import tempfile

import numpy as np


def standalone_quant_batch_matmul():
    import mindspore as ms
    from mindspore.ops.auto_generate import QuantBatchMatmul

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    x = ms.Tensor(np.ones((2, 8), np.int8))
    w = ms.Tensor(np.ones((4, 8), np.int8))
    scale = ms.Tensor(np.ones(4, np.float32))
    try:
        out = QuantBatchMatmul(transpose_x2=True, dtype=ms.float16)(x, w, scale)
        return f"ran: {out.asnumpy().tolist()}"
    except Exception as e:  # noqa: BLE001  (what MindSpore says is the finding)
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"


def ir_before_kernel_selection():
    """Finding 3: the opt_a graph of a sharded QuantV2 + QuantBatchMatmul, compiled
    stand-alone on CPU, and where the compile stopped."""
    import mindspore as ms
    from mindspore import nn
    from mindspore.ops.auto_generate import QuantBatchMatmul, QuantV2

    from msinfer.tools.layouts import STAGE, dumping_ir, parse_ir, stage_dumps

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")

    class W8A8Column(nn.Cell):
        def __init__(self, t):
            super().__init__()
            self.quant = QuantV2().shard(((1, 1), (1,), (1,)))
            self.qbmm = QuantBatchMatmul(transpose_x2=True, dtype=ms.float16).shard(
                ((1, 1), (t, 1), (t,), (t,)))

        def construct(self, x, weight, deq_scale, quant_bias, scale, offset):
            x_q = self.quant(x, scale, offset, False, "ROUND", ms.int8)
            return self.qbmm(x_q, weight, deq_scale, None, quant_bias)

    args = (ms.Tensor(np.ones((2, 8), np.float16)), ms.Tensor(np.ones((4, 8), np.int8)),
            ms.Tensor(np.ones(4, np.int64)), ms.Tensor(np.zeros(4, np.int32)),
            ms.Tensor(np.ones(1, np.float16)), ms.Tensor(np.zeros(1, np.float16)))
    folder = tempfile.mkdtemp(prefix="semi-auto-quant-ir-")
    with dumping_ir(folder):
        try:
            W8A8Column(2)(*args)
            stopped = "it compiled and ran"
        except RuntimeError as e:  # the finding: where MindSpore stopped
            stopped = next(line for line in str(e).splitlines() if "Unsupported op" in line)
    dumps = [f for f in os.listdir(folder) if f.startswith(STAGE)]
    if not dumps:
        return f"no {STAGE}*.ir written; {stopped}"
    with open(os.path.join(folder, stage_dumps(folder)[-1])) as f:
        calls = [c for c in parse_ir(f.read(), "bench") if c.op.startswith("Quant")]
    read = "; ".join(f"{c.op} {c.inputs} in_strategy {c.strategy}" for c in calls)
    return f"{dumps[-1]} written: {read}. Then: {stopped.strip()}"


def semi_auto_rank():
    """One rank: msinfer's CPU W8A8 form, column-parallel, compiled under semi_auto."""
    import mindspore as ms
    from mindspore import nn, ops
    from mindspore.communication import get_rank, init
    from mindspore.parallel.auto_parallel import AutoParallel

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    init()

    class W8A8Column(nn.Cell):
        def __init__(self, t):
            super().__init__()
            self.div = ops.Div().shard(((1, 1), ()))
            self.add_offset = ops.Add().shard(((1, 1), ()))
            self.round = ops.Round().shard(((1, 1),))
            self.matmul = ops.MatMul(transpose_b=True).shard(((1, 1), (t, 1)))
            self.add_bias = ops.Add().shard(((1, t), (t,)))
            self.mul = ops.Mul().shard(((1, t), (t,)))

        def construct(self, x, weight, quant_bias, deq_scale, input_scale, input_offset):
            x_q = ops.clamp(self.round(self.add_offset(self.div(x, input_scale),
                                                       input_offset)), -128.0, 127.0)
            acc = self.matmul(x_q, ops.cast(weight, ms.float32))
            return self.mul(self.add_bias(acc, quant_bias), deq_scale)

    cell = AutoParallel(W8A8Column(2), parallel_mode="semi_auto")
    cell.dataset_strategy("full_batch")
    args = (ms.Tensor(np.ones((2, 8), np.float32)), ms.Tensor(np.ones((4, 8), np.int8)),
            ms.Tensor(np.zeros(4, np.float32)), ms.Tensor(np.ones(4, np.float32)),
            ms.Tensor(0.5, ms.float32), ms.Tensor(0.0, ms.float32))
    try:
        out = cell(*args)
        result = f"compiled and ran: {out.asnumpy().tolist()}"
    except Exception as e:  # noqa: BLE001
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        where = [line for line in lines if ".cc:" in line][:1]  # the C++ site that refused
        result = f"{type(e).__name__}: {' at '.join(lines[:1] + where) if lines else e}"
    print(f"rank {get_rank()}: semi_auto W8A8 column-parallel on CPU: {result}", flush=True)


def main():
    if "--rank" in sys.argv:
        semi_auto_rank()
        return 0
    print("1. QuantBatchMatmul stand-alone on CPU:", standalone_quant_batch_matmul(),
          flush=True)
    from msinfer.parallel.distributed import free_port

    logs = tempfile.mkdtemp(prefix="semi-auto-quant-")
    msrun = os.path.join(os.path.dirname(sys.executable), "msrun")
    env = dict(os.environ, GLOG_v="3",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    subprocess.run([msrun, "--worker_num=2", "--local_worker_num=2",
                    f"--master_port={free_port()}", f"--log_dir={logs}", "--join=True",
                    "--cluster_time_out=120", os.path.abspath(__file__), "--rank"],
                   env=env, capture_output=True, text=True, timeout=300)
    print("2. the CPU W8A8 form under semi_auto, 2 ranks (msrun):")
    for name in sorted(os.listdir(logs)):
        with open(os.path.join(logs, name), errors="replace") as f:
            for line in f:
                if line.startswith("rank "):
                    print("  ", line.rstrip())
    print("3. QuantV2 + QuantBatchMatmul with shard(), stand-alone GRAPH_MODE on CPU:",
          ir_before_kernel_selection(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
