"""Moving nested batches (tensors inside dicts, lists, tuples, BatchEncoding-like objects) to a device.

Shared by accel.data.MpDeviceLoader and accel.runtime.io.Prefetcher, which both copy host batches to a
device ahead of use. The CUDA helpers copy on a side stream from pinned memory and let the consumer
wait for that copy (SideStreamCopy). The rules they follow:
- the copy reads page-locked memory (SideStreamCopy.pin), or non_blocking would silently be a synchronous
  copy;
- the consumer stream waits on an event recorded on the side stream after the copies (SideStreamCopy.claim),
  and only after that event was recorded (a never-recorded event is not waited for at all);
- a tensor allocated on the side stream and used on another one is record_stream()-ed there, or the
  caching allocator may hand its memory to the next copy while the training step still reads it.
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch

# The CUDA primitives of the side-stream copy are looked up as names of this module, so that the order of
# the calls can be checked on machines without a GPU. All of them import without CUDA.
from torch.cuda import Event, Stream, current_stream
from torch.cuda import device as cuda_device
from torch.cuda import stream as use_stream

from accel.utils.xla import is_xla_device, require_xla, xla_available


def _is_namedtuple(obj) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor], fallback_to=None) -> Any:
    """Rebuild `batch` with fn applied to each tensor, keeping every container's type.

    Mappings and dataclass instances are copied (copy.copy, so dict subclasses and UserDict-based classes
    such as transformers' BatchEncoding keep their type and extra attributes) and their values replaced;
    lists, tuples and namedtuples are rebuilt with their own type. Other objects that
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
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        # A copy with its fields replaced: __init__/__post_init__ are not run again, and frozen
        # dataclasses are filled the way their own __init__ does it.
        out = copy.copy(batch)
        for f in dataclasses.fields(batch):
            object.__setattr__(out, f.name, map_tensors(getattr(batch, f.name), fn, fallback_to))
        return out
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


def _xla_bulk_move(batch: Any, device: torch.device, input_sharding=None) -> Any:
    """One bulk host-to-XLA transfer for all tensors of a batch (what torch_xla's own loader does); with
    input_sharding (SPMD), each tensor is uploaded already split over the devices."""
    import torch_xla.core.xla_model as xm

    tensors = iter_tensors(batch)
    if not tensors:
        return map_tensors(batch, lambda t: t, fallback_to=_object_to(device, False))
    moved = iter(xm.send_cpu_data_to_device(tensors, device, input_sharding))
    return map_tensors(batch, lambda _t: next(moved), fallback_to=_object_to(device, False))


def move_to_device(batch: Any, device, non_blocking: bool = False, input_sharding=None) -> Any:
    """Copy every tensor of a nested batch to `device`, keeping the containers' types.

    input_sharding (XLA SPMD only): an accel.xla.spmd.BatchSharding (or a torch_xla ShardingSpec) that
    places each tensor over the mesh's devices.
    """
    device = torch.device(device)
    if is_xla_device(device) and xla_available():
        # The bulk path converts plain host tensors only (not subclasses, not tensors already on a device).
        host_only = all(type(t) is torch.Tensor and t.device.type == "cpu" for t in iter_tensors(batch))
        if host_only:
            try:
                return _xla_bulk_move(batch, device, input_sharding)
            except (ImportError, AttributeError):
                # The bulk API moved in this torch_xla version; per-tensor copies are still correct.
                pass
    if input_sharding is not None and is_xla_device(device):
        def move(t):
            t = t.to(device)
            if input_sharding.can_apply(t):
                input_sharding.apply(t)
            return t

        return map_tensors(batch, move, fallback_to=_object_to(device, non_blocking))
    return map_tensors(
        batch,
        lambda t: t.to(device, non_blocking=non_blocking),
        fallback_to=_object_to(device, non_blocking),
    )


def copy_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One tensor's copy to `device`, queued on the current stream of `device` without waiting for it."""
    return t.to(device, non_blocking=True)


class SideStreamCopy:
    """Host-to-GPU copies on a side stream of `device`, in three steps:

    pin (background thread) -> start (background thread; queues the copy) -> claim (training thread).
    pin and start run with `device` current, so the background thread never touches another GPU; claim
    names `device` in every call, so it leaves the training thread's current device alone.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.stream = Stream(device=self.device)

    def pin(self, batch: Any) -> Any:
        """Page-locked copies of the host tensors of a batch (already pinned ones are kept as they are).

        Only page-locked memory lets a non_blocking copy run asynchronously; the CUDA host allocator keeps
        a pinned block from reuse until the copies that read it have finished, so the pinned tensors
        returned here may be dropped as soon as their copies are queued.
        """

        def pin(t: torch.Tensor) -> torch.Tensor:
            if t.device.type != "cpu" or t.is_pinned():
                return t
            return t.pin_memory()

        with cuda_device(self.device):
            return map_tensors(batch, pin)

    def start(self, host_batch: Any) -> tuple[Any, Any]:
        """Queue the copies of a (pinned) batch's tensors on the side stream; return (device_batch, ready).

        Nothing here waits for the copies: `ready` is an event recorded on the side stream after the last
        of them, and the consumer must hand the pair to `claim` before touching the batch. Objects that
        are not tensors but have .to() are left for claim: their tensors cannot be seen, so they could not
        be record_stream()-ed if they were allocated here.
        """
        with cuda_device(self.device):
            sources = {t.device.index for t in iter_tensors(host_batch) if t.device.type == "cuda"}
            for source in sorted(sources):
                # Inputs already on a GPU were written by a loader running in a background thread, i.e. on
                # that thread's current stream of their device: the default stream, unless the loader
                # switched streams itself (and then synchronised them itself). The side stream must not read
                # them before that work is done. Host inputs need no such wait, which is what lets the copy
                # overlap the step.
                self.stream.wait_stream(current_stream(torch.device("cuda", source)))
            with use_stream(self.stream):
                moved = map_tensors(host_batch, lambda t: copy_async(t, self.device))
            ready = Event()
            ready.record(self.stream)
        return moved, ready

    def claim(self, started: tuple[Any, Any]) -> Any:
        """Make the current stream of `device` wait for a started copy and take ownership of its tensors.

        Call in the thread that will use the batch, with the stream it will use current, and only after
        start has returned (an event that was never recorded is not waited for).
        """
        moved, ready = started
        consumer = current_stream(self.device)
        consumer.wait_event(ready)
        for t in iter_tensors(moved):
            # Every tensor came out of start, so its memory belongs to the side stream (or, for an input
            # that was already on `device`, to the loader's stream). Without this the allocator could give
            # that memory to the next prefetch while kernels on the consumer stream still read it.
            t.record_stream(consumer)
        # The objects start left alone are moved now, in order on the consumer stream.
        return map_tensors(moved, lambda t: t, fallback_to=_object_to(self.device, False))


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
