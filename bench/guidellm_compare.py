"""guidellm beside bench/serve.py (issue 21): the same load from both tools against each server,
msinfer serve and `transformers serve --continuous-batching`, one server at a time:

    python bench/guidellm_compare.py --model-dir /work/benchmodels/small-8x512 \
        --out bench/results/guidellm

The load: `--num-prompts` streamed /v1/completions requests at Poisson arrivals of `--rate`/s,
prompts of `--input-len` tokens and `--output-len` output tokens (fixed lengths: guidellm's
synthetic_text makes prompts of exactly that many tokens of its own text; bench/serve.py of
at most that many, of its own words). guidellm 0.8.1 runs from its own venv (setup.cfg):
.venv-guidellm or --guidellm. Writes OUT.json, OUT.md (the table) and OUT.png.
"""
import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)

import serve as load  # noqa: E402  (bench/serve.py)
from machine import machine_record, record_load_at_end  # noqa: E402

SIDES = ("msinfer", "hf")


def serve_py(url, model, args, tokenizer):
    """bench/serve.py's load; its summary (ms, tokens/s)."""
    load_args = argparse.Namespace(num_prompts=args.num_prompts, input_len=args.input_len,
                                   output_len=args.output_len, range_ratio=0.0,
                                   shared_prefix_len=0, seed=args.seed)
    requests = load.make_requests(load_args, tokenizer, salt="guidellm-compare")
    results, duration = asyncio.run(load.run_load(url, model, requests, args.rate, args.seed))
    s = load.summarize(results, duration, requests)
    return {"requests": s["requests"], "successful": s["completed"], "errors": s["errors"],
            "duration_s": duration, "output_tokens": s["output_tokens"],
            "output_throughput": s["output_throughput"],
            "prompt_tokens_mean": s["prompt_tokens"] / len(requests),
            "ttft_ms": _trio(s["ttft_ms"]), "itl_ms": _trio(s["itl_ms"]),
            "tpot_ms": _trio(s["tpot_ms"]), "e2e_ms": _trio(s["e2e_ms"])}


def _trio(p):
    return {"mean": p["mean"], "p50": p["p50"], "p99": p["p99"]} if p else None


def guidellm(url, model, args, out_path):
    """One `guidellm run` of the same load; its figures, in bench/serve.py's terms."""
    command = [
        args.guidellm, "run",
        # max_tokens on the backend, not output_tokens on the data: with output_tokens guidellm
        # adds vLLM's ignore_eos, which transformers serve refuses (422, unexpected field);
        # so both tools send the same request: max_tokens, no ignore_eos
        "--backend", f"kind=openai_http,target={url},model={model},"
                     f"request_format=/v1/completions,timeout=600,max_tokens={args.output_len}",
        "--profile", f"kind=poisson,rate={args.rate}",
        "--constraint", f"kind=max_requests,count={args.num_prompts}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.input_len}",
        "--tokenizer", f"kind=huggingface_auto,model={args.model_dir}",
        "--seed", f"kind=static,value={args.seed}",
        "--output", f"kind=json,path={out_path}",
        "--disable-console-interactive",
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONPATH="")
    started = time.monotonic()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        return {"error": (done.stdout + done.stderr)[-2000:], "command": " ".join(command)}
    with open(out_path) as f:
        (benchmark,) = json.load(f)["benchmarks"]
    m = benchmark["metrics"]
    ok = benchmark["requests"]["successful"]
    out_tokens = sum(r["output_tokens"] or 0 for r in ok)

    def dist(name):
        s = m[name]["successful"]
        return {"mean": s["mean"], "p50": s["percentiles"]["p50"],
                "p99": s["percentiles"]["p99"]} if s["count"] else None
    return {"requests": m["request_totals"]["total"], "successful": m["request_totals"]
            ["successful"], "errors": m["request_totals"]["errored"],
            "incomplete": m["request_totals"]["incomplete"],
            "duration_s": benchmark["duration"], "output_tokens": out_tokens,
            # the same definition as bench/serve.py's: output tokens / the run's duration
            "output_throughput": out_tokens / benchmark["duration"],
            "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in ok) if ok
            else None,
            "ttft_ms": dist("time_to_first_token_ms"), "itl_ms": dist("inter_token_latency_ms"),
            "tpot_ms": dist("time_per_output_token_ms"),
            "e2e_ms": {k: 1000 * v for k, v in dist("request_latency").items()}
            if dist("request_latency") else None,
            "wall_s_with_startup": time.monotonic() - started, "command": " ".join(command)}


def bench_side(side, args, tokenizer):
    with load.running_server(side, args) as (url, model, out):
        warm = load.make_requests(argparse.Namespace(
            num_prompts=4, input_len=args.input_len, output_len=4, range_ratio=0.0,
            shared_prefix_len=0, seed=args.seed), tokenizer, salt="warmup")
        asyncio.run(load.run_load(url, model, warm, float("inf"), args.seed))
        out["bench/serve.py"] = serve_py(url, model, args, tokenizer)
        print(f"  bench/serve.py: {_line(out['bench/serve.py'])}", file=sys.stderr, flush=True)
        out["guidellm"] = guidellm(url, model, args,
                                   os.path.join(args.log_dir, f"guidellm_{side}.json"))
        print(f"  guidellm: {_line(out['guidellm'])}", file=sys.stderr, flush=True)
        out["uptime_after"] = load.uptime()
    return out


