"""The HTTP side of `msinfer serve` over a fake engine (tests/fake_engine.py): the OpenAI
protocol, streaming, errors, back-pressure, disconnects and metrics, in seconds.

The same routes over the real engine, as a `msinfer serve` process: tests/server/test_serve.py."""
import asyncio
import json
import socket
import threading
import time

import httpx2 as httpx
import openai
import pytest
import uvicorn

from msinfer.server.app import build_app
from msinfer.server.handoff import Leader
from msinfer.server.lockstep import EngineLoop
from msinfer.server.metrics import ServerMetrics
from msinfer.server.server_config import DEFAULT_MAX_REQUEST_BYTES, ServerConfig

from fake_engine import expected_ids, fake_llm

pytestmark = pytest.mark.waits  # it mostly waits: the third xdist worker runs it (conftest.py)

MODEL = "fake-model"


class RunningServer:
    def __init__(self, api_key=None, max_queue=64, max_request_bytes=None, llm=None,
                 reasoning_parser=None, front=None, **engine_options):
        """llm: an LLM (or what has its engine and tokenizer) to serve; default the fake.
        front: makes what the app talks to of the engine loop (a replicas.Router over it)."""
        self.llm = llm or fake_llm(**engine_options)
        self.engine = self.llm.engine
        self.metrics = ServerMetrics(MODEL, self.llm.engine_config, self.engine.stats())
        self.loop = EngineLoop(self.engine, Leader([]), self.metrics.observer(0))
        config = ServerConfig(model_names=[MODEL], api_key=api_key, max_queue=max_queue,
                              max_request_bytes=max_request_bytes or DEFAULT_MAX_REQUEST_BYTES,
                              reasoning_parser=reasoning_parser)
        self.front = front(self.loop) if front else self.loop
        app = build_app(self.front, self.llm.tokenizer, config, self.llm.engine_config,
                        self.metrics)
        listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.threads = [threading.Thread(target=self.server.run, args=([listener],), daemon=True),
                        threading.Thread(target=self.loop.run, daemon=True)]
        self.loop.open()
        for t in self.threads:
            t.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"),
                             max_retries=0, **kw)

    def stop(self):
        self.loop.drain(0)
        self.server.should_exit = True
        for t in self.threads:
            t.join(timeout=10)


@pytest.fixture(scope="module")
def server():
    s = RunningServer(num_blocks=10, block_size=8)  # a pool of 80 tokens, contexts of 96
    yield s
    s.stop()


def expected_text(prompt, count):
    return bytes(expected_ids(list(prompt.encode()), count)).decode(errors="replace")


def test_completion_returns_the_engine_text_and_usage(server):
    out = server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=7)
    assert out.choices[0].text == expected_text("Hi", 7)
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (2, 7)
    assert out.model == MODEL and out.object == "text_completion"


def test_streamed_text_equals_the_whole_text_without_broken_characters(server):
    # 40 bytes of the fake's text cross several 2- and 3-byte characters
    for prompt in ("a", "bc", "xyz!"):
        whole = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=40)
        chunks = list(server.client().completions.create(
            model=MODEL, prompt=prompt, max_tokens=40, stream=True,
            stream_options={"include_usage": True}))
        texts = [c.choices[0].text for c in chunks if c.choices]
        assert "".join(texts) == whole.choices[0].text
        assert not any("\ufffd" in t for t in texts)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40


def test_token_id_prompts_and_a_batch_of_prompts(server):
    out = server.client().completions.create(model=MODEL, prompt=[[72, 105], [1, 2, 3]],
                                             max_tokens=5)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == expected_text("Hi", 5)
    assert out.choices[1].text == bytes(expected_ids([1, 2, 3], 5)).decode(errors="replace")
    assert out.usage.prompt_tokens == 5


