"""torch_xla, optional: every accel module imports without it; calls that need it say so."""
from __future__ import annotations

import functools
import importlib.util

import torch

INSTALL_HINT = "pip install 'accel[xla]' (torch_xla 2.9 needs torch 2.9.0)"


@functools.cache
def xla_available() -> bool:
    try:
        return importlib.util.find_spec("torch_xla") is not None
    except (ImportError, ValueError):  # a broken install or an import hook that refuses it
        return False


def require_xla(feature: str):
    """Import and return torch_xla, or raise a RuntimeError telling the user how to get it."""
    if not xla_available():
        raise RuntimeError(f"{feature} needs torch_xla, which is not installed: {INSTALL_HINT}")
    import torch_xla

    return torch_xla


def is_xla_device(device) -> bool:
    if device is None:
        return False
    return torch.device(device).type == "xla"


def is_xla_tensor(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "xla"


def mark_step() -> None:
    """Cut the lazy graph and run it (torch_xla.sync); a no-op without torch_xla."""
    if xla_available():
        import torch_xla

        torch_xla.sync()


def xla_on_cpu_client() -> bool:
    """Whether torch_xla is set to run on its CPU client (PJRT_DEVICE=CPU): same CPU, same native dtypes."""
    import os

    return os.environ.get("PJRT_DEVICE", "").upper() == "CPU"


def xla_on_accelerator() -> bool:
    """Whether torch_xla would run on an accelerator (TPU, ...): PJRT_DEVICE names one, or it is unset and
    libtpu is installed (torch_xla then picks the TPU by itself)."""
    import os

    if os.environ.get("PJRT_DEVICE"):
        return not xla_on_cpu_client()
    return importlib.util.find_spec("libtpu") is not None
