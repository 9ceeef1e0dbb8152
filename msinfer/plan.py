"""`msinfer plan`: before launch, is this (model, strategy, hardware) legal, and does it fit?

Per device it counts the weight bytes exactly (from the config and the shard plan), the KV
cache for batch x max-len, and a stated workspace estimate, against the profile's usable
memory. It lists the collectives each decoded token costs, the dtype and why, and the decode
speed that memory bandwidth allows. It refuses what would fail on the hardware, saying how to
fix it.

Three things are easy to confuse: a `Strategy` (the YAML: degrees and rules), the `ShardPlan`
it resolves to for one model (what each rank holds: strategy.py), and the `PlanReport` made
here (is that ShardPlan legal on this hardware, in this parallel mode, and does it fit).
"""
from __future__ import annotations

import dataclasses
import json
import textwrap

from .config import ModelConfig, load_config
from .errors import PlanRefused, positive_int
from .hardware import (DTYPE_BYTES, PROFILES, GiB, HardwareProfile, compute_dtype, dtype_name,
                       get_profile)
from .strategy import PARALLEL_MODES, ShardPlan, Strategy, decide_parallel_mode, load_strategy

DEFAULT_MAX_LEN = 4096  # KV positions per sequence when none are asked for
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
    """The planner's verdict on one (model, strategy, hardware, mode, batch, max-len)."""

    model: str
    strategy: str
    hardware: str
    hardware_title: str
    world_size: int
    tensor: int
    data: int
    pipeline: int
    batch: int
    max_len: int
    memory_bandwidth_bytes_per_s: float
    parallel_mode: str = "explicit"
    dtype: str | None = None
    dtype_reason: str | None = None
    devices: list[DeviceMemory] = dataclasses.field(default_factory=list)
    collectives_per_token: list[Collective] = dataclasses.field(default_factory=list)
    workspace_formula: str | None = None
    decode_bytes_per_step: int | None = None  # read by the busiest device, full context
    decode_tokens_per_s_bound: float | None = None  # at a full max-len context
    decode_tokens_per_s_bound_short_context: float | None = None  # weights only
    errors: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict:
        return {"fits": self.fits, **dataclasses.asdict(self)}


def default_max_len(config: ModelConfig) -> int:
    """KV positions per sequence when none are asked for: DEFAULT_MAX_LEN, or fewer when the
    model's max_position_embeddings is smaller."""
    return min(config.max_position_embeddings, DEFAULT_MAX_LEN)


