"""Strategy files: how a Qwen2 checkpoint is split over devices, and what each rank holds.

A strategy (strategies/*.yaml) names the degrees (tensor x data x pipeline = world_size) and one
shard rule per checkpoint module pattern. `Strategy.resolve(config)` checks it against a model
and returns a `ShardPlan`, the one place that turns a rule into both the MindSpore `in_strategy`
for `shard()` and the slice of each weight a rank loads, so the semi-auto path, the explicit
path and the weight loader cannot disagree.

The parallel mode (`explicit` or `semi_auto`) is decided once, by `decide_parallel_mode`, and
handed to `Strategy.resolve` and the planner, which refuse what the mode cannot run.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import os
import re

import yaml

from ..config import ModelConfig
from ..errors import MsinferError, PlanRefused, positive_int

STYLES = ("colwise", "rowwise", "vocab", "colwise_gather", "replicate", "expert")
PARALLEL_MODES = ("explicit", "semi_auto")
DEFAULT_PARALLEL_MODE = "explicit"
_KEYS = ("world_size", "tensor", "data", "pipeline", "parallel_mode", "rules")

# The Megatron split: q/k/v and gate/up by output features, o/down by input features (one
# AllReduce each per layer), embedding by vocabulary rows, lm_head by vocabulary then gathered.
TENSOR_PARALLEL_RULES = {
    "model.embed_tokens": "vocab",
    "model.layers.*.input_layernorm": "replicate",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.post_attention_layernorm": "replicate",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "model.norm": "replicate",
    "lm_head": "colwise_gather",
}
# A MoE model's sparse layers (Qwen2-MoE, Qwen3-MoE): the router whole on every rank, every
# expert split along its intermediate width (each rank a slice of every expert, one AllReduce
# per layer as the dense MLP), Qwen2-MoE's shared expert split as a dense MLP.
MOE_TENSOR_PARALLEL_RULES = {
    "model.layers.*.mlp.gate": "replicate",
    "model.layers.*.mlp.experts.*.gate_proj": "colwise",
    "model.layers.*.mlp.experts.*.up_proj": "colwise",
    "model.layers.*.mlp.experts.*.down_proj": "rowwise",
    "model.layers.*.mlp.shared_expert.gate_proj": "colwise",
    "model.layers.*.mlp.shared_expert.up_proj": "colwise",
    "model.layers.*.mlp.shared_expert.down_proj": "rowwise",
    "model.layers.*.mlp.shared_expert_gate": "replicate",
}

# What each module is, the styles msinfer runs for it (the split one first, so that at tensor 1,
# where every style is the whole weight, a raw in_strategy reads as the split style), and the
# primitive that consumes its weight.
_ALLOWED = {
    "embedding": ("vocab", "replicate"),
    "attention_in": ("colwise", "replicate"),
    "attention_out": ("rowwise", "replicate"),
    "mlp_in": ("colwise", "replicate"),
    "mlp_out": ("rowwise", "replicate"),
    "norm": ("replicate",),
    "lm_head": ("colwise_gather", "replicate"),
    "router": ("replicate",),
    # expert: whole experts per rank (expert parallel), num_experts / tensor on each
    "expert_in": ("colwise", "replicate", "expert"),
    "expert_out": ("rowwise", "replicate", "expert"),
}
_PRIMITIVE = {"embedding": "Gather"}  # norms have none (replicated, element-wise); others MatMul
_LAST_NAME_KIND = {
    "q_proj": "attention_in", "k_proj": "attention_in", "v_proj": "attention_in",
    "o_proj": "attention_out", "gate_proj": "mlp_in", "up_proj": "mlp_in",
    "down_proj": "mlp_out", "gate": "router", "shared_expert_gate": "router",
}
_TIED_SPLIT = {"vocab": "colwise_gather", "replicate": "replicate"}
# Qwen3's per-head norms of q and k (one weight of head_dim for every head): whole on every
# rank, so a strategy need not name them (written for Qwen2, it works for Qwen3 as it is).
PER_HEAD_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
# The model fuses these projections: one matmul of the parts' rows stacked in this order, each
# rank holding its slice of every part (so fusing changes no rule and no byte count).
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.shared_expert.gate_up_proj": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
}
# A sparse layer's experts, stacked: the model's weight of each name holds, expert after
# expert, the parts of the experts a rank holds (every expert, or its own under `expert`).
STACKED_EXPERTS = {"mlp.experts.gate_up_proj": ("gate_proj", "up_proj"),
                   "mlp.experts.down_proj": ("down_proj",)}
_EXPERT = re.compile(r"\.experts\.\d+\.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def decide_parallel_mode(requested: str | None, strategy: Strategy) -> str:
    """The one decision of the parallel mode: what the caller asked for (`--parallel-mode`,
    `LLM(parallel_mode=...)`), else the strategy's `parallel_mode`, else explicit, on every
    device. Explicit is the path the tests run on real ranks; semi_auto is opt-in."""
    mode = requested or strategy.parallel_mode or DEFAULT_PARALLEL_MODE
    if mode not in PARALLEL_MODES:
        raise MsinferError(f"parallel mode {mode!r}: use {' or '.join(PARALLEL_MODES)}")
    return mode


def _kind(module):
    if module == "model.embed_tokens":
        return "embedding"
    if module == "lm_head":
        return "lm_head"
    if module == "model.norm" or module.endswith(("layernorm",) + PER_HEAD_NORMS):
        return "norm"
    kind = _LAST_NAME_KIND[module.rsplit(".", 1)[-1]]
    if _EXPERT.search(module):
        return "expert_in" if kind == "mlp_in" else "expert_out"
    return kind


def _module(name):
    """The module a checkpoint tensor belongs to: rules name modules, weight and bias follow."""
    return name.rsplit(".", 1)[0]


def _in_strategy(kind, style, tensor, data, bias=False):
    """The MindSpore in_strategy of the primitive that consumes this module's weight (or adds
    its bias). Activations are 2-D (tokens, features), their rows split over data replicas;
    token ids are 1-D (tokens,)."""
    t, d = tensor, data
    if bias:  # BiasAdd(x, b): a colwise output stays split, others are whole
        return ((d, t), (t,)) if style == "colwise" else ((d, 1), (1,))
    if style in ("colwise", "colwise_gather"):
        return ((d, 1), (t, 1))
    if style == "rowwise":
        return ((d, t), (1, t))
    # Gather(table, ids): MindSpore's GatherInfo lets a table split on the gathered axis 0 take
    # only unsplit ids (its "shard axis 0" mode; the "batch and axis" mode needs both 2-D), so
    # a vocabulary split leaves the ids whole and the data replicas compute the lookup alike.
    if style == "vocab":
        return ((t, 1), (1,))
    if _PRIMITIVE.get(kind) == "Gather":
        return ((1, 1), (d,))
    return ((d, 1), (1, 1))


def _even_split(size, parts, index):
    step = size // parts
    return slice(index * step, (index + 1) * step)


def checkpoint_parts(name, experts=()):
    """The checkpoint tensors a model weight is made of: the parts of the `experts` (expert
    numbers) for a STACKED_EXPERTS weight, its FUSED parts, else itself."""
    for stacked, parts in STACKED_EXPERTS.items():
        if f".{stacked}." in name:
            return [name.replace(stacked, f"mlp.experts.{e}.{part}")
                    for e in experts for part in parts]
    for fused, parts in FUSED.items():
        if f".{fused}." in name:
            return [name.replace(fused, part) for part in parts]
    return [name]


def _ratio(a, b):
    return f"{a} / {b} = {a / b:g}"


def divisibility_problems(config: ModelConfig, styles: dict[str, str], tensor: int) -> list[str]:
    """Why `tensor` cannot split this model under these module styles (empty when it can)."""
    t = tensor
    if t == 1:
        return []
    first = "model.layers.0."
    problems = []
    if styles[first + "self_attn.q_proj"] == "colwise":
        heads, kv = config.num_heads, config.num_kv_heads
        if heads % t:
            problems.append(f"the {heads} attention heads do not split into {t} "
                            f"({_ratio(heads, t)} heads per rank)")
        if t % kv and kv % t:
            problems.append(f"the {kv} KV heads can neither be split {t} ways ({_ratio(kv, t)}) "
                            f"nor replicated evenly ({_ratio(t, kv)} ranks per KV head)")
    dense = first_layer(config, sparse=False)
    if (dense is not None and styles[f"model.layers.{dense}.mlp.gate_proj"] == "colwise"
            and config.intermediate_size % t):
        problems.append(f"intermediate_size does not split: "
                        f"{_ratio(config.intermediate_size, t)}")
    problems += _expert_problems(config, styles, t)
    vocab_split = (styles["model.embed_tokens"] == "vocab"
                   or styles["lm_head"] == "colwise_gather")
    if vocab_split and config.vocab_size % t:
        problems.append(f"vocab_size does not split: {_ratio(config.vocab_size, t)}")
    return problems


def first_layer(config, sparse=True):
    """The first decoder layer with routed experts (`sparse`) or with a dense MLP; None when
    there is none: the layer whose names stand for every layer of its kind."""
    return next((n for n in range(config.num_layers) if config.is_sparse_layer(n) == sparse),
                None)


def _expert_problems(config, styles, t):
    """Why `t` cannot place a MoE model's experts (and shared expert) as the styles say."""
    sparse = first_layer(config)
    if sparse is None:
        return []
    moe, p = config.moe, f"model.layers.{sparse}.mlp."
    style = styles[p + "experts.0.gate_proj"]
    problems = []
    if style == "colwise" and moe.intermediate % t:
        problems.append(f"moe_intermediate_size does not split: {_ratio(moe.intermediate, t)}")
    if style == "expert" and moe.num_experts % t:
        problems.append(f"expert parallel: the {moe.num_experts} experts do not split into "
                        f"{t} ranks ({_ratio(moe.num_experts, t)} experts per rank)")
    shared = moe.shared_expert_intermediate
    if shared and styles[p + "shared_expert.gate_proj"] == "colwise" and shared % t:
        problems.append(f"shared_expert_intermediate_size does not split: {_ratio(shared, t)}")
    return problems


