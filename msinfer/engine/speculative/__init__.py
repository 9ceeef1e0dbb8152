"""Speculative decoding: proposers (n-gram prompt lookup, suffix decoding, a draft model)
offer up to k next tokens per sequence; the target model verifies them all in one forward and
keeps the longest run its own sampling agrees with (verify.py)."""
from __future__ import annotations

from ...errors import MsinferError
from .ngram import NgramProposer
from .proposer import Proposer
from .suffix import SuffixProposer


def build_proposer(config) -> Proposer:
    """The proposer of `config.method` (a SpeculativeConfig)."""
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method == "suffix":
        return SuffixProposer(config)
    # "draft_model": the draft model's proposer is built here (it needs the engine's runner)
    raise MsinferError(f"speculative_config: method {config.method!r} has no proposer here "
                       f"(built: ngram, suffix)")
