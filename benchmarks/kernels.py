"""Kernel benchmark: each op of accel.runtime next to its strongest peers, in one run.

For every case in benchmarks/kernel_cases/<op>.py it prints our time, the best peer's time, the ratio
(peer / ours: > 1 means we are faster), the achieved GB/s and that as a fraction of the device's
measured copy bandwidth (for memory-bound ops), then writes benchmarks/results/kernels_<device>.json
and a PNG of the ratios.

    python benchmarks/kernels.py [--device cpu|cuda] [--quick] [--ops quick_gelu,nms] [--budget-s S]
                                 [--exclude REGEX] [--ours-only]

--ours-only times our op alone: the baseline side of an A/B of two trees (benchmarks/kernels_ab.py), whose
peers the other side times already.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from accel.runtime.host_memory import keep_freed_memory  # noqa: E402
from accel.utils.dynamo import allow_recompiles  # noqa: E402
from benchmarks import _report, kernel_cases  # noqa: E402

ROUNDS = 5


def time_calls(fns: dict, device: str, min_time: float = 0.2, warmup: int = 3) -> dict:
    """Median seconds per call of each function, over ROUNDS batches each that together take about `min_time`
    per function. The batches alternate between the functions, round by round, so a machine that drifts
    (clocks, a busy host: calls this small are bound by the host on a fast GPU) slows every side alike
    instead of whichever ran later; ours and a peer running the very same code measured 0.75-1.29x apart
    on an H100 when timed one after the other."""
    batch = {}
    for name, fn in fns.items():
        for _ in range(warmup):
            fn()
        _report.sync(device)
        start = time.perf_counter()  # calibrate how many calls fill ~min_time / ROUNDS
        fn()
        _report.sync(device)
        batch[name] = max(1, int(min_time / ROUNDS / max(time.perf_counter() - start, 1e-7)))
    samples: dict = {name: [] for name in fns}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(batch[name]):
                fn()
            _report.sync(device)
            samples[name].append((time.perf_counter() - start) / batch[name])
    return {name: statistics.median(ts) for name, ts in samples.items()}


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted), the ceiling for memory-bound ops."""
    n = (1 << 28) if device.startswith("cuda") else (1 << 26)
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    t = time_calls({"copy": lambda: dst.copy_(src)}, device)["copy"]
    return 2 * n / t


def load_cases(device: str, quick: bool, ops: set[str] | None):
    for info in pkgutil.iter_modules(kernel_cases.__path__):
        if ops and info.name not in ops:
            continue
        module = importlib.import_module(f"benchmarks.kernel_cases.{info.name}")
        yield info.name, module.cases(device, quick)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small sizes only (a smoke run)")
    ap.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    ap.add_argument("--min-time", type=float, default=0.2, help="seconds of timing per measurement")
    ap.add_argument("--budget-s", type=float, help="skip the cases that would start after this many seconds "
                    "(they are listed as skipped), so a run under a time limit still writes its table")
    ap.add_argument("--exclude", type=re.compile, help="skip the cases whose 'op size' label this regular "
                    "expression matches (re.search), e.g. 'compiled' for the cases that compile first")
    ap.add_argument("--ours-only", action="store_true", help="time our op alone, no peers")
    ap.add_argument("--results-dir", type=Path, default=_report.RESULTS,
                    help="where the JSON and PNG go (default benchmarks/results; a partial --ops run "
                         "should not replace the full table there)")
    args = ap.parse_args(argv)
    ops = {o.strip() for o in args.ops.split(",") if o.strip()} or None

    # The cases compile one function per op for every size and dtype (and the closures of one lambda share
    # its cache): past Dynamo's default limit of 8 the rest would run eagerly and be timed as "compiled".
    allow_recompiles(64)
    env = _report.environment(args.device)
    # On the CPU, ours and the peers alike run with freed memory kept (what accelerate() sets there): outputs
    # over 32 MiB otherwise cost their page faults every call, which timed the allocator rather than the op
    env["keep_freed_memory"] = not args.device.startswith("cuda") and keep_freed_memory()
    bw = copy_bandwidth(args.device)
    print(f"device: {env['device']}   torch {env['torch']}   copy bandwidth {bw / 1e9:.1f} GB/s\n")

    rows, skipped = [], []
    started = time.perf_counter()
    for name, cases in load_cases(args.device, args.quick, ops):
        for case in cases:
            if args.exclude and args.exclude.search(f"{case.op} {case.size}"):
                continue
            if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
                skipped.append({"op": case.op, "size": case.size,
                                "reason": f"time budget (--budget-s {args.budget_s:g}) spent"})
                continue
            # "ours" cannot clash with a peer's name: those describe torch's code
            times = time_calls({"ours": case.ours, **({} if args.ours_only else case.peers)}, args.device,
                               args.min_time)
            ours = times.pop("ours")
            peers = times
            best = min(peers, key=peers.get) if peers else None
            gbps = case.bytes_moved / ours / 1e9
            rows.append({
                "op": case.op, "size": case.size, "ours_ms": ours * 1e3,
                "best_peer": best, "peer_ms": peers[best] * 1e3 if best else None,
                "ratio": peers[best] / ours if best else None,
                "gbps": gbps, "copy_frac": gbps * 1e9 / bw if case.memory_bound else None,
                "peers_ms": {p: t * 1e3 for p, t in peers.items()},
            })
            print(f"  {case.op:<24} {case.size:<18} ours {ours * 1e3:9.3f} ms"
                  + (f"   {best} {peers[best] * 1e3:9.3f} ms   x{peers[best] / ours:5.2f}" if best else ""),
                  flush=True)

    print()
    _report.print_table(rows, [
        ("op", "op", ""), ("size", "size", ""), ("ours_ms", "ours ms", ".3f"),
        ("best_peer", "best peer", ""), ("peer_ms", "peer ms", ".3f"),
        ("ratio", "peer/ours", ".2f"), ("gbps", "GB/s", ".1f"), ("copy_frac", "of copy BW", ".0%"),
    ])
    if skipped:
        print(f"\nskipped {len(skipped)} cases: {skipped[0]['reason']}")
    tag = "cuda" if args.device.startswith("cuda") else "cpu"
    payload = {**env, "copy_bandwidth_gbps": bw / 1e9, "quick": args.quick, "rows": rows, "skipped": skipped}
    path = _report.write_json(f"kernels_{tag}", payload, args.results_dir)
    png = _plot(rows, env, tag, args.results_dir)
    print(f"\nwrote {path} and {png}")
    return 0


def _plot(rows, env, tag, directory):
    labelled = [r for r in rows if r["ratio"]]
    return _report.ratio_bars([f"{r['op']} {r['size']}" for r in labelled], [r["ratio"] for r in labelled],
                              "speed-up over the best peer (peer time / our time)",
                              f"accel kernels on {env['device']} ({env['date']})", f"kernels_{tag}", directory)


if __name__ == "__main__":
    sys.exit(main())
