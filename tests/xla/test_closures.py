"""Step closures: after the graph ran, in order; async ones on a worker thread; errors surface."""
import threading
import time

import pytest
import torch

torch_xla = pytest.importorskip("torch_xla", reason="torch_xla is not installed")

import accel.xla as xm  # noqa: E402


@pytest.fixture(autouse=True)
def clean_queue():
    xm.sync()
    xm.wait_async_closures()
    yield
    try:
        xm.sync()
        xm.wait_async_closures()
    except Exception:
        pass


def test_closures_run_after_sync_in_order_with_materialized_args():
    dev = xm.xla_device()
    a = torch.arange(4.0, device=dev) * 3
    seen = []
    xm.add_step_closure(lambda t: seen.append(("first", t.cpu().tolist())), args=(a,))
    xm.add_step_closure(lambda t: seen.append(("second", t.sum().item())), args=(a + 1,))
    assert seen == []  # nothing runs before the step ends
    xm.sync()
    assert seen == [("first", [0.0, 3.0, 6.0, 9.0]), ("second", 22.0)]
    xm.sync()  # closures run once, not again at the next step
    assert len(seen) == 2


def test_closures_run_when_torch_xla_syncs_directly():
    # Device loaders call torch_xla.sync(): the closures must still run.
    seen = []
    xm.add_step_closure(seen.append, args=("ran",))
    torch_xla.sync()
    assert seen == ["ran"]


def test_async_closures_run_in_order_on_a_background_thread():
    seen, threads = [], []

    def record(i):
        time.sleep(0.01)
        seen.append(i)
        threads.append(threading.current_thread())

    for i in range(5):
        xm.add_step_closure(record, args=(i,), run_async=True)
    xm.sync()
    xm.wait_async_closures()
    assert seen == [0, 1, 2, 3, 4]
    assert all(t is not threading.main_thread() for t in threads)


def test_exception_in_a_closure_propagates_out_of_sync():
    def fail():
        raise ValueError("closure failed")

    xm.add_step_closure(fail)
    with pytest.raises(ValueError, match="closure failed"):
        xm.sync()


def test_exception_in_an_async_closure_surfaces_at_the_next_sync():
    started = threading.Event()

    def fail():
        started.set()
        raise KeyError("async closure failed")

    xm.add_step_closure(fail, run_async=True)
    xm.sync()  # the closure is handed to the worker here
    assert started.wait(10)
    time.sleep(0.05)
    with pytest.raises(KeyError, match="async closure failed"):
        xm.sync()
    xm.sync()  # reported once, then cleared


def test_wait_async_closures_raises_the_error():
    xm.add_step_closure(lambda: 1 / 0, run_async=True)
    xm.sync()
    with pytest.raises(ZeroDivisionError):
        xm.wait_async_closures()


def test_add_step_closure_validates_arguments():
    with pytest.raises(ValueError, match="fn must be callable"):
        xm.add_step_closure("not callable")
    with pytest.raises(ValueError, match="args"):
        xm.add_step_closure(print, args=5)
    with pytest.raises(ValueError, match="wait"):
        xm.sync(wait="yes")
