"""`msinfer doctor`: can this box run this plan? Checks before a launch, each with what to do.

Ascend spreads the answer over separate tools (`npu-smi info`, version files, `hccn_tool`,
plog files) that know nothing of the model, the strategy or the rank table. Each check here
ends as pass / warn / fail / skip with one line: what was found and what to do about it.
On --hardware cpu the device and Ascend software checks are skipped, not failed.
"""
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import sys

from ..errors import MsinferError
# The npu-smi reader lives in hardware.py (--hardware auto uses it too).
from ..hardware import AUTO, NpuSmiUnavailable, npu_smi_info, parse_npu_smi, profile_for_chips

__all__ = ["parse_npu_smi", "run_checks", "run"]  # parse_npu_smi: where doctor's users find it

PASS, WARN, FAIL, SKIP = "pass", "warn", "fail", "skip"
DEFAULT_ASCEND_ROOT = "/usr/local/Ascend"
MEMINFO = "/proc/meminfo"
_IDLE_CHIP_MB = 4096  # an idle 310P chip shows about 1.3-1.7 GB in use (public npu-smi outputs)
_MAX_LOG_BYTES = 200 * 1024 ** 2


@dataclasses.dataclass
class Check:
    name: str
    status: str
    detail: str


def run_npu_smi():
    """(NpuSmi, None) or (None, Check saying why not)."""
    try:
        return npu_smi_info(), None
    except NpuSmiUnavailable as e:
        return None, Check("devices.npu-smi", FAIL, str(e))


def detect_hardware(smi):
    """The profile a box's chips match (hardware.profile_for_chips); cpu without chips or for
    chips no profile describes (doctor then skips the device checks and says so)."""
    if smi is None:
        return "cpu"
    return profile_for_chips(smi) or "cpu"


def _device_list(ids):
    return ", ".join(map(str, sorted(ids))) or "none"


def device_checks(smi, profile, strategy):
    chips = smi.chips
    names = sorted({c.name for c in chips})
    cards = smi.cards()
    checks = [Check("devices.npu-smi", PASS,
                    f"npu-smi {smi.version}: {len(chips)} chips ({', '.join(names)}) on "
                    f"{len(cards)} cards, devices {_device_list(c.device for c in chips)}")]

    problems = []
    wanted = "310P" if profile.name.startswith("atlas-300i-duo") else "910"
    if not all(wanted in c.name for c in chips):
        problems.append((WARN, f"the chips are {', '.join(names)}, not what --hardware "
                               f"{profile.name} describes ({wanted}); give the --hardware that "
                               f"matches them"))
    for npu, on_card in sorted(cards.items()):
        if len(on_card) < profile.devices_per_card:
            seen = ", ".join(f"chip {c.chip} as device {c.device}" for c in on_card)
            problems.append((FAIL, f"NPU {npu} shows {len(on_card)} chip ({seen}) but each "
                                   f"{profile.title.split(' (')[0]} card has "
                                   f"{profile.devices_per_card}: a chip is lost; check "
                                   f"`npu-smi info -t board -i {npu}` and dmesg, reload the "
                                   f"driver or reseat the card"))
    if strategy is not None and len(chips) < strategy.world_size:
        problems.append((FAIL, f"{strategy.source} needs {strategy.world_size} devices but "
                               f"npu-smi shows {len(chips)}: fix the missing chips or use a "
                               f"strategy with world_size <= {len(chips)}"))
    if problems:
        worst = FAIL if any(s == FAIL for s, _ in problems) else WARN
        checks.append(Check("devices.count", worst, "; ".join(d for _, d in problems)))
    else:
        need = f", the strategy needs {strategy.world_size}" if strategy else ""
        checks.append(Check("devices.count", PASS,
                            f"{len(chips)} chips, {profile.devices_per_card} per card{need}"))

    sick = [c for c in chips if c.health.upper() != "OK"]
    if sick:
        checks.append(Check("devices.health", FAIL, "; ".join(
            f"NPU {c.npu} chip {c.chip} (device {c.device}) health {c.health}" for c in sick)
            + f": see `npu-smi info -t health -i {sick[0].npu} -c {sick[0].chip}`, reset the "
              f"chip (`npu-smi set -t reset -i {sick[0].npu} -c {sick[0].chip}`) or replace the "
              f"card; keep it out of the rank table meanwhile"))
    else:
        checks.append(Check("devices.health", PASS, f"all {len(chips)} chips OK"))
    checks.append(_memory_check(smi, profile))
    return checks


