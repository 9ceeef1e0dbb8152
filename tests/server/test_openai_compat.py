"""What clients written for vLLM and OpenAI send and read, over the fake engine
(tests/fake_engine.py), in seconds: unknown fields ignored with a warning, the neutral values
of fields msinfer does not do yet, chat's content parts and usage chunks, the tokenizer
endpoints, /version and /v1/models, and every response's `object`."""
import json
import logging

import openai
import pytest

from msinfer.server.serving import IGNORED_FIELDS_HEADER

from fake_engine import expected_ids
from test_serve_protocol import MODEL, RunningServer, expected_text, raw

pytestmark = pytest.mark.waits  # it mostly waits: the third xdist worker runs it (conftest.py)


@pytest.fixture(scope="module")
def server():
    s = RunningServer()
    yield s
    s.stop()


def sse_events(response):
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_unknown_fields_are_ignored_and_named_in_a_header_and_the_log(server, caplog):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "frobnicate": 1,
            "chat_template_kwargs": {"x": 1}}
    with caplog.at_level(logging.WARNING):
        response = raw(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected_text("Hi", 3)
    assert response.headers[IGNORED_FIELDS_HEADER] == "frobnicate,chat_template_kwargs"
    assert "present in the request but ignored: frobnicate, " not in caplog.text
    assert "present in the request but ignored: frobnicate,chat_template_kwargs" in caplog.text


def test_a_request_without_unknown_fields_has_no_header(server):
    response = raw(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert response.status_code == 200 and IGNORED_FIELDS_HEADER not in response.headers


def test_unknown_fields_of_a_stream_and_of_messages_are_named_too(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x", "weird": 1}],
            "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True,
                                                                "shiny": True}}
    response = raw(server, "/v1/chat/completions", body)
    assert response.status_code == 200
    assert response.headers[IGNORED_FIELDS_HEADER] == "stream_options.shiny,messages.0.weird"


def test_a_field_name_that_is_not_printable_ascii_is_escaped():
    from msinfer.server.serving import ignored_fields_headers
    header = ignored_fields_headers(["a\r\nb", "ü"])[IGNORED_FIELDS_HEADER]
    assert header == "a\\r\\nb,\\xfc"


def test_a_field_named_with_spaces_at_its_ends_is_named_in_a_valid_header(server):
    """Found by tests/server/test_serve_fuzz.py: an unknown field " " made the header value " ",
    which HTTP forbids (no leading or trailing whitespace): the response failed."""
    response = raw(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1,
                                               " ": 1, " pad ": 2})
    assert response.status_code == 200, response.text
    assert response.headers[IGNORED_FIELDS_HEADER] == "\\x20,\\x20pad\\x20"


@pytest.mark.parametrize("extra", [
    {"stop": None}, {"n": 1}, {"n": None}, {"best_of": 1}, {"echo": False}, {"echo": None},
    {"logprobs": None}, {"temperature": None}, {"top_p": None}, {"seed": None},
    {"repetition_penalty": 1.0}, {"presence_penalty": 0}, {"frequency_penalty": 0.0},
    {"min_tokens": 0}, {"min_p": 0}, {"logit_bias": {}}, {"logit_bias": None},
    {"suffix": None}, {"parallel_tool_calls": True}, {"tools": []}, {"tool_choice": "none"},
    {"response_format": {"type": "text"}}, {"include_stop_str_in_output": False},
    {"skip_special_tokens": True}, {"ignore_eos": None}, {"stop_token_ids": None},
    {"user": "me"},
])
def test_neutral_values_of_fields_msinfer_does_not_do_yet_are_accepted(server, extra):
    response = raw(server, "/v1/completions",
                   {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **extra})
    assert response.status_code == 200, response.text
    assert IGNORED_FIELDS_HEADER not in response.headers
    assert response.json()["choices"][0]["text"] == expected_text("Hi", 2)


