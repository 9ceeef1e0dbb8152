"""Qwen2 model configuration, read from a Hugging Face config.json.

Accepts both spellings in the wild: transformers 4.x (`rope_theta`, `torch_dtype`) and
5.x (`rope_parameters.rope_theta`, `dtype`). Every derived size is computed here, once.
"""
import dataclasses
import json
import os

from .errors import MsinferError

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
    bos_token_id: int = None
    eos_token_ids: tuple = ()
    source: str = "<memory>"

    @property
    def kv_groups(self):
        """Query heads that share one KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self):
        return self.num_heads * self.head_dim

    @property
    def kv_size(self):
        return self.num_kv_heads * self.head_dim

    def parameter_shapes(self):
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

    def num_parameters(self):
        total = 0
        for shape in self.parameter_shapes().values():
            count = 1
            for dim in shape:
                count *= dim
            total += count
        return total

    @classmethod
    def from_dict(cls, raw, source="<dict>"):
        model_type = raw.get("model_type")
        if model_type not in _SUPPORTED_MODEL_TYPES:
            raise MsinferError(
                f"{source}: model_type {model_type!r} is not supported "
                f"(msinfer runs {', '.join(_SUPPORTED_MODEL_TYPES)})")
        missing = [k for k in _REQUIRED_KEYS if k not in raw]
        if missing:
            raise MsinferError(f"{source}: missing required key(s): {', '.join(missing)}")

        def integer(key, default=None):
            value = raw.get(key, default)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise MsinferError(f"{source}: {key} must be a positive integer, got {value!r}")
            return value

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
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
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
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            source=source,
        )

    @classmethod
    def from_model_dir(cls, model_dir):
        path = os.path.join(model_dir, "config.json")
        if not os.path.isdir(model_dir):
            raise MsinferError(f"model directory {model_dir} does not exist")
        if not os.path.isfile(path):
            raise MsinferError(f"{path}: not found (a Hugging Face model directory has one)")
        try:
            with open(path) as f:
                raw = json.load(f)
        except json.JSONDecodeError as e:
            raise MsinferError(f"{path}: not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise MsinferError(f"{path}: expected a JSON object")
        return cls.from_dict(raw, source=path)


def _preset(vocab, hidden, inter, layers, heads, kv, tie, max_pos):
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_layers=layers, num_heads=heads, num_kv_heads=kv,
                       head_dim=hidden // heads, tie_word_embeddings=tie,
                       max_position_embeddings=max_pos, eos_token_ids=(151643,))


# The published Qwen2 configs (Hugging Face Qwen/Qwen2-*/config.json), for planning
# without the checkpoint at hand.
PRESETS = {
    "qwen2-0.5b": _preset(151936, 896, 4864, 24, 14, 2, True, 131072),
    "qwen2-1.5b": _preset(151936, 1536, 8960, 28, 12, 2, True, 131072),
    "qwen2-7b": _preset(152064, 3584, 18944, 28, 28, 4, False, 131072),
    "qwen2-72b": _preset(152064, 8192, 29568, 80, 64, 8, False, 131072),
}


def load_config(model):
    """A model directory or a preset name."""
    if model in PRESETS:
        return dataclasses.replace(PRESETS[model], source=model)
    if not os.path.isdir(model):
        raise MsinferError(f"{model}: no such model directory, and not a built-in model "
                           f"({', '.join(PRESETS)})")
    return ModelConfig.from_model_dir(model)
