"""Prefix caching benchmark (issue 23): msinfer with its prefix cache, msinfer
--no-prefix-caching and `transformers serve --continuous-batching`, one after the other on the
same checkpoint and the same three workloads:

    python bench/prefix_cache.py --model-dir models/qwen2-0.5b-shape --out bench/results/prefix_cache

- shared: `--requests` prompts sharing one system prompt of `--system-len` tokens, each with
  its own question of `--question-len` tokens; the first is sent alone (it computes the system
  prompt), the others together once it has finished. TTFT of the first, p50 TTFT of the
  others, output tokens/s over the whole workload.
- chat: one `--turns`-turn conversation; each turn resends the whole conversation (a
  `--chat-system-len` system prompt, every question and every answer so far). TTFT per turn.
- unique: `--unique-requests` prompts of `--unique-len` tokens that share nothing, all at
  once, `--unique-repeats` times with new prompts: output tokens/s, what the cache costs
  when it cannot hit.

On the msinfer sides it also checks the cache's accounting: /metrics'
`vllm:prefix_cache_hits_total` grows by the sum of the responses' `usage.prompt_tokens_details.
cached_tokens`, and by what the workload should hit (the full blocks each prompt shares with
one computed before it). Writes OUT.json, OUT.png and OUT.md (the table).
"""
import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)

import serve as load  # noqa: E402  (bench/serve.py: requests, servers, percentiles)
from machine import machine_record, record_load_at_end  # noqa: E402
from msinfer.planning.kv_layout import DEFAULT_BLOCK_SIZE  # noqa: E402

SIDES = ("msinfer", "msinfer-nocache", "hf")
CACHE_COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


def ids(tokenizer, text):
    return tokenizer.encode(text).ids


