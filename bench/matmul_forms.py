"""Which product form MindSpore's CPU MatMul runs fastest on this processor, by row count.

    python bench/matmul_forms.py [--rows 1 2 4 8 16 32 64 128 256] [--layers 24] [--json F]

A decoder layer's four projections at Qwen2-0.5B's shapes (q/k/v 896 -> 1152, o 896 -> 896,
gate/up 896 -> 9728, down 4864 -> 896), through `--layers` layers of distinct random weights
(1.4 GB for 24: they stream from memory, as a decode step's do), in one GRAPH_MODE graph per
form, best of 5 calls:
  x @ W      W stored (in, out)
  x @ W.T    W stored (out, in), as the checkpoint
  (W @ x.T).T  W stored (out, in), the product transposed back
and torch's F.linear on the same weights for reference. hardware.CPU_MATMUL_FORMS holds what
this printed on each processor the project has run on; a new processor's figures go there.
"""
import argparse
import json
import os
import platform
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from msinfer.hardware import cpuinfo_fields  # noqa: E402  (no mindspore import)
from timing import best_ms  # noqa: E402

SHAPES = ((896, 1152), (896, 896), (896, 9728), (4864, 896))  # (in, out)
FORMS = ("x @ W", "x @ W.T", "(W @ x.T).T")


def cpu_model():
    fields = cpuinfo_fields()
    return {k: fields.get(k, "") for k in ("vendor_id", "model name", "cpu family", "model")}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)

    import mindspore as ms
    import numpy as np
    import torch
    from mindspore import Tensor, nn, ops

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    rng = np.random.default_rng(0)
    out_in = [rng.standard_normal(s[::-1], dtype=np.float32) * 0.02
              for _ in range(args.layers) for s in SHAPES]
    weight_bytes = sum(w.nbytes for w in out_in)

    class Products(nn.Cell):
        """Every layer's four products of one form, summed into one output."""

        def __init__(self, form):
            super().__init__()
            self.form = form
            self.x_w = ops.MatMul()
            self.x_wt = ops.MatMul(transpose_b=True)
            self.transpose = ops.Transpose()

        def construct(self, x, x_down, *weights):
            total = x
            for i, w in enumerate(weights):
                inp = x_down if i % 4 == 3 else x
                if self.form == 0:
                    y = self.x_w(inp, w)
                elif self.form == 1:
                    y = self.x_wt(inp, w)
                else:
                    y = self.transpose(self.x_wt(w, inp), (1, 0))
                total = total + y[:, :896]
            return total

    results = []
    for rows in args.rows:
        x = rng.standard_normal((rows, 896), dtype=np.float32)
        x_down = rng.standard_normal((rows, 4864), dtype=np.float32)
        row = {"rows": rows}
        for form, name in enumerate(FORMS):
            weights = [Tensor(np.ascontiguousarray(w.T) if form == 0 else w) for w in out_in]
            net = Products(form)
            row[name] = best_ms(lambda: net(Tensor(x), Tensor(x_down), *weights).asnumpy(),
                                repeats=5)
            del weights, net
        tw = [torch.from_numpy(w) for w in out_in]
        tx, txd = torch.from_numpy(x), torch.from_numpy(x_down)

        def torch_pass():
            total = tx
            with torch.no_grad():
                for i, w in enumerate(tw):
                    total = total + torch.nn.functional.linear(txd if i % 4 == 3 else tx,
                                                               w)[:, :896]
            return total

        row["torch F.linear"] = best_ms(torch_pass, repeats=5)
        best = min(FORMS, key=lambda f: row[f])
        row["fastest"] = best
        results.append(row)
        print(f"rows {rows:4d}: " + ", ".join(f"{k} {row[k]:.1f} ms" for k in
                                              (*FORMS, "torch F.linear"))
              + f"  -> {best} ({weight_bytes / row[best] / 1e6:.1f} GB/s)", flush=True)
    report = {"cpu": cpu_model(), "python": platform.python_version(),
              "mindspore": ms.__version__, "torch": torch.__version__,
              "layers": args.layers, "weight_bytes": weight_bytes, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
