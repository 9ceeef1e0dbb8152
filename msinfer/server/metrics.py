"""Prometheus metrics of a server, under vLLM's names, labels and histogram buckets.

The series vLLM has are named as vLLM names them (`vllm:` prefix, labels `model_name` and
`engine`, `finished_reason` on `vllm:request_success_total`, vLLM's buckets, from
vllm/v1/metrics/loggers.py), so vLLM's Grafana dashboard, inference-perf's server-side report
and autoscalers that read `vllm:num_requests_waiting` or `vllm:kv_cache_usage_perc` work as
they are (docs/grafana-msinfer.json is a dashboard over them). What vLLM has no series for
keeps the `msinfer_` prefix: KV blocks in use and in the pool, refused requests by status, the
engine step's wall time, rank 0's hand-off to the other ranks.

The engine's own counts (running, waiting, KV blocks, token totals, preemptions) come from
each replica's last `EngineStats` when scraped; latencies are observed as requests produce
tokens and finish.

Which requests count, as vLLM's (vllm/v1/engine/output_processor.py, vllm/v1/metrics/
loggers.py): `vllm:request_success_total` has a sample for every finish reason of vLLM and
every replica from the start (0 until one finishes so). A request counts, and the
finished-request histograms observe it (end-to-end latency and token counts always, the
per-token and phase times once it got a token), when its response ends with its finish
reason: "abort" too, for one the server aborted while its client waited (the drain's
deadline, a second SIGTERM), as vLLM counts a request its engine core reports finished with
FinishReason.ABORT. A request whose client left counts nowhere among the finished: vLLM's
AsyncLLM aborts it through OutputProcessor.abort_requests, which records no stats. The time
to the first token and between tokens are observed as the tokens come, whatever happens
next, as vLLM's IterationStats.update_from_output does.

With data-parallel replicas every series is per replica: vLLM's `engine` label is the
replica's index (as vLLM labels its data-parallel engines), msinfer's series have a
`replica` label.

With speculative decoding configured (and only then, as vLLM), vLLM's
`vllm:spec_decode_*` counters (vllm/v1/spec_decode/metrics.py) count drafts, proposed and
accepted tokens, and accepted tokens by proposal position.
"""
import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .stats_log import StatsLog

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                         2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_N_BUCKETS = (1, 2, 5, 10, 20)
# vLLM's finish reasons (FINISH_REASON_STRINGS, vllm/v1/engine/__init__.py), each a
# vllm:request_success_total sample from the start; msinfer's requests end with the first four
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
# msinfer's own
_STEP_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                 5.0)
_HANDOFF_BUCKETS = (1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3, 0.01)


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
    def __init__(self, model_name, engine_config, stats, replicas=1):
        """engine_config: the served engine's EngineConfig (its max_model_len sizes the
        token-count histograms' buckets, as vLLM's; its KV cache settings are
        vllm:cache_config_info's labels; its speculative config, the vllm:spec_decode_*
        series, none without); stats: replica 0's EngineStats before its first step (every
        replica starts alike)."""
        self.registry = CollectorRegistry()
        speculative = self.speculative = engine_config.speculative
        self.stats_log = StatsLog(speculative)  # the periodic log line, from the same stats
        self.stats = [stats] * replicas  # each replica's after its last step
        self._model = model_name
        self._cache_info = _cache_info(engine_config, stats.num_blocks_total)
        self._tokens_seen = [stats.prompt_tokens_total + stats.generation_tokens_total] * replicas
        self.registry.register(_EngineCollector(self))
        labels = ["model_name", "engine"]
        token_buckets = build_1_2_5_buckets(engine_config.max_model_len)

        def histogram(name, doc, buckets):
            made = Histogram(name, doc, labels, buckets=buckets, registry=self.registry)
            for replica in range(replicas):  # a series per engine from the start (vLLM's)
                made.labels(model_name, str(replica))
            return made
        self._latency_histograms(histogram)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                               "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.",
                                                   token_buckets)
        self._request_histograms(histogram, token_buckets)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.",
                                          ITERATION_TOKEN_BUCKETS)
        self.finished = Counter("vllm:request_success", "Count of successfully processed "
                                "requests (by finish reason).",
                                labels + ["finished_reason"], registry=self.registry)
        for replica in range(replicas):
            for reason in FINISH_REASONS:
                self.finished.labels(model_name, str(replica), reason)
        self.rejected = Counter("msinfer_request_rejected_total",
                                "Requests answered with an error status, by status",
                                ["model_name", "status"], registry=self.registry)
        self.step_time = Histogram("msinfer_engine_step_seconds", "Wall time of one engine step",
                                   ["model_name", "replica"], buckets=_STEP_BUCKETS,
                                   registry=self.registry)
        self.handoff = Histogram("msinfer_handoff_seconds",
                                 "A tensor group leader's time to hand one step's frame to "
                                 "the other ranks of its group", ["model_name", "replica"],
                                 buckets=_HANDOFF_BUCKETS, registry=self.registry)

    def _latency_histograms(self, histogram):
        """vLLM's latencies: to the first token, between tokens, per output token of a
        request, end to end."""
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

    def _request_histograms(self, histogram, token_buckets):
        """vLLM's request parameters, and its split of a request's time: waiting to be
        scheduled, prefill (to the first token), decode (first to last token), inference
        (prefill and decode)."""
        self.request_max_tokens = histogram("vllm:request_params_max_tokens",
                                            "Histogram of the max_tokens request parameter.",
                                            token_buckets)
        self.max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", token_buckets)
        self.request_n = histogram("vllm:request_params_n",
                                   "Histogram of the n request parameter.", REQUEST_N_BUCKETS)

        def phase(name, doc):
            return histogram(f"vllm:request_{name}_time_seconds", doc, REQUEST_LATENCY_BUCKETS)
        self.queue_time = phase("queue", "Histogram of time spent in WAITING phase for request.")
        self.prefill_time = phase("prefill", "Histogram of time spent in PREFILL phase for "
                                  "request.")
        self.decode_time = phase("decode", "Histogram of time spent in DECODE phase for request.")
        self.inference_time = phase("inference", "Histogram of time spent in RUNNING phase for "
                                    "request.")

    def observe_request_params(self, n):
        """A request's `n` (vllm:request_params_n), as it is taken."""
        self.request_n.labels(self._model, "0").observe(n)

    def observer(self, replica):
        """The `on_step` of `replica`'s engine loop (lockstep.EngineLoop)."""
        return lambda handoff, seconds, stats: self.observe_step(replica, handoff, seconds,
                                                                 stats)

    def observe_step(self, replica, handoff_seconds, step_seconds, stats):
        """After a pass of `replica`'s engine loop (step_seconds None: no step ran)."""
        self.stats[replica] = stats
        self.stats_log.observe(self.stats)
        if step_seconds is None:
            return
        label = str(replica)
        self.step_time.labels(self._model, label).observe(step_seconds)
        self.handoff.labels(self._model, label).observe(handoff_seconds)
        tokens = stats.prompt_tokens_total + stats.generation_tokens_total
        if tokens > self._tokens_seen[replica]:
            self.iteration_tokens.labels(self._model, label).observe(
                tokens - self._tokens_seen[replica])
        self._tokens_seen[replica] = tokens

    def observe_first_token(self, seconds, replica=0):
        """A request's time from its arrival to its first token."""
        self.ttft.labels(self._model, str(replica)).observe(seconds)

    def observe_token_gap(self, seconds, replica=0):
        """The time between two successive tokens of a request."""
        self.itl.labels(self._model, str(replica)).observe(seconds)
        self.tpot.labels(self._model, str(replica)).observe(seconds)

    def observe_request(self, arrival, first_token, finished, generated, finish_reason,
                        prompt_tokens=None, max_tokens=None, replica=0, scheduled=None):
        """Monotonic times of one request that finished with its client there (first_token
        None when it got none; scheduled: when the engine first scheduled it, None if
        unknown). As vLLM, every finished request is observed end to end, tokens or not."""
        labels = (self._model, str(replica))
        self.finished.labels(*labels, finish_reason or "abort").inc()
        self.e2e.labels(*labels).observe(finished - arrival)
        if prompt_tokens is not None:
            self.request_prompt_tokens.labels(*labels).observe(prompt_tokens)
        self.request_generation_tokens.labels(*labels).observe(generated)
        # each choice is an engine request of its own: its group's longest is itself
        self.max_generation_tokens.labels(*labels).observe(generated)
        if max_tokens:
            self.request_max_tokens.labels(*labels).observe(max_tokens)
        if first_token is None:
            return
        if generated > 1:
            self.request_tpot.labels(*labels).observe(
                (finished - first_token) / (generated - 1))
        if scheduled is not None:
            self.queue_time.labels(*labels).observe(max(0.0, scheduled - arrival))
            self.prefill_time.labels(*labels).observe(max(0.0, first_token - scheduled))
            self.decode_time.labels(*labels).observe(finished - first_token)
            self.inference_time.labels(*labels).observe(max(0.0, finished - scheduled))

    def observe_rejected(self, status):
        self.rejected.labels(self._model, str(status)).inc()


