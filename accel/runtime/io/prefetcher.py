"""Prefetcher: the TorchAcc guide's data prefetcher (section IO優化).

    prefetcher = Prefetcher(data_loader, preprocess_fn)
    for step, samples in enumerate(prefetcher):      # samples are already on the device
        loss = model(samples); loss.backward()
        prefetcher.prefetch_CPU()                     # CPU is idle while kernels run: read the next batch
        optimizer.step()
        prefetcher.prefetch_GPU()                     # start copying it to the device

How each device is served (one background thread reads, and starts copies, in loader order):
- cuda: the background thread reads the next host batch, pins its tensors (those not pinned yet) and
  queues their non_blocking copy on a side stream of the target device, then records an event after the
  copy. When the loop takes the batch, its current stream waits for that event, every tensor is
  record_stream()-ed on that stream (so the allocator does not give its memory to a later prefetch while
  the step still reads it), and preprocess_fn runs in the training thread on that stream. Running it
  there keeps its random draws in program order with the step's and needs no further stream bookkeeping;
  its kernels are usually small next to a training step. See accel.utils.batch.SideStreamCopy.
- xla: the upload runs in the background thread ahead of use; preprocess_fn runs in the training thread,
  which is the thread that traces the step's lazy graph. Marking the step stays with the training loop
  (xm.optimizer_step / torch_xla.sync), as on the guide's XLA path.
- cpu: reading and preprocess_fn run in the background thread (with background=True; by default the
  training thread reads, see below).
preprocess_fn always runs under torch.no_grad().

From the third batch of a pass on, the prefetcher keeps the next batch read and copied ahead in the
background, from the moment the loop takes a batch. prefetch_CPU/prefetch_GPU mark points where the caller
allows that work; the read and the copy have usually started long before, so the calls never delay anything
(they only start the next batch if it somehow is not under way yet), and a loop written as the guide shows
is as fast as one without the calls.

Random numbers: the first two batches of a pass are read when the loop asks for them, in its thread, and the
second read is watched: if it draws from the host's global RNGs (python `random`, numpy's, torch's CPU
generator: random masking in a collate_fn such as transformers' DataCollatorForLanguageModeling, random
augmentation in the dataset, with num_workers=0; or a CPU preprocess_fn), every batch of the pass is read
when the loop asks for it, as without a Prefetcher. Read ahead, a batch would take its numbers at another
point of the stream than the step's own draws (from the thread: at a point that depends on timing), so a seed
would not reproduce a run and a checkpoint (accel.save_state) would not resume it exactly. Loaders with
worker processes draw in the workers (their own RNGs) and are read ahead.

background=False does the same work in the training thread instead, one batch ahead: as the loop takes
batch k, batch k+1 is read and (on cuda) its copy started, so the copy still overlaps step k on the GPU,
but the read costs the loop its own time, as it does in a loop without a Prefetcher. It is for steps bound
by their host's Python work: there a second Python thread mostly competes with the step for the GIL (each
hand-over between the threads costs a thread wake-up) instead of working beside it. It is the default on the
CPU (background=None: a thread for cuda and xla, none for cpu): there the step's own threads use every core,
so a reading thread has no idle core to work on and only takes one from them (a 2-core Zen 5, a small ResNet
training on 8 images of 224 px: 61.9 ms a step with the thread, 34.0 without; accel.config's
dataloader.background_prefetch).

Each `for` loop over a Prefetcher is a pass of its own, as a DataLoader's are: nested loops see every
pair of batches, and breaking out of a loop stops that pass's thread once its iterator is dropped.
"""
from __future__ import annotations

import queue
import threading
import weakref
from concurrent.futures import Future

import torch

