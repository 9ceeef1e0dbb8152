"""The engine's speculative decoding, apart from the model calls: how many tokens each
decoding sequence may propose (adaptive.py), asking the proposer and fitting the schedule to
what it proposed, and, once verified, the counters vLLM reports (vllm:spec_decode_*).

A step with speculation (LLMEngine.begin_step): the scheduler makes room for up to k tokens
after each decoding sequence that wants them (Schedule.verifies), the proposer fills them in,
the engine runs those sequences' last token and proposals through the prefill call (one
forward: every position's logits) and keeps the run its sampling agrees with (verify.py).
"""
from __future__ import annotations

from ..scheduler import Chunk
from .adaptive import ProposalBudget
from .verify import accepted_count


class Speculation:
    def __init__(self, config, proposer):
        self.config = config
        self.proposer = proposer
        self.budget = ProposalBudget(config)
        self.num_drafts = 0  # verifications of at least one proposed token
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens

    def lookahead(self, max_model_len):
        """The scheduler's `lookahead` for a new step: room for this many proposals after
        `seq`."""
        self.budget.new_step()
        return lambda seq, decoding: self.budget.wanted(seq, decoding, max_model_len)

    def propose(self, schedule, blocks) -> None:
        """Fill `schedule.verifies` with the proposer's tokens; a sequence given none decodes
        plainly. The blocks taken for proposals not made are given back. When some verify,
        the plain decodes that fit ride in the same prefill call (Chunk.rides): a step of
        one call, not a verification call and a decode call."""
        chunks = schedule.verifies
        proposals = self.proposer.propose([c.seq for c in chunks], [c.count - 1 for c in chunks])
        kept = []
        budget, context = schedule.room
        for chunk, proposal in zip(chunks, proposals):
            proposal = tuple(int(t) for t in proposal[:chunk.count - 1])
            blocks.shrink(chunk.seq, chunk.seq.length + len(proposal))
            if proposal:  # the room it took for proposals not made goes back
                budget += chunk.count - 1 - len(proposal)
                context += chunk.count - 1 - len(proposal)
                chunk.proposal, chunk.count = proposal, 1 + len(proposal)
                kept.append(chunk)
            else:  # all of it
                budget += chunk.count
                context += chunk.start + chunk.count
                schedule.decodes.append(chunk.seq)
        schedule.verifies = kept
        if kept:
            riding = []
            for seq in schedule.decodes:
                if budget >= 1 and context >= seq.length:
                    riding.append(seq)
                    budget -= 1
                    context -= seq.length
            schedule.decodes = [s for s in schedule.decodes if s not in riding]
            kept += [Chunk(seq, seq.computed, 1, rides=True) for seq in riding]

    def verified(self, chunk, tokens) -> None:
        """`chunk`'s sequence emitted `tokens` from its verification: count them, and tell the
        budget how the proposal fared."""
        proposal = chunk.proposal
        accepted = accepted_count(tokens, proposal)
        self.num_drafts += 1
        self.num_draft_tokens += len(proposal)
        self.num_accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_pos[position] += 1
        self.budget.proposed(chunk.seq, len(proposal), accepted)

    def finished(self, seq) -> None:
        self.proposer.finished(seq)
        self.budget.finished(seq)
