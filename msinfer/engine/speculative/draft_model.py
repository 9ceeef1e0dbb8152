"""Proposals from a draft model: a small model of the target's vocabulary (e.g. Qwen2.5-0.5B
for a 7B or 32B) decodes k tokens greedily; the target verifies them in one forward.

The draft runs in the same engine, with its own model runner (its own weights and, on every
rank, its own plan: api.py builds it) and its own KV cache. That cache has the target's
blocks, in number and size, so the target's block tables address it too: a sequence's
positions are in the same blocks in both caches, and the scheduler's room for proposals is
room for the draft's writes.

What the draft's cache holds of a sequence is followed here: the positions it wrote, of
which those the target kept (`seq.computed`: the proposals it accepted, not the rejected
ones; nothing after a preemption) are valid. Before proposing, the draft computes the rest
(a new sequence's whole prompt, or the last one or two tokens), then decodes. Greedy: the
same proposals on every rank, and a proposal of one token with certainty, which the
acceptance rule (verify.py) takes as such.
"""
from __future__ import annotations

import numpy as np

from ..scheduler import Chunk
from .proposer import Proposer


class _Draft:
    """A sequence as the draft's runner sees it: the target's tokens and blocks, and the
    draft's own tokens after them."""

    unscored_prompt = range(0)

    def __init__(self, seq):
        self.seq = seq
        self.block_table = seq.block_table
        self.proposed = []

    @property
    def length(self):
        return self.seq.length + len(self.proposed)

    @property
    def last_token(self):
        return self.proposed[-1] if self.proposed else self.seq.last_token

    def token_slice(self, start, stop):
        return self.seq.token_slice(start, stop)


class DraftModelProposer(Proposer):
    def __init__(self, runner, max_prefill_tokens: int, max_context: int):
        """runner: the draft's ModelRunner (decode, prefill); its chunks within
        `max_prefill_tokens` and `max_context` (the engine's limits)."""
        self.runner = runner
        self.max_prefill_tokens = max_prefill_tokens
        self.max_context = max_context
        self.written = {}  # request id -> positions 0 .. n - 1 the draft's cache has written

    def propose(self, seqs, counts):
        drafts = [_Draft(seq) for seq in seqs]
        first = self._catch_up(drafts)
        for draft, token in zip(drafts, first):
            draft.proposed.append(token)
        for step in range(1, max(counts, default=0)):
            going = [d for d, count in zip(drafts, counts) if count > step]
            if not going:
                break
            rows = self.runner.decode(going)  # writes each one's last token's K/V
            for draft, row in zip(going, rows):
                self.written[draft.seq.request_id] = draft.length
                draft.proposed.append(int(np.argmax(row)))
        return [d.proposed[:count] for d, count in zip(drafts, counts)]

    def _catch_up(self, drafts):
        """The draft's cache brought to each sequence's last token (the valid positions kept,
        the rest computed in prefill calls within the limits); the first proposal of each,
        from its last token's logits."""
        first = [None] * len(drafts)
        todo = []
        for i, draft in enumerate(drafts):
            seq = draft.seq
            valid = min(self.written.get(seq.request_id, 0), seq.computed)
            todo.append((i, draft, valid))
        while todo:
            chunks, owners, later = [], [], []
            tokens, context = self.max_prefill_tokens, self.max_context
            for i, draft, start in todo:
                count = min(draft.length - start, tokens, context - start)
                if count <= 0:
                    later.append((i, draft, start))
                    continue
                chunks.append(Chunk(draft, start, count))
                owners.append(i)
                tokens -= count
                context -= start + count
                if start + count < draft.length:
                    later.append((i, draft, start + count))
            rows = self.runner.prefill(chunks)
            completing = [i for i, c in zip(owners, chunks) if c.completes]
            for i, row in zip(completing, rows):
                first[i] = int(np.argmax(row))
            for c in chunks:
                self.written[c.seq.seq.request_id] = c.start + c.count
            todo = later
        return first

    def finished(self, seq):
        self.written.pop(seq.request_id, None)
