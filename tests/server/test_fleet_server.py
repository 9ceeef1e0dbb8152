"""The session's real server (conftest.py's `tiny_server`) as the fleet sees it: its KV-cache
events against its prefix-cache counters, and a real Prometheus (Debian's `prometheus`)
scraping it, answering every query of vLLM's published Grafana dashboard, of
docs/grafana-msinfer.json and of the gateways (Gateway API Inference Extension, llm-d,
production-stack's router). One server start for all (the session's)."""
import json
import math
import os
import shutil
import subprocess
import time

import httpx2 as httpx
import msgpack
import pytest
import zmq

from msinfer.parallel.distributed import free_port

from servers import NAME

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VLLM_DASHBOARD = os.path.join(ROOT, "tests", "fixtures", "vllm_grafana_queries.txt")
MSINFER_DASHBOARD = os.path.join(ROOT, "docs", "grafana-msinfer.json")
# what the gateways read (GIE's model-server protocol, llm-d's scorers, production-stack)
GATEWAY_QUERIES = [
    'vllm:num_requests_waiting{model_name="$model_name"}',
    'vllm:num_requests_running{model_name="$model_name"}',
    'vllm:kv_cache_usage_perc{model_name="$model_name"}',
    'vllm:cache_config_info{block_size!="", num_gpu_blocks!=""}',
    'vllm:lora_requests_info{max_lora!=""}',
    'vllm:gpu_prefix_cache_hits_total{model_name="$model_name"}',
    'vllm:gpu_prefix_cache_queries_total{model_name="$model_name"}',
    'sum by (source) (vllm:prompt_tokens_by_source_total{model_name="$model_name"})',
    'vllm:prompt_tokens_cached_total{model_name="$model_name"}',
    'histogram_quantile(0.9, sum by (le) (rate(vllm:request_inference_time_seconds_bucket'
    '{model_name="$model_name"}[$__rate_interval])))',
    'histogram_quantile(0.9, sum by (le) (rate(vllm:request_params_n_bucket'
    '{model_name="$model_name"}[$__rate_interval])))',
    'histogram_quantile(0.9, sum by (le) (rate(vllm:request_params_max_tokens_bucket'
    '{model_name="$model_name"}[$__rate_interval])))',
    'histogram_quantile(0.9, sum by (le) (rate(vllm:iteration_tokens_total_bucket'
    '{model_name="$model_name"}[$__rate_interval])))',
]


def _get(server, path):
    response = httpx.get(server.url + path, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def _subscribe(server):
    source = _get(server, "/kv_event_sources")["0"]
    port = source["endpoint"].rsplit(":", 1)[1]
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, source["topic"].encode())
    return sub


def _events(sub, quiet=1.0):
    """The events published until none came for `quiet` seconds."""
    events = []
    while sub.poll(int(quiet * 1000)):
        _, _, payload = sub.recv_multipart()
        events += msgpack.unpackb(payload)[1]
    return events


def test_kv_events_agree_with_the_prefix_cache_counters(tiny_server):
    server = tiny_server
    block = _get(server, "/get_server_info")["kv_block_size"]
    sub = _subscribe(server)
    deadline = time.monotonic() + 30
    while True:  # the slow joiner: flush (the server is idle) until the subscriber hears it
        assert httpx.post(server.url + "/flush_cache", timeout=30).status_code == 200
        if {"type": "AllBlocksCleared"} in _events(sub, 0.3):
            break
        assert time.monotonic() < deadline, "no AllBlocksCleared from /flush_cache"
    hits = server.metric("vllm:prefix_cache_hits_total")
    queries = server.metric("vllm:prefix_cache_queries_total")
    prompt = [7 + i % 300 for i in range(min(3 * block + 3, 100))]
    client = server.client()
    client.completions.create(model=NAME, prompt=prompt, max_tokens=2)
    stored = [e for e in _events(sub) if e["type"] == "BlockStored"]
    again = client.completions.create(model=NAME, prompt=prompt, max_tokens=2)
    cached = again.usage.prompt_tokens_details.cached_tokens
    # the blocks published after the flush are the prompt's first blocks, chained from none
    assert stored and stored[0]["parent_block_hash"] is None
    assert all(e["block_size"] == block for e in stored)
    tokens = [t for e in stored for t in e["token_ids"]]
    hashes = [h for e in stored for h in e["block_hashes"]]
    assert len(tokens) == len(hashes) * block
    matched = (len(prompt) - 1) // block  # the cache never serves a prompt's last token
    assert tokens[:matched * block] == prompt[:matched * block]
    assert cached == matched * block > 0
    assert server.metric("vllm:prefix_cache_hits_total") - hits == cached
    assert server.metric("vllm:prefix_cache_queries_total") - queries == 2 * len(prompt)
    sub.close()


