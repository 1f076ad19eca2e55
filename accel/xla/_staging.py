"""Moving XLA tensors to host memory for a host collective, and the results back in place.

The CPU PJRT client has no cross-process collectives, so on CPU a collective over XLA
tensors is: execute the pending graph, copy to host, run gloo, copy the result back into
the same XLA tensors (so optimizers and modules that hold them see the reduced values).
"""
from __future__ import annotations

import math
import warnings

import torch

from accel.utils.xla import is_xla_tensor

_warned = False


def warn_host_staging_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            "accel's 'xla' process group on the CPU PJRT client stages XLA tensors through host memory "
            "and runs gloo collectives: results are exact, but this path is for correctness, not speed.",
            RuntimeWarning,
            stacklevel=3,
        )


def materialize_pending() -> None:
    """Execute every pending lazy computation once, without running step closures.

    Syncing all live tensors at once (instead of tensor.cpu() one by one) keeps the forward and
    backward in one graph; otherwise each gradient would trigger its own compile and the loss
    would later recompute the forward.
    """
    import torch_xla

    c = torch_xla._XLAC
    if hasattr(c, "_xla_step_marker") and hasattr(c, "_xla_get_default_device"):
        c._xla_step_marker(c._xla_get_default_device(), [], wait=True)
    else:  # pragma: no cover - older/newer torch_xla without the private entry point
        torch_xla.sync(wait=True)


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host tensors to run a collective on: XLA ones copied out, others returned as they are."""
    if any(is_xla_tensor(t) for t in tensors):
        warn_host_staging_once()
        materialize_pending()
    return [t.detach().cpu().contiguous() if is_xla_tensor(t) else t for t in tensors]


def copy_back(targets: list[torch.Tensor], hosts: list[torch.Tensor]) -> None:
    """Write host results into the original tensors (a no-op where they are the same tensor)."""
    with torch.no_grad():
        for target, host in zip(targets, hosts):
            if target is not host:
                target.copy_(host)


def flatten_by_dtype(tensors: list[torch.Tensor]) -> list[tuple[list[int], torch.Tensor]]:
    """Group tensors by (device, dtype) and concatenate each group into one flat buffer.

    One collective per buffer instead of one per tensor: hundreds of gradients become a few calls.
    Returns (indices into ``tensors``, flat buffer) pairs.
    """
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return [(idx, torch.cat([tensors[i].reshape(-1) for i in idx])) for idx in groups.values()]


def unflatten_into(tensors: list[torch.Tensor], idx: list[int], flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for i in idx:
            n = tensors[i].numel()
            tensors[i].copy_(flat[offset : offset + n].view_as(tensors[i]))
            offset += n


# -- data movement (scatter, gather, all_to_all, send/recv) ---------------------------------------
# These collectives only copy bits, so they travel as bytes: gloo then carries every dtype
# (it has no int16 or complex kernels) and one code path serves them all.


def host_buffer_like(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host tensor of t's shape and dtype for gloo to write into."""
    return torch.empty(t.shape, dtype=t.dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a host tensor as a flat uint8 tensor: a view (shared memory) when t is contiguous,
    else the bytes of a contiguous copy (a strided view cannot be reinterpreted as bytes)."""
    return t.contiguous().view(-1).view(torch.uint8)


def rows_as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a host tensor as (t.shape[0], bytes per row), shared with t when it is contiguous
    (as as_bytes): split sizes along dim 0 keep their meaning."""
    return t.contiguous().view(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)
