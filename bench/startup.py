"""Start-up: from process start to /health 200, cold (an empty compile cache) and on a
restart (the cache filled by the cold start), with the graphs warm-up compiled and the
decode and prefill speed after each, for one rank and tp2 (issue 24).

    python bench/startup.py                      # the 0.5B shape, defaults, tp1 and tp2
    python bench/startup.py --max-len 32768 --kv-cache-memory 1GiB
    python bench/startup.py --model DIR --jobs tp1
    python bench/startup.py --graph-shapes static --name startup_static_shapes

Writes bench/results/startup.json, .md (the table, also printed) and .png. Each start gets a
compile cache directory of its own under --out (removed at the end), so nothing on the machine
is reused. Records the load average and the CPU: run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import httpx2 as httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from msinfer.parallel.distributed import free_port  # noqa: E402
from msinfer.engine_config import GRAPH_SHAPES  # noqa: E402
from machine import machine_record, record_load_at_end  # noqa: E402
from serve import stop_server  # noqa: E402  (bench/serve.py)

JOBS = {"tp1": (1, None), "tp2": (2, "qwen2_tp2.yaml")}
PREFILL_TOKENS = 256  # the prompt whose time to first token gives prefill tokens/s
DECODE_TOKENS = 32


def start(args, nproc, strategy, cache, log_path):
    serve = ["serve", "--model", args.model, "--served-model-name", "bench",
             "--max-len", str(args.max_len), "--compile-cache", cache,
             "--graph-shapes", args.graph_shapes]
    if args.kv_cache_memory:
        serve += ["--kv-cache-memory", args.kv_cache_memory]
    if strategy:
        command = [sys.executable, "-m", "msinfer", "launch", "--nproc", str(nproc),
                   "--strategy", os.path.join(ROOT, "strategies", strategy), "--"] + serve
    else:
        command = [sys.executable, "-m", "msinfer"] + serve
    port = free_port()
    command += ["--port", str(port)]
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", GLOG_v="3")
    log = open(log_path, "w")
    began = time.monotonic()
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}: see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url, time.monotonic() - began
        except httpx.HTTPError:
            pass
        if time.monotonic() - began > args.timeout:
            stop_server(process)
            raise RuntimeError(f"not ready after {args.timeout}s: see {log_path}")
        time.sleep(0.25)


def speed(url, max_len):
    """Decode tokens/s of one greedy request and prefill tokens/s of a prompt of
    PREFILL_TOKENS (at most half of max_len; its time to the first token), each the best of
    two; every prompt new (the prefix cache would skip a repeated one)."""
    length = min(PREFILL_TOKENS, max_len // 2)
    calls = iter(range(1, 1000))

    def new_prompt(n):
        first = next(calls) * 37
        return [(first + 7 * i) % 500 + 1 for i in range(n)]

    def complete(prompt, tokens):
        start = time.monotonic()
        r = httpx.post(url + "/v1/completions", timeout=600, json={
            "model": "bench", "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True})
        r.raise_for_status()
        return time.monotonic() - start
    prefill = min(complete(new_prompt(length), 1) for _ in range(2))
    decode = min(complete(new_prompt(8), DECODE_TOKENS + 1) - complete(new_prompt(8), 1)
                 for _ in range(2))
    return {"prefill_tokens_per_s": length / prefill, "prefill_prompt_tokens": length,
            "decode_tokens_per_s": DECODE_TOKENS / decode}


def warmup_facts(log_path):
    text = open(log_path).read()
    graphs = re.findall(r"(?:compiling|loading) graphs: (\d+)/(\d+), ([\d.]+)s", text)
    cache = re.search(r"compile cache: (filling|loading from)", text)
    return {"warmup_graphs_logged": int(graphs[-1][1]) if graphs else None,
            "warmup_s": float(graphs[-1][2]) if graphs else None,
            "cache": cache.group(1) if cache else None,
            "rebuilt_warning": "compiled again" in text or "rebuilding" in text}


def graph_files(cache):
    return sum(name.endswith(".mindir") for _, _, names in os.walk(cache) for name in names)


def measure(args, job, work):
    nproc, strategy = JOBS[job]
    cache = os.path.join(work, f"cache-{job}")
    row = {"job": job, "max_len": args.max_len}
    for run in ("cold", "restart"):
        log_path = os.path.join(work, f"{job}-{run}.log")
        process, url, ready = start(args, nproc, strategy, cache, log_path)
        try:
            facts = speed(url, args.max_len)
        finally:
            stop_server(process)
        row[run] = dict(ready_s=ready, **warmup_facts(log_path), **facts)
        print(f"  {job} {run}: ready in {ready:.1f}s, {facts}", flush=True)
    row["graphs_per_rank"] = graph_files(cache) // nproc
    return row


def table(report):
    """The runs, and those of `report["before"]` (an earlier report of the same command, e.g.
    one graph per call shape) each beside them, with the cold start's ratio to it."""
    before = {r["job"]: r for r in report.get("before", {}).get("runs", [])}
    m = report["machine"]
    lines = [f"start-up of `msinfer serve`: {report['model']}, --max-len {report['max_len']}, "
             f"--graph-shapes {report.get('graph_shapes', 'static')}, "
             f"{m['cpu']}, {m['cores']} cores; load average at start "
             f"{m['load_average_at_start'][0]}",
             "",
             "| job | graphs/rank | cold: ready (s) | restart: ready (s) "
             "| restart/cold | decode tok/s cold / restart | prefill tok/s cold / restart |",
             "|---|---|---|---|---|---|---|"]

    def row(r, label):
        c, w = r["cold"], r["restart"]
        return (f"| {label} | {r['graphs_per_rank']} | {c['ready_s']:.1f} | "
                f"{w['ready_s']:.1f} | {w['ready_s'] / c['ready_s']:.2f} | "
                f"{c['decode_tokens_per_s']:.2f} / {w['decode_tokens_per_s']:.2f} | "
                f"{c['prefill_tokens_per_s']:.1f} / {w['prefill_tokens_per_s']:.1f} |")

    for r in report["runs"]:
        lines.append(row(r, r["job"]))
        if r["job"] in before:
            lines.append(row(before[r["job"]], f"{r['job']}, before"))
    for r in report["runs"]:
        if r["job"] in before:
            old = before[r["job"]]["cold"]["ready_s"]
            lines.append(f"\n{r['job']}: cold start {r['cold']['ready_s'] / old:.2f}x and "
                         f"restart {r['restart']['ready_s'] / old:.2f}x of the cold start "
                         f"before ({report['before'].get('label', 'the earlier report')})")
    return "\n".join(lines)