def _memory_check(smi, profile):
    by_chip = {(c.npu, c.chip): c for c in smi.chips}
    busy = []
    for p in smi.processes:
        chip = by_chip.get((p.npu, p.chip))
        where = f"device {chip.device}" if chip else f"NPU {p.npu} chip {p.chip}"
        busy.append(f"pid {p.pid} ({p.name or '?'}) holds {p.memory_mb} MB on {where}")
    for c in smi.chips:
        listed = any((p.npu, p.chip) == (c.npu, c.chip) for p in smi.processes)
        if not listed and c.memory_used_mb > _IDLE_CHIP_MB:
            busy.append(f"device {c.device} has {c.memory_used_mb} of {c.memory_total_mb} MB "
                        f"in use with no process listed (another container?)")
    free = [c.memory_total_mb - c.memory_used_mb for c in smi.chips]
    # The plan gives the model usable_bytes minus the runtime's reserve; the idle runtime's
    # own ~1.5 GB comes out of that reserve.
    budget_mb = (profile.usable_bytes - profile.runtime_reserve_bytes) // 2 ** 20
    spread = f"free {min(free)}-{max(free)} MB per chip, the plan's budget {budget_mb} MB"
    if busy:
        return Check("devices.memory", WARN,
                     "; ".join(busy) + f"; {spread}: stop those processes before launching, "
                                       f"or the plan's memory is not there")
    short = [c for c, f in zip(smi.chips, free) if f < budget_mb]
    if short:
        return Check("devices.memory", WARN,
                     f"device {_device_list(c.device for c in short)} has less free than the "
                     f"plan's budget; {spread}: check what holds it, or plan with a shorter "
                     f"--max-len")
    used = [c.memory_used_mb for c in smi.chips]
    return Check("devices.memory", PASS,
                 f"no other process; {min(used)}-{max(used)} MB in use per chip (idle); {spread}")


# ---- Ascend software ----

def read_key_values(path):
    """`key=value` lines of an Ascend version or install-info file."""
    values = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            key, sep, value = line.strip().partition("=")
            if sep:
                values[key.strip()] = value.strip()
    return values


def cann_info_candidates(root):
    arch = platform.machine()
    for variable in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"):
        if os.environ.get(variable):
            yield os.path.join(os.environ[variable], f"{arch}-linux", "ascend_toolkit_install.info")
    yield os.path.join(root, "ascend-toolkit", "latest", f"{arch}-linux",
                       "ascend_toolkit_install.info")
    yield os.path.join(root, "cann", f"{arch}-linux", "ascend_toolkit_install.info")  # CANN 8.5+


