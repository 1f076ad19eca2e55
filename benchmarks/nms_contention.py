"""CPU nms / soft-NMS with every core free and with one core kept busy by another process.

A kernel that wakes the thread pool once per selection round waits, every round, for a thread the OS has
not scheduled when another process holds a core. This measures accel's nms and gaussian soft-NMS on
20000 boxes with the pool's threads and with one thread, each with the cores free and with a busy-loop
process running, and reports the ratio (one thread / all threads: >= 1 means the threads do not hurt).

    python benchmarks/nms_contention.py [--boxes 20000] [--repeats 3]

Writes benchmarks/results/nms_contention.json and .png.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from accel.runtime.nn.nms import nms, soft_nms  # noqa: E402
from benchmarks import _report  # noqa: E402


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def _inputs(n: int):
    g = torch.Generator().manual_seed(0)
    xy = torch.rand(n, 2, generator=g) * 400
    boxes = torch.cat([xy, xy + torch.rand(n, 2, generator=g) * 40 + 0.5], 1)
    return boxes, torch.rand(n, generator=g)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--boxes", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    boxes, scores = _inputs(args.boxes)
    dets = torch.cat([boxes, scores[:, None]], 1)
    ops = {
        "nms": lambda: nms(boxes, scores, 0.5),
        "soft_nms gaussian": lambda: soft_nms(dets, method="gaussian", sigma=0.5, min_score=1e-3),
    }
    threads = torch.get_num_threads()
    rows = []
    for load in ("cores free", "one core busy"):
        stop, spinner = mp.Event(), None
        if load == "one core busy":
            spinner = mp.Process(target=_spin, args=(stop,), daemon=True)
            spinner.start()
        try:
            for name, fn in ops.items():
                torch.set_num_threads(threads)
                all_threads = _report.median_seconds(fn, args.repeats)
                torch.set_num_threads(1)
                one_thread = _report.median_seconds(fn, args.repeats)
                torch.set_num_threads(threads)
                rows.append({"op": name, "load": load, "threads": threads, "all_s": all_threads,
                             "one_s": one_thread, "ratio": one_thread / all_threads})
        finally:
            stop.set()
            if spinner is not None:
                spinner.join()
    _report.print_table(rows, [("op", "op", ""), ("load", "load", ""), ("threads", "threads", "d"),
                               ("all_s", "all threads s", ".3f"), ("one_s", "one thread s", ".3f"),
                               ("ratio", "one/all", ".2f")])
    env = _report.environment("cpu")
    path = _report.write_json("nms_contention", {"environment": env, "boxes": args.boxes, "rows": rows})
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    labels = [f"{r['op']}\n{r['load']}" for r in rows]
    ax.bar(labels, [r["ratio"] for r in rows])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("one thread / all threads")
    ax.set_title(f"accel CPU nms, {args.boxes} boxes, {env.get('device', 'cpu')}", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    _report.save_figure(fig, "nms_contention")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
