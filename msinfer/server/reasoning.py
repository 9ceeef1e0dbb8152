"""Reasoning parsers: a thinking model's answer split into `reasoning_content` and `content`,
as vLLM's `--reasoning-parser` does.

qwen3 (vLLM's Qwen3ReasoningParser): the model thinks between `<think>` and `</think>`, then
answers. Whole: a text without `</think>` is all content; else what precedes it (after a
`<think>`, when there is one) is the reasoning and what follows the content (with any text
before `<think>`, which Qwen3 does not write). Streamed: from
`<think>` on the deltas are reasoning, after `</think>` content; a text that never opens
`<think>` is content throughout. With `"chat_template_kwargs": {"enable_thinking": false}`
Qwen3's template closes an empty think block in the prompt, and the answer is all content.
"""

PARSERS = ("qwen3",)
_START, _END = "<think>", "</think>"


def split_whole(text):
    """(reasoning or None, content or None) of a finished answer."""
    before, started, after = text.partition(_START)
    rest = after if started else before
    if _END not in rest:
        return None, text
    reasoning, _, content = rest.partition(_END)
    content = (before if started else "") + content
    return reasoning, content or None


class StreamSplitter:
    """Turns the text deltas of one streamed choice into (reasoning delta, content delta)."""

    def __init__(self):
        self._text = ""
        self._sent_reasoning = 0
        self._sent_content = 0

    def feed(self, delta, finished):
        self._text += delta
        text = self._text if finished else _without_partial_tag(self._text)
        reasoning, content = self._split(text)
        new_reasoning = reasoning[self._sent_reasoning:]
        new_content = content[self._sent_content:]
        self._sent_reasoning += len(new_reasoning)
        self._sent_content += len(new_content)
        return new_reasoning, new_content

    @staticmethod
    def _split(text):
        before, started, after = text.partition(_START)
        if not started:
            return "", text  # not thinking (yet): content
        reasoning, _, content = after.partition(_END)
        return reasoning, before + content


def _without_partial_tag(text):
    """`text` without an ending that may be the start of a tag still arriving."""
    for tag in (_START, _END):
        for k in range(len(tag) - 1, 0, -1):
            if text.endswith(tag[:k]):
                return text[:-k]
    return text