def ascend_software_checks(root):
    checks = []
    driver = os.path.join(root, "driver", "version.info")
    if os.path.isfile(driver):
        version = read_key_values(driver).get("Version", "?")
        checks.append(Check("software.driver", PASS, f"NPU driver {version} ({driver})"))
    else:
        checks.append(Check("software.driver", FAIL,
                            f"no {driver}: install the NPU driver package for the card "
                            f"(Ascend-hdk-...-npu-driver_*.run --full), or give --ascend-root "
                            f"if it lives elsewhere"))
    firmware = os.path.join(root, "firmware", "version.info")
    if os.path.isfile(firmware):
        version = read_key_values(firmware).get("Version", "?")
        checks.append(Check("software.firmware", PASS, f"firmware {version} ({firmware})"))
    else:
        checks.append(Check("software.firmware", WARN,
                            f"no {firmware} (a container usually mounts the driver only): "
                            f"`npu-smi info -t board -i N` on the host shows the firmware"))
    info = next((p for p in cann_info_candidates(root) if os.path.isfile(p)), None)
    if info is None:
        checks.append(Check("software.cann", FAIL,
                            f"no ascend_toolkit_install.info under ASCEND_HOME_PATH or {root}: "
                            f"install the CANN toolkit (Ascend-cann-toolkit_*.run --install) and "
                            f"`source {root}/ascend-toolkit/set_env.sh`"))
    else:
        values = read_key_values(info)
        found = f"CANN {values.get('version', '?')} ({info})"
        if os.environ.get("ASCEND_HOME_PATH"):
            checks.append(Check("software.cann", PASS, found))
        else:
            checks.append(Check("software.cann", WARN,
                                f"{found} is installed but ASCEND_HOME_PATH is not set: "
                                f"`source {root}/ascend-toolkit/set_env.sh` in the shell that "
                                f"launches"))
    return checks


def ascend_backend_check():
    """Whether MindSpore's Ascend plugin loads: it needs CANN's libraries on the library path."""
    import ctypes

    try:
        import mindspore
    except ImportError:
        return Check("software.ascend-backend", SKIP, "MindSpore is not installed (see above)")
    plugin = os.path.join(os.path.dirname(mindspore.__file__), "lib", "plugin",
                          "libmindspore_ascend.so.2")
    if not os.path.isfile(plugin):
        return Check("software.ascend-backend", FAIL,
                     f"this MindSpore has no Ascend plugin ({plugin}): install the "
                     f"mindspore wheel from PyPI or hiascend.com, which carries it")
    try:
        ctypes.CDLL(plugin)
    except OSError as e:
        return Check("software.ascend-backend", FAIL,
                     f"MindSpore's Ascend plugin does not load ({str(e).split(': ')[0]}): CANN's "
                     f"libraries are not on LD_LIBRARY_PATH; `source "
                     f"/usr/local/Ascend/ascend-toolkit/set_env.sh` (and nnal's set_env.sh)")
    return Check("software.ascend-backend", PASS, "MindSpore's Ascend plugin loads")


def mindspore_check():
    try:
        version = importlib.metadata.version("mindspore")
    except importlib.metadata.PackageNotFoundError:
        return Check("software.mindspore", FAIL, "MindSpore is not installed: "
                                                 "pip install mindspore==2.10.0")
    return Check("software.mindspore", PASS, f"MindSpore {version}")


def packages_check():
    """The packages msinfer's own metadata requires (install_requires), installed and in range."""
    try:
        requirements = importlib.metadata.requires("msinfer") or []
    except importlib.metadata.PackageNotFoundError:
        return Check("software.packages", WARN, "msinfer is not installed as a package (run from "
                                                "a checkout?): `pip install -e .` installs what "
                                                "it needs")
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip always brings packaging; without it, check presence only
        Requirement = None
    missing, wrong, found = [], [], []
    for text in requirements:
        if "extra ==" in text:
            continue
        name = re.match(r"[A-Za-z0-9_.\-]+", text)[0]
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(text)
            continue
        if Requirement and version not in Requirement(text).specifier:
            wrong.append(f"{name} {version} (needs {text})")
        found.append(name)
    if missing or wrong:
        return Check("software.packages", FAIL,
                     "; ".join(([f"missing {', '.join(missing)}"] if missing else []) + wrong)
                     + ": `pip install -e .` in the msinfer checkout installs them")
    return Check("software.packages", PASS, f"{len(found)} required packages installed")


# ---- launch ----

