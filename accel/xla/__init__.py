"""accel.xla: the compiler path on PyTorch/XLA, with the xla_model calls TorchAcc scripts use.

    import accel.xla as xm
    device = xm.xla_device()
    ...
    loss.backward()
    xm.optimizer_step(optimizer)       # gradients averaged over workers, then step
    xm.add_step_closure(log, args=(loss,), run_async=True)
    xm.sync()

Importing this package does not import torch_xla; calls that need it raise a RuntimeError
saying how to install it. world_size()/ordinal()/all_reduce on CPU/CUDA tensors work without
it (through torch.distributed, or as a single worker).
"""
from __future__ import annotations

import sys

import torch.distributed as dist

from accel.xla._closures import add_step_closure, mark_step, sync, wait_async_closures
from accel.xla._device import get_replication, get_rng_state, set_replication, set_rng_state, xla_device
from accel.xla._metrics import XlaMetrics, clear_metrics, metrics, metrics_report
from accel.xla._save import save
from accel.xla._topology import (
    get_local_ordinal,
    get_ordinal,
    is_master_ordinal,
    local_ordinal,
    ordinal,
    rendezvous,
    world_size,
    xrt_world_size,
)
from accel.xla.collectives import (
    REDUCE_AND,
    REDUCE_MAX,
    REDUCE_MIN,
    REDUCE_MUL,
    REDUCE_OR,
    REDUCE_SUM,
    _fetch_gradients,
    all_reduce,
    fetch_gradients,
    optimizer_step,
    reduce_gradients,
)

__all__ = [
    "REDUCE_AND",
    "REDUCE_MAX",
    "REDUCE_MIN",
    "REDUCE_MUL",
    "REDUCE_OR",
    "REDUCE_SUM",
    "XlaMetrics",
    "_fetch_gradients",
    "add_step_closure",
    "all_reduce",
    "clear_metrics",
    "fetch_gradients",
    "get_local_ordinal",
    "get_ordinal",
    "get_replication",
    "get_rng_state",
    "is_master_ordinal",
    "local_ordinal",
    "mark_step",
    "metrics",
    "metrics_report",
    "optimizer_step",
    "ordinal",
    "reduce_gradients",
    "rendezvous",
    "save",
    "set_replication",
    "set_rng_state",
    "sync",
    "wait_async_closures",
    "world_size",
    "xla_device",
    "xrt_world_size",
]


def _create_process_group_lazily(store, rank, size, timeout):
    # Importing accel.xla.backend imports torch_xla; deferred until a script really asks for "xla".
    from accel.xla import backend

    return backend.create_process_group(store, rank, size, timeout)


def _register_backend_lazily() -> None:
    """Make init_process_group("xla") reach accel's backend without importing torch_xla now."""
    if "accel.xla.backend" in sys.modules:
        return
    if "torch_xla.distributed.xla_backend" in sys.modules:
        # torch_xla is loaded already, so the full registration costs nothing extra.
        from accel.xla import backend  # noqa: F401

        return
    # Only the backend: the "xla://" handler is installed by accel.xla.backend, because
    # torch_xla's module refuses to import when that scheme is already taken.
    dist.Backend.register_backend("xla", _create_process_group_lazily, devices=["xla", "cpu"])


if dist.is_available():
    _register_backend_lazily()
