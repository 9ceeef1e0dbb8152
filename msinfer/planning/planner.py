"""The planner: before launch, is this (model, strategy, hardware) legal, and does it fit?

Per device it counts what the engine allocates, from the same functions the engine sizes
itself with (memory.py's `engine_memory`): the weight bytes exactly (from the config and the
shard plan), the paged KV cache pool (blocks, tokens, how many max-len sequences it holds),
and a stated workspace estimate bounded by one layer of one prefill chunk, against the
profile's usable memory. It lists the collectives each decoded token costs, the dtype and why,
and the decode speed that memory bandwidth allows. It refuses what would fail on the hardware,
saying how to fix it.

Three things are easy to confuse: a `Strategy` (the YAML: degrees and rules), the `ShardPlan`
it resolves to for one model (what each rank holds: parallel/strategy.py; `shard_plan` here),
and the `PlanReport` made here (`report`: is that ShardPlan legal on this hardware, in this
parallel mode, and does it fit).
"""
from __future__ import annotations

import dataclasses
import textwrap

from ..config import ModelConfig
from ..engine_config import EngineLimits
from ..errors import PlanRefused
from ..hardware import (DTYPE_BYTES, GiB, HardwareProfile, compute_dtype, cpu_matmul_forms,
                        dtype_name)
from ..parallel.strategy import ShardPlan, Strategy, decide_parallel_mode
from ..quantization import ASCEND_SCHEMES
from .memory import draft_config, engine_memory, verify_rows
from .shapes import ExplicitGraphs, ShapeBuckets
from .workspace import stack_layers

_TIGHT_MARGIN = 0.10  # below this share of capacity to spare, say that the workspace is a guess


@dataclasses.dataclass
class DeviceMemory:
    rank: int
    tensor_rank: int
    data_rank: int
    weights_bytes: int
    kv_cache_bytes: int
    workspace_bytes: int
    total_bytes: int
    capacity_bytes: int

    @property
    def margin_bytes(self) -> int:
        return self.capacity_bytes - self.total_bytes


@dataclasses.dataclass
class Collective:
    kind: str
    count: int
    payload_bytes: int  # size of the tensor the collective produces on each rank
    where: str


@dataclasses.dataclass
class PlanReport:
    """The planner's verdict on one (model, strategy, hardware, mode, batch, max-model-len)."""

    model: str
    strategy: str
    hardware: str
    hardware_title: str
    world_size: int
    tensor: int
    data: int
    pipeline: int
    max_num_seqs: int  # per data replica: sequences decoded together
    max_model_len: int
    max_prefill_tokens: int
    block_size: int
    memory_bandwidth_bytes_per_s: float
    parallel_mode: str = "explicit"
    dtype: str | None = None
    dtype_reason: str | None = None
    devices: list[DeviceMemory] = dataclasses.field(default_factory=list)
    kv_blocks: int | None = None  # usable blocks per rank (one more is reserved)
    kv_tokens: int | None = None
    kv_bytes_per_token: int | None = None
    # vLLM's "maximum concurrency for max_model_len tokens per request": how many sequences of
    # max_model_len tokens one replica's KV cache holds at once
    max_concurrency: int | None = None
    collectives_per_token: list[Collective] = dataclasses.field(default_factory=list)
    workspace_formula: str | None = None
    decode_bytes_per_step: int | None = None  # read by the busiest device, full contexts
    decode_tokens_per_s_bound: float | None = None  # with full max-len contexts
    decode_tokens_per_s_bound_short_context: float | None = None  # weights only
    warmup_graphs: int | None = None  # graphs warm-up compiles per rank (planning/shapes.py)
    graph_shapes: str = "static"  # EngineLimits.graph_shapes
    quantization: str | None = None  # msModelSlim's schemes, said in words; None: float
    speculative: dict | None = None  # the SpeculativeConfig's settings; None: no speculation
    errors: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict:
        # "concurrent_max_len_sequences": max_concurrency's name before, kept in --json for
        # the scripts that read it
        return {"fits": self.fits, **dataclasses.asdict(self),
                "concurrent_max_len_sequences": self.max_concurrency}


