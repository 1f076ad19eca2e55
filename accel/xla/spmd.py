"""Single-process data parallelism over several devices with torch_xla SPMD.

One process drives N devices (CPU_NUM_DEVICES=N on CPU, every chip on TPU): the batch is
split along its first dimension across a 1-D mesh, parameters are replicated, and XLA's
partitioner inserts the gradient reduction. Training code stays ordinary
backward/step/sync, and gradients are already global, so no all_reduce is needed.

SPMD must be switched on before any XLA computation, which is why the first call here
(enable_spmd, data_parallel_mesh or fsdp_mesh) should come before the model moves to the device.

accel.accelerate() uses this for FSDP on the xla backend (dist.fsdp.size > 1): fsdp_mesh builds the
('fsdp',) or ('dp', 'fsdp') mesh, accel.xla.fsdp shards the parameters over it, and BatchSharding splits
each batch the loader uploads along dim 0 over all the mesh's axes.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from accel.utils.xla import is_xla_tensor, require_xla

DATA_AXIS = "data"
FSDP_AXIS = "fsdp"  # the axis torch_xla's FSDPv2 shards parameters over (it requires this name)
DP_AXIS = "dp"


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


def fsdp_mesh(fsdp: int, dp: int = 1, topology=(DP_AXIS, FSDP_AXIS)):
    """The mesh of accel's FSDP on xla; enables SPMD.

    dp == 1: a 1-D ('fsdp',) mesh over `fsdp` devices. dp > 1: a 2-D ('dp', 'fsdp') mesh over dp * fsdp
    devices: parameters are sharded over 'fsdp' and replicated over 'dp' (torch FSDP2's HSDP), the batch
    is split over both. topology is dist.topology's order of the axes, outermost first: ['dp', 'fsdp']
    puts the devices of one shard group next to each other (devices 0..fsdp-1 shard one replica, so on a
    TPU slice the all-gathers stay among neighbouring chips); ['fsdp', 'dp'] strides a shard group over
    the replicas.
    """
    for name, value in (("fsdp", fsdp), ("dp", dp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if sorted(topology) != sorted((DP_AXIS, FSDP_AXIS)):
        raise ValueError(f"topology must be an ordering of {[DP_AXIS, FSDP_AXIS]}, got {topology!r}")
    enable_spmd()
    import numpy as np
    import torch_xla.distributed.spmd as xs

    available = device_count()
    if dp * fsdp > available:
        raise ValueError(f"dp * fsdp = {dp} * {fsdp} = {dp * fsdp} devices, but this SPMD program has {available}")
    if dp == 1:
        return xs.Mesh(np.arange(fsdp), (fsdp,), (FSDP_AXIS,))
    if list(topology)[0] == DP_AXIS:
        ids = np.arange(dp * fsdp).reshape(dp, fsdp)
    else:
        ids = np.arange(dp * fsdp).reshape(fsdp, dp).T
    return xs.Mesh(ids.flatten(), (dp, fsdp), (DP_AXIS, FSDP_AXIS))


def batch_partition_spec(mesh, ndim: int) -> tuple:
    """Dim 0 split over every axis of `mesh` (jointly when there are several), the other dims whole."""
    axes = tuple(mesh.axis_names)
    return (axes[0] if len(axes) == 1 else axes,) + (None,) * (ndim - 1)


class BatchSharding:
    """How accel's MpDeviceLoader(input_sharding=...) places each tensor of a batch: dim 0 (the batch) split
    over every axis of `mesh`, the other dims replicated; 0-d tensors replicated. Unlike torch_xla's
    ShardingSpec, which fits tensors of one rank only, it fits every tensor of a batch (input_ids [B, L],
    labels [B], ...). A dim 0 the mesh does not divide is padded by XLA (uneven sharding), so a short last
    batch still works. The tensors are uploaded shard by shard (torch_xla's send_cpu_data_to_device), not
    whole to one device first.
    """

    minibatch = False  # read by torch_xla's send_cpu_data_to_device: the batch is the global one

    def __init__(self, mesh):
        if mesh is None or not hasattr(mesh, "axis_names"):
            raise ValueError(f"mesh must be a torch_xla Mesh, got {type(mesh).__name__}")
        self.mesh = mesh
        self._specs: dict[int, object] = {}

    def can_apply(self, t: torch.Tensor) -> bool:
        return t.dim() >= 1

    def xla_spec(self, t: torch.Tensor):
        """torch_xla's per-tensor sharding for a host tensor (None: replicated)."""
        if not self.can_apply(t):
            return None
        spec = self._specs.get(t.dim())
        if spec is None:
            import torch_xla.distributed.spmd as xs

            spec = self._specs[t.dim()] = xs.ShardingSpec(self.mesh, batch_partition_spec(self.mesh, t.dim()))
        return spec.xla_spec(t)

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        """Shard a tensor already on the XLA device (in place; returns it)."""
        if self.can_apply(t):
            import torch_xla.distributed.spmd as xs

            xs.mark_sharding(t, self.mesh, batch_partition_spec(self.mesh, t.dim()))
        return t


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
