"""Prefill speed with the chunk sizes in powers of 2 (the engine's) or of 4 (its first choice).

    python bench/prefill_chunks.py [--model models/qwen2-0.5b-shape] [--rounds 2]

One process per setting, the settings taking turns; each times a 1-token generation of a
128- and a 512-token prompt (best of 3, after a warm-up that compiles). A prompt pads to the
next chunk size: 128 tokens ran as a 256-token chunk with powers of 4.
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(model, factor):
    import numpy as np

    from msinfer import LLM, SamplingParams
    from msinfer.engine.model_runner import power_buckets

    llm = LLM(model, max_len=1024, kv_cache_memory=256 << 20)
    runner = llm.engine.runner
    runner.chunk_buckets = power_buckets(16, llm.limits.max_prefill_tokens, factor)
    rng = np.random.default_rng(0)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    speeds = {}
    for n in (128, 512):
        prompt = rng.integers(0, 1000, n).tolist()
        llm.generate([prompt], one)
        best = min(_timed(llm, prompt, one) for _ in range(3))
        speeds[n] = n / best
    return {"factor": factor, "chunks": list(runner.chunk_buckets), "prefill_tokens_per_s": speeds}


def _timed(llm, prompt, params):
    start = time.perf_counter()
    llm.generate([prompt], params)
    return time.perf_counter() - start


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=os.path.join(ROOT, "models", "qwen2-0.5b-shape"))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--factor", type=int, help=argparse.SUPPRESS)  # one measurement, in a child
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "prefill_chunks.json"))
    args = p.parse_args()
    if args.factor:
        print(json.dumps(measure(args.model, args.factor)))
        return 0
    runs = []
    for _ in range(args.rounds):
        for factor in (4, 2):
            out = subprocess.run([sys.executable, __file__, "--model", args.model, "--factor",
                                  str(factor)], capture_output=True, text=True, check=True,
                                 env=dict(os.environ, PYTHONPATH=ROOT, GLOG_v="3"))
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(runs[-1], flush=True)
    with open(args.out, "w") as f:
        json.dump({"model": os.path.relpath(args.model, ROOT), "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
