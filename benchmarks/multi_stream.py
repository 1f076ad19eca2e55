"""multi_apply on one stream against multi_apply_multi_stream on 1, 2 and 4 CUDA streams.

The workloads are a detection head's pattern: many independent calls (default 64), each a short chain
of small matmuls (+ tanh), or a sort of one level's scores (one thread block, one SM), that leave most of
the GPU's SMs idle. On one stream the calls run one after another; on several streams their kernels can
run side by side. Reported per workload and mode: milliseconds per multi_apply (issue + run, the host waits
for the device at the end of each timed batch), the host's issue time alone (when it is close to the total
the run is bound by kernel launches, which no number of streams shortens) and the ratio sequential / mode
(> 1: faster than multi_apply). Modes are timed in turn within each of 5 rounds (medians), so none gains
from going first.

    python benchmarks/multi_stream.py [--quick] [--calls 64] [--results-dir DIR]

Needs a CUDA GPU: on the CPU multi_apply_multi_stream runs the calls in order (it is multi_apply), so
without one this prints that and exits 0. Writes <results-dir>/multi_stream.json and .png
(default benchmarks/results/).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from accel.runtime.utils import multi_apply, multi_apply_multi_stream  # noqa: E402
from benchmarks import _report  # noqa: E402

STREAMS = (1, 2, 4)
ROUNDS = 5  # timing rounds; each round times every mode once, so no mode is favoured by running first


@dataclass(frozen=True)
class Workload:
    """`calls` independent calls of `head` (one per slice along dim 0 of each of `make`'s tensors)."""
    name: str
    make: Callable[[int, torch.Generator, torch.device], tuple]  # (calls, generator, device) -> multi_apply args
    head: Callable
    kwargs: dict = field(default_factory=dict)


def matmul_chain(x: torch.Tensor, w: torch.Tensor, depth: int):
    """A detection head's small dense layers: depth (m, k) @ (k, k) matmuls, each followed by tanh."""
    for _ in range(depth):
        x = (x @ w).tanh_()  # tanh keeps the values bounded over the chain
    return x, x.sum()


def top_scores(scores: torch.Tensor, k: int):
    """A detection head's per-level candidate selection: the k best of one level's scores, sorted. torch's
    sort of a few thousand values runs in one thread block: one SM busy for tens of microseconds."""
    values, order = scores.sort(descending=True)
    return values[:k], order[:k]


def matmuls(m: int, k: int, depth: int) -> Workload:
    def make(calls, g, device):
        return (torch.randn(calls, m, k, device=device, generator=g),
                torch.randn(calls, k, k, device=device, generator=g) / k ** 0.5)

    return Workload(f"{depth} matmuls ({m}x{k} @ {k}x{k})", make, matmul_chain, {"depth": depth})


def sorts(n: int, k: int) -> Workload:
    def make(calls, g, device):
        return (torch.rand(calls, n, device=device, generator=g),)

    return Workload(f"sort of {n} scores, top {k}", make, top_scores, {"k": k})


WORKLOADS = (matmuls(64, 256, 4), matmuls(64, 1024, 4), matmuls(256, 1024, 2), sorts(4096, 1000),
             sorts(16384, 1000))
QUICK_WORKLOADS = (matmuls(64, 512, 2), sorts(1024, 100))


def _time_once(fn, reps: int, device: torch.device) -> tuple[float, float]:
    """(seconds per call with the device drained, seconds the host spends issuing it), over reps calls."""
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    issued = time.perf_counter()
    _report.sync(device)
    end = time.perf_counter()
    return (end - start) / reps, (issued - start) / reps


def _time_modes(fns: list, min_time: float, device: torch.device) -> list[tuple[float, float]]:
    """Median (total, issue) seconds per call of each fn, the fns timed in turn within each round."""
    for fn in fns:  # warm-up: allocator, cuBLAS handles and workspaces of every stream
        for _ in range(3):
            fn()
    _report.sync(device)
    reps = []
    for fn in fns:
        start = time.perf_counter()
        fn()
        _report.sync(device)
        reps.append(max(1, int(min_time / ROUNDS / max(time.perf_counter() - start, 1e-6))))
    samples = [[] for _ in fns]
    for _ in range(ROUNDS):
        for i, fn in enumerate(fns):
            samples[i].append(_time_once(fn, reps[i], device))
    return [(statistics.median(t for t, _ in got), statistics.median(i for _, i in got)) for got in samples]


def run(calls: int, workloads, min_time: float, device: torch.device) -> list[dict]:
    rows = []
    for workload in workloads:
        g = torch.Generator(device=device).manual_seed(0)
        args, kwargs = workload.make(calls, g, device), workload.kwargs
        name = f"{calls} calls x {workload.name}"
        reference = multi_apply(workload.head, *args, **kwargs)
        modes = [("multi_apply", None, lambda: multi_apply(workload.head, *args, **kwargs))]
        modes += [(f"multi_stream {n}", n, lambda n=n: multi_apply_multi_stream(workload.head, n, *args, **kwargs))
                  for n in STREAMS]
        for _, _, fn in modes:
            # Same kernels on other streams: the results must agree before the times mean anything.
            for got, want in zip(fn(), reference):
                for a, b in zip(got, want):
                    torch.testing.assert_close(a, b)
        times = _time_modes([fn for _, _, fn in modes], min_time, device)
        sequential_s = times[0][0]
        for (mode, streams, _), (total, issue) in zip(modes, times):
            rows.append({"workload": name, "calls": calls, "mode": mode, "streams": streams, "ms": total * 1e3,
                         "issue_ms": issue * 1e3, "ratio": sequential_s / total})
            print(f"  {name:<50} {mode:<16} {total * 1e3:8.3f} ms  (issue {issue * 1e3:7.3f} ms)"
                  f"  x{sequential_s / total:5.2f}", flush=True)
    return rows


def _plot(rows: list[dict], env: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, ax = plt.subplots(figsize=(10, 4 + 0.4 * len(workloads)))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        values = [next(r["ratio"] for r in rows if r["workload"] == w and r["mode"] == mode) for w in workloads]
        ax.barh([j + i * width for j in range(len(workloads))], values, width, label=mode)
    ax.set_yticks([j + 0.4 - width / 2 for j in range(len(workloads))])
    ax.set_yticklabels(workloads, fontsize=8)
    ax.axvline(1.0, color="black", lw=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("speed-up over multi_apply on one stream (its time / this mode's time)")
    ax.set_title(f"multi_apply_multi_stream on {env['device']} ({env['date']})")
    ax.legend(fontsize=8)
    return fig


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one small workload (a smoke run)")
    ap.add_argument("--calls", type=int, default=64, help="calls per multi_apply (default 64)")
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds of timing per measurement")
    ap.add_argument("--results-dir", type=Path, default=_report.RESULTS)
    args = ap.parse_args(argv)
    if args.calls < 1:
        ap.error("--calls: expected an int >= 1")
    if not torch.cuda.is_available():
        print("multi_stream: no CUDA device. multi_apply_multi_stream overlaps calls on CUDA streams; on the "
              "CPU it runs them in order, exactly as multi_apply, so there is nothing to measure here. "
              "Nothing written.")
        return 0

    device = torch.device("cuda", torch.cuda.current_device())
    env = _report.environment(str(device))
    print(f"device: {env['device']}   torch {env['torch']}\n")
    rows = run(args.calls, QUICK_WORKLOADS if args.quick else WORKLOADS, args.min_time, device)
    print()
    _report.print_table(rows, [
        ("workload", "workload", ""), ("mode", "mode", ""), ("ms", "ms", ".3f"),
        ("issue_ms", "host issue ms", ".3f"), ("ratio", "sequential/this", ".2f"),
    ])
    payload = {"environment": env, "quick": args.quick, "calls": args.calls, "rows": rows}
    path = _report.write_json("multi_stream", payload, args.results_dir)
    png = _report.save_figure(_plot(rows, env), "multi_stream", args.results_dir)
    print(f"\nwrote {path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