def make_plan(config: ModelConfig, strategy: Strategy, profile: HardwareProfile,
              limits: EngineLimits | None = None, dtype: str | None = None,
              parallel_mode: str | None = None, speculative=None) -> PlanReport:
    """Check and size a plan of the engine's `limits` (defaults for this model when None).
    parallel_mode None: decide_parallel_mode's choice; speculative: the engine's
    SpeculativeConfig, None without speculation. Problems the hardware or the mode cannot run
    end up in `errors`; bad values raise MsinferError."""
    limits = limits or EngineLimits.for_model(config)
    mode = decide_parallel_mode(parallel_mode, strategy)
    report = PlanReport(model=config.source, strategy=strategy.source, hardware=profile.name,
                      hardware_title=profile.title, world_size=strategy.world_size,
                      tensor=strategy.tensor, data=strategy.data, pipeline=strategy.pipeline,
                      max_num_seqs=limits.max_num_seqs, max_model_len=limits.max_model_len,
                      max_prefill_tokens=limits.max_prefill_tokens,
                      block_size=limits.block_size,
                      memory_bandwidth_bytes_per_s=profile.memory_bandwidth_bytes_per_s,
                      parallel_mode=mode,
                      speculative=speculative and dataclasses.asdict(speculative))
    refusal = _hardware_refusal(strategy, profile, mode)
    if config.quantization is not None:
        report.quantization = quantization_words(config.quantization)
        if mode == "semi_auto" and not refusal:
            refusal = _quantized_semi_auto_refusal(config, profile)
    if speculative is not None and mode != "explicit" and not refusal:
        refusal = (f"speculative decoding runs in parallel_mode explicit only; this plan is "
                   f"{mode} (give --parallel-mode explicit)")
    if speculative is not None and limits.graph_shapes != "dynamic" and not refusal:
        # a verification's lm_head rows (k + 1 per sequence) take the head graph of dynamic
        # rows; static graphs would compile a head per row count while serving
        refusal = (f"speculative decoding needs graph_shapes dynamic (the default), not "
                   f"{limits.graph_shapes}: its verifications run in the prefill graphs and "
                   f"the lm_head graph of dynamic rows")
    if refusal:
        report.errors.append(refusal)
        return report
    try:
        report.dtype, report.dtype_reason = compute_dtype(profile, config.torch_dtype, dtype)
        shard_plan = strategy.resolve(config, mode)
    except PlanRefused as e:
        report.errors.append(str(e))
        return report

    dtype_bytes = DTYPE_BYTES[report.dtype]
    report.warmup_graphs = warmup_graphs(shard_plan, profile, limits, dtype_bytes, mode,
                                         speculative is not None)
    report.graph_shapes = limits.graph_shapes
    speculation = (speculative, draft_config(speculative))  # the draft's config read once
    report.devices, layout = _device_memory(shard_plan, profile, report.dtype, limits,
                                            speculation)
    report.workspace_formula = _workspace_formula(profile, limits)
    report.collectives_per_token = _collectives(shard_plan, dtype_bytes, limits.max_num_seqs)
    if layout is not None:
        report.kv_blocks = layout.num_blocks - 1
        report.kv_tokens = layout.usable_tokens
        report.kv_bytes_per_token = layout.total_bytes // layout.num_slots
        report.max_concurrency = layout.usable_tokens // limits.max_model_len
        _decode_bound(report, shard_plan, dtype_bytes)
    _explain(report, shard_plan, profile)
    worst = max(report.devices, key=lambda d: d.total_bytes - d.capacity_bytes)
    if worst.margin_bytes < 0 or layout is None or report.max_concurrency < 1:
        report.errors.append(_does_not_fit(worst, layout, shard_plan, profile, report.dtype,
                                           limits, speculation))
    elif worst.margin_bytes < _TIGHT_MARGIN * worst.capacity_bytes and limits.kv_cache_memory:
        report.warnings.append(
            f"rank {worst.rank} has only {_gib(worst.margin_bytes)} "
            f"({worst.margin_bytes / worst.capacity_bytes:.0%}) to spare, and the workspace "
            f"is an estimate")
    return report


def check_plan_or_raise(config: ModelConfig, strategy: Strategy, profile: HardwareProfile,
                        limits: EngineLimits | None = None, dtype: str | None = None,
                        parallel_mode: str | None = None, speculative=None) -> PlanReport:
    """The gate of `msinfer launch` and `LLM(...)`: the report when the plan fits, else
    PlanRefused with the first error."""
    report = make_plan(config, strategy, profile, limits, dtype, parallel_mode, speculative)
    if report.errors:
        raise PlanRefused(report.errors[0])
    return report