def environment_check(profile, strategy, rank_table_arg):
    problems = []
    exported = os.environ.get("RANK_TABLE_FILE")
    if exported and not rank_table_arg:
        state = "" if os.path.isfile(exported) else " (the file does not exist)"
        problems.append((FAIL if state else WARN,
                         f"RANK_TABLE_FILE={exported} is exported{state}: msinfer then runs in "
                         f"rank-table mode with it, and MindSpore's own mpirun mode must not see "
                         f"one; `unset RANK_TABLE_FILE`, or pass the table with --rank-table"))
    stale = [k for k in ("MS_ROLE", "MS_WORKER_NUM", "MS_SCHED_HOST", "MS_SCHED_PORT")
             if os.environ.get(k)]
    if stale:
        problems.append((FAIL, f"{', '.join(stale)} set in this shell: a process started from "
                               f"it takes itself for an msrun worker and waits for a scheduler; "
                               f"`unset {' '.join(stale)}`"))
    visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    if visible is not None and profile.device_target == "Ascend":
        ids = [v for v in visible.split(",") if v.strip()]
        if strategy is not None and len(ids) < strategy.world_size:
            problems.append((FAIL, f"ASCEND_RT_VISIBLE_DEVICES={visible} shows {len(ids)} "
                                   f"devices but the strategy needs {strategy.world_size}; unset "
                                   f"it or list {strategy.world_size} devices"))
    if not problems:
        return Check("launch.environment", PASS, "no RANK_TABLE_FILE, msrun or device-mask "
                                                 "variable left in the environment")
    worst = FAIL if any(s == FAIL for s, _ in problems) else WARN
    return Check("launch.environment", worst, "; ".join(d for _, d in problems))


def rank_table_check(path, profile, strategy, smi, hccn_conf):
    from ..parallel import ranktable

    if path is None:
        return Check("launch.rank-table", SKIP,
                     "no --rank-table (or RANK_TABLE_FILE): mpirun and msrun launches on one "
                     "server need none")
    world = strategy.world_size if strategy else None
    try:
        problems = ranktable.check_file(path, world_size=world,
                                        devices_per_server=profile.devices_per_server)
    except MsinferError as e:  # unreadable: the table is what is being checked
        return Check("launch.rank-table", FAIL, f"{e}: give an existing table, or `msinfer "
                                                f"ranktable generate` one")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return Check("launch.rank-table", FAIL, f"{problems[0]}{more}: `msinfer ranktable "
                                                f"check {path}` lists them; `msinfer ranktable "
                                                f"generate` writes a fresh one")
    table = ranktable.load(path)
    servers = table["server_list"]
    if len(servers) > 1 and not profile.multi_server:
        return Check("launch.rank-table", FAIL,
                     f"{path} spans {len(servers)} servers but {profile.title} runs collectives "
                     f"on one server only (MindSpore does not initialise HCCL across 310P "
                     f"servers): one server per job")
    if len(servers) == 1:
        server = servers[0]
    else:
        here = ranktable.host_ip()
        server = next((s for s in servers if s["server_id"] == here), None)
        if server is None:
            return Check("launch.rank-table", WARN,
                         f"{path} is valid but this host ({here}) is not one of its servers "
                         f"({', '.join(s['server_id'] for s in servers)}): run doctor on each")
    devices = [int(d["device_id"]) for d in server["device"]]
    if smi is not None:
        shown = {c.device for c in smi.chips}
        absent = [d for d in devices if d not in shown]
        if absent:
            return Check("launch.rank-table", FAIL,
                         f"{path}: device {_device_list(absent)} is not a chip npu-smi shows "
                         f"(devices {_device_list(shown)}): regenerate it with `msinfer "
                         f"ranktable generate {_device_list(shown).replace(', ', ',')}`")
    if len(servers) > 1:
        problem = _hccn_problem(server, hccn_conf)
        if problem:
            return Check("launch.rank-table", problem[0], problem[1])
    return Check("launch.rank-table", PASS,
                 f"{path}: {sum(len(s['device']) for s in servers)} ranks on {len(servers)} "
                 f"server(s), devices {_device_list(devices)} here")


