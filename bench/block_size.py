"""How the KV block size affects speed and memory, to choose its default.

    python bench/block_size.py [--model DIR] [--sizes 4 16 64 256]

One process, one LLM per block size, the same seeded workload on each (requests of mixed
prompt and output lengths, all submitted at once, greedy), the sizes taking turns over two
rounds. Reports per size: output tokens/s, graph time per decode step, and the KV cache the
workload left unused inside its sequences' last blocks (internal fragmentation, measured
from the block tables at its peak). Writes bench/results/block_size.json.
"""
import argparse
import json
import os
import platform
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def workload(vocab, count=12, seed=0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, int(n)).tolist() for n in rng.integers(16, 300, count)]
    outputs = [int(n) for n in rng.integers(8, 48, count)]
    return prompts, outputs


def run(llm, prompts, outputs):
    from msinfer import SamplingParams

    engine = llm.engine
    for i, (p, n) in enumerate(zip(prompts, outputs)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0,
                                                      ignore_eos=True))
    before = dict(engine.runner.timings)
    start, waste = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        # Slots held past each sequence's last token: the cost of a coarser block.
        waste = max(waste, sum(len(s.block_table) * engine.layout.block_size - s.length
                               for s in engine.scheduler.running))
    seconds = time.perf_counter() - start
    tokens = sum(outputs)
    t = engine.runner.timings
    steps = t["decode_steps"] - before["decode_steps"]
    return {"seconds": seconds, "output_tokens_per_s": tokens / seconds,
            "decode_step_ms": 1e3 * (t["decode_s"] - before["decode_s"]) / max(steps, 1),
            "peak_unused_slots_in_held_blocks": waste}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=os.path.join(ROOT, "models", "bench-small"),
                   help="made if missing: 8 layers, hidden 512, 8 heads over 2 KV heads")
    p.add_argument("--sizes", type=int, nargs="+", default=[4, 16, 64, 256])
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "block_size.json"))
    args = p.parse_args()
    from msinfer import LLM
    from msinfer.tools.tiny_model import make_tiny_model

    if not os.path.isfile(os.path.join(args.model, "config.json")):
        make_tiny_model(args.model, layers=8, hidden=512, heads=8, kv_heads=2, vocab=8192,
                        seed=0)
    llms = {b: LLM(args.model, max_len=512, block_size=b, max_num_seqs=16,
                   kv_cache_memory=64 << 20) for b in args.sizes}
    prompts, outputs = workload(llms[args.sizes[0]].config.vocab_size)
    for llm in llms.values():  # compile every shape the workload uses
        run(llm, prompts, outputs)
    rounds = {b: [] for b in args.sizes}
    for r in range(2):
        for b in (args.sizes if r % 2 == 0 else args.sizes[::-1]):
            rounds[b].append(run(llms[b], prompts, outputs))
    result = {"model": args.model, "machine": platform.processor() or platform.machine(),
              "cores": os.cpu_count(), "requests": len(prompts),
              "sizes": {b: {k: float(np.median([x[k] for x in rs])) for k in rs[0]}
                        for b, rs in rounds.items()}}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{'block':>6} {'tokens/s':>9} {'decode ms/step':>15} {'unused slots at peak':>21}")
    for b, f in result["sizes"].items():
        print(f"{b:>6} {f['output_tokens_per_s']:>9.2f} {f['decode_step_ms']:>15.1f} "
              f"{f['peak_unused_slots_in_held_blocks']:>21.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
