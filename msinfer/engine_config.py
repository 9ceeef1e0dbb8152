"""One engine's settings, validated once: `EngineConfig`, and `EngineLimits`, its part that
decides memory (what the planner, the memory formulas, the model runner and the scheduler take).

`engine_config(model, **settings)` is the one builder: LLM(...) keywords come straight to it,
and `EngineConfig.from_args` (generate, serve) passes it the CLI's arguments. The context
length has one name, `max_model_len` (vLLM's); the older spelling `max_len` (--max-len) is
accepted for it. `tensor_parallel_size` (vLLM's --tensor-parallel-size) stands for a shipped
tensor-parallel strategy, strategies/qwen2_tp{N}.yaml, when no strategy file is given.

Pure data: no MindSpore, no tokenizer, no weights read.
"""
from __future__ import annotations

import dataclasses
import difflib
import numbers
import re

from .config import ModelConfig
from .errors import MsinferError, positive_int
from .hardware import AUTO, HARDWARE_CHOICES
from .speculative_config import SpeculativeConfig

DEFAULT_MAX_MODEL_LEN = 4096  # the longest sequence when none is asked for
DEFAULT_MAX_NUM_SEQS = 16
DEFAULT_MAX_PREFILL_TOKENS = 256
DEFAULT_BLOCK_SIZE = 16
GRAPH_SHAPES = ("dynamic", "static")  # EngineLimits.graph_shapes, the default first
# Tensor degrees with a shipped strategy (strategies/qwen2_tp{N}.yaml; Strategy.default holds
# the same plan in memory): what --tensor-parallel-size accepts
SHIPPED_TENSOR_DEGREES = (1, 2, 4, 8)
ALIASES = {"max_len": "max_model_len"}  # older keyword -> its name


@dataclasses.dataclass(frozen=True)
class EngineLimits:
    """The engine's knobs that decide its memory: the longest sequence, the KV block size, the
    prefill chunk, the sequences decoded together, and the KV cache budget (None: what is
    left on the device)."""

    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    block_size: int = DEFAULT_BLOCK_SIZE
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    kv_cache_memory: int = None
    # Explicit mode's graphs (planning/shapes.py): "dynamic", a few of dynamic shape whatever
    # max_model_len, or "static", one per call shape: many more to compile, calls a little
    # faster on the CPU backend (docs/engine.md, "Compiled graphs")
    graph_shapes: str = GRAPH_SHAPES[0]

    def __post_init__(self):
        for field in ("max_model_len", "block_size", "max_prefill_tokens", "max_num_seqs"):
            positive_int(getattr(self, field), field)
        if self.block_size < 2:
            # the reserved block holds padded tokens' writes and, apart, the zeros padded
            # context positions read (engine/model_runner.py)
            raise MsinferError(f"block_size must be at least 2, got {self.block_size}")
        if self.kv_cache_memory is not None:
            positive_int(self.kv_cache_memory, "kv_cache_memory")
        if self.graph_shapes not in GRAPH_SHAPES:
            raise MsinferError(f"graph_shapes must be one of {', '.join(GRAPH_SHAPES)}, got "
                               f"{self.graph_shapes!r}")

    @classmethod
    def for_model(cls, config, max_model_len=None, block_size=None, max_prefill_tokens=None,
                  max_num_seqs=None, kv_cache_memory=None, graph_shapes=None, max_len=None):
        """Defaults filled in; max_model_len (or its older name max_len) at most the model's
        context (max_position_embeddings, or what its yarn rope scaling reaches:
        config.max_context_len); kv_cache_memory in bytes or as parse_bytes reads it
        ("2GiB")."""
        max_model_len = _one_of("max_model_len", max_model_len, "max_len", max_len)
        if max_model_len is None:
            max_model_len = default_max_model_len(config)
        positive_int(max_model_len, "max_model_len")
        _check_context(config, max_model_len)

        def given(value, default):
            return default if value is None else value

        if kv_cache_memory is not None:
            kv_cache_memory = parse_bytes(kv_cache_memory, "kv_cache_memory")
        max_prefill_tokens = given(max_prefill_tokens, DEFAULT_MAX_PREFILL_TOKENS)
        if isinstance(max_prefill_tokens, int):
            max_prefill_tokens = min(max_prefill_tokens, max_model_len)  # no chunk beyond it
        return cls(max_model_len=max_model_len,
                   block_size=given(block_size, DEFAULT_BLOCK_SIZE),
                   max_prefill_tokens=max_prefill_tokens,
                   max_num_seqs=given(max_num_seqs, DEFAULT_MAX_NUM_SEQS),
                   kv_cache_memory=kv_cache_memory,
                   graph_shapes=given(graph_shapes, GRAPH_SHAPES[0]))


