"""Compiled graphs kept on disk, so that a restart of the same job loads its warm-up graphs
instead of compiling them (what it saves: bench/README.md, "Start-up and the compile cache").

MindSpore's compile cache (`enable_compile_cache`) files graphs by the order they compile
in: the n-th graph compiled with it on, in the process, is `compile_cache_n.mindir`, with
no check that it is the graph asked for. Measured on MindSpore 2.10 (CPU): the same cache
read by a model of another hidden size returned NaN logits; the same shapes compiled in
reverse order failed in a Reshape. Three rules make it safe:
- one directory per job configuration: a key over everything that changes a graph or its
  order (the model's config and weight files, the plan and this rank, the dtype, the engine
  limits that make the shapes, the processor, msinfer's source, MindSpore's version and
  CANN's and the driver's version files); the weights by their bytes, not their file times;
- the cache is on only while warm-up compiles its shapes, always in the same order; graphs
  compiled before (the job seed's collective) or after (lazy compiles) never touch it;
- once per process: MindSpore's count goes on across sessions and cannot be reset, so a
  second warm-up in the same process (a second LLM) compiles without the cache.

An entry is complete once its manifest is written, after a warm-up that finished; one
without (a warm-up that died) is emptied and rebuilt. MindSpore compiles again any graph
file it cannot read; warm-up notices the files rewritten and says so. A second process of
the same configuration finds the entry locked and compiles without it.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import shutil
import time
from contextlib import contextmanager

from .. import log
from ..config import user_cache_dir
from ..hardware import cpuinfo_fields

MANIFEST = "manifest.json"
_used_in_process = False  # MindSpore numbers cached graphs per process, from the first


def default_root() -> str:
    """$MSINFER_COMPILE_CACHE, else $XDG_CACHE_HOME/msinfer/compile, else
    ~/.cache/msinfer/compile."""
    return user_cache_dir("compile", "MSINFER_COMPILE_CACHE")


def _processor() -> str:
    """The CPU model: explicit mode picks matmul forms per processor (layers/cpu_forms.py)."""
    return cpuinfo_fields().get("model name") or platform.processor() or platform.machine()


_source_digest = None


def source_digest() -> str:
    """sha256 over msinfer's own .py files: any code change may change a graph."""
    global _source_digest
    if _source_digest is None:
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        digest = hashlib.sha256()
        for folder, dirs, files in sorted(os.walk(package)):
            dirs.sort()
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    digest.update(os.path.relpath(path, package).encode())
                    with open(path, "rb") as f:
                        digest.update(f.read())
        _source_digest = digest.hexdigest()
    return _source_digest


_SAMPLES = 16  # blocks read from each weight file for its fingerprint
_SAMPLE_BYTES = 1 << 20


def weight_files(model_dir: str) -> list:
    """(name, size, fingerprint) of the checkpoint's weight and config files: a graph may
    hold weights (semi_auto's Parameters), so other weights of the same shape get their own
    entry. The fingerprint reads the bytes, not the file times (a copy without its times keys
    the same entry): the whole of a small file, 16 spread 1 MiB blocks of a large one (the
    safetensors header among them), so a start reads at most 16 MiB per file."""
    found = []
    for name in sorted(os.listdir(model_dir)):
        if name.endswith((".safetensors", ".bin", ".json")):
            path = os.path.join(model_dir, name)
            found.append([name, os.path.getsize(path), _fingerprint(path)])
    return found


