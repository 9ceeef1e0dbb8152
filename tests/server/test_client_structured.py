"""Structured output and tool calls, judged by code nobody here wrote: every output parses with
json and validates with `jsonschema` against the schema asked for; the openai SDK's own
structured-output helper (`chat.completions.parse`, a pydantic model) and its stream
accumulator read what the session's real server (`tiny_server`) answers.

The JSON-mode volume test (100 sampled requests) runs in-process through `LLM` on a tiny
checkpoint, batched; the server tests are a few requests each. Schemas bound every length
(enums, patterns, maxItems, integer ranges) so a random model finishes well within
max_tokens: the grammar, not the token budget, ends each output ("stop").

The tool call round trips need a longer context than the shared server's 128 tokens: Qwen2.5's
template renders the tools into a system prompt of 635 tokens for one tool (with the tiny
512-token vocabulary). They run over HTTP with the SDK against the app of `msinfer serve`
served in-process (test_serve_protocol.RunningServer) over this module's real engine."""
import json

import jsonschema
import pytest
from pydantic import BaseModel, Field
from typing import Literal

from msinfer.engine.sampling import SamplingParams

from test_serve_protocol import MODEL, RunningServer, raw

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,3}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "items": {"enum": ["x", "y"]},
                                  "maxItems": 2},
                         "ok": {"type": "boolean"}},
           "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 3}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object",
                                       "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SHORT = [{"role": "system", "content": "Hi"}] + ASK  # not the template's long default


# ---- in-process: the engine with the grammar engine ----

@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    from msinfer.api import LLM
    path, _ = tiny_checkpoint(layers=2, hidden=64, heads=4, kv_heads=2, vocab=512, seed=2)
    # graphs compile when first used: the JSON test stays in the first context bucket (64),
    # the tool prompts (~800 tokens) need 1024
    return LLM(path, max_len=1024, max_num_seqs=16, max_prefill_tokens=1024)


def test_100_sampled_json_outputs_all_parse_and_validate(llm):
    # the longest object this schema allows is 51 characters
    params = SamplingParams(max_tokens=58, temperature=1.0,
                            structured_outputs={"json": SCHEMA})
    choice = SamplingParams(max_tokens=20, temperature=1.0,
                            structured_outputs={"choice": ["yes", "no way"]})
    regex = SamplingParams(max_tokens=20, temperature=1.0,
                           structured_outputs={"regex": r"[0-9]{3}-[a-z]{2}"})
    outs = llm.generate(["JSON:"] * 100 + ["Yes?", "Code:"],
                        [params] * 100 + [choice, regex])
    longest = 0
    for out in outs[:100]:
        assert out.finish_reason == "stop", out
        longest = max(longest, len(out.token_ids))
        jsonschema.validate(json.loads(out.text), SCHEMA)
        # the grammar ended it: no end-of-sequence token was sampled after the object
        assert out.text.endswith("}") and out.token_ids[-1] not in llm.engine.eos_token_ids
    assert len({out.text for out in outs[:100]}) > 50  # sampled, not one answer repeated
    print(f"longest JSON output: {longest} tokens")
    assert outs[100].text in ("yes", "no way") and outs[100].finish_reason == "stop"
    assert len(outs[101].text) == 6 and outs[101].text[3] == "-"
    assert outs[101].text[:3].isdigit() and outs[101].text[4:].isalpha()


def test_a_json_object_and_greedy_decoding_follow_the_grammar_too(llm):
    outs = llm.generate(["{", "{"], [
        SamplingParams(max_tokens=40, temperature=0,
                       structured_outputs={"json": {"enum": ["alpha", "beta"]}}),
        SamplingParams(max_tokens=40, temperature=0.7, logprobs=2,
                       structured_outputs={"json_object": True})])
    assert json.loads(outs[0].text) in ("alpha", "beta") and outs[0].finish_reason == "stop"
    # any object; it may run out of tokens, but what was generated is a prefix of one
    assert outs[1].text.startswith("{")
    if outs[1].finish_reason == "stop":
        assert isinstance(json.loads(outs[1].text), dict)
    # reported logprobs are the model's: the sampled token is in them even when masked
    assert all(t in lp for t, lp in zip(outs[1].token_ids, outs[1].logprobs))


