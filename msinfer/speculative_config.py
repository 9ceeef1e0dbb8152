"""Speculative decoding's settings, as vLLM takes them: `--speculative-config '{"method":
"ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'` on the command line, the same
dict as LLM(speculative_config=...). Validated once here (pure data); the proposers and the
verification step are engine/speculative/.

Methods:
- "ngram": prompt lookup. The last n tokens (prompt_lookup_max down to prompt_lookup_min) are
  looked up earlier in the prompt and output; what followed the match is proposed.
- "suffix": suffix decoding. The longest suffix of the output matched in a suffix tree of
  this request and of the recent requests' outputs; the most frequent continuation proposed.
- "draft_model": a small model of the same tokenizer (`model`, a checkpoint directory)
  decodes the proposals greedily, with its own KV cache.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import numbers

from .errors import MsinferError

METHODS = ("ngram", "suffix", "draft_model")
# ngram's n-gram length when neither prompt_lookup_min nor _max is given (vLLM's)
DEFAULT_PROMPT_LOOKUP = 5
# vLLM's spellings of the methods: accepted, stored under ours
METHOD_ALIASES = {"[ngram]": "ngram", "draft": "draft_model", "eagle_draft": "draft_model"}


def _check_int(field, value, least):
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < least:
        raise MsinferError(f"speculative_config: {field} {value!r} must be an integer "
                           f">= {least}")


def _check_real(field, value, low, high):
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not low <= value <= high:
        raise MsinferError(f"speculative_config: {field} {value!r} must be a number in "
                           f"[{low}, {high}]")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 4  # k: tokens proposed per sequence and step, at most
    # ngram: the longest and shortest n-gram looked up. As vLLM: one given, the other is
    # the same (an n-gram of exactly that length); neither, both DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # draft_model: the draft's checkpoint directory (the target's tokenizer and vocabulary)
    model: str | None = None
    # suffix: deepest continuation followed, requests whose outputs are kept for lookups,
    # proposals at most this factor x the matched length, and the least estimated
    # probability of a proposed token (vLLM's suffix_decoding_* settings)
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # no speculation in a step that decodes more than this many sequences (vLLM's
    # disable_by_batch_size): decode is no longer bound by reading the weights there; None:
    # the engine's own bound (engine/speculative/adaptive.py)
    disable_by_batch_size: int | None = None

    def __post_init__(self):
        method = METHOD_ALIASES.get(self.method, self.method)
        if method not in METHODS:
            raise MsinferError(f"speculative_config: method {self.method!r}: one of "
                               f"{', '.join(METHODS)}")
        object.__setattr__(self, "method", method)
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        lookup_min, lookup_max = self.prompt_lookup_min, self.prompt_lookup_max
        if lookup_min is None and lookup_max is None:
            lookup_min = lookup_max = DEFAULT_PROMPT_LOOKUP
        object.__setattr__(self, "prompt_lookup_min", lookup_max if lookup_min is None
                           else lookup_min)
        object.__setattr__(self, "prompt_lookup_max", lookup_min if lookup_max is None
                           else lookup_max)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1)
        _check_int("prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min)
        _check_int("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth, 1)
        _check_int("suffix_decoding_max_cached_requests",
                   self.suffix_decoding_max_cached_requests, 0)
        _check_real("suffix_decoding_max_spec_factor", self.suffix_decoding_max_spec_factor,
                    0.0, 1e6)
        _check_real("suffix_decoding_min_token_prob", self.suffix_decoding_min_token_prob,
                    0.0, 1.0)
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 1)
        if method == "draft_model" and not self.model:
            raise MsinferError('speculative_config: method "draft_model" needs "model", the '
                               "draft checkpoint's directory")
        if method != "draft_model" and self.model:
            raise MsinferError(f'speculative_config: "model" is for method "draft_model", '
                               f"not {method!r}")

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """From a dict, a JSON object's text (the CLI's --speculative-config), an instance,
        or None (no speculation). An unknown key names the closest known one."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise MsinferError(f"speculative_config: not JSON ({e}): {value!r}") from None
        if not isinstance(value, dict):
            raise MsinferError(f"speculative_config: expected a JSON object, got "
                               f"{type(value).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        for key in value:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise MsinferError(f"speculative_config: unknown key {key!r}{hint}")
        if "method" not in value:
            raise MsinferError(f'speculative_config: "method" is required: one of '
                               f"{', '.join(METHODS)}")
        return cls(**value)
