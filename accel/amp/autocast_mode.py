"""accel.amp.autocast: torch.autocast with a default device and dtype.

Default device (when ``device_type`` is None), checked in this order:
  1. "xla"  when torch_xla is importable and the PJRT_DEVICE environment variable is set
            (that variable is what selects a PJRT device for torch_xla);
  2. "cuda" when torch.cuda.is_available();
  3. "cpu".
Default dtype: bfloat16 on xla and cpu, float16 on cuda (pass dtype=torch.bfloat16 for bf16).
``autocast()`` with no dtype on a CPU without native bf16 (no AMX or AVX512-BF16; accel.utils.cpu)
warns once: there bf16 is emulated and many times slower than fp32. The XLA CPU client runs on the
same CPU, so the warning covers xla on PJRT_DEVICE=CPU too.

On XLA this is ``torch.autocast("xla", ...)`` directly: torch_xla.amp.autocast only acts
on TPU/Neuron and ignores autocast on the PJRT CPU device, whereas the core "xla" autocast
key casts matmuls to bf16 on every PJRT device.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from accel.utils.cpu import native_bf16, warn_emulated
from accel.utils.xla import require_xla, xla_available, xla_on_cpu_client

_DEFAULT_DTYPE = {"xla": torch.bfloat16, "cpu": torch.bfloat16, "cuda": torch.float16}


@torch.compiler.assume_constant_result  # inside a compiled region: a constant, not a graph break
def default_device_type() -> str:
    """The device type autocast() uses when none is given (see the module docstring)."""
    if xla_available() and os.environ.get("PJRT_DEVICE"):
        return "xla"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def default_dtype(device_type: str) -> torch.dtype:
    if device_type in _DEFAULT_DTYPE:
        return _DEFAULT_DTYPE[device_type]
    return torch.get_autocast_dtype(device_type)


def _autocast_available(device_type: str) -> bool:
    check = getattr(torch.amp.autocast_mode, "is_autocast_available", None)
    return True if check is None else bool(check(device_type))


def _device_type_of(device_type) -> str:
    if device_type is None:
        return default_device_type()
    if isinstance(device_type, torch.device):
        return device_type.type
    if isinstance(device_type, str):
        try:
            return torch.device(device_type).type
        except RuntimeError as e:
            raise ValueError(f"device_type: expected a device type such as 'xla', 'cuda' or 'cpu', got {device_type!r}") from e
    raise ValueError(f"device_type: expected None, a str or a torch.device, got {type(device_type).__name__}")


def _runs_on_cpu(device_type: str) -> bool:
    if device_type == "cpu":
        return True
    return device_type == "xla" and xla_on_cpu_client()


def autocast(
    device_type: Optional[str] = None,
    dtype: Optional[torch.dtype] = None,
    enabled: bool = True,
    cache_enabled: Optional[bool] = None,
) -> torch.autocast:
    """A mixed-precision region: torch.autocast for the device and dtype the module docstring picks, a
    context manager and a decorator. ``autocast("cuda", dtype=torch.bfloat16)`` is exactly
    ``torch.autocast("cuda", dtype=torch.bfloat16)``.

    A function returning torch.autocast (not a subclass of it): torch.compile traces torch.autocast itself,
    so ``with autocast():`` inside a compiled function or model is part of the graph. There the arguments
    go to torch.autocast unchecked (it checks them itself), without the emulated-bf16 warning.
    """
    device = _device_type_of(device_type)
    if not torch.compiler.is_compiling():
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype: expected None or a torch.dtype, got {dtype!r}")
        if not isinstance(enabled, bool):
            raise ValueError(f"enabled: expected a bool, got {enabled!r}")
        if not _autocast_available(device):
            raise ValueError(f"device_type: autocast does not support device type {device!r}")
        if dtype is None and enabled and _runs_on_cpu(device) and not native_bf16():
            warn_emulated("accel.amp.autocast() defaults to bf16")
        if device == "xla":
            # Registers the XLA backend so the "xla" autocast key has kernels behind it.
            require_xla("accel.amp.autocast on xla")
    return torch.autocast(device, dtype=dtype if dtype is not None else default_dtype(device), enabled=enabled,
                          cache_enabled=cache_enabled)
