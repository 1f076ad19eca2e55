"""Host cost per call: each op of accel.runtime as a model calls it, next to torch's own, in one run.

On inputs so small that the kernels take no time, a call's time is what the host spends on it: Python
argument checks, the dispatcher, autograd. That cost is what made the hooks slow down BERT-base on an
H100 (issue 9: a small-batch eager step is bound by the host). For every `host_cases` in
benchmarks/kernel_cases/<op>.py it prints microseconds per call for ours and the peer and the ratio
(peer / ours: >= 1 means a call of ours costs no more than torch's), then writes
benchmarks/results/host_cost_<device>.json and a PNG.

The two sides are timed in alternating rounds and each keeps its fastest round, so a busy or
throttled machine (shared CI hosts, laptops) slows both alike instead of whichever ran second.

    python benchmarks/host_cost.py [--device cpu|cuda] [--ops layer_norm,quick_gelu] [--rounds 15]
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _report, kernel_cases  # noqa: E402


def time_alternating(fns: dict[str, object], device: str, rounds: int, calls: int) -> dict[str, float]:
    """Seconds per call of each fn: the fastest of `rounds` rounds of `calls` calls, the fns taking
    turns round by round."""
    for fn in fns.values():  # warm-up: builds, caches, autograd graph pools
        for _ in range(max(10, calls // 10)):
            fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            _report.sync(device)
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            _report.sync(device)
            best[name] = min(best[name], (time.perf_counter() - start) / calls)
    return best


def load_cases(device: str, ops: set[str] | None):
    for info in pkgutil.iter_modules(kernel_cases.__path__):
        if ops and info.name not in ops:
            continue
        module = importlib.import_module(f"benchmarks.kernel_cases.{info.name}")
        if hasattr(module, "host_cases"):
            yield from module.host_cases(device)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    ap.add_argument("--rounds", type=int, default=15, help="alternating rounds per case")
    ap.add_argument("--calls", type=int, default=200, help="calls per round")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: what is measured is the host's serial cost)")
    ap.add_argument("--results-dir", type=Path, default=_report.RESULTS)
    args = ap.parse_args(argv)
    ops = {o.strip() for o in args.ops.split(",") if o.strip()} or None
    torch.set_num_threads(args.threads)

    env = _report.environment(args.device)
    print(f"device: {env['device']}   torch {env['torch']}   {args.threads} CPU thread(s)\n")
    rows = []
    for case in load_cases(args.device, ops):
        times = time_alternating({"ours": case.ours, **case.peers}, args.device, args.rounds, args.calls)
        ours = times.pop("ours")
        best = min(times, key=times.get)
        rows.append({"op": case.op, "size": case.size, "ours_us": ours * 1e6, "peer": best,
                     "peer_us": times[best] * 1e6, "ratio": times[best] / ours,
                     "peers_us": {p: t * 1e6 for p, t in times.items()}})
        print(f"  {case.op:<28} ours {ours * 1e6:8.1f} us   {best} {times[best] * 1e6:8.1f} us   "
              f"x{times[best] / ours:5.2f}", flush=True)
    print()
    _report.print_table(rows, [("op", "op", ""), ("size", "size", ""), ("ours_us", "ours us", ".1f"),
                               ("peer", "peer", ""), ("peer_us", "peer us", ".1f"),
                               ("ratio", "peer/ours", ".2f")])
    tag = "cuda" if args.device.startswith("cuda") else "cpu"
    payload = {**env, "threads": args.threads, "rounds": args.rounds, "calls": args.calls, "rows": rows}
    path = _report.write_json(f"host_cost_{tag}", payload, args.results_dir)
    png = _plot(rows, env, tag, args.results_dir)
    print(f"\nwrote {path} and {png}")
    return 0


def _plot(rows, env, tag, directory):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, max(3, 0.35 * len(rows))))
    labels = [f"{r['op']} {r['size']}" for r in rows]
    y = range(len(rows))
    ax.barh([i - 0.2 for i in y], [r["ours_us"] for r in rows], height=0.4, label="accel")
    ax.barh([i + 0.2 for i in y], [r["peer_us"] for r in rows], height=0.4, label="torch (best peer)")
    ax.set_yticks(list(y), labels)
    ax.invert_yaxis()
    ax.set_xlabel("microseconds per call (host cost: tiny inputs)")
    ax.set_title(f"accel host cost per call on {env['device']} ({env['date']})")
    ax.legend()
    return _report.save_figure(fig, f"host_cost_{tag}", directory)


if __name__ == "__main__":
    sys.exit(main())
