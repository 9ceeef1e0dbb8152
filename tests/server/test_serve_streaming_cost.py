"""A long answer costs the server as much per step at its 2000th token as at its 50th (issue
38): nothing of a running request is copied, joined or serialized whole per step, on rank 0's
own replica (`RequestStream.advance` over the engine's Prefix views) nor on the way from
another replica (`ReplicaUplink` -> the link -> `RemoteReplica` -> the stream).

Measured without a clock: the memory that one step's server work allocates at its peak
(tracemalloc; a copy of 2000 tokens' ids is 16 KB, of their text 2-8 KB) and the bytes of
the report that crosses the replica link, compared between steps 50-150 and the last 100
steps by their medians (a list's occasional resize is amortized, not a per-step cost). Over
the fake engine of tests/fake_engine.py, which hands out Prefix views as the real one does,
and here its running text as the real one does too (a TextSoFar view).
And rank 0's view of a remote request's text (`TextSoFar`) slices as the text it stands for.

A chat stream's parsers (reasoning, tool calls) likewise: a chunk's allocations at the end of
2000 against those at its 300th, and what they send chunk by chunk the same as the parsers
that searched the whole text so far (stream_parsers_before.py), on random answers.
"""
import dataclasses
import json
import statistics
import tracemalloc
import types

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fake_engine import FakeEngine, expected_ids

from msinfer.engine.sampling import SamplingParams
from msinfer.engine.text import GrowingText
from msinfer.server import replicas
from msinfer.server.serving import RequestStream

N = 2000  # tokens of the answer
PROMPT = [1, 2, 3]
# logprobs and a stop string that never comes: the stream's per-step work at its fullest
PARAMS = SamplingParams(max_tokens=N, logprobs=2, stop=("zz", "@@@"))
_METRICS = types.SimpleNamespace(observe_first_token=lambda *a, **k: None,
                                 observe_token_gap=lambda *a, **k: None,
                                 observe_request=lambda *a, **k: None)


class _ViewingEngine(FakeEngine):
    """The fake engine, its running outputs' text a TextSoFar view of the pieces it grew by,
    as the real engine's (which holds back an incomplete character: the fake's U+FFFD)."""

    def _output(self, r, reason):
        out = super()._output(r, reason)
        if reason is not None:
            return out
        grown = self.grown.setdefault(r.request_id, GrowingText())
        grown.append(out.text.rstrip("\ufffd")[len(grown):])
        return dataclasses.replace(out, text=grown.view())


def _engine():
    engine = _ViewingEngine(max_model_len=N + 64, num_blocks=64, block_size=64, step_delay=0)
    engine.grown = {}
    engine.add_request("r", PROMPT, PARAMS)
    return engine


def _stream():
    return RequestStream("r", PROMPT, PARAMS, 0.0, _METRICS)


def _allocated(work):
    """The bytes `work()` holds at its peak beyond what was held before it."""
    before = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    work()
    return tracemalloc.get_traced_memory()[1] - before


class _Pipe:
    """The replica link as handoff.Link frames it (JSON), delivering each frame at once to
    rank 0's RemoteReplica; `sizes` are the frames' bytes."""

    def __init__(self, receiver=None):
        self.receiver, self.sizes = receiver, []

    def send(self, frame, timeout=None):
        body = json.dumps(frame, separators=(",", ":")).encode()
        self.sizes.append(len(body))
        if self.receiver is not None:
            self.receiver.on_frame(self, json.loads(body))
        return True


