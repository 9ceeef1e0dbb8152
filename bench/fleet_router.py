"""vLLM's router (`vllm-router`, PyPI) in front of two msinfer servers on this host, with its
round_robin, power_of_two, cache_aware and kv_aware policies (kv_aware indexes the servers'
KV-cache events, --kv-events-config), on a shared-prefix workload (issue 40):

    python bench/fleet_router.py --model-dir models/tiny-qwen2 --out bench/results/fleet_router

`--groups` system prompts of about `--prefix-words` words, each followed by `--questions`
questions, sent interleaved (group 0's first question, group 1's first, ...) by
`--concurrency` clients. The number of groups is odd: with an even one, round robin over two
servers would happen to send each group to the same server every time. Per policy: the
prefix-cache hits and queries both servers count (/metrics' vllm:prefix_cache_hits_total,
_queries_total, read before and after; /flush_cache between policies), how many requests each
server finished, the wall time and the mean latency.
Writes OUT.json and OUT.md. The cheap CI version: tests/server/test_fleet_router.py.
"""
import argparse
import concurrent.futures
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import httpx2 as httpx
from machine import machine_record, record_load_at_end

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICIES = ("round_robin", "power_of_two", "cache_aware", "kv_aware")
COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
            "vllm:request_success_total")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url, process, log, timeout=900):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"{url} exited: see {log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    sys.exit(f"{url} not ready after {timeout}s: see {log}")


def start(argv, url, log):
    process = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                               env=dict(os.environ, PYTHONPATH=ROOT))
    wait_ready(url, process, log)
    return process


def counters(url):
    text = httpx.get(url + "/metrics", timeout=10).text
    return {name: sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith(name + "{")) for name in COUNTERS}


def workload(args):
    prompts = []
    for q in range(args.questions):
        for g in range(args.groups):
            prefix = f"System {g}: " + " ".join(f"rule-{g}-{i}" for i in range(args.prefix_words))
            prompts.append(f"{prefix}\nQuestion {q}: what follows {q * 7 + g}?")
    return prompts


def kv_aware_args(servers, kv_ports, model_dir):
    block = httpx.get(servers[0] + "/get_server_info").json()["kv_block_size"]
    extra = ["--kv-event-block-size", str(block), "--kv-event-model", model_dir]
    for url, port in zip(servers, kv_ports):
        extra += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{port}"]
    return extra


def run_policy(policy, servers, prompts, args, out_dir, extra=()):
    router_bin = shutil.which("vllm-router") or os.path.join(os.path.dirname(sys.executable),
                                                             "vllm-router")
    for url in servers:
        httpx.post(url + "/flush_cache", timeout=60).raise_for_status()
    before = [counters(url) for url in servers]
    url = f"http://127.0.0.1:{free_port()}"
    router = start([router_bin, "--worker-urls", *servers, "--policy", policy,
                    "--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1],
                    "--prometheus-port", str(free_port()),
                    "--worker-startup-check-interval", "1", "--log-level", "warning",
                    *extra],
                   url, os.path.join(out_dir, f"router_{policy}.log"))

    def one(prompt):
        start_time = time.monotonic()
        response = httpx.post(url + "/v1/completions", timeout=600, json={
            "model": args.name, "prompt": prompt, "max_tokens": args.max_tokens,
            "temperature": 0})
        response.raise_for_status()
        return time.monotonic() - start_time
    began = time.monotonic()
    try:
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            latencies = list(pool.map(one, prompts))
    finally:
        router.kill()
        router.wait()
    wall = time.monotonic() - began
    after = [counters(u) for u in servers]
    delta = [{k: a[k] - b[k] for k in COUNTERS} for a, b in zip(after, before)]
    hits = sum(d["vllm:prefix_cache_hits_total"] for d in delta)
    queries = sum(d["vllm:prefix_cache_queries_total"] for d in delta)
    return {"policy": policy, "prefix_cache_hits": hits, "prefix_cache_queries": queries,
            "hit_rate": hits / queries if queries else 0.0,
            "requests_per_server": [d["vllm:request_success_total"] for d in delta],
            "wall_s": round(wall, 2),
            "mean_latency_s": round(sum(latencies) / len(latencies), 3)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default=os.path.join(ROOT, "models", "tiny-qwen2"))
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "fleet_router"))
    p.add_argument("--name", default="tiny")
    p.add_argument("--groups", type=int, default=7)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--prefix-words", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-len", type=int, default=512)
    args = p.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    out_dir = tempfile.mkdtemp(prefix="fleet-router-")  # the servers' and routers' logs
    print(f"logs in {out_dir}")
    servers, processes, kv_ports = [], [], []
    try:
        for i in range(2):
            url, kv_port = f"http://127.0.0.1:{free_port()}", free_port()
            events = json.dumps({"enable_kv_cache_events": True,
                                 "endpoint": f"tcp://*:{kv_port}"})
            processes.append(start(
                [sys.executable, "-m", "msinfer", "serve", "--model", args.model_dir,
                 "--served-model-name", args.name, "--max-len", str(args.max_len),
                 "--port", url.rsplit(":", 1)[1], "--kv-events-config", events], url,
                os.path.join(out_dir, f"fleet_server{i}.log")))
            servers.append(url)
            kv_ports.append(kv_port)
        machine = machine_record()  # the servers up, the measurements next
        prompts = workload(args)
        results = [run_policy(policy, servers, prompts, args, out_dir,
                              kv_aware_args(servers, kv_ports, args.model_dir)
                              if policy == "kv_aware" else ())
                   for policy in POLICIES]
    finally:
        for process in processes:
            process.kill()
    settings = {**vars(args), "model_dir": os.path.basename(args.model_dir.rstrip("/")),
                "out": os.path.relpath(args.out, ROOT)}
    report = {"args": settings, "requests": len(prompts),
              "machine": record_load_at_end(machine), "results": results}
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=2)
    lines = ["| policy | prefix-cache hit rate | hits / queries (tokens) | requests per server "
             "| wall s | mean latency s |", "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['policy']} | {r['hit_rate']:.3f} | {r['prefix_cache_hits']:.0f} / "
                     f"{r['prefix_cache_queries']:.0f} | "
                     f"{' + '.join(f'{n:.0f}' for n in r['requests_per_server'])} | "
                     f"{r['wall_s']} | {r['mean_latency_s']} |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