def common_blocks(a, b, block):
    """Tokens of the full blocks `a` can take from `b`'s cached blocks (at least one token of
    `a` stays to compute, as the engine leaves one for the logits)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    n = min(n, len(a) - 1)
    return n // block * block


# -- workloads ---------------------------------------------------------------------------------

def shared_workload(args, tokenizer):
    rng = random.Random(f"{args.seed}:shared")
    system = load._text(rng, args.system_len, tokenizer) + "\n"
    low, high = args.question_len
    prompts = [system + load._text(rng, rng.randint(low, high), tokenizer)
               for _ in range(args.requests)]
    tokens = [ids(tokenizer, p) for p in prompts]
    # each prompt after the first takes at least the blocks it shares with the first (computed
    # alone before the others are sent), at most those it shares with any other prompt (sent
    # together, some are computed before others)
    expected = (sum(common_blocks(t, tokens[0], args.block_size) for t in tokens[1:]),
                sum(max(common_blocks(t, u, args.block_size)
                        for j, u in enumerate(tokens) if j != i)
                    for i, t in enumerate(tokens) if i))
    return prompts, tokens, expected


def unique_workload(args, tokenizer, repeat):
    rng = random.Random(f"{args.seed}:unique:{repeat}")
    low, high = max(1, args.unique_len // 2), args.unique_len * 3 // 2
    return [load._text(rng, rng.randint(low, high), tokenizer)
            for _ in range(args.unique_requests)]


def warmup_prompts(args, tokenizer):
    # unrelated to every workload, so no cache is warmed for them; one long prompt as long as
    # the shared workload's so HF's first long attention is not measured
    rng = random.Random(f"{args.seed}:warmup")
    return [load._text(rng, n, tokenizer) for n in (64, 300, args.system_len + 100)]


# -- running them ------------------------------------------------------------------------------

async def _gather(url, model, prompts, max_tokens, timeout):
    import httpx2 as httpx
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        return await asyncio.gather(*(load.one_request(client, url, model, p, max_tokens)
                                      for p in prompts))


def send(url, model, prompts, max_tokens, timeout=1800):
    """All `prompts` at once; (results, seconds from the first send to the last token)."""
    start = time.perf_counter()
    results = asyncio.run(_gather(url, model, prompts, max_tokens, timeout))
    return results, time.perf_counter() - start


def errors_of(results):
    return [r["error"] for r in results if "error" in r]


def run_shared(url, model, args, workload):
    prompts, tokens, expected = workload
    first, first_s = send(url, model, prompts[:1], args.output_len)
    rest, rest_s = send(url, model, prompts[1:], args.output_len)
    results = first + rest
    ok = [r for r in results if "ttft" in r]
    out_tokens = sum(r["output_tokens"] for r in ok)
    return {"requests": len(results), "errors": len(errors_of(results)),
            "error_samples": sorted(set(errors_of(results)))[:3],
            "prompt_tokens": [len(t) for t in tokens],
            "first_ttft_ms": 1000 * first[0]["ttft"] if "ttft" in first[0] else None,
            "rest_ttft_ms": load._percentiles([r["ttft"] for r in rest if "ttft" in r]),
            "duration_s": first_s + rest_s, "output_tokens": out_tokens,
            "output_throughput": out_tokens / (first_s + rest_s),
            "cached_tokens": [r.get("cached_tokens") for r in results],
            "expected_hits": list(expected)}


def run_chat(url, model, args, tokenizer):
    rng = random.Random(f"{args.seed}:chat")
    conversation = load._text(rng, args.chat_system_len, tokenizer) + "\n"
    low, high = args.question_len
    turns, previous = [], None
    for turn in range(args.turns):
        conversation += "User: " + load._text(rng, rng.randint(low, high), tokenizer) + \
            "\nAssistant:"
        tokens = ids(tokenizer, conversation)
        (result,), _ = send(url, model, [conversation], args.chat_output_len)
        if "error" in result:
            turns.append({"turn": turn + 1, "error": result["error"]})
            break
        # what this turn can take from the last: the full blocks of the previous prompt (its
        # answer's tokens may tokenize differently as text, so they are not counted on)
        expected = common_blocks(tokens, previous, args.block_size) if previous else 0
        turns.append({"turn": turn + 1, "prompt_tokens": len(tokens),
                      "ttft_ms": 1000 * result["ttft"], "output_tokens": result["output_tokens"],
                      "cached_tokens": result.get("cached_tokens"), "expected_hits": expected})
        conversation += result["text"] + "\n"
        previous = tokens
    return turns


def run_unique(url, model, args, tokenizer):
    runs = []
    for repeat in range(args.unique_repeats):
        prompts = unique_workload(args, tokenizer, repeat)
        results, seconds = send(url, model, prompts, args.output_len)
        ok = [r for r in results if "ttft" in r]
        out_tokens = sum(r["output_tokens"] for r in ok)
        runs.append({"requests": len(results), "errors": len(errors_of(results)),
                     "prompt_tokens": sum(len(ids(tokenizer, p)) for p in prompts),
                     "duration_s": seconds, "output_tokens": out_tokens,
                     "output_throughput": out_tokens / seconds,
                     "ttft_ms": load._percentiles([r["ttft"] for r in ok]),
                     "cached_tokens": sum(r.get("cached_tokens") or 0 for r in results)})
    return {"runs": runs,
            "output_throughput_mean": statistics.fmean(r["output_throughput"] for r in runs)}


def counters(url):
    found = load.scrape(url, CACHE_COUNTERS)
    return {name.split(":")[1].replace("_total", ""): found.get(name) for name in CACHE_COUNTERS}


def delta(after, before):
    return {k: (after[k] - before[k]) if after[k] is not None and before[k] is not None
            else None for k in after}


def bench_side(side, args, tokenizer, workloads):
    with load.running_server(side, args) as (url, model, out):
        warm, _ = send(url, model, warmup_prompts(args, tokenizer), 4)
        out["warmup_errors"] = errors_of(warm)
        for name, run in (("shared", lambda: run_shared(url, model, args, workloads["shared"])),
                          ("chat", lambda: run_chat(url, model, args, tokenizer)),
                          ("unique", lambda: run_unique(url, model, args, tokenizer))):
            print(f"  {name} ...", file=sys.stderr, flush=True)
            before = counters(url) if side.startswith("msinfer") else None
            started = time.monotonic()
            out[name] = run()
            out[name + "_wall_s"] = time.monotonic() - started
            if before is not None:
                out[name + "_metrics"] = delta(counters(url), before)
            print("    " + _summary_line(name, out[name]), file=sys.stderr, flush=True)
        out["uptime_after"] = load.uptime()
    return out


def _summary_line(name, s):
    if name == "shared":
        rest = s["rest_ttft_ms"]
        return (f"first TTFT {s['first_ttft_ms'] or float('nan'):.0f} ms, rest p50 "
                f"{rest['p50'] if rest else float('nan'):.0f} ms, "
                f"{s['output_throughput']:.1f} tok/s, {s['errors']} errors")
    if name == "chat":
        return "TTFT per turn (ms): " + ", ".join(
            f"{t['ttft_ms']:.0f}" if "ttft_ms" in t else "error" for t in s)
    return ", ".join(f"{r['output_throughput']:.1f} tok/s ({r['errors']} errors)"
                     for r in s["runs"])


# -- checks, table, chart ----------------------------------------------------------------------

def cache_checks(side_report, shared_workload):
    """Whether /metrics, usage.cached_tokens and the workload's own count agree."""
    checks = {}
    shared = side_report["shared"]
    usage = sum(c or 0 for c in shared["cached_tokens"])
    low, high = shared_workload[2]
    checks["shared"] = {"metrics_hits": side_report["shared_metrics"]["prefix_cache_hits"],
                        "usage_cached_tokens": usage, "expected_hits_min": low,
                        "expected_hits_max": high}
    turns = [t for t in side_report["chat"] if "ttft_ms" in t]
    checks["chat"] = {"metrics_hits": side_report["chat_metrics"]["prefix_cache_hits"],
                      "usage_cached_tokens": sum(t["cached_tokens"] or 0 for t in turns),
                      "expected_hits_at_least": sum(t["expected_hits"] for t in turns)}
    checks["unique"] = {"metrics_hits": side_report["unique_metrics"]["prefix_cache_hits"],
                        "usage_cached_tokens": sum(r["cached_tokens"]
                                                   for r in side_report["unique"]["runs"]),
                        "expected_hits": 0}
    return checks


