"""Single-process data parallelism over several devices with torch_xla SPMD.

One process drives N devices (CPU_NUM_DEVICES=N on CPU, every chip on TPU): the batch is
split along its first dimension across a 1-D mesh, parameters are replicated, and XLA's
partitioner inserts the gradient reduction. Training code stays ordinary
backward/step/sync, and gradients are already global, so no all_reduce is needed.

SPMD must be switched on before any XLA computation, which is why the first call here
(enable_spmd or data_parallel_mesh) should come before the model moves to the device.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from accel.utils.xla import is_xla_tensor, require_xla

DATA_AXIS = "data"


def enable_spmd() -> None:
    """Switch torch_xla into SPMD mode (idempotent)."""
    require_xla("accel.xla.spmd")
    import torch_xla.runtime as xr

    if not xr.is_spmd():
        xr.use_spmd()


def is_spmd() -> bool:
    require_xla("accel.xla.spmd")
    import torch_xla.runtime as xr

    return bool(xr.is_spmd())


def device_count() -> int:
    """Devices one SPMD program spans."""
    require_xla("accel.xla.spmd")
    import torch_xla.runtime as xr

    return int(xr.global_runtime_device_count())


def data_parallel_mesh(num_devices: int | None = None, axis_name: str = DATA_AXIS):
    """A 1-D mesh over the devices, with one axis to split batches along; enables SPMD."""
    if not isinstance(axis_name, str) or not axis_name:
        raise ValueError(f"axis_name must be a non-empty str, got {axis_name!r}")
    enable_spmd()
    import numpy as np
    import torch_xla.distributed.spmd as xs

    available = device_count()
    n = available if num_devices is None else num_devices
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= available:
        raise ValueError(f"num_devices must be an int in 1..{available}, got {num_devices!r}")
    return xs.Mesh(np.arange(n), (n,), (axis_name,))


def _shard(t: torch.Tensor, mesh, device):
    import torch_xla.distributed.spmd as xs

    if not is_xla_tensor(t):
        t = t.to(device)
    if t.dim() == 0:  # a scalar has no batch dimension: every device keeps all of it
        return t
    axis = mesh.axis_names[0]
    xs.mark_sharding(t, mesh, (axis,) + (None,) * (t.dim() - 1))
    return t


def shard_batch(batch, mesh, device=None):
    """Move a batch (tensor, or dict/list/tuple of them) to the device, split along dim 0.

    Non-tensor leaves pass through. Returns a structure like ``batch``.
    """
    if mesh is None or not hasattr(mesh, "axis_names"):
        raise ValueError(f"mesh must be a torch_xla Mesh (see data_parallel_mesh()), got {type(mesh).__name__}")
    if len(mesh.axis_names) != 1:
        raise ValueError(f"mesh must be 1-D for data parallelism, got axes {mesh.axis_names}")
    require_xla("accel.xla.spmd.shard_batch()")
    import torch_xla

    dev = torch_xla.device() if device is None else device

    def walk(obj):
        if isinstance(obj, torch.Tensor):
            return _shard(obj, mesh, dev)
        if isinstance(obj, Mapping):
            items = {k: walk(v) for k, v in obj.items()}
            try:  # keep dict subclasses such as transformers' BatchEncoding
                return items if type(obj) is dict else type(obj)(items)
            except TypeError:
                return items
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*(walk(v) for v in obj))
        if isinstance(obj, (list, tuple)):
            return type(obj)(walk(v) for v in obj)
        return obj

    return walk(batch)
