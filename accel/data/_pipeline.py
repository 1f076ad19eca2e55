"""Background threads that read a loader and copy its batches to a device, in order, ahead of use.

One thread reads host batches (so a slow dataset/collate overlaps the step) and one thread copies them
to the device (so the transfer overlaps too). A single copy thread keeps batches in loader order. The
threads hold only this object, never the user-facing iterator, so dropping the iterator (a `break` out
of the training loop) lets it be collected and shut the threads down.
"""
from __future__ import annotations

import queue
import threading

import torch

from accel.utils.batch import SideStreamCopy, move_to_device
from accel.utils.threads_at_exit import close_at_exit

# How often a blocked thread looks at the stop flag; short enough that close() returns promptly.
_POLL_S = 0.05


class _End:
    """Marks the end of the loader."""


class _Failure:
    """Carries an exception raised by the loader or the copy to the consuming thread."""

    def __init__(self, exc: BaseException):
        self.exc = exc


END = _End()


class TransferPipeline:
    """transfer() and claim() move one batch; start(iterator) starts the threads that read the rest of the
    iterator and move its batches ahead of next_item()."""

    def __init__(self, device: torch.device, loader_prefetch_size: int, device_prefetch_size: int,
                 name: str, input_sharding=None):
        self.iterator = None
        self.device = device
        self.input_sharding = input_sharding  # XLA SPMD: how each batch tensor is split over the devices
        self.stop = threading.Event()
        self.host_queue: queue.Queue = queue.Queue(maxsize=loader_prefetch_size)
        self.device_queue: queue.Queue = queue.Queue(maxsize=device_prefetch_size)
        # The same side-stream copy as the Prefetcher's: pinned and started in the copy thread, claimed
        # by the consumer (see claim).
        self.copier = SideStreamCopy(device) if device.type == "cuda" else None
        self.name = name
        self.threads: list[threading.Thread] = []

    def start(self, iterator) -> None:
        """Read `iterator` (a pass's, begun by the caller) to its end in the background."""
        self.iterator = iterator
        self.threads = [
            threading.Thread(target=self._read_loader, name=f"{self.name}-read", daemon=True),
            threading.Thread(target=self._copy_to_device, name=f"{self.name}-copy", daemon=True),
        ]
        for thread in self.threads:
            thread.start()
        close_at_exit(self)  # a pipeline still reading when the script ends

    def _put(self, q: queue.Queue, item) -> bool:
        while not self.stop.is_set():
            try:
                q.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _get(self, q: queue.Queue):
        while not self.stop.is_set():
            try:
                return q.get(timeout=_POLL_S)
            except queue.Empty:
                continue
        return None

    def _read_loader(self) -> None:
        iterator, self.iterator = self.iterator, None
        try:
            while not self.stop.is_set():
                try:
                    batch = next(iterator)
                except StopIteration:
                    break
                if not self._put(self.host_queue, batch):
                    return
            self._put(self.host_queue, END)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the training loop
            self._put(self.host_queue, _Failure(exc))
        finally:
            # Dropping a DataLoader iterator here shuts its worker processes down with this thread.
            del iterator

    def transfer(self, batch):
        """Host batch -> what goes into the device queue (for CUDA: a copy started on the side stream)."""
        with torch.no_grad():
            if self.copier is not None:
                return self.copier.start(self.copier.pin(batch))
            return move_to_device(batch, self.device, input_sharding=self.input_sharding)

    def claim(self, item):
        """In the consuming thread: the batch of a device-queue item, ready to use on its current stream."""
        return self.copier.claim(item) if self.copier is not None else item

    def _copy_to_device(self) -> None:
        while True:
            item = self._get(self.host_queue)
            if item is None:
                return
            if item is END or isinstance(item, _Failure):
                self._put(self.device_queue, item)
                return
            try:
                moved = self.transfer(item)
            except BaseException as exc:  # noqa: BLE001
                self._put(self.device_queue, _Failure(exc))
                return
            if not self._put(self.device_queue, moved):
                return

    def next_item(self):
        """The next device item, END, or a _Failure; waits while the threads are working."""
        while True:
            try:
                return self.device_queue.get(timeout=_POLL_S)
            except queue.Empty:
                if not any(t.is_alive() for t in self.threads):
                    # The threads always leave END or a failure behind; look once more before giving up.
                    try:
                        return self.device_queue.get_nowait()
                    except queue.Empty:
                        return _Failure(RuntimeError("the data loading threads stopped without a result"))

    def close(self, timeout_s: float = 60.0) -> None:
        self.stop.set()
        for thread in self.threads:
            if thread is not threading.current_thread():
                # A thread inside a slow loader call finishes that one batch, then sees the stop flag.
                thread.join(timeout_s)

    def alive(self) -> bool:
        return any(t.is_alive() for t in self.threads)