def _cache_info(engine_config, num_blocks):
    """vllm:cache_config_info's labels (what gateways read of the KV cache's geometry)."""
    return {"block_size": str(engine_config.limits.block_size),
            "num_gpu_blocks": str(num_blocks),
            "enable_prefix_caching": str(engine_config.enable_prefix_caching),
            "cache_dtype": "auto", "num_cpu_blocks": "0"}


class _EngineCollector:
    def __init__(self, metrics):
        self.metrics = metrics

    def collect(self):
        model = self.metrics._model
        per_replica = list(enumerate(self.metrics.stats))

        def family(kind, name, doc, value_of, label="engine"):
            f = kind(name, doc, labels=["model_name", label])
            for replica, stats in per_replica:
                f.add_metric([model, str(replica)], value_of(stats))
            return f

        yield family(GaugeMetricFamily, "vllm:num_requests_running",
                     "Number of requests in model execution batches.", lambda s: s.num_running)
        yield family(GaugeMetricFamily, "vllm:num_requests_waiting",
                     "Number of requests waiting to be processed.", lambda s: s.num_waiting)
        def usage(s):
            return s.num_blocks_used / s.num_blocks_total if s.num_blocks_total else 0.0
        yield family(GaugeMetricFamily, "vllm:kv_cache_usage_perc",
                     "KV-cache usage. 1 means 100 percent usage.", usage)
        # the name before vLLM 0.10 (its published dashboard, production-stack's router)
        yield family(GaugeMetricFamily, "vllm:gpu_cache_usage_perc",
                     "GPU KV-cache usage. 1 means 100 percent usage.", usage)
        yield family(CounterMetricFamily, "vllm:prompt_tokens",
                     "Number of prefill tokens processed.", lambda s: s.prompt_tokens_total)
        yield family(CounterMetricFamily, "vllm:generation_tokens",
                     "Number of generation tokens processed.",
                     lambda s: s.generation_tokens_total)
        yield family(CounterMetricFamily, "vllm:prefix_cache_queries",
                     "Prefix cache queries, in terms of number of queried tokens.",
                     lambda s: s.prefix_cache_queries)
        yield family(CounterMetricFamily, "vllm:prefix_cache_hits",
                     "Prefix cache hits, in terms of number of cached tokens.",
                     lambda s: s.prefix_cache_hits)
        yield from self._prompt_sources(family)
        if self.metrics.speculative is not None:
            yield from self._speculation(family)
        yield from self._info(model)
        yield family(CounterMetricFamily, "vllm:num_preemptions",
                     "Cumulative number of preemption from the engine.",
                     lambda s: s.num_preemptions)
        yield family(CounterMetricFamily, "msinfer_prefill_tokens_computed",
                     "Prompt tokens run through prefill (recomputed ones again after a "
                     "preemption)", lambda s: s.prefill_tokens_computed, label="replica")
        yield family(GaugeMetricFamily, "msinfer_kv_blocks_used", "KV cache blocks in use",
                     lambda s: s.num_blocks_used, label="replica")
        yield family(GaugeMetricFamily, "msinfer_kv_blocks_total", "KV cache blocks in the pool",
                     lambda s: s.num_blocks_total, label="replica")

    def _prompt_sources(self, family):
        """Prompt tokens by where their K/V came from (local_compute + local_cache_hit +
        external_kv_transfer = vllm:prompt_tokens), and the legacy prefix-cache names."""
        def computed(s):
            return max(0, s.prompt_tokens_total - s.prefix_cache_hits)
        f = CounterMetricFamily("vllm:prompt_tokens_by_source", "Number of prompt tokens by "
                                "source.", labels=["model_name", "engine", "source"])
        for replica, s in enumerate(self.metrics.stats):
            labels = [self.metrics._model, str(replica)]
            f.add_metric(labels + ["local_compute"], computed(s))
            f.add_metric(labels + ["local_cache_hit"], s.prefix_cache_hits)
            f.add_metric(labels + ["external_kv_transfer"], 0)
        yield f
        yield family(CounterMetricFamily, "vllm:prompt_tokens_cached",
                     "Number of cached prompt tokens (local + external).",
                     lambda s: s.prefix_cache_hits)
        yield family(CounterMetricFamily, "vllm:prompt_tokens_recomputed",
                     "Number of prompt tokens recomputed after a preemption.",
                     lambda s: max(0, s.prefill_tokens_computed - computed(s)))
        yield family(CounterMetricFamily, "vllm:gpu_prefix_cache_queries",
                     "GPU prefix cache queries, in terms of number of queried tokens.",
                     lambda s: s.prefix_cache_queries)
        yield family(CounterMetricFamily, "vllm:gpu_prefix_cache_hits",
                     "GPU prefix cache hits, in terms of number of cached tokens.",
                     lambda s: s.prefix_cache_hits)

    def _speculation(self, family):
        """vLLM's speculative decoding counters: drafts (sequence-steps that verified
        proposals), tokens proposed, tokens accepted, and accepted by proposal position
        (0..k-1, every position from the start, as vLLM's)."""
        yield family(CounterMetricFamily, "vllm:spec_decode_num_drafts",
                     "Number of spec decoding drafts.", lambda s: s.spec_num_drafts)
        yield family(CounterMetricFamily, "vllm:spec_decode_num_draft_tokens",
                     "Number of draft tokens.", lambda s: s.spec_num_draft_tokens)
        yield family(CounterMetricFamily, "vllm:spec_decode_num_accepted_tokens",
                     "Number of accepted tokens.", lambda s: s.spec_num_accepted_tokens)
        f = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                "Accepted tokens per draft position.",
                                labels=["model_name", "engine", "position"])
        k = self.metrics.speculative.num_speculative_tokens
        for replica, s in enumerate(self.metrics.stats):
            counts = list(s.spec_accepted_per_pos) + [0] * k
            for position in range(k):
                f.add_metric([self.metrics._model, str(replica), str(position)],
                             counts[position])
        yield f

    def _info(self, model):
        """vllm:cache_config_info, and vllm:lora_requests_info as the Gateway API Inference
        Extension reads it (no adapters: msinfer serves none; its value is the time, as
        vLLM's)."""
        info = self.metrics._cache_info
        f = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine "
                              "CacheConfig", labels=["engine", *info])
        for replica in range(len(self.metrics.stats)):
            f.add_metric([str(replica), *info.values()], 1)
        yield f
        f = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                              labels=["max_lora", "waiting_lora_adapters",
                                      "running_lora_adapters"])
        f.add_metric(["0", "", ""], time.time())
        yield f