def test_chat_uses_the_template_and_streams_a_role_first(server):
    messages = [{"role": "user", "content": "Hello"}]
    templated = "<user>Hello\n<assistant>"
    out = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=9)
    assert out.choices[0].message.content == expected_text(templated, 9)
    assert out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(templated.encode())
    chunks = list(server.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=9, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        out.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_without_max_tokens_may_fill_the_context():
    # a KV pool that holds a whole context, as the planner sizes a real engine's (the module's
    # server, with a smaller one, refuses prompt + max_tokens beyond its pool, as the engine)
    server = RunningServer()
    try:
        out = server.client().chat.completions.create(model=MODEL, messages=[
            {"role": "user", "content": "x"}])
        prompt = len("<user>x\n<assistant>")
        assert out.usage.completion_tokens == server.engine.max_model_len - prompt
    finally:
        server.stop()


def test_stop_strings_cut_the_text_and_never_leak_while_streaming(server):
    whole = expected_text("a", 40)
    stop = whole[10:13]
    out = server.client().completions.create(model=MODEL, prompt="a", max_tokens=40, stop=stop)
    assert out.choices[0].text == whole[:10] and out.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in server.client().completions.create(
        model=MODEL, prompt="a", max_tokens=40, stop=[stop], stream=True))
    assert streamed == whole[:10]


def test_stop_token_ids_end_a_request(server):
    ids = expected_ids([97], 10)
    out = server.client().completions.create(model=MODEL, prompt="a", max_tokens=10,
                                             extra_body={"stop_token_ids": [ids[4]]})
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 5


def test_models_lists_the_served_name(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]


def raw(server, path, body=None, headers=None, method="POST"):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        if method == "GET":
            return c.get(path, headers=headers)
        content = body if isinstance(body, (str, bytes)) else json.dumps(body)
        return c.post(path, content=content,
                      headers={"content-type": "application/json", **(headers or {})})


@pytest.mark.parametrize("body, status, needle", [
    ('{"model": "fake-model", "prompt": "hi"', 400, "not valid JSON"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "temperature": [1]}, 400, "temperature"),
    ({"model": MODEL, "prompt": "hi", "presence_penalty": 5}, 400, "presence_penalty"),
    ({"model": MODEL, "prompt": "hi", "repetition_penalty": -1}, 400, "repetition_penalty"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"100000": 1}}, 400, "outside the vocab"),
    ({"model": MODEL, "prompt": "hi", "best_of": 2, "n": 3}, 400, "best_of"),
    ({"model": MODEL, "prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ({"model": MODEL, "prompt": "hi", "prompt_logprobs": 99}, 400, "prompt_logprobs"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 10 ** 9}, 400, "maximum context length"),
    ({"model": MODEL, "prompt": ""}, 400, "empty"),
    ({"model": MODEL, "prompt": [[]]}, 400, "empty"),
    ({"model": MODEL, "prompt": [5, 100000]}, 400, "100000"),
    ({"model": MODEL, "prompt": "x" * 85, "max_tokens": 1}, 400, "KV cache"),
    ({"model": MODEL, "prompt": "x" * 200, "max_tokens": 1}, 400, "maximum context length"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "gpt-4"),
    ({"model": MODEL, "prompt": "hi", "n": 99}, 400, "n"),
    ({"model": MODEL, "prompt": "hi", "echo": 3}, 400, "echo"),
    ({"model": MODEL}, 400, "prompt"),
    ([1, 2], 400, "body"),
])
def test_bad_completion_requests_get_an_openai_error_and_the_server_keeps_serving(
        server, body, status, needle):
    response = raw(server, "/v1/completions", body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert needle in error["message"] and error["type"]
    assert "Traceback" not in response.text
    ok = raw(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


@pytest.mark.parametrize("body, needle", [
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{}]}, "tools"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 2}, "alternate"),
])
def test_bad_chat_requests_get_400(server, body, needle):
    response = raw(server, "/v1/chat/completions", body)
    assert response.status_code == 400 and needle in response.json()["error"]["message"]


