"""Decode and prefill speed of two source trees of msinfer, alternated on one machine: what a
change to the compiled graphs (issue 24: graphs of dynamic shape instead of one per call
shape) does to the speed of the engine, measured side by side so that the machine's drift
falls on both.

    python bench/graph_speed.py --before-tree /path/to/checkout-before [--rounds 2]

Each round runs one process per tree (`worker` below, with that tree on PYTHONPATH) on the
0.5B shape: a 512-token prompt then 40 greedy tokens alone (b1), 16 prompts of 100 tokens then
24 tokens each (b16), and a 48-token prompt (p48); each workload once to compile, then twice
measured (the engine's own timings: prefill tokens/s, decode ms per step; the better of two).
Writes bench/results/graph_speed.json and .md: per tree the mean over rounds, and the ratio.
Prefix caching is off so that a repeated prompt is computed again.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = (("b1", 1, 512, 40), ("b16", 16, 100, 24), ("p48", 1, 48, 2))


def worker(model):
    import numpy as np

    from msinfer import LLM
    from msinfer.engine.sampling import SamplingParams

    llm = LLM(model, compile_cache=False, enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    out = {}
    for name, n, length, new in WORKLOADS:
        params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)

        def run():
            before = dict(llm.engine.runner.timings)
            llm.generate([rng.integers(100, 100000, length).tolist() for _ in range(n)],
                         params)
            t = {k: v - before[k] for k, v in llm.engine.runner.timings.items()}
            return (t["prefill_tokens"] / t["prefill_s"],
                    1000 * t["decode_s"] / max(1, t["decode_steps"]))

        run()  # compiles what this workload needs
        runs = [run(), run()]
        out[name] = {"prefill_tokens_per_s": max(r[0] for r in runs),
                     "decode_ms_per_step": min(r[1] for r in runs)}
    out["graphs"] = llm.compilations
    print("RESULT " + json.dumps(out), flush=True)


def measure(tree, model):
    env = dict(os.environ, PYTHONPATH=tree, GLOG_v="3")
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", model],
                          env=env, cwd=tree, capture_output=True, text=True, check=True)
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before-tree", help="a checkout of the earlier commit (required)")
    p.add_argument("--model", default=os.path.join(ROOT, "models", "qwen2-0.5b-shape"))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "graph_speed"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker)
    if not args.before_tree:
        p.error("--before-tree is required")
    sys.path.insert(0, ROOT)
    from msinfer.engine.compile_cache import _processor

    trees = {"before": os.path.abspath(args.before_tree), "after": ROOT}
    commits = {k: subprocess.run(["git", "-C", t, "rev-parse", "--short", "HEAD"],
                                 capture_output=True, text=True).stdout.strip()
               for k, t in trees.items()}
    report = {"model": os.path.relpath(args.model, ROOT), "cpu": f"{_processor()}, "
              f"{os.cpu_count()} cores", "load_at_start": round(os.getloadavg()[0], 2),
              "commits": commits, "rounds": {k: [] for k in trees}}
    for r in range(args.rounds):
        for name, tree in trees.items():
            report["rounds"][name].append(measure(tree, args.model))
            print(f"round {r + 1} {name}: {report['rounds'][name][-1]}", flush=True)
    report["load_at_end"] = round(os.getloadavg()[0], 2)
    lines = [f"graph speed, before ({commits['before']}) and after ({commits['after']}), "
             f"{report['model']}, {report['cpu']}, {args.rounds} rounds alternating; "
             f"load average {report['load_at_start']} at the start, "
             f"{report['load_at_end']} at the end", "",
             "| workload | graphs before / after | prefill tok/s before / after (ratio) "
             "| decode ms/step before / after (ratio) |", "|---|---|---|---|"]
    mean = {k: {w[0]: {m: statistics.mean(r[w[0]][m] for r in runs)
                       for m in ("prefill_tokens_per_s", "decode_ms_per_step")}
                for w in WORKLOADS} for k, runs in report["rounds"].items()}
    report["mean"] = mean
    graphs = {k: runs[-1]["graphs"] for k, runs in report["rounds"].items()}
    for name, *_ in WORKLOADS:
        b, a = mean["before"][name], mean["after"][name]
        lines.append(
            f"| {name} | {graphs['before']} / {graphs['after']} | "
            f"{b['prefill_tokens_per_s']:.1f} / {a['prefill_tokens_per_s']:.1f} "
            f"({a['prefill_tokens_per_s'] / b['prefill_tokens_per_s']:.2f}) | "
            f"{b['decode_ms_per_step']:.1f} / {a['decode_ms_per_step']:.1f} "
            f"({a['decode_ms_per_step'] / b['decode_ms_per_step']:.2f}) |")
    text = "\n".join(lines) + "\n"
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
