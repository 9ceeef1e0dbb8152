"""Where a decode step's time goes: per-kernel speed, and the host side around the graph.

    python bench/profile_decode.py [--model models/qwen2-0.5b-shape] [--batch 1 16]

1. Kernels: each distinct weight shape of the model as one MatMul(x, W^T), timed alone in
   a MindSpore GRAPH_MODE cell and as torch's F.linear (what HF runs), at each batch size:
   milliseconds, GB/s of weights and GFLOP/s, and the sum over one decode step (every layer's
   matmuls plus the lm_head). If the MindSpore sum is near the measured decode step, the
   matmul kernels bound the step; if not, the rest of the graph (attention, cache updates,
   elementwise ops, launches) does.
2. KV cache size: the batch-1 decode step with a small KV pool (max_num_seqs 1, max_len 128)
   and with the benchmark's (max_num_seqs 16, max_len 1024). The weights read are
   the same; a difference is work that grows with the cache, not with the tokens.
3. Host: pyinstrument over a warmed-up batch-1 msinfer generate: the share of wall time spent
   inside the compiled graph versus Python (sampling, input preparation, .asnumpy()).
Heavy: run it alone, not while the benchmark runs.
"""
import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from timing import best_ms  # noqa: E402


def weight_shapes(config):
    """{(out, in): how many of that matmul one decode step runs}."""
    counts = {}
    for name, shape in config.parameter_shapes().items():
        if len(shape) != 2 or "embed_tokens" in name:
            continue
        counts[tuple(shape)] = counts.get(tuple(shape), 0) + 1
    if config.tie_word_embeddings:  # the lm_head reads the embedding
        shape = (config.vocab_size, config.hidden_size)
        counts[shape] = counts.get(shape, 0) + 1
    return counts


def kernels(config, batches):
    import mindspore as ms
    import numpy as np
    import torch
    from mindspore import Tensor, nn, ops

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")

    class Linear(nn.Cell):
        def __init__(self):
            super().__init__()
            self.matmul = ops.MatMul(transpose_b=True)

        def construct(self, x, w):
            return self.matmul(x, w)

    rng = np.random.default_rng(0)
    # A graph call costs this much even for a tiny matmul (launch and copy-out); the
    # figures below have it subtracted, as a kernel inside a whole-step graph does not pay it.
    tiny = Linear()
    tx, tw = Tensor(np.ones((1, 8), np.float32)), Tensor(np.ones((8, 8), np.float32))
    floor = best_ms(warmup=2, fn=lambda: tiny(tx, tw).asnumpy())
    rows = [f"MindSpore graph call floor: {floor:.3f} ms (subtracted below)"]
    for batch in batches:
        totals = {"mindspore": 0.0, "torch": 0.0}
        for (out, inp), count in weight_shapes(config).items():
            w = rng.standard_normal((out, inp), np.float32)
            x = rng.standard_normal((batch, inp), np.float32)
            cell, wm, xm = Linear(), Tensor(w), Tensor(x)
            ms_ms = max(best_ms(warmup=2, fn=lambda: cell(xm, wm).asnumpy()) - floor, 1e-3)
            wt, xt = torch.from_numpy(w), torch.from_numpy(x)
            with torch.inference_mode():
                torch_ms = best_ms(warmup=2, fn=lambda: torch.nn.functional.linear(xt, wt))
            for side, t in (("mindspore", ms_ms), ("torch", torch_ms)):
                totals[side] += count * t
                rows.append(f"batch {batch:>2} {out:>6}x{inp:<5} x{count:<3} {side:<9} "
                            f"{t:8.3f} ms {w.nbytes / t / 1e6:7.1f} GB/s "
                            f"{2 * batch * out * inp / t / 1e6:7.1f} GFLOP/s")
        rows.append(f"batch {batch:>2} one decode step's matmuls: mindspore "
                    f"{totals['mindspore']:.1f} ms, torch {totals['torch']:.1f} ms")
    return rows


def decode_step_ms(llm, tokens):
    """Engine decode step (graph only) of one batch-1 generate, in ms."""
    from msinfer.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    before = dict(llm.engine.runner.timings)
    llm.generate([[1000] * 32], params)
    return ((llm.engine.runner.timings["decode_s"] - before["decode_s"]) * 1e3
            / (llm.engine.runner.timings["decode_steps"] - before["decode_steps"]))


def cache_sizes(model_dir, tokens, rounds=3):
    """Both models loaded at once and measured in turns, so machine noise hits both."""
    import statistics

    from msinfer import LLM

    sizes = ((1, 128), (16, 1024))
    llms = [LLM(model_dir, max_num_seqs=b, max_len=n) for b, n in sizes]
    for llm in llms:
        decode_step_ms(llm, tokens)  # compile
    steps = [[] for _ in llms]
    for _ in range(rounds):
        for llm, times in zip(llms, steps):
            times.append(decode_step_ms(llm, tokens))
    cache_bytes = [llm.memory.kv_cache_bytes for llm in llms]
    return [f"KV cache max_num_seqs {b:>2}, max_len {n:>4} ({size / 1e6:.0f} MB): batch-1 decode "
            f"step {statistics.median(times):.1f} ms (of {', '.join(f'{t:.0f}' for t in times)})"
            for (b, n), size, times in zip(sizes, cache_bytes, steps)]


def host_profile(model_dir, batch, tokens):
    """pyinstrument's text report of one warmed-up generate, and a one-line summary."""
    from pyinstrument import Profiler

    from msinfer import LLM
    from msinfer.engine.sampling import SamplingParams

    llm = LLM(model_dir, max_num_seqs=batch, max_len=256)
    prompts = [[1000 + i] * 32 for i in range(batch)]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, params)  # compile
    before = dict(llm.engine.runner.timings)
    profiler = Profiler(interval=0.001)
    profiler.start()
    start = time.perf_counter()
    llm.generate(prompts, params)
    wall = time.perf_counter() - start
    profiler.stop()
    stats = {k: v - before[k] for k, v in llm.engine.runner.timings.items()}
    graph = stats["prefill_s"] + stats["decode_s"]
    summary = (f"batch {batch}: {tokens} tokens in {wall:.2f} s; inside the engine's prefill/"
               f"decode calls {graph:.2f} s ({graph / wall:.0%}); decode step "
               f"{stats['decode_s'] / stats['decode_steps'] * 1e3:.1f} ms")
    return summary, profiler.output_text(color=False, unicode=False, show_all=False)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=os.path.join(ROOT, "models", "qwen2-0.5b-shape"))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--tokens", type=int, default=16)
    args = p.parse_args()
    os.environ.setdefault("GLOG_v", "3")
    from msinfer.config import ModelConfig

    config = ModelConfig.from_model_dir(args.model)
    print("\n".join(kernels(config, args.batch)), flush=True)
    print("\n".join(cache_sizes(args.model, args.tokens)), flush=True)
    summary, text = host_profile(args.model, 1, args.tokens)
    print(summary)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
