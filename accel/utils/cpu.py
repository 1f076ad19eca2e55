"""What this CPU computes natively: bf16 is fast only with AMX or AVX512-BF16.

The development machines differ: on an AMD EPYC without AVX-512, bf16 autocast made a BERT step 37x
slower than fp32 (every bf16 op is emulated through fp32 conversions), while a CPU with AMX-bf16 runs
it faster than fp32. So precision on the CPU is chosen by asking the CPU, never assumed.
"""
from __future__ import annotations

import functools
import warnings

_CPUINFO_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
_warned: set[str] = set()


def _torch_says_bf16() -> bool | None:
    """torch's own CPUID probes (private, so looked up defensively); None when it has none."""
    import torch

    probes = [getattr(torch._C._cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    probes = [p for p in probes if p is not None]
    if not probes:
        return None
    return any(bool(p()) for p in probes)


def _cpuinfo_says_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return any(flag in flags for flag in _CPUINFO_BF16_FLAGS)
    except OSError:
        pass
    return False


@functools.cache
def native_bf16() -> bool:
    """True when this CPU has bf16 arithmetic in hardware (AVX512-BF16 or AMX)."""
    from_torch = _torch_says_bf16()
    return _cpuinfo_says_bf16() if from_torch is None else from_torch


def warn_emulated_bf16(what: str, stacklevel: int = 3) -> None:
    """Warn once per `what` that bf16 on this CPU is emulated (and many times slower than fp32).
    stacklevel: as warnings.warn's, counted from the caller of this function's caller (the default points
    at whoever called that caller)."""
    if what in _warned:
        return
    _warned.add(what)
    warnings.warn(f"{what}: this CPU has no native bf16 (no AMX or AVX512-BF16); bf16 is emulated there and "
                  "typically tens of times slower than fp32", RuntimeWarning, stacklevel=stacklevel)
