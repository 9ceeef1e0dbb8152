"""The Python API: `LLM(model_dir, strategy=...).generate(prompts, SamplingParams(...))`.

`LLM` loads a checkpoint onto this rank (its slices of every weight), sizes the paged KV
cache, and builds the engine (`llm.engine`: add_request / step / abort_request, what a server
drives). `generate` runs a list of prompts through that engine to completion. Inside each
rank of a sharded job the same code runs; every rank returns the same outputs.
"""
from __future__ import annotations

import dataclasses
import functools
import os

from . import log
from .config import eos_token_ids
from .engine import LLMEngine, RequestOutput
from .engine.sampling import SamplingParams
from .engine.speculative.acceptance import acceptance_words
from .engine.tokenizer import encode_prompts
from .engine_config import EngineConfig, engine_config
from .errors import MsinferError, NonFiniteLogits
from .hardware import choose_hardware, get_profile
from .parallel.strategy import decide_parallel_mode, strategy_of
from .planning.memory import draft_config, engine_memory, verify_rows
from .planning.planner import check_plan_or_raise

__all__ = ["LLM", "EngineConfig", "RequestOutput", "NonFiniteLogits"]


class LLM:
    """A Qwen2 checkpoint loaded for compiled (GRAPH_MODE) inference, sharded per its strategy.

    `LLM(model_dir, **settings)` or `LLM(engine_config)`: the settings are EngineConfig's
    (msinfer/engine_config.py, which validates them once), vLLM's names where vLLM has them:
    model_dir: a Hugging Face Qwen2 directory (config.json, *.safetensors, tokenizer.json).
    strategy: a strategy YAML path (see strategies/); None runs on one device, or on
        tensor_parallel_size ranks (1, 2, 4 or 8) with the shipped strategies/qwen2_tpN.yaml.
    hardware: a profile name from msinfer.hardware, or "auto" (the default): the profile of
        the Ascend chips `npu-smi info` lists, else cpu (logged at start).
    parallel_mode: "explicit" or "semi_auto"; default: the strategy's, else explicit
        (strategy.decide_parallel_mode).
    max_model_len (older name: max_len): the longest sequence (prompt + generated); default
        min(max_position_embeddings, 4096).
    kv_cache_memory: bytes of KV cache per rank, an int or a string with a unit ("2GiB",
        "512MiB", as --kv-cache-memory takes); default: what the planner leaves free on the
        device (capped at max_num_seqs sequences of max_model_len).
    block_size: tokens per KV cache block; max_prefill_tokens: tokens per prefill chunk;
    max_num_seqs: sequences decoded together.
    enable_prefix_caching: reuse the KV blocks of prompt prefixes computed before (on by
        default, as vLLM's; engine/block_manager.py).
    dtype: compute dtype override (the hardware's policy decides otherwise).
    graph_shapes: explicit mode's compiled graphs, "dynamic" (the default: a few, as many at
        any max_model_len) or "static" (one per call shape: 7x as many for the 0.5B shape's
        defaults, a slower start, about the same speed; docs/engine.md, "Compiled graphs").
    compile_cache: where `warmup()` keeps compiled graphs for the next start of the same
        configuration (engine/compile_cache.py): a directory; None (the default):
        $MSINFER_COMPILE_CACHE, else ~/.cache/msinfer/compile; False: none.
    speculative_config: speculative decoding, as vLLM's: a dict (or its JSON text), e.g.
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}; methods
        "ngram", "suffix", "draft_model" (with "model", the draft's directory); None (the
        default): none (msinfer/speculative_config.py, docs/speculative.md).
    """

    def __init__(self, model_dir: str | EngineConfig, **settings):
        if isinstance(model_dir, EngineConfig):
            if settings:
                raise MsinferError(f"LLM(engine_config) takes no more settings, got "
                                   f"{', '.join(sorted(settings))}")
            self.engine_config = model_dir
        else:
            self.engine_config = engine_config(model_dir, **settings)
        self._start(self.engine_config)

    def _start(self, cfg: EngineConfig):
        import mindspore as ms

        from .engine.model_runner import build_runner
        from .layers.parallel_context import ParallelContext
        from .parallel.distributed import (init_distributed, job_seed, replica_seed,
                                           tensor_group)

        self.model_dir = cfg.model
        self.config = cfg.model_config
        hardware, self.hardware_choice = choose_hardware(cfg.parallel.hardware)
        self.profile = get_profile(hardware)
        self.strategy = strategy_of(cfg.parallel.strategy, cfg.parallel.tensor_parallel_size)
        self.parallel_mode = decide_parallel_mode(cfg.parallel.parallel_mode, self.strategy)
        self.limits = cfg.limits
        # The planner's check, here too, so every entry point refuses an illegal or oversized
        # plan before any device or collective is touched.
        report = check_plan_or_raise(self.config, self.strategy, self.profile, self.limits,
                                     dtype=cfg.dtype, parallel_mode=self.parallel_mode,
                                     speculative=cfg.speculative)
        self.dtype_reason = report.dtype_reason
        self.compute_dtype = report.dtype  # "float32", "float16" or "bfloat16"
        self.shard_plan = self.strategy.resolve(self.config, self.parallel_mode)

        self.dist = init_distributed(self.profile.device_target, self.strategy.world_size,
                                     cfg.parallel.rank_table)
        if self.dist.world_size == 1:
            log.setup()
        # The job's seed, agreed by a stand-alone AllReduce graph; the semi_auto context is set
        # only while the model compiles (model_runner.semi_auto_cell), so the two never meet.
        seed = job_seed(self.dist)
        self.tensor_rank = self.shard_plan.tensor_rank(self.dist.rank)
        # Explicit data parallelism: each replica runs its share of the prompts with its own
        # tensor group; semi_auto splits the batch inside MindSpore (full_batch) instead.
        self.replicas = self.shard_plan.data if self.parallel_mode == "explicit" else 1
        group = tensor_group(self.dist, self.shard_plan) if self.replicas > 1 else None
        ctx = ParallelContext(config=self.config, plan=self.shard_plan, mode=self.parallel_mode,
                              tensor_rank=self.tensor_rank, group=group,
                              dtype=getattr(ms, report.dtype))
        draft = draft_config(cfg.speculative)
        self.memory = engine_memory(self.shard_plan, self.profile, report.dtype, self.limits,
                                    self.tensor_rank, draft=draft,
                                    verify_rows=verify_rows(cfg.speculative, self.limits))
        _log_start(self, report)
        runner = build_runner(cfg.model, ctx, self.memory.layout, self.limits,
                              self.dist.world_size, self.profile,
                              speculative=cfg.speculative is not None)
        proposer = None
        if cfg.speculative is not None and cfg.speculative.method == "draft_model":
            # (a semi_auto plan with speculation was refused by the planner's check above)
            proposer = draft_model_proposer(cfg.speculative.model, draft, self.config,
                                            ctx.dtype, self.memory.layout, self.limits,
                                            self.profile)
        self._tokenizer = None
        self.engine = LLMEngine(
            runner, self.memory.layout, cfg, eos_token_ids=self.eos_token_ids(),
            seed=replica_seed(seed, self.shard_plan.data_rank(self.dist.rank)
                              if self.replicas > 1 else 0),
            tokenizer=(lambda: self.tokenizer) if self.has_tokenizer else None,
            proposer=proposer)
        self._batches = 0

    @functools.cached_property
    def compile_cache(self):
        """This configuration's compile cache entry (engine/compile_cache.py), None without
        one; built when first asked for (warm-up), not at every start."""
        root = self.engine_config.compile_cache
        if root is False:
            return None
        from .engine.compile_cache import CompileCache, default_root, weight_files
        key = dict(
            config=dataclasses.asdict(self.config), weights=weight_files(self.model_dir),
            strategy=dataclasses.asdict(self.strategy), mode=self.parallel_mode,
            rank=self.dist.rank, world_size=self.dist.world_size, dtype=self.compute_dtype,
            hardware=self.profile.name, limits=dataclasses.asdict(self.limits),
            layout=dataclasses.asdict(self.memory.layout),
            shapes=self.engine.runner.shapes())
        spec = self.engine_config.speculative
        if spec is not None:  # a draft model's graphs are cached beside the target's
            key["speculative"] = dataclasses.asdict(spec)
            if spec.model:
                key["draft_weights"] = weight_files(spec.model)
        return CompileCache(root or default_root(), key)

    def warmup(self, on_shape=None) -> int:
        """Compile (or load from the compile cache) every graph serving can use, so that no
        request waits for one; returns how many. on_shape(text): warm-up's progress."""
        return self.engine.warmup(self.compile_cache, on_shape)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from .engine.tokenizer import Tokenizer
            self._tokenizer = Tokenizer.from_model_dir(self.model_dir)
        return self._tokenizer

    @property
    def compilations(self) -> int:
        """Graphs compiled so far."""
        return sum(r.compilations for r in self.engine.runners)

    @property
    def has_tokenizer(self) -> bool:
        """Token-id prompts work without tokenizer.json; text needs it."""
        return os.path.isfile(os.path.join(self.model_dir, "tokenizer.json"))

    def eos_token_ids(self) -> set:
        if self.has_tokenizer:
            return set(self.tokenizer.eos_token_ids)
        return set(eos_token_ids(self.model_dir))

    def generate(self, prompts: str | list, sampling_params: SamplingParams | list | None = None
                 ) -> list[RequestOutput]:
        """prompts: a string, a list of strings, or a list of token-id lists.
        sampling_params: one SamplingParams for all, or one per prompt.
        Returns one finished RequestOutput per prompt, in order."""
        encoded = encode_prompts(prompts, lambda text: self.tokenizer.encode(text))
        if not encoded:
            return []
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(encoded)
        if len(params) != len(encoded):
            raise MsinferError(f"{len(encoded)} prompts but {len(params)} SamplingParams")
        texts = [text for text, _ in encoded]
        token_lists = [ids for _, ids in encoded]
        for i, (ids, p) in enumerate(zip(token_lists, params)):  # refuse before anything runs
            self.engine.check_request(ids, p, name=f"prompt {i}")
        self._batches += 1
        # With data replicas, replica d runs prompts d, d + data, ...; then all exchange.
        first = self.shard_plan.data_rank(self.dist.rank) if self.replicas > 1 else 0
        mine = list(range(first, len(encoded), self.replicas))
        ids = {i: f"generate-{self._batches}-{i}" for i in mine}
        for i in mine:
            self.engine.add_request(ids[i], token_lists[i], params[i], prompt=texts[i])
        finished = {}
        progress = log.Progress("generating", len(mine))
        start = self.engine.stats()
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
            progress.step(len(finished), self._progress_words(start, self.engine.stats()))
        outputs = [finished.get(ids[i]) if i in ids else None for i in range(len(encoded))]
        if self.replicas > 1:
            self._exchange(outputs)
        failed = [out for out in outputs if out is not None and out.finish_reason == "error"]
        if failed:  # on every rank alike, after the exchange (no rank is left waiting in it)
            more = f" (and {len(failed) - 1} more prompt(s))" if len(failed) > 1 else ""
            raise NonFiniteLogits(f"{failed[0].error or 'non-finite logits'}{more}", outputs)
        return outputs

    def _progress_words(self, start, stats):
        """What generate's progress line says of the engine: its queues, and with
        speculative decoding the acceptance since `start` (the EngineStats the call began
        with)."""
        words = f"{stats.num_running} running, {stats.num_waiting} waiting"
        spec = self.engine_config.speculative
        accepted = spec and acceptance_words(start, stats, spec.num_speculative_tokens)
        return f"{words}; {accepted}" if accepted else words

    def _exchange(self, outputs):
        """Give every rank every replica's finished outputs, each field exactly as its replica
        computed it (token ids, text cut at stop strings, finish reason, logprobs, error,
        request id). They travel as JSON, once per generate call: two AllGathers over the job
        (distributed.all_gather_json); of each replica, its tensor rank 0's are read."""
        from .parallel.distributed import all_gather_json

        mine = [[i, _output_to_json(out)] for i, out in enumerate(outputs) if out is not None]
        everyone = all_gather_json(self.dist, mine)
        for replica in everyone[::self.shard_plan.tensor]:  # ranks of a replica are consecutive
            for index, fields in replica:
                if outputs[index] is None:
                    outputs[index] = _output_from_json(fields)


