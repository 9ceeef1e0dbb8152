"""What routers, gateways and client libraries read of a server, over the fake engine
(tests/fake_engine.py), checked with the openai SDK and the shapes vllm-router parses: the
context-overflow error, the router endpoints, the Responses API."""
import json
import re

import httpx2 as httpx
import openai
import pytest

from fake_engine import expected_ids
from test_serve_protocol import MODEL, RunningServer

pytestmark = pytest.mark.waits  # it mostly waits: the third xdist worker runs it (conftest.py)

# the wording LangChain, LlamaIndex and agent frameworks match to trim and retry
OVERFLOW = re.compile(r"This model's maximum context length is (\d+) tokens\. However, you "
                      r"requested (\d+) tokens \((\d+) in the messages, (\d+) in the "
                      r"completion\)\. Please reduce the length of the messages or completion\.")


@pytest.fixture(scope="module")
def server():
    s = RunningServer()  # contexts of 96 tokens, a pool that holds one
    yield s
    s.stop()


def _overflow(call):
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    e = caught.value
    assert e.status_code == 400 and e.code == "context_length_exceeded"
    return e, OVERFLOW.fullmatch(e.body["message"])


def test_a_too_long_chat_is_openais_context_length_exceeded(server):
    long = "x" * 100  # templated: 100 + 19 tokens, beyond 96
    e, match = _overflow(lambda: server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": long}], max_tokens=5))
    assert e.param == "messages" and match
    prompt = len(f"<user>{long}\n<assistant>")
    assert [int(x) for x in match.groups()] == [96, prompt + 5, prompt, 5]


def test_a_completion_over_the_context_names_the_prompt(server):
    e, match = _overflow(lambda: server.client().completions.create(
        model=MODEL, prompt="y" * 90, max_tokens=10))
    assert e.param == "prompt"
    assert [int(x) for x in match.groups()] == [96, 100, 90, 10]
    # within the context it runs
    out = server.client().completions.create(model=MODEL, prompt="y" * 86, max_tokens=10)
    assert out.usage.completion_tokens == 10


def test_other_4xx_keep_openais_error_object_with_param(server):
    with pytest.raises(openai.NotFoundError) as caught:
        server.client().completions.create(model="nope", prompt="a", max_tokens=1)
    assert caught.value.param == "model" and caught.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().completions.create(model=MODEL, prompt="a", max_tokens=1,
                                           temperature=5)
    assert caught.value.param == "temperature"
    body = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "a",
                                                             "max_tokens": 0}).json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    assert body["error"]["param"] == "max_tokens"


def test_the_endpoints_routers_call(server):
    get = lambda path: httpx.get(server.url + path, timeout=10)  # noqa: E731
    load = get("/get_load").json()
    assert isinstance(load["load"], int) and load["load"] == load["num_reqs"] + \
        load["num_waiting_reqs"]
    info = get("/get_server_info").json()
    # vllm-router's ServerInfo: model_id/model_path name the worker's model, kv_block_size
    # keys its KV-event index
    assert info["model_id"] == MODEL and info["model_path"] == "/models/fake"
    assert info["kv_block_size"] == server.engine.block_size
    assert info["max_model_len"] == server.engine.max_model_len
    model = get("/get_model_info").json()
    assert model["model_path"] == "/models/fake" and model["is_generation"] is True
    assert get("/health_generate").status_code == 200
    assert server.engine.generation_tokens >= 1  # it ran through the engine
    assert get("/ping").json() == {"status": "ok"}
    assert httpx.post(server.url + "/ping").status_code == 200
    assert get("/version").json()["version"]
    assert get("/kv_event_sources").status_code == 404  # no --kv-events-config here
    flushed = httpx.post(server.url + "/flush_cache")
    assert flushed.status_code == 200 and flushed.text == "Cache flushed."
    assert httpx.post(server.url + "/reset_prefix_cache").status_code == 200


def test_flush_cache_is_refused_while_requests_run(server):
    stream = server.client().completions.create(model=MODEL, prompt="a", max_tokens=60,
                                                stream=True)
    next(iter(stream))  # running now
    refused = httpx.post(server.url + "/flush_cache")
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "requests_running"
    assert httpx.get(server.url + "/get_load").json()["load"] >= 1
    list(stream)