def test_model_rows_beyond_the_tokenizer_are_never_allowed(small_checkpoint):
    from msinfer.engine.structured import GrammarEngine
    from msinfer.engine.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_model_dir(small_checkpoint)
    size = len(json.loads(tokenizer.to_json_str())["model"]["vocab"])
    engine = GrammarEngine(tokenizer, vocab_size=size + 100,
                           eos_token_ids=tokenizer.eos_token_ids)
    guided = engine.start({"json_object": True})
    assert guided.allowed.shape == (size + 100,)
    assert guided.allowed[:size].any() and not guided.allowed[size:].any()
    assert guided.allowed[tokenizer.token_to_id("{")]
    assert not guided.allowed[tokenizer.token_to_id("a")]


def test_a_thinking_model_may_think_before_the_constraint(small_checkpoint):
    """With a reasoning parser, chat's constraint starts after an optional <think>...</think>
    (vLLM's behaviour); without, the first token is the constraint's."""
    from msinfer.engine.structured import AFTER_THINK, GrammarEngine
    from msinfer.engine.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_model_dir(small_checkpoint)
    engine = GrammarEngine(tokenizer, 512, tokenizer.eos_token_ids)
    thought = '<think>{"age": "?"} hmm</think>\n\n'
    answer = '{"name":"bo","age":7,"tags":[],"ok":true}'

    def accepts(spec, text):
        guided = engine.start(spec)
        return (all(guided.advance(t) for t in tokenizer.encode(text))
                and guided.matcher.is_accepting())
    for spec in ({"json": SCHEMA}, {"choice": ["yes", "no"]},
                 {"grammar": 'start: "<tool_call>" "x"'}):
        first = {"json": answer, "choice": "no", "grammar": "<tool_call>x"}[next(iter(spec))]
        assert accepts({**spec, AFTER_THINK: True}, thought + first)
        assert accepts({**spec, AFTER_THINK: True}, first)
        assert not accepts(spec, thought + first) and accepts(spec, first)
    assert not accepts({"json": SCHEMA, AFTER_THINK: True}, thought + '{"name":5}')


def test_qwen3s_tags_are_its_own_tokens_in_forced_calls_and_thoughts(tiny_checkpoint):
    """Qwen3's <tool_call> and <think> are tokens of their own, which llguidance reads as
    special: the grammars name them by id, so the model's own single token is what they allow
    (a quoted "<tool_call>" would refuse it)."""
    from msinfer.engine.structured import AFTER_THINK, GrammarEngine
    from msinfer.engine.tokenizer import Tokenizer
    from msinfer.server.tool_calls import forcing_grammar
    path = tiny_checkpoint(family="qwen3", layers=1, hidden=32, heads=2, kv_heads=1,
                           vocab=512)[0]  # test_tokenizer's
    tokenizer = Tokenizer.from_model_dir(path)
    engine = GrammarEngine(tokenizer, 512, tokenizer.eos_token_ids)
    functions = {"get_weather": WEATHER["function"]["parameters"]}
    call = ('<tool_call>\n{"name":"get_weather","arguments":{"city":"Rome","days":2}}\n'
            '</tool_call>')
    spec = {**forcing_grammar(functions, "get_weather", token_id=tokenizer.token_to_id),
            AFTER_THINK: True}
    for text in (call, "<think>\nsunny?\n</think>\n\n" + call):
        ids = tokenizer.encode(text)
        assert ids[0] in (tokenizer.token_to_id("<tool_call>"), tokenizer.token_to_id("<think>"))
        guided = engine.start(spec)
        assert guided.allowed[ids[0]]
        assert all(guided.advance(t) for t in ids) and guided.complete


