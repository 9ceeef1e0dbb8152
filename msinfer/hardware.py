"""Hardware profiles (per-device memory, bandwidth, dtypes, links), the one dtype policy, and
which profile this host is (`--hardware auto`: the chips `npu-smi info` lists, else cpu).

Each figure says where it comes from. "GiB" figures from npu-smi are its MB column, which
counts MiB. Nothing here imports MindSpore: `msinfer plan` runs where it is not installed.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import subprocess

from .errors import MsinferError, PlanRefused

GiB = 1024 ** 3
MiB = 1024 ** 2
AUTO = "auto"  # --hardware auto: this host's profile (detect_hardware)

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
    # What each layer of a compiled graph past its first adds to the graph's memory peak, as
    # a fraction of one layer's activations (planning/workspace.py). 1.0, every layer's
    # activations held to the end, where unmeasured.
    layer_peak_growth: float = 1.0


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
        # MindSpore 2.10 on CPU: bfloat16 MatMul fails, float16 runs far slower (docs/engine.md,
        # "Measured figures behind the code").
        dtype_note="bfloat16 matmul fails in MindSpore on CPU",
        p2p_copy=True,
        # The Python process with MindSpore loaded; an allowance.
        runtime_reserve_bytes=1 * GiB,
        shared_host_memory=True,
        min_layers_per_graph=2,
        # Measured ~0.10 (docs/engine.md, "Measured figures behind the code"), with a margin.
        layer_peak_growth=0.15,
    ),
}

# What --hardware takes: a profile, or "auto" (this host's: detect_hardware).
HARDWARE_CHOICES = (AUTO, *PROFILES)


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

    def mlp_weight_first_for(self, rows) -> bool:
        return rows_within(rows, self.mlp_weight_first)

    def head_weight_first_for(self, rows) -> bool:
        return rows_within(rows, self.head_weight_first)


def rows_within(rows, bounds) -> bool:
    """Whether `rows` is within bounds (first, last), last None: no bound; bounds None: no."""
    if bounds is None:
        return False
    first, last = bounds
    return rows >= first and (last is None or rows <= last)


# The fastest forms measured on this project's machines, 0.5B shapes, kernel for kernel and
# through 24 layers of distinct weights (so that they stream from memory); the figures are in
# docs/engine.md, "Measured figures behind the code". AMD EPYC (family 25 model 17): x @ W at
# decode sizes, the lm_head (W @ x.T).T from 8 rows. Intel Xeon with AVX-512 (family 6 model
# 167): x @ W.T, except (W @ x.T).T for the MLP from 4 to 32 rows. AMD EPYC family 26: no
# form clearly best from run to run; it keeps the AMD forms. An unmeasured processor takes
# the AMD forms.
CPU_MATMUL_FORMS = {
    "AuthenticAMD": CpuMatmulForms(in_out=True),
    "GenuineIntel": CpuMatmulForms(in_out=False, mlp_weight_first=(4, 32)),
}


# The C++ compiler msinfer's CPU kernels are built with (layers/cpu_kernels), and the
# instructions int8_linear.cc is written with (AVX512-VNNI's vpdpbusd for the int8 sums).
KERNEL_COMPILER = "g++"
INT8_KERNEL_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c"})


def kernel_compiler_available() -> bool:
    """Whether this host can build the CPU kernels (where it cannot, layers keep their
    MindSpore-only forms)."""
    return shutil.which(KERNEL_COMPILER) is not None


def processor_flags(cpuinfo="/proc/cpuinfo") -> set:
    """The host processor's feature flags (/proc/cpuinfo's), empty where unknown: a kernel
    written with instructions the host lacks is not built there."""
    return set(cpuinfo_fields(cpuinfo).get("flags", "").split())


def int8_kernels_available() -> bool:
    """Whether this host builds and runs int8_linear.cc: quantized layers use it on CPU, and
    the planner counts the 16-bit tables it reads."""
    return kernel_compiler_available() and INT8_KERNEL_FLAGS <= processor_flags()


def cpuinfo_fields(cpuinfo="/proc/cpuinfo") -> dict:
    """The first processor's fields in /proc/cpuinfo, names and values stripped (the names
    are tab-padded: "vendor_id\t: AuthenticAMD"); {} where the file cannot be read. Read
    once per file: every quantized projection a model builds asks for the processor's flags."""
    return dict(_cpuinfo_fields(cpuinfo))


@functools.lru_cache(maxsize=None)
def _cpuinfo_fields(cpuinfo) -> dict:
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
    """The profile `name`; "auto" (or None): this host's (detect_hardware)."""
    if name in (None, AUTO):
        name = detect_hardware()[0]
    if name not in PROFILES:
        raise MsinferError(f"unknown hardware {name!r}; known: {', '.join(PROFILES)} (or auto)")
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


# ---- which hardware this host is: `npu-smi info` ----

_BUS_ID = re.compile(r"^[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]$")


@dataclasses.dataclass
class Chip:
    npu: int        # the card (npu-smi's NPU id)
    chip: int       # the chip on that card
    device: int     # the logical device id (DEVICE_ID, rank tables)
    name: str
    health: str
    bus_id: str
    memory_used_mb: int
    memory_total_mb: int


@dataclasses.dataclass
class Process:
    npu: int
    chip: int
    pid: int
    name: str
    memory_mb: int


@dataclasses.dataclass
class NpuSmi:
    version: str
    chips: list
    processes: list

    def cards(self):
        found = {}
        for chip in self.chips:
            found.setdefault(chip.npu, []).append(chip)
        return found


# ---- npu-smi info ----

