"""Loader threads stopped before the interpreter shuts down.

The device loaders read ahead on daemon threads (accel.runtime.io.prefetcher, accel.data._pipeline). A
script that ends with a pass still open (an endless iterator, a loop left by `break` whose iterator is still
referenced) used to leave its thread inside a torch call that runs without the GIL; Python then stops daemon
threads as they take the GIL back during finalisation, unwinding through torch's C++ frames, and the process
aborted ("terminate called without an active exception", exit status 134) after the script had finished.
atexit functions run before that, while the threads still run normally: each open reader is closed there (its
queued batches cancelled, the batch being read finished, the thread joined).
"""
from __future__ import annotations

import atexit
import weakref
from typing import Protocol

# A batch being read at exit is finished before the thread is joined; a loader stuck longer than this is
# left to the interpreter (the old behaviour) rather than holding the exit up.
EXIT_TIMEOUT_S = 10.0


class _Closable(Protocol):
    def close(self, timeout_s: float = ...) -> None: ...


_open: weakref.WeakSet = weakref.WeakSet()  # weak: a reader dropped by the script is collected as before


def close_at_exit(reader: _Closable) -> None:
    """Have reader.close(timeout_s=EXIT_TIMEOUT_S) called at exit, if it is still alive then."""
    _open.add(reader)


def _close_open_readers() -> None:
    for reader in list(_open):
        try:
            reader.close(timeout_s=EXIT_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the others must still close; nobody can handle it at exit
            pass


atexit.register(_close_open_readers)