from accel.utils.batch import SideStreamCopy, move_to_device, resolve_device
from accel.utils.checks import check_bool
from accel.utils.rng import read_when_asked
from accel.utils.threads_at_exit import close_at_exit
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
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - the training loop re-raises it via result()
                    future.set_exception(exc)
            # Hold nothing of the finished job while idle: it refers to its pass, which must be
            # collectable (and so stopped) as soon as the training loop drops it.
            del job, fn, future

    def close(self, timeout_s: float) -> None:
        with self._lock:
            thread, self.thread = self.thread, None
            if thread is not None:
                self._jobs.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)


class _InlineWorker:
    """_Worker's interface, each job run at once in the caller's thread (Prefetcher(background=False))."""

    def submit(self, fn) -> Future:
        future: Future = Future()
        future.set_running_or_notify_cancel()
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised by result(), as from the worker thread
            future.set_exception(exc)
        return future

    def close(self, timeout_s: float) -> None:
        pass


class _Transfer:
    """What happens to a batch on its way to `device`: `host` and `to_device` run in the background
    thread, `finish` in the training thread as the loop takes the batch."""

    def __init__(self, device: torch.device, preprocess_fn):
        self.device = device
        self.preprocess_fn = preprocess_fn

    def _preprocess(self, batch):
        if self.preprocess_fn is None:
            return batch
        with torch.no_grad():
            return self.preprocess_fn(batch)

    def host(self, batch):
        return batch

    def to_device(self, batch):
        with torch.no_grad():
            return move_to_device(batch, self.device)

    def finish(self, item):
        # XLA: preprocess_fn is traced into the training thread's graph.
        return self._preprocess(item)


class _CpuTransfer(_Transfer):
    def to_device(self, batch):
        return self._preprocess(super().to_device(batch))

    def finish(self, item):
        return item


class _CudaTransfer(_Transfer):
    def __init__(self, device: torch.device, preprocess_fn):
        super().__init__(device, preprocess_fn)
        self.copier = SideStreamCopy(device)

    def host(self, batch):
        return self.copier.pin(batch)

    def to_device(self, batch):
        with torch.no_grad():
            return self.copier.start(batch)

    def finish(self, item):
        return self._preprocess(self.copier.claim(item))


def _transfer_for(device: torch.device, preprocess_fn) -> _Transfer:
    if device.type == "cuda":
        return _CudaTransfer(device, preprocess_fn)
    if is_xla_device(device):
        return _Transfer(device, preprocess_fn)
    return _CpuTransfer(device, preprocess_fn)


class _Pass:
    """One pass over the loader: the iterator a `for` loop gets. Holds no reference to the Prefetcher,
    and no other pass shares its state, so passes are independent and dropping one stops it."""

    def __init__(self, loader, transfer: _Transfer, background: bool):
        self.loader = loader
        self.transfer = transfer
        self.iterator = None
        self.fetch: Future | None = None
        self.copy: Future | None = None
        self.worker = _Worker("accel-Prefetcher") if background else _InlineWorker()
        self.reads = 0  # reads done when the loop asked (the first two, or all of them: see _read_on_demand)
        self.ahead = False  # reads run ahead of the loop (set once the probe found reads that draw nothing)
        self.closed = False
        if background:
            close_at_exit(self)  # a pass still open when the script ends

    def _read(self):
        if self.iterator is None:
            self.iterator = iter(self.loader)
        try:
            batch = next(self.iterator)
        except StopIteration:
            return _END
        return self.transfer.host(batch)

    def _read_on_demand(self):
        """Read the batch the loop asks for now, in its thread, as a loop without a Prefetcher does; from the
        probe on (accel.utils.rng.read_when_asked), reads run ahead where the loader draws no random numbers."""
        def read():
            host = self._read()
            return host if host is _END else self.transfer.to_device(host)

        item, self.ahead = read_when_asked(read, self.reads, _END)
        self.reads += 1
        return item

    def _to_device(self, fetched: Future):
        host = fetched.result()  # already finished: the worker runs jobs in order; re-raises a read error
        if host is _END:
            return _END
        return self.transfer.to_device(host)

    def prefetch_cpu(self) -> None:
        if self.fetch is None and self.ahead and not self.closed:
            self.fetch = self.worker.submit(self._read)

    def prefetch_device(self) -> None:
        self.prefetch_cpu()
        if self.copy is None and self.ahead and not self.closed:
            fetched = self.fetch
            self.copy = self.worker.submit(lambda: self._to_device(fetched))

    def __iter__(self):
        return self

    def __next__(self):
        if self.closed:
            raise StopIteration
        try:
            if self.ahead:
                self.prefetch_device()
                copy, self.fetch, self.copy = self.copy, None, None
                item = copy.result()
            else:
                item = self._read_on_demand()
            if item is _END:
                self.close()
                raise StopIteration
            batch = self.transfer.finish(item)
        except BaseException:
            self.close()
            raise  # the loader's own exception, with its traceback (Future.result re-raises it)
        self.prefetch_device()  # read and copy the next batch while the caller trains on this one
        return batch

    def __len__(self):
        return len(self.loader)

    def close(self, timeout_s: float = 60.0) -> None:
        self.closed = True
        for future in (self.fetch, self.copy):
            if future is not None:
                future.cancel()  # a job not yet started is skipped; a running one finishes its batch
        self.fetch = self.copy = None
        self.worker.close(timeout_s)
        # Dropping a DataLoader iterator shuts its worker processes down.
        self.iterator = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