def chart(report, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = report["runs"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    xs = range(len(runs))
    ax.bar([x - 0.2 for x in xs], [r["cold"]["ready_s"] for r in runs], 0.4, label="cold")
    ax.bar([x + 0.2 for x in xs], [r["restart"]["ready_s"] for r in runs], 0.4,
           label="restart, compile cache")
    ax.set_xticks(list(xs), [r["job"] for r in runs])
    ax.set_ylabel("process start to /health 200 (s)")
    ax.set_title(f"msinfer serve start-up, --max-len {report['max_len']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(ROOT, "models", "qwen2-0.5b-shape"),
                   help="checkpoint (default: models/qwen2-0.5b-shape, made by "
                        "`msinfer make-tiny-model --preset qwen2-0.5b-shape` if missing)")
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--kv-cache-memory", default=None)
    p.add_argument("--graph-shapes", default=GRAPH_SHAPES[0], choices=GRAPH_SHAPES)
    p.add_argument("--jobs", nargs="+", choices=sorted(JOBS), default=sorted(JOBS))
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--name", default="startup", help="file name of the results")
    p.add_argument("--before", default=None,
                   help="an earlier report (JSON) of the same runs to set beside these")
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        subprocess.run([sys.executable, "-m", "msinfer", "make-tiny-model", "--preset",
                        "qwen2-0.5b-shape", args.model], check=True)
    report = {"model": os.path.relpath(args.model, ROOT), "max_len": args.max_len,
              "graph_shapes": args.graph_shapes, "machine": machine_record(), "runs": []}
    work = tempfile.mkdtemp(prefix="msinfer-startup-")
    try:
        for job in args.jobs:
            report["runs"].append(measure(args, job, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record_load_at_end(report["machine"])
    if args.before:
        with open(args.before) as f:
            report["before"] = json.load(f)
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, args.name)
    with open(base + ".json", "w") as f:
        json.dump(report, f, indent=1)
    text = (table(report) + "\nload average at the end "
            f"{report['machine']['load_average_at_end'][0]}\n")
    with open(base + ".md", "w") as f:
        f.write(text)
    chart(report, base + ".png")
    print(text)


if __name__ == "__main__":
    main()