def _output_to_json(out: RequestOutput) -> dict:
    """A RequestOutput as JSON takes it: logprobs {token id: logprob} as [id, logprob] pairs
    (JSON object keys are strings); floats survive exactly (json writes repr)."""
    fields = {field.name: getattr(out, field.name) for field in dataclasses.fields(out)}
    if out.logprobs is not None:
        fields["logprobs"] = [list(step.items()) for step in out.logprobs]
    if out.prompt_logprobs is not None:
        fields["prompt_logprobs"] = [step and list(step.items()) for step in out.prompt_logprobs]
    return fields


def _output_from_json(fields: dict) -> RequestOutput:
    fields = dict(fields)
    if fields.get("logprobs") is not None:
        fields["logprobs"] = [{int(token): logprob for token, logprob in step}
                              for step in fields["logprobs"]]
    if fields.get("prompt_logprobs") is not None:
        fields["prompt_logprobs"] = [step and {int(token): logprob for token, logprob in step}
                                     for step in fields["prompt_logprobs"]]
    return RequestOutput(**fields)


def _log_start(llm, report):
    config, layout, limits = llm.config, llm.memory.layout, llm.limits
    logger = log.get()
    logger.info("hardware %s (%s): %s", llm.profile.name, llm.hardware_choice, llm.profile.title)
    logger.info("model %s: %d layers, hidden %d, %d heads (%d KV); %s, %s mode, %s (%s)",
                llm.model_dir, config.num_layers, config.hidden_size, config.num_heads,
                config.num_kv_heads, _describe(llm.shard_plan), llm.parallel_mode, report.dtype,
                report.dtype_reason)
    logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB per rank); "
                "chunks of %d tokens; up to %d sequences of up to %d tokens",
                layout.num_blocks - 1, layout.block_size, layout.usable_tokens,
                layout.total_bytes / 2 ** 30, limits.max_prefill_tokens, limits.max_num_seqs,
                limits.max_model_len)


