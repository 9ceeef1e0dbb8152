"""How many tokens to propose for a sequence this step, so that speculation never costs much.

A verification forward over k + 1 positions costs more than a one-token decode step (on CPU
a padded chunk; on any device more compute), and a draft model's proposals cost a draft
forward each; they pay only when accepted. Three rules keep a losing bet small:
- per sequence, the next proposal is as long as the last one earned: all accepted, twice as
  many (up to k); some, one more than were accepted; none, one;
- per sequence, a proposal none of whose tokens were accepted doubles a back-off (2, 4,
  8 ... up to MAX_BACKOFF steps): the sequence proposes again in the first step at least
  that many steps later whose number is a multiple of it (and on, while it finds nothing to
  propose, only in such steps); one accepted token resets it. Text with no repeats stops
  being verified after a few misses, and is tried again now and then, one token at a time.
  The multiples put the tries of sequences backing off alike in the same steps: a step with
  a verification in it costs the whole batch more (its decodes ride in the prefill call),
  so one such step for several sequences costs less than one each;
- per step, no speculation when more sequences decode than `disable_by_batch_size` (vLLM's
  setting): a large batch already reads the weights once for many tokens.
The state changes only from what every rank of a tensor group knows (the tokens the leader
decided), so every rank decides the same counts.
"""
from __future__ import annotations

import dataclasses

MAX_BACKOFF = 32  # steps, at most, a sequence waits before proposing again
# no speculation when more sequences than this decode in a step, unless set (the batch at
# which a verification forward's extra positions stop being nearly free: bench/results/
# speculative.md)
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclasses.dataclass
class _Odds:
    length: int  # tokens the next proposal may have
    backoff: int = 0  # steps waited after the last miss (0: none), the multiple proposed at
    resume: int = 0  # the first step it may propose in again


class ProposalBudget:
    def __init__(self, config):
        self.k = config.num_speculative_tokens
        self.batch_bound = (config.disable_by_batch_size if config.disable_by_batch_size
                            is not None else DEFAULT_DISABLE_BY_BATCH_SIZE)
        self._odds = {}  # request id -> _Odds
        self.step = 0  # the engine's steps with speculation, counted alike on every rank

    def new_step(self) -> None:
        self.step += 1

    def wanted(self, seq, decoding: int, max_model_len: int) -> int:
        """Tokens to propose for `seq` this step (0: decode plainly), with `decoding`
        sequences decoding in the step: k, less where max_tokens or max_model_len end the
        sequence sooner (a step emits at most proposals + 1 tokens)."""
        if decoding > self.batch_bound:
            return 0
        odds = self._odds.get(seq.request_id)
        if odds is not None and odds.backoff and (self.step < odds.resume
                                                  or self.step % odds.backoff):
            return 0
        left = min(seq.params.max_tokens - len(seq.generated), max_model_len - seq.length)
        return max(0, min(self.k if odds is None else odds.length, left - 1))

    def proposed(self, seq, count: int, accepted: int) -> None:
        """`seq` verified `count` proposals (> 0) in this step and kept `accepted` of
        them."""
        odds = self._odds.setdefault(seq.request_id, _Odds(self.k))
        if accepted == count:
            odds.length = min(self.k, 2 * count)
        else:
            odds.length = accepted + 1
        if accepted:
            odds.backoff = 0
        else:
            odds.backoff = min(MAX_BACKOFF, max(2, 2 * odds.backoff))
            odds.resume = self.step + odds.backoff

    def finished(self, seq) -> None:
        self._odds.pop(seq.request_id, None)
