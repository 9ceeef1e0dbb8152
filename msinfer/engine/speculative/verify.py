"""Which proposed tokens the target model keeps: the standard acceptance rule.

The target's forward over a sequence's last token and its k proposals gives k + 1 rows of
scores; row j decides the token after proposal j - 1 exactly as a decode step would (its
penalties, grammar mask and stop checks see the tokens accepted before it: the engine walks
the rows in order). Then:
- greedy: the row's argmax; the proposal is accepted when it is that token, so the output is
  token for token the output without speculation;
- sampled: the proposers here propose one token with certainty (q = 1 for it). The standard
  rule (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
  vLLM's rejection sampler) accepts the proposal x with probability min(1, p(x) / q(x)) =
  p(x) and on rejection draws from the residual max(0, p - q), normalised: p without x.
  Drawing one token from p and accepting x when it is x is that same rule (accepted with
  probability p(x); otherwise a draw from p conditioned on not x, the residual), with one
  uniform per emitted token, as a decode step draws it: a seeded request's tokens are the
  ones it samples without speculation, whatever was proposed.
The first row that rejects ends the run; after k accepted proposals the last row gives one
more token (the bonus), so a step yields 1 .. k + 1 tokens.
"""
from __future__ import annotations


def decide(sampler, scores, params, generator, proposed, history=None, eos_token_ids=()):
    """(the token row `scores` gives, whether it is `proposed`): the token `sampler` (the
    engine's Sampler) picks from the one row `scores` (after the grammar's mask), as a decode
    step picks it: the penalties of `history` (prompt ids, generated ids) applied, greedy or
    one draw; `proposed` the proposal there, or None (the bonus row, or no proposal)."""
    token = int(sampler(scores[None], [params], [generator],
                        None if history is None else [history], eos_token_ids)[0])
    return token, token == proposed


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
