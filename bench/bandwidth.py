"""This machine's streaming memory bandwidth, measured with numpy (the decode bound).

Three probes on arrays far larger than the caches, each the best of several runs:
- gemv: float32 matrix (rows x cols) times a vector through numpy's BLAS, the same access
  pattern as a batch-1 decode step (each weight read once); bytes = the matrix;
- read: a sum over a large array in each of `threads` Python threads (numpy releases the
  GIL); bytes = the array;
- copy: np.copyto of a large array, split over `threads` threads; bytes = read + write.
`limit_gbs` is the highest of the three: the bound used for "fraction of the limit".

Run as a script it prints one JSON object; bench/run.py starts it as its own process with
OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset (they select an old, slower kernel) and records
which BLAS kernel ran (threadpoolctl).
"""
import json
import os
import sys
import threading
import time

import numpy as np

GiB = 1024 ** 3


def best_seconds(fn, repeats):
    fn()  # first touch: page faults, thread start-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def in_threads(fn, parts):
    threads = [threading.Thread(target=fn, args=(part,)) for part in parts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def measure(size_bytes=GiB, repeats=5, threads=None):
    threads = threads or os.cpu_count()
    n = size_bytes // 4
    cols = 4096
    matrix = np.random.default_rng(0).standard_normal((n // cols, cols), np.float32)
    vector = np.ones(cols, np.float32)
    gemv = best_seconds(lambda: matrix @ vector, repeats)

    flat = matrix.reshape(-1)
    read_parts = np.array_split(flat, threads)
    read = best_seconds(lambda: in_threads(np.sum, read_parts), repeats)

    target = np.empty_like(flat)
    pairs = list(zip(np.array_split(target, threads), read_parts))
    copy = best_seconds(lambda: in_threads(lambda p: np.copyto(p[0], p[1]), pairs), repeats)

    figures = {"gemv_gbs": matrix.nbytes / gemv / 1e9,
               "read_gbs": flat.nbytes / read / 1e9,
               "copy_gbs": 2 * flat.nbytes / copy / 1e9}
    return dict(figures, limit_gbs=max(figures.values()), array_bytes=int(flat.nbytes),
                threads=threads, repeats=repeats)


def blas_info():
    """Which BLAS library and kernel numpy ran (threadpoolctl), and the OpenBLAS variables
    this process saw."""
    info = {"OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"),
            "OPENBLAS_L2_SIZE": os.environ.get("OPENBLAS_L2_SIZE")}
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        info["threadpoolctl"] = "not installed (pip install -e .[bench])"
        return info
    info["libraries"] = [{k: lib.get(k) for k in ("internal_api", "version", "architecture",
                                                   "num_threads", "threading_layer")}
                         for lib in threadpool_info() if lib.get("user_api") == "blas"]
    return info


def main():
    size = GiB // 4 if "--quick" in sys.argv else GiB
    print(json.dumps(dict(measure(size), blas=blas_info())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
