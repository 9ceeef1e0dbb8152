"""What every proposer offers the engine: up to k next tokens for each decoding sequence,
drawn from something cheaper than the target model. The engine verifies them all in one
forward of the target (engine/speculative/verify.py), so a proposal costs only when it is
wrong, and then little.

Proposals must be the same on every rank of a tensor group (each rank proposes for itself,
and the schedule digest the ranks compare covers them): a proposer decides from the
sequences' tokens and what it was told before, in the same order on every rank; no clock,
no randomness of its own.
"""
from __future__ import annotations


class Proposer:
    def propose(self, seqs: list, counts: list[int]) -> list[list[int]]:
        """For each sequence of `seqs` (engine/sequence.py Sequence: prompt_token_ids +
        generated are its tokens so far), at most `counts[i]` proposed next tokens; [] when
        it has nothing to propose. Proposals may come from other requests too: a seeded
        request's tokens do not depend on them (verify.py)."""
        raise NotImplementedError

    def finished(self, seq) -> None:
        """`seq` ended (any reason): what it generated may serve later requests."""