def test_vllms_request_series_with_its_names_types_and_buckets(server):
    server.client().completions.create(model=MODEL, prompt="series", max_tokens=4, n=2)
    text = httpx.get(server.url + "/metrics").text
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE"))
    for name in ("queue", "prefill", "decode", "inference"):
        assert types[f"vllm:request_{name}_time_seconds"] == "histogram"
    for name in ("vllm:request_params_n", "vllm:request_params_max_tokens",
                 "vllm:request_max_num_generation_tokens", "vllm:iteration_tokens_total"):
        assert types[name] == "histogram"
    assert types["vllm:prompt_tokens_by_source_total"] == "counter"
    assert types["vllm:gpu_cache_usage_perc"] == types["vllm:kv_cache_usage_perc"] == "gauge"
    assert types["vllm:cache_config_info"] == types["vllm:lora_requests_info"] == "gauge"
    # vLLM's buckets: n in 1, 2, 5, 10, 20; the phases in its request-latency buckets
    assert 'vllm:request_params_n_bucket{engine="0",le="20.0",model_name="fake-model"}' in text
    assert 'vllm:request_queue_time_seconds_bucket{engine="0",le="7680.0",' in text
    assert f'block_size="{server.engine.block_size}"' in text
    assert 'source="local_cache_hit"' in text and 'max_lora="0"' in text


# -- the Responses API (server/responses.py), with the openai SDK's client.responses --------

def test_responses_text_and_previous_response_id(server):
    client = server.client()
    first = client.responses.create(model=MODEL, input="Hi", max_output_tokens=6,
                                    instructions="Be brief.")
    assert first.object == "response" and first.status == "incomplete"  # 6 tokens: cut off
    assert first.incomplete_details.reason == "max_output_tokens"
    templated = "<system>Be brief.\n<user>Hi\n<assistant>"
    assert first.output_text == bytes(expected_ids(list(templated.encode()), 6)).decode(
        errors="replace")
    assert first.usage.input_tokens == len(templated.encode())
    assert first.usage.output_tokens == 6
    # the next turn continues the stored conversation (instructions are not carried over)
    second = client.responses.create(model=MODEL, input="More", max_output_tokens=4,
                                     previous_response_id=first.id)
    history = f"<user>Hi\n<assistant>{first.output_text}\n<user>More\n<assistant>"
    assert second.usage.input_tokens == len(history.encode())
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
    assert caught.value.param == "previous_response_id"


def test_responses_stream_events_validate_as_the_sdks_types(server):
    whole = server.client().responses.create(model=MODEL, input="Hello", max_output_tokens=12)
    events = list(server.client().responses.create(model=MODEL, input="Hello",
                                                   max_output_tokens=12, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 12
    # every event and the response validate (strictly) as the SDK's pydantic types
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter
    raw = httpx.post(server.url + "/v1/responses", timeout=30, json={
        "model": MODEL, "input": "Hello", "max_output_tokens": 12, "stream": True}).text
    payloads = [line[len("data: "):] for line in raw.split("\n") if line.startswith("data: ")]
    adapter = TypeAdapter(ResponseStreamEvent)
    assert [adapter.validate_json(x).type for x in payloads] == types
    Response.model_validate(whole.model_dump())


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _aligned(text, prefix="Weather in Paris?"):
    """An input whose templated prompt makes the fake answer `text` from its start (the fake
    starts at the prompt's byte sum modulo the text's length)."""
    for pad in range(2000):
        candidate = prefix + "a" * (pad // 7) + "!" * (pad % 7)
        if sum(f"<user>{candidate}\n<assistant>".encode()) % len(text.encode()) == 0:
            return candidate
    raise AssertionError("no aligned input")


def test_responses_function_tools():
    from fake_engine import fake_llm
    tool_server = RunningServer(llm=fake_llm(text=CALL.encode(), max_model_len=256, num_blocks=64))
    tools = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                             "required": ["city"]}}]
    client = tool_server.client()
    ask = dict(model=MODEL, input=_aligned(CALL), tools=tools, max_output_tokens=len(CALL))
    try:
        out = client.responses.create(**ask)
        (call,) = [o for o in out.output if o.type == "function_call"]
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
        assert out.output_text == ""  # the answer was the call alone
        events = list(client.responses.create(**ask, stream=True))
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert len(done) == 1 and json.loads(done[0].arguments) == {"city": "Paris"}
        added = [e.item for e in events if e.type == "response.output_item.added"]
        assert [i.type for i in added] == ["function_call"] and added[0].name == "get_weather"
        # the tool's result goes back with previous_response_id: the template sees the call
        follow = client.responses.create(
            model=MODEL, previous_response_id=out.id, max_output_tokens=3,
            input=[{"type": "function_call_output", "call_id": call.call_id,
                    "output": "sunny"}])
        assert follow.usage.input_tokens == len(
            f"<user>{ask['input']}\n<assistant>\n<tool>sunny\n<assistant>".encode())
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])
        assert caught.value.param == "tools"
    finally:
        tool_server.stop()