def _hccn_problem(server, hccn_conf):
    """The device IPs of this server's entry against /etc/hccn.conf (multi-server tables)."""
    from ..parallel import ranktable

    devices = [int(d["device_id"]) for d in server["device"]]
    if not os.path.isfile(hccn_conf):
        return (WARN, f"no {hccn_conf}: the device IPs of the table cannot be checked here; "
                      f"`hccn_tool -i N -ip -g` shows each device's address")
    try:
        configured = ranktable.read_hccn_conf(hccn_conf, devices)
    except MsinferError as e:
        return (FAIL, f"{e}: configure the device NICs (hccn_tool) before a multi-server job")
    wrong = [f"device {d['device_id']}: table {d.get('device_ip')}, {hccn_conf} "
             f"{configured[int(d['device_id'])]}" for d in server["device"]
             if d.get("device_ip") != configured[int(d["device_id"])]]
    if wrong:
        return (FAIL, "; ".join(wrong) + ": regenerate the table with `msinfer ranktable "
                                         f"generate --hccn-conf {hccn_conf}`")
    return None


def launcher_check(profile):
    found = {name: shutil.which(name) for name in ("mpirun", "msrun")}
    beside = os.path.join(os.path.dirname(sys.executable), "msrun")  # where launch looks too
    found["msrun"] = found["msrun"] or (beside if os.path.exists(beside) else None)
    mpi4py = importlib.util.find_spec("mpi4py") is not None
    have = [n for n, p in found.items() if p]
    if not have:
        return Check("launch.launchers", FAIL, "neither mpirun nor msrun found: install OpenMPI "
                                               "(Debian: openmpi-bin) or MindSpore (brings "
                                               "msrun)")
    if not found["mpirun"]:
        return Check("launch.launchers", WARN, "msrun found, mpirun not: `msinfer launch` "
                                               "defaults to mpirun; install openmpi-bin or use "
                                               "--launcher msrun")
    if profile.device_target == "CPU" and not mpi4py:
        return Check("launch.launchers", FAIL, "mpirun found but mpi4py is not installed: on CPU "
                                               "msinfer joins ranks through it; pip install "
                                               "mpi4py")
    return Check("launch.launchers", PASS, f"{' and '.join(have)} found"
                                           + (", mpi4py installed" if mpi4py else ""))


# ---- model ----

def model_checks(model, strategy, profile):
    from ..config import load_config
    from ..hardware import DTYPE_BYTES, dtype_name
    from ..parallel.strategy import Strategy
    from ..planning.planner import make_plan

    config = load_config(model)
    strategy = strategy or Strategy.default(tensor=1)
    plan = make_plan(config, strategy, profile)
    where = f"{config.source} with {strategy.source} on {profile.name}"
    command = (f"`msinfer plan --model {model} --strategy {strategy.source} --hardware "
               f"{profile.name}`")
    if plan.errors:
        checks = [Check("model.plan", FAIL, f"{plan.errors[0]} ({command} shows the plan)")]
    else:
        worst = max(plan.devices, key=lambda d: d.total_bytes)
        dtype = f"computes in {plan.dtype}: {plan.dtype_reason}"
        fit = (f"FITS: {where}: busiest device {worst.total_bytes / 2 ** 30:.1f} of "
               f"{worst.capacity_bytes / 2 ** 30:.1f} GiB; {dtype}")
        if plan.warnings:
            checks = [Check("model.plan", WARN, f"{fit}; but {plan.warnings[0]}")]
        else:
            checks = [Check("model.plan", PASS, fit)]
    if profile.shared_host_memory:
        checks.append(Check("model.host-memory", SKIP, "on CPU the plan above already counts "
                                                       "this host's memory"))
        return checks
    # Each data replica's ranks read the checkpoint once between them, in its own dtype.
    need = strategy.data * config.num_parameters() * DTYPE_BYTES[dtype_name(config.torch_dtype)]
    available = _mem_available()
    if available is None:
        checks.append(Check("model.host-memory", WARN, f"cannot read {MEMINFO}: make sure "
                                                       f"{need / 2 ** 30:.1f} GiB of host memory "
                                                       f"is free to load the checkpoint"))
    elif available < need:
        checks.append(Check("model.host-memory", FAIL,
                            f"loading needs about {need / 2 ** 30:.1f} GiB of host memory "
                            f"({strategy.data} replica(s) x the checkpoint) but "
                            f"{available / 2 ** 30:.1f} GiB is available: free memory or load "
                            f"fewer replicas per server"))
    else:
        checks.append(Check("model.host-memory", PASS,
                            f"{available / 2 ** 30:.1f} GiB available, loading needs about "
                            f"{need / 2 ** 30:.1f} GiB"))
    return checks