def _one_of(name, value, old, old_value):
    """The value of a setting given by its name or its older name (not both, unless equal)."""
    if value is not None and old_value is not None and value != old_value:
        raise MsinferError(f"{name} {value} and its older name {old} {old_value} disagree; "
                           f"give one")
    return old_value if value is None else value


def _check_context(config, max_model_len):
    if max_model_len > config.max_context_len:
        scaled = config.rope_scaling
        reach = (f" (rope_scaling yarn x{scaled.factor:g} of "
                 f"{scaled.original_max_position_embeddings}: {config.max_context_len})"
                 if config.max_context_len > config.max_position_embeddings else "")
        raise MsinferError(f"max_model_len {max_model_len} exceeds the model's "
                           f"max_position_embeddings {config.max_position_embeddings}{reach}")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Where the engine runs: a strategy file (None: tensor_parallel_size's shipped plan, else
    one device), its parallel mode (None: the strategy's, else explicit), the hardware profile
    (auto: detected) and an HCCL rank table (Ascend rank-table mode)."""

    strategy: str | None = None
    tensor_parallel_size: int | None = None
    parallel_mode: str | None = None
    hardware: str = AUTO
    rank_table: str | None = None

    def __post_init__(self):
        tp = self.tensor_parallel_size
        if tp is not None:
            positive_int(tp, "tensor_parallel_size")
            if self.strategy is not None:
                raise MsinferError(f"give a strategy file or tensor_parallel_size "
                                   f"{tp}, not both (the file names its tensor degree)")
            if tp not in SHIPPED_TENSOR_DEGREES:
                raise MsinferError(
                    f"tensor_parallel_size {tp!r}: a shipped strategy exists for "
                    f"{', '.join(map(str, SHIPPED_TENSOR_DEGREES))} (strategies/qwen2_tp*.yaml); "
                    f"for another plan give a strategy file")
        if self.hardware not in HARDWARE_CHOICES:
            raise MsinferError(f"hardware {self.hardware!r}: one of "
                               f"{', '.join(HARDWARE_CHOICES)}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything one engine is built from: the checkpoint directory and its config.json
    (model_config), the compute dtype override, the limits (scheduler and KV cache sizes,
    compiled graph shapes), prefix caching, where it runs (parallel), and the compile cache
    (a directory; None: $MSINFER_COMPILE_CACHE, else ~/.cache/msinfer/compile; False: none)."""

    model: str
    model_config: ModelConfig
    limits: EngineLimits
    parallel: ParallelConfig = ParallelConfig()
    dtype: str | None = None
    enable_prefix_caching: bool = True
    compile_cache: str | bool | None = None
    # "auto": an msModelSlim directory loads quantized (msinfer/quantization.py); "msmodelslim":
    # refuse a directory that is not one; "none": refuse a quantized one
    quantization: str = "auto"
    # speculative decoding (speculative_config.py); None: none
    speculative: SpeculativeConfig | None = None

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @classmethod
    def from_args(cls, args) -> EngineConfig:
        """From generate's or serve's parsed arguments (cli/args.add_llm_arguments)."""
        compile_cache = getattr(args, "compile_cache", None)
        if getattr(args, "no_compile_cache", False):
            compile_cache = False
        return engine_config(
            args.model, strategy=args.strategy,
            tensor_parallel_size=args.tensor_parallel_size, hardware=args.hardware,
            parallel_mode=args.parallel_mode, rank_table=args.rank_table, dtype=args.dtype,
            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            max_prefill_tokens=args.max_prefill_tokens, block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory, graph_shapes=args.graph_shapes,
            enable_prefix_caching=args.prefix_caching, compile_cache=compile_cache,
            quantization=getattr(args, "quantization", None),
            speculative_config=getattr(args, "speculative_config", None))


_LIMITS = ("max_model_len", "block_size", "max_prefill_tokens", "max_num_seqs",
           "kv_cache_memory", "graph_shapes")
_PARALLEL = tuple(f.name for f in dataclasses.fields(ParallelConfig))
_OTHERS = ("dtype", "enable_prefix_caching", "compile_cache", "quantization",
           "speculative_config")
SETTINGS = _LIMITS + _PARALLEL + _OTHERS  # engine_config's keywords (and ALIASES')


def engine_config(model: str, **settings) -> EngineConfig:
    """The one builder of an EngineConfig: `model` a Hugging Face checkpoint directory;
    `settings` any of SETTINGS (None: the default) or an older name of ALIASES. An unknown
    keyword, a bad value or two names of one setting that disagree raise MsinferError."""
    for old, new in ALIASES.items():
        if old in settings:
            settings[new] = _one_of(new, settings.get(new), old, settings.pop(old))
    for name in settings:
        if name not in SETTINGS:
            close = difflib.get_close_matches(name, SETTINGS + tuple(ALIASES), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise MsinferError(f"unknown engine setting {name!r}{hint}")
    quantization = settings.get("quantization") or "auto"
    model_config = ModelConfig.from_model_dir(model, quantization)
    limits = EngineLimits.for_model(model_config, **{k: settings.get(k) for k in _LIMITS})
    parallel = ParallelConfig(**{k: settings[k] for k in _PARALLEL
                                 if settings.get(k) is not None})
    prefix = settings.get("enable_prefix_caching")
    return EngineConfig(model=model, model_config=model_config, limits=limits,
                        parallel=parallel, dtype=settings.get("dtype"),
                        enable_prefix_caching=True if prefix is None else bool(prefix),
                        compile_cache=settings.get("compile_cache"), quantization=quantization,
                        speculative=SpeculativeConfig.parse(settings.get("speculative_config")))


def default_max_model_len(config) -> int:
    """The longest sequence when none is asked for: DEFAULT_MAX_MODEL_LEN, or fewer when the
    model's max_position_embeddings is smaller."""
    return min(config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)


def parse_bytes(text, what="--kv-cache-memory"):
    """A byte count from an int or a string: '2147483648', '512MiB', '2GiB', '1.5GB', '64KiB'
    (binary units KiB/MiB/GiB/TiB, decimal kB/MB/GB/TB, B; case-insensitive) -> int bytes.
    The one parser of --kv-cache-memory (the CLI's argparse type) and of
    LLM(kv_cache_memory=...); `what` names the value in the error."""
    if isinstance(text, bool):
        raise MsinferError(f"{what} {text!r}: expected bytes like 2147483648, 512MiB or 2GiB")
    if isinstance(text, numbers.Integral):
        value, factor, whole = int(text), 1, True
    else:
        match = _BYTES.match(str(text))
        if match is None:
            raise MsinferError(f"{what} {text!r}: expected bytes like 2147483648, 512MiB or "
                               f"2GiB")
        number, unit = match.group(1), (match.group(2) or "b").lower()
        factor, whole = _BYTE_UNITS[unit], "." not in number and "e" not in number.lower()
        value = int(number) if whole else float(number)
    result = value * factor if whole else int(value * factor)
    if result < 1:
        raise MsinferError(f"{what} {text!r}: must be at least one byte")
    return result


_BYTE_UNITS = {"b": 1, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40,
               "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12}
_BYTES = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?|\.[0-9]+)\s*"
                    r"(b|kib|mib|gib|tib|kb|mb|gb|tb)?\s*$", re.IGNORECASE)
