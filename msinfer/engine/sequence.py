"""One request in flight: its tokens, its place in the KV cache, and how far it has run."""
import dataclasses
import enum

import numpy as np

from .sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted, or preempted (its blocks given back)
    RUNNING = "running"  # admitted: prefilling in chunks, then decoding
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list
    params: SamplingParams
    generator: np.random.Generator = None  # the request's random stream (unused when greedy)
    prompt: str = None
    arrival: int = 0  # admission order: the scheduler preempts the latest arrival first
    generated: list = dataclasses.field(default_factory=list)
    logprobs: list = None  # one {token id: logprob} per generated token, when asked
    decoder: object = None  # IncrementalDecoder of the generated text, with a tokenizer
    status: Status = Status.WAITING
    finish_reason: str = None
    block_table: list = dataclasses.field(default_factory=list)
    # Tokens whose K/V are in the cache. Reset to 0 on preemption: the prompt and what was
    # generated are computed again (recompute), which gives the same cache and logits.
    computed: int = 0
    preemptions: int = 0

    @property
    def tokens(self) -> list:
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
    def finished(self) -> bool:
        return self.status is Status.FINISHED
