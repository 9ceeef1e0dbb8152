"""Qwen2 model configuration, read from a Hugging Face config.json.

Accepts both spellings in the wild: transformers 4.x (`rope_theta`, `torch_dtype`) and
5.x (`rope_parameters.rope_theta`, `dtype`). Every derived size is computed here, once, and
the ids that end a generation are read here, once (`eos_token_ids`).
"""
from __future__ import annotations

import dataclasses
import json
import os

from .errors import MsinferError, positive_int

_SUPPORTED_MODEL_TYPES = ("qwen2",)
_REQUIRED_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads",
)


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
            shapes.update({
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (self.q_size, h),
                p + "self_attn.q_proj.bias": (self.q_size,),
                p + "self_attn.k_proj.weight": (self.kv_size, h),
                p + "self_attn.k_proj.bias": (self.kv_size,),
                p + "self_attn.v_proj.weight": (self.kv_size, h),
                p + "self_attn.v_proj.bias": (self.kv_size,),
                p + "self_attn.o_proj.weight": (h, self.q_size),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            })
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

    @classmethod
    def from_dict(cls, raw: dict, source: str = "<dict>") -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in _SUPPORTED_MODEL_TYPES:
            raise MsinferError(
                f"{source}: model_type {model_type!r} is not supported "
                f"(msinfer runs {', '.join(_SUPPORTED_MODEL_TYPES)})")
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
        rope_type = rope.get("rope_type", (raw.get("rope_scaling") or {}).get("type", "default"))
        if rope_type not in ("default", None):
            raise MsinferError(f"{source}: rope scaling {rope_type!r} is not supported")
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
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"),
            source=source,
        )

    @classmethod
    def from_model_dir(cls, model_dir: str) -> ModelConfig:
        path = os.path.join(model_dir, "config.json")
        if not os.path.isdir(model_dir):
            raise MsinferError(f"model directory {model_dir} does not exist")
        if not os.path.isfile(path):
            raise MsinferError(f"{path}: not found (a Hugging Face model directory has one)")
        return cls.from_dict(read_json_object(path), source=path)


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


def _preset(vocab, hidden, inter, layers, heads, kv, tie, max_pos):
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv,
                       head_dim=hidden // heads, tie_word_embeddings=tie,
                       max_position_embeddings=max_pos)


# The published Qwen2 configs (Hugging Face Qwen/Qwen2-*/config.json), for planning
# without the checkpoint at hand.
PRESETS = {
    "qwen2-0.5b": _preset(151936, 896, 4864, 24, 14, 2, True, 131072),
    "qwen2-1.5b": _preset(151936, 1536, 8960, 28, 12, 2, True, 131072),
    "qwen2-7b": _preset(152064, 3584, 18944, 28, 28, 4, False, 131072),
    "qwen2-72b": _preset(152064, 8192, 29568, 80, 64, 8, False, 131072),
}


def load_config(model: str) -> ModelConfig:
    """A model directory or a preset name."""
    if model in PRESETS:
        return dataclasses.replace(PRESETS[model], source=model)
    if not os.path.isdir(model):
        raise MsinferError(f"{model}: no such model directory, and not a built-in model "
                           f"({', '.join(PRESETS)})")
    return ModelConfig.from_model_dir(model)
