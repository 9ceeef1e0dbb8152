"""What MindSpore's CPU kernels keep, and copy, that the engine's graph forms avoid.

    python bench/cpu_kernel_memory.py [--json bench/results/cpu_kernel_memory.json]

Three probes, each on fresh GRAPH_MODE Cells in this process:
1. Memory a compiled graph keeps for its lifetime, per instance: the RSS growth of the second
   and third new Cell of a kind (the first also pays for the memory pool's first touch), for
   a score-plus-mask Add at a 256-token chunk over 512 of context with the mask broadcast
   implicitly and after a BroadcastTo (parallel_layers.Expand), a norm's row scale likewise,
   and a Transpose of a batch-16 decode's gathered keys over 1,024 positions (what
   CacheLayout.rows_by_head avoids).
2. The same Cell called six times in one graph over Tensor caches it updates (one
   ScatterUpdate and one Gather per call), against six distinct Cells (model.LayerStack): the
   call's time with 8 MB and 128 MB caches.
3. Reshaping a cache that the same graph updates (write, then gather from the reshaped
   cache), against gathering from a cache already held in that shape (kv_cache.rows_shape).
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from timing import best_ms  # noqa: E402


def rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1e3
    return 0.0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)

    import mindspore as ms
    import numpy as np
    from mindspore import Tensor, nn, ops
    from mindspore.common.initializer import Zero

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    report = {"mindspore": ms.__version__, "kept_per_graph_mb": {}, "cache_calls_ms": {},
              "reshaped_cache_ms": {}}

    class Binary(nn.Cell):
        def __init__(self, op, expand):
            super().__init__()
            self.op, self.expand = op, expand

        def construct(self, a, b):
            if self.expand:
                b = ops.broadcast_to(b, a.shape)
            return self.op(a, b)

    class Transposed(nn.Cell):
        def construct(self, a, b):
            return ops.Transpose()(a, (0, 2, 1, 3)) * b

    scores = Tensor(np.ones((1, 2, 7, 256, 512), np.float32))
    mask = Tensor(np.ones((1, 1, 1, 256, 512), np.float32))
    rows = Tensor(np.ones((256, 896), np.float32))
    scale = Tensor(np.ones((256, 1), np.float32))
    keys = Tensor(np.ones((16, 1024, 2, 64), np.float32))
    two = Tensor(2.0, ms.float32)
    cases = (("score + mask, broadcast", lambda: Binary(ops.Add(), False), scores, mask),
             ("score + mask, BroadcastTo first", lambda: Binary(ops.Add(), True), scores, mask),
             ("norm row scale, broadcast", lambda: Binary(ops.Mul(), False), rows, scale),
             ("norm row scale, BroadcastTo first", lambda: Binary(ops.Mul(), True), rows,
              scale),
             ("Transpose of gathered keys", Transposed, keys, two))
    print("memory a compiled graph keeps (RSS growth per new graph: 1st, 2nd, 3rd)")
    for name, make, a, b in cases:
        growth, kept = [], []
        for _ in range(3):
            net = make()
            before = rss_mb()
            net(a, b).asnumpy()
            growth.append(round(rss_mb() - before, 1))
            kept.append(net)
        output_mb = a.nbytes / 1e6
        report["kept_per_graph_mb"][name] = {"growth": growth, "output_mb": output_mb}
        print(f"  {name:36s} {growth} MB (the output is {output_mb:.1f} MB)", flush=True)

    class Layer(nn.Cell):
        def __init__(self):
            super().__init__()
            self.write, self.read = ops.ScatterUpdate(), ops.Gather()

        def construct(self, x, k, v, slots, context):
            k_written = self.write(k, slots, x)
            v_written = self.write(v, slots, x)
            keys = self.read(ops.depend(k, k_written), context, 0)
            values = self.read(ops.depend(v, v_written), context, 0)
            return x + keys[:2] + values[:2]

    class Stack(nn.Cell):
        def __init__(self, distinct, count=6):
            super().__init__()
            self.count = count
            self.layers = nn.CellList([Layer() for _ in range(count if distinct else 1)])

        def construct(self, x, slots, context, *caches):
            for i in range(self.count):
                layer = self.layers[i] if len(self.layers) > 1 else self.layers[0]
                x = layer(x, caches[2 * i], caches[2 * i + 1], slots, context)
            return x

    x = Tensor(np.ones((2, 64), np.float32))
    slots = Tensor(np.array([3, 4], np.int32))
    context = Tensor(np.arange(128, dtype=np.int32))
    print("six layer calls over Tensor caches they update (one call of the graph)")
    for distinct in (False, True):
        name = "six distinct Cells" if distinct else "one Cell called six times"
        report["cache_calls_ms"][name] = {}
        for mb in (8, 128):
            caches = [Tensor(shape=(mb * 10 ** 6 // 256, 64), dtype=ms.float32,
                             init=Zero()).init_data() for _ in range(12)]
            net = Stack(distinct)
            ms_ = best_ms(lambda: net(x, slots, context, *caches).asnumpy(), repeats=10)
            report["cache_calls_ms"][name][f"{mb} MB caches"] = ms_
            del caches
        print(f"  {name:28s} " + ", ".join(f"{k} {v:.2f} ms" for k, v in
                                           report["cache_calls_ms"][name].items()), flush=True)

    class Reshaped(nn.Cell):
        def __init__(self, reshape):
            super().__init__()
            self.reshape = reshape
            self.write, self.read = ops.ScatterUpdate(), ops.Gather()

        def construct(self, cache, slots, update, rows):
            written = self.write(cache, slots, update)
            cache = ops.depend(cache, written)
            if self.reshape:
                cache = cache.reshape(-1, 64)
            return self.read(cache, rows, 0)

    print("write then read a cache in one graph")
    for reshape in (True, False):
        name = "reshaped in the graph" if reshape else "held as rows"
        shape = (16384, 2, 64) if reshape else (32768, 64)
        cache = Tensor(np.zeros(shape, np.float32))
        update = Tensor(np.ones((1, 2, 64) if reshape else (2, 64), np.float32))
        index = Tensor(np.array([5] if reshape else [10, 11], np.int32))
        net = Reshaped(reshape)
        ms_ = best_ms(lambda: net(cache, index, update,
                                  Tensor(np.arange(128, dtype=np.int32))).asnumpy(), repeats=20)
        report["reshaped_cache_ms"][name] = ms_
        print(f"  {name:22s} 8 MB cache: {ms_:.3f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