def table(report):
    sides = report["sides"]
    rows = ["| server | shared: TTFT first (ms) | shared: TTFT p50 of the rest (ms) | "
            "shared: output tok/s | chat: TTFT turn 1 / 5 / 10 (ms) | unique: output tok/s |",
            "|" + "---|" * 6]
    for side, s in sides.items():
        turns = {t["turn"]: t.get("ttft_ms") for t in s["chat"]}
        chat = " / ".join(f"{turns[t]:.0f}" if turns.get(t) else "-" for t in (1, 5, 10))
        rows.append(f"| {side} | {s['shared']['first_ttft_ms']:.0f} | "
                    f"{s['shared']['rest_ttft_ms']['p50']:.0f} | "
                    f"{s['shared']['output_throughput']:.1f} | {chat} | "
                    f"{s['unique']['output_throughput_mean']:.1f} |")
    ratios = report.get("ratios")
    if ratios:
        rows.append("")
        rows += [f"- {k}: {v:.3f}" for k, v in ratios.items()]
    return "\n".join(rows)


def ratios(sides):
    on, off = sides.get("msinfer"), sides.get("msinfer-nocache")
    if not on or not off:
        return {}
    return {
        "shared TTFT p50 after the first, cache / no cache (goal <= 0.2)":
            on["shared"]["rest_ttft_ms"]["p50"] / off["shared"]["rest_ttft_ms"]["p50"],
        "shared output tok/s, cache / no cache (goal >= 2)":
            on["shared"]["output_throughput"] / off["shared"]["output_throughput"],
        "chat TTFT turn 10 / turn 1, cache": _turn_ratio(on["chat"]),
        "chat TTFT turn 10 / turn 1, no cache": _turn_ratio(off["chat"]),
        "unique output tok/s, cache / no cache (goal >= 0.97)":
            on["unique"]["output_throughput_mean"] / off["unique"]["output_throughput_mean"]}


def _turn_ratio(chat):
    ttft = [t.get("ttft_ms") for t in chat]
    return ttft[-1] / ttft[0] if len(ttft) > 1 and all(ttft) else float("nan")


