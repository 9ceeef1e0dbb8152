"""A real `msinfer serve` process for tests (one rank or a launched job), and the tiny
checkpoint and settings of the session's shared single-process server (conftest.py's
`tiny_server`): test_serve.py compares its sharded jobs with it; the real-client tests
(lm-eval, guidellm, the openai SDK) run against it."""
import json
import os
import signal
import subprocess
import sys
import time

import httpx2 as httpx
import openai
import pytest

from msinfer.cli.launch import die_with_parent
from msinfer.parallel.distributed import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "tiny"
MAX_LEN = 128
# The same engine settings for the one-process server and the sharded jobs (their completions
# are compared); a 32-token prefill chunk keeps warm-up short.
SERVE_ARGS = ["--served-model-name", NAME, "--max-len", str(MAX_LEN), "--max-num-seqs", "4",
              "--max-prefill-tokens", "32"]
TINY_SERVE_MODEL = dict(layers=2, hidden=128, heads=4, kv_heads=2, vocab=512)


def dp2_tp2_job(model_dir, log, stall, env=None):
    """The deploy guide's dp2 x tp2 serve job (4 ranks under launch) over a Qwen3 checkpoint of
    TINY_SERVE_MODEL's size, with Qwen3's reasoning parser and n-gram speculation (1- to
    4-grams, so that its short prompts get proposals). test_serve and test_serve_soak start it
    alike: every start after the session's first loads its graphs from the compile cache
    (warm in about 1 s instead of 10 on a quiet machine)."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
             "prompt_lookup_max": 4}
    strategy = os.path.join(ROOT, "strategies", "qwen2_dp2_tp2.yaml")
    return ServerProcess(["launch", "--nproc", "4", "--strategy", strategy, "--", "serve",
                          "--model", model_dir, *SERVE_ARGS, "--stall-timeout", str(stall),
                          "--reasoning-parser", "qwen3", "--speculative-config",
                          json.dumps(ngram)], log, ready_timeout=900, env=env)


def kv_events_args():
    """`--kv-events-config` publishing on a free port (the endpoint in /kv_event_sources)."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{free_port()}"}  # topic "": vllm-router reads no other
    return ["--kv-events-config", json.dumps(config)]


class ServerProcess:
    def __init__(self, argv, log_path, ready_timeout=600, env=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.not_ready_seen = []
        # joining MindSpore's scheduler: a retry every 1 s, not 3-5 s (test_commtest's FAST_JOIN)
        env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1", "GLOG_v": "3",
               "MS_RETRY_INTERVAL_LOWER": "1", "MS_RETRY_INTERVAL_UPPER": "1", **(env or {})}
        self.log = open(log_path, "w")
        # one client for the polls and /metrics: httpx.get makes a client per call, some
        # 20 ms of CPU (its SSL context), at every poll of a start that takes minutes
        self.http = httpx.Client(base_url=self.url, timeout=10)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "msinfer"] + argv + ["--port", str(self.port)],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=die_with_parent)  # a pytest killed outright takes its servers along
        deadline = time.monotonic() + ready_timeout
        while not self.healthy():
            if self.process.poll() is not None:
                pytest.fail(f"server exited with {self.process.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"server not ready after {ready_timeout}s:\n{self.output()}")
            time.sleep(0.5)

    def healthy(self):
        """Whether /health is 200; the statuses of the 503s seen on the way go to
        `not_ready_seen`."""
        try:
            response = self.http.get("/health", timeout=5)
        except httpx.HTTPError:
            return False
        if response.status_code == 503:
            self.not_ready_seen.append(response.json()["status"])
        return response.status_code == 200

    def output(self):
        with open(self.log_path) as f:
            return f.read()

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0,
                             timeout=120)

    def metric(self, name, where=""):
        """The sum of `name`'s samples (those whose labels contain `where`)."""
        text = self.http.get("/metrics").text
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if (line.startswith(name + "{") or line.startswith(name + " "))
                  and where in line]
        assert values, f"{name} not in /metrics"
        return sum(values)

    def interrupt(self):
        """Ctrl-C to the server (to the launcher of a job, which stops its ranks): the time."""
        os.killpg(self.process.pid, signal.SIGINT)
        return time.monotonic()

    def kill(self):
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.log.close()
        self.http.close()

    def alive(self):
        return self.process.poll() is None
