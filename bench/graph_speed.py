"""Decode and prefill speed of explicit mode's static graphs against its dynamic ones
(--graph-shapes), or of two source trees of msinfer, alternated on one machine: what a change
to the compiled graphs does to the speed of the engine, measured side by side so that the
machine's drift falls on both.

    python bench/graph_speed.py [--rounds 2]                  # static vs dynamic, this tree
    python bench/graph_speed.py --before-tree /path/to/checkout-before --name graph_speed_trees
    python bench/graph_speed.py --in-process --name graph_speed_in_process

Each round runs one process per side (`worker` below, with its tree on PYTHONPATH) on the
0.5B shape: a 512-token prompt then 40 greedy tokens alone (b1), 16 prompts of 100 tokens then
24 tokens each (b16), and prompts of 20, 48 and 100 tokens alone (p20, p48, p100: a chat
turn's first token, one chunk short of a full one); each workload once to compile, then twice
measured (the engine's own timings: prefill tokens/s, decode ms per step; the better of two).
With --in-process each round is one process holding both LLMs, their runs alternating, so
that what differs from one process to the next falls on both sides too.
Writes bench/results/graph_speed.json and .md: per side the mean over rounds, and the ratio.
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
WORKLOADS = (("b1", 1, 512, 40), ("b16", 16, 100, 24), ("p20", 1, 20, 2), ("p48", 1, 48, 2),
             ("p100", 1, 100, 2))


def worker(model, graph_shapes):
    """One LLM per comma-separated graph_shapes ("": the tree's default), in this process;
    each workload's runs alternate between them. Prints one result per LLM."""
    import numpy as np

    from msinfer import LLM
    from msinfer.engine.sampling import SamplingParams

    llms = [LLM(model, compile_cache=False, enable_prefix_caching=False,
                **({"graph_shapes": shapes} if shapes else {}))  # a tree before the option
            for shapes in graph_shapes.split(",")]
    rng = np.random.default_rng(0)
    out = [{} for _ in llms]
    for name, n, length, new in WORKLOADS:
        params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)

        def run(llm):
            before = dict(llm.engine.runner.timings)
            llm.generate([rng.integers(100, 100000, length).tolist() for _ in range(n)],
                         params)
            t = {k: v - before[k] for k, v in llm.engine.runner.timings.items()}
            return (t["prefill_tokens"] / t["prefill_s"],
                    1000 * t["decode_s"] / max(1, t["decode_steps"]))

        for llm in llms:
            run(llm)  # compiles what this workload needs
        runs = [[] for _ in llms]
        for _ in range(2):
            for i, llm in enumerate(llms):
                runs[i].append(run(llm))
        for i, side in enumerate(runs):
            out[i][name] = {"prefill_tokens_per_s": max(r[0] for r in side),
                            "decode_ms_per_step": min(r[1] for r in side)}
    for i, llm in enumerate(llms):
        out[i]["graphs"] = llm.compilations
    print("RESULT " + json.dumps(out), flush=True)


def measure(tree, graph_shapes, model):
    env = dict(os.environ, PYTHONPATH=tree, GLOG_v="3")
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", model,
                           "--worker-graph-shapes", graph_shapes or ""],
                          env=env, cwd=tree, capture_output=True, text=True, check=True)
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])  # one result per side of graph_shapes


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before-tree", help="compare this checkout (its defaults) with this tree's "
                                         "instead of static with dynamic graphs")
    p.add_argument("--model", default=os.path.join(ROOT, "models", "qwen2-0.5b-shape"))
    p.add_argument("--in-process", action="store_true",
                   help="static and dynamic in one process, their runs alternating (no "
                        "process-to-process drift; this tree only)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--name", default="graph_speed", help="file name of the results")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-graph-shapes", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.worker_graph_shapes)
    out = os.path.join(ROOT, "bench", "results", args.name)
    sys.path.insert(0, ROOT)
    from msinfer.engine.compile_cache import _processor

    if args.before_tree and args.in_process:
        p.error("--in-process compares static and dynamic graphs of this tree only")
    if args.before_tree:  # (tree, graph_shapes) per side
        sides = {"before": (os.path.abspath(args.before_tree), None), "after": (ROOT, None)}
    else:
        sides = {"static": (ROOT, "static"), "dynamic": (ROOT, "dynamic")}
    commits = {k: subprocess.run(["git", "-C", t, "rev-parse", "--short", "HEAD"],
                                 capture_output=True, text=True).stdout.strip()
               for k, (t, _) in sides.items()}
    report = {"model": os.path.relpath(args.model, ROOT), "cpu": f"{_processor()}, "
              f"{os.cpu_count()} cores", "load_at_start": round(os.getloadavg()[0], 2),
              "commits": commits, "in_process": args.in_process,
              "rounds": {k: [] for k in sides}}
    for r in range(args.rounds):
        if args.in_process:  # one process, both sides
            results = measure(ROOT, ",".join(g for _, g in sides.values()), args.model)
        else:
            results = [measure(tree, g, args.model)[0] for tree, g in sides.values()]
        for name, result in zip(sides, results):
            report["rounds"][name].append(result)
            print(f"round {r + 1} {name}: {result}", flush=True)
    report["load_at_end"] = round(os.getloadavg()[0], 2)
    first, second = sides
    lines = [f"graph speed, {first} ({commits[first]}) and {second} ({commits[second]}), "
             f"{report['model']}, {report['cpu']}, {args.rounds} rounds alternating"
             f"{' in one process' if args.in_process else ''}; "
             f"load average {report['load_at_start']} at the start, "
             f"{report['load_at_end']} at the end", "",
             f"| workload | graphs {first} / {second} | prefill tok/s {first} / {second} "
             f"(ratio) | decode ms/step {first} / {second} (ratio) |", "|---|---|---|---|"]
    mean = {k: {w[0]: {m: statistics.mean(r[w[0]][m] for r in runs)
                       for m in ("prefill_tokens_per_s", "decode_ms_per_step")}
                for w in WORKLOADS} for k, runs in report["rounds"].items()}
    report["mean"] = mean
    graphs = {k: runs[-1]["graphs"] for k, runs in report["rounds"].items()}
    for name, *_ in WORKLOADS:
        b, a = mean[first][name], mean[second][name]
        lines.append(
            f"| {name} | {graphs[first]} / {graphs[second]} | "
            f"{b['prefill_tokens_per_s']:.1f} / {a['prefill_tokens_per_s']:.1f} "
            f"({a['prefill_tokens_per_s'] / b['prefill_tokens_per_s']:.2f}) | "
            f"{b['decode_ms_per_step']:.1f} / {a['decode_ms_per_step']:.1f} "
            f"({a['decode_ms_per_step'] / b['decode_ms_per_step']:.2f}) |")
    text = "\n".join(lines) + "\n"
    with open(out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
