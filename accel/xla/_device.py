"""The XLA device, replication bookkeeping and the random-number state."""
from __future__ import annotations

import torch

from accel.utils.xla import is_xla_device, require_xla, xla_available

# (device, devices) given to the last set_replication call; TorchAcc scripts call it once.
_replication: tuple[torch.device, tuple[torch.device, ...]] | None = None


def xla_device(n: int | None = None) -> torch.device:
    """This process's XLA device (the n-th one when several are visible)."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise ValueError(f"n must be None or a non-negative int, got {n!r}")
    torch_xla = require_xla("accel.xla.xla_device()")
    if hasattr(torch_xla, "device"):
        return torch_xla.device(n)
    import torch_xla.core.xla_model as xm

    return xm.xla_device(n)


def _as_device(value, name: str) -> torch.device:
    try:
        return torch.device(value)
    except (TypeError, RuntimeError) as exc:
        raise ValueError(f"{name} must be a torch.device or a device string, got {value!r}") from exc


def set_replication(device, devices) -> None:
    """Declare the devices this process replicates over (TorchAcc: ``set_replication(d, [d])``)."""
    dev = _as_device(device, "device")
    if not isinstance(devices, (list, tuple)):
        raise ValueError(f"devices must be a list of devices, got {type(devices).__name__}")
    devs = tuple(_as_device(d, "devices[i]") for d in devices)
    if devs and dev not in devs:
        raise ValueError(f"devices must contain device {dev}, got {[str(d) for d in devs]}")
    global _replication
    if is_xla_device(dev):
        require_xla("accel.xla.set_replication()")
        import torch_xla.core.xla_model as xm

        xm.set_replication(dev, list(devs))
    _replication = (dev, devs)


def get_replication() -> tuple[torch.device, tuple[torch.device, ...]] | None:
    return _replication


def set_rng_state(seed: int, device=None) -> None:
    """Seed torch and the XLA generator so every worker initialises the model identically."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if device is not None and not is_xla_device(_as_device(device, "device")):
        raise ValueError(f"device must be an XLA device or None, got {device!r}")
    torch.manual_seed(seed)
    if xla_available():
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(seed, None if device is None else str(device))
    elif device is not None:
        require_xla("accel.xla.set_rng_state(device=...)")


def get_rng_state(device=None) -> int:
    """The XLA generator's current seed."""
    if device is not None and not is_xla_device(_as_device(device, "device")):
        raise ValueError(f"device must be an XLA device or None, got {device!r}")
    require_xla("accel.xla.get_rng_state()")
    import torch_xla.core.xla_model as xm

    return int(xm.get_rng_state(None if device is None else str(device)))