@pytest.mark.parametrize("extra, field", [
    ({"n": 17}, "n"), ({"n": 0}, "n"), ({"suffix": "end"}, "suffix"),
    ({"n": 5}, "n"),  # beyond the server's --max-num-seqs (4)
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # as vLLM
    ({"best_of": 2, "n": 3}, "best_of"), ({"best_of": 5}, "best_of"), ({"best_of": 0}, "best_of"),
    ({"best_of": 2, "stream": True}, "best_of"),
    ({"max_tokens": 0}, "max_tokens"),  # only with echo or prompt_logprobs
    ({"max_tokens": -1}, "max_tokens"), ({"echo": "yes please"}, "echo"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ({"skip_special_tokens": False}, "skip_special_tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ({"repetition_penalty": 0}, "repetition_penalty"),  # out of range
    ({"min_p": 2}, "min_p"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"min_tokens": 20, "max_tokens": 5}, "min_tokens"),  # more than max_tokens
    ({"logit_bias": {"5": 200}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"temperature": "hot"}, "temperature"),  # known fields keep their types
])
def test_fields_msinfer_does_not_do_get_a_400_naming_them(server, extra, field):
    response = raw(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"]


def test_guidellm_requests_work(server):
    """guidellm's streamed chat and completions requests: stop null, continuous usage."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    chat = raw(server, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": [{"type": "text",
                                                                   "text": "Hello"}]}],
        "max_tokens": 5, "stop": None, "ignore_eos": True, "stream": True,
        "stream_options": options})
    assert chat.status_code == 200 and IGNORED_FIELDS_HEADER not in chat.headers
    events = sse_events(chat)
    prompt = len("<user>Hello\n<assistant>")
    # every chunk carries the usage so far; the last has no choices and the whole usage
    assert all(e["usage"]["prompt_tokens"] == prompt for e in events)
    assert [e["usage"]["completion_tokens"] for e in events] == [0, 1, 2, 3, 4, 5, 5]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == prompt + 5
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    completion = raw(server, "/v1/completions", {
        "model": MODEL, "prompt": "Hello", "max_tokens": 4, "stop": None, "stream": True,
        "stream_options": options})
    events = sse_events(completion)
    assert [e["usage"]["completion_tokens"] for e in events] == [1, 2, 3, 4, 4]
    assert all(e["object"] == "text_completion" for e in events)


def test_without_continuous_usage_only_the_last_chunk_has_usage(server):
    response = raw(server, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
        "stream": True, "stream_options": {"include_usage": True}})
    events = sse_events(response)
    assert [e["usage"] is not None for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1]["choices"] == []


def test_vllm_bench_serve_chat_request_with_the_sdk(server):
    """`vllm bench serve --backend openai-chat`: content parts, max_completion_tokens, usage
    from the chunk without choices."""
    chunks = list(server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "He"},
                                                            {"type": "text", "text": "llo"}]}],
        max_completion_tokens=6, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_text("<user>Hello\n<assistant>", 6)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_vllm_bench_serve_completions_request(server):
    response = raw(server, "/v1/completions", {
        "model": MODEL, "prompt": "Hi", "repetition_penalty": 1.0, "max_tokens": 3,
        "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
        "ignore_eos": True})
    events = sse_events(response)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3


def test_tokenize_a_prompt_and_chat_messages_as_vllm(server):
    out = raw(server, "/tokenize", {"prompt": "Hé", "add_special_tokens": False}).json()
    assert out == {"count": 3, "max_model_len": server.engine.max_model_len,
                   "tokens": list("Hé".encode()), "token_strs": None}
    chat = raw(server, "/tokenize", {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "x"}]}]}).json()
    assert chat["tokens"] == list(b"<user>x\n<assistant>")
    bare = raw(server, "/tokenize", {"messages": [{"role": "user", "content": "x"}],
                                     "add_generation_prompt": False}).json()
    assert bare["tokens"] == list(b"<user>x\n")
    # the ids /tokenize gives are the ids the completions count
    usage = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1).usage
    assert usage.prompt_tokens == chat["count"]


def test_detokenize_gives_the_text_of_the_tokens(server):
    assert raw(server, "/detokenize", {"tokens": list("wörld".encode())}).json() == {
        "prompt": "wörld"}


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "return_token_strs": True}, 400, "return_token_strs"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}],
                   "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}] * 2}, 400, None),
    ("/detokenize", {"tokens": [1, 300]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", "{not json", 400, None),
])
def test_tokenizer_endpoints_refuse_bad_requests_with_an_openai_error(server, path, body,
                                                                      status, param):
    response = raw(server, path, body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


def test_tokenizer_info_has_what_lm_eval_reads(server):
    info = raw(server, "/tokenizer_info", method="GET").json()
    assert info["eos_token"] == "<eos>" and info["bos_token"] is None
    assert "pad_token" in info and info["chat_template"].startswith("{% for")
    assert info["model_max_length"] == server.engine.max_model_len


def test_version_and_models_as_vllm_gives_them(server):
    import msinfer
    assert raw(server, "/version", method="GET").json() == {"version": msinfer.__version__}
    models = raw(server, "/v1/models", method="GET").json()
    assert models["object"] == "list"
    assert models["data"][0]["object"] == "model" and models["data"][0]["id"] == MODEL
    assert models["data"][0]["root"] == "/models/fake"
    assert models["data"][0]["max_model_len"] == server.engine.max_model_len
    assert server.client().models.list().data[0].root == "/models/fake"


def test_every_response_object_has_its_object_field(server):
    completion = raw(server, "/v1/completions", {"model": MODEL, "prompt": "a",
                                                 "max_tokens": 1}).json()
    chat = raw(server, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "a"}], "max_tokens": 1}).json()
    assert (completion["object"], chat["object"]) == ("text_completion", "chat.completion")
    stream = raw(server, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "a"}], "max_tokens": 2,
        "stream": True, "stream_options": {"include_usage": True}})
    assert {e["object"] for e in sse_events(stream)} == {"chat.completion.chunk"}
    error = raw(server, "/v1/completions", {"model": MODEL, "prompt": "a", "n": 30}).json()
    assert set(error) == {"error"}  # OpenAI's error body: no object field


def test_the_tokenizer_endpoints_ask_for_the_api_key_and_version_does_not():
    s = RunningServer(api_key="sekret")
    try:
        for path in ("/tokenize", "/detokenize"):
            assert raw(s, path, {"prompt": "x", "tokens": [1]}).status_code == 401
        assert raw(s, "/tokenizer_info", method="GET").status_code == 401
        assert raw(s, "/tokenize", {"prompt": "x"},
                   headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert raw(s, "/version", method="GET").status_code == 200
    finally:
        s.stop()


def test_metrics_carry_vllms_names_labels_and_buckets(server):
    server.client().completions.create(model=MODEL, prompt="met", max_tokens=4)
    server.client().completions.create(model=MODEL, prompt="met", max_tokens=4, stop=[
        expected_text("met", 4)[1]])
    text = raw(server, "/metrics", method="GET").text
    lines = text.splitlines()
    labels = f'engine="0",model_name="{MODEL}"'

    def value(series):
        return float(next(line for line in lines if line.startswith(series + " ")).split()[-1])
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:num_preemptions_total"):
        value(f"{name}{{{labels}}}")
    for reason in ("length", "stop"):
        assert value(f'vllm:request_success_total{{engine="0",finished_reason="{reason}",'
                     f'model_name="{MODEL}"}}') >= 1
    assert 0 <= value(f"vllm:kv_cache_usage_perc{{{labels}}}") <= 1
    # vLLM's buckets (vllm/v1/metrics/loggers.py)
    for name, first, last in (("vllm:time_to_first_token_seconds", "0.001", "2560.0"),
                              ("vllm:inter_token_latency_seconds", "0.01", "80.0"),
                              ("vllm:e2e_request_latency_seconds", "0.3", "7680.0")):
        buckets = [line.split('le="')[1].split('"')[0] for line in lines
                   if line.startswith(name + "_bucket{")]
        assert buckets[0] == first and buckets[-2] == last and buckets[-1] == "+Inf", name
    assert 'vllm:request_prompt_tokens_bucket{engine="0",le="50.0"' in text  # 1-2-5 to 96
    assert 'le="100.0"' not in text.split("vllm:request_prompt_tokens_bucket")[-2]
    assert "msinfer_time_to_first_token" not in text  # one name per series


def test_build_1_2_5_buckets_as_vllm():
    from msinfer.server.metrics import build_1_2_5_buckets
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert build_1_2_5_buckets(4096)[-1] == 2000


def test_the_grafana_dashboard_reads_only_series_the_server_exports(server):
    import pathlib
    import re
    path = pathlib.Path(__file__).resolve().parents[2] / "docs" / "grafana-msinfer.json"
    dashboard = json.loads(path.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    names = {re.sub(r"_bucket$", "", n)
             for e in exprs for n in re.findall(r"(?:vllm:|msinfer_)[a-z0-9_]+", e)}
    server.client().completions.create(model=MODEL, prompt="g", max_tokens=2)
    raw(server, "/v1/completions", {"model": MODEL, "prompt": "g", "n": 2})  # one refused
    exported = {line.split("{")[0].split(" ")[0]
                for line in raw(server, "/metrics", method="GET").text.splitlines()
                if line and not line.startswith("#")}
    exported |= {n.removesuffix("_bucket") for n in exported}
    assert len(names) >= 12 and names <= exported, names - exported


def test_n_choices_per_prompt_are_numbered_as_openai_numbers_them(server):
    """Two prompts with n=3: six choices, prompt i's at i * 3 + j; usage counts each prompt
    once; streamed, every choice's chunks carry its index."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    out = client.completions.create(model=MODEL, prompt=["Hi", "Hey there"], max_tokens=4, n=3)
    assert [c.index for c in out.choices] == list(range(6))
    assert [c.text for c in out.choices] == [expected_text("Hi", 4)] * 3 + \
        [expected_text("Hey there", 4)] * 3
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (2 + 9, 6 * 4)
    texts = {}
    for chunk in client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, n=2,
                                           stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {0: expected_text("Hi", 4), 1: expected_text("Hi", 4)}
    chat = client.chat.completions.create(model=MODEL, n=2, max_tokens=3,
                                          messages=[{"role": "user", "content": "x"}])
    assert [c.index for c in chat.choices] == [0, 1]


THINKING = "<think>\nfirst a plan\n</think>\n\nThe answer.".encode()


def test_a_thinking_answer_comes_as_reasoning_content_and_content_whole_and_streamed():
    """--reasoning-parser qwen3, with the openai client: the <think> part is
    reasoning_content, the rest content, whole and streamed alike (a tag split over chunks
    included); chat_template_kwargs reach the template (enable_thinking=false closes an empty
    think block in the prompt, as Qwen3's does)."""
    from fake_engine import ByteTokenizer, fake_llm
    s = RunningServer(llm=fake_llm(text=THINKING), reasoning_parser="qwen3")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        # the fake answers THINKING from an offset its prompt picks: find a question whose
        # answer starts at the beginning
        tokenizer = ByteTokenizer()
        question = next(q for q in ("why" + "a" * k for k in range(len(THINKING)))
                        if sum(tokenizer.encode(tokenizer.apply_chat_template(
                            [{"role": "user", "content": q}]))) % len(THINKING) == 0)
        ask = dict(model=MODEL, messages=[{"role": "user", "content": question}],
                   max_tokens=len(THINKING))
        whole = client.chat.completions.create(**ask).choices[0].message
        assert whole.reasoning_content == "\nfirst a plan\n"
        assert whole.content == "\n\nThe answer."
        reasoning = content = ""
        for chunk in client.chat.completions.create(**ask, stream=True):
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
        assert (reasoning, content) == (whole.reasoning_content, whole.content)
        plain = client.chat.completions.create(**ask)
        thinking_off = client.chat.completions.create(
            **ask, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert thinking_off.usage.prompt_tokens == plain.usage.prompt_tokens + len(
            "<think></think>")
    finally:
        s.stop()


def test_the_qwen3_split_is_vllms_and_the_same_streamed_and_whole():
    from msinfer.server.reasoning import StreamSplitter, prompt_opens_thinking, split_whole

    def streamed(text, thinking, step=3):
        splitter, parts = StreamSplitter(thinking), ["", ""]
        for i in range(0, len(text), step):
            r, c = splitter.feed(text[i:i + step], i + step >= len(text))
            parts = [parts[0] + r, parts[1] + c]
        return parts[0] or None, parts[1] or None

    cases = [  # (answer, prompt opened a think block) -> (reasoning, content)
        ("no tags at all", False, (None, "no tags at all")),
        ("<think>only thinking</think>", False, ("only thinking", None)),
        ("<think>plan</think>answer", False, ("plan", "answer")),
        ("<think>unfinished", False, ("unfinished", None)),
        ("plan</think>answer", False, (None, "plan</think>answer")),  # never thought
        ("plan</think>answer", True, ("plan", "answer")),  # the template opened <think>
        ("cut short while thinking", True, ("cut short while thinking", None)),
    ]
    for text, thinking, split in cases:
        assert split_whole(text, thinking) == split, text
        assert streamed(text, thinking) == split, text
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")


def test_chat_bounds_on_logprobs_name_the_field(server):
    for extra, field in [({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                         ({"prompt_logprobs": 21}, "prompt_logprobs"),
                         ({"n": 5}, "n"), ({"max_tokens": 0}, "max_tokens")]:
        response = raw(server, "/v1/chat/completions",
                       {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                        **extra})
        assert response.status_code == 400, (extra, response.text)
        assert response.json()["error"]["param"] == field


def fake_prompt_logprob(i):
    """The fake engine's logprob of prompt token i (fake_engine._prompt_logprobs)."""
    return -1.0 - i / 100


def test_echo_with_logprobs_and_max_tokens_0_scores_the_prompt_as_lm_eval_reads_it(server):
    """lm-eval's loglikelihood request: token ids, echo, logprobs 1, max_tokens 0 or 1; one
    entry per prompt token (the first null), then the generated ones."""
    prompt = [72, 105, 33, 10]
    for max_tokens in (0, 1, 3):
        out = raw(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "echo": True,
                                              "logprobs": 1, "max_tokens": max_tokens,
                                              "temperature": 0}).json()
        choice = out["choices"][0]
        generated = expected_ids(prompt, max_tokens)
        assert choice["text"] == bytes(prompt).decode() + bytes(generated).decode(
            errors="replace")
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(prompt) + max_tokens
        assert logprobs["token_logprobs"][:len(prompt)] == [None] + [
            fake_prompt_logprob(i) for i in range(1, len(prompt))]
        assert logprobs["token_logprobs"][len(prompt):] == [-0.25] * max_tokens
        assert logprobs["top_logprobs"][0] is None
        assert all(len(top) == 1 for top in logprobs["top_logprobs"][1:])
        assert logprobs["text_offset"][:2] == [0, 1]
        assert choice["finish_reason"] == "length"
        assert out["usage"]["completion_tokens"] == max_tokens
        assert choice["prompt_logprobs"] is None  # vLLM's field only when asked for


def test_echo_without_logprobs_and_streamed_echo(server):
    whole = raw(server, "/v1/completions", {"model": MODEL, "prompt": "Hey", "echo": True,
                                            "max_tokens": 4}).json()["choices"][0]
    assert whole["text"] == "Hey" + expected_text("Hey", 4) and whole["logprobs"] is None
    response = raw(server, "/v1/completions", {"model": MODEL, "prompt": "Hey", "echo": True,
                                               "max_tokens": 4, "stream": True,
                                               "logprobs": 0})
    chunks = [e["choices"][0] for e in sse_events(response)]
    assert chunks[0]["text"].startswith("Hey")
    assert "".join(c["text"] for c in chunks) == whole["text"]
    tokens = sum((c["logprobs"]["tokens"] for c in chunks), [])
    assert tokens == ["H", "e", "y"] + [bytes([t]).decode(errors="replace")
                                        for t in expected_ids(list(b"Hey"), 4)]


def test_prompt_logprobs_come_in_vllms_shape_on_completions_and_chat(server):
    out = raw(server, "/v1/completions", {"model": MODEL, "prompt": [72, 105, 33],
                                          "prompt_logprobs": 2, "max_tokens": 1}).json()
    scored = out["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == 3
    # the prompt token (rank null: below the two made-up most likely) and the top 2, ranked
    assert scored[1] == {"105": {"logprob": fake_prompt_logprob(1), "rank": None,
                                 "decoded_token": "i"},
                         "250": {"logprob": -0.75, "rank": 1, "decoded_token": "\ufffd"},
                         "251": {"logprob": -0.751, "rank": 2, "decoded_token": "\ufffd"}}
    assert out["choices"][0]["logprobs"] is None
    chat = raw(server, "/v1/chat/completions",
               {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                "prompt_logprobs": 0, "max_tokens": 1}).json()
    templated = "<user>x\n<assistant>"
    assert [next(iter(e)) for e in chat["prompt_logprobs"][1:]] == [
        str(b) for b in templated.encode()[1:]]