def _mem_available():
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# ---- logs ----

# Known failures: a pattern seen in real plog / device / console logs, and what it means.
LOG_SIGNATURES = (
    ("sdma-copy", re.compile(r"sdma copy error|there is a sdma error|result = 507013|"
                             r"error code is 507013", re.IGNORECASE),
     "a device-to-device (SDMA) copy failed: the 300I Duo has no P2P copy between chips, so "
     "moving a tensor to another device or splitting layers over chips (pipeline) dies here; "
     "run tensor parallelism, whose HCCL collectives work (e.g. strategies/qwen2_tp8.yaml). "
     "If an out-of-memory signature shows too, fix that first: the copy may have lacked memory"),
    ("hccl-timeout", re.compile(r"EI0006|EI0002|Getting socket times out|"
                                r"wait socket establish timeout|Notify register times out"),
     "an HCCL connection or collective timed out: one rank did not arrive (it failed earlier, "
     "started late or hangs); read every rank's first error, check the rank table "
     "(`msinfer doctor --rank-table F`), raise HCCL_CONNECT_TIMEOUT (120 s by default) if "
     "ranks start slowly"),
    ("out-of-memory", re.compile(r"EL0004|Failed to allocate memory|alloc device memory failed|"
                                 r"result = 207001|Out of Memory!!!|out of memory",
                                 re.IGNORECASE),
     "device memory ran out: `msinfer plan` with the engine settings used shows the "
     "budget; lower --kv-cache-memory, --max-prefill-tokens or --max-num-seqs, split over "
     "more chips, and stop other processes on the chips (npu-smi info lists them)"),
    # msinfer's own error (engine/llm_engine.py non_finite_message), on every rank.
    ("non-finite-logits", re.compile(r"non-finite logits"),
     "the model's logits came out NaN or inf and msinfer failed those requests (instead of "
     "answering '!!!!', token 0): in float16 (the 300I Duo's only dtype) Qwen's activations "
     "can overflow 65504; run float32 where the hardware has it, or bfloat16 on a device "
     "that has it (atlas-800i-a2); otherwise check the checkpoint for NaN/inf weights "
     "(docs/engine.md, 'Non-finite logits')"),
)


def log_checks(directory):
    found = {name: [] for name, _, _ in LOG_SIGNATURES}
    scanned = 0
    for base, _, files in os.walk(directory):
        for file_name in sorted(files):
            path = os.path.join(base, file_name)
            try:
                if not os.path.isfile(path) or os.path.getsize(path) > _MAX_LOG_BYTES:
                    continue
                with open(path, encoding="utf-8", errors="replace") as f:
                    scanned += 1
                    for lineno, line in enumerate(f, 1):
                        for name, pattern, _ in LOG_SIGNATURES:
                            if pattern.search(line):
                                found[name].append((path, lineno, line.strip()))
            except OSError:
                continue
    checks = []
    for name, _, meaning in LOG_SIGNATURES:
        hits = found[name]
        if hits:
            path, lineno, line = hits[0]
            files = len({h[0] for h in hits})
            checks.append(Check(f"logs.{name}", FAIL,
                                f"{len(hits)} line(s) in {files} file(s), first "
                                f"{os.path.relpath(path, directory)}:{lineno}: "
                                f"{line[:100]!r}: {meaning}"))
    if not checks:
        checks.append(Check("logs", PASS, f"{scanned} files under {directory}: no known failure "
                                          f"signature (sdma copy, HCCL timeout, out of memory, "
                                          f"non-finite logits)"))
    return checks


