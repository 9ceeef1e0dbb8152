"""Choosing the next token from logits: SamplingParams (vLLM-like) and a numpy Sampler.

First what changes the model's scores, as vLLM applies it: `logit_bias` and `min_tokens`
(stop tokens masked until that many were generated), then the penalties (repetition over
prompt and output, frequency and presence over the output). Then logits warp in Hugging
Face's order (temperature, top-k, top-p, min-p) so a request means the same here as in
`transformers.generate`. Temperature 0 is greedy: argmax (after the penalties), ties to the
lowest id as torch.argmax does, so greedy output can be compared token for token. Reported
logprobs are the model's, before all of this (vLLM's default, raw logprobs).
"""
import dataclasses
import math
import numbers
from typing import Optional, Tuple

import numpy as np

from ..errors import MsinferError
from .structured import normalized

# top-p looks for the nucleus among this many most likely tokens first (a partition, O(vocab))
# and sorts the whole vocabulary only when they do not hold top_p of the mass.
_NUCLEUS_CANDIDATES = 1024


def _bad(field, value, why):
    error = MsinferError(f"SamplingParams: {field}={value!r} {why}")
    error.field = field  # the request field to name (HTTP 400's `param`)
    raise error


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


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
    # report each prompt token's logprob (the first has none) and this many most likely ones
    # at its position (vLLM's prompt_logprobs); with it, max_tokens 0 scores the prompt only
    prompt_logprobs: int = None
    min_p: float = 0.0  # keep tokens at least this share of the most likely one's probability
    presence_penalty: float = 0.0  # subtracted once from each token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in what was generated
    repetition_penalty: float = 1.0  # divides positive / multiplies negative scores of tokens
    # in the prompt or the output (1 = off)
    min_tokens: int = 0  # EOS and stop_token_ids cannot end the output before this many tokens
    logit_bias: Optional[dict] = None  # {token id: bias added to its score}, bias in -100..100
    # a grammar the output must follow, one key of {"json": schema, "json_object": True,
    # "regex": str, "choice": [str], "grammar": str} (engine/structured.py)
    structured_outputs: Optional[dict] = None
    # vLLM's cache_salt: only requests with the same salt share prefix-cached blocks (it
    # enters the first block's name, engine/block_manager.py); None: the unsalted cache
    cache_salt: Optional[str] = None

    def __post_init__(self):
        self._check_lengths_and_sampling()
        self._check_stops_and_logprobs()
        self._check_score_changes()
        if self.structured_outputs is not None:
            self.structured_outputs = normalized(self.structured_outputs)
        self.max_tokens, self.top_k = int(self.max_tokens), int(self.top_k)
        self.temperature, self.top_p = float(self.temperature), float(self.top_p)
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        self.ignore_eos = bool(self.ignore_eos)
        self.min_p, self.min_tokens = float(self.min_p), int(self.min_tokens)
        self.presence_penalty = float(self.presence_penalty)
        self.frequency_penalty = float(self.frequency_penalty)
        self.repetition_penalty = float(self.repetition_penalty)

    def _check_lengths_and_sampling(self):
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or self.prompt_logprobs < 0):
            _bad("prompt_logprobs", self.prompt_logprobs,
                 "must be a non-negative integer or None")
        least = 0 if self.prompt_logprobs is not None else 1  # 0: score the prompt only
        if not _is_int(self.max_tokens) or self.max_tokens < least:
            _bad("max_tokens", self.max_tokens, f"must be an integer >= {least}"
                 + (" (0 only with prompt_logprobs)" if least else ""))
        if (not _is_real(self.temperature) or not math.isfinite(self.temperature)
                or self.temperature < 0):
            _bad("temperature", self.temperature, "must be a finite number >= 0 (0 = greedy)")
        if not _is_int(self.top_k) or self.top_k < -1:
            _bad("top_k", self.top_k, "must be an integer >= 1, or 0 / -1 for off")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            _bad("top_p", self.top_p, "must be in (0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            _bad("seed", self.seed, "must be a non-negative integer or None")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            _bad("min_p", self.min_p, "must be in [0, 1]")

    def _check_stops_and_logprobs(self):
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str)
                                            or not self.cache_salt):
            _bad("cache_salt", self.cache_salt, "must be a non-empty string or None")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                _bad("stop", self.stop, "must hold non-empty strings")
        self.stop_token_ids = tuple(self.stop_token_ids)
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                _bad("stop_token_ids", self.stop_token_ids, "must hold non-negative integers")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            _bad("logprobs", self.logprobs, "must be a non-negative integer or None")

    def _check_score_changes(self):
        for field in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, field)
            if not _is_real(value) or not -2 <= value <= 2:
                _bad(field, value, "must be in [-2, 2]")
        if not _is_real(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            _bad("repetition_penalty", self.repetition_penalty, "must be a number > 0 (1 = off)")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            _bad("min_tokens", self.min_tokens, f"must be an integer in 0..max_tokens "
                                                f"({self.max_tokens})")
        bias = {}
        for key, value in dict(self.logit_bias or {}).items():
            # JSON object keys are strings ("50256": -100 as OpenAI documents it)
            token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
            if not _is_int(token) or token < 0:
                _bad("logit_bias", key, "keys must be token ids (non-negative integers)")
            if not _is_real(value) or not -100 <= value <= 100:
                _bad("logit_bias", {key: value}, "biases must be in [-100, 100]")
            bias[int(token)] = float(value)
        self.logit_bias = bias or None

    def changes_scores(self, generated: int) -> bool:
        """Whether the model's scores change before sampling, with `generated` tokens out."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or generated < self.min_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def new_generator(self):
        """The random stream of one request: reproducible with a seed, fresh entropy without."""
        return np.random.default_rng(self.seed)


def adjust_scores(row, params, prompt_ids, generated, eos_token_ids=()):
    """The scores `row` (one float32 row, not changed) after logit_bias, min_tokens and the
    penalties of `params`, given the request's prompt and generated token ids, as vLLM
    applies them; a new float32 array."""
    row = np.array(row, dtype=np.float32)
    if params.logit_bias:
        ids = np.fromiter(params.logit_bias, dtype=np.int64)
        row[ids] += np.fromiter(params.logit_bias.values(), dtype=np.float32)
    if len(generated) < params.min_tokens:
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        row[[t for t in stops if t < row.size]] = -np.inf
    if params.repetition_penalty != 1.0:
        ids = np.unique(np.concatenate([np.asarray(prompt_ids, np.int64),
                                        np.asarray(generated, np.int64)]))
        seen = row[ids]
        row[ids] = np.where(seen > 0, seen / params.repetition_penalty,
                            seen * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and len(generated):
        ids, counts = np.unique(np.asarray(generated, np.int64), return_counts=True)
        row[ids] -= (params.frequency_penalty * counts + params.presence_penalty).astype(
            np.float32)
    return row


class Sampler:
    """Picks one token per row of a (batch, vocab) float32 logits array."""

    def __call__(self, logits, params, generators, histories=None, eos_token_ids=()):
        """`params` and `generators` hold one entry per row (greedy rows ignore theirs);
        `histories` one (prompt ids, generated ids) per row, needed by rows whose params
        change the scores (penalties, logit_bias, min_tokens: `eos_token_ids` are masked too).

        Returns an int64 array of shape (batch,).
        """
        if logits.ndim != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
            raise ValueError(
                f"logits of shape {logits.shape} need one SamplingParams and one generator "
                f"per row, got {len(params)} and {len(generators)}")
        adjust = [row for row, p in enumerate(params)
                  if histories is not None and p.changes_scores(len(histories[row][1]))]
        if adjust:  # only those rows are copied; the caller's logits stay the model's
            logits = logits.copy()
            for row in adjust:
                prompt, generated = histories[row]
                logits[row] = adjust_scores(logits[row], params[row], prompt, generated,
                                            eos_token_ids)
        greedy = np.fromiter((p.greedy for p in params), dtype=bool, count=len(params))
        tokens = np.empty(len(params), dtype=np.int64)
        if greedy.all():
            return np.argmax(logits, axis=1).astype(np.int64)
        if greedy.any():
            tokens[greedy] = np.argmax(logits[greedy], axis=1)
        for row in np.flatnonzero(~greedy):
            tokens[row] = draw(*row_distribution(logits[row], params[row]), generators[row])
        return tokens


def row_distribution(logits, params):
    """(token ids, their probabilities) that sampling `params` draws from for one row of
    scores: temperature, then top-k, top-p and min-p as Hugging Face applies them (the ids
    ascending; speculative decoding's acceptance reads the same distribution)."""
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
    if params.min_p > 0:
        # HF's MinPLogitsWarper: relative to the most likely token (which always stays)
        keep = probs >= params.min_p * probs.max()
        ids, probs = ids[keep], probs[keep]
        probs /= probs.sum()
    return ids, probs


def draw(ids, probs, generator):
    """One of `ids` with `probs` (they sum to 1 up to rounding), by one uniform draw."""
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


def request_logprobs(seqs, logits, tokens, model_rows=None):
    """{row: {token: logprob}} of the rows whose sequences ask for logprobs, taken together
    for each top count (a copy of the rows only when not every row asks alike), from the
    model's rows (`model_rows`: {row: the row before a grammar's mask})."""
    by_top = {}
    for row, seq in enumerate(seqs):
        if seq.logprobs is not None:
            by_top.setdefault(seq.params.logprobs, []).append(row)
    found = {}
    for top, rows in by_top.items():
        picked = logits if len(rows) == len(logits) else logits[rows]
        unmasked = [i for i, row in enumerate(rows) if row in (model_rows or {})]
        if unmasked:
            picked = picked.copy() if picked is logits else picked
            for i in unmasked:
                picked[i] = model_rows[rows[i]]
        found.update(zip(rows, logprobs_of_rows(picked, np.asarray(tokens)[rows], top)))
    return found


# logprobs_of_rows splits a row into groups of this many entries, taken a stride apart
# (entries j, j + n / 64, j + 2n / 64, ...): their maxima are an element-wise maximum of 64
# contiguous slices, one fast pass, where contiguous blocks would be a slow short reduction.
_LOGPROB_GROUP = 64


def logprobs_of_rows(logits, tokens, top):
    """One {token: logprob} per row of `logits` (rows, vocab): the row's token in `tokens`
    and its `top` most likely ones, from the model's distribution (before temperature and
    truncation, as vLLM reports them), most likely first, ties by token id.

    About two passes over the logits (docs/engine.md, "Logprobs on the host"): the
    log-sum-exp over float32 exponentials (summed pairwise: within 1e-6 of float64), and log-probabilities only for the entries returned; the top ones are found
    among the groups whose maximum reaches the top-th largest group maximum (every one of
    the top entries does: that many groups reach it, so that many entries), a few hundred
    candidates that alone are sorted. The same tokens in the same order as sorting the row."""
    logits = np.asarray(logits)
    if logits.dtype != np.float32:
        logits = logits.astype(np.float32)
    rows, vocab = logits.shape
    maxima = _group_maxima(logits) if top else None
    peak = maxima.max(axis=1) if top else logits.max(axis=1)
    lse = _log_sum_exp(logits, peak)
    tokens = np.asarray(tokens, dtype=np.int64)
    chosen = logits[np.arange(rows), tokens].astype(np.float64) - lse
    picked = [{int(t): float(v)} for t, v in zip(tokens, chosen)]
    if top:
        for row, token, value in _top_entries(logits, maxima, top, lse):
            picked[row].setdefault(token, value)
    return picked


def _log_sum_exp(logits, peak):
    """Each row's log-sum-exp (float64), given its maximum `peak`: a row at a time through
    one row of scratch, which stays in the processor's cache (a temporary of the logits'
    size does not: bench/logprobs_step.py)."""
    scratch = np.empty(logits.shape[1], np.float32)
    sums = np.empty(len(logits), np.float64)
    for row, values in enumerate(logits):
        np.subtract(values, peak[row], out=scratch)
        np.exp(scratch, out=scratch)
        sums[row] = scratch.sum()
    return np.log(sums) + peak.astype(np.float64)


def _group_maxima(logits):
    """(rows, groups): the maximum of each strided group of _LOGPROB_GROUP entries, then
    each entry past the last whole group as a group of its own."""
    rows, vocab = logits.shape
    stride = vocab // _LOGPROB_GROUP
    whole = stride * _LOGPROB_GROUP
    maxima = logits[:, :whole].reshape(rows, _LOGPROB_GROUP, stride).max(axis=1)
    return np.concatenate([maxima, logits[:, whole:]], axis=1) if whole < vocab else maxima


def _top_entries(logits, maxima, top, lse):
    """(row, token, logprob) of each row's `top` most likely entries, most likely first,
    ties by token id: sorted among the entries of the groups reaching the bound."""
    rows, vocab = logits.shape
    stride = vocab // _LOGPROB_GROUP
    groups = maxima.shape[1]
    if groups > top:
        bound = np.partition(maxima, groups - top, axis=1)[:, groups - top]
    else:
        bound = np.full(rows, -np.inf, np.float32)
    hit_rows, hit_groups = np.nonzero(maxima >= bound[:, None])
    strided = hit_groups < stride
    cand_rows = np.concatenate([np.repeat(hit_rows[strided], _LOGPROB_GROUP),
                                hit_rows[~strided]])
    cand_ids = np.concatenate([
        (hit_groups[strided, None] + stride * np.arange(_LOGPROB_GROUP)).ravel(),
        hit_groups[~strided] - stride + stride * _LOGPROB_GROUP])  # the entries past them
    values = logits[cand_rows, cand_ids]
    reach = values >= bound[cand_rows]  # the few that can be among the top ones
    cand_rows, cand_ids, values = cand_rows[reach], cand_ids[reach], values[reach]
    order = np.lexsort((cand_ids, -values, cand_rows))  # by row; logit descending; id
    cand_rows, cand_ids, values = cand_rows[order], cand_ids[order], values[order]
    starts = np.searchsorted(cand_rows, np.arange(rows))
    rank = np.arange(len(cand_rows)) - starts[cand_rows]
    keep = rank < top
    logprobs = values[keep].astype(np.float64) - lse[cand_rows[keep]]
    return zip(cand_rows[keep].tolist(), cand_ids[keep].tolist(), logprobs.tolist())