def _speculation_words(settings) -> str:
    k = settings["num_speculative_tokens"]
    lengths = sorted({settings["prompt_lookup_min"], settings["prompt_lookup_max"]})
    source = {"ngram": f"n-grams of {'..'.join(map(str, lengths))} tokens looked up in the "
                       f"prompt and output",
              "suffix": "suffix decoding over this and recent requests",
              "draft_model": f"the draft model {settings['model']}"}[settings["method"]]
    return (f"{settings['method']}: up to {k} tokens proposed per sequence and step ({source}),"
            f" verified in one forward of {k + 1} positions per sequence (docs/speculative.md)")


def quantization_words(quantization) -> str:
    """msModelSlim's schemes of a config, e.g. "W8A8 (msModelSlim: q/k/v W8A8; o W8A8;
    gate/up W8A8; down W8A8, FLOAT in layers 1, 3): int8 weights with their scales; ...":
    each projection's scheme in most layers, and the layers where it differs."""
    names = {"self_attn.qkv_proj": "q/k/v", "self_attn.o_proj": "o", "mlp.gate_up_proj":
             "gate/up", "mlp.down_proj": "down"}
    parts, quantized = [], set()
    for module, layers_of in quantization.by_module().items():
        ordered = sorted(layers_of.items(), key=lambda item: -len(item[1]))
        quantized.update(s for s in layers_of if s != "FLOAT")
        others = "".join(f", {scheme} in layer{'s' if len(layers) > 1 else ''} "
                         f"{', '.join(map(str, layers))}" for scheme, layers in ordered[1:])
        parts.append(f"{names[module]} {ordered[0][0]}{others}")
    kinds = " + ".join(sorted(quantized)) or "FLOAT"
    return (f"{kinds} (msModelSlim: {'; '.join(parts)}): int8 weights with their scales; "
            f"embeddings, norms and lm_head float")


def _quantized_semi_auto_refusal(config, profile):
    """Why a quantized checkpoint cannot run under semi_auto on `profile`, or None. MindSpore
    shards only its Ascend quantized primitives (QuantV2, QuantBatchMatmul,
    WeightQuantBatchMatmul), which have no CPU or GPU kernel; `msinfer layouts` checks their
    layout on CPU (docs/quantization.md)."""
    schemes = {s for layer in config.quantization.layer_schemes for s in layer} - {"FLOAT"}
    without = sorted(schemes - set(ASCEND_SCHEMES))
    if without:
        return (f"{config.source}: {', '.join(without)} runs in parallel_mode explicit only "
                f"(the default): msinfer has no Ascend kernel for it, and under semi_auto "
                f"MindSpore shards only its Ascend quantized matmuls (W8A8, W8A8S, W8A16)")
    if profile.device_target != "Ascend":
        return (f"{config.source}: a quantized checkpoint "
                f"({config.quantization.model_quant_type}) under semi_auto runs "
                f"MindSpore's Ascend quantized primitives (QuantV2, QuantBatchMatmul, "
                f"WeightQuantBatchMatmul), which have no {profile.device_target} kernel: run "
                f"it in parallel_mode explicit (the default) here; `msinfer layouts` checks "
                f"its semi_auto layout on CPU")
    return None


def _hardware_refusal(strategy, profile, mode):
    if mode == "semi_auto" and profile.device_target == "CPU" and strategy.world_size > 1:
        return (
            f"{strategy.source}: parallel mode semi_auto needs Ascend or GPU: MindSpore refuses "
            f"semi_auto_parallel on CPU ('Invalid communication backend: CPU'). The explicit "
            f"mode (the default) runs the same strategy with explicit collectives on CPU, "
            f"Ascend and GPU")
    if strategy.pipeline > 1 and not profile.p2p_copy:
        return (
            f"{strategy.source}: pipeline: {strategy.pipeline} splits the layers over "
            f"devices, and passing activations from one device to the next is a "
            f"device-to-device copy, which {profile.title} does not have: it fails with "
            f"\"sdma error\". Tensor parallelism through collectives (HCCL AllReduce and "
            f"AllGather over PCIe) is the way on this card: set tensor: "
            f"{strategy.tensor * strategy.pipeline} and pipeline: 1")
    if strategy.world_size > profile.devices_per_server and not profile.multi_server:
        return (
            f"{strategy.source}: world_size: {strategy.world_size} needs more than one server "
            f"({profile.devices_per_server} devices each), and {profile.title} runs "
            f"collectives within one server only; plan for at most "
            f"{profile.devices_per_server} devices")
    return None


