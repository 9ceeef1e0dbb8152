"""The probes' timer: the best of several calls, after warm-up calls (which compile)."""
import time


def best_ms(fn, repeats=20, warmup=1):
    """Milliseconds of the fastest of `repeats` calls of fn(), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3
