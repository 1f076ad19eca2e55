"""Print, as a table, the compilations a RecompileGuard recorded: at which step, why, how many.

    python tools/xla_report.py recompiles.json            # a file written by RecompileGuard.save()
    python tools/xla_report.py --strict recompiles.json   # exit status 1 if anything compiled after warm-up

Without a file it prints this process's accel.xla.metrics().compilations, which is only useful from
inside a training script (`main([])` after the loop): a fresh process has compiled nothing. Reading a
file needs neither torch nor accel.
"""
from __future__ import annotations

import argparse
import json
import sys

# Must match accel.compiler.recompile_guard.FORMAT / FORMAT_VERSION (a test checks it); not imported
# so that reading a report does not load torch.
FORMAT = "accel.recompile_guard"
FORMAT_VERSION = 1
_EVENT_KEYS = ("step", "count", "warmup", "cause")


def load_report(path: str) -> dict:
    """Read and check a JSON report written by RecompileGuard.save().

    Args:
        path: the JSON file.

    Returns:
        The report as a dict (see RecompileGuard.to_dict()).

    Raises:
        OSError: the file cannot be read.
        ValueError: the file is not a RecompileGuard report of a known version.
    """
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON: {exc}") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"not a RecompileGuard report (expected \"format\": {FORMAT!r})")
    if data.get("version") != FORMAT_VERSION:
        raise ValueError(f"report version {data.get('version')!r}, this tool reads version {FORMAT_VERSION}")
    events = data.get("events")
    if not isinstance(events, list):
        raise ValueError("\"events\" must be a list")
    for i, event in enumerate(events):
        missing = [k for k in _EVENT_KEYS if not isinstance(event, dict) or k not in event]
        if missing:
            raise ValueError(f"events[{i}] lacks {', '.join(missing)}")
    return data


def report_from_metrics() -> dict:
    """This process's accel.xla.metrics().compilations, shaped like a saved report.

    Returns:
        A dict with "events" (each with a "guard" key), "compiles" (all XLA compiles of the process)
        and "source": "accel.xla.metrics()".

    Raises:
        RuntimeError: torch_xla is not installed.
    """
    from accel.xla._metrics import metrics

    m = metrics(wait=False)
    events = [
        {"step": c.step, "count": c.count, "warmup": c.warmup, "cause": c.cause, "guard": c.guard}
        for c in m.compilations
    ]
    return {"source": "accel.xla.metrics()", "compiles": m.compiles, "events": events}


def format_table(report: dict, after_warmup_only: bool = False) -> str:
    """The report's events as an aligned text table with a summary line.

    Args:
        report: a dict from load_report() or report_from_metrics().
        after_warmup_only: leave out the warm-up steps' rows (the summary still counts them).

    Returns:
        The table, lines joined with "\\n" (no trailing newline).
    """
    events = report["events"]
    shown = [e for e in events if not (after_warmup_only and e["warmup"])]
    with_guard = any("guard" in e for e in shown)
    header = ["step", "compiles", "phase"] + (["guard"] if with_guard else []) + ["cause"]
    rows = [
        [str(e["step"]), str(e["count"]), "warm-up" if e["warmup"] else "steady"]
        + ([str(e.get("guard", ""))] if with_guard else [])
        + [str(e["cause"])]
        for e in shown
    ]
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header) - 1)]
    lines = []
    rule = ["-" * w for w in widths] + ["-" * max([len(header[-1])] + [len(r[-1]) for r in rows])]
    for r in [header, rule] + rows:
        # Numbers right-aligned, words left-aligned; the cause column is last and left ragged.
        cells = [c.rjust(w) if i < 2 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(cells + [r[-1]]).rstrip())
    if not rows:
        lines.append("(no compilations recorded)")
    steady = [e for e in events if not e["warmup"]]
    if "source" in report:
        summary = (
            f"{report['compiles']} XLA compiles in this process; {sum(e['count'] for e in events)} in "
            f"{len(events)} steps attributed by RecompileGuard ({len(steady)} after warm-up)"
        )
    else:
        summary = (
            f"{report.get('compiles', sum(e['count'] for e in events))} compiles in {len(events)} of "
            f"{report.get('steps', '?')} steps ({len(steady)} after warm-up); backend "
            f"{report.get('backend', '?')}, {report.get('warmup_steps', '?')} warm-up steps"
        )
        if report.get("dropped_events"):
            summary += f"; {report['dropped_events']} later events not kept"
    lines.append(summary)
    return "\n".join(lines)


def main(argv=None) -> int:
    """Print the table; see the module docstring.

    Args:
        argv: the arguments (without the program name); None reads sys.argv.

    Returns:
        0, or 1 with --strict when a step compiled after warm-up, or 2 when the report cannot be read.
    """
    parser = argparse.ArgumentParser(
        prog="xla_report.py",
        description="Print the compilations a RecompileGuard recorded (step, cause: input and dimension "
        "that changed, count): from a JSON file written by RecompileGuard.save(), or, without a file, "
        "from this process's accel.xla.metrics().",
    )
    parser.add_argument("report", nargs="?", help="JSON file written by RecompileGuard.save()")
    parser.add_argument("--after-warmup", action="store_true", help="only the steps after warm-up")
    parser.add_argument("--strict", action="store_true", help="exit with status 1 if a step compiled after warm-up")
    args = parser.parse_args(argv)
    try:
        report = load_report(args.report) if args.report else report_from_metrics()
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"xla_report: {args.report or 'accel.xla.metrics()'}: {exc}", file=sys.stderr)
        return 2
    print(format_table(report, after_warmup_only=args.after_warmup))
    if args.strict and any(not e["warmup"] for e in report["events"]):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
