"""Prefetcher (the guide's IO optimisation): batches on the device, in order, with or without the
prefetch_CPU/prefetch_GPU calls; preprocess_fn, errors, early exit, epochs."""
import collections
import contextlib
import dataclasses
import gc
import threading
import traceback

import pytest
import torch
from torch.utils.data import DataLoader

import accel.utils.batch as batch_module
from accel.runtime.io.prefetcher import Prefetcher, _Worker
from accel.utils.batch import iter_tensors, move_to_device
from accel.utils.xla import xla_available
from tests._datasets import BrokenSample, Numbers, Pair


def _prefetch_threads():
    return [t for t in threading.enumerate() if t.name.startswith("accel-Prefetcher")]


def _no_threads_left():
    for t in _prefetch_threads():
        t.join(10)
    return _prefetch_threads() == []


def _train_loop(prefetcher, call_prefetch):
    seen = []
    for samples in prefetcher:
        seen.append(samples)
        loss = (samples["x"] * 3).sum()  # stands in for forward + backward
        if call_prefetch:
            prefetcher.prefetch_CPU()
        loss.item()  # stands in for optimizer.step()
        if call_prefetch:
            prefetcher.prefetch_GPU()
    return seen


@pytest.mark.parametrize("call_prefetch", [False, True], ids=["auto", "guide_calls"])
def test_every_batch_once_in_order(call_prefetch):
    loader = DataLoader(Numbers(11), batch_size=3)
    prefetcher = Prefetcher(loader)
    assert prefetcher.device == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert len(prefetcher) == 4
    seen = _train_loop(prefetcher, call_prefetch)
    assert len(seen) == 4
    for got, expected in zip(seen, loader):
        assert got["x"].device.type == prefetcher.device.type
        torch.testing.assert_close(got, move_to_device(expected, prefetcher.device))
    assert _no_threads_left()


@pytest.mark.parametrize("call_prefetch", [False, True], ids=["auto", "guide_calls"])
def test_preprocess_fn_runs_on_each_device_batch(call_prefetch):
    calls = []

    def preprocess(batch):
        calls.append(batch["x"].device.type)
        return {"x": batch["x"] / 2, "id": batch["id"], "grad_enabled": torch.is_grad_enabled()}

    prefetcher = Prefetcher(DataLoader(Numbers(6), batch_size=2), preprocess, device="cpu")
    seen = _train_loop(prefetcher, call_prefetch)
    assert calls == ["cpu"] * 3
    assert [b["grad_enabled"] for b in seen] == [False] * 3
    assert torch.equal(torch.cat([b["x"] for b in seen]), torch.stack([torch.tensor([i / 2, 0.5]) for i in range(6)]))


def test_reads_ahead_without_being_asked():
    second_read = threading.Event()
    dataset = Numbers(4, on_get=lambda i: second_read.set() if i == 1 else None)
    prefetcher = Prefetcher(DataLoader(dataset, batch_size=1), device="cpu")
    it = iter(prefetcher)
    next(it)
    assert second_read.wait(10)  # batch 1 is read while the loop is still on batch 0
    prefetcher.close()


def test_after_guide_calls_it_reads_when_told():
    reads = []
    prefetcher = Prefetcher(DataLoader(Numbers(5, on_get=reads.append), batch_size=1), device="cpu")
    prefetcher.prefetch_CPU()  # before the loop: hands the timing to the caller (nothing to read yet)
    it = iter(prefetcher)
    next(it)
    assert _no_threads_left()  # the worker finishes what it was given, idles and exits
    assert reads == [0]  # nothing read ahead until prefetch_CPU is called
    prefetcher.prefetch_CPU()
    prefetcher.prefetch_GPU()
    batch = next(it)
    assert int(batch["id"]) == 1 and reads == [0, 1]
    prefetcher.close()


