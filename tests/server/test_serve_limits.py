"""What `msinfer serve` refuses before it works on a request, and how a stream ends when it
fails: a body beyond --max-request-bytes (413), `stop` beyond its bounds (400 naming it), and
an SSE error event then `data: [DONE]` for a stream that fails mid-way. Over the fake engine
of tests/fake_engine.py, as tests/server/test_serve_protocol.py."""
import json

import httpx2 as httpx
import openai
import pytest

from msinfer.cli.main import build_parser
from msinfer.server import serving
from msinfer.server.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS
from msinfer.server.server_config import DEFAULT_MAX_REQUEST_BYTES, ServerConfig

from test_serve_protocol import MODEL, RunningServer, raw

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server():
    s = RunningServer(max_request_bytes=LIMIT, step_delay=0.02)
    yield s
    s.stop()


def assert_openai_error(response, status, needle, param=None, code=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert needle in error["message"] and error["type"]
    assert error["param"] == param and error["code"] == code
    assert "Traceback" not in response.text


def still_serving(server):
    ok = raw(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_the_default_limit_is_4_mib_and_the_option_takes_units():
    parse = build_parser().parse_args
    assert DEFAULT_MAX_REQUEST_BYTES == 4 * 2 ** 20
    default = ServerConfig.from_args(parse(["serve", "--model", "m"]))
    assert default.max_request_bytes == DEFAULT_MAX_REQUEST_BYTES
    assert default.model_names == ["m"]
    args = parse(["serve", "--model", "m", "--max-request-bytes", "1MiB"])
    assert ServerConfig.from_args(args).max_request_bytes == 2 ** 20


def test_a_body_beyond_the_limit_gets_413_unread(server):
    body = json.dumps({"model": MODEL, "prompt": "x" * (LIMIT + 10), "max_tokens": 1})
    response = raw(server, "/v1/completions", body)
    assert_openai_error(response, 413, f"exceeds the server's limit of {LIMIT} bytes",
                        code="request_too_large")
    assert "--max-request-bytes" in response.json()["error"]["message"]
    metrics = raw(server, "/metrics", method="GET").text
    assert 'msinfer_request_rejected_total{model_name="fake-model",status="413"}' in metrics
    still_serving(server)


def test_a_chunked_body_is_counted_as_it_arrives(server):
    def body(size, piece):
        text = json.dumps({"model": MODEL, "prompt": "y" * size, "max_tokens": 2}).encode()
        for start in range(0, len(text), piece):  # no Content-Length: chunked transfer
            yield text[start:start + piece]

    with httpx.Client(base_url=server.url, timeout=30) as c:
        big = c.post("/v1/completions", content=body(LIMIT * 2, 4096),
                     headers={"content-type": "application/json"})
        small = c.post("/v1/completions", content=body(60, 16),
                       headers={"content-type": "application/json"})
    assert_openai_error(big, 413, "exceeds the server's limit", code="request_too_large")
    assert small.status_code == 200, small.text  # read here, then handed on whole
    assert small.json()["usage"]["prompt_tokens"] == 60
    still_serving(server)


@pytest.mark.parametrize("stop, needle", [
    ([f"s{i}" for i in range(MAX_STOP_STRINGS + 1)],
     f"{MAX_STOP_STRINGS + 1} stop strings; at most {MAX_STOP_STRINGS}"),
    (["ok", "z" * (MAX_STOP_CHARS + 1)],
     f"a stop string of {MAX_STOP_CHARS + 1} characters; each may have at most "
     f"{MAX_STOP_CHARS}"),
    ("z" * (MAX_STOP_CHARS + 1), f"{MAX_STOP_CHARS + 1} characters"),
])
def test_stop_beyond_its_bounds_is_a_400_naming_the_field(server, stop, needle):
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}]})):
        response = raw(server, path, {"model": MODEL, "max_tokens": 2, "stop": stop, **body})
        assert_openai_error(response, 400, needle, param="stop")
        assert response.json()["error"]["message"].startswith("stop: ")


def test_stop_within_its_bounds_is_taken(server):
    stops = [f"never{i}" for i in range(MAX_STOP_STRINGS - 1)] + ["q" * MAX_STOP_CHARS]
    out = server.client().completions.create(model=MODEL, prompt="a", max_tokens=3, stop=stops)
    assert out.choices[0].finish_reason == "length"


def stream_lines(server, prompt, max_tokens=60, on_first=None):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                "stream": True}) as r:
            lines = r.iter_lines()
            first = next(lines)
            if on_first:
                on_first()
            return [first] + [line for line in lines if line]


def test_a_stream_whose_engine_loop_fails_ends_with_an_error_event_then_done():
    s = RunningServer(step_delay=0.05)
    try:
        lines = stream_lines(s, "fail", on_first=lambda: s.loop.fail_all("rank 3 is gone"))
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][len("data: "):])["error"]
        assert error["message"] == "rank 3 is gone" and error["type"] == "service_unavailable"
    finally:
        s.stop()


def test_a_stream_that_raises_mid_way_ends_with_an_error_event_then_done(server,
                                                                        monkeypatch):
    calls = []
    advance = serving.RequestStream.advance

    def failing(self, out, tokenizer):
        calls.append(out)
        if len(calls) == 3:
            raise RuntimeError("formatting broke")
        return advance(self, out, tokenizer)

    monkeypatch.setattr(serving.RequestStream, "advance", failing)
    lines = stream_lines(server, "raise")
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: "):])["error"]
    assert error["type"] == "internal_error"
    assert "RuntimeError: formatting broke" in error["message"]
    assert all("choices" in json.loads(line[6:]) for line in lines[:-2])
    monkeypatch.undo()
    # the request was aborted (its blocks freed) and the server goes on
    still_serving(server)


def test_the_openai_client_raises_on_the_error_event():
    s = RunningServer(step_delay=0.05)
    try:
        stream = s.client().completions.create(model=MODEL, prompt="c", max_tokens=60,
                                               stream=True)
        next(iter(stream))
        s.loop.fail_all("rank 1 is gone")
        with pytest.raises(openai.APIError, match="rank 1 is gone"):
            for _ in stream:
                pass
    finally:
        s.stop()
