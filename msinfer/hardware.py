"""Hardware profiles (per-device memory, bandwidth, dtypes, links) and the one dtype policy.

Each figure says where it comes from. "GiB" figures from npu-smi are its MB column, which
counts MiB.
"""
from __future__ import annotations

import dataclasses
import functools
import os

from .errors import MsinferError, PlanRefused

GiB = 1024 ** 3
MiB = 1024 ** 2

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
                  "bf16": "bfloat16"}


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    name: str
    title: str
    device_target: str              # "Ascend" | "CPU" | "GPU"
    usable_bytes: int               # per device, what the driver leaves to programs
    devices_per_server: int
    memory_bandwidth_bytes_per_s: float  # per device
    dtypes: tuple                   # compute dtypes msinfer runs here, preferred first
    dtype_note: str                 # why the others are not offered
    p2p_copy: bool                  # device-to-device copy (what pipeline stages need)
    runtime_reserve_bytes: int      # runtime, communication buffers, compiled graphs
    multi_server: bool = True       # collectives across servers work
    devices_per_card: int = 1       # chips npu-smi lists per card (doctor, commtest's pairs)
    shared_host_memory: bool = False  # all ranks of a server share one memory (CPU)
    # Decoder layers a compiled graph runs at least, and so how many layers of the largest
    # call the workspace reserves (engine/workspace.py says why the CPU backend needs two).
    min_layers_per_graph: int = 1


_ATLAS_300I_DUO_COMMON = dict(
    device_target="Ascend",
    # One card holds two 310P chips; each chip is its own device (npu-smi lists each 310P3).
    devices_per_card=2,
    # An Atlas 800 inference server (model 3000) takes at most 4 Duo cards = 8 chips
    # (hiascend.com mindcluster dl_affinity_0009).
    devices_per_server=8,
    # 408 GB/s per card (vendor spec, as reported by infogioco.it and accio.com), shared by
    # its two chips; per chip is 408 / 2, an estimate.
    memory_bandwidth_bytes_per_s=204e9,
    dtypes=("float16",),
    # MindIE-LLM's Qwen README: "300I DUO只支持float16"; aclnnCast fails on DT_BFLOAT16 on
    # Ascend310P3 (hiyouga/LlamaFactory#7522); HcclAllReduce on 300I Duo takes no bf16.
    dtype_note="the Ascend 310P chip has no bfloat16 (its casts and HCCL AllReduce do not "
               "take bf16); msinfer runs it in float16",
    # Copying device to device dies with "sdma error" (vllm-project/vllm-ascend#3316);
    # HCCL collectives over PCIe work and are how tensor parallelism runs here.
    p2p_copy=False,
    # MindFormers' own 310P config (br_feature_infer_300iduo, deepseek tp4pp6 yaml) caps
    # MindSpore at max_device_memory 41GB of the ~43 GiB the chip shows, leaving about 2 GiB
    # to the runtime and HCCL buffers (HCCL_BUFFSIZE defaults to 200 MB per communicator).
    runtime_reserve_bytes=2 * GiB,
    # MindSpore does not initialise HCCL for inter-node groups on 310P
    # (ascend_communication_group.cc); vllm-ascend maintainers: single server only (#7184).
    multi_server=False,
)

