"""Suffix decoding (vLLM's method "suffix": vllm/v1/spec_decode/suffix_decoding.py over Arctic
Inference's SuffixDecodingCache, arctic_inference/suffix_decoding/cache.py; the paper is
arXiv 2411.04975).

Two kinds of suffix tree (suffix_tree.py), both cut at suffix_decoding_max_tree_depth tokens:
- one per request, over its prompt and output so far;
- one global tree over the OUTPUTS (not prompts) of the last suffix_decoding_max_cached_requests
  requests, fed as they generate; the oldest request's output is removed when a new request
  would make one too many (FIFO, as Arctic's cache; 0: no global tree).

Each step, with the last max_tree_depth tokens as context: for every match length m (1 up to
the context's length - 1, stopping at the first suffix that occurs nowhere or is never
followed by anything, as no longer one is), the most frequent continuation of the matched
path is followed while its estimated probability (the product of count ratios) stays
>= suffix_decoding_min_token_prob, for at most
min(k, int(m x suffix_decoding_max_spec_factor)) tokens. The draft of the highest score (sum of
its tokens' probabilities; ties to the longer match) wins; the request's own tree's draft is
taken over the global one's unless the global one scores higher. One path, no token tree: that
is what the engine verifies. Ties between equally frequent continuations go to the smaller
token id (Arctic's order there is an artifact of its linked lists); no clock, no randomness,
so every rank of a tensor group proposes the same tokens.

Proposals from the global tree depend on what other requests generated; a seeded sampled
request's tokens do not (verify.py draws one token per row, whatever was proposed), so it may
use them.
"""
from __future__ import annotations

import collections

from .proposer import Proposer
from .suffix_tree import SuffixTree


class _Request:
    __slots__ = ("tree", "seen", "global_id")

    def __init__(self, tree: SuffixTree, global_id: int | None):
        self.tree = tree  # over prompt + output
        self.seen = 0  # tokens of the sequence in `tree`
        self.global_id = global_id  # its output's sequence in the global tree, or None


class SuffixProposer(Proposer):
    def __init__(self, config):
        self.max_depth = config.suffix_decoding_max_tree_depth
        self.max_cached = config.suffix_decoding_max_cached_requests
        self.max_spec_factor = config.suffix_decoding_max_spec_factor
        self.min_token_prob = config.suffix_decoding_min_token_prob
        self._requests: dict[str, _Request] = {}
        self._global = SuffixTree(self.max_depth, removable=True)
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._next_global_id = 0

    def propose(self, seqs: list, counts: list[int]) -> list[list[int]]:
        """Up to counts[i] tokens for seqs[i]. Sequences are taken in order (each one's new
        tokens enter the global tree before the next proposes), the same on every rank."""
        out = []
        for seq, k in zip(seqs, counts):
            context = self._update(seq)
            out.append(self._speculate(seq.request_id, context, k) if k > 0 else [])
        return out

    def finished(self, seq) -> None:
        """Its own tree goes; its output stays in the global tree until evicted."""
        self._requests.pop(seq.request_id, None)

    def _start(self, request_id: str) -> _Request:
        global_id = None
        if self.max_cached > 0:
            global_id = self._next_global_id
            self._next_global_id += 1
            self._cached[global_id] = None
            while len(self._cached) > self.max_cached:
                oldest, _ = self._cached.popitem(last=False)
                self._global.remove(oldest)
        request = self._requests[request_id] = _Request(SuffixTree(self.max_depth),
                                                        global_id)
        return request

    def _update(self, seq) -> list[int]:
        """Feeds the tokens added since the last call to the trees; the context (the last
        max_tree_depth tokens)."""
        request = self._requests.get(seq.request_id) or self._start(seq.request_id)
        prompt = len(seq.prompt_token_ids)
        total = prompt + len(seq.generated)
        if total > request.seen:
            new = seq.token_slice(request.seen, total)
            request.tree.extend(0, new)
            if request.global_id in self._cached:
                self._global.extend(request.global_id, new[max(prompt - request.seen, 0):])
            request.seen = total
        return seq.token_slice(max(total - self.max_depth, 0), total)

    def _speculate(self, request_id: str, context: list[int], k: int) -> list[int]:
        tokens, score = self._best_draft(self._requests[request_id].tree, context, k)
        other, other_score = self._best_draft(self._global, context, k)
        return other if other_score > score else tokens

    def _best_draft(self, tree: SuffixTree, context: list[int], k: int):
        """The best draft over match lengths 1 .. len(context) - 1 (Arctic's
        SuffixTree::speculate, path mode)."""
        best, best_score = [], 0.0
        for m in range(1, len(context)):
            found = tree.match(context[len(context) - m:])
            if found is None or not tree.continues(*found):
                # a longer suffix matches (or continues) only where this one does
                break
            limit = min(k, int(m * self.max_spec_factor + 1e-6))
            tokens, score = tree.follow(*found, limit, self.min_token_prob)
            if score >= best_score:
                best, best_score = tokens, score
        return best, best_score