def _device_memory(shard_plan, profile, dtype, limits, speculation=(None, None)):
    """Per rank what `engine_memory` allocates (with `speculation`, (the SpeculativeConfig,
    its draft's ModelConfig): a draft model's weights and KV cache counted with the
    target's); and the target's KV layout (the same on every rank)."""
    devices, layout = [], None
    speculative, draft = speculation
    rows = verify_rows(speculative, limits)
    for rank in range(shard_plan.world_size):
        tensor_rank = shard_plan.tensor_rank(rank)
        memory = engine_memory(shard_plan, profile, dtype, limits, tensor_rank, strict=False,
                               draft=draft, verify_rows=rows)
        layout = memory.layout
        weights = memory.weights_bytes + memory.draft_weights_bytes
        kv_cache = memory.kv_cache_bytes + memory.draft_kv_bytes
        devices.append(DeviceMemory(
            rank=rank, tensor_rank=tensor_rank, data_rank=shard_plan.data_rank(rank),
            weights_bytes=weights, kv_cache_bytes=kv_cache,
            workspace_bytes=memory.workspace_bytes,
            total_bytes=weights + kv_cache + memory.workspace_bytes,
            capacity_bytes=memory.capacity_bytes))
    return devices, layout


def warmup_graphs(shard_plan, profile, limits, dtype_bytes, mode, speculative=False) -> int:
    """Graphs one rank's warm-up compiles (planning/shapes.py): semi_auto one per call shape;
    explicit one per `Graph` (ExplicitGraphs), as the model runner builds them (with
    `speculative`, the target's: a draft model's are its own)."""
    buckets = ShapeBuckets.for_engine(limits, step=shard_plan.data if mode == "semi_auto" else 1,
                                      speculative=speculative)
    if mode == "semi_auto":
        return len(buckets.calls())
    layers_for = stack_layers(shard_plan, dtype_bytes, limits, profile.min_layers_per_graph,
                              profile.layer_peak_growth)
    forms = cpu_matmul_forms() if profile.device_target == "CPU" else None
    graphs = ExplicitGraphs(buckets, layers_for, forms, dynamic=limits.graph_shapes == "dynamic")
    # A layer stack compiles once per run of layer kinds its stacks cover (a MoE model mixing
    # dense and sparse layers, a checkpoint with layers left float: ExplicitRunner.graph_count)
    kinds = shard_plan.config.layer_kinds()
    return sum(len({kinds[first:first + g.layers] for first in range(0, len(kinds), g.layers)})
               if g.part == "layers" else 1 for g in graphs.all())


def _workspace_formula(profile, limits):
    n = profile.min_layers_per_graph
    layers = "one decoder layer" if n == 1 else f"{n} decoder layers"
    return (f"{_gib(profile.runtime_reserve_bytes)} runtime reserve + {layers} of the "
            f"largest call (a {limits.max_prefill_tokens}-token prefill chunk or a "
            f"{limits.max_num_seqs}-sequence decode step, over up to {limits.max_model_len} tokens "
            f"of context: float32 scores grow with chunk x context; a compiled graph runs no "
            f"more layers than fit in it) + float32 logits")


def _collectives(shard_plan, dtype_bytes, local_batch):
    """What one decode step moves between the ranks of a tensor group (data replicas do not
    talk while decoding)."""
    if shard_plan.tensor == 1:
        return []
    config = shard_plan.config
    hidden = local_batch * config.hidden_size * dtype_bytes
    reductions = []
    if shard_plan.styles["model.embed_tokens"] == "vocab":
        reductions.append(("embedding", 1))
    if shard_plan.styles["model.layers.0.self_attn.o_proj"] == "rowwise":
        reductions.append(("o_proj", config.num_layers))
    for where, sparse in (("down_proj", False), ("experts", True)):
        count = sum(_mlp_reduces(shard_plan, n) for n in range(config.num_layers)
                    if config.is_sparse_layer(n) == sparse)
        if count:
            reductions.append((where, count))
    collectives = []
    if reductions:
        collectives.append(Collective(
            kind="AllReduce", count=sum(n for _, n in reductions), payload_bytes=hidden,
            where=", ".join(f"{where} {n}" for where, n in reductions)))
    if shard_plan.styles["lm_head"] == "colwise_gather":
        collectives.append(Collective(
            kind="AllGather", count=1, payload_bytes=local_batch * config.vocab_size * dtype_bytes,
            where="lm_head logits"))
    return collectives


