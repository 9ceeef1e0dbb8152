"""The Python API: `LLM(model_dir, strategy=...).generate(prompts, SamplingParams(...))`.

Inside each rank of a sharded job the same code runs; every rank returns the same outputs.
"""
import dataclasses
import os

import numpy as np

from . import log
from .config import ModelConfig, eos_token_ids
from .errors import MsinferError
from .plan import check_plan_or_raise, default_max_len
from .sampling import Sampler, SamplingParams
from .tokenizer import find_stop


@dataclasses.dataclass
class RequestOutput:
    prompt: str  # None when the prompt was given as token ids
    prompt_token_ids: list
    token_ids: list  # generated ids only
    text: str
    finish_reason: str  # "stop" (eos, stop token or stop string) or "length"


class LLM:
    """A Qwen2 checkpoint loaded for compiled (GRAPH_MODE) inference, sharded per `strategy`.

    model_dir: a Hugging Face Qwen2 directory (config.json, *.safetensors, tokenizer.json).
    strategy: a strategy YAML path (see strategies/); None runs on one device.
    hardware: a profile name from msinfer.hardware (default "cpu").
    parallel_mode: "explicit" or "semi_auto"; default: the strategy's, else explicit
        (strategy.decide_parallel_mode).
    max_batch, max_len: the static KV cache (rows and positions); prompts longer than fit
        are refused before anything runs.
    dtype: compute dtype override (the hardware's policy decides otherwise).
    """

    def __init__(self, model_dir, strategy=None, hardware="cpu", parallel_mode=None,
                 max_batch=8, max_len=None, dtype=None, rank_table=None):
        import mindspore as ms

        from .distributed import init_distributed, job_seed, tensor_group
        from .engine import Engine
        from .hardware import get_profile
        from .strategy import Strategy, decide_parallel_mode, load_strategy

        self.model_dir = model_dir
        self.config = ModelConfig.from_model_dir(model_dir)
        self.profile = get_profile(hardware)
        self.strategy = load_strategy(strategy) if strategy else Strategy.default()
        self.parallel_mode = decide_parallel_mode(parallel_mode, self.strategy)
        max_len = max_len or default_max_len(self.config)
        if max_len > self.config.max_position_embeddings:
            raise MsinferError(f"max_len {max_len} exceeds the model's "
                               f"max_position_embeddings {self.config.max_position_embeddings}")
        # The planner's check, here too, so every entry point refuses an illegal or oversized
        # plan before any device or collective is touched.
        report = check_plan_or_raise(self.config, self.strategy, self.profile, batch=max_batch,
                                     max_len=max_len, dtype=dtype,
                                     parallel_mode=self.parallel_mode)
        dtype_name, self.dtype_reason = report.dtype, report.dtype_reason
        self.plan = self.strategy.resolve(self.config, self.parallel_mode)

        self.dist = init_distributed(self.profile.device_target, self.strategy.world_size,
                                     rank_table)
        if self.dist.world_size == 1:
            log.setup()
        self.tensor_rank = self.plan.tensor_rank(self.dist.rank)
        logger = log.get()
        logger.info("model %s: %d layers, hidden %d, %d heads (%d KV); %s, %s mode, %s (%s)",
                    model_dir, self.config.num_layers, self.config.hidden_size,
                    self.config.num_heads, self.config.num_kv_heads, _describe(self.plan),
                    self.parallel_mode, dtype_name, self.dtype_reason)
        if self.parallel_mode == "semi_auto" and self.dist.world_size > 1:
            ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", full_batch=True,
                                         device_num=self.dist.world_size)

        from .model import Qwen2ForCausalLM
        from .parallel_layers import ParallelContext, checkpoint_parameters
        from .weights import Checkpoint

        # Explicit data parallelism: each replica runs its share of the prompts with its own
        # tensor group; semi_auto splits the batch inside MindSpore (full_batch) instead.
        self.replicas = self.plan.data if self.parallel_mode == "explicit" else 1
        group = tensor_group(self.dist, self.plan) if self.replicas > 1 else None
        ctx = ParallelContext(config=self.config, plan=self.plan, mode=self.parallel_mode,
                              tensor_rank=self.tensor_rank, group=group,
                              dtype=getattr(ms, dtype_name))
        self.model = Qwen2ForCausalLM(self.config, ctx, max_batch, max_len)
        self.engine = Engine(self.model, max_batch, max_len)
        shapes = self.config.parameter_shapes()
        parameters = checkpoint_parameters(self.model)
        if self.parallel_mode == "semi_auto" and self.dist.world_size > 1:
            # Parameters become this rank's slices once the graphs are compiled with the
            # plan's layouts; load the slices after that, from the same function.
            self.engine.compile_for_layouts()
        Checkpoint(model_dir).load_into(
            parameters, lambda name: (self.plan.slices(name, self.tensor_rank), shapes[name]))
        self._tokenizer = None
        self._sampler = Sampler()
        self._seed = job_seed(self.dist)  # for requests without a seed of their own
        self._requests = 0

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from .tokenizer import Tokenizer
            self._tokenizer = Tokenizer.from_model_dir(self.model_dir)
        return self._tokenizer

    @property
    def compilations(self):
        """Graphs compiled so far (prefill and decode buckets)."""
        return self.engine.compilations

    @property
    def has_tokenizer(self):
        """Token-id prompts work without tokenizer.json; text needs it."""
        return os.path.isfile(os.path.join(self.model_dir, "tokenizer.json"))

    def eos_token_ids(self):
        if self.has_tokenizer:
            return set(self.tokenizer.eos_token_ids)
        return set(eos_token_ids(self.model_dir))

    def generate(self, prompts, sampling_params=None):
        """prompts: a string, a list of strings, or a list of token-id lists.
        sampling_params: one SamplingParams for all, or one per prompt.
        Returns one RequestOutput per prompt, in order."""
        from .engine import Sequence

        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            return []
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise MsinferError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        texts, token_lists = [], []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                texts.append(prompt)
                token_lists.append(self.tokenizer.encode(prompt))
            else:
                ids = [int(t) for t in prompt]
                bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
                if bad:
                    raise MsinferError(f"prompt {i}: token id {bad[0]} is outside the "
                                       f"vocabulary (0..{self.config.vocab_size - 1})")
                texts.append(None)
                token_lists.append(ids)
            if not token_lists[-1]:
                raise MsinferError(f"prompt {i} is empty: give at least one token")
        eos = self.eos_token_ids()
        generators = [self._generator(p) for p in params]
        sequences = [Sequence(ids, p.max_tokens) for ids, p in zip(token_lists, params)]
        for seq in sequences:  # refuse before any replica starts
            self.engine.check_fits(len(seq.prompt), seq.max_tokens)
        # With data replicas, replica d runs prompts d, d + data, ...; then all exchange.
        mine = list(range(self.plan.data_rank(self.dist.rank) if self.replicas > 1 else 0,
                          len(sequences), self.replicas))

        def next_tokens(rows, logits):
            return self._sampler(logits, [params[mine[r]] for r in rows],
                                 [generators[mine[r]] for r in rows])

        def is_finished(row, seq):
            p, token = params[mine[row]], seq.generated[-1]
            if (token in eos and not p.ignore_eos) or token in p.stop_token_ids:
                return "stop"
            if p.stop and find_stop(self.tokenizer.decode(seq.generated), p.stop) is not None:
                return "stop"
            return None

        self.engine.generate([sequences[i] for i in mine], next_tokens, is_finished)
        if self.replicas > 1:
            self._exchange(sequences, mine, max(p.max_tokens for p in params))
        return [self._output(text, seq, p) for text, seq, p in zip(texts, sequences, params)]

    def _exchange(self, sequences, mine, max_tokens):
        """Give every rank every replica's results: one AllGather over the job of fixed-size
        rows [prompt index, finished as "stop", count, tokens...] (float32 holds ids < 2**24
        exactly)."""
        from .distributed import all_gather_rows

        per_replica = -(-len(sequences) // self.replicas)
        rows = np.full((per_replica, 3 + max_tokens), -1, np.float32)
        for slot, index in enumerate(mine):
            seq = sequences[index]
            rows[slot, :3] = index, seq.finish_reason == "stop", len(seq.generated)
            rows[slot, 3:3 + len(seq.generated)] = seq.generated
        everyone = all_gather_rows(rows).reshape(self.dist.world_size, per_replica, -1)
        for row in everyone[::self.plan.tensor].reshape(-1, rows.shape[1]):  # one rank each
            if row[0] >= 0:
                seq = sequences[int(row[0])]
                seq.generated = row[3:3 + int(row[2])].astype(np.int64).tolist()
                seq.finish_reason = "stop" if row[1] else "length"

    def _generator(self, params):
        self._requests += 1
        if params.seed is not None:
            return params.new_generator()
        # Every rank sees the same requests in the same order: the same stream everywhere.
        return np.random.default_rng((self._seed, self._requests))

    def _output(self, prompt_text, seq, params):
        text = self.tokenizer.decode(seq.generated) if self.has_tokenizer else ""
        cut = find_stop(text, params.stop) if params.stop else None
        return RequestOutput(prompt=prompt_text, prompt_token_ids=list(seq.prompt),
                             token_ids=list(seq.generated), text=text[:cut],
                             finish_reason=seq.finish_reason)


def _describe(plan):
    parts = []
    if plan.tensor > 1:
        kv = f", each KV head on {plan.kv_replicas} ranks" if plan.kv_replicas > 1 else ""
        parts.append(f"tensor parallel x{plan.tensor}{kv}")
    if plan.data > 1:
        parts.append(f"{plan.data} data replicas")
    return ", ".join(parts) or "one device"