def _line(s):
    if "error" in s:
        return "failed: " + s["error"][-300:]
    f = (lambda m: f"{s[m]['p50']:.0f}" if s.get(m) else "-")
    return (f"{s['successful']}/{s['requests']} ok, {s['errors']} errors, "
            f"{s['output_throughput']:.1f} tok/s, TTFT p50 {f('ttft_ms')} ms, "
            f"ITL p50 {f('itl_ms')} ms, TPOT p50 {f('tpot_ms')} ms")


def table(report):
    rows = ["| server | tool | ok / sent | errors | prompt tokens (mean) | output tok/s | "
            "TTFT mean / p50 / p99 (ms) | ITL mean / p50 / p99 (ms) | "
            "TPOT mean / p50 / p99 (ms) |", "|" + "---|" * 9]

    def trio(m):
        return " / ".join(f"{m[q]:.0f}" for q in ("mean", "p50", "p99")) if m else "-"
    for side, s in report["sides"].items():
        for tool in ("bench/serve.py", "guidellm"):
            t = s.get(tool)
            if not t or "error" in t or not t["successful"]:
                rows.append(f"| {side} | {tool} | 0 / {(t or {}).get('requests', '-')} | "
                            f"{(t or {}).get('errors', 'failed')} | | | | | |")
                continue
            rows.append(f"| {side} | {tool} | {t['successful']} / {t['requests']} | "
                        f"{t['errors']} | {t['prompt_tokens_mean']:.0f} | "
                        f"{t['output_throughput']:.1f} | {trio(t['ttft_ms'])} | "
                        f"{trio(t['itl_ms'])} | {trio(t['tpot_ms'])} |")
    return "\n".join(rows)


def chart(report, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = list(report["sides"])
    tools = ("bench/serve.py", "guidellm")
    panels = (("output_throughput", None, "output tokens/s"), ("ttft_ms", "p50", "TTFT p50 (ms)"),
              ("itl_ms", "p50", "ITL p50 (ms)"))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    width = 0.38
    for ax, (metric, q, label) in zip(axes, panels):
        for j, tool in enumerate(tools):
            values = []
            for side in sides:
                t = report["sides"][side].get(tool) or {}
                v = t.get(metric)
                values.append((v[q] if q and v else v if not q else None) or float("nan"))
            xs = [i + (j - 0.5) * width for i in range(len(sides))]
            ax.bar(xs, values, width, label=tool)
            for x, v in zip(xs, values):
                ax.text(x, v, f"{v:.0f}" if v >= 10 else f"{v:.1f}", ha="center",
                        va="bottom", fontsize=8)
        ax.set_xticks(range(len(sides)), sides)
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend()
    w = report["workload"]
    fig.suptitle(f"{os.path.basename(w['model'].rstrip('/'))}: {w['num_prompts']} requests at "
                 f"Poisson {w['rate']}/s, {w['input_len']} prompt / {w['output_len']} output "
                 f"tokens; {report['load_note']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--guidellm", default=os.path.join(ROOT, ".venv-guidellm", "bin", "guidellm"))
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--rate", type=float, default=1.0)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--msinfer-option", action="append", default=[])
    p.add_argument("--ready-timeout", type=int, default=1200)
    p.add_argument("--out", default=os.path.join(BENCH, "results", "guidellm"))
    args = p.parse_args(argv)
    sides = args.sides.split(",")
    if any(s not in SIDES for s in sides):
        p.error(f"--sides: choose from {SIDES}")
    if not os.access(args.guidellm, os.X_OK):
        p.error(f"--guidellm: no executable {args.guidellm} (setup.cfg: its own venv)")
    args.model_dir = load.with_visible_vocabulary(args.model_dir)
    args.log_dir = os.path.join(os.path.dirname(os.path.abspath(args.out)), "logs")
    os.makedirs(args.log_dir, exist_ok=True)
    args.tokenizer, args.tp4_model_dir = None, None  # what bench/serve.py's helpers read
    tokenizer = load.load_tokenizer(args)
    version = subprocess.run([args.guidellm, "--version"], capture_output=True,
                             text=True).stdout.strip()
    report = {"workload": {k: getattr(args, k) for k in (
        "num_prompts", "rate", "input_len", "output_len", "seed", "max_len")},
        "guidellm_version": version,
        "machine": machine_record(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "sides": {}}
    report["workload"]["model"] = args.model_dir
    for side in sides:
        report["sides"][side] = bench_side(side, args, tokenizer)
    record_load_at_end(report["machine"])
    loads = [s[k] for s in report["sides"].values()
             for k in ("uptime_before", "uptime_after") if k in s]
    report["load_note"] = load.load_note(loads)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    text = table(report) + f"\n\n{version}; load (uptime): {report['load_note']}\n"
    with open(args.out + ".md", "w") as f:
        f.write(text)
    chart(report, args.out + ".png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
