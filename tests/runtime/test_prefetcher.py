"""Prefetcher (the guide's IO optimisation): batches on the device, in order, with or without the
prefetch_CPU/prefetch_GPU calls; preprocess_fn, errors, early exit, epochs."""
import gc
import random
import threading
import traceback

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, default_collate

from accel.runtime.io.prefetcher import Prefetcher, _Worker
from accel.utils.batch import iter_tensors, move_to_device
from accel.utils.xla import xla_available
from tests._cuda_fakes import (
    CudaFakes,
    Sample,
    assert_copied_on_side_stream_of_cuda1,
    event_after,
    nested_batches_one_pinned,
)
from tests._datasets import BrokenSample, Numbers


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


@pytest.mark.parametrize("background", [True, False], ids=["thread", "inline"])
@pytest.mark.parametrize("call_prefetch", [False, True], ids=["auto", "guide_calls"])
def test_every_batch_once_in_order(call_prefetch, background):
    loader = DataLoader(Numbers(11), batch_size=3)
    prefetcher = Prefetcher(loader, background=background)
    # an index-less "cuda" resolves to the current device, as torch itself places tensors
    expected = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    assert prefetcher.device == expected
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
    reads = []  # (index, thread) of every sample read
    third_read = threading.Event()

    def on_get(i):
        reads.append((i, threading.current_thread().name))
        if i == 2:
            third_read.set()

    prefetcher = Prefetcher(DataLoader(Numbers(4, on_get=on_get), batch_size=1), device="cpu", background=True)
    it = iter(prefetcher)
    next(it), next(it)
    assert third_read.wait(10)  # batch 2 is read while the loop is still on batch 1
    # the first two when the loop asked for them (the second is the probe for random draws), then ahead
    assert reads[:2] == [(0, "MainThread"), (1, "MainThread")] and reads[2] == (2, "accel-Prefetcher")
    prefetcher.close()


def test_guide_calls_keep_the_read_ahead():
    # Called as the guide shows, prefetch_CPU/prefetch_GPU must not hand the timing to the caller: the
    # next batch is still read while the loop works on this one, before any call is made.
    read = {i: threading.Event() for i in range(5)}
    prefetcher = Prefetcher(DataLoader(Numbers(5, on_get=lambda i: read[i].set()), batch_size=1), device="cpu",
                            background=True)
    for step, batch in enumerate(prefetcher):
        assert int(batch["id"]) == step
        if 1 <= step < 4:  # from the probe on (batch 1)
            assert read[step + 1].wait(10), f"batch {step + 1} was not read ahead during step {step}"
        prefetcher.prefetch_CPU()
        prefetcher.prefetch_GPU()
    assert _no_threads_left()


def test_inline_reads_one_batch_ahead_in_the_training_thread():
    reads = []  # (index, thread) of every sample read
    dataset = Numbers(5, on_get=lambda i: reads.append((i, threading.current_thread().name)))
    prefetcher = Prefetcher(DataLoader(dataset, batch_size=1), device="cpu", background=False)
    seen = []
    for batch in prefetcher:
        # from batch 1 (the probe) on, batch k arrives with batch k + 1 read already
        seen.append((int(batch["id"]), len(reads)))
        prefetcher.prefetch_CPU()  # the guide's calls find the next batch under way: they read nothing more
        prefetcher.prefetch_GPU()
        assert len(reads) == seen[-1][1]
    assert seen == [(0, 1), (1, 3), (2, 4), (3, 5), (4, 5)]
    assert {thread for _, thread in reads} == {threading.current_thread().name}
    assert _prefetch_threads() == []


class _NoisyNumbers(Numbers):
    """Numbers whose samples get noise from one of the host's global RNGs, as random augmentation does."""

    def __init__(self, n, source, on_get=None):
        super().__init__(n, on_get=on_get)
        self.source = source

    def __getitem__(self, i):
        sample = super().__getitem__(i)
        noise = {"torch": lambda: float(torch.rand(())), "python": random.random,
                 "numpy": lambda: float(np.random.rand())}[self.source]()
        sample["x"] = sample["x"] + noise
        return sample


def _masking_collate(samples):
    """default_collate, then a random mask drawn from torch's generator (as an MLM collator masks tokens)."""
    batch = default_collate(samples)
    batch["x"] = batch["x"] * (torch.rand(batch["x"].shape) > 0.3)
    return batch


def _steps_drawing_random_numbers(batches) -> list:
    """A training loop's use of each batch that draws from every host RNG itself (CPU dropout and the like)."""
    out = []
    for batch in batches:
        kept = torch.nn.functional.dropout(batch["x"], 0.5, training=True)
        out.append((batch["x"].clone(), kept * random.random() * float(np.random.rand())))
    return out


