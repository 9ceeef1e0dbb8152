"""One request in flight: its tokens, its place in the KV cache, how far it has run, and
when it stops (a stop token, a stop string in its text, its grammar complete, its length).

Everything a step does to a sequence costs the same at its 10th token as at its 10,000th:
tokens are appended, never copied (outputs see them through `Prefix` views), the text grows
by pieces (outputs see it through `TextSoFar` views), stop strings are searched in the new
text only, and the running hash of its tokens (what the ranks of a tensor group compare
before each step) is extended, not recomputed.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import enum
import itertools
from typing import TYPE_CHECKING

import numpy as np

from .. import log
from .sampling import SamplingParams
from .tokenizer import find_stop

if TYPE_CHECKING:
    from .structured import GuidedSequence
    from .text import TextSoFar
    from .tokenizer import IncrementalDecoder


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted, or preempted (its blocks given back)
    RUNNING = "running"  # admitted: prefilling in chunks, then decoding
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: np.random.Generator | None = None  # the request's stream (unused when greedy)
    prompt: str | None = None
    generated: list[int] = dataclasses.field(default_factory=list)
    # one {token id: logprob} per generated token, when asked
    logprobs: list[dict[int, float]] | None = None
    # with params.prompt_logprobs: None for the first prompt token, then one {token id:
    # logprob} per prompt token (the leader's; other ranks of a tensor group keep none)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # prompt tokens scored so far (the first needs nothing), on every rank alike: which
    # positions still need logits (unscored_prompt), and so what the prefix cache may serve
    prompt_scored: int = 1
    decoder: IncrementalDecoder | None = None  # of the generated text, with a tokenizer
    # the grammar's state, where this sequence is sampled (engine/structured.py)
    guided: GuidedSequence | None = None
    status: Status = Status.WAITING
    finish_reason: str | None = None
    block_table: list[int] = dataclasses.field(default_factory=list)
    # Tokens whose K/V are in the cache. Reset to 0 on preemption: the prompt and what was
    # generated are computed again (recompute), which gives the same cache and logits.
    computed: int = 0
    preemptions: int = 0
    # prefix caching (block_manager.py): names of the first blocks' contents, how many of the
    # blocks held are named, and the prompt tokens found in the cache when first admitted
    block_names: list[bytes] = dataclasses.field(default_factory=list)
    named_blocks: int = 0
    cached_tokens: int | None = None
    # where the earliest stop string starts in the decoder's text (None: none yet), and how
    # much of the text was searched for one
    stop_at: int | None = None
    searched: int = 0
    # the running hash of prompt + generated tokens, and how many tokens it covers
    hashed: int = 0
    running_hash: int = 0
    scheduled_at: float | None = None  # time.monotonic() when first admitted (queue time ends)

    @property
    def tokens(self) -> list[int]:
        """Prompt and generated tokens, as a new list (the step's paths use token_slice)."""
        return self.prompt_token_ids + self.generated

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens start .. stop - 1 of prompt + generated, copying only those."""
        prompt = len(self.prompt_token_ids)
        return (self.prompt_token_ids[start:min(stop, prompt)]
                + self.generated[max(start - prompt, 0):max(stop - prompt, 0)])

    @property
    def last_token(self) -> int:
        return self.generated[-1] if self.generated else self.prompt_token_ids[-1]

    def append_token(self, token: int) -> None:
        self.generated.append(token)

    def token_hash(self) -> int:
        """A hash of every token so far (prompt and generated), extended by the tokens added
        since the last call: equal on two ranks only if they hold the same tokens."""
        prompt, generated = self.prompt_token_ids, self.generated
        for i in range(self.hashed, self.length):
            token = prompt[i] if i < len(prompt) else generated[i - len(prompt)]
            self.running_hash = (self.running_hash * 1_000_003 + token + 1) % _HASH_MODULUS
        self.hashed = self.length
        return self.running_hash

    def stop_reason(self, token: int, eos_token_ids, max_model_len: int) -> str | None:
        """After `append_token(token)` on the rank that samples: feed the text decoder and
        the grammar; "stop" (an eos or stop token, a stop string, the grammar complete),
        "length" (max_tokens or max_model_len reached) or None."""
        p = self.params
        if self.decoder is not None:
            self.decoder.push(token)
            if p.stop and self.stop_at is None:
                self._search_stop_strings()
        if self.guided is not None and not self.guided.advance(token):
            # cannot happen while the mask holds; said rather than leaving bad output
            log.get().error("request %r: the grammar refused token %d: %s", self.request_id,
                            token, self.guided.error)
            return "stop"
        if (token in eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if self.guided is not None and self.guided.complete:
            return "stop"  # nothing but the end may follow
        if self.stop_at is not None:
            return "stop"
        if len(self.generated) >= p.max_tokens or self.length >= max_model_len:
            return "length"
        return None

    def _search_stop_strings(self) -> None:
        """Search the text added since the last search, from far enough back to find a stop
        string that began in the text already searched (the longest one's length - 1)."""
        text = self.decoder.pieces
        start = max(self.searched - max(map(len, self.params.stop)) + 1, 0)
        found = find_stop(text[start:], self.params.stop)
        self.searched = len(text)
        if found is not None:
            self.stop_at = start + found

    @property
    def text(self) -> str:
        """The decoded text, cut before the first stop string ("" without a tokenizer)."""
        if self.decoder is None:
            return ""
        pieces = self.decoder.pieces
        return str(pieces) if self.stop_at is None else pieces[:self.stop_at]

    def text_so_far(self) -> TextSoFar | str:
        """`text` as a view of the decoder's pieces as they are now (no join, no copy): what
        a running output holds."""
        if self.decoder is None or self.stop_at is not None:
            return self.text
        return self.decoder.pieces.view()

    @property
    def length(self) -> int:
        return len(self.prompt_token_ids) + len(self.generated)

    @property
    def pending(self) -> int:
        """Tokens not in the cache yet: the whole prompt at first, then one per decode step."""
        return self.length - self.computed

    @property
    def prefilling(self) -> bool:
        """More than one pending token: they go through prefill chunks; one goes to decode."""
        return self.pending > 1

    @property
    def in_prompt(self) -> bool:
        """The next token to compute is the prompt's: a decode step computes the last one when
        the budget of the step before left only it to its chunks."""
        return self.computed < len(self.prompt_token_ids)

    @property
    def unscored_prompt(self) -> range:
        """The positions whose logits score a prompt token not scored yet (the token after
        each), when prompt logprobs are asked: they are computed, never served by the prefix
        cache, and the runner returns their logits rows."""
        if self.params.prompt_logprobs is None:
            return range(0)
        return range(self.prompt_scored - 1, len(self.prompt_token_ids) - 1)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


_HASH_MODULUS = (1 << 61) - 1  # a Mersenne prime: the running hash stays a small int


class Prefix(collections.abc.Sequence):
    """The first `len(items)` items of an append-only list, as they are now, without copying
    them: what a RequestOutput holds of its sequence's tokens and logprobs. Compares equal
    to a list of the same items; copies (copy.deepcopy, dataclasses.asdict) and pickles are
    plain lists."""

    __slots__ = ("_items", "_count")

    def __init__(self, items: list):
        self._items, self._count = items, len(items)

    def __len__(self):
        return self._count

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self._count)
            if step > 0:
                return self._items[start:stop:step]
            return [self._items[i] for i in range(start, stop, step)]
        if not -self._count <= index < self._count:
            raise IndexError("Prefix index out of range")
        return self._items[index % self._count]

    def __iter__(self):
        return itertools.islice(self._items, self._count)

    def __eq__(self, other):
        if isinstance(other, (list, tuple, Prefix)):
            return len(other) == self._count and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __add__(self, other):
        return list(self) + list(other)

    def __radd__(self, other):
        return list(other) + list(self)

    def __repr__(self):
        return repr(list(self))

    def __copy__(self):
        return list(self)

    def __deepcopy__(self, memo):
        import copy
        return copy.deepcopy(list(self), memo)

    def __reduce__(self):
        return list, (list(self),)
