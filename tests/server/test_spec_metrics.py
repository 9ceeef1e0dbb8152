"""vLLM's speculative decoding counters on /metrics (vllm:spec_decode_*), read with
prometheus_client's own parser from a server over the fake engine: exposed only when
speculation is configured, every proposal position from the start, per data replica. And the
acceptance in the progress lines: the server's periodic stats line and LLM.generate's."""
import dataclasses
import logging
import types

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from msinfer import log
from msinfer.engine import EngineStats
from msinfer.server.metrics import ServerMetrics
from msinfer.server.stats_log import StatsLog
from msinfer.speculative_config import SpeculativeConfig

from test_serve_protocol import MODEL, RunningServer, raw, wait_for

K = 3
SPEC = SpeculativeConfig(method="ngram", num_speculative_tokens=K)
COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def families(text):
    return {f.name: f for f in text_string_to_metric_families(text)}


def spec_samples(text):
    """{(sample name, labels as sorted tuples): value} of the vllm:spec_decode_* series."""
    found = {}
    for name, family in families(text).items():
        if name.startswith("vllm:spec_decode"):
            assert family.type == "counter", name
            for sample in family.samples:
                found[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return found


def expected(max_tokens, requests):
    """The fake engine's rule (fake_engine.FakeEngine.count_draft), counted over again: each
    decode step after the first token drafts K tokens and accepts generated % (K + 1)."""
    accepted = [g % (K + 1) for g in range(1, max_tokens)] * requests
    return {"drafts": len(accepted), "draft_tokens": K * len(accepted),
            "accepted": sum(accepted),
            "per_pos": [sum(a > p for a in accepted) for p in range(K)]}


@pytest.fixture(scope="module")
def spec_server():
    s = RunningServer(speculative=SPEC)
    yield s
    s.stop()


def test_spec_counters_under_vllm_names_count_what_the_engine_counts(spec_server):
    labels = (("engine", "0"), ("model_name", MODEL))
    before = spec_samples(raw(spec_server, "/metrics", method="GET").text)
    assert before == {**{(f"{n}_total", labels): 0.0 for n in COUNTERS},
                      **{(f"{PER_POS}_total", labels + (("position", str(p)),)): 0.0
                         for p in range(K)}}
    for prompt in ("a", "b"):
        spec_server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=6)
    want = expected(6, 2)
    wait_for(lambda: spec_server.engine.stats().spec_num_drafts == want["drafts"]
             and spec_server.metrics.stats[0].spec_num_drafts == want["drafts"])
    after = spec_samples(raw(spec_server, "/metrics", method="GET").text)
    assert after[f"{COUNTERS[0]}_total", labels] == want["drafts"] == 10
    assert after[f"{COUNTERS[1]}_total", labels] == want["draft_tokens"] == 30
    assert after[f"{COUNTERS[2]}_total", labels] == want["accepted"] == 14
    per_pos = [after[f"{PER_POS}_total", labels + (("position", str(p)),)] for p in range(K)]
    assert per_pos == want["per_pos"] == [8, 4, 2]
    assert sum(per_pos) == want["accepted"]


def test_no_spec_series_without_speculation():
    s = RunningServer()
    try:
        s.client().completions.create(model=MODEL, prompt="a", max_tokens=3)
        text = raw(s, "/metrics", method="GET").text
    finally:
        s.stop()
    assert "vllm:generation_tokens_total" in text and "spec_decode" not in text


def served(speculative):
    """The EngineConfig of a served fake engine speculating with `speculative`."""
    from fake_engine import stub_engine_config
    from msinfer.engine_config import EngineLimits

    return stub_engine_config(EngineLimits(max_model_len=96), 300, speculative=speculative)