def _fingerprint(path: str) -> str:
    size = os.path.getsize(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= _SAMPLES * _SAMPLE_BYTES:
            digest.update(f.read())
        else:
            for i in range(_SAMPLES):
                f.seek((size - _SAMPLE_BYTES) * i // (_SAMPLES - 1))
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()


# CANN's version files, under its toolkit directory ($ASCEND_HOME_PATH): a graph compiled by
# one compiler and runtime is not to be loaded by another
_CANN_VERSION_FILES = ("version.cfg", "compiler/version.info", "runtime/version.info",
                       "opp/version.info")
_DRIVER_VERSION = "/usr/local/Ascend/driver/version.info"


def cann_versions() -> dict:
    """The contents of the CANN toolkit's and the driver's version files found ({} on a
    machine without CANN)."""
    home = (os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME")
            or "/usr/local/Ascend/ascend-toolkit/latest")
    found = {}
    for path in [os.path.join(home, name) for name in _CANN_VERSION_FILES] + [_DRIVER_VERSION]:
        try:
            with open(path, errors="replace") as f:
                found[path] = f.read().strip()
        except OSError:
            pass
    return found


def cache_key(material: dict) -> dict:
    """Everything the key covers: `material` (the job's configuration) plus the versions
    (msinfer's source, MindSpore, Python, CANN and the driver) and the machine."""
    import mindspore as ms
    return dict(material, msinfer_source=source_digest(),
                mindspore=ms.__version__, python=platform.python_version(),
                cann=cann_versions(), processor=_processor())


class CompileCache:
    """One job configuration's directory under `root`, used around warm-up (`session`)."""

    def __init__(self, root: str, material: dict):
        self.material = cache_key(material)
        text = json.dumps(self.material, sort_keys=True, default=str)
        self.key = hashlib.sha256(text.encode()).hexdigest()[:20]
        self.root = root
        self.path = os.path.join(root, self.key)

    def _graph_files(self) -> dict:
        files = {}
        for folder, _, names in os.walk(self.path):
            for name in names:
                if name.endswith(".mindir"):
                    stat = os.stat(os.path.join(folder, name))
                    files[os.path.join(folder, name)] = (stat.st_size, stat.st_mtime_ns)
        return files

    @contextmanager
    def session(self):
        """Turns MindSpore's compile cache on, in this entry, for the body (warm-up); yields
        "load" (a complete entry), "fill" (an empty one) or None (off: the entry is in use,
        unusable, or this process used the cache before). Writes the manifest when the body
        finishes."""
        lock = self._lock()
        if lock is None:
            yield None
            return
        with lock:
            manifest = os.path.join(self.path, MANIFEST)
            complete = os.path.isfile(manifest)
            if not complete:
                self._clear_unfinished()
            before = self._graph_files()
            log.get().info("compile cache: %s %s", "loading from" if complete else "filling",
                           self.path)
            with _mindspore_cache(self.path):
                yield "load" if complete else "fill"
            after = self._graph_files()
            if complete:
                self._report_recompiled(before, after)
            with open(manifest + ".tmp", "w") as f:
                json.dump(dict(self.material, graphs=len(after), written=time.time()), f,
                          indent=1, sort_keys=True, default=str)
            os.replace(manifest + ".tmp", manifest)

    def _lock(self):
        """This entry's lock file, opened and locked for this process; None (said in the
        log) when the cache cannot be used: used in this process before, an entry script
        MindSpore cannot read, a directory that cannot be written, or another process's."""
        global _used_in_process
        logger = log.get()
        if _used_in_process:
            logger.info("compile cache: used once in this process already (MindSpore numbers "
                        "its graphs per process): compiling without it")
            return None
        _used_in_process = True
        from mindspore.graph import api
        entry = api.entry_script_path  # MindSpore reads it (and its imports) at each compile
        if entry is not None and not os.path.isfile(entry):
            logger.info("compile cache: the entry script %s is not a file (python -c, a "
                        "notebook): compiling without it", entry)
            return None
        try:
            os.makedirs(self.path, exist_ok=True)
            lock = open(os.path.join(self.path, ".lock"), "w")
        except OSError as e:
            logger.warning("compile cache %s unusable (%s): compiling without it", self.path,
                           e.strerror)
            return None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            logger.warning("compile cache %s is in use by another process: compiling "
                           "without it", self.path)
            return None
        return lock

    def _clear_unfinished(self):
        """Empty an entry that has graphs but no manifest (its warm-up did not finish)."""
        if not self._graph_files():
            return
        log.get().warning("compile cache %s: an entry without its manifest (a warm-up that "
                          "did not finish): rebuilding it", self.path)
        for name in os.listdir(self.path):
            if name != ".lock":
                target = os.path.join(self.path, name)
                (shutil.rmtree if os.path.isdir(target) else os.remove)(target)

    def _report_recompiled(self, before, after):
        """Log the graphs of a complete entry that MindSpore compiled again (unreadable or
        stale: their files changed) or compiled anew (missing)."""
        rebuilt = [p for p, stamp in before.items() if after.get(p) != stamp]
        if rebuilt:
            log.get().warning("compile cache %s: %d of %d graphs were unreadable or stale and "
                              "were compiled again", self.path, len(rebuilt), len(before))
        elif len(after) > len(before):
            log.get().warning("compile cache %s: %d graphs were missing and were compiled",
                              self.path, len(after) - len(before))


@contextmanager
def _mindspore_cache(path):
    """MindSpore's compile cache on, in `path`, for the body."""
    import mindspore as ms

    ms.set_context(enable_compile_cache=True, compile_cache_path=path)
    try:
        yield
    finally:
        ms.set_context(enable_compile_cache=False)
