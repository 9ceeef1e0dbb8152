"""The machine a benchmark ran on, and its load: one record every bench/ script writes beside
its figures, as "machine" in its JSON.

    record = machine_record()          # when measuring starts
    ...                                # the measurements
    record_load_at_end(record)         # when they end

Load averages: the 1, 5 and 15-minute figures of /proc/loadavg, to its 2 decimals.
"""
import importlib.metadata
import os
import platform
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def machine_record():
    """The CPU, cores, RAM, Python, numpy / MindSpore as installed, msinfer's commit and the
    load average now (`load_average_at_start`)."""
    record = {"platform": platform.platform(), "python": platform.python_version(),
              "cores": os.cpu_count(),
              "cpu": _cpu_model() or platform.processor() or platform.machine(),
              "ram_bytes": _ram_bytes(), "commit": _commit()}
    for package in ("numpy", "mindspore"):
        try:  # the installed version, read without importing it (MindSpore takes seconds)
            record[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    record["load_average_at_start"] = _load_average()
    return record


def record_load_at_end(record):
    """`record` with the load average now as its `load_average_at_end`."""
    record["load_average_at_end"] = _load_average()
    return record


def _load_average():
    return [round(x, 2) for x in os.getloadavg()]


def _cpu_model():
    """/proc/cpuinfo's first "model name". Read here, not by msinfer.hardware.cpuinfo_fields:
    importing msinfer sets OMP_WAIT_POLICY, which torch and the processes a script starts
    would then inherit (msinfer/__init__.py)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return None


def _ram_bytes():
    try:
        with open("/proc/meminfo") as f:  # its first line: "MemTotal: N kB"
            return int(f.readline().split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        return None


def _commit():
    """msinfer's short commit, "" outside a git checkout."""
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""
