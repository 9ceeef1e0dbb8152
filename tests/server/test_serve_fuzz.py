"""Property-based fuzzing of the HTTP API from its own /openapi.json (schemathesis): requests
that follow the schema and requests that break it, on every route, over the fake engine
(tests/fake_engine.py). No 5xx; every 4xx is an OpenAI error object (message, type, param,
code); every event stream ends with [DONE]; afterwards the server is healthy, serves, and
its engine holds no request and no KV block.

CI runs a bounded, derandomized number of cases (FUZZ_EXAMPLES per generation mode,
$MSINFER_FUZZ_EXAMPLES to change); the count tried is printed."""
import json
import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.config import SchemathesisConfig
from schemathesis.generation.modes import GenerationMode

from test_serve_protocol import MODEL, RunningServer, raw

FUZZ_EXAMPLES = int(os.environ.get("MSINFER_FUZZ_EXAMPLES", "150"))
# schemathesis reads 20 events of a stream by default, then hangs up; every stream of the fake
# engine (96 tokens of context, a few choices) is read to its end, to see how it ends
MAX_STREAM_EVENTS = 5000
RESPONSES_ENDS = ("response.completed", "response.incomplete", "response.failed")


@pytest.fixture(scope="module")
def server():
    # no step delay, small max_tokens bounds: many cases per second
    s = RunningServer(step_delay=0.0, max_queue=64)
    yield s
    s.stop()


def assert_clean(case, response):
    """No server error; a client error is OpenAI's error object; a stream ends with [DONE]."""
    where = f"{case.method} {case.path} {case.body!r:.300}"
    assert response.status_code < 500, f"{where}: {response.status_code} {response.content!r:.500}"
    if response.status_code >= 400:
        error = json.loads(response.content)["error"]
        assert isinstance(error["message"], str) and error["message"], where
        assert isinstance(error["type"], str) and error["type"], where
        assert "param" in error and "code" in error, where
    elif response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        assert not response.stream_cut_short, f"{where}: a stream beyond MAX_STREAM_EVENTS"
        events = [line for line in response.content.decode().splitlines() if line]
        if case.path == "/v1/responses":  # the Responses API's streams end with their status
            last = json.loads(events[-1].removeprefix("data: "))
            assert last.get("type") in RESPONSES_ENDS or "error" in last, f"{where}: {last}"
        else:
            assert events[-1] == "data: [DONE]", f"{where}: {events[-3:]}"


def test_fuzzing_every_route_finds_no_5xx_and_only_openai_errors(server, capsys):
    config = SchemathesisConfig.from_dict({"max-stream-events": MAX_STREAM_EVENTS})
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", config=config)
    operations = [result.ok() for result in schema.get_all_operations()]
    ids = [operation.definition.raw.get("operationId") for operation in operations]
    assert len(set(ids)) == len(ids), sorted(ids)  # clients are generated from these names
    tried = {}
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=schema.as_strategy(generation_mode=mode))
        def fuzz(case):
            if isinstance(case.body, dict) and "model" in case.body \
                    and mode is GenerationMode.POSITIVE:
                case.body["model"] = MODEL  # reach the engine, not only the 404
            response = case.call(base_url=server.url, timeout=60)
            assert_clean(case, response)
            key = f"{mode.value} {case.method} {case.path} {response.status_code}"
            tried[key] = tried.get(key, 0) + 1
        fuzz()
    total = sum(tried.values())
    with capsys.disabled():
        print(f"\nschemathesis: {total} cases over {len(operations)} operations")
        for key in sorted(tried):
            print(f"  {tried[key]:5d}  {key}")
    assert total >= FUZZ_EXAMPLES
    reached = {key.split()[2] for key in tried if key.split()[3] == "200"}
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize",
            "/detokenize"} <= reached, sorted(tried)
    # healthy afterwards, and nothing left behind in the engine
    assert raw(server, "/health", method="GET").status_code == 200
    ok = raw(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200
    engine = server.engine
    assert not engine.running and not engine.waiting and engine.stats().num_blocks_used == 0