def _mlp_reduces(shard_plan, layer):
    """Whether layer `layer`'s MLP ends in an AllReduce: a dense one split, a sparse one's
    experts split or placed whole per rank (one AllReduce with its shared expert's)."""
    p = f"model.layers.{layer}.mlp."
    if shard_plan.config.is_sparse_layer(layer):
        return shard_plan.styles[p + "experts.0.down_proj"] in ("rowwise", "expert")
    return shard_plan.styles[p + "down_proj"] == "rowwise"


def _idle_expert_bytes(shard_plan, dtype_bytes, batch):
    """Bytes of the experts a decode step of `batch` tokens leaves unread on tensor rank 0:
    each token reads its num_experts_per_tok routed experts of each sparse layer (the
    others' weights are not read), at most every expert the rank holds; under expert
    parallelism the routed experts spread over the ranks, k / tensor per token on average."""
    config = shard_plan.config
    if config.moe is None:
        return 0
    moe, total = config.moe, 0
    for layer in range(config.num_layers):
        if not config.is_sparse_layer(layer):
            continue
        name = f"model.layers.{layer}.mlp.experts.down_proj.weight"
        held = len(shard_plan.local_experts(name))
        per_token = moe.num_experts_per_tok * held / moe.num_experts
        read = min(held, batch * per_token)
        rows, cols = shard_plan.local_shape(name)
        expert_bytes = 3 * rows // held * cols * dtype_bytes
        total += int((held - read) * expert_bytes)
    return total


def _decode_bound(report, shard_plan, dtype_bytes):
    """Decoding re-reads every weight (and each sequence's KV cache so far) per step, so a
    device's memory bandwidth caps the steps per second; each step yields one token per
    sequence. With full contexts: max_num_seqs sequences of max_len, as many as the pool holds."""
    embedding = 0
    if not shard_plan.config.tie_word_embeddings:  # a lookup reads a few rows, not the table
        rows, cols = shard_plan.local_shape("model.embed_tokens.weight")
        embedding = rows * cols * dtype_bytes
    weights = max(d.weights_bytes for d in report.devices) - embedding
    batch = max(1, min(report.max_num_seqs, report.max_concurrency))
    # A MoE model reads its active parameters: the routed experts of the step's tokens.
    weights_read = weights - _idle_expert_bytes(shard_plan, dtype_bytes, batch)
    full = weights_read + batch * report.max_model_len * report.kv_bytes_per_token
    bandwidth = report.memory_bandwidth_bytes_per_s
    report.decode_bytes_per_step = full
    report.decode_tokens_per_s_bound = batch * report.data * bandwidth / full
    short = weights - _idle_expert_bytes(shard_plan, dtype_bytes, report.max_num_seqs)
    report.decode_tokens_per_s_bound_short_context = (report.max_num_seqs * report.data * bandwidth
                                                    / short)
    config = shard_plan.config
    if config.moe is not None:  # what one sequence's step reads: its routed experts only
        one = weights - _idle_expert_bytes(shard_plan, dtype_bytes, 1)
        report.notes.append(
            f"mixture of experts: a token runs {config.moe.num_experts_per_tok} of the "
            f"{config.moe.num_experts} experts of each sparse layer, "
            f"{config.num_active_parameters() / 1e9:.2f}B of {config.num_parameters() / 1e9:.2f}B "
            f"parameters; one short sequence's decode step reads {_gib(one)} per device (its "
            f"active parameters): at most {report.data * bandwidth / one:.1f} tokens/s; a batch "
            f"reads the union of its tokens' experts")


