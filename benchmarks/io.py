"""IO benchmark: how much loading time the prefetchers hide, and how much padding packing/bucketing remove.

Part 1 (overlap): a loader that takes L ms per batch (a sleep in its collate_fn, like a slow decode) and a
training step of S ms (a sleep, standing for a step the host waits on, or a busy matmul loop on the
device). A plain loop pays L + S per step; with the data read ahead it pays about max(L, S). Reported:
steady-state ms per step (mean gap between batch arrivals, so the unavoidable wait for an epoch's first
batch is left out) and the fraction of L hidden, (plain - prefetched) / L, whose ceiling is min(L, S) / L
(L and S as measured alone in the same run).
"guide calls" drives the Prefetcher the way the TorchAcc guide does (prefetch_CPU after backward, i.e.
half-way through the step, prefetch_GPU after the optimizer step); the prefetcher keeps reading ahead
regardless, so it should hide as much as "auto".

Part 2 (padding): lognormal sample lengths (median ~64, clipped to 512) batched in random order and
padded to the longest of each batch, against padding to 512, packing into 512-token rows, and
bucketing to (64, 128, 256, 512).

    python benchmarks/io.py [--quick] [--device cpu|cuda]

Writes benchmarks/results/io.json and benchmarks/results/io.png.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from accel.data import BucketBatchSampler, MpDeviceLoader, PackedDataset  # noqa: E402
from accel.data.bucketing import bucket_padding_stats  # noqa: E402
from accel.data.padding_stats import consecutive_batches, slots_padded_to_longest  # noqa: E402
from accel.runtime.io import Prefetcher  # noqa: E402
from benchmarks import _report  # noqa: E402

BUCKETS = (64, 128, 256, 512)
ROW = 512


class _SlowCollate:
    """Builds a batch after sleeping `ms` (a stand-in for decoding/tokenising on the host)."""

    def __init__(self, ms: float):
        self.seconds = ms / 1000

    def __call__(self, items):
        time.sleep(self.seconds)
        return {"input_ids": torch.stack(items), "labels": torch.stack(items)[:, 0]}


def _loader(n_batches: int, load_ms: float) -> DataLoader:
    data = [torch.arange(128) + i for i in range(n_batches * 8)]
    return DataLoader(data, batch_size=8, collate_fn=_SlowCollate(load_ms))


class _Step:
    """A training step of about `ms`: a sleep (host waits on the device), or a calibrated matmul loop."""

    def __init__(self, ms: float, kind: str, device: torch.device):
        self.ms, self.kind, self.device = ms, kind, device
        if kind == "matmul":
            self.a = torch.randn(256, 256, device=device)
            self.reps = self._calibrate(ms)

    def _calibrate(self, ms: float) -> int:
        # Grow the loop until one timing spans >= 20 ms, and keep the fastest of three, so a
        # moment of contention on a shared machine does not inflate every later step.
        self.reps = 4
        while True:
            best = min(self._time_ms() for _ in range(3))
            if best >= 20 or self.reps >= 1 << 20:
                return max(1, round(self.reps * ms / best))
            self.reps *= 2

    def _time_ms(self) -> float:
        start = time.perf_counter()
        self.run_part(1.0)
        return (time.perf_counter() - start) * 1000

    def run_part(self, share: float, batch=None) -> None:
        if batch is not None:
            batch["input_ids"].sum()  # touch the batch as a model would
        if self.kind == "sleep":
            time.sleep(self.ms * share / 1000)
            return
        x = self.a
        for _ in range(max(1, round(self.reps * share))):
            x = x @ self.a
            x = x / x.norm()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _batches(mode: str, loader, step: _Step, device: torch.device):
    """The training loop of one mode, as a generator that yields when each batch reaches the loop."""
    if mode == "loader alone":
        for batch in loader:
            yield {k: v.to(device) for k, v in batch.items()}
    elif mode == "step alone":
        for _ in range(len(loader)):
            yield None
            step.run_part(1.0)
    elif mode == "plain":
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            yield batch
            step.run_part(1.0, batch)
    elif mode == "MpDeviceLoader":
        for batch in MpDeviceLoader(loader, device):
            yield batch
            step.run_part(1.0, batch)
    elif mode == "Prefetcher (auto)":
        for batch in Prefetcher(loader, device=device):
            yield batch
            step.run_part(1.0, batch)
    elif mode == "Prefetcher (guide calls)":
        prefetcher = Prefetcher(loader, device=device)
        for batch in prefetcher:
            yield batch
            step.run_part(0.5, batch)   # forward + backward
            prefetcher.prefetch_CPU()
            step.run_part(0.5)          # optimizer step
            prefetcher.prefetch_GPU()
    else:
        raise ValueError(f"unknown mode {mode!r}")


def _run(mode: str, n_batches: int, load_ms: float, step: _Step, device: torch.device) -> float:
    """Steady-state ms per step: the mean gap between batch arrivals. The first batch's load is left out,
    since no prefetcher can hide the wait for the very first batch of an epoch."""
    arrivals = [time.perf_counter() for _ in _batches(mode, _loader(n_batches, load_ms), step, device)]
    return (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) * 1000


MODES = ("plain", "MpDeviceLoader", "Prefetcher (auto)", "Prefetcher (guide calls)")


def overlap_benchmark(device: torch.device, quick: bool, repeats: int = 3) -> list[dict]:
    n_batches = 25 if quick else 60
    cases = [(5, 10, "sleep"), (10, 10, "sleep"), (10, 20, "sleep"), (20, 10, "sleep")]
    if not quick:
        cases += [(2, 10, "sleep"), (20, 40, "sleep"), (40, 20, "sleep")]
    if device.type == "cuda":
        # A device-bound step. On a CPU a busy matmul loop mostly measures whoever else shares the cores
        # (a run on a loaded 2-core machine gave 83 ms for a 20 ms loop), so CPU rows use sleeps only.
        cases += [(10, 20, "matmul"), (20, 40, "matmul")]
    rows = []
    for load_ms, step_ms, kind in cases:
        step = _Step(step_ms, kind, device)
        # Modes interleaved and repeated, median kept: slow drifts on a busy machine hit all modes alike.
        samples = {mode: [] for mode in ("loader alone", "step alone") + MODES}
        for _ in range(repeats):
            for mode in samples:
                samples[mode].append(_run(mode, n_batches, load_ms, step, device))
        times = {mode: statistics.median(values) for mode, values in samples.items()}
        load, alone = times["loader alone"], times["step alone"]
        for mode in MODES:
            rows.append({"device": device.type, "load_ms": load_ms, "step_ms": step_ms, "step_kind": kind,
                         "measured_load_ms": load, "measured_step_ms": alone, "mode": mode,
                         "ms_per_step": times[mode],
                         "hidden_fraction": None if mode == "plain" else (times["plain"] - times[mode]) / load,
                         "hidden_ceiling": min(load, alone) / load})
    return rows


def _lognormal_lengths(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    raw = torch.exp(math.log(64) + 0.9 * torch.randn(n, generator=g))
    return raw.round().clamp(4, ROW).to(torch.long).tolist()


def padding_benchmark(quick: bool, batch_size: int = 32) -> list[dict]:
    n = 4000 if quick else 20000
    lengths = _lognormal_lengths(n)
    real = sum(lengths)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1)).tolist()
    random_batches = [[order[i] for i in b] for b in consecutive_batches(n, batch_size)]
    dynamic = slots_padded_to_longest(lengths, random_batches)

    def row(method: str, slots: int, shapes: int | None) -> dict:
        pad = 1 - real / slots
        dyn_pad = 1 - real / dynamic
        return {"method": method, "token_slots": slots, "pad_fraction": pad,
                "less_padding_than_dynamic": dyn_pad / pad if pad > 0 else float("inf"),
                "distinct_shapes": shapes}

    samples = [{"input_ids": [1] * k} for k in lengths]
    rows = [
        row("pad to longest in batch (dynamic)", dynamic,
            len({max(lengths[i] for i in b) for b in random_batches})),
        row(f"pad to {ROW} (static)", n * ROW, 1),
        row("bucketing, random batches", bucket_padding_stats(lengths, random_batches, BUCKETS).slots_after,
            len(BUCKETS)),
        row("bucketing + BucketBatchSampler",
            BucketBatchSampler(lengths, batch_size, BUCKETS, seed=0).padding_stats().slots_after, len(BUCKETS)),
    ]
    for strategy in ("ffd", "greedy"):
        packed = PackedDataset(samples, ROW, strategy=strategy)
        rows.append(row(f"packing into {ROW}-token rows ({strategy})", len(packed) * ROW, 1))
    for r in rows:
        r.update({"samples": n, "mean_length": real / n, "max_length": max(lengths), "batch_size": batch_size})
    return rows


def _plot(overlap_rows: list[dict], padding_rows: list[dict]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    cases = sorted({(r["device"], r["load_ms"], r["step_ms"], r["step_kind"]) for r in overlap_rows},
                   key=lambda c: (c[0], c[3], c[1], c[2]))
    width = 0.8 / len(MODES)
    for m, mode in enumerate(MODES):
        values = [next(r["ms_per_step"] for r in overlap_rows
                       if (r["device"], r["load_ms"], r["step_ms"], r["step_kind"]) == c and r["mode"] == mode)
                  for c in cases]
        ax1.bar([i + m * width for i in range(len(cases))], values, width, label=mode)
    ax1.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
    ax1.set_xticklabels([f"{d}\nL={lo} S={s}\n{k}" for d, lo, s, k in cases], fontsize=8)
    ax1.set_ylabel("ms per step (lower is better)")
    ax1.set_title("Loader of L ms, step of S ms")
    ax1.legend(fontsize=8)
    names = [r["method"] for r in padding_rows]
    ax2.barh(names, [100 * r["pad_fraction"] for r in padding_rows])
    ax2.set_xlabel("% of token slots that are padding")
    ax2.set_title("Padding on lognormal lengths (max 512)")
    ax2.invert_yaxis()
    fig.tight_layout()
    return fig


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small run, under a minute")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="default: cpu, plus cuda when one is present")
    args = parser.parse_args(argv)
    devices = [args.device] if args.device else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

    overlap_rows = []
    for name in devices:
        overlap_rows += overlap_benchmark(torch.device(name), args.quick)
    print("\nPrefetching: ms per step and fraction of the loader's L ms hidden behind the step")
    _report.print_table(overlap_rows, [
        ("device", "device", "s"), ("load_ms", "L ms", "d"), ("step_ms", "S ms", "d"), ("step_kind", "step", "s"),
        ("measured_load_ms", "L meas.", ".1f"), ("measured_step_ms", "S meas.", ".1f"),
        ("mode", "mode", "s"), ("ms_per_step", "ms/step", ".1f"), ("hidden_fraction", "L hidden", ".0%"),
        ("hidden_ceiling", "ceiling", ".0%")])

    padding_rows = padding_benchmark(args.quick)
    print(f"\nPadding: {padding_rows[0]['samples']} samples, mean length {padding_rows[0]['mean_length']:.0f}, "
          f"batch {padding_rows[0]['batch_size']}")
    _report.print_table(padding_rows, [
        ("method", "method", "s"), ("pad_fraction", "padding", ".1%"),
        ("less_padding_than_dynamic", "x less than dynamic", ".2f"), ("distinct_shapes", "seq shapes", "d")])

    payload = {"environment": _report.environment(devices[-1]), "quick": args.quick,
               "overlap": overlap_rows, "padding": padding_rows}
    json_path = _report.write_json("io", payload)
    png_path = _report.save_figure(_plot(overlap_rows, padding_rows), "io")
    print(f"\nwrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()
