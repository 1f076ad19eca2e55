"""Argument checks and kernel dispatch shared by the ops in accel.runtime.nn."""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_tensor(name: str, t, *, dtypes=FLOAT_DTYPES, ndim: int | tuple[int, ...] | None = None) -> None:
    """Raise an error naming `name` unless t is a tensor with one of `dtypes` and `ndim` dims: TypeError for
    what is not a tensor or has another dtype, ValueError for another number of dims (accel's one rule,
    as in accel.utils.checks)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: expected dtype in ({allowed}), got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None:
        ok = (ndim,) if isinstance(ndim, int) else ndim
        if t.dim() not in ok:
            raise ValueError(f"{name}: expected {' or '.join(map(str, ok))} dims, got shape {tuple(t.shape)}")


def check_same_device(**tensors) -> None:
    """Raise ValueError naming the first tensor that is not on the device of the first one."""
    items = [(k, v) for k, v in tensors.items() if v is not None]
    if not items:
        return
    name0, t0 = items[0]
    for name, t in items[1:]:
        if t.device != t0.device:
            raise ValueError(f"{name}: expected a tensor on {t0.device} (the device of {name0}), got {t.device}")


def use_kernel(t: torch.Tensor) -> bool:
    """Our C++/CUDA kernels serve CPU and CUDA tensors; any other device (XLA) takes the reference,
    which its compiler fuses. (Two flag reads: every op's per-call fast path asks this.)"""
    return t.is_cpu or t.is_cuda


def use_kernel_eagerly(t: torch.Tensor) -> bool:
    """use_kernel, but not while torch.compile traces: for elementwise ops whose plain reference Inductor
    fuses into the kernels next to it, where our opaque op adds a pass over memory of its own (quick_gelu:
    benchmarks/kernel_cases/quick_gelu.py, compiled rows)."""
    return use_kernel(t) and not torch.compiler.is_compiling()
