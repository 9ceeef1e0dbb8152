"""N-gram prompt lookup (vLLM's method "ngram"): the last n tokens of a sequence, for n from
prompt_lookup_max down to prompt_lookup_min, are looked up earlier in its prompt and output;
the tokens that followed the match are proposed.

Which match, as vLLM v1 picks it (vllm/v1/spec_decode/ngram_proposer.py,
_find_longest_matched_ngram_and_propose_tokens: a KMP over the reversed tokens that keeps
"the target n-gram of the earliest position"): the longest n that has an earlier occurrence,
and of that n-gram's occurrences the EARLIEST one. An occurrence may overlap the suffix itself
but must end before the last token, so at least one token follows it; the proposal is the up
to k tokens after it, fewer when the sequence ends sooner.

Cost: each sequence keeps an index {n-gram: start of its earliest occurrence}, extended by the
tokens added since the last call (O(new tokens x (max - min + 1)) per step) and dropped by
finished(); a lookup is max - min + 1 dict probes. Memory: about 0.1 KB per distinct
n-gram, so at most that x (max - min + 1) per token (bench/proposers.py).
"""
from __future__ import annotations

from .proposer import Proposer


class _NgramIndex:
    """One sequence's n-grams (lengths min_n .. max_n), each mapped to its earliest start."""

    __slots__ = ("earliest", "indexed")

    def __init__(self):
        self.earliest: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # tokens of the sequence whose n-grams are in `earliest`


class NgramProposer(Proposer):
    def __init__(self, config):
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self._index: dict[str, _NgramIndex] = {}

    def propose(self, seqs: list, counts: list[int]) -> list[list[int]]:
        return [self._propose_one(seq, k) if k > 0 else [] for seq, k in zip(seqs, counts)]

    def finished(self, seq) -> None:
        self._index.pop(seq.request_id, None)

    def _propose_one(self, seq, k: int) -> list[int]:
        total = len(seq.prompt_token_ids) + len(seq.generated)
        # the last max_n tokens, which every lookup below reads
        tail = seq.token_slice(max(total - self.max_n, 0), total)
        earliest = self._extend(seq, total)
        for n in range(min(self.max_n, total), self.min_n - 1, -1):
            start = earliest.get(tuple(tail[len(tail) - n:]))
            # the earliest occurrence is the suffix itself only when there is no other
            if start is not None and start + n < total:
                follow = start + n
                return seq.token_slice(follow, min(follow + k, total))
        return []

    def _extend(self, seq, total: int) -> dict:
        """The sequence's index, extended by the tokens added since the last call."""
        index = self._index.get(seq.request_id)
        if index is None or index.indexed > total:  # new (or, against the contract, shrunk)
            index = self._index[seq.request_id] = _NgramIndex()
        if index.indexed == total:
            return index.earliest
        # the new tokens and the max_n - 1 before them: every n-gram ending in a new token
        first = max(index.indexed - self.max_n + 1, 0)
        window = seq.token_slice(first, total)
        earliest = index.earliest
        for end in range(index.indexed - first + 1, len(window) + 1):
            for n in range(self.min_n, min(self.max_n, first + end) + 1):
                earliest.setdefault(tuple(window[end - n:end]), first + end - n)
        index.indexed = total
        return earliest
