"""A small, comparable snapshot of torch_xla's debug counters.

torch_xla keeps cumulative counters; the questions users ask ("did this loop recompile?",
"does the steady state copy anything to the host?") are about differences, so a snapshot
supports subtraction.

torch_xla counts compilations but does not say which inputs caused them; an
accel.compiler.recompile_guard.RecompileGuard watching an XLA loop records each step whose compile
count grew, with that step's input shapes (record_compilation), and metrics().compilations lists them.
"""
from __future__ import annotations

import collections
import dataclasses

from accel.utils.xla import require_xla

_NS_PER_S = 1e9
# A loop that recompiles every step would otherwise grow this list without bound; the oldest go first.
_MAX_COMPILATIONS = 10_000


@dataclasses.dataclass(frozen=True)
class XlaCompilation:
    """The XLA compilations a RecompileGuard saw during one step, with the inputs of that step.

    Attributes:
        step: the guard's step number (1-based).
        count: how many graphs XLA compiled during that step.
        warmup: whether the step was one of the guard's warm-up steps (compiling there is expected).
        cause: what changed against the reference step, e.g. "batch['input_ids'] dim 1: 128 -> 131".
        inputs: (path, shape, dtype) of each tensor input of the step; shape is None and dtype holds
            repr(value) for a Python scalar input.
        guard: the name of the guard that recorded it.
    """

    step: int
    count: int
    warmup: bool
    cause: str
    inputs: tuple = ()
    guard: str = ""


_COMPILATIONS: collections.deque = collections.deque(maxlen=_MAX_COMPILATIONS)


def record_compilation(compilation: XlaCompilation) -> None:
    """Add one entry to the list metrics().compilations returns (called by RecompileGuard).

    Args:
        compilation: the step's compilations and the input shapes that caused them.

    Raises:
        ValueError: compilation is not an XlaCompilation.
    """
    if not isinstance(compilation, XlaCompilation):
        raise ValueError(f"compilation must be an XlaCompilation, got {type(compilation).__name__}")
    _COMPILATIONS.append(compilation)


@dataclasses.dataclass(frozen=True)
class XlaMetrics:
    compiles: int = 0
    executions: int = 0
    h2d_transfers: int = 0
    d2h_transfers: int = 0
    item_calls: int = 0  # tensor.item()/bool(tensor) and friends: each one stalls for the device
    compile_time_s: float = 0.0
    execute_time_s: float = 0.0
    # XlaCompilation entries recorded by RecompileGuards (empty when no guard watches the loop).
    compilations: tuple = ()
    # torch_xla's persistent compile cache (xlarun --compile-cache): a hit is a graph loaded from disk
    # instead of compiled, so it is not in `compiles`; a miss found no entry on disk; a load failure
    # found one the runtime could not load back (it compiles instead, and rewrites the entry).
    persistent_cache_hits: int = 0
    persistent_cache_misses: int = 0
    persistent_cache_load_failures: int = 0

    def __sub__(self, earlier: "XlaMetrics") -> "XlaMetrics":
        if not isinstance(earlier, XlaMetrics):
            return NotImplemented
        counts = {
            f.name: getattr(self, f.name) - getattr(earlier, f.name)
            for f in dataclasses.fields(self)
            if f.name != "compilations"
        }
        # The entries recorded since `earlier`; compared by identity because the list may have dropped
        # its oldest entries in between, so positions do not line up.
        seen = {id(c) for c in earlier.compilations}
        return XlaMetrics(**counts, compilations=tuple(c for c in self.compilations if id(c) not in seen))

    def since(self, earlier: "XlaMetrics") -> "XlaMetrics":
        """What happened between ``earlier`` and this snapshot (same as ``self - earlier``)."""
        return self - earlier

    def report(self) -> str:
        text = (
            f"XLA metrics: {self.compiles} compiles ({self.compile_time_s:.3f} s), "
            f"{self.executions} executions ({self.execute_time_s:.3f} s), "
            f"{self.h2d_transfers} host-to-device transfers, "
            f"{self.d2h_transfers} device-to-host transfers ({self.item_calls} from .item())"
        )
        if self.persistent_cache_hits or self.persistent_cache_misses or self.persistent_cache_load_failures:
            text += (
                f"; persistent compile cache: {self.persistent_cache_hits} loaded, "
                f"{self.persistent_cache_misses} not found, {self.persistent_cache_load_failures} unloadable"
            )
        return text

    def __str__(self) -> str:
        return self.report()


def _metric(met, name: str) -> tuple[int, float]:
    data = met.metric_data(name)
    if data is None:  # the event has not happened yet in this process
        return 0, 0.0
    count, accumulator = data[0], data[1]
    return int(count), float(accumulator)


def metrics(wait: bool = True) -> XlaMetrics:
    """Snapshot of compile/execute/transfer counts since the process started (or clear_metrics()).

    Executions launched by sync() finish in the background and are counted when they finish,
    so by default we first wait for the device to go idle (no transfer, no graph cut). Compilations
    happen inside sync() itself (torch_xla 2.9), so `compiles` is exact without waiting.

    Args:
        wait: wait for pending device work first, so that `executions` and the transfer counts are final.

    Returns:
        An XlaMetrics snapshot; its `compilations` lists the compilations RecompileGuards attributed
        to input shapes (XlaCompilation entries, oldest first).
    """
    if not isinstance(wait, bool):
        raise ValueError(f"wait must be a bool, got {wait!r}")
    require_xla("accel.xla.metrics()")
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    if wait:
        xm.wait_device_ops()

    compiles, compile_ns = _metric(met, "CompileTime")
    executions, execute_ns = _metric(met, "ExecuteTime")
    h2d, _ = _metric(met, "TransferToDeviceTime")
    d2h, _ = _metric(met, "TransferFromDeviceTime")
    items = met.counter_value("aten::_local_scalar_dense") or 0
    # Counter names from torch_xla's PersistentCache (runtime/cache.h); None until the event happens.
    hits = met.counter_value("PersistentCacheHit") or 0
    misses = met.counter_value("PersistentCacheMiss") or 0
    load_failures = met.counter_value("PersistentCacheDeserializeFailure") or 0
    return XlaMetrics(
        compiles=compiles,
        executions=executions,
        h2d_transfers=h2d,
        d2h_transfers=d2h,
        item_calls=int(items),
        compile_time_s=compile_ns / _NS_PER_S,
        execute_time_s=execute_ns / _NS_PER_S,
        compilations=tuple(_COMPILATIONS),
        persistent_cache_hits=int(hits),
        persistent_cache_misses=int(misses),
        persistent_cache_load_failures=int(load_failures),
    )


def metrics_report() -> str:
    """torch_xla's full text report, for when the summary is not enough."""
    require_xla("accel.xla.metrics_report()")
    import torch_xla.debug.metrics as met

    return met.metrics_report()


def clear_metrics() -> None:
    require_xla("accel.xla.clear_metrics()")
    import torch_xla.debug.metrics as met

    met.clear_all()
    _COMPILATIONS.clear()
