"""Which proposed tokens the target model keeps: the standard acceptance rule.

The target's forward over a sequence's last token and its k proposals gives k + 1 rows of
scores; row j decides the token after proposal j - 1 exactly as a decode step would (its
penalties, grammar mask and stop checks see the tokens accepted before it: the engine walks
the rows in order). Then:
- greedy: the row's argmax; the proposal is accepted when it is that token, so the output is
  token for token the output without speculation;
- sampled: the proposers here propose one token with certainty (q = 1 for it), so the
  proposal x is accepted with probability min(1, p(x) / q(x)) = p(x), and on rejection the
  token is drawn from the residual max(0, p - q), normalised: p without x (Leviathan et al.
  2023, "Fast Inference from Transformers via Speculative Decoding", as vLLM's rejection
  sampler). The result is distributed as p: the target's distribution is kept, and with a
  seeded generator the draws (one per row) repeat.
The first row that rejects ends the run; after k accepted proposals the last row gives one
more token (the bonus), so a step yields 1 .. k + 1 tokens.
"""
from __future__ import annotations

import numpy as np

from ..sampling import draw, row_distribution


def decide(scores, params, generator, proposed):
    """(the token row `scores` gives, whether it is `proposed`): `scores` one row after
    penalties and grammar mask; `proposed` the proposal there, or None (the bonus row, or no
    proposal): the token sampled as a decode step samples it."""
    if params.greedy:
        token = int(np.argmax(scores))
        return token, token == proposed
    ids, probs = row_distribution(scores, params)
    if proposed is None:
        return int(draw(ids, probs, generator)), False
    at = np.searchsorted(ids, proposed)
    p = probs[at] if at < ids.size and ids[at] == proposed else 0.0
    if generator.random() < p:
        return int(proposed), True
    if p >= 1.0:  # rounding: the proposal held all the mass, nothing else can be drawn
        return int(proposed), True
    residual = probs.copy()
    if p:
        residual[at] = 0.0
    residual /= residual.sum()
    return int(draw(ids, residual, generator)), False


def accepted_count(tokens, proposal) -> int:
    """How many proposals a step's emitted `tokens` accepted: their common prefix (a rejected
    proposal is never the token emitted in its place). Every rank of a tensor group works it
    out from the leader's tokens alike."""
    count = 0
    for token, proposed in zip(tokens, proposal):
        if token != proposed:
            break
        count += 1
    return count
