"""A faster batch-1 matmul for MindSpore's CPU backend, built from source on first use.

Batch-1 decode reads every weight once per token, so it runs at the speed the matmul kernel
streams weights. MindSpore's CPU MatMul(transpose_b=True) streams a (1, in) x (out, in)^T
product at 10-13 GB/s on this project's machines where numpy's GEMV reaches about 30;
kernels/row_matmul.cc reaches about twice MindSpore's where out >= in (q/o/gate/up
projections, lm_head). It is compiled with the system's g++ into a per-user cache; without a
compiler msinfer keeps MindSpore's MatMul and says so once.
"""
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile

from . import log

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels", "row_matmul.cc")


def _cache_dir():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "msinfer")


@functools.lru_cache(maxsize=None)
def row_matmul_library():
    """Path of the compiled kernel, or None when it cannot be built here."""
    if os.environ.get("MSINFER_NO_CPU_KERNELS"):
        return None
    compiler = shutil.which("g++")
    if compiler is None:
        log.get().info("no g++: batch-1 matmuls use MindSpore's CPU MatMul")
        return None
    with open(_SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    target = os.path.join(_cache_dir(), f"row_matmul-{digest}.so")
    if not os.path.exists(target):
        os.makedirs(_cache_dir(), exist_ok=True)
        fd, scratch = tempfile.mkstemp(suffix=".so", dir=_cache_dir())
        os.close(fd)
        build = [compiler, "-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC", "-pthread", "-o",
                 scratch, _SOURCE]
        done = subprocess.run(build, capture_output=True, text=True)
        if done.returncode != 0:
            os.unlink(scratch)
            log.get().info("building %s failed, batch-1 matmuls use MindSpore's: %s", _SOURCE,
                           done.stderr.strip()[-500:])
            return None
        os.replace(scratch, target)  # atomic: ranks building at once do not collide
    return target


def set_threads(threads):
    """OpenMP threads of the kernel (the rank's share of the host's cores)."""
    library = row_matmul_library()
    if library:
        ctypes.CDLL(library).msinfer_set_threads(int(threads))


def row_matmul():
    """A Custom primitive computing (1, in) x (out, in)^T, or None without the kernel."""
    library = row_matmul_library()
    if library is None:
        return None
    from mindspore import ops
    return ops.Custom(library + ":RowMatMul", out_shape=lambda x, w: (x[0], w[0]),
                      out_dtype=lambda x, w: x, func_type="aot")
