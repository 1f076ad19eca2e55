"""Fail if code reads a tensor value on the host (.item(), bool(t), float(t), if t: ...).

All of those dispatch aten::_local_scalar_dense, so a dispatch mode that rejects it
catches host syncs on any device, CPU included, without torch_xla's metrics.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostReadError(AssertionError):
    pass


class ForbidHostReads(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise HostReadError("a tensor value was read on the host (aten::_local_scalar_dense)")
        return func(*args, **(kwargs or {}))
