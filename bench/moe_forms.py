"""Forms of a sparse layer's experts at decode, on MindSpore's CPU backend: what the step
of a MoE costs over a dense MLP of the same active size, and whether a form that reads the
routed experts where they lie (no copy) beats the by-token form's gather.

    python bench/moe_forms.py [--out bench/results] [--reps 15]

The experts part of 8 sparse layers (8 of 128 experts of width 128, hidden 512: bench/moe.py's
MoE) in one GRAPH_MODE Cell per form, weights as graph arguments as the engine passes them,
one process, forms alternated, median ms per call of the 8 layers, at 1 and 8 tokens:
- `kernel`: layers/moe.SparseMoE as decode runs it on CPU with g++: its router and the C++
  kernel reading the routed experts in place (layers/cpu_kernels/moe_experts.cc);
- `by_token`: SparseMoE's MindSpore form without the kernel (router, gather, batched matmuls);
- `route_gather`: its router and gathers only (the copies, no matmul);
- `route`: its router only;
- `dense`: a dense SwiGLU MLP 8 x 128 wide (the same bytes per token), no router;
- `views`: each (token, expert) pair's weights as SelectExtView views, a MatMul each;
- `sparse_matmul`: the routed experts as SparseTensorDenseMatmul's dense operand, laid out
  so the sparse operand (the token's values at its experts' rows) selects them.
Writes OUT/moe_forms.json and .md with the machine and its load.
"""
import argparse
import json
import os
import statistics
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)

from machine import machine_record, record_load_at_end  # noqa: E402

E, K, I, H, LAYERS = 128, 8, 128, 512, 8


def forms(tokens):
    import mindspore as ms
    import numpy as np
    from mindspore import Tensor, nn, ops
    from mindspore.ops.auto_generate import SelectExtView, SiLU

    from msinfer.config import ModelConfig
    from msinfer.layers.moe import SparseMoE
    from msinfer.layers.parallel_context import ParallelContext
    from msinfer.parallel.strategy import Strategy
    from msinfer.planning.shapes import Graph

    config = ModelConfig.from_dict(dict(
        model_type="qwen3_moe", vocab_size=64, hidden_size=H, intermediate_size=K * I,
        num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4, num_experts=E,
        num_experts_per_tok=K, moe_intermediate_size=I, norm_topk_prob=True))
    plan = Strategy(world_size=1, tensor=1, rules=Strategy.default().rules).resolve(config)
    ctx = ParallelContext(config=config, plan=plan, dtype=ms.float32,
                          graph=Graph("layers", "decode", 1, rows=tokens))

    class Stack(nn.Cell):
        """LAYERS layers of `make()`, each x + layer(x, its weights...)."""

        def __init__(self, make, per_layer):
            super().__init__()
            self.layers = nn.CellList([make() for _ in range(LAYERS)])
            self.per_layer = per_layer

        def construct(self, x, *weights):
            for n in range(LAYERS):
                x = x + self.layers[n](x, *weights[n * self.per_layer:(n + 1) * self.per_layer])
            return x

    class RouteGather(nn.Cell):
        def __init__(self, gather):
            super().__init__()
            self.moe = SparseMoE(ctx, "model.layers.0.mlp")
            self.gather = gather
            self.pick = ops.Gather()

        def construct(self, x, w_router, w_gate_up, w_down):
            weights, ids = self.moe._route(x, w_router)
            out = weights.sum() + ids.sum().astype(ms.float32)
            if self.gather:
                pairs = ids.reshape(-1)
                out = (out + self.pick(w_gate_up, pairs, 0)[0, 0, 0]
                       + self.pick(w_down, pairs, 0)[0, 0, 0])
            return ops.zeros_like(x) + out

    class Dense(nn.Cell):
        def __init__(self):
            super().__init__()
            self.gate_up = ops.MatMul(transpose_b=True)
            self.down = ops.MatMul()
            self.halves = ops.Split(-1, 2)
            self.silu = SiLU()

        def construct(self, x, w_gate_up, w_down):
            gate, up = self.halves(self.gate_up(x, w_gate_up))
            return self.down(self.silu(gate) * up, w_down)

    class Views(nn.Cell):
        def __init__(self):
            super().__init__()
            self.moe = SparseMoE(ctx, "model.layers.0.mlp")
            self.view = SelectExtView()
            self.gate_up = ops.MatMul(transpose_b=True)
            self.down = ops.MatMul()
            self.halves = ops.Split(-1, 2)
            self.silu = SiLU()

        def construct(self, x, w_router, w_gate_up, w_down):
            weights, ids = self.moe._route(x, w_router)
            rows = ()
            for t in range(tokens):
                y = None
                for j in range(K):
                    gate, up = self.halves(self.gate_up(x[t:t + 1],
                                                        self.view(w_gate_up, 0, ids[t, j])))
                    part = self.down(self.silu(gate) * up * weights[t, j],
                                     self.view(w_down, 0, ids[t, j]))
                    y = part if y is None else y + part
                rows = rows + (y,)
            return ops.concat(rows, 0)

    class SparseMatmul(nn.Cell):
        """gate/up held (experts x hidden, 2I): row e*H + h is input h of expert e, so pair p's
        products are the sum over h of x[h] * row(e_p*H + h); down (experts x I, hidden)."""

        def __init__(self):
            super().__init__()
            self.moe = SparseMoE(ctx, "model.layers.0.mlp")
            self.matmul = ops.SparseTensorDenseMatmul()
            self.halves = ops.Split(-1, 2)
            self.silu = SiLU()
            pairs = tokens * K
            self.pair_of_h = Tensor(np.repeat(np.arange(pairs), H).astype(np.int64))
            self.h = Tensor(np.tile(np.arange(H), pairs).astype(np.int64))
            self.token_of_i = Tensor(np.repeat(np.arange(tokens), K * I).astype(np.int64))
            self.i = Tensor(np.tile(np.arange(I), pairs).astype(np.int64))

        def construct(self, x, w_router, w_gate_up, w_down):
            weights, ids = self.moe._route(x, w_router)
            experts = ids.reshape(-1).astype(ms.int64)
            cols = ops.repeat_interleave(experts * H, H, 0) + self.h
            values = ops.tile(x, (1, K)).reshape(-1)
            gate_up = self.matmul(ops.stack((self.pair_of_h, cols), 1), values,
                                  (tokens * K, E * H), w_gate_up)
            gate, up = self.halves(gate_up)
            act = (self.silu(gate) * up * weights.reshape(-1, 1)).reshape(-1)
            cols = ops.repeat_interleave(experts * I, I, 0) + self.i
            return self.matmul(ops.stack((self.token_of_i, cols), 1), act, (tokens, E * I),
                               w_down.reshape(E * I, H))

    rng = np.random.default_rng(0)

    def tensor(*shape):
        return Tensor(rng.standard_normal(shape, dtype=np.float32) * 0.05)

    moe_weights, dense_weights, sparse_weights = [], [], []
    for _ in range(LAYERS):
        router, gate_up, down = tensor(E, H) * 20, tensor(E, 2 * I, H), tensor(E, I, H)
        moe_weights += [router, gate_up, down]
        sparse_weights += [router, Tensor(np.ascontiguousarray(
            gate_up.asnumpy().transpose(0, 2, 1)).reshape(E * H, 2 * I)), down]
        dense_weights += [tensor(2 * K * I, H), tensor(K * I, H)]
    def gathering():  # the MindSpore form, as where g++ is missing
        layer = SparseMoE(ctx, "model.layers.0.mlp")
        layer.kernel = None
        return layer

    forms = {"kernel": (lambda: SparseMoE(ctx, "model.layers.0.mlp"), 3, moe_weights)}
    if forms["kernel"][0]().kernel is None:
        del forms["kernel"]  # no g++ here
    return {
        **forms,
        "by_token": (gathering, 3, moe_weights),
        "route_gather": (lambda: RouteGather(True), 3, moe_weights),
        "route": (lambda: RouteGather(False), 3, moe_weights),
        "dense": (Dense, 2, dense_weights),
        "views": (Views, 3, moe_weights),
        "sparse_matmul": (SparseMatmul, 3, sparse_weights),
    }, Stack, tensor(tokens, H)


