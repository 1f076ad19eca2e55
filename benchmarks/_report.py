"""Shared by the benchmarks: a printed table, a JSON file and a PNG plot in benchmarks/results/, and the
device sync every timer needs."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from accel.utils.atomic_file import atomic_write

RESULTS = Path(__file__).resolve().parent / "results"


def sync(device) -> None:
    """Wait for the device's queued work, so that a timer stopped after it measures the work (CUDA)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_seconds(fn, repeats: int) -> float:
    """Median wall seconds of `repeats` calls of fn, after one untimed call (allocations, first-call caches).
    fn must wait for its own work (CPU code, or a sync at its end)."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"{platform.processor() or 'CPU'} ({os.cpu_count()} cores)"


def environment(device: str) -> dict:
    return {
        "device": device_name(device),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format spec)."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append([("" if r.get(k) is None else format(r[k], f)) for k, _, f in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    for n, row in enumerate(cells):
        print("  ".join(c.rjust(w) if n and i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def write_json(name: str, payload: dict, directory: Path = RESULTS) -> Path:
    """Atomically write <directory>/<name>.json (default benchmarks/results/)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    atomic_write(path, lambda f: f.write(json.dumps(payload, indent=2, default=str) + "\n"), binary=False)
    return path


def save_figure(fig, name: str, directory: Path = RESULTS) -> Path:
    """Atomically write <directory>/<name>.png (default benchmarks/results/)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.png"
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120, bbox_inches="tight"))
    return path


def ratio_bars(labels: list[str], ratios: list[float], xlabel: str, title: str, name: str,
               directory: Path = RESULTS) -> Path:
    """A bar a row on a log scale around 1 (green at or above, red below), written as <name>.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, max(3, 0.28 * len(labels))))
    ax.barh(labels, ratios, color=["tab:green" if x >= 1 else "tab:red" for x in ratios])
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    return save_figure(fig, name, directory)
