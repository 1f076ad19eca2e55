"""multi_apply and multi_apply_multi_stream against mmdet's multi_apply semantics.

Reference: mmdet.core.multi_apply written out with plain loops. Without a GPU the stream logic is
checked with recording fakes of the CUDA primitives; the CUDA tests run it on real streams.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import accel.runtime.utils.misc as misc
from accel.runtime.utils import multi_apply, multi_apply_multi_stream

NO_CUDA = "needs a CUDA device; this machine has none (the stream logic is checked with fakes on the CPU)"
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)


def reference_multi_apply(func, *args, **kwargs):
    """mmdet's multi_apply: func over zip(*args) with kwargs, results transposed into a tuple of lists
    (zip semantics on both sides: the shortest input, and the shortest result, set the lengths)."""
    results = []
    for items in zip(*args):
        results.append(func(*items, **kwargs))
    if not results:
        return ()
    rows = [list(r) for r in results]
    width = min(len(r) for r in rows)
    return tuple([row[j] for row in rows] for j in range(width))


def guide_func(t1, t2, t3):
    return (t1 * 2.0, t2 + 2.0, t3 - 2.0)


def guide_inputs(device="cpu", n=100):
    g = torch.Generator().manual_seed(0)
    return [torch.empty((n, 1000)).normal_(0.0, 1.0, generator=g).to(device) for _ in range(3)]


def assert_same(got, expected):
    assert type(got) is tuple and len(got) == len(expected)
    for g, e in zip(got, expected):
        assert type(g) is list and len(g) == len(e)
        for a, b in zip(g, e):
            if isinstance(b, torch.Tensor):
                assert a.device == b.device and torch.equal(a, b)
            else:
                assert a == b


# ------------------------------------------------------------------ semantics, on the CPU

@pytest.mark.parametrize("num_streams", [1, 2, 4])
def test_guide_example_on_cpu(num_streams):
    t1, t2, t3 = guide_inputs()
    expected = reference_multi_apply(guide_func, t1, t2, t3)
    assert len(expected) == 3 and len(expected[0]) == 100
    assert_same(multi_apply(guide_func, t1, t2, t3), expected)
    assert_same(multi_apply_multi_stream(guide_func, num_streams, t1, t2, t3), expected)


def test_lists_kwargs_and_non_tensor_results():
    def per_level(feat, stride, *, scale):
        return feat.sum() * scale, stride * 2, [feat.shape[0]]

    feats = [torch.ones(k + 1, 2) for k in range(5)]
    strides = [4, 8, 16, 32, 64]
    expected = reference_multi_apply(per_level, feats, strides, scale=0.5)
    assert_same(multi_apply(per_level, feats, strides, scale=0.5), expected)
    assert_same(multi_apply_multi_stream(per_level, 3, feats, strides, scale=0.5), expected)
    assert expected[1] == [8, 16, 32, 64, 128]


def test_mmdet_edge_cases():
    # No calls: an empty tuple. A func returning one tensor: mmdet splits it along dim 0.
    assert multi_apply(guide_func, [], [], []) == () == multi_apply_multi_stream(guide_func, 2, [], [], [])
    x = torch.arange(6.0).reshape(3, 2)
    expected = reference_multi_apply(lambda row: row * 10, x)
    assert len(expected) == 2
    assert_same(multi_apply(lambda row: row * 10, x), expected)
    assert_same(multi_apply_multi_stream(lambda row: row * 10, 2, x), expected)
    # multi_apply keeps mmdet's zip truncation; the multi-stream version refuses unequal lengths.
    assert_same(multi_apply(lambda a, b: (a + b,), [1, 2, 3], [10, 20]), ([11, 22],))
    # Any iterable, generators included.
    assert_same(multi_apply_multi_stream(lambda a: (a, -a), 2, (k for k in range(3))), ([0, 1, 2], [0, -1, -2]))


@pytest.mark.parametrize("num_streams,error", [(0, ValueError), (-1, ValueError), (2.0, TypeError),
                                               (True, TypeError), ("2", TypeError), (None, TypeError)])
def test_num_streams_is_validated(num_streams, error):
    with pytest.raises(error, match="^num_streams:"):
        multi_apply_multi_stream(guide_func, num_streams, *guide_inputs(n=2))


def test_func_and_args_are_validated():
    with pytest.raises(TypeError, match="^func:"):
        multi_apply_multi_stream("not callable", 2, [1, 2])
    with pytest.raises(ValueError, match=r"lengths \[3, 2, 3\]"):
        multi_apply_multi_stream(guide_func, 2, torch.ones(3, 4), torch.ones(2, 4), torch.ones(3, 4))
    with pytest.raises(TypeError, match="^args:"):
        multi_apply_multi_stream(guide_func, 2)
    with pytest.raises(TypeError, match=r"^args\[1\]:"):
        multi_apply_multi_stream(guide_func, 2, [1], 5)


# ------------------------------------------------------------------ stream rules, with fakes

class StreamFakes:
    """Recording stand-ins for the CUDA primitives misc uses; tensors on the CPU play CUDA tensors."""

    def __init__(self, monkeypatch):
        self.log = []
        self.caller = self.Stream("caller")
        self.current = [self.caller]
        self.created = []
        fakes = self

        def new_stream(device=None):
            s = fakes.Stream(f"side{len(fakes.created)}")
            fakes.created.append(s)
            return s

        @contextlib.contextmanager
        def use_stream(stream):
            fakes.current.append(stream)
            try:
                yield
            finally:
                fakes.current.pop()

        monkeypatch.setattr(misc, "Stream", new_stream)
        monkeypatch.setattr(misc, "current_stream", lambda device=None: fakes.current[-1])
        monkeypatch.setattr(misc, "use_stream", use_stream)
        monkeypatch.setattr(misc, "cuda_device", lambda device: contextlib.nullcontext())
        monkeypatch.setattr(misc, "_stream_device", lambda tensors: torch.device("cpu"))
        monkeypatch.setattr(misc, "_record_stream", lambda t, s: fakes.log.append(("record", t, s)))

    def Stream(self, name):
        fakes = self

        class _Stream:
            def wait_stream(self, other):
                fakes.log.append(("wait", self, other))

            def __repr__(self):
                return name

        return _Stream()

    def indices(self, op, pred=lambda e: True):
        return [i for i, e in enumerate(self.log) if e[0] == op and pred(e)]


def test_stream_rules_with_fakes(monkeypatch):
    fakes = StreamFakes(monkeypatch)
    t1, t2 = torch.randn(5, 3), torch.randn(5, 3)
    boxes = [torch.randn(k + 1, 4) for k in range(5)]
    offset = torch.ones(3)

    def func(a, b, box, *, offset):
        fakes.log.append(("call", fakes.current[-1], a))
        return a + b + offset, box * 2

    out = multi_apply_multi_stream(func, 2, t1, t2, boxes, offset=offset)
    assert_same(out, reference_multi_apply(func, t1, t2, boxes, offset=offset))  # the fake log grew, fine

    sides = fakes.created
    assert len(sides) == 2 and fakes.current == [fakes.caller]
    calls = fakes.indices("call")[:5]  # the first five: the reference's calls came after
    # Round-robin over the side streams, never on the caller's stream.
    assert [fakes.log[i][1] for i in calls] == [sides[0], sides[1], sides[0], sides[1], sides[0]]
    for s in sides:
        # Each side stream waits for the caller's stream before its first call...
        (waited,) = fakes.indices("wait", lambda e: e[1] is s and e[2] is fakes.caller)
        assert waited < min(i for i in calls if fakes.log[i][1] is s)
        # ...and the caller's stream waits for it after its last call.
        (joined,) = fakes.indices("wait", lambda e: e[1] is fakes.caller and e[2] is s)
        assert joined > max(i for i in calls if fakes.log[i][1] is s)
    records = [(i, e[1], e[2]) for i, e in enumerate(fakes.log) if e[0] == "record"]
    # Whole tensors (the tensor args and the kwarg) recorded once on each side stream, before any call.
    for t in (t1, t2, offset):
        assert sorted(str(s) for i, x, s in records if x is t and i < calls[0]) == ["side0", "side1"]
    # Each list item recorded on the stream that reads it, before its call.
    for k, box in enumerate(boxes):
        ((i, _, s),) = [r for r in records if r[1] is box]
        assert s is sides[k % 2] and i < calls[k] and (k == 0 or i > calls[k - 1])
    # Every output recorded on the caller's stream, after the joins.
    last_join = max(fakes.indices("wait", lambda e: e[1] is fakes.caller))
    outputs = [t for column in out for t in column]
    for t in outputs:
        ((i, _, s),) = [r for r in records if r[1] is t]
        assert s is fakes.caller and i > last_join


def test_a_failing_call_still_joins_the_streams(monkeypatch):
    fakes = StreamFakes(monkeypatch)

    def func(a):
        if a[0] == 3:
            raise RuntimeError("call 3 failed")
        return (a * 2,)

    x = torch.arange(8.0).reshape(8, 1)
    with pytest.raises(RuntimeError, match="call 3 failed"):
        multi_apply_multi_stream(func, 4, x)
    joins = fakes.indices("wait", lambda e: e[1] is fakes.caller)
    assert len(joins) == 4 and fakes.current == [fakes.caller]
    # The three results made before the failure are recorded on the caller's stream.
    assert len([e for e in fakes.log if e[0] == "record" and e[2] is fakes.caller]) == 3


def test_sequential_without_streams_when_nothing_to_overlap(monkeypatch):
    fakes = StreamFakes(monkeypatch)
    x = torch.randn(4, 2)
    multi_apply_multi_stream(lambda r: (r,), 1, x)  # one stream
    multi_apply_multi_stream(lambda r: (r,), 4, x[:1])  # one call
    assert fakes.created == [] and fakes.log == []
    multi_apply_multi_stream(lambda r: (r,), 8, x)  # more streams than calls: one per call
    assert len(fakes.created) == 4


def test_stream_device_picks_one_cuda_device():
    cpu = torch.ones(1)
    assert misc._stream_device([cpu]) is None and misc._stream_device([]) is None
    meta = torch.ones(1, device="meta")
    assert misc._stream_device([meta, cpu]) is None


# ------------------------------------------------------------------ on a GPU

@requires_cuda
@pytest.mark.parametrize("num_streams", [1, 2, 4])
def test_guide_example_on_cuda_equals_sequential(num_streams):
    t1, t2, t3 = guide_inputs("cuda")
    expected = multi_apply(guide_func, t1, t2, t3)
    assert_same(expected, reference_multi_apply(guide_func, t1, t2, t3))
    got = multi_apply_multi_stream(guide_func, num_streams, t1, t2, t3)
    torch.cuda.synchronize()
    assert_same(got, expected)


@requires_cuda
def test_cuda_calls_run_on_side_streams_round_robin():
    caller = torch.cuda.current_stream()
    seen = []

    def func(a, b):
        seen.append(torch.cuda.current_stream())
        return (a @ b,)

    a = torch.randn(6, 32, 32, device="cuda")
    b = torch.randn(6, 32, 32, device="cuda")
    (got,) = multi_apply_multi_stream(func, 3, a, b)
    assert torch.cuda.current_stream() == caller
    assert all(s != caller for s in seen) and len({s.stream_id for s in seen}) == 3
    assert [s.stream_id for s in seen[:3]] == [s.stream_id for s in seen[3:]]
    torch.testing.assert_close(torch.stack(got), a @ b)


@requires_cuda
def test_cuda_reads_an_input_written_on_the_current_stream_just_before():
    # The input's final values are written behind a long kernel on the current stream: a side stream
    # that did not wait for it would read the zeros that are there before.
    n = 16
    x = torch.zeros(n, 4096, device="cuda")
    src = torch.arange(n * 4096, dtype=torch.float32, device="cuda").reshape(n, 4096)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s on the current stream
    x.copy_(src)
    got = multi_apply_multi_stream(lambda row: (row * 1.0, row.sum()), 4, x)
    # The results are consumed on the current stream, where they must be complete too.
    stacked, sums = torch.stack(got[0]), torch.stack(got[1])
    torch.testing.assert_close(stacked, src, rtol=0, atol=0)
    torch.testing.assert_close(sums, src.sum(dim=1))


@requires_cuda
def test_cuda_outputs_survive_their_stream_reusing_memory():
    # Outputs are allocated on the side streams. Once the caller drops one, the allocator must not give
    # its block to new work on that side stream before the caller's queued reads of it have run: the
    # outputs are record_stream()-ed on the current stream for that.
    used = []

    def func(row):
        used.append(torch.cuda.current_stream())
        return (row * 3.0,)

    x = torch.randn(8, 1 << 16, device="cuda")
    expected = (x * 3.0).sum(dim=1)
    outs = multi_apply_multi_stream(func, 4, x)[0]
    torch.cuda._sleep(200_000_000)  # the reads below wait ~0.1 s on the current stream
    total = torch.stack(outs).sum(dim=1)
    del outs
    # Same-sized allocations on the side streams, which are not behind the sleep: a block released
    # without the recorded use would come back here and be overwritten before the reads above.
    keep = []
    for s in used:
        with torch.cuda.stream(s):
            keep.append(torch.full((1 << 16,), -1.0, device="cuda"))
    torch.cuda.synchronize()
    torch.testing.assert_close(total, expected)