PROFILES = {
    "atlas-300i-duo": HardwareProfile(
        name="atlas-300i-duo",
        title="Atlas 300I Duo (96 GB card, 2 x 310P chips)",
        # 96 GB LPDDR4X per card = 2 x 48 GB (accio.com/plp/huawei-96gb-gpu), of which
        # npu-smi shows 44280 and 43693 MB for the two chips of one card
        # (vllm-project/vllm-ascend#1141, Syllo/nvtop#421): take the smaller.
        usable_bytes=43693 * MiB,
        **_ATLAS_300I_DUO_COMMON),
    "atlas-300i-duo-48g": HardwareProfile(
        name="atlas-300i-duo-48g",
        title="Atlas 300I Duo (48 GB card, 2 x 310P chips)",
        # npu-smi shows 21525 MB per chip on the 48 GB card (Project-HAMi/website#782).
        usable_bytes=21525 * MiB,
        **_ATLAS_300I_DUO_COMMON),
    "atlas-800i-a2": HardwareProfile(
        name="atlas-800i-a2",
        title="Atlas 800I A2 (Ascend 910B, 64 GB)",
        device_target="Ascend",
        # npu-smi shows 65536 MB HBM with about 3.4 GB in use at idle
        # (vllm-project/vllm-ascend#2534); MindFormers' Qwen2-72B predict config caps
        # MindSpore at 59GB (research/qwen2 r1.3.0).
        usable_bytes=(65536 - 3416) * MiB,
        devices_per_server=8,
        # 1.6 TB/s is the figure commonly quoted for the 64 GB 910B's HBM2e; not confirmed
        # from a Huawei datasheet.
        memory_bandwidth_bytes_per_s=1.6e12,
        # MindIE-LLM's Qwen README: Qwen2 runs bfloat16 on 800I A2.
        dtypes=("bfloat16", "float16"),
        dtype_note="msinfer runs the 910B in bfloat16 or float16",
        # The NPUs of one 800I A2 server are linked by HCCS, which carries device-to-device
        # copies and every HCCL collective (not measured here: no A2 at hand).
        p2p_copy=True,
        # The 300I Duo allowance; 65536 - 3416 MiB - 2 GiB is close to MindFormers' 59GB cap.
        runtime_reserve_bytes=2 * GiB,
    ),
    "cpu": HardwareProfile(
        name="cpu",
        title="CPU (MindSpore CPU backend, ranks share this host's memory)",
        device_target="CPU",
        # A planning allowance, not a measurement: the OS and other programs keep a fifth.
        usable_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 4 // 5,
        devices_per_server=os.cpu_count() or 1,
        # Measured on this project's 2-core CI machines: a float32 896x4864 GEMV reads
        # ~17 GB/s with MindSpore 2.10.
        memory_bandwidth_bytes_per_s=17e9,
        dtypes=("float32", "float16"),
        # MindSpore 2.10 on CPU: bfloat16 MatMul fails, float16 runs about 11x slower.
        dtype_note="bfloat16 matmul fails in MindSpore on CPU",
        p2p_copy=True,
        # The Python process with MindSpore loaded; an allowance.
        runtime_reserve_bytes=1 * GiB,
        shared_host_memory=True,
        min_layers_per_graph=2,
    ),
}


@dataclasses.dataclass(frozen=True)
class CpuMatmulForms:
    """How explicit mode multiplies on the CPU backend, whose MatMul (oneDNN's f32 gemm) is
    fastest in different forms on different processors. `in_out`: the decoder-layer
    projections stored (in, out), transposed once at load, and computed x @ W; else stored
    (out, in) as the checkpoint has them. `mlp_weight_first` / `head_weight_first`: the row
    counts (first, last) at which the MLP (gate/up and down, stored (out, in)) / the lm_head
    computes (W @ x.T).T instead of x @ W.T. Only the MLP, whose weights are 85% of a layer's:
    a weight-first product is transposed back, and on CPU each Transpose keeps an int64 index
    per element for the life of its graph (the MLP's chain transposes once, its output)."""

    in_out: bool
    mlp_weight_first: tuple = None
    head_weight_first: tuple = (8, None)