# ---- the command ----


def run_checks(args):
    from ..hardware import get_profile
    from ..parallel.strategy import load_strategy

    if args.logs and not os.path.isdir(args.logs):
        raise MsinferError(f"--logs {args.logs}: no such directory")
    strategy = load_strategy(args.strategy) if args.strategy else None
    auto = args.hardware in (None, AUTO)
    smi, smi_failure = (None, None)
    if args.hardware != "cpu":
        smi, smi_failure = run_npu_smi()
    profile = get_profile(detect_hardware(smi) if auto else args.hardware)
    ascend = profile.device_target == "Ascend"

    checks = []
    if not ascend:
        if auto and shutil.which("npu-smi"):
            checks.append(smi_failure)  # an NPU box whose npu-smi fails: say so
        else:
            how = "detected: no npu-smi on PATH" if auto else "given"
            checks.append(Check("devices", SKIP, f"--hardware {profile.name} ({how}): no NPU "
                                                 f"to check"))
    elif smi is None:
        checks.append(smi_failure)
    else:
        checks += device_checks(smi, profile, strategy)

    if ascend:
        checks += ascend_software_checks(args.ascend_root)
    else:
        checks.append(Check("software.ascend", SKIP, f"--hardware {profile.name} needs no "
                                                     f"Ascend driver, firmware or CANN"))
    checks.append(mindspore_check())
    checks.append(ascend_backend_check() if ascend else Check(
        "software.ascend-backend", SKIP, f"--hardware {profile.name} runs MindSpore's "
                                         f"{profile.device_target} backend"))
    checks.append(packages_check())

    rank_table = (args.rank_table or os.environ.get("MSINFER_RANK_TABLE")
                  or os.environ.get("RANK_TABLE_FILE"))
    checks.append(environment_check(profile, strategy, args.rank_table))
    checks.append(rank_table_check(rank_table, profile, strategy, smi, args.hccn_conf))
    checks.append(launcher_check(profile))

    if args.model:
        checks += model_checks(args.model, strategy, profile)
    else:
        checks.append(Check("model", SKIP, "no --model: give one (directory or preset) to plan "
                                           "it on this hardware"))
    if args.logs:
        checks += log_checks(args.logs)
    else:
        checks.append(Check("logs", SKIP, "no --logs: give the plog directory "
                                          "(~/ascend/log) after a failed run"))
    for check in checks:
        if any(check.name.startswith(prefix) for prefix in args.skip):
            check.status, check.detail = SKIP, f"skipped with --skip ({check.detail})"
    return profile, checks


def format_checks(profile, checks):
    width = max(len(c.name) for c in checks)
    lines = [f"msinfer doctor: {profile.title}"]
    lines += [f"{c.status.upper():<5} {c.name:<{width}}  {c.detail}" for c in checks]
    counts = {s: sum(c.status == s for c in checks) for s in (FAIL, WARN, PASS, SKIP)}
    warnings = f"{counts[WARN]} warning" + ("" if counts[WARN] == 1 else "s")
    lines.append(f"{counts[FAIL]} failed, {warnings}, {counts[PASS]} passed, "
                 f"{counts[SKIP]} skipped")
    return "\n".join(lines)


def run(args):
    profile, checks = run_checks(args)
    ok = not any(c.status == FAIL for c in checks)
    if args.json:
        print(json.dumps({"ok": ok, "checks": [dataclasses.asdict(c) for c in checks]},
                         indent=2))
    else:
        print(format_checks(profile, checks))
    return 0 if ok else 1