def measure(tokens, reps):
    made, stack, x = forms(tokens)
    cells = {name: (stack(make, n), weights) for name, (make, n, weights) in made.items()}
    outputs = {name: cell(x, *w).asnumpy() for name, (cell, w) in cells.items()}  # compiles
    for name in {"kernel", "views", "sparse_matmul"} & set(outputs):  # by_token's numbers
        diff = abs(outputs[name] - outputs["by_token"]).max()
        assert diff < 1e-3 * (1 + abs(outputs["by_token"]).max()), (name, diff)
    times = {name: [] for name in cells}
    for _ in range(reps):
        for name, (cell, weights) in cells.items():
            start = time.perf_counter()
            for _ in range(5):
                cell(x, *weights).asnumpy()
            times[name].append((time.perf_counter() - start) / 5 * 1000)
    return {name: round(statistics.median(v), 2) for name, v in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(BENCH, "results"))
    p.add_argument("--reps", type=int, default=15)
    args = p.parse_args(argv)
    import mindspore as ms

    from msinfer.parallel.distributed import set_graph_mode

    set_graph_mode("CPU")
    machine = machine_record()
    results = {f"tokens{t}": measure(t, args.reps) for t in (1, 8)}
    record = dict(
        machine=record_load_at_end(machine),
        shape=dict(experts=E, top_k=K, width=I, hidden=H, layers=LAYERS),
        reps=args.reps, median_ms_per_call=results)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "moe_forms.json"), "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    names = list(results["tokens1"])
    lines = [
        "# Sparse-layer expert forms at decode (MindSpore CPU)", "",
        f"`python bench/moe_forms.py`: {machine['cpu']}, {machine['cores']} cores, load "
        f"average {machine['load_average_at_start']} at the start, "
        f"{machine['load_average_at_end']} at the end; MindSpore {ms.__version__}. "
        f"The experts part of {LAYERS} layers ({K} of {E} experts of {I}, hidden {H}), median "
        f"ms per call of {args.reps} alternated.", "",
        "| tokens | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for key, row in results.items():
        lines.append(f"| {key[6:]} | " + " | ".join(str(row[n]) for n in names) + " |")
    with open(os.path.join(args.out, "moe_forms.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
