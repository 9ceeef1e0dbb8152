"""The incremental engine: add requests, step, stream their tokens, abort them.

    engine.add_request("a", prompt_ids, SamplingParams(max_tokens=64))
    while engine.has_unfinished_requests():
        for out in engine.step():   # RequestOutput of each request that moved this step
            ...

One step = the scheduler's decisions (decodes + prefill chunks, preemptions), the runner's
graphs, then sampling and stop checks on the host. Every rank of a sharded job runs the same
engine; given the same add/abort calls in the same order, every rank schedules, samples and
stops identically (requests without a seed draw from a job-wide seed).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc

import numpy as np

from .. import log
from ..errors import MsinferError
from .block_manager import BlockManager
from .sampling import Sampler, SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence, Status
from .structured import GrammarEngine, grammar_of
from .tokenizer import IncrementalDecoder, find_stop


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str  # None when the prompt was given as token ids
    prompt_token_ids: list
    token_ids: list  # everything generated so far
    text: str  # decoded so far, complete characters only, cut before a stop string
    finished: bool = False
    # "stop" (eos, stop token or stop string), "length", "abort", or "error" (the model's
    # logits were not finite: `error` says why and what to do)
    finish_reason: str = None
    logprobs: list = None  # per generated token {token id: logprob}, when asked
    # per prompt token {token id: logprob} (None for the first), when asked: from the first
    # output on (the prompt is scored when its last chunk runs)
    prompt_logprobs: list = None
    error: str = None  # with finish_reason "error"
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache, not computed
    # time.monotonic() when first scheduled (None: not yet), for the server's queue-time
    # metrics: a time of this process, so outputs compare equal without it
    scheduled_at: float = dataclasses.field(default=None, compare=False)


# What a non-finite logits row means, by compute dtype; `msinfer doctor --logs` knows the
# words "non-finite logits" (tools/doctor.py LOG_SIGNATURES).
_FLOAT16_OVERFLOW = (
    "the model's activations overflowed float16 (largest value 65504), as Qwen models are "
    "known to: without this check the answer would be token 0 repeated ('!!!!'). Run in "
    "float32 (--dtype float32 / LLM(dtype='float32') where the hardware has it, e.g. cpu) or "
    "in bfloat16 on a device that has it (atlas-800i-a2; the 310P of the 300I Duo has only "
    "float16): docs/engine.md, 'Non-finite logits'")
_OTHER_NON_FINITE = (
    "the model computed NaN or inf in {dtype}: check the checkpoint for NaN/inf weights, and "
    "the device (msinfer doctor --logs DIR): docs/engine.md, 'Non-finite logits'")


def non_finite_message(request_id, generated, dtype):
    """The error of a request whose logits row is not finite."""
    why = (_FLOAT16_OVERFLOW if dtype == "float16"
           else _OTHER_NON_FINITE.format(dtype=dtype or "its dtype"))
    return (f"non-finite logits (NaN or inf) for request {request_id!r} after {generated} "
            f"generated token(s): {why}")


@dataclasses.dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks_total: int
    num_blocks_used: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefill_tokens_computed: int = 0  # prompt tokens run through prefill, recomputes included
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache at admission
    prefix_cache_hits: int = 0  # ... and found there (not computed)


def check_request_limits(ids, params, vocab_size, max_model_len, layout, *, has_tokenizer,
                         name="prompt"):
    """Refuse a request that could never run (MsinferError, with the numbers): an empty
    prompt, a token id outside the vocabulary, prompt + max_tokens beyond max_model_len or
    beyond the whole KV cache of `layout`, stop strings without a tokenizer."""
    if not ids:
        raise MsinferError(f"{name}: empty prompt: give at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise MsinferError(f"{name}: token id {bad[0]} is outside the vocabulary "
                           f"(0..{vocab_size - 1})")
    biased = [t for t in (params.logit_bias or ()) if t >= vocab_size]
    if biased:
        raise MsinferError(f"{name}: logit_bias names token id {biased[0]}, outside the "
                           f"vocabulary (0..{vocab_size - 1})")
    total = len(ids) + params.max_tokens
    if total > max_model_len:
        raise MsinferError(
            f"{name}: prompt of {len(ids)} tokens + max_tokens {params.max_tokens} = "
            f"{total} exceeds the longest sequence, max_len {max_model_len}; "
            f"shorten the prompt, lower max_tokens or raise max_len")
    pool = layout.usable_tokens
    if total > pool:
        raise MsinferError(
            f"{name}: prompt of {len(ids)} tokens + max_tokens {params.max_tokens} = "
            f"{total} exceeds the whole KV cache of {pool} tokens "
            f"({layout.num_blocks - 1} blocks of {layout.block_size}); "
            f"raise kv_cache_memory or lower max_tokens")
    if params.stop and not has_tokenizer:
        raise MsinferError(f"{name}: stop strings need the checkpoint's tokenizer.json")
    if params.structured_outputs:
        if not has_tokenizer:
            raise MsinferError(f"{name}: structured output needs the checkpoint's "
                               f"tokenizer.json")
        grammar_of(params.structured_outputs)  # refuses what the grammar engine cannot compile


class LLMEngine:
    def __init__(self, runner, layout, vocab_size: int, max_model_len: int, eos_token_ids,
                 max_num_seqs: int, max_prefill_tokens: int, seed: int, tokenizer=None,
                 prefix_caching: bool = True):
        """tokenizer: a callable returning the Tokenizer (loaded when first needed), or None
        for checkpoints without tokenizer.json (token-id prompts, no text, no stop strings).
        prefix_caching: reuse computed full blocks of earlier prompts (block_manager.py)."""
        self.runner = runner
        self.layout = layout
        self.blocks = BlockManager(layout, prefix_caching=prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_prefill_tokens,
                                   max_context=max_model_len)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.eos_token_ids = set(eos_token_ids)
        self.seed = seed
        self._tokenizer = tokenizer
        self._sampler = Sampler()
        self._grammars = None  # GrammarEngine, built for the first guided request sampled
        self._requests = {}  # unfinished requests by id
        self._arrivals = 0
        self._aborted = []  # outputs of aborted requests, returned by the next step
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.prefill_tokens_computed = 0
        self.step_count = 0
        self.decisions = []  # of the last run_step: [request id, token, finish reason]

    # ---- requests ----

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams | None = None, prompt: str | None = None) -> None:
        params = params or SamplingParams()
        ids = [int(t) for t in prompt_token_ids]
        self.check_request(ids, params, name=f"request {request_id!r}")
        if request_id in self._requests:
            raise MsinferError(f"request id {request_id!r} is already running")
        self._arrivals += 1
        generator = (params.new_generator() if params.seed is not None
                     else np.random.default_rng((self.seed, self._arrivals)))
        seq = Sequence(request_id, ids, params, generator=generator, prompt=prompt)
        if params.logprobs is not None:
            seq.logprobs = []
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]  # the first token: nothing before it scores it
        if self._tokenizer is not None:
            seq.decoder = IncrementalDecoder(self._tokenizer())
        self._requests[request_id] = seq
        self.prompt_tokens_total += len(ids)
        self.scheduler.add(seq)

    def check_request(self, ids: list[int], params: SamplingParams, name: str = "prompt"
                      ) -> None:
        """Refuse what could never run, with the numbers, before anything is queued."""
        check_request_limits(ids, params, self.vocab_size, self.max_model_len, self.layout,
                             has_tokenizer=self._tokenizer is not None, name=name)

    def abort_request(self, request_id: str) -> None:
        seq = self._requests.get(request_id)
        if seq is None:
            log.get().warning("abort of unknown or finished request %r: nothing to do",
                              request_id)
            return
        self._finish(seq, "abort")
        self._aborted.append(self._output(seq))

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache; False (nothing done) while a request holds blocks."""
        return self.blocks.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_blocks_total=self.blocks.num_usable, num_blocks_used=self.blocks.num_used,
            num_preemptions=self.scheduler.preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            prefill_tokens_computed=self.prefill_tokens_computed,
            prefix_cache_queries=self.blocks.queried_tokens,
            prefix_cache_hits=self.blocks.hit_tokens)

    # ---- the step ----

    def step(self) -> list[RequestOutput]:
        """Run one step; returns a RequestOutput for each request that got a token, finished or
        was aborted since the last step."""
        outputs, schedule = self.begin_step()
        if not schedule.empty:
            outputs += self.run_step(schedule)
        return outputs

    # A sharded server splits the step (server/lockstep.py): each tensor group's leader calls
    # begin_step and run_step and sends its `decisions`; the other ranks call begin_step,
    # check that their schedule is the leader's, run it with sample=False and apply the
    # leader's decisions before the next one. Only the leader samples and decides finishes.

    def begin_step(self):
        """(outputs of the requests aborted since the last step, the scheduler's decisions for
        this step); the schedule is empty when there is nothing to run."""
        outputs, self._aborted = self._aborted, []
        return outputs, self.scheduler.schedule()

    def run_step(self, schedule, sample: bool = True) -> list[RequestOutput]:
        """Run `schedule`'s graphs. With `sample`: sample each finished row, decide what ends,
        return the outputs and keep the decisions in `self.decisions` ([request id, token or
        None, finish reason or None] per row). Without (a follower): the graphs only; []."""
        self.step_count += 1
        self.decisions = []
        sampled_seqs, logits = [], []
        if schedule.chunks:
            positions = [chunk.logit_positions() for chunk in schedule.chunks]
            chunk_logits = self.runner.prefill(schedule.chunks)
            completing, row = [], 0
            for chunk, chunk_positions in zip(schedule.chunks, positions):
                scoring = len(chunk_positions) - chunk.completes  # prompt rows come first
                if scoring:
                    if sample:  # only the leader of a tensor group keeps values
                        self._score_prompt(chunk.seq, chunk_logits[row:row + scoring])
                    chunk.seq.prompt_scored += scoring
                row += scoring
                if chunk.completes:
                    completing.append(row)
                    row += 1
                chunk.seq.computed += chunk.count
                self.prefill_tokens_computed += chunk.count
                self.blocks.computed(chunk.seq)
            completed = [c.seq for c in schedule.chunks if c.completes]
            if completed:
                sampled_seqs += completed
                logits.append(chunk_logits if row == len(completing)
                              else chunk_logits[completing])
        if schedule.decodes:
            logits.append(self.runner.decode(schedule.decodes))
            for seq in schedule.decodes:
                seq.computed += 1
                self.blocks.computed(seq)
            sampled_seqs += schedule.decodes
        if not sampled_seqs or not sample:
            return []
        outputs = []
        # max_tokens 0 (prompt logprobs only): the prompt is scored, nothing is generated
        scored_only = [s.params.max_tokens == 0 for s in sampled_seqs]
        if any(scored_only):
            for seq, done in zip(sampled_seqs, scored_only):
                if done:
                    self._finish(seq, "length")
                    outputs.append(self._output(seq))
                    self.decisions.append([seq.request_id, None, "length"])
            keep = [not done for done in scored_only]
            sampled_seqs = [s for s, k in zip(sampled_seqs, keep) if k]
            logits = [np.concatenate(logits)[keep]] if sampled_seqs else []
            if not sampled_seqs:
                return outputs
        # one call's logits need no copy (16 x 151,936 float32 is 9.7 MB)
        logits = logits[0] if len(logits) == 1 else np.concatenate(logits)
        finite = np.isfinite(logits).all(axis=1)  # 0.2 ms for 16 x 151,936
        if not finite.all():
            # A NaN row's argmax is token 0 ('!' in Qwen's vocabulary): finish it with an
            # error instead; the other rows go on (padding cannot carry NaN into them:
            # model_runner's zero slot).
            for row in np.flatnonzero(~finite):
                outputs.append(self._fail(sampled_seqs[row]))
                self.decisions.append([sampled_seqs[row].request_id, None, "error"])
            sampled_seqs = [s for s, ok in zip(sampled_seqs, finite) if ok]
            logits = logits[finite]
            if not sampled_seqs:
                return outputs
        model_rows = self._guide(sampled_seqs, logits)
        tokens = self._sampler(logits, [s.params for s in sampled_seqs],
                               [s.generator for s in sampled_seqs],
                               [(s.prompt_token_ids, s.generated) for s in sampled_seqs],
                               self.eos_token_ids)
        logprobs = self._token_logprobs(sampled_seqs, logits, tokens, model_rows)
        for row, (seq, token) in enumerate(zip(sampled_seqs, tokens)):
            self._append(seq, int(token), logprobs.get(row))
            outputs.append(self._output(seq))
            self.decisions.append([seq.request_id, int(token), seq.finish_reason])
        return outputs

    def apply_decisions(self, decisions) -> None:
        """A follower's half of the leader's `run_step`: append each row's token and finish
        what the leader finished (rows as in `decisions`)."""
        for request_id, token, reason in decisions:
            seq = self._requests.get(request_id)
            if seq is None:
                raise MsinferError(f"the leader decided for request {request_id!r}, which "
                                   f"this rank does not hold")
            if token is not None:
                seq.generated.append(token)
                self.generation_tokens_total += 1
            if reason:
                self._finish(seq, reason)

    def _guide(self, seqs, logits):
        """Mask the rows of guided sequences in `logits` (in place: no copy of the whole
        batch) to what their grammar allows next. Returns {row: the model's row} for those
        that report logprobs, which are the model's."""
        model_rows = {}
        for row, seq in enumerate(seqs):
            if not seq.params.structured_outputs:
                continue
            if seq.params.logprobs is not None:
                model_rows[row] = logits[row].copy()
            if seq.guided is None:  # first sampled here (a preempted one keeps its state)
                if self._grammars is None:
                    self._grammars = GrammarEngine(self._tokenizer(), self.vocab_size,
                                                   self.eos_token_ids)
                seq.guided = self._grammars.start(seq.params.structured_outputs)
                seq.guided.advance_all(seq.generated)
            seq.guided.mask(logits[row])
        return model_rows

    @staticmethod
    def _token_logprobs(seqs, logits, tokens, model_rows=None):
        """{row: {token: logprob}} of the rows whose requests ask for logprobs, taken together
        for each top count (a copy of the rows only when not every row asks alike), from the
        model's rows (`model_rows`: those of guided sequences, before their mask)."""
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

    def _append(self, seq, token, logprobs=None):
        seq.generated.append(token)
        self.generation_tokens_total += 1
        if seq.logprobs is not None:
            seq.logprobs.append(logprobs)
        decoder = seq.decoder
        if decoder is not None:
            decoder.push(token)
        p = seq.params
        reason = None
        if seq.guided is not None and not seq.guided.advance(token):
            # cannot happen while the mask holds; said rather than leaving bad output
            log.get().error("request %r: the grammar refused token %d: %s", seq.request_id,
                            token, seq.guided.error)
            reason = "stop"
        elif (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
        elif seq.guided is not None and seq.guided.complete:
            reason = "stop"  # the grammar is complete: nothing but the end may follow
        elif p.stop and find_stop(decoder.text, p.stop) is not None:
            reason = "stop"
        elif len(seq.generated) >= p.max_tokens or seq.length >= self.max_model_len:
            reason = "length"
        if reason:
            self._finish(seq, reason)

    def _score_prompt(self, seq, logits):
        """Record the logprobs of the prompt tokens that `logits` rows (one per position
        from the first unscored one on) score, with their `prompt_logprobs` top entries."""
        first = seq.prompt_scored  # the token that the first row scores
        tokens = seq.prompt_token_ids[first:first + len(logits)]
        if not np.isfinite(logits).all():  # reported as such, not as a number that is not one
            seq.prompt_logprobs += [{t: float("nan")} for t in tokens]
            return
        seq.prompt_logprobs += logprobs_of_rows(logits, tokens, seq.params.prompt_logprobs)

    def _fail(self, seq):
        """Finish `seq` whose logits are not finite: finish_reason "error", logged (every
        rank logs it alike) and said in the output."""
        dtype = str(getattr(self.runner, "dtype", "") or "").lower() or None
        message = non_finite_message(seq.request_id, len(seq.generated), dtype)
        log.get().error("%s", message)
        self._finish(seq, "error")
        return dataclasses.replace(self._output(seq), error=message)

    def _finish(self, seq, reason):
        seq.status = Status.FINISHED
        seq.guided = None  # the matcher's memory goes with it
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        del self._requests[seq.request_id]

    def _output(self, seq) -> RequestOutput:
        text = seq.decoder.text if seq.decoder is not None else ""
        if seq.params.stop:
            cut = find_stop(text, seq.params.stop)
            text = text[:cut] if cut is not None else text
        return RequestOutput(request_id=seq.request_id, prompt=seq.prompt,
                             prompt_token_ids=list(seq.prompt_token_ids),
                             token_ids=list(seq.generated), text=text, finished=seq.finished,
                             finish_reason=seq.finish_reason,
                             logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                             prompt_logprobs=(list(seq.prompt_logprobs)
                                              if seq.prompt_logprobs is not None
                                              and len(seq.prompt_logprobs)
                                              == len(seq.prompt_token_ids) else None),
                             cached_tokens=seq.cached_tokens or 0,
                             scheduled_at=seq.scheduled_at)

    # ---- compile ahead ----

    def warmup(self, compile_cache=None, on_shape=None) -> int:
        """Compile every graph the engine can use (the calls of `runner.shapes()`); returns how
        many were compiled (or loaded from `compile_cache`, a compile_cache.CompileCache).
        `on_shape(text)` hears the progress after each shape. Writes and reads only the
        cache's reserved block."""
        before = self.runner.compilations
        shapes = self.runner.shapes()
        with (compile_cache.session() if compile_cache else contextlib.nullcontext()) as cache:
            progress = log.Progress("loading graphs" if cache == "load" else "compiling graphs",
                                    self.runner.graph_count, on_step=on_shape)
            self._compile(shapes, progress)
        return self.runner.compilations - before

    def _compile(self, shapes, progress):
        # MindSpore runs gc.collect() before each graph it compiles, which walks every object
        # of the process (~200k in a server: 0.1-0.3 s a graph); frozen, they are skipped
        # (warm-up 12.6 s -> 9.6 s for 10 shapes of a tiny model in a server process).
        frozen_before = gc.get_freeze_count()  # someone else's freeze is left as it was
        gc.collect()
        gc.freeze()
        try:
            for shape in shapes:  # progress in graphs: a call may compile several
                self.runner.compile_shape(*shape)
                progress.step(self.runner.compilations,
                              f"{shape[0]} {shape[1]} x {shape[2]}, {shape[3]} rows")
        finally:
            if not frozen_before:
                gc.unfreeze()


_LOGPROB_BLOCK = 256  # entries per block whose maxima bound the top ones (logprobs_of_rows)


def logprobs_of_rows(logits, tokens, top):
    """One {token: logprob} per row of `logits` (rows, vocab): the row's token in `tokens`
    and its `top` most likely ones, from the model's distribution (before temperature and
    truncation, as vLLM reports them), most likely first, ties by token id.

    All rows at once. The log-sum-exp is taken over float32 exponentials, summed pairwise
    (within 1e-6 of float64 throughout: a third of its time), and log-probabilities only for
    the entries returned. The top ones are found without sorting a row: the top-th largest of
    its blocks' maxima is a bound every one of the top entries reaches (k blocks reach it, so
    k entries do), which leaves a handful of candidates; only they are sorted. The same
    tokens in the same order as sorting the whole row (docs/engine.md)."""
    logits = np.asarray(logits)
    if logits.dtype != np.float32:
        logits = logits.astype(np.float32)
    rows, vocab = logits.shape
    peak = logits.max(axis=1)
    shifted = np.subtract(logits, peak[:, None], dtype=np.float32)  # the one full temporary
    np.exp(shifted, out=shifted)
    lse = np.log(shifted.sum(axis=1)).astype(np.float64) + peak.astype(np.float64)
    tokens = np.asarray(tokens, dtype=np.int64)
    chosen = logits[np.arange(rows), tokens].astype(np.float64) - lse
    picked = [{int(t): float(v)} for t, v in zip(tokens, chosen)]
    if not top:
        return picked
    whole = vocab // _LOGPROB_BLOCK * _LOGPROB_BLOCK
    blocks = logits[:, :whole].reshape(rows, -1, _LOGPROB_BLOCK)
    maxima = blocks.max(axis=2)
    if whole < vocab:  # the tail beyond the last whole block is a block of its own
        maxima = np.concatenate([maxima, logits[:, whole:].max(axis=1, keepdims=True)], 1)
    if maxima.shape[1] > top:
        bound = np.partition(maxima, maxima.shape[1] - top, axis=1)[:, maxima.shape[1] - top]
    else:
        bound = np.full(rows, -np.inf, np.float32)
    # only the blocks whose maximum reaches the bound hold candidates: a few per row, laid
    # side by side (rows, blocks x 256), padding -inf with ids past the vocabulary
    hit = maxima >= bound[:, None]
    order = np.argsort(~hit, axis=1, kind="stable")[:, :hit.sum(axis=1).max()]
    body = blocks.shape[1]
    inside = np.minimum(order, max(body - 1, 0))  # the tail's slots are filled below
    values = (blocks[np.arange(rows)[:, None], inside] if body
              else np.full(order.shape + (_LOGPROB_BLOCK,), -np.inf, np.float32))
    ids = inside[..., None] * _LOGPROB_BLOCK + np.arange(_LOGPROB_BLOCK)
    if whole < vocab:
        tail_rows, tail_slots = np.nonzero(order == body)
        values[tail_rows, tail_slots] = -np.inf
        values[tail_rows, tail_slots, :vocab - whole] = logits[tail_rows, whole:]
        ids[tail_rows, tail_slots] = whole + np.arange(_LOGPROB_BLOCK)
    missing = ~np.take_along_axis(hit, order, 1)
    values[missing], ids[missing] = -np.inf, vocab
    values, ids = values.reshape(rows, -1), ids.reshape(rows, -1)
    ids[ids >= vocab] = vocab  # the tail's padding
    best = np.lexsort((ids, -values))[:, :top]  # by logit (so logprob), descending; by id
    best_ids = np.take_along_axis(ids, best, 1).tolist()
    best_values = (np.take_along_axis(values, best, 1).astype(np.float64)
                   - lse[:, None]).tolist()
    for row in range(rows):
        for token, value in zip(best_ids[row], best_values[row]):
            if token < vocab:
                picked[row].setdefault(token, value)
    return picked


def _logprobs(logits, token, top):
    """logprobs_of_rows of one row."""
    return logprobs_of_rows(np.asarray(logits)[None], [token], top)[0]
