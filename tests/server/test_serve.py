"""`msinfer serve` as a real process on a tiny checkpoint: one start, many checks through the
official openai client and raw HTTP; then the same server as a 4-rank tp4 job under mpirun,
whose completions must equal the single process's, and which must fail /health and exit
non-zero when one of its ranks stops; then as the dp2 x tp2 job on a Qwen3 checkpoint, whose
replicas share the requests, whose chat separates Qwen3's thinking (--reasoning-parser qwen3),
and which ends when a rank falls out of step."""
import json
import os
import re
import signal
import threading
import time

import httpx2 as httpx
import pytest

from faults import FAULT_SITE, PLANT_DIVERGENCE
from servers import MAX_LEN, NAME, ROOT, SERVE_ARGS, ServerProcess, dp2_tp2_job

pytestmark = pytest.mark.server

TP4 = os.path.join(ROOT, "strategies", "qwen2_tp4.yaml")
PROMPTS = ["The capital of France is", "Tensor parallelism splits each layer", "Hello",
           "one two three four five six seven"]


@pytest.fixture(scope="module")
def model_dir(serve_model):
    return serve_model


@pytest.fixture
def server(tiny_server):
    return tiny_server


def greedy(server, prompt, max_tokens=12):
    return server.client().completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens,
                                              temperature=0)


def scored(server, prompt, max_tokens):
    """lm-eval's loglikelihood request (echo, logprobs 1): (tokens, their logprobs)."""
    response = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": NAME, "prompt": prompt, "echo": True, "logprobs": 1, "temperature": 0,
        "max_tokens": max_tokens})
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    return logprobs["tokens"], logprobs["token_logprobs"]


def assert_scored_alike(ours, reference, tolerance=1e-4):
    assert ours[0] == reference[0] and ours[1][0] is None and reference[1][0] is None
    assert max(abs(a - b) for a, b in zip(ours[1][1:], reference[1][1:])) < tolerance


def test_health_says_how_far_warm_up_is_until_ready(server):
    progress = [s for s in server.not_ready_seen if s.startswith("not ready: warming up: ")]
    assert progress, server.not_ready_seen  # e.g. "compiling graphs: 3/4, 2.6s, ~1s left"
    assert re.search(r"(compiling|loading) graphs: \d+/\d+, [\d.]+s", progress[-1])


