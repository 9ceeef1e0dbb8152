"""One rank of the distributed benchmark, started by bench/run.py under mpirun.

Each rank loads its slice, warms up (compiles), then times greedy batch-1 generation of
--new-tokens tokens and of 1 token, --reps times; decode time per token is the difference
over new-tokens - 1 steps. It then measures the time in collectives: the same model with
every collective taken out of new prefill/decode graphs (each rank then computes on its own
slice alone: wrong numbers, the same compute), timed the same way. Time in collectives per
token = decode step time with collectives - without. Each rank writes OUT/rank_R.json with
its own figures and peak RSS.
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
from side_worker import rss_figures


def timed_runs(llm, prompt, new_tokens, reps):
    """Median seconds per decode step and of a 1-token generate (the prefill)."""
    from msinfer.engine.sampling import SamplingParams

    def run(n):
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return time.perf_counter() - start

    steps, firsts = [], []
    for _ in range(reps):
        first, full = run(1), run(new_tokens)
        firsts.append(first)
        steps.append((full - first) / (new_tokens - 1))
    return statistics.median(steps), statistics.median(firsts)


def count_collectives(runner):
    """Collectives one decode step runs: (AllReduce, AllGather). The decoder layer runs once
    per layer."""
    def count(cell, attr):
        return sum(getattr(c, attr, None) is not None for _, c in cell.cells_and_names())

    family = runner.family
    embedding, head = family.Embedding(runner.ctx), family.LMHead(runner.ctx)
    layer = family.LayerStack.LAYER(runner.ctx)
    reduces = (count(embedding, "reduce") + count(head, "reduce")
               + runner.num_layers * count(layer, "reduce"))
    gathers = (count(head, "vocab_gather") + count(embedding, "vocab_gather")
               + runner.num_layers * count(layer, "vocab_gather"))
    return reduces, gathers


def without_collectives(llm):
    """Have the runner build its graphs again, from Cells with no collective: the sharded
    layers keep their slices and skip the AllReduce / AllGather. The lm_head then gives this
    rank's vocabulary block only, so greedy ids stay inside it and the embedding (which skips
    its AllReduce too) looks them up locally. New Cells, because a Cell already compiled keeps
    its graphs whatever its attributes say now."""
    def strip(graph):
        for _, cell in graph.cells_and_names():
            if getattr(cell, "reduce", None) is not None:
                cell.reduce = None
            if getattr(cell, "vocab_gather", None) is not None:
                cell.vocab_gather = None
        return graph

    runner = llm.engine.runner
    build = runner._build
    runner._build = lambda graph: strip(build(graph))
    runner.cells = {}


def param_bytes(runner):
    """Bytes of the weight tensors this rank holds (a tied embedding once)."""
    tensors = {id(t): t for t in [runner.embed_weight, *runner.head_weights]
               + [t for layer in runner.layer_weights for t in layer]}
    return sum(int(np.prod(t.shape)) * t.itemsize for t in tensors.values())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--strategy", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=0,
                   help="MindSpore runtime_num_threads per rank (0: MindSpore's default)")
    args = p.parse_args()
    if args.threads:
        import mindspore as ms
        ms.set_context(runtime_num_threads=args.threads)

    from msinfer import LLM

    start = time.perf_counter()
    llm = LLM(args.model, strategy=args.strategy, max_num_seqs=1,
              max_len=args.prompt_len + args.new_tokens + 1)
    load_seconds = time.perf_counter() - start
    after_load = rss_figures()
    rank, world = llm.dist.rank, llm.dist.world_size
    vocab = llm.config.vocab_size
    # Ids from the first quarter of the vocabulary: inside rank 0's block at every degree
    # up to 4, so the variant without collectives can look them up locally.
    prompt = np.random.default_rng(0).integers(0, vocab // 4, args.prompt_len).tolist()
    reduces, gathers = count_collectives(llm.engine.runner)

    start = time.perf_counter()
    timed_runs(llm, prompt, args.new_tokens, 1)  # warm-up: compiles every graph used
    warmup_seconds = time.perf_counter() - start
    step, first = timed_runs(llm, prompt, args.new_tokens, args.reps)
    peak = rss_figures()["peak_rss_bytes"]

    result = {"rank": rank, "world_size": world, "strategy": os.path.basename(args.strategy),
              "load_seconds": load_seconds, "warmup_seconds": warmup_seconds,
              "decode_step_seconds": step, "decode_tokens_per_s": 1 / step,
              "first_token_seconds": first,
              "rss_after_load_bytes": after_load["rss_bytes"],
              "peak_rss_after_load_bytes": after_load["peak_rss_bytes"],
              "peak_rss_bytes": peak,
              "param_bytes": param_bytes(llm.engine.runner),
              "kv_cache_bytes": llm.memory.kv_cache_bytes,
              "allreduces_per_step": reduces, "allgathers_per_step": gathers,
              "runtime_num_threads": args.threads or "default",
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "reps": args.reps}
    if world > 1:
        without_collectives(llm)
        timed_runs(llm, prompt, args.new_tokens, 1)
        bare_step, _ = timed_runs(llm, prompt, args.new_tokens, args.reps)
        result.update(decode_step_seconds_without_collectives=bare_step,
                      collective_seconds_per_token=step - bare_step)
    with open(os.path.join(args.out, f"rank_{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    from msinfer.parallel.distributed import leave_if_mpirun_rank

    code = main()
    leave_if_mpirun_rank(code)  # as `msinfer` does: MindSpore's teardown can segfault
    sys.exit(code)
