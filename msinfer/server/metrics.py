"""Prometheus metrics of a server: engine gauges and counters, request latency histograms.

The engine's own counts (running, waiting, KV blocks, token totals, preemptions) come from
the last step's `EngineStats` when scraped; latencies are observed as requests finish.
"""
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
                    160.0)
_TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                          1.0, 2.5, 5.0)
_HANDOFF_BUCKETS = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3, 0.01)


class ServerMetrics:
    def __init__(self, model_name, stats):
        """stats: the engine's EngineStats before its first step."""
        self.registry = CollectorRegistry()
        self.stats = stats
        self._model = model_name
        self.registry.register(_EngineCollector(self))
        labels = ["model_name"]
        self.ttft = Histogram("msinfer_time_to_first_token_seconds",
                              "Time from request arrival to its first generated token",
                              labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("msinfer_time_per_output_token_seconds",
                              "Mean time between output tokens of a finished request, "
                              "after the first", labels, buckets=_TOKEN_LATENCY_BUCKETS,
                              registry=self.registry)
        self.e2e = Histogram("msinfer_e2e_request_latency_seconds",
                             "Time from request arrival to its last token", labels,
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.finished = Counter("msinfer_request_success_total",
                                "Requests finished, by finish reason",
                                labels + ["finished_reason"], registry=self.registry)
        self.rejected = Counter("msinfer_request_rejected_total",
                                "Requests answered with an error status, by status",
                                labels + ["status"], registry=self.registry)
        self.step_time = Histogram("msinfer_engine_step_seconds", "Wall time of one engine step",
                                   labels, buckets=_TOKEN_LATENCY_BUCKETS,
                                   registry=self.registry)
        self.handoff = Histogram("msinfer_handoff_seconds",
                                 "Rank 0's time to hand one step's requests and aborts to the "
                                 "other ranks", labels, buckets=_HANDOFF_BUCKETS,
                                 registry=self.registry)

    def observe_step(self, handoff_seconds, step_seconds, stats):
        self.stats = stats
        self.step_time.labels(self._model).observe(step_seconds)
        self.handoff.labels(self._model).observe(handoff_seconds)

    def observe_request(self, arrival, first_token, finished, generated, finish_reason):
        """Monotonic times of one finished request (first_token None when it got none)."""
        model = self._model
        self.finished.labels(model, finish_reason or "abort").inc()
        if first_token is None:
            return
        self.ttft.labels(model).observe(first_token - arrival)
        self.e2e.labels(model).observe(finished - arrival)
        if generated > 1:
            self.tpot.labels(model).observe((finished - first_token) / (generated - 1))

    def observe_rejected(self, status):
        self.rejected.labels(self._model, str(status)).inc()


class _EngineCollector:
    def __init__(self, metrics):
        self.metrics = metrics

    def collect(self):
        stats, model = self.metrics.stats, self.metrics._model

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([model], value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([model], value)
            return c

        yield gauge("msinfer_num_requests_running", "Requests in the running batch",
                    stats.num_running)
        yield gauge("msinfer_num_requests_waiting", "Requests waiting to be scheduled",
                    stats.num_waiting)
        yield gauge("msinfer_kv_blocks_used", "KV cache blocks in use", stats.num_blocks_used)
        yield gauge("msinfer_kv_blocks_total", "KV cache blocks in the pool",
                    stats.num_blocks_total)
        yield counter("msinfer_prompt_tokens", "Prompt tokens taken in",
                      stats.prompt_tokens_total)
        yield counter("msinfer_generation_tokens", "Tokens generated",
                      stats.generation_tokens_total)
        yield counter("msinfer_num_preemptions", "Requests preempted to free KV blocks",
                      stats.num_preemptions)
