"""MpDeviceLoader: every batch once, in order, on the device; errors, early exit, epochs, XLA steps."""
import dataclasses
import gc
import threading
import traceback

import pytest
import torch
from torch.utils.data import DataLoader, default_collate

import accel.data.device_loader as device_loader_module
from accel.data import MpDeviceLoader
from accel.utils.xla import xla_available
from tests._cuda_fakes import CudaFakes, assert_copied_on_side_stream_of_cuda1, nested_batches_one_pinned
from tests._datasets import BrokenSample, Numbers, Pair


def _loader_threads():
    return [t for t in threading.enumerate() if t.name.startswith("accel-MpDeviceLoader")]


def _wait_for_no_loader_threads():
    for t in _loader_threads():
        t.join(10)
    return _loader_threads()


def test_every_batch_once_in_order_with_container_types():
    loader = DataLoader(Numbers(10), batch_size=3)
    device_loader = MpDeviceLoader(loader, "cpu")
    assert len(device_loader) == 4
    got = list(device_loader)
    expected = list(loader)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert type(a) is dict and isinstance(a["y"], Pair) and isinstance(a["y"].y, list)
        torch.testing.assert_close(a, b)
    assert _wait_for_no_loader_threads() == []


@dataclasses.dataclass(frozen=True)
class _Features:
    pixels: torch.Tensor
    boxes: list
    source: str


def test_nested_containers_and_dataclasses_are_moved_with_their_types():
    # "meta" is a device other than the host's, so every tensor visibly moves (and nothing is computed).
    batches = [{"features": _Features(torch.ones(2, 2) * k, [torch.zeros(3), Pair(torch.tensor(k), 5)], "cam"),
                "ids": (torch.arange(3), "text")} for k in range(2)]
    got = list(MpDeviceLoader(batches, "meta"))
    assert len(got) == 2
    for batch in got:
        features = batch["features"]
        assert type(features) is _Features and features.source == "cam" and batch["ids"][1] == "text"
        assert type(features.boxes) is list and type(features.boxes[1]) is Pair and features.boxes[1].y == 5
        assert [t.device.type for t in (features.pixels, features.boxes[0], features.boxes[1].x, batch["ids"][0])] \
            == ["meta"] * 4
        assert features.pixels.shape == (2, 2) and batch["ids"][0].dtype == torch.int64
    assert batches[0]["features"].pixels.device.type == "cpu"  # the loader's own batch is left alone


def test_dataset_and_loader_pass_through():
    loader = DataLoader(Numbers(7), batch_size=2)
    device_loader = MpDeviceLoader(loader, torch.device("cpu"))
    assert device_loader.loader is loader
    assert len(device_loader.dataset) == 7
    assert device_loader.batch_size == 2


def test_batch_encoding_keeps_its_type():
    transformers = pytest.importorskip("transformers")
    batches = [transformers.BatchEncoding({"input_ids": torch.arange(4).view(1, 4)}) for _ in range(2)]
    got = list(MpDeviceLoader(batches, "cpu"))
    assert all(type(b) is transformers.BatchEncoding for b in got)
    assert torch.equal(got[1]["input_ids"], torch.arange(4).view(1, 4))


def test_reads_ahead_of_the_training_loop():
    reads = []
    third_read = threading.Event()

    def on_get(i):
        reads.append(threading.current_thread().name)
        if i == 2:
            third_read.set()

    iterator = iter(MpDeviceLoader(DataLoader(Numbers(6, on_get=on_get), batch_size=1), "cpu"))
    next(iterator), next(iterator)
    # The loop has not asked for batch 2 yet; the background thread reads it anyway. The first two were read
    # when the loop asked (the second probes for random draws, see the next test).
    assert third_read.wait(10)
    assert reads[:2] == ["MainThread"] * 2 and reads[2] == "accel-MpDeviceLoader-read"
    iterator.close()


def _noisy_collate(samples):
    """default_collate, then noise from torch's generator: random augmentation with num_workers=0."""
    batch = default_collate(samples)
    batch["x"] = batch["x"] + torch.rand(batch["x"].shape)
    return batch


def test_loader_that_draws_random_numbers_is_read_when_asked():
    # Its batches and the loop's own draws equal a plain loop's over the DataLoader under the same seed.
    def steps(batches):
        return [(b["x"].clone(), torch.rand(2)) for b in batches]

    torch.manual_seed(0)
    want = steps(DataLoader(Numbers(10), batch_size=2, shuffle=True, collate_fn=_noisy_collate))
    torch.manual_seed(0)
    reads = []
    loader = DataLoader(Numbers(10, on_get=lambda i: reads.append(threading.current_thread().name)), batch_size=2,
                        shuffle=True, collate_fn=_noisy_collate)
    got = steps(MpDeviceLoader(loader, "cpu"))
    assert len(got) == len(want) == 5
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(got, want))
    assert set(reads) == {"MainThread"}
    assert _wait_for_no_loader_threads() == []


