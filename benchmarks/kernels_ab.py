"""A kernel change against the code it replaces: two results of benchmarks/kernels.py from one machine (the
`kernels` and `kernels_base` steps of gpu_session.sh), compared row by row.

    python benchmarks/kernels_ab.py NEW.json BASE.json [--results-dir DIR]

Rows are matched by (op, size). Per row: the base and new times, base/new (> 1: the change is faster), both
fractions of the copy bandwidth and both speed-ups over the best peer (each run's own peers). Prints the
table, writes kernels_ab_<tag>.json and .png (kernels_<tag>.json is NEW's name); rows only one file has are listed, not compared. A change
is kept where it wins and reverted where it loses, op by op (the note says which).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _report  # noqa: E402


def compare(new: dict, base: dict) -> tuple[list[dict], list[str]]:
    """(rows of both runs with base/new, labels of rows only one run has)."""
    before = {(r["op"], r["size"]): r for r in base["rows"]}
    rows, unmatched = [], []
    for r in new["rows"]:
        b = before.pop((r["op"], r["size"]), None)
        if b is None:
            unmatched.append(f"new only: {r['op']} {r['size']}")
            continue
        rows.append({"op": r["op"], "size": r["size"], "base_ms": b["ours_ms"], "new_ms": r["ours_ms"],
                     "speedup": b["ours_ms"] / r["ours_ms"], "base_copy": b.get("copy_frac"),
                     "new_copy": r.get("copy_frac"), "base_vs_peer": b.get("ratio"), "new_vs_peer": r.get("ratio")})
    unmatched += [f"base only: {op} {size}" for op, size in before]
    return rows, unmatched


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("new", type=Path, help="kernels.py JSON of the change")
    ap.add_argument("base", type=Path, help="kernels.py JSON of the code it replaces")
    ap.add_argument("--results-dir", type=Path, default=_report.RESULTS)
    args = ap.parse_args(argv)
    new, base = (json.loads(p.read_text()) for p in (args.new, args.base))
    if new.get("device") != base.get("device"):
        raise SystemExit(f"kernels_ab: the runs are from different devices ({new.get('device')!r} and "
                         f"{base.get('device')!r}): compare runs of one machine")
    rows, unmatched = compare(new, base)
    _report.print_table(rows, [
        ("op", "op", ""), ("size", "size", ""), ("base_ms", "base ms", ".3f"), ("new_ms", "new ms", ".3f"),
        ("speedup", "base/new", ".2f"), ("base_copy", "base of copy BW", ".0%"), ("new_copy", "new of copy BW", ".0%"),
        ("base_vs_peer", "base peer/ours", ".2f"), ("new_vs_peer", "new peer/ours", ".2f"),
    ])
    for line in unmatched:
        print(line)
    tag = args.new.stem.removeprefix("kernels_")  # kernels_cuda.json -> kernels_ab_cuda.json
    payload = {"device": new.get("device"), "date": new.get("date"), "torch": new.get("torch"),
               "new": str(args.new), "base": str(args.base), "rows": rows, "unmatched": unmatched}
    path = _report.write_json(f"kernels_ab_{tag}", payload, args.results_dir)
    png = _report.ratio_bars([f"{r['op']} {r['size']}" for r in rows], [r["speedup"] for r in rows],
                             "base time / new time (> 1: the change is faster)",
                             f"kernel changes on {payload['device']} ({payload['date']})", f"kernels_ab_{tag}",
                             args.results_dir)
    print(f"\nwrote {path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
