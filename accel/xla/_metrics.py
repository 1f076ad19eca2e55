"""A small, comparable snapshot of torch_xla's debug counters.

torch_xla keeps cumulative counters; the questions users ask ("did this loop recompile?",
"does the steady state copy anything to the host?") are about differences, so a snapshot
supports subtraction.
"""
from __future__ import annotations

import dataclasses

from accel.utils.xla import require_xla

_NS_PER_S = 1e9


@dataclasses.dataclass(frozen=True)
class XlaMetrics:
    compiles: int = 0
    executions: int = 0
    h2d_transfers: int = 0
    d2h_transfers: int = 0
    item_calls: int = 0  # tensor.item()/bool(tensor) and friends: each one stalls for the device
    compile_time_s: float = 0.0
    execute_time_s: float = 0.0

    def __sub__(self, earlier: "XlaMetrics") -> "XlaMetrics":
        if not isinstance(earlier, XlaMetrics):
            return NotImplemented
        return XlaMetrics(
            **{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in dataclasses.fields(self)}
        )

    def since(self, earlier: "XlaMetrics") -> "XlaMetrics":
        """What happened between ``earlier`` and this snapshot (same as ``self - earlier``)."""
        return self - earlier

    def report(self) -> str:
        return (
            f"XLA metrics: {self.compiles} compiles ({self.compile_time_s:.3f} s), "
            f"{self.executions} executions ({self.execute_time_s:.3f} s), "
            f"{self.h2d_transfers} host-to-device transfers, "
            f"{self.d2h_transfers} device-to-host transfers ({self.item_calls} from .item())"
        )

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
    so by default we first wait for the device to go idle (no transfer, no graph cut).
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
    return XlaMetrics(
        compiles=compiles,
        executions=executions,
        h2d_transfers=h2d,
        d2h_transfers=d2h,
        item_calls=int(items),
        compile_time_s=compile_ns / _NS_PER_S,
        execute_time_s=execute_ns / _NS_PER_S,
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
