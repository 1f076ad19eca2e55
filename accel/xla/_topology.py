"""Who am I among the workers: world size, ordinals, rendezvous.

An initialised torch.distributed group is the truth when there is one: on CPU PJRT every
torchrun process sees an XLA world of 1, so torch_xla's own answers would be wrong there.
Without a group we ask torch_xla (xmp.spawn, TPU), and without torch_xla we answer 1/0 so
the same script runs on CPU/CUDA.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from accel.utils.xla import xla_available


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _xla_runtime():
    import torch_xla.runtime as xr

    return xr


def _xla_in_use() -> bool:
    """torch_xla is installed and this program uses it (PJRT_DEVICE chosen or runtime started).

    Asking torch_xla for the world size starts its runtime; a CUDA or CPU job that merely has
    torch_xla installed should not pay for that (or get its "defaulting to CPU" warning).
    """
    if not xla_available():
        return False
    if os.environ.get("PJRT_DEVICE"):
        return True
    torch_xla = sys.modules.get("torch_xla")
    if torch_xla is None:  # not even imported, so its runtime cannot have started
        return False

    started = getattr(torch_xla._XLAC, "_xla_runtime_is_initialized", None)
    return bool(started()) if started is not None else True


def world_size() -> int:
    """Number of workers taking part in training."""
    if _dist_ready():
        return dist.get_world_size()
    if _xla_in_use():
        return int(_xla_runtime().world_size())
    return 1


def ordinal() -> int:
    """This worker's global index, 0 .. world_size() - 1."""
    if _dist_ready():
        return dist.get_rank()
    if _xla_in_use():
        return int(_xla_runtime().global_ordinal())
    return 0


def local_ordinal() -> int:
    """This worker's index on its own host."""
    if _dist_ready() and "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    if _xla_in_use() and not _dist_ready():
        return int(_xla_runtime().local_ordinal())
    return int(os.environ.get("LOCAL_RANK", 0))


def is_master_ordinal(local: bool = True) -> bool:
    """True on the worker that should write files: the first on its host, or globally if not local."""
    return (local_ordinal() if local else ordinal()) == 0


# TorchAcc / torch_xla spellings.
xrt_world_size = world_size
get_ordinal = ordinal
get_local_ordinal = local_ordinal


def _uses_xla_native_collectives() -> bool:
    """True where torch_xla runs collectives itself (TPU and other non-CPU PJRT devices)."""
    if not _xla_in_use():
        return False
    return _xla_runtime().device_type() not in (None, "CPU")


def _host_collective_device() -> torch.device:
    # Object exchanges use plain host tensors; only NCCL insists on CUDA ones.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather_bytes(data: bytes) -> list[bytes]:
    device = _host_collective_device()
    n = world_size()
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(n)]
    dist.all_gather(lengths, length)
    longest = max(int(t.item()) for t in lengths)
    buf = torch.zeros(max(longest, 1), dtype=torch.uint8, device=device)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    bufs = [torch.zeros_like(buf) for _ in range(n)]
    dist.all_gather(bufs, buf)
    return [bytes(b[: int(ln.item())].cpu().tolist()) for b, ln in zip(bufs, lengths)]


def rendezvous(tag: str, payload: bytes = b"", replicas=None) -> list[bytes]:
    """Wait until every worker reaches rendezvous(tag); return every worker's payload, by ordinal."""
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"tag must be a non-empty str, got {tag!r}")
    if not isinstance(payload, (bytes, bytearray)):
        raise ValueError(f"payload must be bytes, got {type(payload).__name__}")
    n = world_size()
    if replicas:
        if sorted(replicas) != list(range(n)):
            raise ValueError(f"replicas must be empty or every ordinal 0..{n - 1}, got {list(replicas)!r}")
    if _uses_xla_native_collectives() and (n > 1 or not _dist_ready()):
        import torch_xla.core.xla_model as xm

        return list(xm.rendezvous(tag, bytes(payload), list(replicas or [])))
    if not _dist_ready() or n == 1:
        return [bytes(payload)]
    tag_bytes = tag.encode()
    gathered = _all_gather_bytes(len(tag_bytes).to_bytes(4, "little") + tag_bytes + bytes(payload))
    result = []
    for rank, blob in enumerate(gathered):
        tag_len = int.from_bytes(blob[:4], "little")
        other = blob[4 : 4 + tag_len].decode()
        if other != tag:
            raise RuntimeError(f"rendezvous mismatch: ordinal {ordinal()} is at {tag!r}, ordinal {rank} at {other!r}")
        result.append(blob[4 + tag_len :])
    return result
