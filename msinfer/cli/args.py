"""Options several subcommands share: the engine's limits (plan, generate, serve; launch
reads them from the rank command)."""
from ..config import PRESETS
from ..engine_config import (DEFAULT_BLOCK_SIZE, DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_NUM_SEQS,
                             DEFAULT_MAX_PREFILL_TOKENS, GRAPH_SHAPES, SHIPPED_TENSOR_DEGREES,
                             EngineLimits, ParallelConfig, parse_bytes)
from ..errors import MsinferError
from ..hardware import AUTO, HARDWARE_CHOICES
from ..planning.memory import KV_CACHE_UTILIZATION
from ..speculative_config import SpeculativeConfig


def add_model_and_strategy(parser, tensor_parallel=False):
    """--model (a checkpoint directory or a preset) and --strategy, both required: the
    commands that check a plan without loading weights (plan, layouts). `tensor_parallel`:
    --tensor-parallel-size N may stand for --strategy (job_strategy)."""
    parser.add_argument("--model", required=True,
                        help="model directory (with config.json) or a preset: "
                             + ", ".join(sorted(PRESETS)))
    parser.add_argument("--strategy", required=not tensor_parallel,
                        help="strategy file, e.g. strategies/qwen2_tp4.yaml")
    if tensor_parallel:
        add_tensor_parallel_size(parser)


def add_tensor_parallel_size(parser):
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, metavar="N",
                        help="as vLLM's: the shipped strategy strategies/qwen2_tpN.yaml (N in "
                             + ", ".join(map(str, SHIPPED_TENSOR_DEGREES))
                             + "), instead of --strategy")


def job_strategy(strategy, tensor_parallel_size):
    """The Strategy of a strategy file, else of --tensor-parallel-size's shipped plan; both,
    neither, or a size not shipped: MsinferError (engine_config.ParallelConfig's rule)."""
    from ..parallel.strategy import strategy_of

    parallel = ParallelConfig(strategy=strategy, tensor_parallel_size=tensor_parallel_size)
    if not parallel.strategy and not parallel.tensor_parallel_size:
        raise MsinferError("give --strategy FILE or --tensor-parallel-size N")
    return strategy_of(parallel.strategy, parallel.tensor_parallel_size)


def add_hardware_argument(parser, required=False):
    """--hardware: a profile, or auto (the default where there is one): the profile of the
    Ascend chips `npu-smi info` lists, else cpu (hardware.detect_hardware). What auto chose is
    printed with the plan (plan, launch) and logged when the model loads."""
    parser.add_argument("--hardware", required=required, default=None if required else AUTO,
                        choices=HARDWARE_CHOICES, metavar="NAME",
                        help="hardware profile: " + ", ".join(HARDWARE_CHOICES) + "; auto: "
                             "the Ascend chips npu-smi lists, else cpu"
                             + ("" if required else " (default: auto)"))


def add_llm_arguments(parser, parallel_modes):
    """What LLM is built from (EngineConfig.from_args), the same for generate and serve:
    --model, where it runs (--strategy or --tensor-parallel-size, --hardware,
    --parallel-mode, --rank-table), --dtype and the engine knobs."""
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--strategy", default=None, help="strategy YAML (default: one device)")
    add_tensor_parallel_size(parser)
    add_hardware_argument(parser)
    parser.add_argument("--parallel-mode", choices=parallel_modes, default=None,
                        help="default: the strategy's parallel_mode, else explicit")
    add_engine_arguments(parser)
    parser.add_argument("--dtype", default=None, help="compute dtype override")
    parser.add_argument("--rank-table", default=None,
                        help="HCCL rank table (Ascend rank-table mode)")


def add_engine_arguments(parser):
    """The engine knobs, the same for plan, generate, serve (and launch reads them)."""
    parser.add_argument("--max-model-len", "--max-len", dest="max_model_len", type=int,
                        default=None, metavar="N",
                        help=f"longest sequence, prompt plus generated tokens, as vLLM's "
                             f"(--max-len: its older name) (default: "
                             f"min(max_position_embeddings, {DEFAULT_MAX_MODEL_LEN}))")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help=f"sequences decoded together (default {DEFAULT_MAX_NUM_SEQS})")
    parser.add_argument("--max-prefill-tokens", type=int, default=None,
                        help=f"tokens per prefill chunk (default {DEFAULT_MAX_PREFILL_TOKENS})")
    parser.add_argument("--block-size", type=int, default=None,
                        help=f"tokens per KV cache block (default {DEFAULT_BLOCK_SIZE})")
    parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                        help="compute every prompt in full instead of reusing the KV blocks of "
                             "a prefix computed before (docs/engine.md, 'Prefix caching')")
    parser.add_argument("--graph-shapes", choices=GRAPH_SHAPES, default=None,
                        help="explicit mode's compiled graphs: dynamic, a few of dynamic "
                             "shape (12 for the 0.5B shape at any max-model-len), or static, one "
                             "per call shape (81 at the default max-model-len, 111 at 32768: a "
                             "cold start about 5x longer, for about the same speed; "
                             "docs/engine.md, 'Compiled graphs') (default: dynamic)")
    parser.add_argument("--quantization", choices=("auto", "msmodelslim", "none"),
                        default="auto",
                        help="auto: an msModelSlim directory (quant_model_description.json) "
                             "loads quantized, any other as float; msmodelslim: refuse a "
                             "directory that is not one; none: refuse a quantized one "
                             "(docs/quantization.md) (default: auto)")
    # Parsed here, once, for every command (launch parses the rank command with this parser
    # too): the value the engine and the planner get is an int of bytes.
    parser.add_argument("--kv-cache-memory", type=kv_cache_bytes, default=None, metavar="BYTES",
                        help="KV cache per rank: bytes (2147483648) or with a unit (512MiB, "
                             "2GiB, 1.5GB) (default: "
                             f"{KV_CACHE_UTILIZATION:.0%}% of what weights and workspace leave)")
    parser.add_argument("--speculative-config", type=speculative_config, default=None,
                        metavar="JSON",
                        help="speculative decoding, as vLLM's: a JSON object, e.g. "
                             "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                             "\"prompt_lookup_max\": 4}'; methods ngram, suffix, draft_model "
                             "(with \"model\": DIR) (docs/speculative.md) (default: none)")


def kv_cache_bytes(text):
    """argparse type of --kv-cache-memory: bytes as an int. A bad value raises MsinferError,
    which cli.main reports as a one-line error (exit 2)."""
    return parse_bytes(text, "--kv-cache-memory")


def speculative_config(text):
    """argparse type of --speculative-config: a SpeculativeConfig. A bad value raises
    MsinferError naming the key, which cli.main reports as a one-line error (exit 2)."""
    try:
        return SpeculativeConfig.parse(text)
    except MsinferError as e:
        raise MsinferError(str(e).replace("speculative_config:", "--speculative-config:", 1)
                           ) from None


def limits_from_args(config, args):
    return EngineLimits.for_model(config, max_model_len=args.max_model_len,
                                  block_size=args.block_size,
                                  max_prefill_tokens=args.max_prefill_tokens,
                                  max_num_seqs=args.max_num_seqs,
                                  kv_cache_memory=args.kv_cache_memory,
                                  graph_shapes=args.graph_shapes)
