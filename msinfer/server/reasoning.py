"""Reasoning parsers: a thinking model's answer split into `reasoning_content` and `content`,
as vLLM's `--reasoning-parser` does.

qwen3 (vLLM's Qwen3ReasoningParser): the model thinks between `<think>` and `</think>`, then
answers. Where the answer starts thinking: at a `<think>` it writes (Qwen3's hybrid models),
or at once when the rendered prompt ends inside an open think block (`prompt_opens_thinking`:
the templates of Qwen3's thinking-only models end with `<think>`). The reasoning runs to
`</think>` (or to the end of an answer cut short), the content is what follows (with any text
before `<think>`, which Qwen3 does not write); an answer that never thinks is all content.
Streamed and whole split the same way. With `"chat_template_kwargs": {"enable_thinking":
false}` Qwen3's template closes an empty think block in the prompt: the answer is content.
"""

PARSERS = ("qwen3",)
_START, _END = "<think>", "</think>"


def prompt_opens_thinking(prompt):
    """Whether a rendered chat prompt ends inside a think block (its last `<think>` after its
    last `</think>`): the answer then starts as reasoning."""
    return prompt.rfind(_START) > prompt.rfind(_END)


def _split(text, thinking):
    """(reasoning, content, whether it thought) of `text`, an answer so far."""
    before, started, after = text.partition(_START)
    if started:
        thinking, text = True, after
    else:
        before = ""
    if not thinking:
        return "", before + text, False
    reasoning, _, content = text.partition(_END)
    return reasoning, before + content, True


def split_whole(text, thinking=False):
    """(reasoning or None, content or None) of a finished answer; `thinking`: the prompt
    opened a think block (prompt_opens_thinking)."""
    reasoning, content, thought = _split(text, thinking)
    if not thought:
        return None, text
    return reasoning, content or None


class StreamSplitter:
    """Turns the text deltas of one streamed choice into (reasoning delta, content delta),
    as `_split` splits the text so far, at the cost of what each delta adds: it keeps the
    text in pieces, where the tags are (each searched for in the new text only) and how much
    of each part it sent. The last feed is the one `finished`."""

    def __init__(self, thinking=False):
        # here, not at the top: the CLI reads PARSERS without the engine's imports (jinja2...)
        from ..engine.text import GrowingText, Search
        self._thinking = thinking
        self._text = GrowingText()
        self._start = Search(_START)  # the first <think>
        self._end = Search(_END)  # the first </think> after it (or from 0 when thinking)
        self._sent_reasoning = 0
        self._sent_content = 0

    def feed(self, delta, finished):
        text = self._text
        text.append(delta)
        visible = len(text) if finished else len(text) - _partial_tag(text[-len(_END):])
        (reasoning, reasoning_end), (head, tail) = self._parts(visible)
        new_reasoning = text[reasoning + self._sent_reasoning:reasoning_end]
        if self._sent_content < head:  # content is text[:head] + text[tail:visible]
            new_content = text[self._sent_content:head] + text[tail:visible]
        else:
            new_content = text[tail + self._sent_content - head:visible]
        self._sent_reasoning += len(new_reasoning)
        self._sent_content += len(new_content)
        return new_reasoning, new_content

    def _parts(self, visible):
        """Where `_split` of text[:visible] finds its parts: the reasoning's (start, end),
        and the content's (end of its head, start of its tail, which runs to `visible`)."""
        opened = self._start(self._text, visible)
        if opened is None and not self._thinking:
            return (0, 0), (visible, visible)
        reasoning = 0 if opened is None else opened + len(_START)
        if self._end.start != reasoning:  # <think> found: </think> counts from after it
            self._end.restart(reasoning)
        closed = self._end(self._text, visible)
        if closed is None:
            return (reasoning, visible), (opened or 0, visible)
        return (reasoning, closed), (opened or 0, closed + len(_END))


def _partial_tag(end):
    """How many of the last characters of `end` (the text's end, a tag's length or more of
    it) may be the start of a tag still arriving."""
    for tag in (_START, _END):
        for k in range(len(tag) - 1, 0, -1):
            if end.endswith(tag[:k]):
                return k
    return 0