def _explain(report, shard_plan, profile):
    config = shard_plan.config
    checkpoint = dtype_name(config.torch_dtype)
    if checkpoint == "bfloat16" and report.dtype == "float16":
        report.warnings.append(
            "bfloat16 weights run in float16, whose largest value is 65504: an activation "
            "bfloat16 would hold can overflow to inf")
    if shard_plan.replicated_kv_heads:
        r = shard_plan.kv_replicas
        report.notes.append(
            f"tensor {shard_plan.tensor} > {config.num_kv_heads} KV heads: each KV head is "
            f"replicated on {r} consecutive ranks (tensor ranks 0-{r - 1} hold KV head 0, "
            f"{r}-{2 * r - 1} KV head 1, ...), so its k/v_proj rows and KV cache are stored "
            f"{r} times")
    if shard_plan.data > 1:
        report.notes.append(
            f"data {shard_plan.data}: each replica holds a whole tensor-parallel copy of the "
            f"weights and its own KV cache, and decodes up to {report.max_num_seqs} sequences")
    if profile.shared_host_memory:
        report.notes.append(
            f"the {shard_plan.world_size} ranks share this host's memory: each gets "
            f"1/{shard_plan.world_size} of {_gib(profile.usable_bytes)}")


def _does_not_fit(worst, layout, shard_plan, profile, dtype, limits, speculation):
    if worst.margin_bytes < 0:
        message = (f"does not fit: rank {worst.rank} needs {_gib(worst.total_bytes)} of "
                   f"{_gib(worst.capacity_bytes)} ({_gib(-worst.margin_bytes)} over)")
    else:
        held = layout.usable_tokens if layout else 0
        source = (f"kv_cache_memory {limits.kv_cache_memory} bytes holds" if limits.kv_cache_memory
                  else f"the weights ({_gib(worst.weights_bytes)}) and workspace "
                       f"({_gib(worst.workspace_bytes)}) leave")
        message = (f"does not fit: {source} a KV cache of {held} tokens per rank, less than "
                   f"one sequence of max-model-len {limits.max_model_len}")
    if profile.shared_host_memory:
        return (message + "; the ranks share this host's memory, so more ranks do not help: "
                "lower --max-model-len or --max-prefill-tokens, or use a machine with more memory")
    fixes = []
    limit = 64 if profile.multi_server else profile.devices_per_server // shard_plan.data
    for tensor in range(shard_plan.tensor + 1, limit + 1):
        try:
            bigger = ShardPlan(shard_plan.config, shard_plan.styles, tensor, shard_plan.data)
        except PlanRefused:
            continue
        if _fits(bigger, profile, dtype, limits, speculation):
            need = max(d.total_bytes for d in _device_memory(bigger, profile, dtype, limits,
                                                             speculation)[0])
            fixes.append(f"with tensor: {tensor} (world_size {tensor * shard_plan.data}) it fits, "
                         f"needing {_gib(need)} per device")
            break
    else:
        fixes.append(f"no tensor degree up to {limit} fits max-model-len {limits.max_model_len}")
    longest = _longest_fitting_max_len(shard_plan, profile, dtype, limits, speculation)
    if longest:
        fixes.append(f"with --max-model-len {longest} it fits at tensor {shard_plan.tensor}")
    return "; ".join([message] + fixes)


def _fits(shard_plan, profile, dtype, limits, speculation):
    devices, layout = _device_memory(shard_plan, profile, dtype, limits, speculation)
    return (layout is not None and all(d.margin_bytes >= 0 for d in devices)
            and layout.usable_tokens >= limits.max_model_len)


def _longest_fitting_max_len(shard_plan, profile, dtype, limits, speculation):
    """The largest max-model-len below the requested one that fits at this degree (None if none)."""
    def fits(n):
        return _fits(shard_plan, profile, dtype, dataclasses.replace(
            limits, max_model_len=n, max_prefill_tokens=min(limits.max_prefill_tokens, n)),
            speculation)

    low, high = 0, limits.max_model_len  # fits(low) or low == 0; not fits(high)
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low or None


def _gib(n):
    return f"{n / GiB:.2f} GiB"


