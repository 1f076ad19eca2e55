"""The one timer of accel's probes, which decide between two ways of computing by running both on this machine."""
from __future__ import annotations

import time


def best_time(call, repeats: int = 3) -> float:
    """The shortest of `repeats` timed calls of `call()` in seconds, after one untimed call (in which libraries
    create their primitives and buffers)."""
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best