class ShardPlan:
    """A strategy resolved against one model: the style, slices and in_strategy of every tensor.

    Global rank r = data_rank * tensor + tensor_rank: tensor groups are consecutive ranks.
    Slices are in HF layout (weights are (out, in)) and index safetensors' get_slice directly.
    """

    def __init__(self, config: ModelConfig, styles: dict[str, str], tensor: int, data: int = 1,
                 source: str = "<memory>"):
        problems = divisibility_problems(config, styles, tensor)
        if problems:
            working = [str(n) for n in range(1, 65)
                       if not divisibility_problems(config, styles, n)]
            raise PlanRefused(
                f"{source}: tensor: {tensor} cannot shard {config.source}: "
                f"{'; '.join(problems)}. Tensor degrees that work for this model with these "
                f"rules: {', '.join(working)}")
        self.config = config
        self.styles = dict(styles)
        self.tensor = tensor
        self.data = data
        self.world_size = tensor * data
        self.source = source
        self._shapes = config.parameter_shapes()
        if "lm_head.weight" not in self._shapes:  # tied: the embedding serves as lm_head too
            self._shapes["lm_head.weight"] = self._shapes["model.embed_tokens.weight"]
        attention_split = styles["model.layers.0.self_attn.q_proj"] == "colwise"
        kv = config.num_kv_heads
        # KV heads too few to split: each is held, whole, by tensor // kv consecutive ranks.
        self.replicated_kv_heads = attention_split and tensor > kv
        if attention_split:
            self.kv_replicas = tensor // kv if self.replicated_kv_heads else 1
        else:
            self.kv_replicas = tensor  # every rank holds every head
        self.local_kv_heads = kv * self.kv_replicas // tensor
        self.local_heads = config.num_heads // tensor if attention_split else config.num_heads

    def _check(self, name):
        if name not in self._shapes and not self._tied_lm_head(name):
            raise MsinferError(f"{name!r} is not a parameter of {self.config.source}")

    def _tied_lm_head(self, name):
        return name == "lm_head.weight" and self.config.tie_word_embeddings

    def style(self, name: str) -> str:
        """The split of a checkpoint tensor (or of a fused weight: its parts'). With tied
        embeddings the lm_head reuses the embedding's slice: vocab rows split
        (colwise_gather) or whole (replicate)."""
        name = self.parts(name)[0]
        self._check(name)
        if self._tied_lm_head(name):
            return _TIED_SPLIT[self.styles["model.embed_tokens"]]
        return self.styles[_module(name)]

    def parts(self, name: str, tensor_rank: int = 0) -> list[str]:
        """The checkpoint tensors of a model weight on tensor rank `tensor_rank`: its FUSED
        parts, or the parts of the experts the rank holds (STACKED_EXPERTS), else itself."""
        return checkpoint_parts(name, self.local_experts(name, tensor_rank))

    def local_experts(self, name: str, tensor_rank: int = 0) -> range:
        """The experts (numbers) of the sparse layer of `name` that tensor rank `tensor_rank`
        holds: every one, each sliced, unless the experts are placed whole (`expert`)."""
        if self.config.moe is None:
            return range(0)
        experts = self.config.moe.num_experts
        layer = _LAYER.match(name)
        probe = (f"{layer.group(0) if layer else 'model.layers.0.'}mlp.experts.0.gate_proj")
        if self.styles.get(probe) != "expert" or self.tensor == 1:
            return range(experts)
        per_rank = experts // self.tensor
        return range(tensor_rank * per_rank, (tensor_rank + 1) * per_rank)

    def slices(self, name: str, tensor_rank: int) -> tuple[slice, ...]:
        style = self.style(name)
        if not 0 <= tensor_rank < self.tensor:
            raise MsinferError(f"tensor rank {tensor_rank} is outside 0..{self.tensor - 1}")
        shape = self._shapes[name]
        whole = [slice(0, n) for n in shape]
        if style == "expert" and self.tensor > 1:  # the rank's own experts whole, no other
            expert = int(_EXPERT.search(name).group(0).split(".")[2])
            if expert not in self.local_experts(name, tensor_rank):
                whole[0] = slice(0, 0)
            return tuple(whole)
        if style == "replicate" or self.tensor == 1:
            return tuple(whole)
        if style == "rowwise":
            if name.endswith(".weight"):  # a rowwise bias is whole: added once, after the sum
                whole[1] = _even_split(shape[1], self.tensor, tensor_rank)
            return tuple(whole)
        if _module(name).endswith(("k_proj", "v_proj")):
            # Rank r holds KV heads [first, first + local); with replication (tensor > KV
            # heads) consecutive ranks share one head, matching the GQA grouping of their
            # query heads.
            head_dim = self.config.head_dim
            first = (tensor_rank // self.kv_replicas) * self.local_kv_heads
            whole[0] = slice(first * head_dim, (first + self.local_kv_heads) * head_dim)
        else:
            whole[0] = _even_split(shape[0], self.tensor, tensor_rank)
        return tuple(whole)

    def local_shape(self, name: str) -> tuple[int, ...]:
        """Shape of a rank's slice; a fused weight stacks its parts' slices."""
        shapes = [tuple(s.stop - s.start for s in self.slices(part, 0))
                  for part in self.parts(name)]
        return (sum(s[0] for s in shapes),) + shapes[0][1:]

    def in_strategy(self, name: str) -> tuple[tuple[int, ...], ...]:
        """The in_strategy semi_auto hands to shard() for the primitive consuming `name` (a
        fused weight: its parts')."""
        name = self.parts(name)[0]
        style = self.style(name)
        module = _module(name)
        if _kind(module) == "norm":
            raise MsinferError(f"{name}: a norm weight is replicated and applied element-wise; "
                               f"it has no MatMul or Gather in_strategy")
        if self.replicated_kv_heads and module.endswith(("k_proj", "v_proj")):
            raise MsinferError(
                f"{self.source}: {name}: tensor={self.tensor} exceeds the "
                f"{self.config.num_kv_heads} KV heads, so ranks share replicated KV heads; "
                f"msinfer's semi_auto path has no shard() layout for that. "
                f"Use parallel_mode: explicit")
        return _in_strategy(_kind(module), style, self.tensor, self.data,
                            bias=name.endswith(".bias"))

    def tensor_rank(self, global_rank: int) -> int:
        self._check_rank(global_rank)
        return global_rank % self.tensor

    def data_rank(self, global_rank: int) -> int:
        self._check_rank(global_rank)
        return global_rank // self.tensor

    def _check_rank(self, global_rank):
        if not 0 <= global_rank < self.world_size:
            raise MsinferError(f"rank {global_rank} is outside 0..{self.world_size - 1}")


@dataclasses.dataclass(frozen=True)
class Strategy:
    world_size: int
    tensor: int
    data: int = 1
    pipeline: int = 1
    parallel_mode: str | None = None  # None: decide_parallel_mode's default
    rules: dict = dataclasses.field(default_factory=dict)  # pattern -> style or raw in_strategy
    source: str = "<memory>"

    @classmethod
    def default(cls, tensor: int = 1, data: int = 1,
                parallel_mode: str | None = None) -> Strategy:
        """The tensor-parallel plan of strategies/qwen2_tp*.yaml (with a MoE model's rules of
        strategies/moe_tp*.yaml), in memory."""
        return cls(world_size=tensor * data, tensor=tensor, data=data,
                   parallel_mode=parallel_mode,
                   rules={**TENSOR_PARALLEL_RULES, **MOE_TENSOR_PARALLEL_RULES},
                   source=f"<default tensor={tensor} data={data}>")

    @classmethod
    def from_dict(cls, raw: object, source: str = "<dict>") -> Strategy:
        if not isinstance(raw, dict):
            raise MsinferError(f"{source}: a strategy is a mapping of keys "
                               f"({', '.join(_KEYS)}), got {type(raw).__name__}")
        for key in raw:
            if key not in _KEYS:
                close = difflib.get_close_matches(str(key), _KEYS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise MsinferError(f"{source}: unknown key {key!r}{hint}; a strategy has "
                                   f"{', '.join(_KEYS)}")
        for key in ("world_size", "tensor", "rules"):
            if key not in raw:
                raise MsinferError(f"{source}: missing key {key!r}")

        world_size, tensor, data, pipeline = (
            positive_int(raw.get(k, 1), f"{source}: {k}:")
            for k in ("world_size", "tensor", "data", "pipeline"))
        if tensor * data * pipeline != world_size:
            raise MsinferError(
                f"{source}: world_size: {world_size} is not tensor x data x pipeline = "
                f"{tensor} x {data} x {pipeline} = {tensor * data * pipeline}")
        mode = raw.get("parallel_mode")
        if mode is not None and mode not in PARALLEL_MODES:
            raise MsinferError(f"{source}: parallel_mode: {mode!r} is not one of "
                               f"{', '.join(PARALLEL_MODES)}")
        rules = raw["rules"]
        if not isinstance(rules, dict) or not rules:
            raise MsinferError(f"{source}: rules: expected a mapping of module pattern -> "
                               f"style, got {rules!r}")
        parsed = {}
        for pattern, value in rules.items():
            if not isinstance(pattern, str) or not pattern:
                raise MsinferError(f"{source}: rules: pattern {pattern!r} is not a module name")
            parsed[pattern] = _parse_rule(value, f"{source}: rules.{pattern}")
        return cls(world_size, tensor, data, pipeline, mode, parsed, source)

    def resolve(self, config: ModelConfig, parallel_mode: str | None = None) -> ShardPlan:
        """Check this strategy against a model, run in `parallel_mode` (None: decided by
        decide_parallel_mode), and return its ShardPlan. PlanRefused for what the model or the
        mode cannot run."""
        src = self.source
        mode = decide_parallel_mode(parallel_mode, self)
        if self.pipeline > 1:
            raise PlanRefused(
                f"{src}: pipeline: {self.pipeline}: msinfer runs tensor and data parallelism "
                f"only; set tensor: {self.tensor * self.pipeline} and pipeline: 1")
        modules = list(dict.fromkeys(_module(n) for n in config.parameter_shapes()))
        tied = "lm_head" not in modules
        if tied:
            modules.append("lm_head")
        regexes = {p: re.compile(re.escape(p).replace(r"\*", "[^.]*") + "$") for p in self.rules}
        rule_of = {}
        for module in modules:
            matches = [p for p, rx in regexes.items() if rx.match(module)]
            if len(matches) > 1:
                raise MsinferError(
                    f"{src}: rules: {matches[0]!r} and {matches[1]!r} both cover {module}; "
                    f"each module needs exactly one rule")
            if matches:
                rule_of[module] = matches[0]
        # A MoE model's rules may serve dense models, a dense MLP's rules a MoE model with no
        # dense layer, and a shared expert's a MoE family without one.
        unused = [p for p in self.rules if p not in rule_of.values()
                  and p not in MOE_TENSOR_PARALLEL_RULES
                  and not (config.moe is not None and ".mlp." in p)]
        if unused:
            raise MsinferError(
                f"{src}: rules.{unused[0]}: the pattern matches no module of {config.source} "
                f"(patterns name modules, e.g. model.layers.*.self_attn.q_proj; the weight and "
                f"bias follow; '*' stands for one name part)")
        uncovered = [m for m in modules if m not in rule_of and not (tied and m == "lm_head")
                     and not m.endswith(PER_HEAD_NORMS)]
        if uncovered:
            more = f" and {len(uncovered) - 1} more" if len(uncovered) > 1 else ""
            example = _LAYER.sub("model.layers.*.", uncovered[0])
            raise MsinferError(
                f"{src}: rules: no rule covers {uncovered[0]}{more}; add one, e.g. "
                f"'{example}: {_ALLOWED[_kind(uncovered[0])][0]}'")
        styles = {m: self._style(m, rule_of[m]) for m in rule_of}
        for module in modules:  # per-head norms no rule names: replicated
            if module.endswith(PER_HEAD_NORMS):
                styles.setdefault(module, "replicate")
        if tied:
            embedding = styles["model.embed_tokens"]
            styles.setdefault("lm_head", _TIED_SPLIT[embedding])
            if styles["lm_head"] != _TIED_SPLIT[embedding]:
                raise MsinferError(
                    f"{src}: rules.{rule_of['lm_head']}: {config.source} ties lm_head to the "
                    f"embedding, so one slice serves both: with model.embed_tokens "
                    f"{embedding}, lm_head must be {_TIED_SPLIT[embedding]}, "
                    f"not {styles['lm_head']}")
        _check_layers(styles, rule_of, src)
        plan = ShardPlan(config, styles, self.tensor, self.data, src)
        if mode == "semi_auto" and config.moe is not None:
            raise PlanRefused(
                f"{src}: parallel mode semi_auto: {config.source} is a mixture-of-experts "
                f"model ({config.model_type}), which msinfer runs only in the explicit mode "
                f"(the default: drop --parallel-mode semi_auto / parallel_mode: semi_auto)")
        if mode == "semi_auto" and plan.replicated_kv_heads:
            raise PlanRefused(
                f"{src}: parallel mode semi_auto: tensor={self.tensor} exceeds the "
                f"{config.num_kv_heads} KV heads of {config.source}, so ranks share replicated "
                f"KV heads, which msinfer runs only in the explicit mode (the default: drop "
                f"--parallel-mode semi_auto / parallel_mode: semi_auto), or use tensor <= "
                f"{config.num_kv_heads}")
        return plan

    def _style(self, module, pattern):
        """The style a rule gives a module, checked against what msinfer runs for that module."""
        kind = _kind(module)
        rule = self.rules[pattern]
        allowed = _ALLOWED[kind]
        where = f"{self.source}: rules.{pattern}"
        if isinstance(rule, str):
            if rule not in allowed:
                raise MsinferError(f"{where}: {module} cannot be {rule}; msinfer runs it as "
                                   f"{' or '.join(allowed)}")
            return rule
        if kind == "norm":
            raise MsinferError(f"{where}: {module} is a norm weight (applied element-wise, not "
                               f"by MatMul or Gather); give it the style replicate")
        primitive = _PRIMITIVE.get(kind, "MatMul")
        for style in allowed:
            if _in_strategy(kind, style, self.tensor, self.data) == rule:
                return style
        options = ", ".join(
            f"{_as_lists(_in_strategy(kind, s, self.tensor, self.data))} ({s})" for s in allowed)
        raise MsinferError(
            f"{where}: in_strategy {_as_lists(rule)} is not a layout msinfer runs for {module} "
            f"({primitive}, tensor={self.tensor}, data={self.data}); use {options}")


def _check_layers(styles, rule_of, source):
    """Every decoder layer alike, attention and MLP each either split or whole."""
    layer0 = {}
    for module, style in styles.items():
        found = _LAYER.match(module)
        if not found:
            continue
        part = _EXPERT.sub(".experts.*.", module[found.end() - 1:])[1:]
        first = layer0.setdefault(part, (module, style))
        if first[1] != style:
            raise MsinferError(
                f"{source}: rules.{rule_of[module]}: msinfer shards every decoder layer alike, "
                f"but {first[0]} is {first[1]} and {module} is {style}")
    blocks = (("self_attn", ("q_proj", "k_proj", "v_proj"), "o_proj"),
              ("mlp", ("gate_proj", "up_proj"), "down_proj"),
              ("mlp.experts.*", ("gate_proj", "up_proj"), "down_proj"),
              ("mlp.shared_expert", ("gate_proj", "up_proj"), "down_proj"))
    for block, inputs, output in blocks:
        if f"{block}.{output}" not in layer0:  # a MoE model without dense layers, ...
            continue
        found = {n: layer0[f"{block}.{n}"][1] for n in inputs + (output,)}
        split = all(found[n] == "colwise" for n in inputs) and found[output] == "rowwise"
        wholes = [{"replicate"}] + ([{"expert"}] if block == "mlp.experts.*" else [])
        if not split and set(found.values()) not in wholes:
            listing = ", ".join(f"{n} {s}" for n, s in found.items())
            placed = " or whole experts per rank (all expert)" if block == "mlp.experts.*" else ""
            raise MsinferError(
                f"{source}: rules: {block} has {listing}; msinfer runs it either split "
                f"({'/'.join(inputs)} colwise with {output} rowwise){placed} or whole "
                f"(all replicate)")


def _parse_rule(value, where):
    if isinstance(value, str):
        if value not in STYLES:
            close = difflib.get_close_matches(value, STYLES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise MsinferError(f"{where}: unknown style {value!r}{hint}; use one of "
                               f"{', '.join(STYLES)} or a raw in_strategy like [[1, 1], [4, 1]]")
        return value
    ok = (isinstance(value, list) and len(value) == 2
          and all(isinstance(row, list) and row for row in value)
          and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                  for row in value for n in row))
    if not ok:
        raise MsinferError(f"{where}: {value!r} is neither a style ({', '.join(STYLES)}) nor "
                           f"an in_strategy of two lists of positive integers, e.g. "
                           f"[[1, 1], [4, 1]]")
    return tuple(tuple(row) for row in value)


def _as_lists(strategy):
    return [list(row) for row in strategy]


class _StrictLoader(yaml.SafeLoader):
    """YAML that refuses a repeated key instead of silently keeping the last one."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, collections.abc.Hashable):
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r}", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep)


def strategy_of(path: str | None = None, tensor_parallel_size: int | None = None) -> Strategy:
    """A strategy file's plan; else the shipped tensor-parallel plan of tensor_parallel_size
    (strategies/qwen2_tpN.yaml's rules, in memory: vLLM's --tensor-parallel-size); else one
    device. EngineConfig (engine_config.ParallelConfig) refuses both at once."""
    if path:
        return load_strategy(path)
    return Strategy.default(tensor=tensor_parallel_size or 1)


def load_strategy(path: str | os.PathLike) -> Strategy:
    path = str(path)
    try:
        with open(path) as f:
            raw = yaml.load(f, Loader=_StrictLoader)
    except OSError as e:
        raise MsinferError(f"{path}: cannot read strategy file: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise MsinferError(f"{path}: not valid YAML: {e}") from None
    return Strategy.from_dict(raw, source=path)