def make_plan(config: ModelConfig, strategy: Strategy, profile: HardwareProfile,
              batch: int = 1, max_len: int | None = None, dtype: str | None = None,
              parallel_mode: str | None = None) -> PlanReport:
    """Check and size a plan. parallel_mode None: decide_parallel_mode's choice; max_len None:
    default_max_len(config). Problems the hardware or the mode cannot run end up in
    `errors`; bad values raise MsinferError."""
    max_len = default_max_len(config) if max_len is None else max_len
    positive_int(batch, "batch")
    positive_int(max_len, "max_len")
    mode = decide_parallel_mode(parallel_mode, strategy)
    plan = PlanReport(model=config.source, strategy=strategy.source, hardware=profile.name,
                      hardware_title=profile.title, world_size=strategy.world_size,
                      tensor=strategy.tensor, data=strategy.data, pipeline=strategy.pipeline,
                      batch=batch, max_len=max_len,
                      memory_bandwidth_bytes_per_s=profile.memory_bandwidth_bytes_per_s,
                      parallel_mode=mode)
    refusal = _hardware_refusal(strategy, profile, mode)
    if refusal:
        plan.errors.append(refusal)
        return plan
    try:
        plan.dtype, plan.dtype_reason = compute_dtype(profile, config.torch_dtype, dtype)
        shard = strategy.resolve(config, mode)
    except PlanRefused as e:
        plan.errors.append(str(e))
        return plan
    if batch % strategy.data:
        plan.errors.append(
            f"--batch {batch} does not divide over data: {strategy.data} replicas "
            f"({batch} / {strategy.data} = {batch / strategy.data:g}); use a batch that is a "
            f"multiple of {strategy.data}")
        return plan

    dtype_bytes = DTYPE_BYTES[plan.dtype]
    plan.devices = _device_memory(shard, profile, dtype_bytes, batch, max_len)
    plan.workspace_formula = _workspace_formula(profile, batch // shard.data, max_len)
    plan.collectives_per_token = _collectives(shard, dtype_bytes, batch // shard.data)
    _decode_bound(plan, shard, dtype_bytes)
    _explain(plan, shard, profile)
    worst = max(plan.devices, key=lambda d: d.total_bytes - d.capacity_bytes)
    if worst.margin_bytes < 0:
        plan.errors.append(_does_not_fit(worst, shard, profile, dtype_bytes, batch, max_len))
    elif worst.margin_bytes < _TIGHT_MARGIN * worst.capacity_bytes:
        plan.warnings.append(
            f"rank {worst.rank} has only {_gib(worst.margin_bytes)} "
            f"({worst.margin_bytes / worst.capacity_bytes:.0%}) to spare, and the workspace "
            f"is an estimate")
    return plan


def check_plan_or_raise(config: ModelConfig, strategy: Strategy, profile: HardwareProfile,
                        batch: int = 1, max_len: int | None = None, dtype: str | None = None,
                        parallel_mode: str | None = None) -> PlanReport:
    """The gate of `msinfer launch` and `LLM(...)`: the report when the plan fits, else
    PlanRefused with the first error."""
    plan = make_plan(config, strategy, profile, batch, max_len, dtype, parallel_mode)
    if plan.errors:
        raise PlanRefused(plan.errors[0])
    return plan


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


def _device_memory(shard, profile, dtype_bytes, batch, max_len):
    config = shard.config
    local_batch = batch // shard.data
    kv_cache = (config.num_layers * 2 * local_batch * max_len * shard.local_kv_heads
                * config.head_dim * dtype_bytes)
    workspace = _workspace_bytes(shard, profile, dtype_bytes, local_batch, max_len)
    capacity = profile.usable_bytes
    if profile.shared_host_memory:
        capacity //= shard.world_size
    devices = []
    for rank in range(shard.world_size):
        tensor_rank = shard.tensor_rank(rank)
        weights = 0
        for name in config.parameter_shapes():
            count = 1
            for s in shard.slices(name, tensor_rank):
                count *= s.stop - s.start
            weights += count * dtype_bytes
        devices.append(DeviceMemory(
            rank=rank, tensor_rank=tensor_rank, data_rank=shard.data_rank(rank),
            weights_bytes=weights, kv_cache_bytes=kv_cache, workspace_bytes=workspace,
            total_bytes=weights + kv_cache + workspace, capacity_bytes=capacity))
    return devices


def _workspace_bytes(shard, profile, dtype_bytes, local_batch, max_len):
    """Runtime reserve plus the activations of one layer prefilling the local batch at
    max-len, all held at once (an upper estimate): 4 hidden-size tensors, local q/k/v, float32
    attention scores, 3 intermediate-size tensors, and float32 logits over the whole vocab."""
    config = shard.config
    tokens = local_batch * max_len
    intermediate = shard.local_shape("model.layers.0.mlp.gate_proj.weight")[0]
    activations = tokens * dtype_bytes * (
        4 * config.hidden_size
        + (shard.local_heads + 2 * shard.local_kv_heads) * config.head_dim
        + 3 * intermediate)
    scores = local_batch * shard.local_heads * max_len * max_len * 4
    logits = local_batch * config.vocab_size * 4
    return profile.runtime_reserve_bytes + activations + scores + logits


def _workspace_formula(profile, local_batch, max_len):
    return (f"{_gib(profile.runtime_reserve_bytes)} runtime reserve + one layer's prefill "
            f"activations for {local_batch} x {max_len} tokens (float32 attention scores "
            f"grow with max-len squared) + float32 logits")


def _collectives(shard, dtype_bytes, local_batch):
    """What one decode step moves between the ranks of a tensor group (data replicas do not
    talk while decoding)."""
    if shard.tensor == 1:
        return []
    config = shard.config
    hidden = local_batch * config.hidden_size * dtype_bytes
    reductions = []
    if shard.styles["model.embed_tokens"] == "vocab":
        reductions.append(("embedding", 1))
    if shard.styles["model.layers.0.self_attn.o_proj"] == "rowwise":
        reductions.append(("o_proj", config.num_layers))
    if shard.styles["model.layers.0.mlp.down_proj"] == "rowwise":
        reductions.append(("down_proj", config.num_layers))
    collectives = []
    if reductions:
        collectives.append(Collective(
            kind="AllReduce", count=sum(n for _, n in reductions), payload_bytes=hidden,
            where=", ".join(f"{where} {n}" for where, n in reductions)))
    if shard.styles["lm_head"] == "colwise_gather":
        collectives.append(Collective(
            kind="AllGather", count=1, payload_bytes=local_batch * config.vocab_size * dtype_bytes,
            where="lm_head logits"))
    return collectives


def _decode_bound(plan, shard, dtype_bytes):
    """Decoding re-reads every weight (and the KV cache so far) per step, so a device's memory
    bandwidth caps the steps per second; each step yields one token per sequence."""
    embedding = 0
    if not shard.config.tie_word_embeddings:  # a lookup reads a few rows, not the table
        rows, cols = shard.local_shape("model.embed_tokens.weight")
        embedding = rows * cols * dtype_bytes
    weights_read = max(d.weights_bytes for d in plan.devices) - embedding
    full = weights_read + max(d.kv_cache_bytes for d in plan.devices)
    bandwidth = plan.memory_bandwidth_bytes_per_s
    plan.decode_bytes_per_step = full
    plan.decode_tokens_per_s_bound = plan.batch * bandwidth / full
    plan.decode_tokens_per_s_bound_short_context = plan.batch * bandwidth / weights_read


def _explain(plan, shard, profile):
    config = shard.config
    checkpoint = dtype_name(config.torch_dtype)
    if checkpoint == "bfloat16" and plan.dtype == "float16":
        plan.warnings.append(
            "bfloat16 weights run in float16, whose largest value is 65504: an activation "
            "bfloat16 would hold can overflow to inf")
    if plan.max_len > config.max_position_embeddings:
        plan.warnings.append(
            f"--max-len {plan.max_len} exceeds the model's max_position_embeddings "
            f"{config.max_position_embeddings}")
    if shard.replicated_kv_heads:
        r = shard.kv_replicas
        plan.notes.append(
            f"tensor {shard.tensor} > {config.num_kv_heads} KV heads: each KV head is "
            f"replicated on {r} consecutive ranks (tensor ranks 0-{r - 1} hold KV head 0, "
            f"{r}-{2 * r - 1} KV head 1, ...), so its k/v_proj rows and KV cache are stored "
            f"{r} times")
    if shard.data > 1:
        plan.notes.append(
            f"data {shard.data}: each replica holds a whole tensor-parallel copy of the "
            f"weights and serves {plan.batch // shard.data} of the {plan.batch} sequences")
    if profile.shared_host_memory:
        plan.notes.append(
            f"the {shard.world_size} ranks share this host's memory: each gets "
            f"1/{shard.world_size} of {_gib(profile.usable_bytes)}")


def _does_not_fit(worst, shard, profile, dtype_bytes, batch, max_len):
    message = (f"does not fit: rank {worst.rank} needs {_gib(worst.total_bytes)} of "
               f"{_gib(worst.capacity_bytes)} ({_gib(-worst.margin_bytes)} over)")
    if profile.shared_host_memory:
        return (message + "; the ranks share this host's memory, so more ranks do not help: "
                "lower --batch or --max-len, or use a machine with more memory")
    fixes = []
    limit = 64 if profile.multi_server else profile.devices_per_server // shard.data
    for tensor in range(shard.tensor + 1, limit + 1):
        try:
            bigger = ShardPlan(shard.config, shard.styles, tensor, shard.data)
        except PlanRefused:
            continue
        devices = _device_memory(bigger, profile, dtype_bytes, batch, max_len)
        need = max(d.total_bytes for d in devices)
        if need <= profile.usable_bytes:
            fixes.append(f"with tensor: {tensor} (world_size {tensor * shard.data}) it fits, "
                         f"needing {_gib(need)} per device")
            break
    else:
        fixes.append(f"no tensor degree up to {limit} fits batch {batch} x max-len {max_len}")
    longest = _longest_fitting_max_len(shard, profile, dtype_bytes, batch, max_len)
    if longest:
        fixes.append(f"with --max-len {longest} it fits at tensor {shard.tensor}")
    return "; ".join([message] + fixes)


def _longest_fitting_max_len(shard, profile, dtype_bytes, batch, max_len):
    """The largest max-len below the requested one that fits at this degree (None if none)."""
    def fits(n):
        devices = _device_memory(shard, profile, dtype_bytes, batch, n)
        return all(d.margin_bytes >= 0 for d in devices)

    low, high = 0, max_len  # fits(low) or low == 0; not fits(high)
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


def format_plan(plan: PlanReport) -> str:
    lines = [f"msinfer plan: {plan.model} on {plan.world_size} x {plan.hardware}, "
             f"{plan.hardware_title}",
             f"  strategy   {plan.strategy}: tensor {plan.tensor} x data {plan.data} x "
             f"pipeline {plan.pipeline} = {plan.world_size} devices, {plan.parallel_mode} mode",
             f"  request    batch {plan.batch}, max length {plan.max_len}"]
    if plan.dtype:
        lines.append(_wrap("  dtype      ", f"{plan.dtype}: {plan.dtype_reason}"))
    if plan.devices:
        header = ("rank", "weights", "KV cache", "workspace", "total", "capacity", "margin")
        table = [header]
        for ranks, d in _rank_ranges(plan.devices):
            margin = f"{d.margin_bytes / GiB:.2f} ({d.margin_bytes / d.capacity_bytes:.0%})"
            table.append((ranks,) + tuple(
                f"{n / GiB:.2f}" for n in (d.weights_bytes, d.kv_cache_bytes, d.workspace_bytes,
                                           d.total_bytes, d.capacity_bytes)) + (margin,))
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        lines += ["", "  memory per device, GiB:"]
        lines += ["    " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                  for row in table]
        lines.append(_wrap("  workspace = ", plan.workspace_formula))
        lines += ["", f"  collectives per decoded token (within each tensor group of "
                      f"{plan.tensor}):"]
        if not plan.collectives_per_token:
            lines.append("    none")
        for c in plan.collectives_per_token:
            lines.append(f"    {c.kind:<10} x{c.count:<4} {_size(c.payload_bytes):>10} each  "
                         f"({c.where})")
        lines += ["", _wrap("  decode     ", (
            f"at most {plan.decode_tokens_per_s_bound:.1f} tokens/s at batch {plan.batch} with "
            f"a full {plan.max_len}-token context ({plan.decode_tokens_per_s_bound_short_context:.1f} "
            f"at a short one): each device reads {_size(plan.decode_bytes_per_step)} per step "
            f"at {plan.memory_bandwidth_bytes_per_s / 1e9:.0f} GB/s. A ceiling set by memory "
            f"bandwidth, not a promise."))]
    if plan.notes or plan.warnings or plan.errors:
        lines.append("")
    lines += [_wrap("  note: ", n) for n in plan.notes]
    lines += [_wrap("  warning: ", w) for w in plan.warnings]
    lines += [_wrap("  error: ", e) for e in plan.errors]
    lines.append("")
    if plan.fits:
        tightest = min(d.margin_bytes for d in plan.devices)
        lines.append(f"FITS: every device keeps at least {_gib(tightest)} free.")
    else:
        lines.append("REFUSED: see the error above.")
    return "\n".join(lines)


def _run(args):
    config = load_config(args.model)
    strategy = load_strategy(args.strategy)
    profile = get_profile(args.hardware)
    plan = make_plan(config, strategy, profile, batch=args.batch, max_len=args.max_len,
                     dtype=args.dtype, parallel_mode=args.parallel_mode)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan))
    return 0 if plan.fits else 1


def register_cli(subparsers):
    parser = subparsers.add_parser(
        "plan", help="check a strategy against a model and hardware before launch",
        description="Says whether a shard plan is legal on the hardware and whether it fits: "
                    "memory per device, collectives per token, dtype, decode speed bound. "
                    "Exit 0 when it fits, 1 when it does not fit or is refused, 2 for bad input.")
    parser.add_argument("--model", required=True,
                        help="model directory (with config.json) or qwen2-0.5b, qwen2-1.5b, "
                             "qwen2-7b, qwen2-72b")
    parser.add_argument("--strategy", required=True, help="strategy file, e.g. "
                                                          "strategies/qwen2_tp4.yaml")
    parser.add_argument("--hardware", required=True, choices=sorted(PROFILES),
                        help="hardware profile")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    parser.add_argument("--max-len", type=int, default=None,
                        help=f"prompt plus generated tokens per sequence (default "
                             f"{DEFAULT_MAX_LEN}, or the model's max_position_embeddings if "
                             f"smaller)")
    parser.add_argument("--parallel-mode", choices=PARALLEL_MODES, default=None,
                        help="default: the strategy's parallel_mode, else explicit")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES),
                        help="compute dtype (default: the hardware's policy)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=_run)
