"""Choosing the next token from logits: SamplingParams (vLLM-like) and a numpy Sampler.

Logits warp in Hugging Face's order (temperature, then top-k, then top-p) so a request means
the same here as in `transformers.generate`. Temperature 0 is greedy: argmax, ties to the
lowest id as torch.argmax does, so greedy output can be compared token for token.
"""
import dataclasses
import math
import numbers
from typing import Optional, Tuple

import numpy as np

from ..errors import MsinferError

# top-p looks for the nucleus among this many most likely tokens first (a partition, O(vocab))
# and sorts the whole vocabulary only when they do not hold top_p of the mass.
_NUCLEUS_CANDIDATES = 1024


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: Tuple[str, ...] = ()  # strings that end the output; the string itself is not returned
    stop_token_ids: Tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = None  # report the sampled token's logprob and this many most likely ones

    def __post_init__(self):
        def bad(field, value, why):
            raise MsinferError(f"SamplingParams: {field}={value!r} {why}")

        def is_int(value):
            return isinstance(value, numbers.Integral) and not isinstance(value, bool)

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", self.max_tokens, "must be an integer >= 1")
        if (not isinstance(self.temperature, numbers.Real) or isinstance(self.temperature, bool)
                or not math.isfinite(self.temperature) or self.temperature < 0):
            bad("temperature", self.temperature, "must be a finite number >= 0 (0 = greedy)")
        if not is_int(self.top_k) or self.top_k < -1:
            bad("top_k", self.top_k, "must be an integer >= 1, or 0 / -1 for off")
        if (not isinstance(self.top_p, numbers.Real) or isinstance(self.top_p, bool)
                or not 0 < self.top_p <= 1):
            bad("top_p", self.top_p, "must be in (0, 1]")
        if self.seed is not None and (not is_int(self.seed) or self.seed < 0):
            bad("seed", self.seed, "must be a non-negative integer or None")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                bad("stop", self.stop, "must hold non-empty strings")
        self.stop_token_ids = tuple(self.stop_token_ids)
        for t in self.stop_token_ids:
            if not is_int(t) or t < 0:
                bad("stop_token_ids", self.stop_token_ids, "must hold non-negative integers")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            bad("logprobs", self.logprobs, "must be a non-negative integer or None")
        self.max_tokens, self.top_k = int(self.max_tokens), int(self.top_k)
        self.temperature, self.top_p = float(self.temperature), float(self.top_p)
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        self.ignore_eos = bool(self.ignore_eos)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def new_generator(self):
        """The random stream of one request: reproducible with a seed, fresh entropy without."""
        return np.random.default_rng(self.seed)


class Sampler:
    """Picks one token per row of a (batch, vocab) float32 logits array."""

    def __call__(self, logits, params, generators):
        """`params` and `generators` hold one entry per row (greedy rows ignore theirs).

        Returns an int64 array of shape (batch,).
        """
        if logits.ndim != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
            raise ValueError(
                f"logits of shape {logits.shape} need one SamplingParams and one generator "
                f"per row, got {len(params)} and {len(generators)}")
        greedy = np.fromiter((p.greedy for p in params), dtype=bool, count=len(params))
        tokens = np.empty(len(params), dtype=np.int64)
        if greedy.all():
            return np.argmax(logits, axis=1).astype(np.int64)
        if greedy.any():
            tokens[greedy] = np.argmax(logits[greedy], axis=1)
        for row in np.flatnonzero(~greedy):
            tokens[row] = _sample_row(logits[row], params[row], generators[row])
        return tokens


def _sample_row(logits, params, generator):
    scores = logits.astype(np.float64) / params.temperature
    ids = np.arange(scores.size)
    if 0 < params.top_k < scores.size:
        # Like HF's TopKLogitsWarper: everything tied with the k-th score stays.
        kth = np.partition(scores, scores.size - params.top_k)[scores.size - params.top_k]
        ids = np.flatnonzero(scores >= kth)
        scores = scores[ids]
    probs = np.exp(scores - scores.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        # Tokens tied with the last one in stay too, as with top-k.
        keep = probs >= _nucleus_floor(probs, params.top_p)
        ids, probs = ids[keep], probs[keep]
        probs /= probs.sum()
    cumulative = np.cumsum(probs)
    pick = np.searchsorted(cumulative, generator.random() * cumulative[-1], side="right")
    return ids[min(pick, ids.size - 1)]


def _nucleus_floor(probs, top_p):
    """The smallest probability in the nucleus: the most likely tokens while the mass ranked
    above each is below top_p, as HF's TopPLogitsWarper keeps them (the top token always)."""
    values = probs
    if probs.size > _NUCLEUS_CANDIDATES:
        top = np.partition(probs, probs.size - _NUCLEUS_CANDIDATES)[-_NUCLEUS_CANDIDATES:]
        if top.sum() >= top_p:
            values = top  # nothing outside can have less than top_p ranked above it
    values = np.sort(values)[::-1]
    mass_above = np.cumsum(values) - values
    return values[mass_above < top_p][-1]
