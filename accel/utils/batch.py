"""Moving nested batches (tensors inside dicts, lists, tuples, BatchEncoding-like objects) to a device.

Shared by accel.data.MpDeviceLoader and accel.runtime.io.Prefetcher, which both copy host batches to a
device ahead of use. The CUDA helpers copy on a side stream from pinned memory and let the consumer
wait for that copy; the rules they follow are the caching allocator's: a tensor allocated on the side
stream and used on another one must be record_stream()-ed there, or its memory may be handed to the next
copy while the training step still reads it.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch

from accel.utils.xla import is_xla_device, require_xla, xla_available


def _is_namedtuple(obj) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor], fallback_to=None) -> Any:
    """Rebuild `batch` with fn applied to each tensor, keeping every container's type.

    Mappings are copied (copy.copy, so dict subclasses and UserDict-based classes such as transformers'
    BatchEncoding keep their type and extra attributes) and their values replaced. Other objects that
    expose .to() are moved with `fallback_to(obj)` when given, and passed through otherwise; plain Python
    values (ints, strings, None) are passed through unchanged.
    """
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, MutableMapping):
        out = copy.copy(batch)
        for key in list(out.keys()):
            out[key] = map_tensors(batch[key], fn, fallback_to)
        return out
    if isinstance(batch, Mapping):
        # Read-only mappings cannot be filled in place; a plain dict is the closest faithful copy.
        return {key: map_tensors(value, fn, fallback_to) for key, value in batch.items()}
    if _is_namedtuple(batch):
        return type(batch)(*(map_tensors(v, fn, fallback_to) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn, fallback_to) for v in batch)
    if fallback_to is not None and callable(getattr(batch, "to", None)):
        return fallback_to(batch)
    return batch


def iter_tensors(batch: Any):
    """Every tensor in a nested batch, in the order map_tensors visits them."""
    found: list[torch.Tensor] = []

    def collect(t):
        found.append(t)
        return t

    map_tensors(batch, collect)
    return found


def _object_to(device, non_blocking):
    def move(obj):
        try:
            return obj.to(device, non_blocking=non_blocking)
        except TypeError:
            # Some .to() methods (older BatchEncoding, user classes) take only the device.
            return obj.to(device)

    return move


def _xla_bulk_move(batch: Any, device: torch.device) -> Any:
    """One bulk host-to-XLA transfer for all tensors of a batch (what torch_xla's own loader does)."""
    import torch_xla.core.xla_model as xm

    tensors = iter_tensors(batch)
    if not tensors:
        return map_tensors(batch, lambda t: t, fallback_to=_object_to(device, False))
    moved = iter(xm.send_cpu_data_to_device(tensors, device))
    return map_tensors(batch, lambda _t: next(moved), fallback_to=_object_to(device, False))


def move_to_device(batch: Any, device, non_blocking: bool = False) -> Any:
    """Copy every tensor of a nested batch to `device`, keeping the containers' types."""
    device = torch.device(device)
    if is_xla_device(device) and xla_available():
        # The bulk path converts plain host tensors only (not subclasses, not tensors already on a device).
        host_only = all(type(t) is torch.Tensor and t.device.type == "cpu" for t in iter_tensors(batch))
        if host_only:
            try:
                return _xla_bulk_move(batch, device)
            except (ImportError, AttributeError):
                # The bulk API moved in this torch_xla version; per-tensor copies are still correct.
                pass
    return map_tensors(
        batch,
        lambda t: t.to(device, non_blocking=non_blocking),
        fallback_to=_object_to(device, non_blocking),
    )


def pin_batch(batch: Any) -> Any:
    """Page-locked copies of the host tensors of a batch (already pinned ones are kept as they are)."""

    def pin(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu" or t.is_pinned():
            return t
        return t.pin_memory()

    return map_tensors(batch, pin)


def cuda_copy_on_stream(batch: Any, device: torch.device, stream, preprocess_fn=None):
    """Start the host-to-device copy of a (pinned) batch on `stream`; return (device_batch, ready_event).

    The copy is asynchronous: nothing here waits for it. preprocess_fn, when given, also runs on the side
    stream so its kernels queue behind the copy and overlap the training step. The consumer must call
    `wait_and_claim` before touching the result.
    """
    if any(t.is_cuda for t in iter_tensors(batch)):
        # Inputs already on the GPU were written by work queued on the current stream; the side stream
        # must not read them before that work is done. (Host inputs need no such wait, which is what
        # lets the copy overlap the step.)
        stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.device(device), torch.cuda.stream(stream):
        moved = move_to_device(batch, device, non_blocking=True)
        if preprocess_fn is not None:
            moved = preprocess_fn(moved)
        ready = torch.cuda.Event()
        ready.record(stream)
    return moved, ready


def wait_and_claim(batch: Any, ready_event, device: torch.device) -> Any:
    """Make the current CUDA stream wait for a side-stream copy and take ownership of its tensors."""
    current = torch.cuda.current_stream(device)
    current.wait_event(ready_event)
    for t in iter_tensors(batch):
        if t.is_cuda:
            # The memory was allocated on the side stream; without this the allocator could give it to
            # the next prefetch while kernels on the current stream still read it.
            t.record_stream(current)
    return batch


def resolve_device(device) -> torch.device:
    """torch.device for `device`; None means cuda when available, else cpu. An index-less cuda gets one."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be a torch.device or a device string, got {device!r}") from exc
    if device.type == "xla" and device.index is None:
        device = torch.device(require_xla("an XLA device").device())
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device} was requested but CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device
