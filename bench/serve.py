"""Serving benchmark, like `vllm bench serve`: Poisson load against OpenAI-compatible servers.

    # against any server that speaks /v1/completions:
    python bench/serve.py --url http://127.0.0.1:8000 --rates 0.5,1,burst --num-prompts 40
    # start each server in turn on the same checkpoint and give each the same load:
    python bench/serve.py --start msinfer --start hf --model-dir models/qwen2-0.5b-shape
    # a bounded soak: many requests near saturation, some clients leaving mid-stream:
    python bench/serve.py --start msinfer --soak 2000 --soak-rate 4 --disconnect-fraction 0.1

Requests are streamed `/v1/completions` with text prompts; prompt and output lengths are drawn
from a seeded uniform distribution (`--input-len`, `--output-len`, +- `--range-ratio`), the
same for every server. Arrivals are a Poisson process at each rate (requests/s); `burst`
sends them all at once. Per request it records the time to the first token (TTFT), the gaps
between streamed chunks (ITL), the time per output token after the first (TPOT) and the
end-to-end latency; per rate, request and output-token throughput and errors. Writes
OUT.json, OUT.png and prints a Markdown table (also in OUT.md).
"""
import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time

import httpx2 as httpx
from machine import machine_record, record_load_at_end

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
WORDS = ("the of and to in is that for it as was with be by on not he this are or his from "
         "at which but have an they you were her she there would their we him been has when "
         "who will more no if out so said what up its about into than them can only other "
         "new some could time these two may then do first any my now such like our over man "
         "me even most made after also did many before must through back years where much "
         "your way well down should because each just those people how too little state "
         "good very make world still own see men work long get here between both life being "
         "under never day same another know while last might us great old year off come "
         "since against go came right used take three").split()


def make_requests(args, tokenizer, salt=""):
    """The seeded workload: (prompt text, prompt tokens, max_tokens) per request; with
    --shared-prefix-len every prompt starts with the same text of about that many tokens (a
    system prompt), then its own. Each `salt` (a rate's name) draws other prompts, so a
    server's prefix cache cannot serve one rate's prompts from an earlier rate's."""
    prefix = ""
    if args.shared_prefix_len:
        prefix = _text(random.Random(args.seed), args.shared_prefix_len, tokenizer) + "\n"
    rng = random.Random(f"{args.seed}:{salt}")
    out = []
    for _ in range(args.num_prompts):
        n_in = _draw(rng, args.input_len, args.range_ratio)
        n_out = _draw(rng, args.output_len, args.range_ratio)
        text = prefix + _text(rng, n_in, tokenizer)
        out.append((text, len(tokenizer.encode(text).ids) if tokenizer else len(text.split()),
                    n_out))
    return out


def _text(rng, tokens, tokenizer):
    """Seeded words of at most `tokens` tokens (at least one word)."""
    words, text = [], ""
    while True:
        words.append(rng.choice(WORDS))
        candidate = " ".join(words)
        length = len(tokenizer.encode(candidate).ids) if tokenizer else len(words)
        if length > tokens:
            break
        text = candidate
    return text or words[0]


def _draw(rng, mean, ratio):
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(low, high)


