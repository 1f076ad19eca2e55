"""MpDeviceLoader: wrap a DataLoader so its batches arrive on the device ahead of use.

Same call as torch_xla's `pl.MpDeviceLoader(loader, device)` (the TorchAcc guide's), but it also works
for cpu and cuda devices: on cpu it is a prefetching thread, on cuda it copies from pinned memory on a
side stream, on XLA it uploads in the background and marks the step boundary each time the training loop
asks for the next batch, as torch_xla's loader does. Unlike torch_xla's, it reads a loader whose reads draw
from the host's global RNGs (random masking or augmentation with num_workers=0) when the loop asks for each
batch, so a seed reproduces the run and a checkpoint resumes it exactly (see _DeviceLoaderIterator).
"""
from __future__ import annotations

import weakref

from accel.data._pipeline import END, TransferPipeline, _Failure
from accel.utils.batch import resolve_device
from accel.utils.loader import LoaderWrapper
from accel.utils.rng import read_when_asked
from accel.utils.xla import is_xla_device, mark_step

_OPTIONS = ("loader_prefetch_size", "device_prefetch_size", "input_sharding")


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


class _DeviceLoaderIterator:
    """One pass over the loader. Dropping it (or exhausting it) stops its threads.

    The first two batches are read in the training thread when the loop asks for them; the rest are read ahead
    by the pipeline's threads, unless the second read drew from the host's global RNGs: then every batch is
    read when asked, as the Prefetcher does and for the same reason (see accel.runtime.io.prefetcher)."""

    def __init__(self, loader, device, loader_prefetch_size: int, device_prefetch_size: int, input_sharding=None):
        self._loader = loader
        self._iterator = None
        self._reads = 0
        self._ahead = False
        self._is_xla = is_xla_device(device)
        self._pipeline = TransferPipeline(device, loader_prefetch_size, device_prefetch_size,
                                          name="accel-MpDeviceLoader", input_sharding=input_sharding)
        self._len = len(loader) if hasattr(loader, "__len__") else None
        self._closed = False

    def __iter__(self):
        return self

    def __len__(self):
        if self._len is None:
            raise TypeError("the wrapped loader has no len()")
        return self._len

    def _read_on_demand(self):
        def read():
            try:
                batch = next(self._iterator)
            except StopIteration:
                return END
            return self._pipeline.transfer(batch)

        if self._iterator is None:
            self._iterator = iter(self._loader)
        item, self._ahead = read_when_asked(read, self._reads, END)
        self._reads += 1
        if self._ahead:
            # the read thread holds the iterator from now on (dropping it there stops DataLoader workers)
            iterator, self._iterator = self._iterator, None
            self._pipeline.start(iterator)
        return item

    def __next__(self):
        if self._closed:
            raise StopIteration
        if self._is_xla:
            # The previous batch's step ends here: cut and run its lazy graph, as torch_xla's loader does.
            mark_step()
        if self._ahead:
            item = self._pipeline.next_item()
        else:
            try:
                item = self._read_on_demand()
            except BaseException:
                self.close()
                raise
        if item is END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            # The worker's exception object carries its own traceback; raising it keeps type and frames.
            raise item.exc
        return self._pipeline.claim(item)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pipeline.close()
            self._iterator = None  # a DataLoader iterator dropped shuts its worker processes down

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer (e.g. at interpreter exit)
            pass


class MpDeviceLoader(LoaderWrapper):
    """Iterate `loader` with every batch already on `device`.

    Args:
        loader: a torch DataLoader or any re-iterable with batches of tensors (nested in dicts, lists,
            tuples, or objects with .to(), e.g. transformers' BatchEncoding; container types are kept).
        device: the target device: "cpu", "cuda[:i]", or an XLA device (e.g. torch_xla.device()).
        loader_prefetch_size: how many host batches may wait for their copy (default 8).
        device_prefetch_size: how many batches may wait on the device (default 4).
        input_sharding: XLA SPMD only (as torch_xla's loader): how each tensor is split over the devices
            while it is uploaded; an accel.xla.spmd.BatchSharding (dim 0 over the mesh, for every tensor
            of the batch) or a torch_xla ShardingSpec (tensors of its rank only). None: one device.

    Each `for` loop is a pass of its own with its own threads, as a DataLoader's are, so nested loops
    over one loader see every pair of batches. A loader exception is re-raised in the training loop with
    its original type and traceback. Breaking out of a loop stops its threads once the iterator is
    dropped; `close()` stops every pass at once.
    """

    def __init__(self, loader, device, **kwargs):
        super().__init__(loader)
        unknown = sorted(set(kwargs) - set(_OPTIONS))
        if unknown:
            raise ValueError(f"MpDeviceLoader got unsupported option(s) {unknown}; supported: {list(_OPTIONS)}")
        self._device = resolve_device(device)
        self._input_sharding = kwargs.get("input_sharding")
        if self._input_sharding is not None:
            if not is_xla_device(self._device):
                raise ValueError(f"MpDeviceLoader: input_sharding needs an XLA device, got {self._device}")
            if not callable(getattr(self._input_sharding, "xla_spec", None)):
                raise ValueError("MpDeviceLoader: input_sharding must be an accel.xla.spmd.BatchSharding or a "
                                 f"torch_xla ShardingSpec, got {type(self._input_sharding).__name__}")
        self._loader_prefetch_size = _positive_int("loader_prefetch_size", kwargs.get("loader_prefetch_size", 8))
        self._device_prefetch_size = _positive_int("device_prefetch_size", kwargs.get("device_prefetch_size", 4))
        self._passes: weakref.WeakSet = weakref.WeakSet()  # weak: a loop that breaks early frees its pass

    @property
    def device(self):
        return self._device

    def __iter__(self):
        iterator = _DeviceLoaderIterator(self.loader, self._device, self._loader_prefetch_size,
                                         self._device_prefetch_size, self._input_sharding)
        self._passes.add(iterator)
        return iterator

    def close(self) -> None:
        """Stop the threads of every pass still running."""
        for iterator in list(self._passes):
            iterator.close()
