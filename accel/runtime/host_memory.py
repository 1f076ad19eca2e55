"""Freed CPU memory kept for reuse, so that large tensors stop costing page faults every step.

glibc's malloc serves every block above its mmap threshold (which it lets grow to 32 MiB at most) with a
fresh mmap and gives it back with munmap when it is freed. A training step on the CPU frees and re-creates
its large tensors every step (BERT's 3072-wide activations, attention scores, their gradients), so each one
is new memory that the kernel faults in and zeroes page by page, every step. On a 2-core AMD EPYC (glibc
2.36) `x * 2` on 38.5 MB took 10.3 ms that way and 2.0-2.6 ms with the freed memory kept; an eager fp32
4-layer BERT-base training step at batch 16 x 512 took 12.8-14.7 s against 9.5-9.9 s
(benchmarks/host_memory.py), and accelerate()'s compiled bf16 BERT-base step at 16 x 512 10.7-11.1 s against
6.2-6.7 s (benchmarks/results/host_memory_cpu_accel_16x512.json).

keep_freed_memory() makes torch's CPU allocations of MIN_BYTES or more go through accel's caching allocator
(csrc/cpu/host_memory.cpp): such a block is a mapping of its own, kept when its tensor is freed, and a later
allocation of its size (or up to an eighth smaller) takes it back, already faulted in. Smaller blocks stay with
malloc. What the allocator keeps is bounded: on a miss it unmaps the least recently kept blocks that would take it
past a quarter above the peak of its live blocks, so shapes that change every step cost page faults, not memory
without end. Static shapes (bucketing, packing) keep the sizes recurring. The setting is the whole process's, from
the call on; accelerate() makes it for models that run on the CPU (Config.memory.keep_freed_memory, on by
default). Where another allocator is preloaded (jemalloc, tcmalloc, mimalloc, which keep freed memory their own
way) it changes nothing and returns False.

Before (sessions up to 36) glibc kept the memory itself (mallopt: M_MMAP_MAX 0, no trimming): the same speed,
but large blocks then lived in malloc's heap among small ones, which settled inside freed large blocks, so that the
next large block no longer fit and the heap grew: a packed Llama's CPU training steps over rows of differing
samples (per-sample attention, whose temporaries change size with the samples) grew the process by 250-750 MB a
step, without end (2.5 to 6.8 GB over 12 steps; 3.3 GB steady with the same row every step).
"""
from __future__ import annotations

import ctypes
import functools
import warnings

# Blocks of at least this many bytes go through accel's allocator: every tensor whose page faults cost
# (a 1 MiB block is 256 pages), while malloc keeps the small ones its heap serves well.
MIN_BYTES = 1 << 20
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")

_kept = False
_build_error: str | None = None  # why accel's allocator could not be built, once: not retried by every call


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc's (it has gnu_get_libc_version), else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  (AttributeError elsewhere: musl, macOS, Windows)
        libc.malloc_trim
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


def _ops():
    from accel.runtime import _build

    return _build.ops("host_memory")


def keep_freed_memory() -> bool:
    """Keep the memory of freed CPU tensors of MIN_BYTES or more for reuse (accel's caching allocator).

    Returns:
        bool: True when torch's CPU allocations now go through it (also when an earlier call installed it);
        False where another allocator is preloaded, or accel's could not be built or installed (nothing is
        changed then; a warning says why the build failed).
    """
    global _kept, _build_error
    if _kept:
        return True
    if _build_error is not None or _preloaded_allocator() is not None:
        return False
    try:
        ops = _ops()
    except Exception as error:  # no compiler here: the model runs as before, on malloc alone
        _build_error = str(error)
        warnings.warn(f"keep_freed_memory: accel's host allocator could not be built ({error}); freed CPU memory "
                      "is left to malloc", stacklevel=2)
        return False
    _kept = bool(ops.host_memory_install(MIN_BYTES))
    return _kept


def kept_memory_stats() -> dict[str, int]:
    """What accel's host allocator holds: mapped_bytes (its live and kept blocks), kept_bytes (freed, kept for
    reuse), hits and misses (allocations served from a kept block or newly mapped), peak_live_bytes (the most its
    live blocks ever held at once), min_bytes; zeros before keep_freed_memory() installed it."""
    names = ("mapped_bytes", "kept_bytes", "hits", "misses", "peak_live_bytes", "min_bytes")
    if not _kept:
        return dict.fromkeys(names, 0)
    return dict(zip(names, _ops().host_memory_stats()))


def return_freed_memory() -> bool:
    """Hand freed memory back to the system now: the blocks accel's allocator keeps, and malloc's free memory
    (glibc's malloc_trim): between phases of different sizes, where what one phase freed would otherwise stay
    mapped (a benchmark's next row, say). Returns whether any was released."""
    released = _kept and _ops().host_memory_release() > 0
    libc = _glibc()
    return (libc is not None and libc.malloc_trim(0) == 1) or released
