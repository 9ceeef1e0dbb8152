"""Which sequences run in the next engine step: continuous batching with chunked prefill.

Pure Python over `Sequence`s and a `BlockManager`: no model, no clock, no randomness, so every
rank of a sharded job that sees the same requests in the same order makes the same decisions.

Each step:
1. decode every admitted sequence with exactly one pending token. One that needs a new block
   when none is free preempts the latest admitted running sequence (its blocks are freed and it
   goes back to the front of the queue, to be recomputed later; possibly itself), then the
   next latest admitted, until the block fits;
2. fill the prefill budget (`max_prefill_tokens`) with chunks: first of sequences already
   prefilling, then of waiting ones admitted in queue order (arrival order, preempted
   sequences back at the front) while there is a sequence slot
   (`max_num_seqs`) and free blocks for the whole prompt (so an admitted prefill never stalls
   for blocks). A sequence whose prefix is in the prefix cache starts its prefill after it. A queue head that does not fit waits; nothing overtakes it. The chunks of one
   step attend over their sequences' contexts side by side, and those together stay within
   `max_context` positions (the runner's largest context bucket).
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import time

from ..engine_config import EngineLimits
from .block_manager import BlockManager
from .sequence import Sequence, Status


@dataclasses.dataclass
class Chunk:
    """Prefill of positions start .. start + count - 1 of `seq`; or, with a `proposal`
    (speculative decoding), the verification of a decoding sequence: its last token and the
    proposed tokens after it, each position's logits needed."""

    seq: Sequence
    start: int
    count: int
    proposal: tuple = ()
    # a decoding sequence's one token run in the prefill call beside the step's
    # verifications (speculative decoding), so that the step is one call, not two
    rides: bool = False

    @property
    def completes(self) -> bool:
        """Reaches the sequence's last token (and its proposals): logits give the next token."""
        return self.start + self.count == self.seq.length + len(self.proposal)

    def token_ids(self) -> list[int]:
        end = self.start + self.count
        return (self.seq.token_slice(self.start, min(end, self.seq.length))
                + list(self.proposal[:end - max(self.start, self.seq.length)]))

    def logit_positions(self) -> list[int]:
        """The positions of this chunk whose logits the step needs, ascending: those that
        score prompt tokens (Sequence.unscored_prompt), then the last one when it completes;
        a verification's every position."""
        end = self.start + self.count
        if self.proposal:
            return list(range(self.start, end))
        unscored = self.seq.unscored_prompt
        positions = list(range(max(self.start, unscored.start), min(end, unscored.stop)))
        if self.completes:
            positions.append(end - 1)
        return positions


@dataclasses.dataclass
class Schedule:
    decodes: list[Sequence]  # one new token each
    chunks: list[Chunk]
    preempted: list[Sequence]  # this step, latest admitted first; none of them scheduled
    # decoding sequences that may verify proposals (speculative decoding): Chunks from their
    # last token, counting the proposals the scheduler made room for; the engine fills in
    # the proposals (LLMEngine.begin_step), and those left with none decode in `decodes`
    verifies: list[Chunk] = dataclasses.field(default_factory=list)
    # (prefill tokens, context positions) the step's chunks and verifications leave
    room: tuple = (0, 0)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.chunks and not self.verifies

    def describe(self) -> str:
        tokens = sum(c.count for c in self.chunks)
        proposed = sum(len(c.proposal) for c in self.verifies)
        return (f"{len(self.decodes)} decodes, {len(self.verifies)} verifications "
                f"({proposed} proposed tokens) and {len(self.chunks)} prefill chunks "
                f"({tokens} tokens)")

    def digest(self) -> str:
        """What the ranks of a tensor group must agree on before they run a step together:
        which sequences, at which positions, in which cache blocks, holding which tokens (the
        sampled ones the followers took from the leader included; 16 hex digits)."""
        h = hashlib.blake2b(digest_size=8)
        for seq in self.decodes:
            h.update(f"d{seq.request_id}:{seq.length}:{seq.token_hash()}:"
                     f"{seq.block_table};".encode())
        for c in self.verifies + self.chunks:
            h.update(f"c{c.seq.request_id}:{c.start}:{c.count}:{c.seq.token_hash()}:"
                     f"{c.proposal}:{c.seq.block_table};".encode())
        return h.hexdigest()