def _prometheus_or_fail():
    binary = shutil.which("prometheus")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is not installed (launch/quickstart.sh installs Debian's)")
        pytest.skip("prometheus is not installed (apt-get install prometheus)")
    return binary


@pytest.fixture
def prometheus(tiny_server, tmp_path):
    binary = _prometheus_or_fail()
    config = tmp_path / "prometheus.yml"
    target = tiny_server.url.split("//", 1)[1]
    config.write_text(json.dumps({  # YAML is a superset of JSON
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "msinfer", "static_configs": [{"targets": [target]}]}]}))
    url = f"http://127.0.0.1:{free_port()}"
    log = open(tmp_path / "prometheus.log", "w")
    process = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address={url.split('//')[1]}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while _query(url, 'up{job="msinfer"} == 1', check=False) == []:
            assert process.poll() is None, (tmp_path / "prometheus.log").read_text()
            assert time.monotonic() < deadline, "Prometheus never scraped the server"
            time.sleep(0.5)
        yield url
    finally:
        process.kill()
        process.wait()
        log.close()


def _query(url, expr, check=True):
    try:
        response = httpx.get(url + "/api/v1/query", params={"query": expr}, timeout=10)
    except httpx.HTTPError:
        if check:
            raise
        return []
    if not check and response.status_code != 200:
        return []
    body = response.json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def _dashboard_queries():
    with open(VLLM_DASHBOARD) as f:
        vllm = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    found = []

    def walk(x):
        if isinstance(x, dict):
            if "expr" in x:
                found.append(x["expr"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    with open(MSINFER_DASHBOARD) as f:
        walk(json.load(f))
    return vllm, found


def _traffic(server):
    """What every panel needs: completions and chats (streamed, n=2, a shared prefix for the
    cache), one refusal (a prompt beyond the context)."""
    client = server.client()
    shared = [11 + i % 200 for i in range(40)]
    for i in range(3):
        client.completions.create(model=NAME, prompt=shared + [300 + i], max_tokens=6, n=2,
                                  temperature=0.8, seed=i)
        list(client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=8,
            stream=True))
    with pytest.raises(Exception):
        client.completions.create(model=NAME, prompt=[5] * 200, max_tokens=4)


def test_prometheus_answers_every_dashboard_and_gateway_query(tiny_server, prometheus):
    _traffic(tiny_server)
    time.sleep(4)  # a few scrapes after the traffic: every rate has two samples in its window
    vllm, msinfer_dashboard = _dashboard_queries()
    assert len(vllm) == 27 and len(msinfer_dashboard) >= 20
    models = httpx.get(prometheus + "/api/v1/label/model_name/values",
                       params={"match[]": '{__name__=~"vllm:.*"}'}).json()["data"]
    assert models == [NAME]  # the dashboards' $model_name variable
    empty, not_numbers = [], []
    for expr in vllm + msinfer_dashboard + GATEWAY_QUERIES:
        query = expr.replace("$model_name", NAME).replace("$__rate_interval", "1m")
        result = _query(prometheus, query)
        if not result:
            empty.append(expr)
        elif not all(math.isfinite(float(r["value"][1])) for r in result):
            not_numbers.append(expr)
    assert not empty, f"queries without data: {empty}"
    assert not not_numbers, f"queries answering NaN: {not_numbers}"
