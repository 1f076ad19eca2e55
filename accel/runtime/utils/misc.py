"""multi_apply (mmdet's helper) and multi_apply_multi_stream, its version that spreads the calls over
CUDA streams.

Detection heads call one function per feature level or per image through multi_apply; each call
launches a handful of small kernels that leave most of the GPU idle. Issued on several streams,
the calls' kernels can run side by side. The stream rules followed here:

- each side stream waits on the current stream before its first call: the inputs were (usually)
  produced there, and the side stream must not read them earlier;
- the current stream waits on every side stream at the end (also when a call raises), so whatever
  the caller queues next sees every result;
- a tensor used on a stream it was not allocated on is record_stream()-ed there: the inputs on the
  side stream that reads them, the outputs (allocated on a side stream) on the current stream.
  Without that, freeing one lets the caching allocator hand its memory to new work while queued
  kernels on the other stream still read it.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import torch

# Looked up as names of this module, so the order of the stream calls can be checked on machines
# without a GPU (tests/runtime/test_multi_apply.py swaps in recording fakes). All import without CUDA.
from torch.cuda import Stream, current_stream
from torch.cuda import device as cuda_device
from torch.cuda import stream as use_stream

from accel.utils.batch import iter_tensors
from accel.utils.checks import check_int

__all__ = ["multi_apply", "multi_apply_multi_stream"]


def multi_apply(func: Callable, *args: Any, **kwargs: Any) -> tuple[list, ...]:
    """``func`` applied to each tuple of ``zip(*args)`` (with ``kwargs`` on every call), the results
    transposed into a tuple of lists: mmdet.core.multi_apply, including its edge cases (the shortest
    of ``args`` sets the number of calls; a func returning a single tensor is split along dim 0)."""
    pfunc = partial(func, **kwargs) if kwargs else func
    map_results = map(pfunc, *args)
    return tuple(map(list, zip(*map_results)))


def _record_stream(t: torch.Tensor, stream) -> None:
    t.record_stream(stream)


def _stream_device(tensors: list[torch.Tensor]) -> Optional[torch.device]:
    """The CUDA device the calls run on, or None to run them one after another on the current stream:
    no CUDA tensor among the inputs, or CUDA tensors on several devices (streams belong to one device)."""
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    return devices.pop() if len(devices) == 1 else None


def multi_apply_multi_stream(func: Callable, num_streams: int, *args: Any, **kwargs: Any) -> tuple[list, ...]:
    """multi_apply's result, with the calls issued round-robin on ``num_streams`` CUDA side streams.

    ``args`` are iterables of one length (tensors are iterated along dim 0, as by multi_apply);
    ``kwargs`` are passed to every call. Streams are used when the input tensors (in ``args`` and
    ``kwargs``, nested containers included) are on one CUDA device; otherwise, and for
    ``num_streams == 1``, the calls run in order on the current stream, exactly as multi_apply.
    The host is never blocked: on return the current stream has been told to wait for every call.

    ``func`` must issue its work on the current stream (as ordinary torch code does) and must not
    synchronise with the host, or the streams cannot overlap. Calls must be independent: two calls
    on different streams run in any order.

    Streams pay only where the GPU, not the host, bounds the calls: each call's kernels must take
    longer than issuing the next call does. On an H100 (benchmarks/multi_stream.py, 2026-11-27) every
    workload of 64 small calls (matmuls, sorts of scores) was bound by the host issuing them, and 2-4
    streams took 1.25-1.6x as long as one; use num_streams=1 unless a measurement of your calls says
    otherwise.

    Raises TypeError for a num_streams that is not an int, a func that is not callable, or no args;
    ValueError for num_streams < 1 or args of different lengths.
    """
    check_int("num_streams", num_streams, min=1)
    if not callable(func):
        raise TypeError(f"func: expected a callable, got {type(func).__name__} {func!r}")
    if not args:
        raise TypeError("args: expected at least one iterable to map func over")
    columns = []
    for i, arg in enumerate(args):
        try:
            columns.append(list(arg))
        except TypeError as e:
            raise TypeError(f"args[{i}]: expected an iterable (a list, a tensor of >= 1 dimension, ...), "
                            f"got {type(arg).__name__}") from e
    lengths = [len(c) for c in columns]
    if len(set(lengths)) > 1:
        raise ValueError(f"args: expected iterables of one length, got lengths {lengths}")

    shared = iter_tensors(kwargs)
    whole = [a for a in args if isinstance(a, torch.Tensor)]
    device = None
    if num_streams > 1 and lengths[0] > 1:
        device = _stream_device(whole + [t for c, a in zip(columns, args) if not isinstance(a, torch.Tensor)
                                         for t in iter_tensors(c)] + shared)
    if device is None:
        return multi_apply(func, *columns, **kwargs)

    pfunc = partial(func, **kwargs) if kwargs else func
    calls = list(zip(*columns))
    with cuda_device(device):
        caller = current_stream(device)
        streams = [Stream(device=device) for _ in range(min(num_streams, len(calls)))]
        # Tensors given whole (a tensor arg, whose rows are the items; kwargs) are read by every
        # stream: recorded once per stream rather than once per row.
        whole_on_device = [t for t in whole + shared if t.device == device]
        for s in streams:
            s.wait_stream(caller)
            for t in whole_on_device:
                _record_stream(t, s)
        results = []
        try:
            for i, call in enumerate(calls):
                s = streams[i % len(streams)]
                for a, item in zip(args, call):
                    if not isinstance(a, torch.Tensor):
                        for t in iter_tensors(item):
                            if t.device == device:
                                _record_stream(t, s)
                with use_stream(s):
                    results.append(pfunc(*call))
        finally:
            # Queued before any error propagates: the caller's next work must not overtake the calls
            # already issued, whatever it does with the exception.
            for s in streams:
                caller.wait_stream(s)
            for out in results:
                for t in iter_tensors(out):
                    if t.device == device:
                        _record_stream(t, caller)
    return tuple(map(list, zip(*results)))