def test_the_constraint_reaches_a_tensor_groups_followers_as_it_was_given():
    """Followers rebuild SamplingParams from the leader's JSON (server/lockstep.py); they never
    sample, but their check of the request must see the same constraint."""
    import dataclasses
    params = SamplingParams(structured_outputs={"json": json.dumps(SCHEMA)})
    assert params.structured_outputs == {"json": SCHEMA}  # a schema given as text is parsed
    sent = json.loads(json.dumps(dataclasses.asdict(params)))
    assert SamplingParams(**sent) == params


def test_the_engine_refuses_what_the_grammar_engine_cannot_compile(llm):
    from msinfer.errors import MsinferError
    for spec, needle in (({"json": {"type": "foo"}}, "foo"), ({"regex": "(ab"}, "regex"),
                         ({"json": "{not json"}, "not valid JSON"),
                         ({"json": {}, "regex": "a"}, "exactly one")):
        with pytest.raises(MsinferError, match="structured_outputs") as e:
            llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=spec))
        assert needle in str(e.value)


# ---- the tool call parser (vLLM's hermes format), whole and streamed ----

def test_tool_calls_are_parsed_whole_and_from_any_split_of_the_stream():
    from msinfer.server.tool_calls import ToolCallStream, parse_whole
    text = ('Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"days": {"n": 2}}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
            '{}}\n</tool_call>')
    content, calls = parse_whole(text)
    assert content == "Let me look."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": {"n": 2}}), ("get_time", {})]
    for step in (1, 2, 5, 13, len(text)):
        stream, content, got = ToolCallStream(), "", {}
        for i in range(0, len(text), step):
            piece, deltas = stream.feed(text[i:i + step], i + step >= len(text))
            content += piece
            for d in deltas:
                call = got.setdefault(d["index"], {"id": d.get("id"), "name": "",
                                                   "arguments": ""})
                assert "id" not in d or d["id"] == call["id"]  # an id once per call
                call["name"] += d["function"].get("name") or ""
                call["arguments"] += d["function"].get("arguments") or ""
        assert content == "Let me look."
        assert [(c["name"], json.loads(c["arguments"])) for c in got.values()] == [
            ("get_weather", {"city": "Paris", "days": {"n": 2}}), ("get_time", {})]
    assert parse_whole("no call here") == ("no call here", [])
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_whole(broken) == (broken, [])


# ---- bad input: 400 naming the field (fake engine) ----

@pytest.fixture(scope="module")
def fake_server():
    s = RunningServer()
    yield s
    s.stop()


@pytest.mark.parametrize("path, extra, field", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "foo"}}}}, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/completions", {"guided_regex": "(ab"}, "guided_regex"),
    ("/v1/completions", {"guided_json": {"type": "object", "properties": {
        "a": {"$ref": "#/defs/missing"}}}}, "guided_json"),
    ("/v1/completions", {"structured_outputs": {"json": {}, "regex": "a"}},
     "structured_outputs"),
    ("/v1/completions", {"response_format": {"type": "json_object"},
                         "guided_regex": "a"}, "guided_regex"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": "x"}}}}}]}, "tools[0].function.parameters"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": "not a schema"}}]}, "tools[0].function.parameters"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {}}]},
     "tools[0].function.name"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "get_stock"}}}, "tool_choice"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),  # no tools
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, "tool_choice"),
    ("/v1/completions", {"tools": [WEATHER]}, "tools"),
])
def test_bad_schemas_tools_and_tool_choices_are_a_400_naming_the_field(fake_server, path,
                                                                         extra, field):
    body = {"model": MODEL, "max_tokens": 4, **extra}
    body.update({"messages": ASK} if "chat" in path else {"prompt": "Hi"})
    response = raw(fake_server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"], error


# ---- the real server and the openai SDK ----

class Weather(BaseModel):
    city: Literal["Paris", "Rome"]
    celsius: int = Field(ge=-20, le=40)
    summary: str = Field(pattern="^[a-z ]{0,8}$")


def test_the_sdks_structured_output_helper_returns_a_valid_object(tiny_server):
    client = tiny_server.client()
    done = client.chat.completions.parse(model="tiny", messages=SHORT, response_format=Weather,
                                         max_tokens=70, temperature=1.0, seed=3)
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Weather)  # the SDK's own pydantic validation
    assert Weather.model_validate_json(choice.message.content) == choice.message.parsed
    # completions take the same response_format, and vLLM's guided_json; n choices each
    # follow the grammar with a matcher of their own
    for extra in ({"response_format": {"type": "json_schema",
                                       "json_schema": {"name": "p", "schema": SCHEMA}}},
                  {"guided_json": SCHEMA, "n": 2}):
        response = raw(tiny_server, "/v1/completions", {
            "model": "tiny", "prompt": "JSON:", "max_tokens": 90, **extra})
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        assert len(choices) == extra.get("n", 1)
        for choice in choices:
            assert choice["finish_reason"] == "stop"
            jsonschema.validate(json.loads(choice["text"]), SCHEMA)