class Prefetcher:
    """Iterate `data_loader` with each batch already on `device` (see the module docstring).

    Args:
        data_loader: a DataLoader or any re-iterable of batches (tensors nested in dicts, lists, tuples,
            namedtuples and dataclasses, or objects with .to(); container types and non-tensor values
            are kept).
        preprocess_fn: optional callable applied to each batch after it is on the device; its return
            value is what the loop receives.
        device: target device; None means cuda if available, else cpu. Pass an XLA device for XLA.
        background: read and start copies on a thread of the Prefetcher's own (True), or in the training
            thread one batch ahead (False); None: a thread unless the device is the CPU (see the module
            docstring).
    """

    def __init__(self, data_loader, preprocess_fn=None, device=None, background: bool | None = None):
        if not hasattr(data_loader, "__iter__"):
            raise ValueError(
                f"data_loader must be an iterable of batches (e.g. a DataLoader), got {type(data_loader).__name__}")
        if preprocess_fn is not None and not callable(preprocess_fn):
            raise ValueError(f"preprocess_fn must be callable or None, got {type(preprocess_fn).__name__}")
        self.device = resolve_device(device)
        # The CPU's cores run the step's own threads: a reading thread would only take one from them.
        self.background = self.device.type != "cpu" if background is None else check_bool("background", background)
        self.data_loader = data_loader
        self._transfer = _transfer_for(self.device, preprocess_fn)
        self._passes: weakref.WeakSet = weakref.WeakSet()  # weak: a loop that breaks early frees its pass

    def __len__(self):
        return len(self.data_loader)

    @property
    def preprocess_fn(self):
        return self._transfer.preprocess_fn

    @property
    def dataset(self):
        return self.data_loader.dataset

    def __iter__(self):
        one_pass = _Pass(self.data_loader, self._transfer, self.background)
        self._passes.add(one_pass)
        return one_pass

    def prefetch_CPU(self) -> None:  # noqa: N802 - the guide's name
        """The guide's point after backward where reading the next batch may start. It has normally
        started already (see the module docstring); this only makes sure."""
        for one_pass in list(self._passes):
            one_pass.prefetch_cpu()

    def prefetch_GPU(self) -> None:  # noqa: N802 - the guide's name
        """The guide's point after the optimizer step where the next batch's copy to the device may
        start. As with prefetch_CPU, it has normally started already."""
        for one_pass in list(self._passes):
            one_pass.prefetch_device()

    def close(self) -> None:
        """Stop the background thread of every pass still running (a pass also stops at its end)."""
        for one_pass in list(self._passes):
            one_pass.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
