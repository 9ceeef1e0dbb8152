"""Speculative decoding's acceptance said in a progress line, from two EngineStats: what the
steps between them proposed and kept (vLLM's SpecDecodingLogging, in short).

    spec: acceptance 0.62, mean accepted 2.5/4 per draft (by position 0.91 0.70 0.52 0.35)

acceptance: accepted / proposed tokens; mean accepted: accepted tokens per draft (a sequence's
proposals of one step) out of k, num_speculative_tokens (vLLM's "mean acceptance length" is
one more: it counts the token the verifying forward adds itself); by position: the share of
drafts whose i-th proposal was accepted.
"""
from __future__ import annotations


def acceptance_words(before, after, k: int) -> str | None:
    """The line's words for the steps between EngineStats `before` and `after`; None when
    they verified no draft."""
    drafts = after.spec_num_drafts - before.spec_num_drafts
    if drafts <= 0:
        return None
    proposed = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    old = list(before.spec_accepted_per_pos) + [0] * k
    new = list(after.spec_accepted_per_pos) + [0] * k
    by_position = " ".join(f"{(new[i] - old[i]) / drafts:.2f}" for i in range(k))
    return (f"spec: acceptance {accepted / proposed if proposed else 0.0:.2f}, mean accepted "
            f"{accepted / drafts:.1f}/{k} per draft (by position {by_position})")
