"""The XLA device, replication bookkeeping and the random-number state."""
from __future__ import annotations

import os
import warnings

import torch

from accel.utils.xla import is_xla_device, require_xla, xla_available

# (device, devices) given to the last set_replication call; TorchAcc scripts call it once.
_replication: tuple[torch.device, tuple[torch.device, ...]] | None = None
_compile_cache_checked = False


def _start_compile_cache(torch_xla) -> None:
    """Start torch_xla's persistent cache in $ACCEL_XLA_COMPILE_CACHE/rank<RANK>, once per process.

    xlarun's worker mode normally sets torch_xla's variables before the script runs; this covers
    workers it cannot wrap (--no-python, --run-path) and other launchers. torch_xla reads the
    variables when it creates its computation cache at the first compile, so after that it is too late.
    """
    global _compile_cache_checked
    if _compile_cache_checked:
        return
    _compile_cache_checked = True
    from accel import launch

    root = os.environ.get(launch.CACHE_ENV)
    if not root:
        return
    wanted = launch.rank_cache_dir(root)
    current = os.environ.get(launch.XLA_CACHE_PATH)
    if current and current != wanted:
        return  # the user's own torch_xla setting
    started = getattr(torch_xla._XLAC, "_xla_computation_cache_is_initialized", lambda: False)()
    if started:
        if not current:
            warnings.warn(
                f"accel: XLA compile cache not used: torch_xla compiled a graph before the first "
                f"accel.xla.xla_device() call; run through xlarun, or set {launch.XLA_CACHE_PATH} "
                "before the first computation.",
                RuntimeWarning,
                stacklevel=3,
            )
        return
    if current:  # xlarun's worker mode checked the folder already
        read_only = os.environ.get(launch.XLA_CACHE_READ_ONLY) == "1"
    else:
        opened = launch.open_cache_dir(wanted)
        if opened is None:
            return
        read_only = opened[1]
    import torch_xla.runtime as xr

    # Through the API even when the variables are set: it is where torch_xla would move the setting.
    xr.initialize_cache(wanted, readonly=read_only)


_autograd_checked = False


def _check_autograd_reaches_xla(device: torch.device) -> None:
    """Raise a clear error, once per process, where torch's autograd cannot run a backward on XLA tensors.

    The autograd engine sizes its per-device queues when the process's first backward starts, from the device
    counts known then; torch_xla knows its devices once its runtime has started (the first device call), not
    at import. A backward that ran before (a CPU reference model, a test) leaves XLA no queue, and every later
    XLA backward fails with torch's "device_ready_queues_ ... INTERNAL ASSERT FAILED" (pytorch/xla#4174). A
    backward over one lazy scalar finds out here, at the device's first use, and costs no compilation (its
    lazy result is dropped unexecuted)."""
    global _autograd_checked
    if _autograd_checked:
        return
    probe = torch.zeros((), device=device, requires_grad=True)
    try:
        with torch.enable_grad():
            torch.autograd.grad(probe * 2.0, probe)
    except RuntimeError as exc:
        if "device_ready_queues_" not in str(exc):
            raise
        raise RuntimeError(
            "torch's autograd engine started before the XLA device did (a backward ran earlier in this process), "
            "so it cannot run a backward on XLA tensors (pytorch/xla#4174): get the device first "
            "(accel.xla.xla_device(), or accel.accelerate() with backend='xla'), before the first backward"
        ) from None
    _autograd_checked = True


def xla_device(n: int | None = None) -> torch.device:
    """This process's XLA device (the n-th one when several are visible)."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise ValueError(f"n must be None or a non-negative int, got {n!r}")
    torch_xla = require_xla("accel.xla.xla_device()")
    _start_compile_cache(torch_xla)
    if hasattr(torch_xla, "device"):
        device = torch_xla.device(n)
    else:
        import torch_xla.core.xla_model as xm

        device = xm.xla_device(n)
    _check_autograd_reaches_xla(device)
    return device


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