def _describe(plan):
    parts = []
    if plan.tensor > 1:
        kv = f", each KV head on {plan.kv_replicas} ranks" if plan.kv_replicas > 1 else ""
        parts.append(f"tensor parallel x{plan.tensor}{kv}")
    if plan.data > 1:
        parts.append(f"{plan.data} data replicas")
    return ", ".join(parts) or "one device"



def draft_model_proposer(model_dir, config, target_config, dtype, layout, limits, profile):
    """Speculative decoding's draft model (engine/speculative/draft_model.py) in `model_dir`,
    whose ModelConfig is `config`: the whole draft on this rank (a small model: no
    collectives, the same proposals on every rank), in the target's compute dtype, with a KV
    cache of the target's blocks (its block tables address both)."""
    from .engine.model_runner import build_runner
    from .engine.speculative.draft_model import DraftModelProposer
    from .hardware import DTYPE_BYTES
    from .layers.parallel_context import ParallelContext
    from .parallel.strategy import Strategy
    from .planning.kv_layout import CacheLayout

    if config.vocab_size != target_config.vocab_size:
        raise MsinferError(f"speculative_config: the draft model {model_dir} has a vocabulary "
                           f"of {config.vocab_size} tokens, the target {target_config.vocab_size}: "
                           f"a draft must share the target's tokenizer")
    if limits.max_model_len > config.max_context_len:
        raise MsinferError(f"speculative_config: max_model_len {limits.max_model_len} exceeds "
                           f"the draft model's context ({config.max_context_len})")
    plan = Strategy.default(tensor=1).resolve(config, "explicit")
    ctx = ParallelContext(config=config, plan=plan, mode="explicit", dtype=dtype)
    draft_layout = CacheLayout(config.num_layers, config.num_kv_heads, config.head_dim,
                               layout.block_size, layout.num_blocks,
                               DTYPE_BYTES[str(dtype).lower()])
    log.get().info("draft model %s: %d layers, KV cache %.1f MiB", model_dir,
                   config.num_layers, draft_layout.total_bytes / 2 ** 20)
    # its catch-up chunks (the tokens since it last proposed) are a few rows too
    runner = build_runner(model_dir, ctx, draft_layout, limits, 1, profile, speculative=True)
    return DraftModelProposer(runner, limits.max_prefill_tokens, limits.max_model_len)