def test_each_data_replica_is_an_engine_as_vllm_labels_them():
    stats = EngineStats(0, 0, 8, 0, 0, 0, 0)
    metrics = ServerMetrics(MODEL, served(SPEC), stats, replicas=2)
    # replica 1's stats arrive over the link as JSON: its per-position counts as a list
    metrics.observe_step(1, 0.0, 0.01, EngineStats(1, 0, 8, 2, 0, 5, 7, spec_num_drafts=4,
                                                   spec_num_draft_tokens=12,
                                                   spec_num_accepted_tokens=5,
                                                   spec_accepted_per_pos=[3, 2]))
    found = spec_samples(generate_latest(metrics.registry).decode())
    one = (("engine", "1"), ("model_name", MODEL))
    assert found[f"{COUNTERS[0]}_total", one] == 4
    assert found[f"{COUNTERS[2]}_total", one] == 5
    assert [found[f"{PER_POS}_total", one + (("position", str(p)),)] for p in range(K)] == \
        [3, 2, 0]
    zero = (("engine", "0"), ("model_name", MODEL))
    assert found[f"{COUNTERS[1]}_total", zero] == 0


class Lines(logging.Handler):
    """msinfer's log lines, kept while installed on its logger."""

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def __enter__(self):
        log.get().addHandler(self)
        previous, log.get().level = log.get().level, logging.INFO
        self.previous = previous
        return self

    def __exit__(self, *exc):
        log.get().removeHandler(self)
        log.get().level = self.previous


def test_the_periodic_stats_line_says_acceptance_over_its_interval():
    """The replicas' stats summed, every interval in which something ran; the acceptance
    counted over the interval only (as vLLM's SpecDecodingLogging resets each time)."""
    clock = [100.0]
    start = EngineStats(0, 0, 8, 0, 0, 0, 0, spec_num_drafts=5, spec_num_draft_tokens=15,
                        spec_num_accepted_tokens=15, spec_accepted_per_pos=(5, 5, 5))
    one = EngineStats(2, 1, 8, 2, 0, 100, 50, spec_num_drafts=15, spec_num_draft_tokens=45,
                      spec_num_accepted_tokens=35, spec_accepted_per_pos=(14, 12, 9))
    two = EngineStats(1, 0, 8, 2, 0, 100, 50, spec_num_drafts=10, spec_num_draft_tokens=30,
                      spec_num_accepted_tokens=10, spec_accepted_per_pos=[6, 3, 1])
    for speculative, spec_words in ((SPEC, "; spec: acceptance 0.50, mean accepted 1.5/3 per "
                                           "draft (by position 0.75 0.50 0.25)"), (None, "")):
        zero = EngineStats(0, 0, 8, 0, 0, 0, 0)
        metrics = ServerMetrics(MODEL, served(speculative), zero, replicas=2)
        metrics.stats_log = StatsLog(speculative, interval=10, clock=lambda: clock[0])
        with Lines() as seen:
            metrics.observe_step(0, 0.0, 0.01, start)  # the interval starts here
            clock[0] += 5
            metrics.observe_step(0, 0.0, 0.01, one)  # within the interval: no line
            clock[0] += 5
            metrics.observe_step(1, 0.0, 0.01, two)
        assert seen.lines == [
            "serve: 20.0 prompt, 10.0 generation tokens/s; 3 running, 1 waiting; KV cache 25%"
            + spec_words]
        idle = dataclasses.replace(one, num_running=0, num_waiting=0)
        assert metrics.stats_log.line(idle, idle, 10.0) is None  # nothing ran, nothing waits


def test_generate_progress_says_acceptance(monkeypatch):
    """LLM.generate's progress line over the fake engine (its draft counts), the acceptance
    since the call began; without speculation the line is as before."""
    from msinfer.api import LLM
    from msinfer.engine.sampling import SamplingParams
    from fake_engine import FakeEngine

    for speculative in (SPEC, None):
        llm = LLM.__new__(LLM)  # the engine a fake, the rest of LLM as it is
        llm.engine = FakeEngine(step_delay=0, speculative=speculative)
        llm.engine_config = types.SimpleNamespace(speculative=speculative)
        llm.replicas, llm._batches = 1, 0
        with Lines() as seen:
            outputs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=6))
        assert [len(out.token_ids) for out in outputs] == [6, 6]
        last = seen.lines[-1]
        assert last.startswith("generating: 2/2, ")
        if speculative:  # 2 requests as the server test's: 10 drafts, 14 of 30 accepted
            assert last.endswith("(0 running, 0 waiting; spec: acceptance 0.47, mean accepted "
                                 "1.4/3 per draft (by position 0.80 0.40 0.20))")
        else:
            assert last.endswith("(0 running, 0 waiting)")