def chart(report, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = report["sides"]
    names = list(sides)
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.4))
    panels = ((lambda s: s["shared"]["rest_ttft_ms"]["p50"], "shared: TTFT p50 after the first (ms)"),
              (lambda s: s["shared"]["output_throughput"], "shared: output tokens/s"),
              (lambda s: s["unique"]["output_throughput_mean"], "no shared prefix: output tokens/s"))
    for ax, (value, label) in zip((axes[0], axes[1], axes[3]), panels):
        values = [value(sides[n]) for n in names]
        ax.bar(names, values, color=["C0", "C1", "C2"][:len(names)])
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.0f}" if v >= 10 else f"{v:.1f}", ha="center", va="bottom")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    ax = axes[2]
    for i, n in enumerate(names):
        turns = [t for t in sides[n]["chat"] if "ttft_ms" in t]
        ax.plot([t["turn"] for t in turns], [t["ttft_ms"] for t in turns], marker="o",
                label=n, color=f"C{i}")
    ax.set_title("chat: TTFT per turn (ms)", fontsize=10)
    ax.set_xlabel("turn (the whole conversation resent)")
    ax.grid(alpha=0.3)
    ax.legend()
    w = report["workload"]
    fig.suptitle(f"{os.path.basename(w['model'].rstrip('/'))}: {w['requests']} requests sharing "
                 f"a {w['system_len']}-token system prompt; a {w['turns']}-turn chat; "
                 f"{w['unique_requests']} unrelated prompts. Load (uptime) during the run: "
                 f"{report['load_note']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", required=True)
    p.add_argument("--sides", default=",".join(SIDES),
                   help=f"comma-separated, run in this order (of {', '.join(SIDES)})")
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--msinfer-option", action="append", default=[],
                   help="extra `msinfer serve` argument (repeatable)")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                   help="msinfer's KV block size (what the expected hits are counted in)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--system-len", type=int, default=2000)
    p.add_argument("--question-len", type=lambda s: tuple(int(x) for x in s.split(",")),
                   default=(50, 200), metavar="LOW,HIGH")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--chat-system-len", type=int, default=500)
    p.add_argument("--chat-output-len", type=int, default=24)
    p.add_argument("--unique-requests", type=int, default=16)
    p.add_argument("--unique-len", type=int, default=256)
    p.add_argument("--unique-repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=int, default=1200)
    p.add_argument("--keep-tokenizer", action="store_true",
                   help="do not give every model id a text (bench/serve.py's "
                        "with_visible_vocabulary)")
    p.add_argument("--append", action="store_true",
                   help="replace these sides in an existing OUT.json of the same workload, "
                        "keeping its others (a side measured again, e.g. one disturbed)")
    p.add_argument("--out", default=os.path.join(BENCH, "results", "prefix_cache"))
    args = p.parse_args(argv)
    sides = args.sides.split(",")
    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        p.error(f"--sides: unknown {unknown}; choose from {SIDES}")
    if not args.keep_tokenizer:
        args.model_dir = load.with_visible_vocabulary(args.model_dir)
    args.log_dir = os.path.join(os.path.dirname(os.path.abspath(args.out)), "logs")
    os.makedirs(args.log_dir, exist_ok=True)
    args.tokenizer, args.tp4_model_dir = None, None  # what bench/serve.py's helpers read
    tokenizer = load.load_tokenizer(args)
    if tokenizer is None:
        p.error(f"--model-dir: no tokenizer.json in {args.model_dir}")

    workloads = {"shared": shared_workload(args, tokenizer)}
    report = {"workload": {k: getattr(args, k) for k in (
        "model_dir", "requests", "system_len", "question_len", "output_len", "turns",
        "chat_system_len", "chat_output_len", "unique_requests", "unique_len",
        "unique_repeats", "seed", "max_len", "block_size", "msinfer_option")},
        "machine": machine_record(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "sides": {}}
    report["workload"]["model"] = args.model_dir
    report["workload"]["shared_prompt_tokens_mean"] = statistics.fmean(
        len(t) for t in workloads["shared"][1])
    if args.append:
        with open(args.out + ".json") as f:
            earlier = json.load(f)
        if earlier["workload"] != json.loads(json.dumps(report["workload"])):
            p.error(f"--append: {args.out}.json measured another workload")
        earlier.setdefault("appended", []).append({"started": report["started"],
                                                   "sides": sides})
        report = earlier
    for side in sides:
        report["sides"][side] = bench_side(side, args, tokenizer, workloads)
    for side, side_report in report["sides"].items():
        if side.startswith("msinfer") and "shared_metrics" in side_report:
            side_report["cache_checks"] = cache_checks(side_report, workloads["shared"])
    record_load_at_end(report["machine"])
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    loads = [s[k] for s in report["sides"].values()
             for k in ("uptime_before", "uptime_after") if k in s]
    report["load_note"] = load.load_note(loads)
    report["ratios"] = ratios(report["sides"])
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    text = table(report)
    checks = {s: v["cache_checks"] for s, v in report["sides"].items() if "cache_checks" in v}
    text += "\n\ncache accounting (tokens): " + json.dumps(checks) + "\n"
    text += "\nload (uptime) per side, before and after:\n" + "".join(
        f"- {side}: {s.get('uptime_before')} / {s.get('uptime_after')}\n"
        for side, s in report["sides"].items())
    with open(args.out + ".md", "w") as f:
        f.write(text)
    chart(report, args.out + ".png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
