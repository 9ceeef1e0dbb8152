"""The new engine beside the old static-batch one (commit 8717a73) on the side-by-side's
decode and prefill cases, in turns, on the same machine state.

    python bench/old_vs_new.py [--old-engine /work/old-engine] [--rounds 2]

Both run as `engine_worker.py` processes on models/qwen2-0.5b-shape (new: max_num_seqs 16,
max_len 1024; old: max_batch 16, max_len 1024). Per case and round each side times a
1-token and an N-token generate; decode step = (t(N) - t(1)) / (N - 1). Prints a table and
writes bench/results/old_vs_new.json.
"""
import argparse
import json
import os
import statistics
import sys

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)

from engine import ROOT, Worker  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old-engine", default="/work/old-engine")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    import numpy as np
    model = os.path.join(ROOT, "models", "qwen2-0.5b-shape")
    logs = os.path.join(BENCH, "results", "logs")
    os.makedirs(logs, exist_ok=True)
    sides = {"new": Worker("ovn-new", "msinfer", model, {"max_num_seqs": 16, "max_len": 1024},
                           logs),
             "old": Worker("ovn-old", "old", model, {"max_batch": 16, "max_len": 1024}, logs,
                           old_engine=args.old_engine)}
    rng = np.random.default_rng(0)
    cases = [("decode b1", 1, 32, 64), ("decode b16", 16, 32, 32), ("prefill 512", 1, 512, 1)]
    results = {}
    for name, batch, length, tokens in cases:
        prompts = rng.integers(0, 151936, (batch, length)).tolist()
        for w in sides.values():  # compile
            w.ask(op="generate", prompts=prompts, max_tokens=[tokens] * batch)
            w.ask(op="generate", prompts=prompts, max_tokens=[1] * batch)
        figures = {k: {"step": [], "first": [], "others": []} for k in sides}
        for r in range(args.rounds):
            for key in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                first = sides[key].measured(op="generate", prompts=prompts,
                                            max_tokens=[1] * batch)
                figures[key]["first"].append(first["seconds"])
                figures[key]["others"].append(first["other_load"])
                if tokens > 1:
                    full = sides[key].measured(op="generate", prompts=prompts,
                                               max_tokens=[tokens] * batch)
                    figures[key]["step"].append((full["seconds"] - first["seconds"])
                                                / (tokens - 1))
                    figures[key]["others"].append(full["other_load"])
        results[name] = figures
        line = [name]
        for key, f in figures.items():
            if f["step"]:
                line.append(f"{key}: {batch / statistics.median(f['step']):.2f} tok/s")
            else:
                line.append(f"{key}: {batch * length / statistics.median(f['first']):.1f} "
                            f"prefill tok/s")
            line.append(f"(others {max(f['others']):.2f} cores)")
        print("  ".join(line), flush=True)
    for w in sides.values():
        w.close()
    with open(os.path.join(BENCH, "results", "old_vs_new.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
