"""What routers, gateways and client libraries read of a server, over the fake engine
(tests/fake_engine.py), checked with the openai SDK and the shapes vllm-router parses: the
context-overflow error, the router endpoints, the Responses API."""
import re

import httpx2 as httpx
import openai
import pytest

from test_serve_protocol import MODEL, RunningServer

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