class Scheduler:
    def __init__(self, blocks: BlockManager, limits: EngineLimits) -> None:
        """limits: the EngineConfig's; max_model_len is also the largest context a step may
        hold (the runner's largest context bucket)."""
        self.blocks = blocks
        self.max_num_seqs = limits.max_num_seqs
        self.max_prefill_tokens = limits.max_prefill_tokens
        self.max_context = limits.max_model_len
        self.waiting: collections.deque[Sequence] = collections.deque()  # preempted at the front
        # admitted, in admission order: the last is the latest admitted, preempted first
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self, lookahead=None) -> Schedule:
        """This step's decisions. `lookahead(seq, decoding)`: with speculative decoding, the
        tokens to make room for after a decoding sequence's last one (0: none), asked once
        per decoding sequence, `decoding` of them in the step."""
        preempted = []
        decodes = self._decodes(preempted)
        chunks, budget, context = self._prefill_chunks(preempted)
        verifies = []
        if lookahead is not None:  # what the prefill chunks and admissions leave
            decodes, verifies, budget, context = self._verifications(decodes, lookahead,
                                                                     budget, context)
        return Schedule(decodes, chunks, preempted, verifies, (budget, context))

    def _decodes(self, preempted):
        """Every admitted sequence with one pending token, with a block for it; preempting
        the latest admitted (added to `preempted`) while none is free."""
        decodes = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or seq.prefilling:
                continue
            while not self.blocks.can_hold(seq, seq.length):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self.blocks.grow(seq, seq.length)
                decodes.append(seq)
        return [s for s in decodes if s.status is Status.RUNNING]

    def _prefill_chunks(self, preempted):
        """(chunks, prefill budget left, context left): chunks of the sequences prefilling,
        then of waiting ones admitted in queue order."""
        chunks = []
        budget = self.max_prefill_tokens
        context = self.max_context
        for seq in self.running:
            chunk = self._chunk(seq, budget, context) if seq.prefilling else None
            if chunk:
                chunks.append(chunk)
                budget -= chunk.count
                context -= chunk.start + chunk.count
        while budget and context >= 1 and self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if any(seq is p for p in preempted):
                break  # its blocks went to a decode of this step: it waits a step at least
            matched = self.blocks.match(seq)  # its prefix already in the cache, if any
            if not self.blocks.can_admit(seq, matched):
                break
            self.waiting.popleft()
            self._admit(seq, matched)
            # even one pending token (a one-token prompt, or the rest of a cached one) is a
            # chunk: it gets its logits in this step
            chunk = self._chunk(seq, budget, context)
            if chunk:  # else no context left this step: it goes on next step
                chunks.append(chunk)
                budget -= chunk.count
                context -= chunk.start + chunk.count
        return chunks, budget, context

    def _admit(self, seq, matched):
        self.blocks.admit(seq, matched)
        if seq.cached_tokens is None:
            seq.cached_tokens = len(matched) * self.blocks.layout.block_size
            seq.scheduled_at = time.monotonic()  # read by metrics only, never decides
        seq.status = Status.RUNNING
        self.running.append(seq)

    def _verifications(self, decodes, lookahead, budget, context):
        """(plain decodes, verifications, prefill budget left, context left): a decoding
        sequence verifies proposals when it
        wants some and its last token with them fits what the step's prefill chunks and
        admissions left of its prefill budget, context and free blocks (taken now for all of
        them: the engine gives back what goes unused). Verifications run in the prefill call
        (Chunk.proposal); speculation takes nothing a prompt needs: a prompt's chunks and a
        new admission go first (a verification's context, the sequence's whole length, would
        otherwise crowd prompts out of the call's context)."""
        plain, verifies = [], []
        for seq in decodes:
            wanted = lookahead(seq, len(decodes))
            span = seq.length + wanted
            if (wanted and 1 + wanted <= budget and span <= context
                    and self.blocks.can_hold(seq, span)):
                self.blocks.grow(seq, span)
                verifies.append(Chunk(seq, seq.computed, 1 + wanted))
                budget -= 1 + wanted
                context -= span
            else:
                plain.append(seq)
        return plain, verifies, budget, context

    def _chunk(self, seq: Sequence, budget: int, context: float) -> Chunk | None:
        """The next chunk of `seq` within the token budget and the context left (its chunk
        attends over positions 0 .. start + count - 1); None when nothing fits."""
        count = min(seq.pending, budget, context - seq.computed)
        return Chunk(seq, seq.computed, count) if count > 0 else None

    def _preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and queue it first, to be recomputed from its first token."""
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.computed = 0
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)
