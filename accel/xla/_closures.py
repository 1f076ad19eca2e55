"""Step closures: callbacks that run once the current step's graph has executed.

Why our own queue instead of only xm.add_step_closure: torch_xla's asynchronous closures
report a failure only when a later async closure is queued, so an exception can stay
hidden forever. We keep the closures here and hook a single runner into torch_xla's
per-step list, so they still run whenever anyone syncs (torch_xla.sync(), a device loader,
accel.xla.sync()), and a failed async closure is raised at the next sync.
"""
from __future__ import annotations

import atexit
import queue
import threading
from typing import Any, Callable

from accel.xla._topology import _xla_in_use

_lock = threading.Lock()
_pending: list[tuple[Callable[..., Any], tuple, bool]] = []
_runner_hooked = False  # a runner is queued in torch_xla's closures for the current step


class _AsyncWorker:
    """One background thread that runs async closures in the order they were queued."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], args: tuple) -> None:
        if self._thread is None or not self._thread.is_alive():
            # Daemon so a stuck logging closure cannot keep the interpreter alive; atexit
            # drains the queue so closures queued in the last step still run.
            self._thread = threading.Thread(target=self._loop, name="accel-step-closures", daemon=True)
            self._thread.start()
        self._queue.put((fn, args))

    def _loop(self) -> None:
        while True:
            fn, args = self._queue.get()
            try:
                fn(*args)
            except BaseException as exc:  # surfaced to the training thread at its next sync
                with self._error_lock:
                    if self._error is None:
                        self._error = exc
            finally:
                self._queue.task_done()

    def wait(self, timeout: float | None = None) -> bool:
        """True once every queued closure has finished; False if ``timeout`` ran out first."""
        cond = self._queue.all_tasks_done
        with cond:
            return cond.wait_for(lambda: self._queue.unfinished_tasks == 0, timeout)

    def take_error(self) -> BaseException | None:
        with self._error_lock:
            exc, self._error = self._error, None
        return exc


_worker = _AsyncWorker()
_EXIT_DRAIN_TIMEOUT_S = 60.0


def add_step_closure(fn: Callable[..., Any], args: tuple = (), run_async: bool = False) -> None:
    """Run ``fn(*args)`` after the next sync, when tensors in ``args`` hold device data.

    Closures run in the order they were added. ``run_async=True`` ones run on a background
    thread (use it for logging that would otherwise stall the step); if one raises, the
    exception is raised by the next sync() or wait_async_closures().
    """
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(args, (tuple, list)):
        raise ValueError(f"args must be a tuple of arguments for the closure, got {type(args).__name__}")
    global _runner_hooked
    with _lock:
        _pending.append((fn, tuple(args), bool(run_async)))
        hook = _xla_in_use() and not _runner_hooked
        if hook:
            _runner_hooked = True
    if hook:
        import torch_xla.core.xla_model as xm

        xm.add_step_closure(run_step_closures)


def run_step_closures() -> None:
    """Run (or hand to the worker) every closure queued so far; raise a failed async one's error."""
    global _runner_hooked
    with _lock:
        todo = list(_pending)
        _pending.clear()
        _runner_hooked = False
    for fn, args, run_async in todo:
        if run_async:
            _worker.submit(fn, args)
        else:
            fn(*args)
    raise_async_error()


def raise_async_error() -> None:
    exc = _worker.take_error()
    if exc is not None:
        raise exc


def wait_async_closures() -> None:
    """Block until every queued async closure has run; raise the first error one raised."""
    _worker.wait()
    raise_async_error()


def _drain_at_exit() -> None:
    # Let the last step's log lines appear, without letting a hung closure block exit forever;
    # an error can no longer reach the caller here.
    _worker.wait(timeout=_EXIT_DRAIN_TIMEOUT_S)


atexit.register(_drain_at_exit)


def sync(wait: bool = False) -> None:
    """Cut the lazy graph, execute it, then run the step closures."""
    if not isinstance(wait, bool):
        raise ValueError(f"wait must be a bool, got {type(wait).__name__}")
    if _xla_in_use():
        import torch_xla

        # torch_xla.sync runs torch_xla's step closures, among them our runner when one is queued.
        torch_xla.sync(wait=wait)
    # Covers closures added without torch_xla, and errors from async closures of earlier steps.
    run_step_closures()


mark_step = sync
