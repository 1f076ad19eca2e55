"""save(): one worker writes a checkpoint with host tensors, atomically."""
from __future__ import annotations

import collections
import os

import torch

from accel.utils.atomic_file import atomic_write
from accel.utils.xla import is_xla_tensor, mark_step
from accel.xla._topology import is_master_ordinal, rendezvous, world_size


def _to_cpu(obj):
    """Copy XLA tensors to CPU through dicts, lists and tuples, so the file loads anywhere."""
    if is_xla_tensor(obj):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        converted = [(k, _to_cpu(v)) for k, v in obj.items()]
        return collections.OrderedDict(converted) if isinstance(obj, collections.OrderedDict) else dict(converted)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_to_cpu(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _has_xla_tensor(obj) -> bool:
    if is_xla_tensor(obj):
        return True
    if isinstance(obj, dict):
        return any(_has_xla_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_xla_tensor(v) for v in obj)
    return False


def atomic_torch_save(obj, path: str) -> None:
    """torch.save to a temporary file next to ``path``, then rename: readers never see half a file."""
    atomic_write(path, lambda f: torch.save(obj, f))


def save(obj, path, master_only: bool = True, global_master: bool = False) -> None:
    """Save ``obj`` (XLA tensors copied to CPU) to ``path``.

    With ``master_only`` only the master worker writes (the first on each host, or the first
    overall with ``global_master``); every worker must call save so they leave it together.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"path must be a file path, got the directory {path!r}")
    if _has_xla_tensor(obj):
        mark_step()  # pending updates must land before we copy values out
    if not master_only or is_master_ordinal(local=not global_master):
        atomic_torch_save(_to_cpu(obj), path)
    if world_size() > 1:
        rendezvous("accel.xla.save")
