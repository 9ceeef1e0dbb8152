"""The incremental engine: add requests, step, stream their tokens, abort them.

    engine.add_request("a", prompt_ids, SamplingParams(max_tokens=64))
    while engine.has_unfinished_requests():
        for out in engine.step():   # RequestOutput of each request that moved this step
            ...

One step reads as nano-vllm's: schedule (scheduler.py: decodes + prefill chunks,
preemptions) -> run (model_runner.py: the graphs, logits rows) -> sample (sampling.py: tokens
and logprobs) -> postprocess (sequence.py: append, stop checks; finish what ends). Every rank of a sharded job runs the same
engine; given the same add/abort calls in the same order, every rank schedules, samples and
stops identically (requests without a seed draw from a job-wide seed).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc

import numpy as np

from .. import log
from ..engine_config import EngineConfig
from ..errors import MsinferError
from .block_manager import BlockManager
from .sampling import Sampler, SamplingParams, logprobs_of_rows, request_logprobs
from .scheduler import Scheduler
from .speculative.speculation import Speculation
from .speculative.verify import decide
from .sequence import Prefix, Sequence, Status
from .structured import GrammarEngine, grammar_of
from .tokenizer import IncrementalDecoder


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str  # None when the prompt was given as token ids
    prompt_token_ids: list
    # everything generated so far: a list once finished, before that a read-only Prefix view
    # of the engine's list (the same for the lists below)
    token_ids: list
    # decoded so far, complete characters only, cut before a stop string: a str once
    # finished, before that a read-only TextSoFar view (len, indexes, slices, str())
    text: str
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
    # speculative decoding (vLLM's vllm:spec_decode_* counters): sequence-steps that verified
    # proposals, tokens proposed, tokens accepted, and accepted at each proposal position
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple = ()


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
            f"{total} exceeds the longest sequence, max_model_len {max_model_len}; "
            f"shorten the prompt, lower max_tokens or raise max_model_len")
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
    def __init__(self, runner, layout, config: EngineConfig, eos_token_ids, seed: int,
                 tokenizer=None, proposer=None):
        """config: the EngineConfig, whole: its limits (max_model_len, max_num_seqs,
        max_prefill_tokens), prefix caching (reuse computed full blocks of earlier prompts:
        block_manager.py), speculative decoding (config.speculative, with `proposer`: built
        from it when not given, engine/speculative/) and the model's vocabulary size; what a
        server reads of the engine's settings (`self.config`). tokenizer: a callable
        returning the Tokenizer (loaded when first needed), or None for checkpoints without
        tokenizer.json (token-id prompts, no text, no stop strings)."""
        self.runner = runner
        self.layout = layout
        self.config = config
        self.limits = config.limits
        self.blocks = BlockManager(layout, prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.limits)
        self.vocab_size = config.model_config.vocab_size
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
        self.speculation = None
        if config.speculative is not None:
            if proposer is None:
                from .speculative import build_proposer
                proposer = build_proposer(config.speculative)
            self.speculation = Speculation(config.speculative, proposer)
        self._verifying = {}  # request id -> its Chunk, of the step run last

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
        check_request_limits(ids, params, self.vocab_size, self.limits.max_model_len,
                             self.layout, has_tokenizer=self._tokenizer is not None, name=name)

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

    def listen_to_prefix_cache(self, listener) -> None:
        """Tell `listener` the prefix cache's changes from now on, as vLLM's KV events say
        them (server/kv_events.py): stored(names, parent name or None, tokens),
        removed(names), cleared()."""
        self.blocks.listener = listener

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def stats(self) -> EngineStats:
        spec = self.speculation
        counters = {} if spec is None else dict(
            spec_num_drafts=spec.num_drafts, spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_pos=tuple(spec.accepted_per_pos))
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_blocks_total=self.blocks.num_usable, num_blocks_used=self.blocks.num_used,
            num_preemptions=self.scheduler.preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            prefill_tokens_computed=self.prefill_tokens_computed,
            prefix_cache_queries=self.blocks.queried_tokens,
            prefix_cache_hits=self.blocks.hit_tokens, **counters)

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
        spec = self.speculation
        if spec is None:
            return outputs, self.scheduler.schedule()
        schedule = self.scheduler.schedule(spec.lookahead(self.limits.max_model_len))
        if schedule.verifies:
            spec.propose(schedule, self.blocks)
        self._verifying = {c.seq.request_id: c for c in schedule.verifies if c.proposal}
        return outputs, schedule

    def run_step(self, schedule, sample: bool = True) -> list[RequestOutput]:
        """Run `schedule`'s graphs. With `sample`: sample each finished row, decide what ends,
        return the outputs and keep the decisions in `self.decisions` ([request id, token or
        None, finish reason or None] per row). Without (a follower): the graphs only; []."""
        self.step_count += 1
        self.decisions = []
        seqs, logits, verified = self._run(schedule, score=sample)
        if not sample:
            return []
        outputs = []
        if seqs:
            outputs, seqs, logits = self._drop_unsampled(seqs, logits)
        if seqs:
            tokens, logprobs = self._sample(seqs, logits)
            outputs += self._postprocess(seqs, tokens, logprobs)
        for chunk, rows in verified:
            outputs.append(self._verify(chunk, rows))
        return outputs

    def _run(self, schedule, score):
        """Run the step's graphs and move each sequence's `computed`; the sequences whose
        next token is due and their logits rows (prompt rows scored on the way, with
        `score`), and the verifications with theirs ([(Chunk, rows)])."""
        seqs, logits, verified = [], [], []
        if schedule.chunks or schedule.verifies:
            completed, rows, verified = self._run_prefill(schedule.verifies + schedule.chunks,
                                                          score)
            if completed:
                seqs += completed
                logits.append(rows)
        if schedule.decodes:
            logits.append(self.runner.decode(schedule.decodes))
            for seq in schedule.decodes:
                self.prefill_tokens_computed += seq.in_prompt  # a prompt's last token
                seq.computed += 1
                self.blocks.computed(seq)
            seqs += schedule.decodes
        # one call's logits need no copy (16 x 151,936 float32 is 9.7 MB)
        return seqs, (logits[0] if len(logits) == 1 else
                      np.concatenate(logits) if logits else None), verified

    def _run_prefill(self, chunks, score):
        """The prefill call: (the sequences whose prompt it completes, their logits rows,
        [(verification Chunk, its rows)]). Rows scoring prompt tokens come first in each
        chunk's rows (Chunk.logit_positions). A verification's `computed` moves when its
        tokens are decided (_settle)."""
        positions = [chunk.logit_positions() for chunk in chunks]
        chunk_logits = self.runner.prefill(chunks)
        completing, verified, row = [], [], 0
        for chunk, chunk_positions in zip(chunks, positions):
            if chunk.proposal:
                verified.append((chunk, chunk_logits[row:row + chunk.count]))
                row += chunk.count
                continue
            scoring = len(chunk_positions) - chunk.completes
            if scoring:
                if score:  # only the leader of a tensor group keeps values
                    self._score_prompt(chunk.seq, chunk_logits[row:row + scoring])
                chunk.seq.prompt_scored += scoring
            row += scoring
            if chunk.completes:
                completing.append(row)
                row += 1
            if not chunk.rides or chunk.seq.in_prompt:  # a riding decode is no prefill
                self.prefill_tokens_computed += chunk.count
            chunk.seq.computed += chunk.count
            self.blocks.computed(chunk.seq)
        completed = [c.seq for c in chunks if c.completes and not c.proposal]
        if not completing:
            return completed, None, verified
        return completed, (chunk_logits if row == len(completing)
                           else chunk_logits[completing]), verified

    def _drop_unsampled(self, seqs, logits):
        """Finish the rows that get no token: max_tokens 0 (the prompt scored, nothing to
        generate: "length") and non-finite logits ("error"). (their outputs, the sequences
        left, their rows)."""
        outputs = []
        # a NaN row's argmax is token 0 ('!' in Qwen's vocabulary): an error instead; the
        # other rows go on (padding cannot carry NaN into them: model_runner's zero slot)
        finite = np.isfinite(logits).all(axis=1)
        keep = finite.copy()
        for row, seq in enumerate(seqs):
            if seq.params.max_tokens == 0:
                self._finish(seq, "length")
                outputs.append(self._output(seq))
                keep[row] = False
            elif not finite[row]:
                outputs.append(self._fail(seq))
                keep[row] = False
            if not keep[row]:
                self.decisions.append([seq.request_id, None, seq.finish_reason])
        if keep.all():
            return outputs, seqs, logits
        return outputs, [s for s, k in zip(seqs, keep) if k], logits[keep]

    def _sample(self, seqs, logits):
        """(the token of each row, {row: its logprobs} of the rows that ask for them)."""
        model_rows = self._guide(seqs, logits)
        tokens = self._sampler(logits, [s.params for s in seqs], [s.generator for s in seqs],
                               [(s.prompt_token_ids, s.generated) for s in seqs],
                               self.eos_token_ids)
        return tokens, request_logprobs(seqs, logits, tokens, model_rows)

    def _postprocess(self, seqs, tokens, logprobs):
        """Append each row's token, finish what stops; their outputs and decisions."""
        outputs = []
        for row, (seq, token) in enumerate(zip(seqs, tokens.tolist())):
            seq.append_token(token)
            self.generation_tokens_total += 1
            if seq.logprobs is not None:
                seq.logprobs.append(logprobs.get(row))
            reason = seq.stop_reason(token, self.eos_token_ids, self.limits.max_model_len)
            if reason:
                self._finish(seq, reason)
            outputs.append(self._output(seq))
            self.decisions.append([seq.request_id, token, reason])
        return outputs

    def _verify(self, chunk, rows):
        """Decide a verification's tokens (verify.py): row j, scored as a decode step would
        score it after the tokens accepted before it, keeps proposal j or replaces it and
        ends the run; all k kept, the last row adds one more. Its output and decision (the
        tokens as a list)."""
        seq, proposal = chunk.seq, chunk.proposal
        if not np.isfinite(rows).all():
            output = self._fail(seq)
            self.decisions.append([seq.request_id, None, seq.finish_reason])
            return output
        tokens, reason = [], None
        for j, row in enumerate(rows):
            proposed = proposal[j] if j < len(proposal) else None
            token, accepted = decide(self._sampler, self._masked(seq, row), seq.params,
                                     seq.generator, proposed,
                                     (seq.prompt_token_ids, seq.generated), self.eos_token_ids)
            seq.append_token(token)
            tokens.append(token)
            self.generation_tokens_total += 1
            if seq.logprobs is not None:
                seq.logprobs.append(logprobs_of_rows(row[None], [token],
                                                     seq.params.logprobs)[0])
            reason = seq.stop_reason(token, self.eos_token_ids, self.limits.max_model_len)
            if reason or not accepted:
                break
        self._settle(chunk, tokens, reason)
        self.decisions.append([seq.request_id, tokens, reason])
        return self._output(seq)

    def _masked(self, seq, row):
        """One row masked by a guided sequence's grammar (a copy; `row` stays the model's),
        as _guide masks a decode step's rows; the Sampler applies the rest."""
        if not seq.params.structured_outputs:
            return row
        row = np.array(row, dtype=np.float32)
        self._grammar_of(seq).mask(row)
        return row

    def _settle(self, chunk, tokens, reason):
        """After a verification emitted `tokens` (appended): its counters; and, unless it
        finished, the cache holds the positions before its new last token (the rejected
        proposals' slots are given back and will be written again)."""
        seq = chunk.seq
        self.speculation.verified(chunk, tokens)
        if reason:
            self._finish(seq, reason)
            return
        seq.computed = seq.length - 1
        self.blocks.computed(seq)
        self.blocks.shrink(seq, seq.length)

    def apply_decisions(self, decisions) -> None:
        """A follower's half of the leader's `run_step`: append each row's token (a
        verification's tokens) and finish what the leader finished (rows as in
        `decisions`)."""
        for request_id, token, reason in decisions:
            seq = self._requests.get(request_id)
            if seq is None:
                raise MsinferError(f"the leader decided for request {request_id!r}, which "
                                   f"this rank does not hold")
            tokens = token if isinstance(token, list) else [] if token is None else [token]
            for t in tokens:
                seq.append_token(t)
            self.generation_tokens_total += len(tokens)
            chunk = self._verifying.get(request_id)
            if chunk is not None and token is not None:
                self._settle(chunk, tokens, reason)
            elif reason:
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
            self._grammar_of(seq).mask(logits[row])
        return model_rows

    def _grammar_of(self, seq):
        """The grammar state of a guided sequence, started when it is first sampled (a
        preempted one keeps its state)."""
        if seq.guided is None:
            if self._grammars is None:
                self._grammars = GrammarEngine(self._tokenizer(), self.vocab_size,
                                               self.eos_token_ids)
            seq.guided = self._grammars.start(seq.params.structured_outputs)
            seq.guided.advance_all(seq.generated)
        return seq.guided

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
        if self.speculation is not None:
            self.speculation.finished(seq)

    def _output(self, seq) -> RequestOutput:
        """What `seq` holds now: while it runs, its lists and text seen through Prefix and
        TextSoFar views (no copy per step); once finished, plain lists and a str (one copy
        per request)."""
        view = list if seq.finished else Prefix
        prompt_logprobs = seq.prompt_logprobs
        complete = (prompt_logprobs is not None
                    and len(prompt_logprobs) == len(seq.prompt_token_ids))
        return RequestOutput(request_id=seq.request_id, prompt=seq.prompt,
                             prompt_token_ids=view(seq.prompt_token_ids),
                             token_ids=view(seq.generated),
                             text=seq.text if seq.finished else seq.text_so_far(),
                             finished=seq.finished, finish_reason=seq.finish_reason,
                             logprobs=view(seq.logprobs) if seq.logprobs is not None else None,
                             prompt_logprobs=view(prompt_logprobs) if complete else None,
                             cached_tokens=seq.cached_tokens or 0,
                             scheduled_at=seq.scheduled_at)

    # ---- compile ahead ----

    def compiling(self) -> bool:
        """Whether a graph is compiling now (its first use, in the step in progress): a
        server's stall watch waits longer for it."""
        return self.runner.compiling_since is not None

    def warmup_calls(self) -> int:
        """The model calls `warmup` runs, one per graph shape the engine can use."""
        return len(self.runner.shapes())

    def warmup(self, compile_cache=None, on_shape=None) -> int:
        """Compile every graph the engine can use (the calls of `runner.shapes()`, and of a
        draft model's runner); returns how many were compiled (or loaded from
        `compile_cache`, a compile_cache.CompileCache). `on_shape(text)` hears the progress
        after each shape. Writes and reads only the caches' reserved block."""
        runners = self.runners
        before = sum(r.compilations for r in runners)
        with (compile_cache.session() if compile_cache else contextlib.nullcontext()) as cache:
            progress = log.Progress("loading graphs" if cache == "load" else "compiling graphs",
                                    sum(r.graph_count for r in runners), on_step=on_shape)
            self._compile(runners, progress)
        return sum(r.compilations for r in runners) - before

    @property
    def runners(self) -> list:
        """The target's model runner, and the draft model's (speculative decoding)."""
        draft = getattr(self.speculation and self.speculation.proposer, "runner", None)
        return [self.runner] + ([draft] if draft is not None else [])

    def _compile(self, runners, progress):
        # MindSpore runs gc.collect() before each graph it compiles, which walks every object
        # of the process (some 200k in a server); frozen, they are skipped.
        frozen_before = gc.get_freeze_count()  # someone else's freeze is left as it was
        gc.collect()
        gc.freeze()
        try:
            done = 0
            for runner in runners:  # progress in graphs: a call may compile several
                for shape in runner.shapes():
                    runner.compile_shape(shape)
                    progress.step(done + runner.compilations,
                                  f"{shape.kind} {shape.size} x {shape.context}, "
                                  f"{shape.rows} rows")
                done += runner.compilations
        finally:
            if not frozen_before:
                gc.unfreeze()