def test_the_openai_client_sees_errors_as_its_exceptions(server):
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        server.client().completions.create(model=MODEL, prompt="x", max_tokens=500)


def test_logprobs_for_completions_and_chat(server):
    out = server.client().completions.create(model=MODEL, prompt="a", max_tokens=3, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == [-0.25] * 3 and len(lp.top_logprobs) == 3
    assert all(len(top) == 2 for top in lp.top_logprobs)
    chat = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=3, logprobs=True,
        top_logprobs=1)
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == [-0.25] * 3
    assert all(len(c.top_logprobs) == 1 for c in content)


def metric(server, name):
    text = raw(server, "/metrics", method="GET").text
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_metrics_count_tokens_and_latencies(server):
    before = metric(server, "vllm:generation_tokens_total")
    gaps = metric(server, "vllm:inter_token_latency_seconds_count")
    server.client().completions.create(model=MODEL, prompt="m", max_tokens=6)
    assert metric(server, "vllm:generation_tokens_total") == before + 6
    assert metric(server, "vllm:inter_token_latency_seconds_count") == gaps + 5
    assert metric(server, "vllm:time_to_first_token_seconds_count") >= 1
    assert metric(server, "msinfer_kv_blocks_total") == server.engine.num_blocks
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "msinfer_kv_blocks_used",
                 "vllm:prompt_tokens_total", "vllm:num_preemptions_total",
                 "vllm:e2e_request_latency_seconds_count",
                 "vllm:time_per_output_token_seconds_count",
                 "vllm:request_time_per_output_token_seconds_count",
                 "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_count",
                 "vllm:request_params_max_tokens_count", "vllm:iteration_tokens_total_count",
                 "vllm:request_success_total", "msinfer_handoff_seconds_count",
                 "msinfer_engine_step_seconds_count"):
        metric(server, name)


def wait_for(predicate, timeout=10):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_client_that_leaves_mid_stream_aborts_its_request_and_frees_blocks():
    s = RunningServer(step_delay=0.05)
    try:
        with httpx.Client(base_url=s.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json={
                    "model": MODEL, "prompt": "leave", "max_tokens": 80, "stream": True}) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                assert metric(s, "msinfer_kv_blocks_used") > 0
        wait_for(lambda: len(s.engine.aborted_ids) == 1)
        wait_for(lambda: metric(s, "msinfer_kv_blocks_used") == 0)
        assert metric(s, "vllm:num_requests_running") == 0
    finally:
        s.stop()


def test_a_non_streaming_client_that_leaves_aborts_too():
    s = RunningServer(step_delay=0.05)
    try:
        with pytest.raises(httpx.ReadTimeout):
            with httpx.Client(base_url=s.url, timeout=0.5) as c:
                c.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                                "max_tokens": 80})
        wait_for(lambda: len(s.engine.aborted_ids) == 1)
    finally:
        s.stop()