@pytest.mark.parametrize("background", [True, False], ids=["thread", "inline"])
@pytest.mark.parametrize("source", ["torch_collate", "torch", "python", "numpy", "preprocess_fn"])
def test_loaders_that_draw_random_numbers_are_read_when_asked(source, background):
    # Reads that draw from the global RNGs happen in the training thread when the loop asks for each batch, as
    # without a Prefetcher: the loop's results equal a plain loop's over the DataLoader, bit for bit.
    def build(on_get=None):
        dataset = _NoisyNumbers(12, source, on_get) if source in ("torch", "python", "numpy") else Numbers(12, on_get=on_get)
        return DataLoader(dataset, batch_size=2, shuffle=True,
                          collate_fn=_masking_collate if source == "torch_collate" else None)

    def preprocess(batch):
        return {**batch, "x": batch["x"] + torch.randn(batch["x"].shape)}

    def seeded():
        torch.manual_seed(0), random.seed(0), np.random.seed(0)

    seeded()
    plain = build()
    want = _steps_drawing_random_numbers(map(preprocess, plain) if source == "preprocess_fn" else plain)
    reads = []
    seeded()
    prefetcher = Prefetcher(build(on_get=lambda i: reads.append(threading.current_thread().name)),
                            preprocess_fn=preprocess if source == "preprocess_fn" else None, device="cpu",
                            background=background)
    taken = []
    got = _steps_drawing_random_numbers(batch for batch in prefetcher if not taken.append(len(reads)))
    assert len(got) == len(want) == 6
    for (x, kept), (x_ref, kept_ref) in zip(got, want):
        assert torch.equal(x, x_ref) and torch.equal(kept, kept_ref)
    assert taken == [2 * (k + 1) for k in range(6)]  # nothing read ahead: each batch read when asked
    assert set(reads) == {"MainThread"}
    assert _no_threads_left()


def test_shuffled_loader_that_draws_nothing_else_is_read_ahead():
    # A shuffling sampler draws its seed in the first read only (the probe is the second): the rest is read
    # ahead, in the same order as the plain DataLoader's under the same seed.
    reads = []
    torch.manual_seed(3)
    want = [int(i) for batch in DataLoader(Numbers(8), batch_size=1, shuffle=True) for i in batch["id"]]
    torch.manual_seed(3)
    loader = DataLoader(Numbers(8, on_get=lambda i: reads.append(threading.current_thread().name)), batch_size=1,
                        shuffle=True)
    assert [int(b["id"]) for b in Prefetcher(loader, device="cpu", background=True)] == want
    assert reads[:2] == ["MainThread"] * 2 and set(reads[2:]) == {"accel-Prefetcher"}
    assert _no_threads_left()


def test_nested_loops_see_every_pair():
    prefetcher = Prefetcher(DataLoader(Numbers(5), batch_size=1), device="cpu", background=True)
    pairs = []
    for a in prefetcher:
        for b in prefetcher:
            pairs.append((int(a["id"]), int(b["id"])))
            prefetcher.prefetch_CPU()  # reaches every live pass; harmless to both
    assert pairs == [(i, j) for i in range(5) for j in range(5)]
    assert _no_threads_left()


def test_close_stops_every_pass():
    prefetcher = Prefetcher(DataLoader(Numbers(20), batch_size=1), device="cpu", background=True)
    first, second = iter(prefetcher), iter(prefetcher)
    assert int(next(first)["id"]) == 0 and int(next(second)["id"]) == 0
    prefetcher.close()
    assert list(first) == [] and list(second) == []
    assert _no_threads_left()


