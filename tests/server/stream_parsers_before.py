"""The stream parsers as they were before they became incremental (commit cab8653): each
feed searched the whole text so far. The reference the incremental ones must equal, feed by
feed (tests/server/test_serve_streaming_cost.py)."""
import json

from msinfer.server.reasoning import _END, _START, _split
from msinfer.server.tool_calls import CLOSE, OPEN, _CLOSING, _NAME, _delta, new_call_id


class StreamSplitter:
    """Turns the text deltas of one streamed choice into (reasoning delta, content delta)."""

    def __init__(self, thinking=False):
        self._thinking = thinking
        self._text = ""
        self._sent_reasoning = 0
        self._sent_content = 0

    def feed(self, delta, finished):
        self._text += delta
        text = self._text if finished else _without_partial_tag(self._text)
        reasoning, content, _ = _split(text, self._thinking)
        new_reasoning = reasoning[self._sent_reasoning:]
        new_content = content[self._sent_content:]
        self._sent_reasoning += len(new_reasoning)
        self._sent_content += len(new_content)
        return new_reasoning, new_content


def _without_partial_tag(text):
    """`text` without an ending that may be the start of a tag still arriving."""
    for tag in (_START, _END):
        for k in range(len(tag) - 1, 0, -1):
            if text.endswith(tag[:k]):
                return text[:-k]
    return text


class ToolCallStream:
    """Turns one streamed choice's text deltas into content deltas and tool call deltas
    ({"index", "id", "type", "function": {"name", "arguments"}}, as the openai SDK
    accumulates them): content until `<tool_call>`, then per call its name once known and its
    arguments as they come, holding back what may be the block's closing."""

    def __init__(self):
        self._text = ""
        self._content_sent = 0
        self._calls = []  # per call: [id, name sent?, characters of arguments sent]

    def feed(self, delta, finished):
        """(content delta, [tool call deltas]) after `delta`; `finished` flushes all."""
        self._text += delta
        text = self._text
        start = text.find(OPEN)
        content_end = start if start >= 0 else len(text)
        if start < 0 and not finished:
            content_end = _without_partial(text, OPEN)
        content = text[self._content_sent:content_end]
        self._content_sent = max(self._content_sent, content_end)
        if start < 0:
            return content, []
        deltas = []
        blocks = text[start:].split(OPEN)[1:]
        for index, block in enumerate(blocks):
            closed = CLOSE in block or index < len(blocks) - 1 or finished
            deltas += self._call_deltas(index, block.split(CLOSE)[0], closed)
        return content, deltas

    def _call_deltas(self, index, body, closed):
        while len(self._calls) <= index:
            self._calls.append([new_call_id(), False, 0])
        call = self._calls[index]
        match = _NAME.match(body)
        if match is None:
            if not closed:
                return []
            try:  # a block whose name does not come first: whole, once closed
                parsed = json.loads(body)
                name = parsed["name"]
                arguments = json.dumps(parsed.get("arguments", {}), ensure_ascii=False)
            except (ValueError, KeyError, TypeError):
                return []
            if call[1]:
                return []
            call[1], call[2] = True, len(arguments)
            return [_delta(index, call[0], name, arguments)]
        out = []
        if not call[1]:
            call[1] = True
            out.append(_delta(index, call[0], json.loads(f'"{match.group(1)}"'), ""))
        arguments = body[match.end():]
        if closed:
            end = len(arguments.rstrip())
            if end and arguments[end - 1] == "}":
                end -= 1  # the outer object's closing brace
            arguments = arguments[:end].rstrip()
        else:
            arguments = arguments[:_CLOSING.search(arguments).start()]
        if len(arguments) > call[2]:
            out.append({"index": index, "function": {"arguments": arguments[call[2]:]}})
            call[2] = len(arguments)
        return out

    @property
    def called(self):
        """Whether a call (its name at least) was sent."""
        return any(named for _, named, _ in self._calls)


def _without_partial(text, tag):
    """The length of `text` without an ending that may be the start of `tag`."""
    for k in range(len(tag) - 1, 0, -1):
        if text.endswith(tag[:k]):
            return len(text) - k
    return len(text)