def test_completions_chat_and_streams_agree(server):
    out = greedy(server, PROMPTS[0])
    assert 1 <= out.usage.completion_tokens <= 12
    assert out.choices[0].finish_reason in ("length", "stop")
    assert greedy(server, PROMPTS[0]).choices[0].text == out.choices[0].text  # deterministic
    chunks = list(server.client().completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens

    messages = [{"role": "user", "content": "Hi there"}]
    chat = server.client().chat.completions.create(model=NAME, messages=messages,
                                                   max_tokens=10, temperature=0)
    streamed = list(server.client().chat.completions.create(
        model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == \
        chat.choices[0].message.content
    assert [m.id for m in server.client().models.list().data] == [NAME]


def test_concurrent_requests_get_what_they_get_alone(server):
    alone = {p: greedy(server, p).choices[0].text for p in PROMPTS}
    together = {}

    def ask(p):
        together[p] = greedy(server, p).choices[0].text
    threads = [threading.Thread(target=ask, args=(p,)) for p in PROMPTS * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert together == alone


def test_seeded_sampling_and_logprobs(server):
    def sample():
        return server.client().completions.create(model=NAME, prompt="seeded", max_tokens=8,
                                                  temperature=1.0, top_p=0.9, seed=7,
                                                  logprobs=2)
    first, second = sample(), sample()
    assert first.choices[0].text == second.choices[0].text
    lp = first.choices[0].logprobs
    assert len(lp.token_logprobs) == first.usage.completion_tokens
    assert all(x <= 0 for x in lp.token_logprobs) and all(len(t) == 2 for t in lp.top_logprobs)
    # n choices: choice j draws from seed + j, so it is what a request seeded so gets alone
    three = server.client().completions.create(model=NAME, prompt="seeded", max_tokens=8,
                                               temperature=1.0, top_p=0.9, seed=7, n=3)
    alone = [server.client().completions.create(model=NAME, prompt="seeded", max_tokens=8,
                                                temperature=1.0, top_p=0.9,
                                                seed=s).choices[0].text for s in (7, 8, 9)]
    assert [c.text for c in three.choices] == alone and len(set(alone)) > 1
    # what changes the scores reaches the real engine: a biased token is all a greedy
    # request gets, and penalties and min_p are taken
    forced = server.client().completions.create(
        model=NAME, prompt="seeded", max_tokens=4, temperature=0, logit_bias={"300": 100},
        extra_body={"min_tokens": 4, "repetition_penalty": 1.3, "min_p": 0.1})
    four = httpx.post(server.url + "/detokenize", json={"model": NAME, "tokens": [300] * 4})
    assert forced.choices[0].text == four.json()["prompt"]
    assert forced.usage.completion_tokens == 4


def test_issue_38_fixes_on_the_real_engine(server):
    """echo with max_tokens 0 and no logprobs echoes the prompt; a lone surrogate is a 400;
    chat logprobs' bytes are the tokens' own (joined, they decode to the answer); cache_salt
    keeps a prefix to requests of the same salt."""
    echoed = post(server, {"model": NAME, "prompt": "echo me", "echo": True, "max_tokens": 0})
    assert echoed.status_code == 200, echoed.text
    assert echoed.json()["choices"][0]["text"] == "echo me"
    assert echoed.json()["usage"]["completion_tokens"] == 0
    lone = post(server, '{"model": "tiny", "prompt": "a\\ud800", "max_tokens": 1}')
    assert lone.status_code == 400 and lone.json()["error"]["param"] == "prompt"
    chat = server.client().chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "bytes"}], max_tokens=16,
        temperature=1.0, seed=3, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    joined = bytes(b for entry in content for b in entry.bytes)
    assert joined.decode(errors="replace") == chat.choices[0].message.content
    prompt = list(range(5, 75))  # several full blocks

    def cached(salt):
        body = {"model": NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        if salt:
            body["cache_salt"] = salt
        response = post(server, body)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached("tenant-a") == 0 and cached("tenant-b") == 0
    assert cached("tenant-a") > 0


def post(server, body):
    return httpx.post(server.url + "/v1/completions", timeout=60,
                      content=body if isinstance(body, str) else json.dumps(body),
                      headers={"content-type": "application/json"})


@pytest.mark.parametrize("body, status, needle", [
    ('{"model": "tiny", "prompt": ', 400, "JSON"),
    ({"model": NAME, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "x", "max_tokens": 100000}, 400, str(MAX_LEN)),
    ({"model": NAME, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    # beyond the server's --max-num-seqs (4)
    ({"model": NAME, "prompt": "x", "best_of": 5}, 400, "best_of"),
    ({"model": NAME, "prompt": "x", "n": 5}, 400, "--max-num-seqs 4"),
    ({"model": NAME, "prompt": ""}, 400, "empty"),
    ({"model": NAME, "prompt": list(range(MAX_LEN + 5)), "max_tokens": 1}, 400, str(MAX_LEN)),
    ({"model": NAME, "prompt": [1, 10 ** 6]}, 400, str(10 ** 6)),
    ({"model": "gpt-4o", "prompt": "x"}, 404, "gpt-4o"),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, body, status,
                                                                     needle):
    response = post(server, body)
    assert response.status_code == status, response.text
    assert needle in response.json()["error"]["message"]
    assert "Traceback" not in response.text
    assert greedy(server, "still there", 2).usage.completion_tokens == 2


def test_a_client_leaving_mid_stream_frees_its_blocks(server):
    with httpx.Client(timeout=120) as c:
        with c.stream("POST", server.url + "/v1/completions", json={
                "model": NAME, "prompt": "a long one", "max_tokens": 100, "stream": True,
                "ignore_eos": True}) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: "):
                pass
    deadline = time.monotonic() + 30
    while server.metric("msinfer_kv_blocks_used") or server.metric(
            "vllm:num_requests_running"):
        assert time.monotonic() < deadline, "blocks still in use after the client left"
        time.sleep(0.2)
    assert server.metric("vllm:request_success_total") >= 1
    assert server.metric("msinfer_kv_blocks_total") > 0
    assert server.metric("vllm:generation_tokens_total") > 0
    assert server.metric("vllm:time_to_first_token_seconds_count") > 0


def wait_unhealthy(job, since, bound):
    """Poll /health until it fails; its body, within `bound` seconds of `since`."""
    while True:
        try:
            r = job.http.get("/health", timeout=5)
            if r.status_code != 200:
                return r.json()["status"]
        except httpx.HTTPError:
            return "unreachable"
        assert time.monotonic() - since < bound, f"/health still ok after {bound}s"
        time.sleep(0.1)


STALL = 5  # --stall-timeout of the sharded jobs below


@pytest.mark.multirank
def test_tp4_under_mpirun_serves_the_same_completions_and_a_stopped_rank_ends_it(
        server, model_dir, tmp_path):
    """One start of the 4-rank job, speculating with suffix decoding (its tree of the job's
    recent outputs proposes what the same prompt gave before: accepted, several tokens a
    step; no draft graphs to warm up): same greedy completions as tp1 (no speculation),
    whole and streamed (the tokens of a step stream as accepted), vLLM's
    spec_decode counters count; the hand-off cost is in /metrics; a rank that stops
    (SIGSTOP: alive, silent) fails /health within the stall timeout, its in-flight request
    gets an answer, and the job ends non-zero."""
    log = str(tmp_path / "tp4.log")
    suffix = json.dumps({"method": "suffix", "num_speculative_tokens": 4})
    # one sequence at a time (each request is sent alone): warm-up compiles the decode graphs
    # of batch 1 only, not of 2 and 4 as well, on each rank
    job = ServerProcess(["launch", "--nproc", "4", "--strategy", TP4, "--", "serve",
                         "--model", model_dir, *SERVE_ARGS, "--max-num-seqs", "1",
                         "--stall-timeout", str(STALL), "--speculative-config", suffix],
                        log, ready_timeout=900)
    try:
        for prompt in PROMPTS:
            assert greedy(job, prompt).choices[0].text == greedy(server, prompt).choices[0].text
        long = dict(model=NAME, prompt=PROMPTS[3], max_tokens=30, temperature=0,
                    extra_body={"ignore_eos": True})
        whole = server.client().completions.create(**long)
        # once whole, so that the suffix tree holds all 30 tokens; then streamed
        assert job.client().completions.create(**long).choices[0].text == whole.choices[0].text
        chunks = list(job.client().completions.create(**long, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == \
            whole.choices[0].text and whole.usage.completion_tokens == 30
        accepted = job.metric("vllm:spec_decode_num_accepted_tokens_total")
        assert 0 < accepted <= job.metric("vllm:spec_decode_num_draft_tokens_total")
        assert len(chunks) < 20  # several accepted tokens in one chunk
        chat = [{"role": "user", "content": "Hi there"}]
        assert (job.client().chat.completions.create(model=NAME, messages=chat, max_tokens=8,
                                                     temperature=0).choices[0].message.content
                == server.client().chat.completions.create(
                    model=NAME, messages=chat, max_tokens=8,
                    temperature=0).choices[0].message.content)
        # prompt logprobs take the sampled tokens' path: the leader scores, the others keep
        # pace (and a request that only scores, max_tokens 0, ends on every rank)
        for max_tokens in (1, 0):
            assert_scored_alike(scored(job, PROMPTS[1], max_tokens),
                                scored(server, PROMPTS[1], max_tokens))
        steps = job.metric("msinfer_handoff_seconds_count")
        assert steps > 0 and job.metric("msinfer_handoff_seconds_sum") / steps < 0.01

        pid = int(re.search(r"rank 2 is process (\d+)", job.output()).group(1))
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        answered = []
        asker = threading.Thread(target=lambda: answered.append(httpx.post(
            job.url + "/v1/completions", json={"model": NAME, "prompt": "still there?",
                                               "max_tokens": 40}, timeout=120)))
        asker.start()
        status = wait_unhealthy(job, stopped, STALL + 5)
        # the silent rank named (its heartbeats stopped), or the step its group waits for
        # (whichever bound a loaded machine reaches first)
        assert ("rank 2" in status or "has not completed in" in status
                or status == "unreachable"), status
        asker.join(60)
        assert answered and answered[0].status_code in (500, 503), answered
        assert job.process.wait(timeout=60) != 0
        assert time.monotonic() - stopped < STALL + 30
        assert "rank 2 has said nothing" in job.output() or "step" in job.output()
    finally:
        job.kill()


@pytest.mark.multirank
def test_dp2_tp2_replicas_share_the_requests_and_a_diverging_rank_ends_the_job(
        qwen3_serve_model, tmp_path):
    """The deploy guide's dp2 x tp2 job, one start, serving Qwen3 with --reasoning-parser
    qwen3 and speculating with n-grams: 32 requests sharing a prefix give offline
    generation's completions (without the prefix cache, nor speculation); both replicas served (the counts add up to 32) and every prompt token was
    computed once or taken from a replica's cache; chat with thinking on and off, whole and
    streamed, through the openai client (check_qwen3_chat); then rank 3 (replica 1's follower)
    is made to drop a request: every rank names it and its step, /health fails, the job ends
    non-zero."""
    from msinfer import LLM, SamplingParams

    model_dir = qwen3_serve_model
    trigger = tmp_path / "diverge"
    env = {PLANT_DIVERGENCE: f"3:{trigger}",  # tests/faults.py, in every rank
           "PYTHONPATH": os.pathsep.join([ROOT, FAULT_SITE])}
    job = dp2_tp2_job(model_dir, str(tmp_path / "dp2tp2.log"), STALL, env=env)
    try:
        # n=2 unseeded, the job's first request: one choice on each replica, each replica's
        # first arrival; replicas keyed alike drew the same stream: identical choices
        pair = job.client().completions.create(model=NAME, prompt="hi", n=2, max_tokens=12,
                                               temperature=1.0, logprobs=1,
                                               extra_body={"ignore_eos": True})
        assert pair.choices[0].logprobs.tokens != pair.choices[1].logprobs.tokens
        # a shared "system prompt", so that the replicas' prefix caches serve it
        system = "Answer in one short sentence, kindly, and only about the question. "
        prompts = [f"{system}{PROMPTS[i % 4]} {i}" for i in range(32)]
        got = {}

        def ask(i):
            out = job.client().completions.create(model=NAME, prompt=prompts[i],
                                                  max_tokens=10, temperature=0)
            got[i] = (out.choices[0].text, out.choices[0].finish_reason,
                      out.usage.prompt_tokens, out.usage.prompt_tokens_details.cached_tokens)
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        llm = LLM(model_dir, max_len=MAX_LEN, max_num_seqs=4, max_prefill_tokens=32,
                  hardware="cpu", enable_prefix_caching=False)
        offline = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0))
        assert [got[i][:2] for i in range(32)] == [(o.text, o.finish_reason) for o in offline]
        assert job.metric("vllm:spec_decode_num_drafts_total") > 0  # proposals verified
        served = [job.metric("vllm:request_success_total", f'engine="{r}"') for r in (0, 1)]
        assert min(served) > 0 and sum(served) == 32 + 2, served  # and the pair's two
        prompt_tokens = sum(g[2] for g in got.values())
        cached = sum(g[3] for g in got.values())
        assert cached > 0 and job.metric("vllm:prefix_cache_hits_total") == cached
        # each prompt token computed once, on one replica, or taken from its cache
        # (and the pair's prompt, shorter than a block, computed on both replicas)
        paired = 2 * pair.usage.prompt_tokens
        # (a prompt's last token left to a decode step by its chunks counts too: once it did
        # not, and this came out one token short)
        assert job.metric("msinfer_prefill_tokens_computed_total") == (
            prompt_tokens - cached + paired), \
            f"preemptions: {job.metric('vllm:num_preemptions_total')}"
        assert job.metric("vllm:prompt_tokens_total") == prompt_tokens + paired
        check_qwen3_chat(job, llm, model_dir)
        # prompt logprobs come back from either replica (replicas.py carries them)
        for i in range(4):
            tokens, values = scored(job, prompts[i], 0)
            reference = llm.generate([prompts[i]], SamplingParams(
                max_tokens=0, prompt_logprobs=0))[0].prompt_logprobs
            assert len(values) == len(reference) and values[0] is None
            assert max(abs(v - next(iter(r.values())))
                       for v, r in zip(values[1:], reference[1:])) < 1e-4

        trigger.touch()
        started = time.monotonic()
        answered = []
        threads = [threading.Thread(target=lambda: answered.append(httpx.post(
            job.url + "/v1/completions", json={"model": NAME, "prompt": "split brain",
                                               "max_tokens": 40, "ignore_eos": True},
            timeout=120).status_code)) for _ in range(4)]
        for t in threads:
            t.start()
        status = wait_unhealthy(job, started, 20)
        assert "rank 3 diverged" in status or status == "unreachable", status
        for t in threads:
            t.join(60)
        assert len(answered) == 4 and all(code in (200, 500, 503) for code in answered)
        assert job.process.wait(timeout=60) != 0
        said = job.output()
        step = re.search(r"rank 3 diverged from its leader, rank 2, at step (\d+)", said)
        assert step, said[-3000:]
        for rank in range(4):  # every rank says which rank and step
            assert re.search(rf"\[msinfer rank {rank}/4 [^]]*\] .*rank 3 diverged from its "
                             rf"leader, rank 2, at step {step.group(1)}", said), rank
    finally:
        job.kill()


# The random model thinks when pushed: with these biases on <think> and </think> its greedy
# answer to CHAT opens <think> as its second token and closes it at its ninth, then goes on
# (measured: <think> 7 or less opens it later or never, 9 or more repeats it; </think> 4 to 5
# closes it at the ninth).
THINK_BIAS = {"<think>": 8.0, "</think>": 4.5}
CHAT = [{"role": "user", "content": "Why is the sky blue?"}]


def check_qwen3_chat(job, llm, model_dir):
    """A Qwen3 chat through the openai client, thinking on and off, whole and streamed: the
    prompt is transformers' rendering of Qwen3's template, the answer offline generation's
    greedy one, split at its think tags into reasoning_content and content (all content when
    thinking is off: the template closed an empty think block in the prompt)."""
    import transformers

    from msinfer import SamplingParams

    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    bias = {hf.convert_tokens_to_ids(tag): value for tag, value in THINK_BIAS.items()}
    client = job.client()
    for thinking in (True, False):
        kwargs = {"enable_thinking": thinking}
        prompt = hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True,
                                        **kwargs)
        expected = llm.generate([prompt], SamplingParams(
            max_tokens=16, temperature=0, logit_bias=bias if thinking else None))[0].text
        ask = dict(model=NAME, messages=CHAT, max_tokens=16, temperature=0,
                   logit_bias={str(k): v for k, v in bias.items()} if thinking else None,
                   extra_body={"chat_template_kwargs": kwargs})
        whole = client.chat.completions.create(**ask)
        assert whole.usage.prompt_tokens == len(hf(prompt, add_special_tokens=False)[
            "input_ids"])
        if thinking:
            # the reasoning is what <think> opens, the content what is around it
            before, opened, rest = expected.partition("<think>")
            reasoning, closed, after = rest.partition("</think>")
            assert opened and closed and reasoning, expected  # the biases still make it think
            content = before + after
            assert prompt.endswith("<|im_start|>assistant\n")
        else:
            assert "</think>" not in expected, expected
            assert prompt.endswith("<think>\n\n</think>\n\n")
            reasoning, content = None, expected
        message = whole.choices[0].message
        assert (message.reasoning_content, message.content) == (reasoning, content)
        streamed = {"reasoning": "", "content": ""}
        for chunk in client.chat.completions.create(**ask, stream=True):
            delta = chunk.choices[0].delta if chunk.choices else None
            if delta is not None:
                streamed["reasoning"] += getattr(delta, "reasoning_content", None) or ""
                streamed["content"] += delta.content or ""
        assert (streamed["reasoning"] or None, streamed["content"]) == (reasoning, content)


def test_sigterm_refuses_new_work_finishes_in_flight_and_exits_0(server):
    """Last in this file: it stops the session's shared server (its in-flight stream has the
    60 s of --shutdown-timeout to finish); a later test that asks for it gets a new one."""
    s = server
    try:
        with httpx.Client(timeout=120) as c:
            with c.stream("POST", s.url + "/v1/completions", json={
                    "model": NAME, "prompt": "last words", "max_tokens": 60, "stream": True,
                    "ignore_eos": True}) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                s.process.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 10
                while (health := c.get(s.url + "/health")).status_code == 200:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                assert health.json()["status"] == \
                    "not ready: shutting down: draining in-flight requests"
                refused = c.post(s.url + "/v1/completions", json={"model": NAME, "prompt": "x"})
                assert refused.status_code == 503
                events = [json.loads(line[6:]) for line in lines
                          if line.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert s.process.wait(timeout=60) == 0
    finally:
        s.kill()
