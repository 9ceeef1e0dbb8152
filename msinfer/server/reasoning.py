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