async def one_request(client, url, model, prompt, max_tokens, leave_after=None):
    """Stream one completion; returns a dict of timings (seconds) and counts."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    chunks, pieces, usage, error = [], [], None, None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return {"error": f"HTTP {response.status_code}: {text[:200]}"}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = str(event["error"])[:200]
                    break
                if event.get("usage"):
                    usage = event["usage"]
                if any(c.get("text") for c in event.get("choices", [])):
                    chunks.append(time.perf_counter())
                    pieces += [c.get("text") or "" for c in event["choices"]]
                    if leave_after is not None and len(chunks) >= leave_after:
                        return {"left": True}  # closing the stream disconnects
    except (httpx.HTTPError, OSError) as e:
        return {"error": f"{type(e).__name__}: {e}"[:200]}
    end = time.perf_counter()
    if error or not chunks:
        return {"error": error or "no tokens streamed"}
    tokens = usage["completion_tokens"] if usage else len(chunks)
    # prompt tokens the server's prefix cache served (OpenAI's usage field; None if absent)
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"ttft": chunks[0] - start, "e2e": end - start, "output_tokens": tokens,
            "itl": [b - a for a, b in zip(chunks, chunks[1:])],
            "tpot": (end - chunks[0]) / (tokens - 1) if tokens > 1 else None,
            "text": "".join(pieces), "cached_tokens": cached,
            "prompt_tokens": (usage or {}).get("prompt_tokens")}


async def run_load(url, model, requests, rate, seed, disconnect_fraction=0.0, timeout=600):
    """All requests at Poisson arrivals of `rate`/s (inf: at once); returns the results."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        tasks, t = [], 0.0
        start = time.perf_counter()
        for prompt, _, max_tokens in requests:
            if math.isfinite(rate):
                t += rng.expovariate(rate)
                await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
            leave = rng.randint(1, 3) if rng.random() < disconnect_fraction else None
            tasks.append(asyncio.create_task(
                one_request(client, url, model, prompt, max_tokens, leave)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return results, duration


def summarize(results, duration, requests):
    ok = [r for r in results if "ttft" in r]
    errors = [r["error"] for r in results if "error" in r]
    out_tokens = sum(r["output_tokens"] for r in ok)
    summary = {"requests": len(results), "completed": len(ok), "errors": len(errors),
               "left_mid_stream": sum(1 for r in results if r.get("left")),
               "error_samples": sorted(set(errors))[:5], "duration_s": duration,
               "request_throughput": len(ok) / duration,
               "output_throughput": out_tokens / duration,
               "prompt_tokens": sum(n for _, n, _ in requests), "output_tokens": out_tokens}
    for name, values in (("ttft", [r["ttft"] for r in ok]),
                         ("tpot", [r["tpot"] for r in ok if r["tpot"] is not None]),
                         ("itl", [x for r in ok for x in r["itl"]]),
                         ("e2e", [r["e2e"] for r in ok])):
        summary[name + "_ms"] = _percentiles(values)
    return summary


def _percentiles(values):
    if not values:
        return None
    values = sorted(values)

    def at(q):
        return 1000 * values[min(len(values) - 1, int(round(q * (len(values) - 1))))]
    return {"mean": 1000 * statistics.fmean(values), "p50": at(0.5), "p99": at(0.99)}


# -- starting servers ------------------------------------------------------------------------

# sharded msinfer servers: ranks and strategy
SHARDED = {"msinfer-tp2": (2, "qwen2_tp2.yaml"), "msinfer-tp4": (4, "qwen2_tp4.yaml"),
           "msinfer-dp2tp2": (4, "qwen2_dp2_tp2.yaml")}


def start_server(side, args, port):
    """Popen of one server (own session) and the model name its requests use."""
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", GLOG_v="3")
    if side == "hf":
        exe = shutil.which("transformers") or os.path.join(os.path.dirname(sys.executable),
                                                           "transformers")
        # The same KV budget and prefill chunk as msinfer's defaults (1024 blocks of 16
        # tokens, 256 tokens per batch): HF otherwise sizes its cache by the host's memory.
        command = [exe, "serve", args.model_dir, "--continuous-batching", "--device", "cpu",
                   "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
                   "--cb-block-size", "16", "--cb-num-blocks", "1024",
                   "--cb-max-batch-tokens", "256"]
        model = args.model_dir
    else:
        serve = ["serve", "--model", args.model_dir, "--port", str(port),
                 "--served-model-name", "bench", "--max-len", str(args.max_len)]
        serve += args.msinfer_option
        if side == "msinfer-nocache":
            serve.append("--no-prefix-caching")
        if side in SHARDED:
            nproc, strategy = SHARDED[side]
            serve[serve.index("--model") + 1] = args.tp4_model_dir or args.model_dir
            command = [sys.executable, "-m", "msinfer", "launch", "--nproc", str(nproc),
                       "--strategy", os.path.join(ROOT, "strategies", strategy),
                       "--"] + serve
        else:
            command = [sys.executable, "-m", "msinfer"] + serve
        model = "bench"
    log = open(os.path.join(args.log_dir, f"serve_{side}.log"), "w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    return process, model


def wait_healthy(url, process, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server not healthy after {timeout}s")


@contextlib.contextmanager
def running_server(side, args):
    """start_server on a free port and wait_healthy; yields (url, model, facts), and stops it
    on the way out. facts: its command, the `uptime` line once started, the seconds to ready
    and, after, its exit code."""
    from msinfer.parallel.distributed import free_port
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    print(f"{side}: starting on {url} ...", file=sys.stderr, flush=True)
    process, model = start_server(side, args, port)
    facts = {"command": " ".join(process.args), "uptime_before": uptime()}
    try:
        started = time.monotonic()
        wait_healthy(url, process, args.ready_timeout)
        facts["ready_s"] = time.monotonic() - started
        yield url, model, facts
    finally:
        facts["exit_code"] = stop_server(process)


def uptime():
    """The `uptime` line (its load averages are recorded beside the figures)."""
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def load_note(uptimes):
    """'1-min load a, b, ...' from `uptime` lines."""
    return "1-min load " + ", ".join(u.split("load average:")[1].split(",")[0].strip()
                                     for u in uptimes if "load average" in u)


def stop_server(process):
    # msinfer launch stops its mpirun job on SIGINT; msinfer serve and HF drain on it
    os.killpg(process.pid, signal.SIGINT)
    try:
        return process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return process.wait()


def scrape(url, names):
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    found = {}
    for line in text.splitlines():
        for name in names:
            if line.startswith(name + "{") or line.startswith(name + " "):
                found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def scrape_per_replica(url):
    """{replica: {requests finished, prompt tokens computed, engine steps}} (vLLM's `engine`
    label and msinfer's `replica` label are the replica's index)."""
    import re
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    names = {"vllm:request_success_total": "requests",
             "msinfer_prefill_tokens_computed_total": "prefill_tokens",
             "msinfer_engine_step_seconds_count": "steps"}
    found = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        where = re.search(r'(?:engine|replica)="(\d+)"', line)
        if name in names and where:
            row = found.setdefault(where.group(1), {})
            row[names[name]] = row.get(names[name], 0.0) + float(line.rsplit(" ", 1)[1])
    return found


# -- the run ---------------------------------------------------------------------------------

def bench_url(url, model, args, workloads):
    """workloads: {"warmup": requests, rate name: requests} (make_requests, one salt each)."""
    warm = [(t, n, min(o, 8)) for t, n, o in workloads["warmup"][:args.warmup]]
    if warm:
        asyncio.run(run_load(url, model, warm, float("inf"), args.seed))
    by_rate = {}
    for rate_name in args.rates.split(","):
        requests = workloads[rate_name]
        rate = float("inf") if rate_name in ("burst", "inf") else float(rate_name)
        print(f"  rate {rate_name}: {len(requests)} requests ...", file=sys.stderr, flush=True)
        load_before = os.getloadavg()[0]
        results, duration = asyncio.run(run_load(url, model, requests, rate, args.seed))
        by_rate[rate_name] = summarize(results, duration, requests)
        by_rate[rate_name]["loadavg_1m_before"] = load_before
        print("    " + _line(rate_name, by_rate[rate_name]), file=sys.stderr, flush=True)
    return by_rate


def soak(url, model, args):
    rng_args = argparse.Namespace(**vars(args))
    rng_args.num_prompts = args.soak
    requests = make_requests(rng_args, load_tokenizer(args))
    watched = ("msinfer_kv_blocks_used", "vllm:num_requests_running",
               "vllm:num_requests_waiting")
    results, duration = asyncio.run(run_load(url, model, requests, args.soak_rate, args.seed,
                                             args.disconnect_fraction))
    summary = summarize(results, duration, requests)
    time.sleep(2)  # the aborts of the last clients to leave take a step to land
    summary["after_drain"] = scrape(url, watched)
    summary["healthy_after"] = httpx.get(url + "/health", timeout=5).status_code == 200
    summary["rate"] = args.soak_rate
    return summary


def _line(name, s):
    def f(metric, q="p50"):
        return f"{s[metric][q]:.0f}" if s.get(metric) else "-"
    return (f"{name}: {s['completed']}/{s['requests']} ok, {s['errors']} errors, "
            f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} tok/s, "
            f"TTFT p50 {f('ttft_ms')} ms, TPOT p50 {f('tpot_ms')} ms, ITL p50 {f('itl_ms')} ms")


def table(report):
    rows = ["| server | rate (req/s) | ok / sent | errors | req/s | output tok/s | "
            "TTFT mean / p50 / p99 (ms) | TPOT mean / p50 / p99 (ms) | "
            "ITL mean / p50 / p99 (ms) |", "|" + "---|" * 9]

    def trio(m):
        return " / ".join(f"{m[q]:.0f}" for q in ("mean", "p50", "p99")) if m else "-"
    for side, by_rate in report["servers"].items():
        for rate, s in by_rate.items():
            rows.append(f"| {side} | {rate} | {s['completed']} / {s['requests']} | "
                        f"{s['errors']} | {s['request_throughput']:.2f} | "
                        f"{s['output_throughput']:.1f} | {trio(s['ttft_ms'])} | "
                        f"{trio(s['tpot_ms'])} | {trio(s['itl_ms'])} |")
    return "\n".join(rows)


def chart(report, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("output_throughput", None, "output tokens/s"), ("ttft_ms", "p50", "TTFT p50 (ms)"),
              ("tpot_ms", "p50", "TPOT p50 (ms)"))
    for ax, (metric, q, label) in zip(axes, panels):
        for side, by_rate in report["servers"].items():
            names = list(by_rate)
            values = [(by_rate[r][metric][q] if q and by_rate[r][metric] else
                       by_rate[r][metric] if not q else float("nan")) for r in names]
            ax.plot(range(len(names)), values, marker="o", label=side)
            ax.set_xticks(range(len(names)), names)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    w = report["workload"]
    fig.suptitle(f"{os.path.relpath(w['model'], ROOT)}: {w['num_prompts']} requests per rate, prompt ~{w['input_len']} "
                 f"and output ~{w['output_len']} tokens (+-{int(100 * w['range_ratio'])}%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def with_visible_vocabulary(model_dir):
    """The checkpoint as is, unless its tokenizer.json covers fewer ids than the model emits:
    then a sibling directory (the same files, linked) whose tokenizer's vocabulary gives every
    remaining id a text of its own (`<tN>`, plain BPE entries that no merge produces, so
    prompts tokenize as before). A random checkpoint samples ids all over its vocabulary, and
    ids without text stream nothing, so without this TTFT and ITL would time the rare
    visible tokens rather than every token, differently on each server."""
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    with open(os.path.join(model_dir, "tokenizer.json")) as f:
        tokenizer = json.load(f)
    ids = set(tokenizer["model"]["vocab"].values())
    ids |= {t["id"] for t in tokenizer.get("added_tokens", [])}
    if len(ids) >= vocab:
        return model_dir
    target = os.path.abspath(model_dir).rstrip("/") + "-visible"
    os.makedirs(target, exist_ok=True)
    for name in os.listdir(model_dir):
        link = os.path.join(target, name)
        if name != "tokenizer.json" and not os.path.lexists(link):
            os.symlink(os.path.abspath(os.path.join(model_dir, name)), link)
    tokenizer["model"]["vocab"].update({f"<t{i}>": i for i in range(vocab) if i not in ids})
    with open(os.path.join(target, "tokenizer.json"), "w") as f:
        json.dump(tokenizer, f, ensure_ascii=False)
    return target


def load_tokenizer(args):
    directory = args.tokenizer or args.model_dir
    if not directory or not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return None
    import tokenizers
    return tokenizers.Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))


def _earlier_report(path, report):
    """--append: the earlier run's servers stay unless measured again (same workload only)."""
    with open(path) as f:
        earlier = json.load(f)
    if earlier["workload"] != report["workload"]:
        raise SystemExit(f"--append: {path} measured another workload: {earlier['workload']}")
    earlier.setdefault("appended", []).append(report["started"])
    return earlier


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", help="benchmark this running server")
    p.add_argument("--model", help="model name for --url (default: its first /v1/models)")
    p.add_argument("--start", action="append", default=[],
                   choices=("msinfer", "msinfer-nocache", "hf", *SHARDED),
                   help="start this server on --model-dir, benchmark it, stop it "
                        "(repeatable; run in the order given)")
    p.add_argument("--model-dir", help="checkpoint for --start")
    p.add_argument("--tp4-model-dir", help="checkpoint for the sharded servers (msinfer-tp2, "
                   "-tp4, -dp2tp2; heads divisible by 4; default --model-dir)")
    p.add_argument("--keep-tokenizer", action="store_true",
                   help="do not give every model id a text (see with_visible_vocabulary)")
    p.add_argument("--tokenizer", help="tokenizer.json directory to size prompts "
                   "(default: --model-dir)")
    p.add_argument("--msinfer-option", action="append", default=[],
                   help="extra `msinfer serve` argument (repeatable), e.g. --msinfer-option="
                        "--max-num-seqs=16")
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--rates", default="0.5,1,burst", help="comma-separated req/s; burst = "
                   "all at once")
    p.add_argument("--num-prompts", type=int, default=40, help="requests per rate")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--shared-prefix-len", type=int, default=0, metavar="TOKENS",
                   help="every prompt starts with the same text of about this many tokens "
                        "(a system prompt: what prefix caching serves)")
    p.add_argument("--warmup", type=int, default=4, help="requests before measuring")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--soak", type=int, default=0, help="after the rates: this many requests "
                   "(on --url, or the msinfer tp1 server)")
    p.add_argument("--soak-rate", type=float, default=4.0)
    p.add_argument("--disconnect-fraction", type=float, default=0.1,
                   help="share of soak clients that leave after 1-3 chunks")
    p.add_argument("--ready-timeout", type=int, default=1200)
    p.add_argument("--append", action="store_true",
                   help="add this run's servers to an existing OUT.json of the same workload")
    p.add_argument("--out", default=os.path.join(BENCH, "results", "serve"),
                   help="writes OUT.json, OUT.png, OUT.md")
    args = p.parse_args(argv)
    if not args.url and not args.start:
        p.error("give --url or --start")
    if args.start and not args.model_dir:
        p.error("--start needs --model-dir")
    args.out_dir = os.path.dirname(os.path.abspath(args.out))
    args.log_dir = os.path.join(args.out_dir, "logs")  # the servers' output, not committed
    os.makedirs(args.log_dir, exist_ok=True)
    if args.start and not args.keep_tokenizer:
        args.model_dir = with_visible_vocabulary(args.model_dir)
        if args.tp4_model_dir:
            args.tp4_model_dir = with_visible_vocabulary(args.tp4_model_dir)

    tokenizer = load_tokenizer(args)
    workloads = {name: make_requests(args, tokenizer, salt=name)
                 for name in ["warmup", *args.rates.split(",")]}
    requests = workloads[args.rates.split(",")[0]]
    report = {"workload": {k: getattr(args, k) for k in (
        "num_prompts", "input_len", "output_len", "range_ratio", "seed", "rates",
        "shared_prefix_len")},
        "machine": machine_record(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "servers": {}}
    report["workload"]["model"] = args.model_dir or args.url
    report["workload"]["prompt_tokens_mean"] = statistics.fmean(n for _, n, _ in requests)
    report["workload"]["max_tokens_mean"] = statistics.fmean(o for _, _, o in requests)
    if args.append and os.path.exists(args.out + ".json"):
        report = _earlier_report(args.out + ".json", report)
    if args.url:
        model = args.model or httpx.get(args.url + "/v1/models").json()["data"][0]["id"]
        report["servers"][args.url] = bench_url(args.url, model, args, workloads)
        if args.soak:
            report["soak"] = {args.url: soak(args.url, model, args)}
    for side in args.start:
        with running_server(side, args) as (url, model, facts):
            report.setdefault("commands", {})[side] = facts["command"]
            report.setdefault("ready_seconds", {})[side] = facts["ready_s"]
            report["servers"][side] = bench_url(url, model, args, workloads)
            if side.startswith("msinfer"):
                report.setdefault("server_metrics", {})[side] = scrape(url, (
                    "msinfer_handoff_seconds_sum", "msinfer_handoff_seconds_count",
                    "msinfer_engine_step_seconds_sum", "msinfer_engine_step_seconds_count",
                    "vllm:num_preemptions_total", "msinfer_kv_blocks_total",
                    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                    "msinfer_prefill_tokens_computed_total"))
                report.setdefault("per_replica", {})[side] = scrape_per_replica(url)
            if args.soak and side == "msinfer":
                report.setdefault("soak", {})[side] = soak(url, model, args)
        report.setdefault("exit_codes", {})[side] = facts["exit_code"]
    record_load_at_end(report["machine"])
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    text = table(report)
    with open(args.out + ".md", "w") as f:
        f.write(text + "\n")
    chart(report, args.out + ".png")
    print(text)
    for side, s in report.get("soak", {}).items():
        print(f"soak {side}: " + _line(f"{s['requests']} requests at {s['rate']}/s", s)
              + f"; {s['left_mid_stream']} left mid-stream; after drain {s['after_drain']}, "
              f"healthy {s['healthy_after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
