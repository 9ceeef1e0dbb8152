"""One request in flight: its tokens, its place in the KV cache, and how far it has run."""
from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

import numpy as np

from .sampling import SamplingParams

if TYPE_CHECKING:
    from .structured import GuidedSequence
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
    scheduled_at: float | None = None  # time.monotonic() when first admitted (queue time ends)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_token_ids + self.generated

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
