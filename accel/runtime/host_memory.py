"""Freed CPU memory kept for reuse, so that large tensors stop costing page faults every step.

glibc's malloc serves every block above its mmap threshold (which it lets grow to 32 MiB at most) with a
fresh mmap and gives it back with munmap when it is freed. A training step on the CPU frees and re-creates
its large tensors every step (BERT's 3072-wide activations, attention scores, their gradients), so each one
is new memory that the kernel faults in and zeroes page by page, every step. On a 2-core AMD EPYC (glibc
2.36) `x * 2` on 38.5 MB took 10.3 ms that way and 2.0-2.6 ms with the freed memory kept; an eager fp32
4-layer BERT-base training step at batch 16 x 512 took 12.8-14.7 s against 9.5-9.9 s
(benchmarks/host_memory.py), and accelerate()'s compiled bf16 BERT-base step at 16 x 512 10.7-11.1 s against
6.2-6.7 s (benchmarks/results/host_memory_cpu_accel_16x512.json).

keep_freed_memory() sets two of glibc's malloc options (mallopt): large blocks come from the heap like small
ones (M_MMAP_MAX = 0), and freed heap memory is not handed back to the system (M_TRIM_THRESHOLD at its
largest, 2 GiB free at the top of the heap), so after the first steps every tensor of a step reuses memory
that is already mapped. The price: the process keeps its heap at its peak, as jemalloc and tcmalloc (the
allocators PyTorch's CPU performance guides preload) also do, and freed blocks of other sizes fragment it:
that BERT step's peak RSS rose 5% (6.7 to 7.1 GB), while a synthetic loop of ever-changing sizes held 1.7 GB
for 0.2 GB live. Static shapes (bucketing, packing) keep the sizes recurring; where shapes change every
step, measure, or switch it off. The setting is the whole process's, from the call on; accelerate() makes it
for models that run on the CPU (Config.memory.keep_freed_memory, on by default). Where malloc is not glibc's
(another C library, or jemalloc / tcmalloc / mimalloc preloaded, which manage memory their own way) it
changes nothing and returns False.
"""
from __future__ import annotations

import ctypes
import functools

# glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")

_kept = False


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc's (it has gnu_get_libc_version), else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  (AttributeError elsewhere: musl, macOS, Windows)
        libc.mallopt
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def _preloaded_allocator() -> str | None:
    """The name of a malloc replacement mapped into this process (jemalloc, tcmalloc, mimalloc), if any."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return None
    return next((name for name in _OTHER_ALLOCATORS if name in maps), None)


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse: no mmap for large blocks, no trimming of the heap.

    Returns:
        bool: True when glibc now keeps freed memory (also when an earlier call set it); False where this
        process's malloc is not glibc's or another allocator replaces it (nothing is changed then).
    """
    global _kept
    if _kept:
        return True
    libc = _glibc()
    if libc is None or _preloaded_allocator() is not None:
        return False
    # mallopt returns 1 on success; the mmap limit first: blocks already mapped are unaffected either way
    _kept = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _INT_MAX) == 1
    return _kept


def return_freed_memory() -> bool:
    """Hand the heap's free memory back to the system now (glibc's malloc_trim), also after
    keep_freed_memory(): between phases of different sizes, where what one phase freed would otherwise
    stay mapped (a benchmark's next row, say). Returns whether glibc released any; False elsewhere."""
    libc = _glibc()
    return libc is not None and libc.malloc_trim(0) == 1
