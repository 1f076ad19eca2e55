"""Test helpers for the XLA parts: a skip mark and the torch_xla metrics the tests read."""
from __future__ import annotations

import os

import pytest

from accel.utils.xla import xla_available

XLA_ON = bool(xla_available() and os.environ.get("PJRT_DEVICE"))

requires_xla = pytest.mark.skipif(not XLA_ON, reason="needs torch_xla with PJRT_DEVICE set (PJRT_DEVICE=CPU works)")

if XLA_ON:
    # torch's autograd engine sizes its per-device queues at its first backward from each
    # backend's device count; a CPU backward run before the XLA runtime is up leaves no queue
    # for XLA devices (INTERNAL ASSERT in engine.cpp). Starting the runtime at collection
    # time, before any test runs a backward, avoids that.
    import torch_xla

    torch_xla.device()


def xla_device():
    import torch_xla

    return torch_xla.device()


def sync() -> None:
    import torch_xla

    torch_xla.sync()


def host_transfer_counts() -> dict[str, int]:
    """Device-to-host transfers, .item()-style reads and compiles so far (read straight from torch_xla)."""
    import torch_xla.debug.metrics as met

    def samples(name: str) -> int:
        data = met.metric_data(name)
        return 0 if data is None else int(data[0])

    return {
        "TransferFromDeviceTime": samples("TransferFromDeviceTime"),
        "aten::_local_scalar_dense": int(met.counter_value("aten::_local_scalar_dense") or 0),
        "CompileTime": samples("CompileTime"),
    }
