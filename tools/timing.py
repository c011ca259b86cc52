"""The benchmarks' one clock."""
import time


def timed(fn) -> float:
    """Seconds that fn() takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