def test_loader_exception_reraised_with_type_and_traceback():
    prefetcher = Prefetcher(DataLoader(Numbers(6, fail_at=3), batch_size=1), device="cpu")
    seen = []
    with pytest.raises(BrokenSample, match="broken sample 3") as info:
        for batch in prefetcher:
            seen.append(int(batch["id"]))
    assert seen == [0, 1, 2]
    assert "__getitem__" in [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert _no_threads_left()


def test_early_break_leaves_no_thread_and_next_epoch_starts_over():
    prefetcher = Prefetcher(DataLoader(Numbers(30), batch_size=1), device="cpu")
    for step, _ in enumerate(prefetcher):
        prefetcher.prefetch_CPU()
        if step == 3:
            break
    # The prefetcher object is still alive; its thread stops once the pending read is done.
    assert _no_threads_left()
    assert [int(b["id"]) for b in prefetcher] == list(range(30))
    for _ in prefetcher:
        break
    del prefetcher
    gc.collect()
    assert _no_threads_left()


def test_early_break_with_worker_processes_and_context_manager():
    with Prefetcher(DataLoader(Numbers(40), batch_size=2, num_workers=1), device="cpu") as prefetcher:
        for step, _ in enumerate(prefetcher):
            if step == 1:
                break
    assert prefetcher._epoch is None
    assert _no_threads_left()


def test_worker_runs_jobs_in_order_across_idle_restarts(monkeypatch):
    monkeypatch.setattr(_Worker, "IDLE_EXIT_S", 0.01)
    worker = _Worker("accel-Prefetcher-test")
    out = []
    futures = [worker.submit(lambda i=i: out.append(i)) for i in range(5)]
    for f in futures:
        f.result(10)
    threading.Event().wait(0.1)  # long enough for the idle thread to exit
    assert worker.submit(lambda: out.append(5)).result(10) is None
    assert out == list(range(6))
    worker.close(10)


def test_bad_arguments():
    with pytest.raises(ValueError, match="data_loader"):
        Prefetcher(5)
    with pytest.raises(ValueError, match="preprocess_fn"):
        Prefetcher([], preprocess_fn="scale")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            Prefetcher([], device="cuda")


@pytest.mark.skipif(not xla_available(), reason="torch_xla is not installed")
def test_xla_device():
    import torch_xla

    device = torch_xla.device()
    prefetcher = Prefetcher([torch.ones(2) * i for i in range(3)], lambda b: b + 1, device=device)
    out = []
    for batch in prefetcher:
        assert batch.device.type == "xla"
        out.append(batch.cpu())
    assert [t.tolist() for t in out] == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("call_prefetch", [False, True], ids=["auto", "guide_calls"])
def test_cuda_side_stream_copies_are_waited_for(call_prefetch):
    host = [torch.randn(512, 1024) for _ in range(12)]
    prefetcher = Prefetcher(DataLoader(host, batch_size=None, pin_memory=False), lambda b: b * 2, device="cuda")
    results = []
    for batch in prefetcher:
        assert batch.is_cuda
        # Kernels on the current stream that read the batch at once, and a large allocation that would
        # reuse the batch's memory if record_stream were missing.
        results.append((batch @ batch.T).trace())
        scratch = torch.empty_like(batch).fill_(float("nan"))
        if call_prefetch:
            prefetcher.prefetch_CPU()
            prefetcher.prefetch_GPU()
        del scratch
    for r, h in zip(results, host):
        torch.testing.assert_close(r.cpu(), ((h * 2) @ (h * 2).T).trace(), rtol=1e-3, atol=1e-1)


# --------------------------------------------------------------------------- the CUDA branch, with fakes
# No GPU here: the CUDA primitives accel.utils.batch uses are replaced by recording fakes, and the order in
# which the Prefetcher calls them is checked against the rules of CUDA streams and the caching allocator.

@dataclasses.dataclass
class _Sample:
    image: torch.Tensor
    label: int


class _Boxes:
    """An object with tensors inside that only it knows about; moved with its own .to()."""

    def __init__(self, data, log=None):
        self.data, self.log = data, log

    def to(self, device, non_blocking=False):
        self.log("object_to", self, device)
        return _Boxes(self.data.clone(), self.log)


class _Entry(collections.namedtuple("_Entry", "op thread args")):
    def on_worker(self):
        return self.thread.startswith("accel-Prefetcher")


class _CudaFakes:
    """Recording stand-ins for Stream, Event, current_stream, the stream and device guards, the copy,
    pin_memory/is_pinned and record_stream. Every call is appended to `log` as an _Entry, in call order."""

    def __init__(self, monkeypatch):
        self.log: list[_Entry] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        self.pinned: list[torch.Tensor] = []  # tensors that count as page-locked (kept alive: ids stay unique)
        self.defaults: dict[int, object] = {}
        fakes = self

        class Stream:
            def __init__(self, device=None, priority=0):
                self.device = torch.device(device)
                self.name = f"side:{self.device.index}"
                fakes.add("new_stream", self)

            def wait_stream(self, other):
                fakes.add("wait_stream", self, other)

            def wait_event(self, event):
                fakes.add("wait_event", self, event)

            def __repr__(self):
                return self.name

        class Event:
            def record(self, stream=None):
                fakes.add("record_event", stream, self)

        class DefaultStream(Stream):
            def __init__(self, index):
                self.device, self.name = torch.device("cuda", index), f"default:{index}"

        def current_stream(device=None):
            index = fakes.current_device() if device is None else torch.device(device).index
            stack = getattr(fakes._local, "streams", [])
            if stack and stack[-1].device.index == index:
                return stack[-1]
            return fakes.defaults.setdefault(index, DefaultStream(index))

        @contextlib.contextmanager
        def use_stream(stream):
            fakes._local.__dict__.setdefault("streams", []).append(stream)
            try:
                yield
            finally:
                fakes._local.streams.pop()

        @contextlib.contextmanager
        def cuda_device(device):
            fakes._local.__dict__.setdefault("devices", []).append(torch.device(device).index)
            try:
                yield
            finally:
                fakes._local.devices.pop()

        def copy_async(t, device):
            out = t.clone()
            fakes.add("copy", t, out, current_stream(device), fakes.current_device(), torch.device(device))
            return out

        def pin_memory(t, *args):
            out = t.clone()
            fakes.pinned.append(out)
            fakes.add("pin", t, out, fakes.current_device())
            return out

        def is_pinned(t, *args):
            return any(t is p for p in fakes.pinned)

        def record_stream(t, stream):
            fakes.add("record_stream", t, stream)

        for name, fake in [("Stream", Stream), ("Event", Event), ("current_stream", current_stream),
                           ("use_stream", use_stream), ("cuda_device", cuda_device), ("copy_async", copy_async)]:
            monkeypatch.setattr(batch_module, name, fake)
        monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
        monkeypatch.setattr(torch.Tensor, "is_pinned", is_pinned)
        monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def current_device(self):
        devices = getattr(self._local, "devices", [])
        return devices[-1] if devices else 0

    def add(self, op, *args):
        with self._lock:
            self.log.append(_Entry(op, threading.current_thread().name, args))
            return len(self.log) - 1

    def find(self, op, pred=lambda e: True):
        return [(i, e) for i, e in enumerate(self.log) if e.op == op and pred(e)]

    def only(self, op, pred):
        found = self.find(op, pred)
        assert len(found) == 1, (op, found)
        return found[0]


def _nested_batches(n, log):
    return [{"tokens": torch.arange(4) + k,
             "parts": [torch.full((2,), float(k)), (torch.tensor(k), "caption", 7)],
             "pair": Pair(torch.ones(3) * k, [torch.zeros(1) - k]),
             "sample": _Sample(torch.eye(2) * k, label=k),
             "boxes": _Boxes(torch.tensor([k, k + 1]), log),
             "name": f"batch{k}"} for k in range(n)]


def _event_after(fakes, copies, side, consumer):
    """(log index of the event recorded after the copies at `copies`, log index of the wait for it);
    checks the event is recorded on `side` by the background thread, after the last of those copies and
    before any later copy, and waited for once, on `consumer`, by the training thread."""
    recorded_at, record = min((i, e) for i, e in fakes.find("record_event") if i > max(copies))
    assert record.args[0] is side and record.on_worker()
    assert all(i > recorded_at for i, _ in fakes.find("copy") if i > max(copies))
    waited_at, wait = fakes.only("wait_event", lambda e: e.args[1] is record.args[1])
    assert wait.args[0] is consumer and wait.thread == "MainThread"
    return recorded_at, waited_at


def _assert_same_values(got, expected):
    assert type(got) is dict and got.keys() == expected.keys()
    assert got["name"] == expected["name"] and got["parts"][1][1:] == ("caption", 7)
    assert type(got["pair"]) is Pair and type(got["sample"]) is _Sample and got["sample"].label == expected["sample"].label
    assert type(got["parts"]) is list and type(got["parts"][1]) is tuple
    torch.testing.assert_close(iter_tensors(got), iter_tensors(expected), rtol=0, atol=0)
    assert torch.equal(got["boxes"].data, expected["boxes"].data)


@pytest.mark.parametrize("call_prefetch", [False, True], ids=["auto", "guide_calls"])
def test_cuda_branch_order_of_operations(monkeypatch, call_prefetch):
    fakes = _CudaFakes(monkeypatch)
    batches = _nested_batches(3, fakes.add)
    already_pinned = batches[1]["tokens"]
    fakes.pinned.append(already_pinned)  # e.g. from DataLoader(pin_memory=True): must not be pinned again
    prefetcher = Prefetcher(batches, device="cuda:1")
    assert prefetcher.device == torch.device("cuda", 1)
    (side,) = fakes.only("new_stream", lambda e: True)[1].args
    assert side.device == torch.device("cuda", 1)

    seen = []
    for batch in prefetcher:
        fakes.add("loop_gets", batch)
        seen.append(batch)
        if call_prefetch:
            prefetcher.prefetch_CPU()
            prefetcher.prefetch_GPU()
    assert _no_threads_left()
    assert len(seen) == 3
    consumer = fakes.defaults[1]

    for k, (host, got) in enumerate(zip(batches, seen)):
        _assert_same_values(got, host)
        yielded_at, _ = fakes.only("loop_gets", lambda e: e.args[0] is got)
        leaves = iter_tensors(got)
        host_leaves = iter_tensors(host)
        assert len(leaves) == 6 and all(not any(t is h for h in host_leaves) for t in leaves)

        copies = []
        for leaf, source in zip(leaves, host_leaves):
            # Each device tensor was copied on the side stream of cuda:1, by the background thread, from
            # page-locked memory: pinned there too (under cuda:1), unless it already was.
            at, copy = fakes.only("copy", lambda e, leaf=leaf: e.args[1] is leaf)
            src, _, stream, current_device, target = copy.args
            assert stream is side and current_device == 1 and target == torch.device("cuda", 1)
            assert copy.on_worker()
            if source is already_pinned:
                assert src is source and fakes.find("pin", lambda e, s=source: e.args[0] is s) == []
            else:
                pinned_at, pin = fakes.only("pin", lambda e, s=src: e.args[1] is s)
                assert pin.args[0] is source and pin.on_worker() and pin.args[2] == 1 and pinned_at < at
            copies.append(at)

        # The event is recorded on the side stream after the batch's last copy, and the training thread's
        # stream waits on exactly that event before the batch reaches the loop ...
        recorded_at, waited_at = _event_after(fakes, copies, side, consumer)
        assert recorded_at < waited_at < yielded_at
        # ... and every tensor is record_stream()-ed on that stream, after the wait, before the loop gets it.
        for leaf in leaves:
            at, rec = fakes.only("record_stream", lambda e, leaf=leaf: e.args[0] is leaf)
            assert rec.args[1] is consumer and waited_at < at < yielded_at and rec.thread == "MainThread"
        # The object the copy cannot look into is moved by the training thread after the wait.
        moved_at, moved = fakes.only("object_to", lambda e, b=host["boxes"]: e.args[0] is b)
        assert moved.thread == "MainThread" and waited_at < moved_at < yielded_at
        assert moved.args[1] == torch.device("cuda", 1)
    assert len(fakes.find("record_stream")) == 3 * 6


def test_cuda_branch_preprocess_runs_after_the_wait_in_the_training_thread(monkeypatch):
    fakes = _CudaFakes(monkeypatch)

    def preprocess(batch):
        fakes.add("preprocess", batch, torch.is_grad_enabled())
        return {"scaled": batch["x"] * 10, "id": batch["id"]}

    prefetcher = Prefetcher(DataLoader(Numbers(4), batch_size=2), preprocess, device="cuda:1")
    seen = []
    for batch in prefetcher:
        fakes.add("loop_gets", batch)
        seen.append(batch)
    assert [b["id"].tolist() for b in seen] == [[0, 1], [2, 3]]
    torch.testing.assert_close(seen[1]["scaled"], torch.tensor([[20.0, 10.0], [30.0, 10.0]]))
    for got in seen:
        yielded_at, _ = fakes.only("loop_gets", lambda e, got=got: e.args[0] is got)
        at, call = fakes.only("preprocess", lambda e, got=got: e.args[0]["id"] is got["id"])
        claimed, grad_enabled = call.args
        assert call.thread == "MainThread" and not grad_enabled and at < yielded_at
        # it received the device copies, after the stream waited and took ownership of them
        for leaf in iter_tensors(claimed):
            copied_at, _ = fakes.only("copy", lambda e, leaf=leaf: e.args[1] is leaf)
            recorded_at, _ = fakes.only("record_stream", lambda e, leaf=leaf: e.args[0] is leaf)
            assert copied_at < recorded_at < at
        copies = [fakes.only("copy", lambda e, leaf=leaf: e.args[1] is leaf)[0] for leaf in iter_tensors(claimed)]
        _, waited_at = _event_after(fakes, copies, fakes.only("new_stream", lambda e: True)[1].args[0],
                                    fakes.defaults[1])
        assert waited_at < at


def test_cuda_branch_loader_error_and_early_break(monkeypatch):
    fakes = _CudaFakes(monkeypatch)
    prefetcher = Prefetcher(DataLoader(Numbers(6, fail_at=3), batch_size=1), device="cuda:0")
    with pytest.raises(BrokenSample, match="broken sample 3"):
        for _ in prefetcher:
            pass
    assert len(fakes.find("wait_event")) == 3 and _no_threads_left()
    for step, _ in enumerate(prefetcher):
        if step == 1:
            break
    prefetcher.close()
    assert _no_threads_left()


# --------------------------------------------------------------------------- the CUDA branch, for real

class _GeneratedBatches:
    """Re-iterable; each batch is built as it is read, i.e. in the Prefetcher's background thread."""

    def __init__(self, make, n):
        self.make, self.n = make, n

    def __iter__(self):
        return (self.make(k) for k in range(self.n))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_nested_batches_from_pageable_pinned_and_gpu_tensors():
    def make(k):
        return {"pageable": torch.arange(4096.0) + k,
                "pinned": (torch.arange(4096.0) * k).pin_memory(),
                # written by a kernel queued in the loader's thread: the copy stream must wait for it
                "on_gpu": torch.full((4096,), float(k), device="cuda").mul_(2),
                "sample": _Sample(torch.eye(3) * k, label=k), "name": f"b{k}"}

    prefetcher = Prefetcher(_GeneratedBatches(make, 5), lambda b: dict(b, doubled=b["pageable"] * 2), device="cuda")
    for k, batch in enumerate(prefetcher):
        expected = make(k)
        assert batch["name"] == f"b{k}" and type(batch["sample"]) is _Sample and batch["sample"].label == k
        for key in ("pageable", "pinned", "on_gpu"):
            assert batch[key].is_cuda
            torch.testing.assert_close(batch[key].cpu(), expected[key].cpu(), rtol=0, atol=0)
        torch.testing.assert_close(batch["sample"].image.cpu(), expected["sample"].image, rtol=0, atol=0)
        torch.testing.assert_close(batch["doubled"].cpu(), expected["pageable"] * 2, rtol=0, atol=0)
    assert k == 4


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_second_device_is_honoured():
    previous = torch.cuda.current_device()
    prefetcher = Prefetcher([torch.ones(8) * k for k in range(3)], lambda b: b + 1, device="cuda:1")
    out = []
    for batch in prefetcher:
        assert batch.device == torch.device("cuda", 1)
        out.append(batch.cpu())
    assert torch.cuda.current_device() == previous
    assert [float(b[0]) for b in out] == [1.0, 2.0, 3.0]