@pytest.mark.parametrize("background", [True, False], ids=["thread", "inline"])
def test_loader_exception_reraised_with_type_and_traceback(background):
    prefetcher = Prefetcher(DataLoader(Numbers(6, fail_at=3), batch_size=1), device="cpu", background=background)
    seen = []
    with pytest.raises(BrokenSample, match="broken sample 3") as info:
        for batch in prefetcher:
            seen.append(int(batch["id"]))
    assert seen == [0, 1, 2]
    assert "__getitem__" in [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert _no_threads_left()


def test_early_break_leaves_no_thread_and_next_epoch_starts_over():
    prefetcher = Prefetcher(DataLoader(Numbers(30), batch_size=1), device="cpu", background=True)
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
    with Prefetcher(DataLoader(Numbers(40), batch_size=2, num_workers=1), device="cpu", background=True) as prefetcher:
        for step, _ in enumerate(prefetcher):
            if step == 1:
                break
    assert len(prefetcher._passes) == 0  # closed, and dropped with the loop
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


def test_reads_on_a_thread_by_default_except_on_the_cpu(monkeypatch):
    # The CPU's cores run the step's own threads; a cuda step leaves the host's cores to the reader.
    assert Prefetcher([], device="cpu").background is False
    CudaFakes(monkeypatch, worker_prefix="accel-Prefetcher")
    assert Prefetcher([], device="cuda:1").background is True


def test_bad_arguments():
    with pytest.raises(ValueError, match="data_loader"):
        Prefetcher(5)
    with pytest.raises(ValueError, match="preprocess_fn"):
        Prefetcher([], preprocess_fn="scale")
    with pytest.raises(TypeError, match="background"):
        Prefetcher([], background=1)
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
@pytest.mark.parametrize("background", [True, False], ids=["thread", "inline"])
@pytest.mark.parametrize("call_prefetch", [False, True], ids=["auto", "guide_calls"])
def test_cuda_side_stream_copies_are_waited_for(call_prefetch, background):
    host = [torch.randn(512, 1024) for _ in range(12)]
    prefetcher = Prefetcher(DataLoader(host, batch_size=None, pin_memory=False), lambda b: b * 2, device="cuda",
                            background=background)
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
# See tests/_cuda_fakes.py: the order of the CUDA calls is checked on machines without a GPU.

@pytest.mark.parametrize("call_prefetch", [False, True], ids=["auto", "guide_calls"])
def test_cuda_branch_order_of_operations(monkeypatch, call_prefetch):
    fakes = CudaFakes(monkeypatch, worker_prefix="accel-Prefetcher")
    batches, already_pinned = nested_batches_one_pinned(fakes)
    prefetcher = Prefetcher(batches, device="cuda:1")
    assert prefetcher.device == torch.device("cuda", 1)

    seen = []
    for batch in prefetcher:
        fakes.add("loop_gets", batch)
        seen.append(batch)
        if call_prefetch:
            prefetcher.prefetch_CPU()
            prefetcher.prefetch_GPU()
    assert _no_threads_left()
    # the first two batches are read when the loop asks (the second probes for random draws)
    assert_copied_on_side_stream_of_cuda1(fakes, batches, seen, already_pinned, read_when_asked=2)


def test_cuda_branch_preprocess_runs_after_the_wait_in_the_training_thread(monkeypatch):
    fakes = CudaFakes(monkeypatch, worker_prefix="accel-Prefetcher")

    def preprocess(batch):
        fakes.add("preprocess", batch, torch.is_grad_enabled())
        return {"scaled": batch["x"] * 10, "id": batch["id"]}

    prefetcher = Prefetcher(DataLoader(Numbers(6), batch_size=2), preprocess, device="cuda:1")
    seen = []
    for batch in prefetcher:
        fakes.add("loop_gets", batch)
        seen.append(batch)
    assert [b["id"].tolist() for b in seen] == [[0, 1], [2, 3], [4, 5]]
    torch.testing.assert_close(seen[1]["scaled"], torch.tensor([[20.0, 10.0], [30.0, 10.0]]))
    for k, got in enumerate(seen):  # the first two batches of a pass are read when the loop asks for them
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
        _, waited_at = event_after(fakes, copies, fakes.only("new_stream", lambda e: True)[1].args[0],
                                    fakes.defaults[1], by_worker=k >= 2)
        assert waited_at < at


def test_cuda_branch_inline_copies_one_batch_ahead(monkeypatch):
    fakes = CudaFakes(monkeypatch, worker_prefix="accel-Prefetcher")
    prefetcher = Prefetcher(DataLoader(Numbers(4), batch_size=1), device="cuda:1", background=False)
    seen = []
    for batch in prefetcher:
        fakes.add("loop_gets", batch)
        seen.append(batch)
    assert [int(b["id"]) for b in seen] == [0, 1, 2, 3]
    assert fakes.log and not any(e.on_worker() or e.thread != "MainThread" for e in fakes.log)
    assert _prefetch_threads() == []
    for k, batch in enumerate(seen):
        got_at, _ = fakes.only("loop_gets", lambda e, b=batch: e.args[0] is b)
        copied_at, _ = fakes.only("copy", lambda e, x=batch["x"]: e.args[1] is x)
        waited = [i for i, _ in fakes.find("wait_event")]
        assert copied_at < got_at and any(copied_at < i < got_at for i in waited)
        if 1 <= k < len(seen) - 1:  # from the probe (batch 1) on, the next batch's copy is queued first
            next_at, _ = fakes.only("copy", lambda e, x=seen[k + 1]["x"]: e.args[1] is x)
            assert next_at < got_at


def test_cuda_branch_loader_error_and_early_break(monkeypatch):
    fakes = CudaFakes(monkeypatch, worker_prefix="accel-Prefetcher")
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
                "sample": Sample(torch.eye(3) * k, label=k), "name": f"b{k}"}

    prefetcher = Prefetcher(_GeneratedBatches(make, 5), lambda b: dict(b, doubled=b["pageable"] * 2), device="cuda")
    for k, batch in enumerate(prefetcher):
        expected = make(k)
        assert batch["name"] == f"b{k}" and type(batch["sample"]) is Sample and batch["sample"].label == k
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
