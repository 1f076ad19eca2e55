"""What this CPU computes natively: bf16 is fast only with AMX or AVX512-BF16, fp16 only with AVX512-FP16
or AMX-FP16.

The development machines differ: on an AMD EPYC without AVX-512, bf16 autocast made a BERT step 37x
slower than fp32 (every bf16 op is emulated through fp32 conversions), while a CPU with AMX-bf16 runs
it faster than fp32. So precision on the CPU is chosen by asking the CPU, never assumed.
"""
from __future__ import annotations

import functools
import warnings

_CPUINFO_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
_CPUINFO_FP16_FLAGS = ("avx512_fp16", "amx_fp16")  # what torch's fp16 CPU matmuls (oneDNN) need
_warned: set[str] = set()


def _torch_probes(names: tuple[str, ...]) -> bool | None:
    """torch's own CPUID probes (private, so looked up defensively); None when it has none of them."""
    import torch

    probes = [getattr(torch._C._cpu, name, None) for name in names]
    probes = [p for p in probes if p is not None]
    if not probes:
        return None
    return any(bool(p()) for p in probes)


def _cpuinfo_has(wanted: tuple[str, ...]) -> bool:
    """Whether /proc/cpuinfo's flags name any of `wanted` (False where there is no such file)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return any(flag in flags for flag in wanted)
    except OSError:
        pass
    return False


@functools.cache
def native_bf16() -> bool:
    """True when this CPU has bf16 arithmetic in hardware (AVX512-BF16 or AMX)."""
    from_torch = _torch_probes(("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return _cpuinfo_has(_CPUINFO_BF16_FLAGS) if from_torch is None else from_torch


@functools.cache
def native_fp16() -> bool:
    """True when this CPU has fp16 arithmetic in hardware (AVX512-FP16, from Intel's Sapphire Rapids on, or
    AMX-FP16). CPUs with native bf16 may still emulate fp16: on an AMD EPYC with AVX512-BF16 an fp16 matmul
    ran 2.6x slower than fp32 and 6x slower than bf16. torch probes AMX-FP16 only; AVX512-FP16 is read from
    /proc/cpuinfo."""
    return bool(_torch_probes(("_is_amx_fp16_supported",))) or _cpuinfo_has(_CPUINFO_FP16_FLAGS)


def native(dtype_name: str) -> bool:
    """native_bf16() for "bf16", native_fp16() for "fp16"."""
    return {"bf16": native_bf16, "fp16": native_fp16}[dtype_name]()


def warn_emulated(what: str, dtype_name: str = "bf16", stacklevel: int = 3) -> None:
    """Warn once per `what` that `dtype_name` ("bf16" or "fp16") on this CPU is emulated (and many times
    slower than fp32). stacklevel: as warnings.warn's, counted from the caller of this function's caller
    (the default points at whoever called that caller)."""
    if what in _warned:
        return
    _warned.add(what)
    hardware = "AMX or AVX512-BF16" if dtype_name == "bf16" else "AMX-FP16 or AVX512-FP16"
    warnings.warn(f"{what}: this CPU has no native {dtype_name} (no {hardware}); {dtype_name} is emulated there "
                  "and typically many times slower than fp32", RuntimeWarning, stacklevel=stacklevel)