def _round_trip(client, stream, answer=True, **request):
    """Ask with tools, answer the calls with tool messages, ask again (with `answer`): the
    first answer's choice, the final answer's (None without `answer`), and how many pieces
    of arguments the SDK's stream saw (0 unstreamed)."""
    kwargs = dict(model=MODEL, tools=[WEATHER, TIME], max_tokens=120, temperature=1.0)
    if stream:
        with client.chat.completions.stream(messages=ASK, **kwargs, **request) as events:
            pieces = sum(e.type == "tool_calls.function.arguments.delta" for e in events)
            first = events.get_final_completion().choices[0]
    else:
        pieces = 0
        first = client.chat.completions.create(messages=ASK, **kwargs, **request).choices[0]
    calls = first.message.tool_calls
    assert first.finish_reason in ("tool_calls", "stop") and calls
    if not answer:
        return first, None, pieces
    messages = ASK + [first.message.model_dump(exclude_none=True,
                                               exclude={"parsed", "refusal"})]
    messages += [{"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}
                 for call in calls]
    answer = client.chat.completions.create(messages=messages, **dict(kwargs, max_tokens=8),
                                            tool_choice="none")
    return first, answer.choices[0], pieces


@pytest.fixture(scope="module")
def engine_server(llm):
    s = RunningServer(llm=llm)
    yield s
    s.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_round_trip_with_the_sdk(engine_server, stream):
    client = engine_server.client(timeout=120)
    first, answer, pieces = _round_trip(client, stream, tool_choice={
        "type": "function", "function": {"name": "get_weather"}})
    [call] = first.message.tool_calls
    assert pieces > 1 if stream else pieces == 0  # streamed as they come, not in one piece
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert not answer.message.tool_calls and isinstance(answer.message.content, str)
    assert answer.finish_reason in ("stop", "length")
    # required: one or more calls, each of a given tool with valid arguments
    first, _, _ = _round_trip(client, stream, answer=False, tool_choice="required",
                           parallel_tool_calls=False)
    assert len(first.message.tool_calls) == 1
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in first.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_tokenize_renders_the_tools_as_chat_does(engine_server, llm):
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER]}
    response = raw(engine_server, "/tokenize", body)
    assert response.status_code == 200, response.text
    expected = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(ASK, tools=[WEATHER]))
    assert response.json()["tokens"] == expected
    assert "get_weather" in llm.tokenizer.decode(expected)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_the_calls_the_model_writes(engine_server, stream):
    """tool_choice auto parses free output; a regex (vLLM's structured_outputs) makes the
    random model write Qwen's call format, as a trained model would."""
    client = engine_server.client(timeout=120)
    pattern = (r'Sure\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": '
               r'"(Paris|Rome)", "days": [123]\}\}\n</tool_call>')
    first, _, _ = _round_trip(client, stream, answer=False, tool_choice="auto",
                           extra_body={"structured_outputs": {"regex": pattern}})
    assert first.finish_reason == "tool_calls"
    assert first.message.content == "Sure. "
    [call] = first.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
