"""The host's global random number generators (python `random`, numpy's global RandomState, torch's CPU
generator): their state as weights_only-loadable values, restoring it, and whether some code drew from them.

Data loading shares these generators with the training loop when the DataLoader reads in the main process
(num_workers=0): accel.data.resumable replays them at a pass start, accel.state saves them, and the
Prefetcher asks whether a loader's reads draw from them (accel.runtime.io.prefetcher).
"""
from __future__ import annotations

import random
from typing import Any

import torch


def _numpy():
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def host_rng_state() -> dict:
    """The python, numpy (when installed) and torch CPU RNG states, as tensors, ints, floats and tuples
    only, so torch.load(weights_only=True) reads them back."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = _numpy()
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        # An ndarray would need an allow-list under weights_only; an int64 tensor holds uint32 exactly.
        state["numpy"] = {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return state


def set_host_rng_state(state: dict) -> None:
    """Restore what host_rng_state() returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    saved_np = state.get("numpy")
    np = _numpy()
    if saved_np is not None and np is not None:
        keys = saved_np["keys"].numpy().astype(np.uint32)
        np.random.set_state((saved_np["kind"], keys, saved_np["pos"], saved_np["has_gauss"],
                             saved_np["cached_gaussian"]))


def same_host_rng_state(a: dict, b: dict) -> bool:
    """Whether two host_rng_state() values are the same state: nothing drew from any of the generators between
    them (or exactly a whole period, which no program does)."""
    if a["python"] != b["python"] or not torch.equal(a["torch"], b["torch"]):
        return False
    na, nb = a.get("numpy"), b.get("numpy")
    if na is None or nb is None:
        return na is nb
    return (all(na[k] == nb[k] for k in ("kind", "pos", "has_gauss", "cached_gaussian"))
            and torch.equal(na["keys"], nb["keys"]))


def read_when_asked(read, reads_so_far: int, end) -> tuple:
    """(read(), whether reads may run ahead of the loop from now on), for a device loader's read that the loop
    asked for, in its thread. The pass's second read is the probe (the first also creates the iterator, whose
    worker base seed and shuffling sampler's seed are draws anyway): reads may go ahead where it left the host's
    global RNGs as they were and the pass goes on (`end`: what read() returns at its end). Where it drew, a read
    ahead would take its numbers at another point of the stream than the step's own draws (from a thread: at a
    point that depends on timing), so a seed would not reproduce a run nor a checkpoint resume it."""
    if reads_so_far != 1:
        return read(), False
    before = host_rng_state()
    item = read()
    return item, item is not end and same_host_rng_state(before, host_rng_state())
