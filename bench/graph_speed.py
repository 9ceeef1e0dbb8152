"""Decode and prefill speed of explicit mode's static graphs against its dynamic ones
(--graph-shapes), or of two source trees of msinfer, alternated on one machine: what a change
to the compiled graphs does to the speed of the engine, measured side by side so that the
machine's drift falls on both.

    python bench/graph_speed.py [--rounds 2]                  # static vs dynamic, this tree
    python bench/graph_speed.py --before-tree /path/to/checkout-before --name graph_speed_trees
    python bench/graph_speed.py --in-process --name graph_speed_in_process
    python bench/graph_speed.py --in-process --before-tree /path/to/checkout-before \
        --before-graph-shapes static --name graph_speed_vs_static   # one process, two trees

Each round runs one process per side (`worker` below, with its tree on PYTHONPATH) on the
0.5B shape: a 512-token prompt then 40 greedy tokens alone (b1; b1s: after 20 tokens), 16
prompts of 100 tokens then 24 tokens each (b16), and prompts of 8, 20, 48 and 100 tokens
alone (p8 ... p100: a chat turn's first token, one chunk short of a full one; --workloads
picks some); each workload once to compile, then `--runs` times measured (the engine's own
timings: prefill tokens/s, decode ms per step; the median). With --in-process each round is
one process holding both LLMs, their runs alternating, so that what differs from one
process to the next falls on both sides too; a before-tree's package is then imported under
another name (msinfer_before: msinfer's imports are relative). Writes
bench/results/graph_speed.json and .md: per side the mean over rounds, and the ratio. Prefix
caching is off so that a repeated prompt is computed again.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = (("b1", 1, 512, 40), ("b1s", 1, 20, 40), ("b16", 16, 100, 24), ("p8", 1, 8, 2),
             ("p20", 1, 20, 2), ("p48", 1, 48, 2), ("p100", 1, 100, 2))


def worker(model, sides, runs, names):
    """One LLM per comma-separated side, "package:graph_shapes" (graph_shapes "": the tree's
    default), in this process; each workload's runs alternate between them. Prints one
    result per side."""
    import importlib

    import numpy as np

    llms = []
    for side in sides.split(","):
        package, shapes = side.split(":")
        LLM = importlib.import_module(package).LLM
        sampling = importlib.import_module(package + ".engine.sampling")
        llms.append((LLM(model, compile_cache=False, enable_prefix_caching=False,
                         **({"graph_shapes": shapes} if shapes else {})),  # a tree before it
                     sampling.SamplingParams))
    rng = np.random.default_rng(0)
    out = [{} for _ in llms]
    for name, n, length, new in WORKLOADS:
        if name not in names:
            continue
        prompts = [rng.integers(100, 100000, length).tolist() for _ in range(n)]

        def run(llm, params):
            before = dict(llm.engine.runner.timings)
            tokens = [o.token_ids for o in llm.generate(
                prompts, params(max_tokens=new, temperature=0, ignore_eos=True))]
            t = {k: v - before[k] for k, v in llm.engine.runner.timings.items()}
            return (t["prefill_tokens"] / t["prefill_s"],
                    1000 * t["decode_s"] / max(1, t["decode_steps"]), tokens)

        tokens = [run(*side)[2] for side in llms]  # compiles what this workload needs
        if any(t != tokens[0] for t in tokens):
            raise SystemExit(f"{name}: the sides generated different tokens")
        timed = [[] for _ in llms]
        for _ in range(runs):
            for i, side in enumerate(llms):
                timed[i].append(run(*side))
        for i, side in enumerate(timed):
            out[i][name] = {"prefill_tokens_per_s": statistics.median(r[0] for r in side),
                            "decode_ms_per_step": statistics.median(r[1] for r in side)}
    for i, (llm, _) in enumerate(llms):
        out[i]["graphs"] = llm.compilations
    print("RESULT " + json.dumps(out), flush=True)


def measure(path, sides, model, runs, names):
    """The worker's results, run with `path` (a tree, or its parent) on PYTHONPATH."""
    env = dict(os.environ, PYTHONPATH=path, GLOG_v="3")
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", model,
                           "--worker-sides", sides, "--runs", str(runs),
                           "--workloads", ",".join(names)],
                          env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])  # one result per side


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before-tree", help="compare this checkout (its defaults) with this tree's "
                                         "instead of static with dynamic graphs")
    p.add_argument("--model", default=os.path.join(ROOT, "models", "qwen2-0.5b-shape"))
    p.add_argument("--before-graph-shapes", default="",
                   help="the before-tree's graph_shapes (default: its default)")
    p.add_argument("--graph-shapes", default="",
                   help="this tree's graph_shapes against a before-tree (default: its default)")
    p.add_argument("--in-process", action="store_true",
                   help="both sides in one process, their runs alternating (no "
                        "process-to-process drift)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--runs", type=int, default=2, help="measured runs of each workload")
    p.add_argument("--workloads", default=",".join(w[0] for w in WORKLOADS),
                   help="comma-separated workloads to run (default: all)")
    p.add_argument("--name", default="graph_speed", help="file name of the results")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-sides", help=argparse.SUPPRESS)
    args = p.parse_args()
    names = args.workloads.split(",")
    unknown = set(names) - {w[0] for w in WORKLOADS}
    if unknown:
        p.error(f"unknown workloads {', '.join(sorted(unknown))}; known: "
                f"{', '.join(w[0] for w in WORKLOADS)}")
    workloads = [w for w in WORKLOADS if w[0] in names]
    if args.worker:
        return worker(args.worker, args.worker_sides, args.runs, names)
    out = os.path.join(ROOT, "bench", "results", args.name)
    sys.path.insert(0, ROOT)
    # msinfer sets OMP_WAIT_POLICY as it is imported: the workers inherit it from here, those
    # of a before-tree older than that setting too
    import msinfer  # noqa: F401
    from machine import machine_record, record_load_at_end

    if args.before_tree:  # (tree, graph_shapes) per side
        sides = {"before": (os.path.abspath(args.before_tree), args.before_graph_shapes),
                 "after": (ROOT, args.graph_shapes)}
    else:
        sides = {"static": (ROOT, "static"), "dynamic": (ROOT, "dynamic")}
    commits = {k: subprocess.run(["git", "-C", t, "rev-parse", "--short", "HEAD"],
                                 capture_output=True, text=True).stdout.strip()
               for k, (t, _) in sides.items()}
    report = {"model": os.path.relpath(args.model, ROOT), "machine": machine_record(),
              "commits": commits, "in_process": args.in_process, "runs": args.runs,
              "graph_shapes": {k: g or "default" for k, (_, g) in sides.items()},
              "rounds": {k: [] for k in sides}}
    with tempfile.TemporaryDirectory() as before_package:
        path = ROOT
        if args.in_process and args.before_tree:  # its msinfer as msinfer_before
            shutil.copytree(os.path.join(sides["before"][0], "msinfer"),
                            os.path.join(before_package, "msinfer_before"))
            path = os.pathsep.join([ROOT, before_package])
        for r in range(args.rounds):
            if args.in_process:  # one process, both sides
                packages = ["msinfer_before" if tree != ROOT else "msinfer"
                            for tree, _ in sides.values()]
                results = measure(path, ",".join(f"{package}:{g}" for package, (_, g)
                                                 in zip(packages, sides.values())),
                                  args.model, args.runs, names)
            else:
                results = [measure(tree, f"msinfer:{g}", args.model, args.runs, names)[0]
                           for tree, g in sides.values()]
            for name, result in zip(sides, results):
                report["rounds"][name].append(result)
                print(f"round {r + 1} {name}: {result}", flush=True)
    machine = record_load_at_end(report["machine"])
    first, second = sides
    shapes = report["graph_shapes"]
    lines = [f"graph speed, {first} ({commits[first]}, {shapes[first]} graphs) and {second} "
             f"({commits[second]}, {shapes[second]} graphs), "
             f"{report['model']}, {machine['cpu']}, {machine['cores']} cores, "
             f"{args.rounds} rounds alternating, median of {args.runs} runs"
             f"{' in one process' if args.in_process else ''}; "
             f"load average {machine['load_average_at_start'][0]} at the start, "
             f"{machine['load_average_at_end'][0]} at the end", "",
             f"| workload | graphs {first} / {second} | prefill tok/s {first} / {second} "
             f"(ratio) | decode ms/step {first} / {second} (ratio) |", "|---|---|---|---|"]
    mean = {k: {w[0]: {m: statistics.mean(r[w[0]][m] for r in runs)
                       for m in ("prefill_tokens_per_s", "decode_ms_per_step")}
                for w in workloads} for k, runs in report["rounds"].items()}
    report["mean"] = mean
    graphs = {k: runs[-1]["graphs"] for k, runs in report["rounds"].items()}
    for name, *_ in workloads:
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