def finished_series(server):
    """/metrics as Prometheus reads it (prometheus_client's parser): request_success_total
    by finished_reason, and the sample counts of the per-request series, replica 0's."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=10).text
    values = {(s.name, s.labels.get("finished_reason")): s.value
              for family in text_string_to_metric_families(text) for s in family.samples
              if s.labels.get("engine") == "0"}
    reasons = {reason: v for (name, reason), v in values.items()
               if name == "vllm:request_success_total"}
    counts = {name[len("vllm:"):-len("_count")]: v for (name, _), v in values.items()
              if name.endswith("_count") and name.startswith("vllm:")}
    return reasons, counts


def test_aborted_requests_count_as_vllm_counts_them():
    """vLLM's vllm:request_success_total has a sample for every finish reason from the start;
    a request whose client left is counted by no finished-request series (AsyncLLM.abort ->
    OutputProcessor.abort_requests records no stats), though its first token was timed as
    it came; one the server aborts while its client waits (the drain's deadline) counts as
    "abort", observed end to end and by its tokens as any finished request."""
    s = RunningServer(step_delay=0.05)
    try:
        reasons, counts = finished_series(s)
        assert reasons == {"stop": 0, "length": 0, "abort": 0, "error": 0, "repetition": 0}
        assert counts.get("e2e_request_latency_seconds", 0) == 0
        body = {"model": MODEL, "prompt": "leave", "max_tokens": 80, "stream": True}
        with httpx.Client(base_url=s.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
        wait_for(lambda: len(s.engine.aborted_ids) == 1)
        wait_for(lambda: not s.engine.running)
        reasons, counts = finished_series(s)
        assert sum(reasons.values()) == 0
        assert counts["time_to_first_token_seconds"] == 1
        for name in ("e2e_request_latency_seconds", "request_generation_tokens",
                     "request_prompt_tokens", "request_params_max_tokens",
                     "request_decode_time_seconds"):
            assert counts.get(name, 0) == 0, name
        with httpx.Client(base_url=s.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                s.loop.drain(0)  # the deadline passed: what runs is aborted
                events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "abort"
        reasons, counts = finished_series(s)
        assert reasons == {"stop": 0, "length": 0, "abort": 1, "error": 0, "repetition": 0}
        assert counts["time_to_first_token_seconds"] == 2
        for name in ("e2e_request_latency_seconds", "request_generation_tokens",
                     "request_prompt_tokens", "request_params_max_tokens"):
            assert counts[name] == 1, name
    finally:
        s.stop()


def test_more_waiting_than_max_queue_gets_503_with_retry_after():
    s = RunningServer(max_queue=2, max_num_seqs=1, step_delay=0.05)

    async def fire():
        async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
            return await asyncio.gather(*[c.post("/v1/completions", json={
                "model": MODEL, "prompt": f"q{i}", "max_tokens": 4}) for i in range(8)])
    try:
        responses = asyncio.run(fire())
        codes = sorted(r.status_code for r in responses)
        assert 200 in codes and 503 in codes, codes
        busy = next(r for r in responses if r.status_code == 503)
        assert busy.headers["retry-after"] and "max-queue" in busy.json()["error"]["message"]
    finally:
        s.stop()


def test_api_key_is_required_when_set():
    s = RunningServer(api_key="sekret")
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").completions.create(model=MODEL, prompt="x")
        assert raw(s, "/v1/models", method="GET").status_code == 401
        out = s.client(api_key="sekret").completions.create(model=MODEL, prompt="x",
                                                            max_tokens=2)
        assert out.usage.completion_tokens == 2
        assert raw(s, "/health", method="GET").status_code == 200  # probes need no key
    finally:
        s.stop()


def test_draining_refuses_new_requests_and_finishes_in_flight_ones():
    s = RunningServer(step_delay=0.05)
    try:
        with httpx.Client(base_url=s.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json={
                    "model": MODEL, "prompt": "d", "max_tokens": 30, "stream": True}) as r:
                lines = r.iter_lines()
                next(lines)
                s.loop.drain(timeout=30)
                assert c.get("/health").status_code == 503
                refused = c.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
                assert refused.status_code == 503
                rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        s.threads[1].join(timeout=10)
        assert not s.threads[1].is_alive()  # the loop returned once drained
    finally:
        s.stop()


def test_a_drain_deadline_aborts_what_is_still_running():
    s = RunningServer(step_delay=0.05)
    try:
        with httpx.Client(base_url=s.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json={
                    "model": MODEL, "prompt": "d", "max_tokens": 80, "stream": True}) as r:
                lines = r.iter_lines()
                next(lines)
                s.loop.drain(timeout=0.2)
                rest = [line for line in lines if line]
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "abort"
        s.threads[1].join(timeout=10)
        assert not s.threads[1].is_alive()
    finally:
        s.stop()