# Measured on this project's machines, 0.5B shapes, kernel for kernel and through 24 layers of
# distinct weights (so that they stream from memory), best of 5 (bench/README.md: the
# matmul_forms probe).
# AMD EPYC (family 25 model 17): x @ W beat x @ W.T at decode sizes (16 rows: gate/up 2.8 vs
# 5.4 ms; 1 row: 1.4 vs 1.8 ms; equal at 256); the lm_head (W @ x.T).T from 8 rows (16 rows:
# 31 vs 41 ms). Intel Xeon with AVX-512 (family 6 model 167), the four projections of 24
# layers: 1 row x @ W.T 55 ms, x @ W 58, (W @ x.T).T 83; 2 rows 60 / 84 / 89; 4 rows 104 /
# 104 / 89; 16 rows 152 / 175 / 108; 32 rows 209 / 227 / 156; 64 rows 272 / 328 / 278;
# 256 rows 917 / 1030 / 1139. AMD EPYC family 26 (results/matmul_forms_amd_f26.json, two
# runs): x @ W.T 52-57 ms vs x @ W 61-67 at 1 row, equal at 2, 1.5 x slower at 4-32 rows, where
# x @ W and (W @ x.T).T trade places from run to run; it keeps the AMD forms. An unmeasured
# processor takes the AMD forms.
CPU_MATMUL_FORMS = {
    "AuthenticAMD": CpuMatmulForms(in_out=True),
    "GenuineIntel": CpuMatmulForms(in_out=False, mlp_weight_first=(4, 32)),
}


def cpuinfo_fields(cpuinfo="/proc/cpuinfo") -> dict:
    """The first processor's fields in /proc/cpuinfo, names and values stripped (the names
    are tab-padded: "vendor_id\t: AuthenticAMD"); {} where the file cannot be read."""
    fields = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                if not line.strip() and fields:
                    break  # a blank line ends the first processor's block
                if ":" in line:
                    name, value = line.split(":", 1)
                    fields[name.strip()] = value.strip()
    except OSError:
        pass
    return fields


@functools.lru_cache(maxsize=None)
def cpu_matmul_forms(cpuinfo="/proc/cpuinfo") -> CpuMatmulForms:
    """The forms measured fastest on this processor's vendor (CPU_MATMUL_FORMS); read once
    per file (every layer Cell and every loaded weight asks)."""
    vendor = cpuinfo_fields(cpuinfo).get("vendor_id")
    return CPU_MATMUL_FORMS.get(vendor, CPU_MATMUL_FORMS["AuthenticAMD"])


def get_profile(name: str) -> HardwareProfile:
    if name not in PROFILES:
        raise MsinferError(f"unknown hardware {name!r}; known: {', '.join(PROFILES)}")
    return PROFILES[name]


def dtype_name(value: object, what: str = "dtype") -> str:
    """A dtype spelled as in config.json, torch or short form, as its plain name."""
    name = str(value).replace("torch.", "").lower()
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise MsinferError(f"{what} {value!r} is not one of {', '.join(DTYPE_BYTES)}")
    return name


def compute_dtype(profile: HardwareProfile, checkpoint_dtype: str,
                  requested: str | None = None) -> tuple[str, str]:
    """The dtype msinfer computes in on this hardware, and why. PlanRefused if it cannot."""
    checkpoint = dtype_name(checkpoint_dtype, "checkpoint dtype")
    if requested is not None:
        wanted = dtype_name(requested, "--dtype")
        if wanted not in profile.dtypes:
            raise PlanRefused(
                f"{profile.title} cannot run {wanted}: {profile.dtype_note}. Use --dtype "
                f"{profile.dtypes[0]} or leave --dtype out; the {checkpoint} checkpoint is "
                f"converted while loading")
        reason = "requested with --dtype"
        if profile.device_target == "CPU" and wanted == "float16":
            reason += "; float16 matmul is about 11x slower than float32 on CPU"
        return wanted, reason
    if profile.device_target == "CPU":
        return "float32", ("CPU computes in float32: float16 matmul is about 11x slower there "
                           "and bfloat16 matmul fails")
    if checkpoint in profile.dtypes:
        return checkpoint, f"the checkpoint's dtype, which {profile.name} runs natively"
    chosen = profile.dtypes[0]
    return chosen, (f"the checkpoint is {checkpoint} and {profile.dtype_note}; weights are "
                    f"converted while loading")
