"""Model configuration (Qwen2, Qwen2.5, Qwen3 dense, Qwen2-MoE and Qwen3-MoE), read from a
Hugging Face config.json.

Accepts both spellings in the wild: transformers 4.x (`rope_theta`, `rope_scaling`,
`torch_dtype`) and 5.x (`rope_parameters`, `dtype`). Every derived size is computed here, once,
and the ids that end a generation are read here, once (`eos_token_ids`). What msinfer cannot
run (another architecture, a rope type other than default and yarn, Qwen3 with attention
biases or sliding windows) is refused here, naming the config field and what is supported.
"""
from __future__ import annotations

import dataclasses
import json
import os

from .errors import MsinferError, positive_int

# model_type -> the architecture its checkpoints name (models/families.py: the code of each).
_SUPPORTED_MODEL_TYPES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                          "qwen2_moe": "Qwen2MoeForCausalLM",
                          "qwen3_moe": "Qwen3MoeForCausalLM"}
_SUPPORTED_ROPE_TYPES = ("default", "yarn")
_REQUIRED_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads",
)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Static YaRN (rope type `yarn`), as HF transformers' `_compute_yarn_parameters` reads it:
    `factor`, `original_max_position_embeddings`, and the optional `attention_factor`,
    `beta_fast`, `beta_slow`, `mscale`, `mscale_all_dim`, `truncate` (None: HF's defaults)."""

    rope_type: str
    factor: float
    original_max_position_embeddings: int
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @property
    def max_positions(self) -> int:
        """The context the scaling reaches: factor x the original context."""
        return int(self.factor * self.original_max_position_embeddings)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    source: str = "<memory>"
    model_type: str = "qwen2"  # qwen3: per-head q/k RMSNorm, no q/k/v bias
    rope_scaling: RopeScaling | None = None  # None: HF's default rotary embedding
    moe: MoeConfig | None = None  # qwen2_moe / qwen3_moe: their sparse layers' experts
    # msModelSlim's schemes when the directory is quantized (quantization.py), else None
    quantization: object = None

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` runs routed experts (HF's rule): not in
        mlp_only_layers, and (layer + 1) a multiple of decoder_sparse_step."""
        moe = self.moe
        return (moe is not None and moe.num_experts > 0 and layer not in moe.mlp_only_layers
                and (layer + 1) % moe.decoder_sparse_step == 0)

    def layer_kinds(self) -> tuple:
        """Each decoder layer's kind: whether it is sparse, and its projections' quantization
        schemes (msModelSlim may leave some layers' projections float). Layers of one kind
        take the same compiled graph; a stack of consecutive layers is compiled once per
        distinct run of kinds it covers (ExplicitRunner, and the planner counting them)."""
        quantization = self.quantization
        return tuple((self.is_sparse_layer(n),
                      quantization.layer_schemes[n] if quantization is not None else None)
                     for n in range(self.num_layers))

    @property
    def qkv_bias(self) -> bool:
        """q/k/v projections with biases (Qwen2's); Qwen3 has none."""
        return self.model_type in ("qwen2", "qwen2_moe")

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm of q and k before the rotary embedding (Qwen3's)."""
        return self.model_type in ("qwen3", "qwen3_moe")

    @property
    def max_context_len(self) -> int:
        """The longest sequence the model takes: max_position_embeddings, or what its yarn
        scaling reaches (factor x original_max_position_embeddings) when that is more, as
        Qwen2.5's README has it: 32,768 positions scaled by 4 to 131,072."""
        reach = self.rope_scaling.max_positions if self.rope_scaling else 0
        return max(self.max_position_embeddings, reach)

    @property
    def kv_groups(self) -> int:
        """Query heads that share one KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter of the HF checkpoint, by its HF name, in HF layout (out, in).

        This is the one table of checkpoint names: the loader checks files against it, the
        strategy resolves a rule for each entry, the planner counts bytes from it.
        """
        h, i = self.hidden_size, self.intermediate_size
        shapes = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for n in range(self.num_layers):
            p = f"model.layers.{n}."
            shapes[p + "input_layernorm.weight"] = (h,)
            for proj, size in (("q_proj", self.q_size), ("k_proj", self.kv_size),
                               ("v_proj", self.kv_size)):
                shapes[p + f"self_attn.{proj}.weight"] = (size, h)
                if self.qkv_bias:
                    shapes[p + f"self_attn.{proj}.bias"] = (size,)
            if self.qk_norm:  # over head_dim, shared by every head
                shapes[p + "self_attn.q_norm.weight"] = (self.head_dim,)
                shapes[p + "self_attn.k_norm.weight"] = (self.head_dim,)
            shapes.update({
                p + "self_attn.o_proj.weight": (h, self.q_size),
                p + "post_attention_layernorm.weight": (h,),
            })
            if self.is_sparse_layer(n):
                shapes.update(self.moe.parameter_shapes(p + "mlp.", h))
            else:
                shapes.update(_mlp_shapes(p + "mlp.", h, i))
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    def num_parameters(self) -> int:
        total = 0
        for shape in self.parameter_shapes().values():
            count = 1
            for dim in shape:
                count *= dim
            total += count
        return total

    def num_active_parameters(self) -> int:
        """The parameters one token reads: all of a dense model's; of a MoE model's routed
        experts only its num_experts_per_tok per sparse layer."""
        if self.moe is None:
            return self.num_parameters()
        moe = self.moe
        idle = moe.num_experts - moe.num_experts_per_tok
        sparse = sum(self.is_sparse_layer(n) for n in range(self.num_layers))
        return self.num_parameters() - sparse * idle * 3 * self.hidden_size * moe.intermediate

    @classmethod
    def from_dict(cls, raw: dict, source: str = "<dict>") -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in _SUPPORTED_MODEL_TYPES:
            raise MsinferError(
                f"{source}: model_type {model_type!r} is not supported "
                f"(msinfer runs {_supported_architectures()})")
        architectures = raw.get("architectures")
        expected = _SUPPORTED_MODEL_TYPES[model_type]
        if architectures is not None and list(architectures) != [expected]:
            raise MsinferError(
                f"{source}: architectures {architectures!r} is not supported for model_type "
                f"{model_type!r} (msinfer runs {_supported_architectures()})")
        if model_type in ("qwen3", "qwen3_moe"):
            _check_qwen3(raw, source)
        if model_type == "qwen2_moe":
            _check_qwen2_moe(raw, source)
        missing = [k for k in _REQUIRED_KEYS if k not in raw]
        if missing:
            raise MsinferError(f"{source}: missing required key(s): {', '.join(missing)}")

        def integer(key, default=None):
            return positive_int(raw.get(key, default), f"{source}: {key}")

        heads = integer("num_attention_heads")
        kv_heads = integer("num_key_value_heads", heads)
        hidden = integer("hidden_size")
        if heads % kv_heads:
            raise MsinferError(
                f"{source}: num_attention_heads={heads} is not a multiple of "
                f"num_key_value_heads={kv_heads}")
        head_dim = raw.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise MsinferError(
                    f"{source}: hidden_size={hidden} is not divisible by "
                    f"num_attention_heads={heads}")
            head_dim = hidden // heads
        rope = raw.get("rope_parameters") or {}
        rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        max_positions = int(raw.get("max_position_embeddings", 32768))
        return cls(
            vocab_size=integer("vocab_size"),
            hidden_size=hidden,
            intermediate_size=integer("intermediate_size"),
            num_layers=integer("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"),
            source=source,
            model_type=model_type,
            rope_scaling=_rope_scaling(raw, max_positions, source),
            moe=MoeConfig.from_dict(raw, source) if model_type.endswith("_moe") else None,
        )

    @classmethod
    def from_model_dir(cls, model_dir: str, quantization: str = "auto") -> ModelConfig:
        """`quantization`: "auto" (msModelSlim's directories load quantized), "msmodelslim"
        (refuse any other) or "none" (refuse a quantized one): quantization.describe."""
        path = os.path.join(model_dir, "config.json")
        if not os.path.isdir(model_dir):
            raise MsinferError(f"model directory {model_dir} does not exist")
        if not os.path.isfile(path):
            raise MsinferError(f"{path}: not found (a Hugging Face model directory has one)")
        from .quantization import describe
        config = cls.from_dict(read_json_object(path), source=path)
        want = None if quantization in (None, "auto") else quantization
        return dataclasses.replace(config, quantization=describe(model_dir, config, want))


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """The routed experts of Qwen2-MoE and Qwen3-MoE (HF's configuration_qwen*_moe.py)."""

    num_experts: int
    num_experts_per_tok: int
    intermediate: int  # moe_intermediate_size: one expert's
    norm_topk_prob: bool = False  # renormalise the top-k weights to sum 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()
    shared_expert_intermediate: int = 0  # Qwen2-MoE's shared expert (0: none)

    def parameter_shapes(self, prefix, hidden):
        """A sparse layer's MLP tensors as the checkpoint names them: the router
        (`gate`), each expert's gate/up/down, and Qwen2-MoE's shared expert and its gate."""
        shapes = {prefix + "gate.weight": (self.num_experts, hidden)}
        for e in range(self.num_experts):
            shapes.update(_mlp_shapes(f"{prefix}experts.{e}.", hidden, self.intermediate))
        if self.shared_expert_intermediate:
            shapes.update(_mlp_shapes(prefix + "shared_expert.", hidden,
                                      self.shared_expert_intermediate))
            shapes[prefix + "shared_expert_gate.weight"] = (1, hidden)
        return shapes

    @classmethod
    def from_dict(cls, raw, source):
        """Both spellings of the expert count: `num_experts` (Qwen2-MoE, the released
        Qwen3-MoE configs) and `num_local_experts` (what transformers 5.x's Qwen3MoeConfig
        writes)."""
        count_key = "num_experts" if "num_experts" in raw else "num_local_experts"
        if count_key not in raw:
            raise MsinferError(f"{source}: missing num_experts (or num_local_experts)")
        for key in ("num_experts_per_tok", "moe_intermediate_size"):
            if key not in raw:
                raise MsinferError(f"{source}: missing required key {key}")
        experts = positive_int(raw[count_key], f"{source}: {count_key}")
        top_k = positive_int(raw["num_experts_per_tok"], f"{source}: num_experts_per_tok")
        if top_k > experts:
            raise MsinferError(f"{source}: num_experts_per_tok={top_k} exceeds "
                               f"{count_key}={experts}")
        only = raw.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(n, int) and not isinstance(n, bool)
                                                 for n in only):
            raise MsinferError(f"{source}: mlp_only_layers must be a list of layer numbers, "
                               f"got {only!r}")
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise MsinferError(f"{source}: hidden_act {hidden_act!r} is not supported "
                               f"(msinfer runs silu)")
        shared = raw.get("shared_expert_intermediate_size") or 0
        return cls(num_experts=experts, num_experts_per_tok=top_k,
                   intermediate=positive_int(raw["moe_intermediate_size"],
                                             f"{source}: moe_intermediate_size"),
                   norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                   decoder_sparse_step=positive_int(raw.get("decoder_sparse_step", 1),
                                                    f"{source}: decoder_sparse_step"),
                   mlp_only_layers=tuple(only),
                   shared_expert_intermediate=int(shared))


def _mlp_shapes(prefix, hidden, intermediate):
    return {prefix + "gate_proj.weight": (intermediate, hidden),
            prefix + "up_proj.weight": (intermediate, hidden),
            prefix + "down_proj.weight": (hidden, intermediate)}


def _check_qwen2_moe(raw, source):
    """What HF's Qwen2-MoE has that msinfer's does not run, refused by field."""
    if raw.get("qkv_bias") is False:
        raise MsinferError(f"{source}: qkv_bias false is not supported for qwen2_moe "
                           f"(msinfer runs Qwen2-MoE as released: qkv_bias true)")
    if raw.get("use_sliding_window"):
        raise MsinferError(f"{source}: use_sliding_window true is not supported (msinfer runs "
                           f"full attention in every layer: use_sliding_window false)")


def _supported_architectures():
    return ", ".join(f"{arch} (model_type {kind})"
                     for kind, arch in _SUPPORTED_MODEL_TYPES.items())


def _check_qwen3(raw, source):
    """What HF's Qwen3 has that msinfer's does not run, refused by field."""
    if raw.get("attention_bias"):
        raise MsinferError(f"{source}: attention_bias true is not supported for qwen3 "
                           f"(msinfer runs Qwen3 as released: attention_bias false)")
    if raw.get("use_sliding_window"):
        raise MsinferError(f"{source}: use_sliding_window true is not supported (msinfer runs "
                           f"full attention in every layer: use_sliding_window false)")
    layer_types = raw.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise MsinferError(f"{source}: layer_types other than full_attention are not supported "
                           f"(msinfer runs full attention in every layer)")


def _rope_scaling(raw, max_positions, source):
    """The rope scaling of a config.json: transformers 5.x's `rope_parameters` (rope_type and
    its parameters), else 4.x's `rope_scaling` (`type` or `rope_type`); None for the default
    rotary embedding, RopeScaling for yarn, refused otherwise. Defaults as transformers fills
    them in: original_max_position_embeddings is max_position_embeddings, and a missing factor
    is max_position_embeddings / original."""
    for field in ("rope_parameters", "rope_scaling"):
        params = raw.get(field)
        if params:
            break
    else:
        return None
    if not isinstance(params, dict):
        raise MsinferError(f"{source}: {field} must be a JSON object, got {params!r}")
    key = "rope_type" if "rope_type" in params else "type"
    rope_type = params.get(key) or "default"
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise MsinferError(f"{source}: {field}.{key} {rope_type!r} is not supported (msinfer "
                           f"runs rope types {', '.join(_SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        return None
    top_level = raw.get("original_max_position_embeddings")  # transformers gives it priority
    original = top_level or params.get("original_max_position_embeddings") or max_positions
    original = positive_int(original, f"{source}: {field}.original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        factor = max_positions / original

    def number(name):
        value = params.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise MsinferError(f"{source}: {field}.{name} must be a number, got {value!r}")
        return float(value)

    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 1:
        raise MsinferError(f"{source}: {field}.factor must be a number of at least 1, "
                           f"got {factor!r}")
    return RopeScaling(rope_type=rope_type, factor=float(factor),
                       original_max_position_embeddings=original,
                       attention_factor=number("attention_factor"),
                       beta_fast=number("beta_fast"), beta_slow=number("beta_slow"),
                       mscale=number("mscale"), mscale_all_dim=number("mscale_all_dim"),
                       truncate=bool(params.get("truncate", True)))


def user_cache_dir(kind: str, variable: str) -> str:
    """$variable, else $XDG_CACHE_HOME/msinfer/kind, else ~/.cache/msinfer/kind: where msinfer
    keeps what it builds once per host (compiled graphs, C++ kernels)."""
    if os.environ.get(variable):
        return os.environ[variable]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "msinfer", kind)


def read_json_object(path: str) -> dict:
    """The JSON object in `path`, or {} when the file is absent."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MsinferError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise MsinferError(f"{path}: expected a JSON object")
    return value


def eos_token_ids(model_dir: str) -> tuple[int, ...]:
    """The ids that end a generation: generation_config.json's eos_token_id, else
    config.json's (an int or a list); () when neither names one. The tokenizer adds a last
    fallback by token name, for checkpoints that name none."""
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name)
        value = read_json_object(path).get("eos_token_id")
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        for i in ids:
            if not isinstance(i, int) or isinstance(i, bool) or i < 0:
                raise MsinferError(f"{path}: eos_token_id must be a non-negative integer or a "
                                   f"list of them, got {value!r}")
        if ids:
            return tuple(ids)
    return ()


def _preset(vocab, hidden, inter, layers, heads, kv, tie, max_pos, head_dim=None,
            model_type="qwen2", eps=1e-6, rope_scaling=None):
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv,
                       head_dim=head_dim or hidden // heads, tie_word_embeddings=tie,
                       max_position_embeddings=max_pos, rms_norm_eps=eps,
                       model_type=model_type, rope_scaling=rope_scaling)


# Qwen2.5's README: beyond 32,768 tokens, static YaRN over the Instruct models' 32,768.
QWEN25_YARN = RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768)


def _qwen3(vocab, hidden, inter, layers, heads, kv, tie):
    # head_dim 128 in every Qwen3 dense config, whatever hidden / heads (0.6B: 64; 32B: 80).
    return _preset(vocab, hidden, inter, layers, heads, kv, tie, 40960, head_dim=128,
                   model_type="qwen3")


def _qwen25(hidden, inter, layers, heads, kv, eps, yarn=False):
    # The Instruct configs: 32,768 positions (their README adds yarn to reach 131,072).
    return _preset(152064, hidden, inter, layers, heads, kv, False, 32768, eps=eps,
                   rope_scaling=QWEN25_YARN if yarn else None)


# The published configs, for planning without the checkpoint at hand: Qwen2 (Hugging Face
# Qwen/Qwen2-*/config.json), Qwen2.5 Instruct (Qwen/Qwen2.5-*-Instruct: their native 32,768
# positions; the -yarn entries add the README's rope_scaling {type yarn, factor 4,
# original_max_position_embeddings 32768} and so reach 131,072), Qwen3 dense (Qwen/Qwen3-*:
# head_dim 128, 40,960 positions, no q/k/v bias, q/k norms). Values collected in
# ../shared/reference/research-anchors-2.md section 4.
PRESETS = {
    "qwen2-0.5b": _preset(151936, 896, 4864, 24, 14, 2, True, 131072),
    "qwen2-1.5b": _preset(151936, 1536, 8960, 28, 12, 2, True, 131072),
    "qwen2-7b": _preset(152064, 3584, 18944, 28, 28, 4, False, 131072),
    "qwen2-72b": _preset(152064, 8192, 29568, 80, 64, 8, False, 131072),
    "qwen2.5-7b": _qwen25(3584, 18944, 28, 28, 4, 1e-6),
    "qwen2.5-14b": _qwen25(5120, 13824, 48, 40, 8, 1e-5),
    "qwen2.5-32b": _qwen25(5120, 27648, 64, 40, 8, 1e-5),
    "qwen2.5-72b": _qwen25(8192, 29568, 80, 64, 8, 1e-6),
    "qwen2.5-7b-yarn": _qwen25(3584, 18944, 28, 28, 4, 1e-6, yarn=True),
    "qwen2.5-14b-yarn": _qwen25(5120, 13824, 48, 40, 8, 1e-5, yarn=True),
    "qwen2.5-32b-yarn": _qwen25(5120, 27648, 64, 40, 8, 1e-5, yarn=True),
    "qwen2.5-72b-yarn": _qwen25(8192, 29568, 80, 64, 8, 1e-6, yarn=True),
    "qwen3-0.6b": _qwen3(151936, 1024, 3072, 28, 16, 8, True),
    "qwen3-8b": _qwen3(151936, 4096, 12288, 36, 32, 8, False),
    "qwen3-14b": _qwen3(151936, 5120, 17408, 40, 40, 8, False),
    "qwen3-32b": _qwen3(151936, 5120, 25600, 64, 64, 8, False),
}


def _moe_preset(dense, **moe):
    return dataclasses.replace(dense, model_type=dense.model_type + "_moe", moe=MoeConfig(**moe))


# Qwen/Qwen3-30B-A3B (48 layers, every one sparse: 128 experts of 768, 8 routed per token,
# renormalised) and Qwen/Qwen2-57B-A14B (64 experts of 2,560, 8 routed, not renormalised, and a
# shared expert of 20,480 with its sigmoid gate), as their config.json files say
# (../shared/reference/research-anchors-3.md section 2; Qwen2-57B-A14B's as NVIDIA
# TensorRT-LLM's Qwen-MoE test copies it).
PRESETS["qwen3-30b-a3b"] = _moe_preset(
    _qwen3(151936, 2048, 6144, 48, 32, 4, False), num_experts=128, num_experts_per_tok=8,
    intermediate=768, norm_topk_prob=True)
PRESETS["qwen2-57b-a14b"] = _moe_preset(
    _preset(151936, 3584, 18944, 28, 28, 4, False, 131072), num_experts=64,
    num_experts_per_tok=8, intermediate=2560, shared_expert_intermediate=20480)


def _quantized(base, scheme):
    from .quantization import preset
    return dataclasses.replace(PRESETS[base],
                               quantization=preset(scheme, PRESETS[base].num_layers))


# What 300I Duo users deploy: msModelSlim's W8A8 (and a W8A16), for planning (quantization.py)
PRESETS.update({
    "qwen2.5-72b-w8a8": _quantized("qwen2.5-72b", "W8A8"),
    "qwen2.5-32b-w8a8": _quantized("qwen2.5-32b", "W8A8"),
    "qwen3-32b-w8a8": _quantized("qwen3-32b", "W8A8"),
    "qwen2.5-7b-w8a16": _quantized("qwen2.5-7b", "W8A16"),
})


def load_config(model: str, quantization: str = "auto") -> ModelConfig:
    """A model directory or a preset name; `quantization` as ModelConfig.from_model_dir."""
    if model in PRESETS:
        return dataclasses.replace(PRESETS[model], source=model)
    if not os.path.isdir(model):
        raise MsinferError(f"{model}: no such model directory, and not a built-in model "
                           f"({', '.join(PRESETS)})")
    return ModelConfig.from_model_dir(model, quantization)
