"""vLLM's router (`vllm-router` from PyPI, a Rust binary) in front of two msinfer servers on
this host, with four of its policies:
- round_robin, cache_aware and kv_aware over two real servers (the session's `tiny_server` and
  one more on the same checkpoint, both publishing KV-cache events): a workload of shared
  prompt prefixes gets more prefix-cache hits through cache_aware, which sends a prefix back
  where it went, and through kv_aware, which indexes the servers' KV events and credits the
  cached prefix, than through round_robin;
- power_of_two over two fake-engine servers (tests/fake_engine.py, slow steps): the router
  reads their /get_load and sends new requests to the one that is not busy.
bench/fleet_router.py runs the larger workload and records its figures."""
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import time

import httpx2 as httpx
import pytest

from msinfer.parallel.distributed import free_port

from servers import NAME, SERVE_ARGS, ServerProcess, kv_events_args
from test_serve_protocol import MODEL, RunningServer


def router_binary():
    binary = shutil.which("vllm-router") or os.path.join(os.path.dirname(sys.executable),
                                                         "vllm-router")
    if not os.path.exists(binary):
        if os.environ.get("CI"):
            pytest.fail("vllm-router is not installed (setup.cfg's [test] extra has it)")
        pytest.skip("vllm-router is not installed (pip install vllm-router==0.1.17)")
    return binary


class RouterProcess:
    def __init__(self, policy, workers, log_path, extra=(), log_level=None):
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(
            [router_binary(), "--worker-urls", *workers, "--policy", policy,
             "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1],
             "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1",
             "--log-level", log_level or os.environ.get("ROUTER_LOG", "warning"), *extra],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            assert self.process.poll() is None, open(log_path).read()
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, open(log_path).read()
            time.sleep(0.3)

    def complete(self, model, prompt, max_tokens):
        response = httpx.post(self.url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        assert response.status_code == 200, response.text
        return response.json()

    def stop(self):
        self.process.kill()
        self.process.wait()
        self.log.close()


def _metric(url, name):
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


# Shared-prefix workload: each of 3 long system prompts with 4 questions after it, in turn
# (an odd number of prompts: with an even one, round robin over two servers would happen to
# send each prompt to the same server every time).
PREFIXES = [f"You are assistant number {g}. " + " ".join(f"rule{g}x{i}" for i in range(12))
            for g in range(3)]
WORKLOAD = [f"{prefix}\nQuestion {q}: what is {q} + {q}?" for q in range(4)
            for prefix in PREFIXES]


@pytest.fixture(scope="module")
def second_server(serve_model, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("log") / "second.log")
    server = ServerProcess(["serve", *SERVE_ARGS, "--model", serve_model, *kv_events_args()],
                           log)
    yield server
    server.kill()


def kv_aware_args(servers, model_dir):
    """vllm-router's kv_aware: each server's KV-event endpoint (its /kv_event_sources), the
    block size, and the checkpoint (the router tokenizes prompts with its tokenizer.json)."""
    block = httpx.get(servers[0].url + "/get_server_info").json()["kv_block_size"]
    extra = ["--kv-event-block-size", str(block), "--kv-event-model", model_dir]
    for server in servers:
        endpoint = httpx.get(server.url + "/kv_event_sources").json()["0"]["endpoint"]
        extra += ["--kv-event-source",
                  f"{server.url}=tcp://127.0.0.1:{endpoint.rsplit(':', 1)[1]}"]
    return extra


def _credited(log_path):
    """The prefix tokens kv_aware credited to its choices (its debug log's decisions)."""
    with open(log_path) as f:
        text = re.sub(r"\x1b\[[0-9;]*m", "", f.read())
    return [int(n) for n in re.findall(r"credited_prefix_tokens=(\d+)", text)]


def _hits_through(policy, servers, tmp_path, extra=(), log_level=None):
    for server in servers:
        assert httpx.post(server.url + "/flush_cache", timeout=30).status_code == 200
    before = [_metric(s.url, "vllm:prefix_cache_hits_total") for s in servers]
    served = [_metric(s.url, "vllm:request_success_total") for s in servers]
    router = RouterProcess(policy, [s.url for s in servers], tmp_path / f"{policy}.log",
                           extra, log_level)
    try:
        for prompt in WORKLOAD:
            router.complete(NAME, prompt, 2)
    finally:
        router.stop()
    hits = sum(_metric(s.url, "vllm:prefix_cache_hits_total") - b
               for s, b in zip(servers, before))
    per_server = [_metric(s.url, "vllm:request_success_total") - b
                  for s, b in zip(servers, served)]
    return hits, per_server


def test_cache_and_kv_aware_routing_raise_prefix_hits_over_round_robin(
        tiny_server, second_server, serve_model, tmp_path):
    servers = [tiny_server, second_server]
    robin_hits, robin_spread = _hits_through("round_robin", servers, tmp_path)
    aware_hits, aware_spread = _hits_through("cache_aware", servers, tmp_path)
    kv_hits, kv_spread = _hits_through("kv_aware", servers, tmp_path,
                                       kv_aware_args(servers, serve_model), "debug")
    assert robin_spread == [len(WORKLOAD) / 2] * 2  # round robin alternates
    # (vllm-router 0.1.17 puts a new prefix on the same worker while the loads are even:
    # this sequential workload may all land on one)
    assert sum(aware_spread) == len(WORKLOAD)
    # round robin computes each prefix on both servers, cache_aware on one
    assert aware_hits > robin_hits, (aware_hits, robin_hits)
    # kv_aware read the servers' KV events: it credited cached prefixes to its choices
    assert sum(kv_spread) == len(WORKLOAD) and kv_hits > robin_hits, (kv_hits, robin_hits)
    assert max(_credited(tmp_path / "kv_aware.log")) >= len(PREFIXES[0]) // 8


def test_power_of_two_reads_get_load(tmp_path):
    busy, idle = RunningServer(step_delay=0.1), RunningServer(step_delay=0.1)
    router = None
    try:
        router = RouterProcess("power_of_two", [busy.url, idle.url], tmp_path / "p2.log")
        client = busy.client()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            # four long requests straight to one server: its /get_load says 4 for ~8 s
            hogs = [pool.submit(client.completions.create, model=MODEL, prompt=f"hog{i}",
                                max_tokens=80) for i in range(4)]
            deadline = time.monotonic() + 10
            while httpx.get(busy.url + "/get_load").json()["load"] < 4:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            time.sleep(2.5)  # the router polls /get_load every second
            before = idle.engine.prompt_tokens
            for i in range(6):
                router.complete(MODEL, f"new{i}", 2)
            assert idle.engine.prompt_tokens - before == 6 * len("new0")
            assert all(h.result().usage.completion_tokens == 80 for h in hogs)
    finally:
        if router is not None:
            router.stop()
        busy.stop()
        idle.stop()