def _in_process():
    """Rank 0's own replica: the engine's outputs straight into the stream."""
    engine, stream, deltas, costs = _engine(), _stream(), [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            costs.append(_allocated(lambda: deltas.append(stream.advance(out, engine.tokenizer))))
    return stream, deltas, costs, []


def _remote():
    """Another replica: its leader's uplink reports each step to rank 0, whose mirror of
    the request feeds the stream."""
    engine, stream, deltas, costs = _engine(), _stream(), [], []
    remote = replicas.RemoteReplica(1, _Pipe())
    pipe = _Pipe(remote)
    uplink = replicas.ReplicaUplink(pipe)
    remote.submit("r", PROMPT, PARAMS, None,
                  lambda out: deltas.append(stream.advance(out, engine.tokenizer)))
    while engine.has_unfinished_requests():
        for out in engine.step():
            uplink.sink(out)
        stats = engine.stats()
        costs.append(_allocated(lambda: uplink.on_step(0.0, 0.01, stats)))
    return stream, deltas, costs, pipe.sizes


@pytest.mark.parametrize("path", [_in_process, _remote], ids=["in_process", "remote"])
def test_a_steps_server_work_does_not_grow_with_the_answer(path):
    tracemalloc.start()
    try:
        stream, deltas, costs, sizes = path()
    finally:
        tracemalloc.stop()
    expected = expected_ids(PROMPT, N)
    text = bytes(expected).decode()
    # what was streamed is the whole answer, once, and the stream holds it all at the end
    assert stream.finished and stream.finish_reason == "length"
    assert list(stream.token_ids) == expected and stream.text == text
    assert "".join(d.text for d in deltas) == text
    assert [t for d in deltas for t in d.token_ids] == expected
    assert len(stream.logprobs) == N and len([lp for d in deltas for lp in d.logprobs]) == N
    assert len(costs) == N
    early, late = statistics.median(costs[50:150]), statistics.median(costs[-100:])
    assert late <= early + 256, (early, late)  # bytes allocated at a step's peak
    if sizes:  # bytes of a report across the replica link (its counters gain digits)
        early, late = statistics.median(sizes[50:150]), statistics.median(sizes[-100:])
        assert late <= early + 16, (early, late)


@given(st.lists(st.text(min_size=1, max_size=5), max_size=8), st.integers(-30, 30) | st.none(),
       st.integers(-30, 30) | st.none(), st.integers(0, 8))
def test_text_so_far_slices_as_the_joined_text_as_it_was(pieces, start, stop, later):
    """A view holds the text as it was when made: pieces appended later do not show."""
    mirror = replicas._Mirror(None, [], None)
    for piece in pieces:
        mirror.text.append(piece)
    view = mirror.text.view()
    for i in range(later):
        mirror.text.append(f"+{i}")
    text = "".join(pieces)
    assert len(view) == len(text) and str(view) == text
    assert view[start:stop] == text[start:stop]
    assert [view[i] for i in range(-len(text), len(text))] == list(text + text)


# ---- a chat stream's parsers: reasoning (--reasoning-parser qwen3) and tool calls ----

_WORDS = "Hello wörld, ünïcode → ok. "  # no tag in it; multi-byte characters
_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "'
_ANSWERS = {  # what comes before 2000 chunks of words, and where the words land
    "reasoning": ("<think>", "reasoning"),
    "content": ("<think>plan</think>", "content"),
    "tool_arguments": ("<think>plan</think>Let me look." + _CALL, "arguments"),
}


def _chat_chunks(opening, chunks):
    """The deltas of a chat stream of `opening` then `chunks` chunks of 3 characters, through
    a chat format with the qwen3 reasoning parser and tools: per kind, what was sent; and
    what each chunk allocated at its peak."""
    from msinfer.server import protocol
    from msinfer.server.serving import Delta
    from msinfer.server.serving_chat import ChatFormat
    body = protocol.ChatCompletionRequest(model="m", messages=[{"role": "user",
                                                                "content": "x"}])
    fmt = ChatFormat(body, "m", None, reasoning_parser="qwen3", tool_choice="auto")
    words = _WORDS * (3 * chunks // len(_WORDS) + 1)
    deltas = [opening] + [words[3 * i:3 * i + 3] for i in range(chunks)]
    sent, costs = {"reasoning": "", "content": "", "arguments": "", "names": ""}, []
    for i, text in enumerate(deltas):
        finish = "length" if i == len(deltas) - 1 else None
        chunk = []
        costs.append(_allocated(lambda: chunk.append(fmt.chunk(0, Delta(text, [], []),
                                                               finish))))
        delta = chunk[0].choices[0].delta
        sent["reasoning"] += delta.reasoning_content or ""
        sent["content"] += delta.content or ""
        for call in delta.tool_calls or ():
            sent["names"] += call["function"].get("name") or ""
            sent["arguments"] += call["function"].get("arguments") or ""
    return sent, words[:3 * chunks], costs


@pytest.mark.parametrize("answer", list(_ANSWERS))
def test_a_chat_chunks_parsing_does_not_grow_with_the_answer(answer):
    """Each chunk of a chat stream with a reasoning parser and tools costs what it adds:
    the parsers keep where they searched and what they sent, not a search of the whole text
    so far (the chunks' medians from the 300th and the last 100 of 2000)."""
    opening, lands = _ANSWERS[answer]
    tracemalloc.start()
    try:
        sent, words, costs = _chat_chunks(opening, N)
    finally:
        tracemalloc.stop()
    expected = {"reasoning": "", "content": "", "arguments": "", "names": ""}
    expected[lands] = words
    if answer != "reasoning":
        expected["reasoning"] = "plan"
    if answer == "tool_arguments":
        expected.update(content="Let me look.", names="get_weather",
                        arguments=('{"city": "' + words).rstrip())  # the end closes it
    assert sent == expected
    early, late = statistics.median(costs[300:400]), statistics.median(costs[-100:])
    assert late <= early + 256, (early, late)


# what answers are made of: the tags whole and cut, the calls' JSON in pieces, plain text
_REASONING_PARTS = ["<think>", "</think>", "<", "</", "<th", "ink>", "</thi", ">", "a", "bc",
                    " ", "\n", "é→"]
_TOOL_PARTS = ["<tool_call>", "</tool_call>", "<tool_", "call>", "</tool", "<", "\n", " ",
               '{"name": "f", "arguments": ', '{"name":"g\\"h","arguments":', '{"x": 1}', "}",
               '"', "\\", '{"arguments": {}, "name": "k"}', "{", "é", "ab", "\t"]


@st.composite
def _answer_in_chunks(draw, parts):
    """An answer made of `parts`, cut into chunks at random (empty ones too)."""
    text = "".join(draw(st.lists(st.sampled_from(parts), max_size=14)))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@given(_answer_in_chunks(_REASONING_PARTS), st.booleans())
def test_the_reasoning_split_streams_as_it_did_searching_the_whole_text(chunks, thinking):
    import stream_parsers_before as before
    from msinfer.server.reasoning import StreamSplitter
    new, old = StreamSplitter(thinking), before.StreamSplitter(thinking)
    for i, chunk in enumerate(chunks):
        finished = i == len(chunks) - 1
        assert new.feed(chunk, finished) == old.feed(chunk, finished), (chunks, i)


@given(_answer_in_chunks(_TOOL_PARTS))
def test_tool_calls_stream_as_they_did_searching_the_whole_text(chunks):
    """Feed by feed the same content and call deltas (call ids by the order they came)."""
    import stream_parsers_before as before
    from msinfer.server.tool_calls import ToolCallStream

    def feeds(stream):
        ids, out = {}, []
        for i, chunk in enumerate(chunks):
            try:
                content, deltas = stream.feed(chunk, i == len(chunks) - 1)
            except ValueError as e:  # a name whose escape JSON refuses, in both alike
                return out + [repr(e)]
            for d in deltas:
                if "id" in d:
                    d = {**d, "id": ids.setdefault(d["id"], len(ids))}
                out.append(d)
            out.append((content, stream.called))
        return out

    assert feeds(ToolCallStream()) == feeds(before.ToolCallStream()), chunks