def _size(n):
    for unit, scale in (("GiB", GiB), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _rank_ranges(devices):
    """Consecutive ranks with the same figures, as one row each."""
    rows = []
    for d in devices:
        key = (d.weights_bytes, d.kv_cache_bytes, d.workspace_bytes, d.capacity_bytes)
        if rows and rows[-1][2] == key:
            rows[-1][1] = d.rank
        else:
            rows.append([d.rank, d.rank, key, d])
    return [(f"{a}" if a == b else f"{a}-{b}", d) for a, b, _, d in rows]


def _wrap(prefix, text):
    return textwrap.fill(text, width=100, initial_indent=prefix,
                         subsequent_indent=" " * len(prefix), break_on_hyphens=False)


def format_plan(report: PlanReport) -> str:
    lines = [f"msinfer plan: {report.model} on {report.world_size} x {report.hardware}, "
             f"{report.hardware_title}",
             f"  strategy   {report.strategy}: tensor {report.tensor} x data {report.data} x "
             f"pipeline {report.pipeline} = {report.world_size} devices, "
             f"{report.parallel_mode} mode",
             f"  engine     up to {report.max_num_seqs} sequences of up to {report.max_model_len} "
             f"tokens, "
             f"prefill chunks of {report.max_prefill_tokens}, KV blocks of {report.block_size}"]
    if report.dtype:
        lines.append(_wrap("  dtype      ", f"{report.dtype}: {report.dtype_reason}"))
    if report.quantization:
        lines.append(_wrap("  quantized  ", report.quantization))
    if report.speculative:
        lines.append(_wrap("  speculate  ", _speculation_words(report.speculative)))
    if report.warmup_graphs:
        if report.parallel_mode != "explicit":
            shapes = "one per call shape: semi_auto lays out each graph for its shapes"
        elif report.graph_shapes == "dynamic":
            shapes = "of dynamic shape: as many at any max-model-len"
        else:
            shapes = "one per call shape: --graph-shapes static"
        lines.append(_wrap("  warm-up    ", (
            f"{report.warmup_graphs} graphs per rank ({shapes}), compiled before serving (kept "
            f"by the compile cache for the next start)")))
    if report.devices:
        header = ("rank", "weights", "KV cache", "workspace", "total", "capacity", "margin")
        table = [header]
        for ranks, d in _rank_ranges(report.devices):
            margin = f"{d.margin_bytes / GiB:.2f} ({d.margin_bytes / d.capacity_bytes:.0%})"
            table.append((ranks,) + tuple(
                f"{n / GiB:.2f}" for n in (d.weights_bytes, d.kv_cache_bytes, d.workspace_bytes,
                                           d.total_bytes, d.capacity_bytes)) + (margin,))
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        lines += ["", "  memory per device, GiB:"]
        lines += ["    " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                  for row in table]
        lines.append(_wrap("  workspace = ", report.workspace_formula))
        if report.kv_blocks:
            lines.append(_wrap("  KV cache = ", (
                f"{report.kv_blocks} blocks of {report.block_size} tokens = {report.kv_tokens} "
                f"tokens "
                f"per rank ({_size(report.kv_bytes_per_token)} per token): "
                f"{report.max_concurrency} sequence(s) of "
                f"{report.max_model_len} tokens at "
                f"once, more when shorter; the same pool is the prefix cache (free blocks keep "
                f"what they hold until reused)")))
        lines += ["", f"  collectives per decoded token (within each tensor group of "
                      f"{report.tensor}):"]
        if not report.collectives_per_token:
            lines.append("    none")
        for c in report.collectives_per_token:
            lines.append(f"    {c.kind:<10} x{c.count:<4} {_size(c.payload_bytes):>10} each  "
                         f"({c.where})")
    if report.decode_tokens_per_s_bound:
        full = max(1, min(report.max_num_seqs, report.max_concurrency))
        lines += ["", _wrap("  decode     ", (
            f"at most {report.decode_tokens_per_s_bound:.1f} tokens/s with {full} full "
            f"{report.max_model_len}-token context(s) per replica "
            f"({report.decode_tokens_per_s_bound_short_context:.1f} with "
            f"{report.max_num_seqs} short "
            f"ones): each device reads {_size(report.decode_bytes_per_step)} per step at "
            f"{report.memory_bandwidth_bytes_per_s / 1e9:.0f} GB/s. A ceiling set by memory "
            f"bandwidth, not a promise."))]
    if report.notes or report.warnings or report.errors:
        lines.append("")
    lines += [_wrap("  note: ", n) for n in report.notes]
    lines += [_wrap("  warning: ", w) for w in report.warnings]
    lines += [_wrap("  error: ", e) for e in report.errors]
    lines.append("")
    if report.fits:
        tightest = min(d.margin_bytes for d in report.devices)
        lines.append(f"FITS: every device keeps at least {_gib(tightest)} free.")
    else:
        lines.append("REFUSED: see the error above.")
    return "\n".join(lines)