def parse_npu_smi(text):
    """The chip table and the process table of `npu-smi info`.

    Each chip is two rows: `| NPU Name | Health | Power Temp Hugepages |` then
    `| Chip Device | Bus-Id | AICore Memory-Usage [HBM-Usage] |`. The 300I Duo prints a Device
    column (the logical id); other cards may not, and then devices are numbered in order."""
    version = re.search(r"npu-smi\s+([0-9A-Za-z.]+)", text)
    chips, processes = [], []
    has_device_column, pending, section = False, None, None
    for line in text.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        joined = " ".join(cells)
        if "Health" in joined and "Name" in joined:
            section = "chips"
            continue
        if "Bus-Id" in joined:
            has_device_column = bool(re.search(r"\bChip\s+(Device|Phy-ID)\b", cells[0]))
            continue
        if "Process id" in joined:
            section = "processes"
            continue
        if section == "chips" and len(cells) >= 3:
            if _BUS_ID.match(cells[1]):
                if pending is None:
                    raise MsinferError(f"npu-smi info: chip row without its NPU row: {line!r}")
                tokens = cells[0].split()
                memory = re.findall(r"(\d+)\s*/\s*(\d+)", cells[2])
                if not tokens or not tokens[0].isdigit() or not memory:
                    raise MsinferError(f"npu-smi info: cannot read chip row {line!r}")
                device = (int(tokens[1]) if has_device_column and len(tokens) > 1
                          and tokens[1].isdigit() else len(chips))
                used, total = map(int, memory[-1])  # HBM when both columns are shown
                chips.append(Chip(npu=pending[0], chip=int(tokens[0]), device=device,
                                  name=pending[1], health=pending[2], bus_id=cells[1],
                                  memory_used_mb=used, memory_total_mb=total))
                pending = None
            else:
                tokens = cells[0].split()
                if tokens and tokens[0].isdigit():
                    pending = (int(tokens[0]), " ".join(tokens[1:]), cells[1])
        elif section == "processes" and len(cells) >= 4:
            ids = cells[0].split()
            if len(ids) == 2 and all(i.isdigit() for i in ids) and cells[1].isdigit():
                memory = re.match(r"\d+", cells[3])
                processes.append(Process(npu=int(ids[0]), chip=int(ids[1]), pid=int(cells[1]),
                                         name=cells[2], memory_mb=int(memory[0]) if memory else 0))
    if not chips:
        first = next((line.strip() for line in text.splitlines() if line.strip()), "")
        raise MsinferError(f"npu-smi info printed no chip table (first line: {first[:120]!r})")
    return NpuSmi(version=version[1] if version else "?", chips=chips, processes=processes)


class NpuSmiUnavailable(MsinferError):
    """`npu-smi info` is not there, did not run, failed, or printed no chip table; the
    message says which and what to do. `missing`: not on PATH at all."""

    def __init__(self, message, missing=False):
        super().__init__(message)
        self.missing = missing


def npu_smi_info(timeout=60) -> NpuSmi:
    """`npu-smi info`, run and parsed; NpuSmiUnavailable saying why not."""
    tool = shutil.which("npu-smi")
    if tool is None:
        raise NpuSmiUnavailable("npu-smi not found on PATH: install the Ascend NPU driver (it "
                                "puts npu-smi in /usr/local/bin), or add that directory to PATH",
                                missing=True)
    try:
        done = subprocess.run([tool, "info"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NpuSmiUnavailable(f"`npu-smi info` did not run: {e}") from None
    if done.returncode != 0:
        said = (done.stdout + done.stderr).strip().splitlines()
        raise NpuSmiUnavailable(f"`npu-smi info` failed (exit {done.returncode}: "
                                f"{said[0][:120] if said else 'no output'!r}): the driver is not "
                                f"loaded or this user cannot open /dev/davinci*; try as root or "
                                f"add the user to the HwHiAiUser group")
    try:
        return parse_npu_smi(done.stdout)
    except MsinferError as e:
        raise NpuSmiUnavailable(f"{e}; compare with `npu-smi info` by hand") from None


def profile_for_chips(smi: NpuSmi) -> str | None:
    """The profile a box's chips match: 310P -> 300I Duo (by memory, 96 or 48 GB card), 910 ->
    800I A2; None for chips no profile describes."""
    name = smi.chips[0].name
    if name.startswith("310P"):
        return ("atlas-300i-duo" if min(c.memory_total_mb for c in smi.chips) > 30000
                else "atlas-300i-duo-48g")
    if "910" in name:
        return "atlas-800i-a2"
    return None


def detect_hardware() -> tuple[str, str]:
    """(profile name, how it was chosen) for `--hardware auto`: the profile of the chips
    `npu-smi info` lists; cpu where there is no npu-smi. An Ascend host whose npu-smi fails or
    lists chips no profile describes is an error (MsinferError), never a silent cpu."""
    try:
        smi = npu_smi_info()
    except NpuSmiUnavailable as e:
        if e.missing:
            return "cpu", "detected (--hardware auto): no npu-smi on PATH, no Ascend chip"
        raise MsinferError(f"--hardware auto: {e}; or give --hardware (one of "
                           f"{', '.join(PROFILES)})") from None
    name = profile_for_chips(smi)
    chips = sorted({c.name for c in smi.chips})
    if name is None:
        raise MsinferError(f"--hardware auto: npu-smi lists {', '.join(chips)} chips, which no "
                           f"profile describes; give --hardware (one of {', '.join(PROFILES)})")
    return name, (f"detected (--hardware auto): npu-smi {smi.version} lists "
                  f"{len(smi.chips)} {'/'.join(chips)} chips on {len(smi.cards())} cards")


def choose_hardware(name: str | None) -> tuple[str, str]:
    """(profile name, how it was chosen): `name` as given, or detect_hardware's for "auto" or
    None. MsinferError for an unknown name."""
    if name in (None, AUTO):
        return detect_hardware()
    return get_profile(name).name, "given"
