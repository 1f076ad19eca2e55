"""Prefetcher: the TorchAcc guide's data prefetcher (section IO優化).

    prefetcher = Prefetcher(data_loader, preprocess_fn)
    for step, samples in enumerate(prefetcher):      # samples are already on the device
        loss = model(samples); loss.backward()
        prefetcher.prefetch_CPU()                     # CPU is idle while kernels run: read the next batch
        optimizer.step()
        prefetcher.prefetch_GPU()                     # start copying it to the device

How each device is served:
- cuda: the next host batch is read and pinned in a background thread; its copy runs non_blocking on a
  side stream, and preprocess_fn runs there too, so both overlap the step. Before a batch is handed out
  the current stream waits for that copy, and every tensor is record_stream()-ed on the current stream
  so the allocator does not reuse its memory for a later prefetch while the step still reads it.
- xla: the upload runs in a background thread ahead of use; preprocess_fn runs in the training thread,
  which is the thread that traces the step's lazy graph. Marking the step stays with the training loop
  (xm.optimizer_step / torch_xla.sync), as on the guide's XLA path.
- cpu: reading and preprocess_fn run in a background thread.

Without prefetch_CPU/prefetch_GPU calls the prefetcher keeps one batch ahead on its own. After the first
call to either, it leaves the timing to the caller; a batch the caller did not request in time is read
and copied when the loop asks for it, so a missed call costs overlap, never a batch.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

import torch

from accel.utils.batch import cuda_copy_on_stream, move_to_device, pin_batch, resolve_device, wait_and_claim
from accel.utils.xla import is_xla_device


class _End:
    """Marks the end of the data loader."""


_END = _End()


class _Worker:
    """Runs jobs in submission order (so a copy always follows its read) on one background thread.

    The thread exits after a short idle spell and a later submit starts a new one, so a loop that
    breaks early leaves no thread behind even if the Prefetcher object itself stays alive.
    """

    IDLE_EXIT_S = 0.5

    def __init__(self, name: str):
        self._name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def submit(self, fn) -> Future:
        future: Future = Future()
        with self._lock:
            self._jobs.put((fn, future))
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self.thread.start()
        return future

    def _run(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self.IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:
                    if self._jobs.empty():  # submit() holds the lock while it enqueues, so no job is lost
                        self.thread = None
                        return
                continue
            if job is None:
                return
            fn, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - the training loop re-raises it via result()
                future.set_exception(exc)

    def close(self, timeout_s: float) -> None:
        with self._lock:
            thread, self.thread = self.thread, None
            if thread is not None:
                self._jobs.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)


class _Epoch:
    """One pass over the loader. Holds no reference to the Prefetcher, so dropping that stops this."""

    def __init__(self, loader, device: torch.device, preprocess_fn, side_stream):
        self.loader = loader
        self.device = device
        self.preprocess_fn = preprocess_fn
        self.side_stream = side_stream
        self.iterator = None
        self.fetch: Future | None = None
        self.copy: Future | None = None
        self.worker = _Worker("accel-Prefetcher")

    def _read(self):
        if self.iterator is None:
            # Created in the worker too: starting DataLoader worker processes takes a while.
            self.iterator = iter(self.loader)
        try:
            batch = next(self.iterator)
        except StopIteration:
            return _END
        return pin_batch(batch) if self.side_stream is not None else batch

    def _to_device(self, fetched: Future):
        host = fetched.result()  # already finished: the worker runs jobs in order; re-raises a read error
        if host is _END:
            return _END
        with torch.no_grad():
            if self.side_stream is not None:
                moved, ready = cuda_copy_on_stream(host, self.device, self.side_stream, self.preprocess_fn)
                return moved, ready
            moved = move_to_device(host, self.device)
            if self.preprocess_fn is not None and not is_xla_device(self.device):
                moved = self.preprocess_fn(moved)
            return moved

    def prefetch_cpu(self) -> None:
        if self.fetch is None:
            self.fetch = self.worker.submit(self._read)

    def prefetch_device(self) -> None:
        self.prefetch_cpu()
        if self.copy is None:
            fetched = self.fetch
            self.copy = self.worker.submit(lambda: self._to_device(fetched))

    def take(self):
        self.prefetch_device()
        copy, self.fetch, self.copy = self.copy, None, None
        return copy.result()

    def close(self, timeout_s: float = 60.0) -> None:
        for future in (self.fetch, self.copy):
            if future is not None:
                future.cancel()  # a job not yet started is skipped; a running one finishes its batch
        self.fetch = self.copy = None
        self.worker.close(timeout_s)
        # Dropping a DataLoader iterator shuts its worker processes down.
        self.iterator = None


class Prefetcher:
    """Iterate `data_loader` with each batch already on `device` (see the module docstring).

    Args:
        data_loader: a DataLoader or any re-iterable of batches (tensors nested in dicts/lists/tuples or
            objects with .to(); container types are kept).
        preprocess_fn: optional callable applied to each batch after it is on the device; its return
            value is what the loop receives.
        device: target device; None means cuda if available, else cpu. Pass an XLA device for XLA.
    """

    def __init__(self, data_loader, preprocess_fn=None, device=None):
        if not hasattr(data_loader, "__iter__"):
            raise ValueError(
                f"data_loader must be an iterable of batches (e.g. a DataLoader), got {type(data_loader).__name__}")
        if preprocess_fn is not None and not callable(preprocess_fn):
            raise ValueError(f"preprocess_fn must be callable or None, got {type(preprocess_fn).__name__}")
        self.data_loader = data_loader
        self.preprocess_fn = preprocess_fn
        self.device = resolve_device(device)
        self._side_stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        self._epoch: _Epoch | None = None
        self._caller_drives = False

    def __len__(self):
        return len(self.data_loader)

    @property
    def dataset(self):
        return self.data_loader.dataset

    def __iter__(self):
        self.close()
        self._epoch = _Epoch(self.data_loader, self.device, self.preprocess_fn, self._side_stream)
        self._epoch.prefetch_device()  # the first batch is needed at once
        return self

    def __next__(self):
        epoch = self._epoch
        if epoch is None:
            raise StopIteration
        try:
            item = epoch.take()
        except BaseException:
            self.close()
            raise  # the loader's own exception, with its traceback (Future.result re-raises it)
        if item is _END:
            self.close()
            raise StopIteration
        if self._side_stream is not None:
            moved, ready = item
            batch = wait_and_claim(moved, ready, self.device)
        else:
            batch = item
            if self.preprocess_fn is not None and is_xla_device(self.device):
                batch = self.preprocess_fn(batch)
        if not self._caller_drives:
            epoch.prefetch_device()
        return batch

    def prefetch_CPU(self) -> None:  # noqa: N802 - the guide's name
        """Start reading the next host batch in the background (call after backward)."""
        self._caller_drives = True
        if self._epoch is not None:
            self._epoch.prefetch_cpu()

    def prefetch_GPU(self) -> None:  # noqa: N802 - the guide's name
        """Start the next batch's host-to-device copy (call after the optimizer step)."""
        self._caller_drives = True
        if self._epoch is not None:
            self._epoch.prefetch_device()

    def close(self) -> None:
        """Stop the background thread of the current pass (also done at the end of a pass)."""
        epoch, self._epoch = self._epoch, None
        if epoch is not None:
            epoch.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass
