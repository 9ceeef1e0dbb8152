"""Where a decode step of the new engine goes: per graph call, against the matmuls it runs.

    python bench/profile_step.py [--model models/qwen2-0.5b-shape] [--batch 1 16] [--steps 16]

The engine runs a step as one embedding call, the decoder layers in stacks of k layers (one
graph call per stack; k from the workspace, engine/workspace.py) and one lm_head call. This
times every call of `--steps` decode steps (the side-by-side's engine:
max_num_seqs 16 unless --max-num-seqs, max_len 1024, a 32-token prompt), and, in the same process, one layer's
four weight matmuls (qkv, o, gate_up, down at the model's shapes) alone in one graph: the
difference per layer is what is not weight matmul (attention over the gathered context, cache
writes, norms, rotary, its share of the call).
"""
import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from timing import best_ms  # noqa: E402


class Timed:
    """Stands in for one of the runner's graphs and times each call, the output copied to
    the host so that the time is the call's and not a later one's."""

    def __init__(self, graph, sink):
        self.graph, self.sink = graph, sink

    def __call__(self, *args):
        start = time.perf_counter()
        out = self.graph(*args)
        out.asnumpy()
        self.sink.append(time.perf_counter() - start)
        return out

    @property
    def compile_cache(self):  # the runner counts its graphs' compilations
        return self.graph.compile_cache


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=os.path.join(ROOT, "models", "qwen2-0.5b-shape"))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=16,
                   help="the engine's max_num_seqs (the KV pool holds that many x 1024 tokens)")
    args = p.parse_args(argv)

    import mindspore as ms
    import numpy as np
    from mindspore import Tensor, nn, ops

    from msinfer import LLM
    from msinfer.engine.sampling import SamplingParams

    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, max_len=1024)
    print(f"KV pool {llm.memory.kv_cache_bytes / 1e6:.0f} MB "
          f"({llm.memory.layout.usable_tokens} tokens)", flush=True)
    runner, c = llm.engine.runner, llm.config
    rng = np.random.default_rng(0)

    class Matmuls(nn.Cell):
        def __init__(self):
            super().__init__()
            self.mm = ops.MatMul(transpose_b=True)

        def construct(self, x, qkv, o, gate_up, down, xi):
            return (self.mm(x, qkv), self.mm(x, o), self.mm(x, gate_up), self.mm(xi, down))

    h, i = c.hidden_size, c.intermediate_size
    shapes = [(c.q_size + 2 * c.kv_size, h), (h, c.q_size), (2 * i, h), (h, i)]
    weights = [Tensor(rng.standard_normal(s, np.float32)) for s in shapes]
    matmuls = Matmuls()
    for batch in args.batch:
        prompts = rng.integers(0, c.vocab_size, (batch, 32)).tolist()
        params = SamplingParams(max_tokens=args.steps + 1, temperature=0, ignore_eos=True)
        llm.generate(prompts, params)  # compiles
        calls = {"embedding": [], "stack": [], "head": []}
        graphs = runner.embedding, dict(runner.stacks), runner.head
        runner.embedding = Timed(graphs[0], calls["embedding"])
        runner.stacks = {k: Timed(g, calls["stack"]) for k, g in graphs[1].items()}
        runner.head = Timed(graphs[2], calls["head"])
        before = dict(runner.timings)
        llm.generate(prompts, params)
        runner.embedding, runner.stacks, runner.head = graphs
        steps = runner.timings["decode_steps"] - before["decode_steps"]
        step_ms = (runner.timings["decode_s"] - before["decode_s"]) / steps * 1e3
        per_layer = runner.layers_per_call(batch, batch, runner.context_buckets[0])
        stacks_per_step = c.num_layers // per_layer
        # The decode calls are the last `steps` of each kind (the prefill ran first).
        stack = calls["stack"][-steps * stacks_per_step:]
        x = Tensor(rng.standard_normal((batch, h), np.float32))
        xi = Tensor(rng.standard_normal((batch, i), np.float32))
        mm = best_ms(lambda: [t.asnumpy() for t in matmuls(x, *weights, xi)])
        stack_ms = statistics.median(stack) * 1e3
        layer_ms = stack_ms / per_layer
        print(f"batch {batch:>2}: decode step {step_ms:.1f} ms = embedding "
              f"{statistics.median(calls['embedding'][-steps:]) * 1e3:.1f} + {stacks_per_step} "
              f"call(s) of {per_layer} layers x {stack_ms:.2f} + lm_head "
              f"{statistics.median(calls['head'][-steps:]) * 1e3:.1f} (+ host); one layer's 4 "
              f"weight matmuls alone in one graph: {mm:.2f} ms, so {layer_ms - mm:.2f} ms per "
              f"layer is not weight matmul ({(layer_ms - mm) * c.num_layers:.0f} ms per "
              f"step)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
