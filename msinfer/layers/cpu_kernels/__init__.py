"""C++ kernels for MindSpore's CPU backend, where it has no kernel of its own for the job
(an int8-weight product, a product over the routed experts only), run as MindSpore
`Custom` ops of type "aot" inside the compiled graphs.

Each kernel is one source file here (`<name>.cc`), compiled on first use with the host's
g++ (-O3 -march=native: the build is for this processor) into the kernel cache, keyed by
the source, the flags and the processor, so a changed file or another host builds anew.
Ranks of one job ask at once: the first builds under a lock and the others wait for it.

A kernel's C entry points follow MindSpore's aot contract: `int Name(int nparam, void
**params, int *ndims, int64_t **shapes, const char **dtypes, void *stream, void *extra)`
computes, and `std::vector<int64_t> NameInferShape(int *ndims, int64_t **shapes, AotExtra
*extra)` gives the output's shape, so the op works in graphs of dynamic shape too. A kernel
that runs OpenMP threads exports `void SetThreads(int)`: it is given MindSpore's CPU pool
size (parallel.distributed.cpu_threads), so ranks sharing a host share its cores.
"""
import ctypes
import fcntl
import hashlib
import os
import platform
import subprocess
import tempfile
from functools import lru_cache

from ... import hardware, log
from ...config import user_cache_dir
from ...errors import MsinferError
from ...parallel.distributed import cpu_threads

HERE = os.path.dirname(os.path.abspath(__file__))
# MindSpore is built with the old C++ ABI; an aot library that passes std:: types (the
# shape inference returns std::vector) must match it.
FLAGS = ("-std=c++17", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC",
         "-D_GLIBCXX_USE_CXX11_ABI=0")


def cache_root() -> str:
    """$MSINFER_KERNEL_CACHE, else $XDG_CACHE_HOME/msinfer/kernels, else
    ~/.cache/msinfer/kernels."""
    return user_cache_dir("kernels", "MSINFER_KERNEL_CACHE")


def _processor() -> str:
    """What -march=native builds for: the processor's model and flags."""
    fields = hardware.cpuinfo_fields()
    return f"{fields.get('model name', platform.processor())} {fields.get('flags', '')}"


@lru_cache(maxsize=None)
def library(name: str) -> str:
    """The path of kernel `name`'s shared library, built if the cache lacks it."""
    source = os.path.join(HERE, name + ".cc")
    with open(source, "rb") as f:
        text = f.read()
    key = hashlib.sha256(text + repr(FLAGS).encode() + _processor().encode()).hexdigest()[:16]
    path = os.path.join(cache_root(), f"{name}-{key}.so")
    if os.path.exists(path):
        return path
    if not hardware.kernel_compiler_available():
        raise MsinferError(f"building CPU kernel {name}: no {hardware.KERNEL_COMPILER} on this host "
                           "(install g++, or use the float/MindSpore forms)")
    os.makedirs(cache_root(), exist_ok=True)
    # The ranks of a job on one host ask at once: one builds, the others wait and load it.
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed
        if not os.path.exists(path):
            _build(source, path)
    return path


def _build(source, path):
    """g++ on `source` into `path`, by way of a temporary file renamed when whole."""
    log.get().info("building CPU kernel %s into %s (once per processor and source)",
                   os.path.basename(source), os.path.dirname(path))
    fd, partial = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    built = subprocess.run([hardware.KERNEL_COMPILER, *FLAGS, "-o", partial, source],
                           capture_output=True, text=True)
    if built.returncode != 0:
        os.unlink(partial)
        raise MsinferError(f"building CPU kernel {source} failed:\n{built.stderr[-2000:]}")
    os.replace(partial, path)


_OPENED = {}  # path -> ctypes handle: kept open, so MindSpore's dlopen finds the same copy


def share_threads(path):
    """Gives library `path`'s SetThreads, where it has one, MindSpore's CPU pool size."""
    threads = cpu_threads()
    handle = _OPENED.setdefault(path, ctypes.CDLL(path))
    if hasattr(handle, "SetThreads"):
        handle.SetThreads(threads)


def custom_op(name: str, function: str, inputs, out_dtype, also=()):
    """A MindSpore aot Custom op running `function` of kernel `name`, on CPU, with the
    output's shape from the kernel's `<function>InferShape`. `inputs` are the MindSpore
    DataType names of its inputs, e.g. ("F32_Default", "I8_Default"); `out_dtype` the
    output's mindspore dtype; `also`: the function's other formats, (inputs..., output)
    DataType names. MindSpore keeps the first registration of a function's op for the
    process: one made for float16 alone failed a float32 model's compile after it
    ("Unsupported data type"), so every op of a function registers all its formats."""
    from mindspore import ops
    from mindspore.ops import CustomRegOp, DataType

    reg = CustomRegOp(function)
    for i in range(len(inputs)):
        reg = reg.input(i, f"x{i}")
    reg = reg.output(0, "y")
    out_name = {"Float32": "F32_Default", "Int32": "I32_Default",
                "Float16": "F16_Default"}[str(out_dtype)]
    for names in ((*inputs, out_name), *also):
        reg = reg.dtype_format(*(getattr(DataType, t) for t in names))
    info = reg.target("CPU").get_op_info()
    share_threads(library(name))
    return ops.Custom(f"{library(name)}:{function}", out_shape=None, out_dtype=out_dtype,
                      func_type="aot", reg_info=info)
