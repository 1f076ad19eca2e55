"""multi_apply on one stream against multi_apply_multi_stream on 1, 2 and 4 CUDA streams.

The workload is a detection head's pattern: many independent calls (default 64), each a short chain
of small matmuls (+ tanh) that occupies a few of the GPU's SMs. On one stream the calls run one after
another and most SMs idle; on several streams their kernels can run side by side. Reported per
workload and mode: milliseconds per multi_apply (issue + run, the host waits for the device at the
end of each timed batch), the host's issue time alone (when it is close to the total the run is
bound by kernel launches, which no number of streams shortens) and the ratio sequential / mode
(> 1: faster than multi_apply).

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
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from accel.runtime.utils import multi_apply, multi_apply_multi_stream  # noqa: E402
from benchmarks import _report  # noqa: E402

STREAMS = (1, 2, 4)
# (rows m, width k, matmuls per call): an (m, k) @ (k, k) chain per call.
WORKLOADS = ((64, 256, 4), (64, 1024, 4), (256, 1024, 2))
QUICK_WORKLOADS = ((64, 512, 2),)


def head(x: torch.Tensor, w: torch.Tensor, depth: int):
    for _ in range(depth):
        x = (x @ w).tanh_()  # tanh keeps the values bounded over the chain
    return x, x.sum()


def _inputs(calls: int, m: int, k: int, device: torch.device):
    g = torch.Generator(device=device).manual_seed(0)
    xs = torch.randn(calls, m, k, device=device, generator=g)
    ws = torch.randn(calls, k, k, device=device, generator=g) / k ** 0.5
    return xs, ws


def _time(fn, min_time: float) -> tuple[float, float]:
    """(median seconds per call with the device drained, median seconds the host spends issuing it)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    reps = max(1, int(min_time / 5 / max(time.perf_counter() - start, 1e-6)))
    totals, issues = [], []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        end = time.perf_counter()
        totals.append((end - start) / reps)
        issues.append((issued - start) / reps)
    return statistics.median(totals), statistics.median(issues)


def run(calls: int, workloads, min_time: float, device: torch.device) -> list[dict]:
    rows = []
    for m, k, depth in workloads:
        xs, ws = _inputs(calls, m, k, device)
        name = f"{calls} calls x {depth} matmuls ({m}x{k} @ {k}x{k})"
        reference = multi_apply(head, xs, ws, depth=depth)
        modes = [("multi_apply", None, lambda: multi_apply(head, xs, ws, depth=depth))]
        modes += [(f"multi_stream {n}", n, lambda n=n: multi_apply_multi_stream(head, n, xs, ws, depth=depth))
                  for n in STREAMS]
        sequential_s = None
        for mode, streams, fn in modes:
            got = fn()
            # Same kernels on other streams: the results must agree before the times mean anything.
            for a, b in zip(got[0], reference[0]):
                torch.testing.assert_close(a, b)
            total, issue = _time(fn, min_time)
            if sequential_s is None:
                sequential_s = total
            rows.append({"workload": name, "calls": calls, "m": m, "k": k, "depth": depth, "mode": mode,
                         "streams": streams, "ms": total * 1e3, "issue_ms": issue * 1e3,
                         "ratio": sequential_s / total})
            print(f"  {name:<44} {mode:<16} {total * 1e3:8.3f} ms  (issue {issue * 1e3:7.3f} ms)"
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
