"""Recording fakes of the CUDA primitives that accel.utils.batch.SideStreamCopy uses, and the checks both
loaders that copy through it (Prefetcher, MpDeviceLoader) must pass.

No GPU here: Stream, Event, current_stream, the stream and device guards, the copy, pin_memory/is_pinned and
record_stream are replaced by fakes that log every call, and the order of the calls is checked against the
rules of CUDA streams and the caching allocator.
"""
import collections
import contextlib
import dataclasses
import threading

import torch

import accel.utils.batch as batch_module
from accel.utils.batch import iter_tensors
from tests._datasets import Pair


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    label: int


class Boxes:
    """An object with tensors inside that only it knows about; moved with its own .to()."""

    def __init__(self, data, log=None):
        self.data, self.log = data, log

    def to(self, device, non_blocking=False):
        self.log("object_to", self, device)
        return Boxes(self.data.clone(), self.log)


class Entry(collections.namedtuple("Entry", "op thread args worker")):
    def on_worker(self):
        """Whether the call was made by one of the background threads of the loader under test."""
        return self.worker


class CudaFakes:
    """Recording stand-ins for Stream, Event, current_stream, the stream and device guards, the copy,
    pin_memory/is_pinned and record_stream. Every call is appended to `log` as an Entry, in call order."""

    def __init__(self, monkeypatch, worker_prefix):
        self.worker_prefix = worker_prefix  # the name its background threads start with
        self.log: list[Entry] = []
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
            name = threading.current_thread().name
            self.log.append(Entry(op, name, args, name.startswith(self.worker_prefix)))
            return len(self.log) - 1

    def find(self, op, pred=lambda e: True):
        return [(i, e) for i, e in enumerate(self.log) if e.op == op and pred(e)]

    def only(self, op, pred):
        found = self.find(op, pred)
        assert len(found) == 1, (op, found)
        return found[0]


def nested_batches(n, log):
    return [{"tokens": torch.arange(4) + k,
             "parts": [torch.full((2,), float(k)), (torch.tensor(k), "caption", 7)],
             "pair": Pair(torch.ones(3) * k, [torch.zeros(1) - k]),
             "sample": Sample(torch.eye(2) * k, label=k),
             "boxes": Boxes(torch.tensor([k, k + 1]), log),
             "name": f"batch{k}"} for k in range(n)]


def event_after(fakes, copies, side, consumer, by_worker=True):
    """(log index of the event recorded after the copies at `copies`, log index of the wait for it);
    checks the event is recorded on `side` by the background thread (by_worker; else the training thread),
    after the last of those copies and before any later copy, and waited for once, on `consumer`, by the
    training thread."""
    recorded_at, record = min((i, e) for i, e in fakes.find("record_event") if i > max(copies))
    assert record.args[0] is side and record.on_worker() == by_worker
    assert all(i > recorded_at for i, _ in fakes.find("copy") if i > max(copies))
    waited_at, wait = fakes.only("wait_event", lambda e: e.args[1] is record.args[1])
    assert wait.args[0] is consumer and wait.thread == "MainThread"
    return recorded_at, waited_at


def assert_same_values(got, expected):
    assert type(got) is dict and got.keys() == expected.keys()
    assert got["name"] == expected["name"] and got["parts"][1][1:] == ("caption", 7)
    assert type(got["pair"]) is Pair and type(got["sample"]) is Sample and got["sample"].label == expected["sample"].label
    assert type(got["parts"]) is list and type(got["parts"][1]) is tuple
    torch.testing.assert_close(iter_tensors(got), iter_tensors(expected), rtol=0, atol=0)
    assert torch.equal(got["boxes"].data, expected["boxes"].data)


def nested_batches_one_pinned(fakes, n=3):
    """nested_batches(n), with batch 1's "tokens" already page-locked (as from DataLoader(pin_memory=True))."""
    batches = nested_batches(n, fakes.add)
    fakes.pinned.append(batches[1]["tokens"])
    return batches, batches[1]["tokens"]


def assert_copied_on_side_stream_of_cuda1(fakes, batches, seen, already_pinned, read_when_asked=0):
    """`seen[k]` is `batches[k]` (from nested_batches) as the training loop got it, on cuda:1, logged as
    "loop_gets" when the loop got it. Checks every pin, copy, event, wait and record_stream of each batch.
    The first `read_when_asked` batches are pinned and copied by the training thread, the rest by the worker."""
    side = fakes.only("new_stream", lambda e: True)[1].args[0]
    assert side.device == torch.device("cuda", 1)
    consumer = fakes.defaults[1]
    assert len(seen) == len(batches)
    for k, (host, got) in enumerate(zip(batches, seen)):
        assert_same_values(got, host)
        by_worker = k >= read_when_asked
        yielded_at, _ = fakes.only("loop_gets", lambda e: e.args[0] is got)
        leaves = iter_tensors(got)
        host_leaves = iter_tensors(host)
        assert len(leaves) == 6 and all(not any(t is h for h in host_leaves) for t in leaves)

        copies = []
        for leaf, source in zip(leaves, host_leaves):
            # Each device tensor was copied on the side stream of cuda:1, by the background thread (or the
            # training thread), from page-locked memory: pinned there too (under cuda:1), unless it already was.
            at, copy = fakes.only("copy", lambda e, leaf=leaf: e.args[1] is leaf)
            src, _, stream, current_device, target = copy.args
            assert stream is side and current_device == 1 and target == torch.device("cuda", 1)
            assert copy.on_worker() == by_worker
            if source is already_pinned:
                assert src is source and fakes.find("pin", lambda e, s=source: e.args[0] is s) == []
            else:
                pinned_at, pin = fakes.only("pin", lambda e, s=src: e.args[1] is s)
                assert pin.args[0] is source and pin.on_worker() == by_worker and pin.args[2] == 1 and pinned_at < at
            copies.append(at)

        # The event is recorded on the side stream after the batch's last copy, and the training thread's
        # stream waits on exactly that event before the batch reaches the loop ...
        recorded_at, waited_at = event_after(fakes, copies, side, consumer, by_worker)
        assert recorded_at < waited_at < yielded_at
        # ... and every tensor is record_stream()-ed on that stream, after the wait, before the loop gets it.
        for leaf in leaves:
            at, rec = fakes.only("record_stream", lambda e, leaf=leaf: e.args[0] is leaf)
            assert rec.args[1] is consumer and waited_at < at < yielded_at and rec.thread == "MainThread"
        # The object the copy cannot look into is moved by the training thread after the wait.
        moved_at, moved = fakes.only("object_to", lambda e, b=host["boxes"]: e.args[0] is b)
        assert moved.thread == "MainThread" and waited_at < moved_at < yielded_at
        assert moved.args[1] == torch.device("cuda", 1)
    assert len(fakes.find("record_stream")) == len(batches) * 6
