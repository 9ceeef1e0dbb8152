"""What fusing q/k/v and gate/up buys, kernel for kernel, on this machine.

    python bench/fused_matmuls.py [--model models/qwen2-0.5b-shape] [--batch 1 16] [--rounds 5]

Times one decoder layer's projections in MindSpore GRAPH_MODE cells (each cell one graph,
like the engine's per-layer graph): unfused, q, k, v, gate and up as five MatMuls; fused,
qkv and gate_up as two (o_proj and down_proj are the same in both and left out). The two
variants run in turns, `--rounds` times, the best of 20 calls each time; the median of the
rounds is reported, per layer and for all layers of a decode step. This isolates the fusion
from everything else that changed between the old and the new engine.
"""
import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from timing import best_ms  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=os.path.join(ROOT, "models", "qwen2-0.5b-shape"))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)

    import mindspore as ms
    import numpy as np
    from mindspore import Tensor, nn, ops

    from msinfer.config import ModelConfig

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    c = ModelConfig.from_model_dir(args.model)
    hidden, kv = c.hidden_size, c.num_kv_heads * c.head_dim
    rng = np.random.default_rng(0)

    def weight(out):
        return Tensor(rng.standard_normal((out, hidden), np.float32))

    class Unfused(nn.Cell):
        def __init__(self):
            super().__init__()
            self.mm = ops.MatMul(transpose_b=True)

        def construct(self, x, q, k, v, gate, up):
            return (self.mm(x, q), self.mm(x, k), self.mm(x, v), self.mm(x, gate),
                    self.mm(x, up))

    class Fused(nn.Cell):
        def __init__(self):
            super().__init__()
            self.mm = ops.MatMul(transpose_b=True)

        def construct(self, x, qkv, gate_up):
            return self.mm(x, qkv), self.mm(x, gate_up)

    unfused_w = [weight(n) for n in (hidden, kv, kv, c.intermediate_size,
                                     c.intermediate_size)]
    fused_w = [weight(hidden + 2 * kv), weight(2 * c.intermediate_size)]
    unfused, fused = Unfused(), Fused()
    figures = {"model": os.path.relpath(args.model, ROOT), "layers": c.num_layers,
               "rounds": args.rounds, "batches": {}}
    for batch in args.batch:
        x = Tensor(rng.standard_normal((batch, hidden), np.float32))
        times = {"unfused": [], "fused": []}
        for _ in range(args.rounds):
            times["unfused"].append(best_ms(lambda: [t.asnumpy() for t in unfused(x, *unfused_w)]))
            times["fused"].append(best_ms(lambda: [t.asnumpy() for t in fused(x, *fused_w)]))
        u, f = statistics.median(times["unfused"]), statistics.median(times["fused"])
        figures["batches"][batch] = {"unfused_ms_per_layer": u, "fused_ms_per_layer": f,
                                     "saved_ms_per_step": (u - f) * c.num_layers,
                                     "all_rounds": times}
        print(f"batch {batch:>2}: q/k/v + gate/up per layer: unfused {u:.2f} ms, fused "
              f"{f:.2f} ms ({u / f:.2f}x); over {c.num_layers} layers a decode step saves "
              f"{(u - f) * c.num_layers:.1f} ms")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