def test_loader_exception_reraised_with_type_and_traceback():
    device_loader = MpDeviceLoader(DataLoader(Numbers(6, fail_at=4), batch_size=2), "cpu")
    seen = []
    with pytest.raises(BrokenSample, match="broken sample 4") as info:
        for batch in device_loader:
            seen.append(batch["x"])
    assert len(seen) == 2  # the batches before the broken one were delivered
    frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert "__getitem__" in frames  # the dataset's own frame, raised in the worker thread
    assert _wait_for_no_loader_threads() == []


def test_early_break_stops_threads_and_new_epoch_restarts():
    device_loader = MpDeviceLoader(DataLoader(Numbers(50), batch_size=1), "cpu",
                                   loader_prefetch_size=2, device_prefetch_size=1)
    for step, _ in enumerate(device_loader):
        if step == 2:
            break
    gc.collect()
    assert _wait_for_no_loader_threads() == []
    # A new pass starts from the first batch again and sees everything.
    assert [int(b["y"].x) for b in device_loader] == list(range(50))


def test_passes_are_independent_and_close_stops_every_one():
    device_loader = MpDeviceLoader(DataLoader(Numbers(20), batch_size=1), "cpu", device_prefetch_size=1)
    first = iter(device_loader)
    assert int(next(first)["id"]) == 0
    second = iter(device_loader)  # a second pass, as a DataLoader's: the first goes on where it was
    assert [int(b["id"]) for b in second] == list(range(20))
    assert [int(b["id"]) for b in first] == list(range(1, 20))
    third, fourth = iter(device_loader), iter(device_loader)
    device_loader.close()
    assert list(third) == [] and list(fourth) == []
    assert _wait_for_no_loader_threads() == []


def test_nested_loops_see_every_pair():
    device_loader = MpDeviceLoader(DataLoader(Numbers(5), batch_size=1), "cpu")
    pairs = [(int(a["id"]), int(b["id"])) for a in device_loader for b in device_loader]
    assert pairs == [(i, j) for i in range(5) for j in range(5)]
    gc.collect()
    assert _wait_for_no_loader_threads() == []


def test_early_break_with_worker_processes_does_not_hang():
    loader = DataLoader(Numbers(40), batch_size=2, num_workers=1)
    for step, _ in enumerate(MpDeviceLoader(loader, "cpu")):
        if step == 1:
            break
    gc.collect()
    assert _wait_for_no_loader_threads() == []


def test_bad_options():
    with pytest.raises(ValueError, match="unsupported option"):
        MpDeviceLoader([], "cpu", batchdim=1)
    with pytest.raises(ValueError, match="device_prefetch_size"):
        MpDeviceLoader([], "cpu", device_prefetch_size=0)
    with pytest.raises(ValueError, match="loader must be an iterable"):
        MpDeviceLoader(3, "cpu")
    with pytest.raises(ValueError, match="device"):
        MpDeviceLoader([], "not-a-device")


def test_marks_the_step_on_xla_devices_only(monkeypatch):
    calls = []
    monkeypatch.setattr(device_loader_module, "mark_step", lambda: calls.append(1))
    list(MpDeviceLoader([torch.zeros(1)] * 3, "cpu"))
    assert calls == []


@pytest.mark.skipif(not xla_available(), reason="torch_xla is not installed")
def test_xla_batches_on_device_and_step_marked_per_batch(monkeypatch):
    import torch_xla

    real_mark_step = device_loader_module.mark_step
    calls = []

    def counting_mark_step():
        calls.append(1)
        real_mark_step()

    monkeypatch.setattr(device_loader_module, "mark_step", counting_mark_step)
    device = torch_xla.device()
    batches = [{"x": torch.full((2,), float(i)), "n": i} for i in range(3)]
    device_loader = MpDeviceLoader(batches, device)
    got = []
    for batch in device_loader:
        assert batch["x"].device.type == "xla"
        got.append((batch["x"] * 2).cpu())
    # Marked before each of the 3 batches and once more when the loop ends, as torch_xla's loader does.
    assert len(calls) == 4
    for i, x in enumerate(got):
        assert torch.equal(x, torch.full((2,), 2.0 * i))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_batches_match_host_batches():
    host = [torch.randn(256, 1024) for _ in range(8)]
    device_loader = MpDeviceLoader(host, "cuda")
    for h, d in zip(host, device_loader):
        assert d.is_cuda
        # Work queued on the current stream right away: correct only if it waits for the side-stream copy.
        d.mul_(2).add_(1)
        torch.testing.assert_close(d.cpu(), h * 2 + 1)


def test_cuda_copies_go_through_the_prefetchers_side_stream_copy(monkeypatch):
    # No GPU here: tests/_cuda_fakes.py logs the CUDA calls, and the loader must make the same ones, in the
    # same order, as the Prefetcher (pinned and copied on cuda:1 in the copy thread, from the third batch on,
    # claimed in this one).
    fakes = CudaFakes(monkeypatch, worker_prefix="accel-MpDeviceLoader")
    batches, already_pinned = nested_batches_one_pinned(fakes)
    seen = []
    for batch in MpDeviceLoader(batches, "cuda:1", device_prefetch_size=1):
        fakes.add("loop_gets", batch)
        seen.append(batch)
    assert _wait_for_no_loader_threads() == []
    assert_copied_on_side_stream_of_cuda1(fakes, batches, seen, already_pinned, read_when_asked=2)
