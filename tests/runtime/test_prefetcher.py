"""Prefetcher (the guide's IO optimisation): batches on the device, in order, with or without the
prefetch_CPU/prefetch_GPU calls; preprocess_fn, errors, early exit, epochs."""
import gc
import threading
import traceback

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from accel.runtime.io.prefetcher import Prefetcher, _Worker
from accel.utils.xla import xla_available


def _prefetch_threads():
    return [t for t in threading.enumerate() if t.name.startswith("accel-Prefetcher")]


def _no_threads_left():
    for t in _prefetch_threads():
        t.join(10)
    return _prefetch_threads() == []


class _Numbers(Dataset):
    def __init__(self, n, fail_at=None, on_get=None):
        self.n, self.fail_at, self.on_get = n, fail_at, on_get

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.on_get is not None:
            self.on_get(i)
        if i == self.fail_at:
            raise IndexError(f"unreadable sample {i}")
        return {"x": torch.tensor([float(i), 1.0]), "id": torch.tensor(i)}


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
    loader = DataLoader(_Numbers(11), batch_size=3)
    prefetcher = Prefetcher(loader)
    assert prefetcher.device == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert len(prefetcher) == 4
    seen = _train_loop(prefetcher, call_prefetch)
    assert len(seen) == 4
    for got, expected in zip(seen, loader):
        assert got["x"].device.type == prefetcher.device.type
        torch.testing.assert_close(got, {k: v.to(prefetcher.device) for k, v in expected.items()})
    assert _no_threads_left()


@pytest.mark.parametrize("call_prefetch", [False, True], ids=["auto", "guide_calls"])
def test_preprocess_fn_runs_on_each_device_batch(call_prefetch):
    calls = []

    def preprocess(batch):
        calls.append(batch["x"].device.type)
        return {"x": batch["x"] / 2, "id": batch["id"]}

    prefetcher = Prefetcher(DataLoader(_Numbers(6), batch_size=2), preprocess, device="cpu")
    seen = _train_loop(prefetcher, call_prefetch)
    assert calls == ["cpu"] * 3
    assert torch.equal(torch.cat([b["x"] for b in seen]), torch.stack([torch.tensor([i / 2, 0.5]) for i in range(6)]))


def test_reads_ahead_without_being_asked():
    second_read = threading.Event()
    dataset = _Numbers(4, on_get=lambda i: second_read.set() if i == 1 else None)
    prefetcher = Prefetcher(DataLoader(dataset, batch_size=1), device="cpu")
    it = iter(prefetcher)
    next(it)
    assert second_read.wait(10)  # batch 1 is read while the loop is still on batch 0
    prefetcher.close()


def test_after_guide_calls_it_reads_when_told():
    reads = []
    prefetcher = Prefetcher(DataLoader(_Numbers(5, on_get=reads.append), batch_size=1), device="cpu")
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
    prefetcher = Prefetcher(DataLoader(_Numbers(6, fail_at=3), batch_size=1), device="cpu")
    seen = []
    with pytest.raises(IndexError, match="unreadable sample 3") as info:
        for batch in prefetcher:
            seen.append(int(batch["id"]))
    assert seen == [0, 1, 2]
    assert "__getitem__" in [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert _no_threads_left()


def test_early_break_leaves_no_thread_and_next_epoch_starts_over():
    prefetcher = Prefetcher(DataLoader(_Numbers(30), batch_size=1), device="cpu")
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
    with Prefetcher(DataLoader(_Numbers(40), batch_size=2, num_workers=1), device="cpu") as prefetcher:
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
