"""Prometheus metrics of a server, under vLLM's names, labels and histogram buckets.

The series vLLM has are named as vLLM names them (`vllm:` prefix, labels `model_name` and
`engine`, `finished_reason` on `vllm:request_success_total`, vLLM's buckets, from
vllm/v1/metrics/loggers.py), so vLLM's Grafana dashboard, inference-perf's server-side report
and autoscalers that read `vllm:num_requests_waiting` or `vllm:kv_cache_usage_perc` work as
they are (docs/grafana-msinfer.json is a dashboard over them). What vLLM has no series for
keeps the `msinfer_` prefix: KV blocks in use and in the pool, refused requests by status, the
engine step's wall time, rank 0's hand-off to the other ranks.

The engine's own counts (running, waiting, KV blocks, token totals, preemptions) come from
the last step's `EngineStats` when scraped; latencies are observed as requests produce tokens
and finish.
"""
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                         2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# msinfer's own
_STEP_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                 5.0)
_HANDOFF_BUCKETS = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3, 0.01)

ENGINE = "0"  # vLLM's `engine` label: one engine (data-parallel replicas share the loop)


def build_1_2_5_buckets(max_value):
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(buckets)
            buckets.append(m * scale)
        scale *= 10


class ServerMetrics:
    def __init__(self, model_name, stats, max_model_len=None):
        """stats: the engine's EngineStats before its first step; max_model_len sizes the
        token-count histograms' buckets (as vLLM's)."""
        self.registry = CollectorRegistry()
        self.stats = stats
        self._model = model_name
        self._tokens_seen = stats.prompt_tokens_total + stats.generation_tokens_total
        self.registry.register(_EngineCollector(self))
        labels = ["model_name", "engine"]
        token_buckets = build_1_2_5_buckets(max_model_len or stats.num_blocks_total or 1)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets,
                             registry=self.registry).labels(model_name, ENGINE)
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.",
                             TOKEN_LATENCY_BUCKETS)
        # vLLM's name for the same observations before 0.11 (older dashboards read it)
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds (the same "
                              "observations as vllm:inter_token_latency_seconds).",
                              TOKEN_LATENCY_BUCKETS)
        self.request_tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.", TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                               "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.",
                                                   token_buckets)
        self.request_max_tokens = histogram("vllm:request_params_max_tokens",
                                            "Histogram of the max_tokens request parameter.",
                                            token_buckets)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.",
                                          ITERATION_TOKEN_BUCKETS)
        self.finished = Counter("vllm:request_success", "Count of successfully processed "
                                "requests (by finish reason).",
                                labels + ["finished_reason"], registry=self.registry)
        self.rejected = Counter("msinfer_request_rejected_total",
                                "Requests answered with an error status, by status",
                                ["model_name", "status"], registry=self.registry)
        self.step_time = Histogram("msinfer_engine_step_seconds", "Wall time of one engine step",
                                   ["model_name"], buckets=_STEP_BUCKETS,
                                   registry=self.registry).labels(model_name)
        self.handoff = Histogram("msinfer_handoff_seconds",
                                 "Rank 0's time to hand one step's requests and aborts to the "
                                 "other ranks", ["model_name"], buckets=_HANDOFF_BUCKETS,
                                 registry=self.registry).labels(model_name)

    def observe_step(self, handoff_seconds, step_seconds, stats):
        self.stats = stats
        self.step_time.observe(step_seconds)
        self.handoff.observe(handoff_seconds)
        tokens = stats.prompt_tokens_total + stats.generation_tokens_total
        if tokens > self._tokens_seen:
            self.iteration_tokens.observe(tokens - self._tokens_seen)
        self._tokens_seen = tokens

    def observe_token_gap(self, seconds):
        """The time between two successive tokens of a request."""
        self.itl.observe(seconds)
        self.tpot.observe(seconds)

    def observe_request(self, arrival, first_token, finished, generated, finish_reason,
                        prompt_tokens=None, max_tokens=None):
        """Monotonic times of one finished request (first_token None when it got none)."""
        self.finished.labels(self._model, ENGINE, finish_reason or "abort").inc()
        if prompt_tokens is not None:
            self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generated)
        if max_tokens:
            self.request_max_tokens.observe(max_tokens)
        if first_token is None:
            return
        self.ttft.observe(first_token - arrival)
        self.e2e.observe(finished - arrival)
        if generated > 1:
            self.request_tpot.observe((finished - first_token) / (generated - 1))

    def observe_rejected(self, status):
        self.rejected.labels(self._model, str(status)).inc()


class _EngineCollector:
    def __init__(self, metrics):
        self.metrics = metrics

    def collect(self):
        stats, model = self.metrics.stats, self.metrics._model

        def family(kind, name, doc, value, labels=("model_name", "engine")):
            f = kind(name, doc, labels=list(labels))
            f.add_metric([model, ENGINE][:len(labels)], value)
            return f

        yield family(GaugeMetricFamily, "vllm:num_requests_running",
                     "Number of requests in model execution batches.", stats.num_running)
        yield family(GaugeMetricFamily, "vllm:num_requests_waiting",
                     "Number of requests waiting to be processed.", stats.num_waiting)
        total = stats.num_blocks_total
        yield family(GaugeMetricFamily, "vllm:kv_cache_usage_perc",
                     "KV-cache usage. 1 means 100 percent usage.",
                     stats.num_blocks_used / total if total else 0.0)
        yield family(CounterMetricFamily, "vllm:prompt_tokens",
                     "Number of prefill tokens processed.", stats.prompt_tokens_total)
        yield family(CounterMetricFamily, "vllm:generation_tokens",
                     "Number of generation tokens processed.", stats.generation_tokens_total)
        yield family(CounterMetricFamily, "vllm:num_preemptions",
                     "Cumulative number of preemption from the engine.", stats.num_preemptions)
        yield family(GaugeMetricFamily, "msinfer_kv_blocks_used", "KV cache blocks in use",
                     stats.num_blocks_used, labels=("model_name",))
        yield family(GaugeMetricFamily, "msinfer_kv_blocks_total", "KV cache blocks in the pool",
                     total, labels=("model_name",))
