"""Where a BERT-base training step spends its time, mode against mode: the profile behind bert_base.py's rows.

bert_base.py says how fast each mode trains; this says why. Each mode (bert_base.py's set-ups: peer, accel,
eager-amp, ...) is set up on one fixed size, warmed up (compiles and CUDA-graph recording happen there), and
then a few steps run under torch.profiler, each taking its batch from the mode's loader as a training loop
does (accel's Prefetcher and its thread included). Reported per mode and step: wall time, the host's time to
issue the steps (up to the final wait for the device: when it is close to the wall time, the host is the
bottleneck), the time kernels kept the device busy (on the CPU: the self time of the ops), the gap between
wall and busy (launch and host overhead, syncs), the busy time split into kinds of kernel (matmul, attention,
fused elementwise by Inductor, the optimizer, copies, ...), the top kernels by time, and on CUDA the host's
calls into the CUDA runtime and driver by kind: kernel launches outside CUDA graphs, graph launches, syncs and
copies (a compiled step whose CUDA graphs were skipped shows hundreds of kernel launches and no graph launch).
A mode ahead by x% shows here which kinds it wins on.

    python benchmarks/step_profile.py [--size 32x128] [--modes peer,accel] [--steps 5] [--top 15] [--quick]

--modes takes bert_base.py's modes, its accel:FIELD=VALUE variants too: e.g. accel:compute.cuda_graphs=false
beside accel shows what CUDA graphs save the host (nothing, if accel's graphs were skipped).

Writes <results-dir>/step_profile_<device>.json (rewritten after every mode, so a run cut short keeps what it
profiled) and .png (default benchmarks/results/).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _report  # noqa: E402
from benchmarks import bert_base as bb  # noqa: E402

# Kinds of kernel (or CPU op), first match wins: the SDPA back ends (before GEMMs: cuDNN's attention kernels
# carry sm90_ in their names), the name patterns of cuBLAS/CUTLASS/nvjet GEMMs, the optimizers' multi-tensor
# kernels, Inductor's generated kernels (those drawing random numbers apart: Triton's tl.rand costs a Philox an
# element, so a dropout's forward kernel can be bound by that rather than by its bytes), copies and fills.
KINDS = (
    ("attention", r"flash|fmha|attention|sdpa|efficient"),
    # oneDNN's fp32 products on the CPU: accel::onednn_mm around mkldnn::_linear_pointwise (compute.cpu_gemm)
    ("matmul", r"gemm|cutlass|nvjet|xmma|sm90_|sm80_|aten::(mm|addmm|bmm|baddbmm|linear)$|_linear_pointwise|onednn_mm"),
    ("optimizer", r"adam|foreach|multi_tensor"),
    # before the next: Inductor's kernels are named after the ops they fuse
    ("inductor fused, drawing", r"^triton_.*(native_dropout(?!_backward)|bernoulli|rand)"),
    ("inductor fused", r"^triton_"),
    ("layer_norm / dropout", r"layer_norm|dropout|philox|masked_scale"),
    ("copy / fill", r"copy|memcpy|memset|fill|cat|index"),
)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


def parse_size(text: str) -> tuple[int, int]:
    batch, _, seq = text.partition("x")
    if not (batch.isdigit() and seq.isdigit() and int(batch) > 0 and int(seq) > 0):
        raise argparse.ArgumentTypeError(f"--size: expected BATCHxSEQ such as 32x128, got {text!r}")
    return int(batch), int(seq)


def kernel_times(prof, device: torch.device) -> dict[str, tuple[int, float]]:
    """name -> (calls, self time in us): device kernels on CUDA, the ops' own CPU time on the CPU."""
    out = {}
    for e in prof.key_averages():
        if device.type == "cuda":
            if e.device_type != torch.autograd.DeviceType.CUDA or e.self_device_time_total <= 0:
                continue
            out[e.key] = (e.count, float(e.self_device_time_total))
        elif e.self_cpu_time_total > 0 and not e.key.startswith("ProfilerStep"):
            out[e.key] = (e.count, float(e.self_cpu_time_total))
    return out


# The host's calls into the CUDA runtime and driver, by kind (first match wins); the profiler records them as
# CPU events named after the API function.
HOST_CALLS = (
    ("graph launches", r"^cu(da)?GraphLaunch"),
    ("kernel launches", r"^cu(da)?LaunchKernel|^cuLaunchCooperativeKernel"),
    ("syncs", r"Synchronize$"),
    ("copies", r"^cu(da)?Memcpy"),
)


def host_calls(prof, steps: int) -> dict[str, float]:
    """Calls per step of each HOST_CALLS kind (none on the CPU)."""
    counts = {kind: 0.0 for kind, _ in HOST_CALLS}
    for e in prof.key_averages():
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        for kind, pattern in HOST_CALLS:
            if re.search(pattern, e.key):
                counts[kind] += e.count / steps
                break
    return counts


def host_top(prof, steps: int, top: int) -> list[dict]:
    """The host's costliest ops and calls (self CPU time per step, every thread: a loader's too)."""
    events = [e for e in prof.key_averages()
              if e.device_type == torch.autograd.DeviceType.CPU and e.self_cpu_time_total > 0
              and not e.key.startswith("ProfilerStep")]
    events.sort(key=lambda e: -e.self_cpu_time_total)
    return [{"name": e.key, "calls_per_step": e.count / steps, "ms_per_step": e.self_cpu_time_total / steps / 1e3}
            for e in events[:top]]


def profile_mode(mode: str, ctx: bb.Context, warmup: int, steps: int, top: int, trace: Path | None = None) -> dict:
    """One mode's row; with `trace`, the profiled steps' timeline is written there too (Chrome trace format,
    gzipped: chrome://tracing or ui.perfetto.dev), host threads and device streams side by side."""
    row = {"mode": mode}
    skips, heard = bb.cudagraph_skips(), len(bb.cudagraph_skip_reasons())
    try:
        run = bb.setup(mode, ctx)  # accel:F=V variants too
        for _ in range(warmup):
            run.step(next(run.batches))
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.device.type == "cuda" else [])
        # One step more under a profiler of its own, not kept: compiled code may compile or capture again
        # the first time it runs profiled (H100, 2026-11-27: the peer's first profiled step took 688 ms, its
        # others 9-10 ms, and made its row 146 ms a step)
        with profile(activities=activities):
            run.step(next(run.batches))
        bb.device_sync(run.device)
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                run.step(next(run.batches))  # the loader's work is part of a training step's host time
            issued = time.perf_counter() - start
            bb.device_sync(run.device)
            wall = time.perf_counter() - start
    except bb.Skip as reason:
        return {**row, "status": "skipped", "reason": str(reason)}
    finally:
        bb.restore_hooks()
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        partial = trace.with_name(f".partial-{trace.name}")  # ends in .gz, so torch compresses it too
        prof.export_chrome_trace(str(partial))
        os.replace(partial, trace)  # whole or absent, never a torn file
        row["trace"] = trace.name
    times = kernel_times(prof, run.device)
    busy_us = sum(t for _, t in times.values())
    kinds: dict[str, float] = {}
    for name, (_, t) in times.items():
        kind = kind_of(name)
        kinds[kind] = kinds.get(kind, 0.0) + t / steps / 1e3
    ranked = sorted(times.items(), key=lambda item: -item[1][1])[:top]
    wall_ms, busy_ms = wall / steps * 1e3, busy_us / steps / 1e3
    return {**row, "status": "ok", "precision": run.precision, "steps": steps,
            # the profiler's own cost inflates wall time a little, and the same for every mode
            "wall_ms": wall_ms, "host_ms": issued / steps * 1e3, "busy_ms": busy_ms,
            "gap_ms": max(wall_ms - busy_ms, 0.0), "host_calls": host_calls(prof, steps),
            "cudagraph_skips": bb.cudagraph_skips() - skips,
            "cudagraph_skip_reasons": bb.distinct(bb.cudagraph_skip_reasons(heard)),
            "host_top": host_top(prof, steps, top) if run.device.type == "cuda" else [],  # on the CPU "top" lists the ops
            "kinds_ms": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "top": [{"name": n, "calls_per_step": c / steps, "ms_per_step": t / steps / 1e3, "kind": kind_of(n)}
                    for n, (c, t) in ranked]}


def print_report(rows: list[dict]) -> None:
    ok = [r for r in rows if r["status"] == "ok"]
    for r in rows:
        if r["status"] != "ok":
            print(f"  {r['mode']}: {r['status']}: {r.get('reason', '')}")
    if not ok:
        return
    kinds = sorted({k for r in ok for k in r["kinds_ms"]}, key=lambda k: -max(r["kinds_ms"].get(k, 0) for r in ok))
    table = [{"what": "wall ms / step", **{r["mode"]: r["wall_ms"] for r in ok}},
             {"what": "host ms / step (issuing)", **{r["mode"]: r["host_ms"] for r in ok}},
             {"what": "busy ms / step", **{r["mode"]: r["busy_ms"] for r in ok}},
             {"what": "gap ms / step", **{r["mode"]: r["gap_ms"] for r in ok}},
             {"what": "CUDA graphs skipped (set-up on)", **{r["mode"]: r["cudagraph_skips"] for r in ok}}]
    table += [{"what": f"  {k}", **{r["mode"]: r["kinds_ms"].get(k, 0.0) for r in ok}} for k in kinds]
    if any(any(r["host_calls"].values()) for r in ok):
        table += [{"what": f"{kind} / step", **{r["mode"]: r["host_calls"][kind] for r in ok}}
                  for kind, _ in HOST_CALLS]
    _report.print_table(table, [("what", "per step", "")] + [(r["mode"], r["mode"], ".3f") for r in ok])
    for r in ok:
        for reason in r["cudagraph_skip_reasons"]:
            print(f"{r['mode']}: graph skip: {reason}")
    for r in ok:
        print(f"\ntop kernels, {r['mode']} ({r['precision']})")
        _report.print_table([{**t, "name": t["name"][:90]} for t in r["top"]],
                            [("ms_per_step", "ms/step", ".3f"), ("calls_per_step", "calls", ".0f"),
                             ("kind", "kind", ""), ("name", "name", "")])
        if r["host_top"]:
            print(f"\ntop host ops and CUDA calls, {r['mode']} (self CPU time, every thread)")
            _report.print_table([{**t, "name": t["name"][:90]} for t in r["host_top"]],
                                [("ms_per_step", "ms/step", ".3f"), ("calls_per_step", "calls", ".0f"),
                                 ("name", "name", "")])


def plot(rows: list[dict], title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(7, 4))
    kinds = sorted({k for r in ok for k in r["kinds_ms"]})
    bottom = [0.0] * len(ok)
    for kind in kinds + ["gap"]:
        values = [r["gap_ms"] if kind == "gap" else r["kinds_ms"].get(kind, 0.0) for r in ok]
        ax.bar([r["mode"] for r in ok], values, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("ms per step")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    return fig


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, help="BATCHxSEQ of the fixed workload (default 32x128; quick 4x32)")
    ap.add_argument("--modes", type=bb.parse_modes, default=["peer", "accel"], help="comma-separated bert_base modes")
    ap.add_argument("--warmup", type=int, default=3, help="steps before profiling (compiles happen there)")
    ap.add_argument("--steps", type=int, default=5, help="profiled steps per mode")
    ap.add_argument("--top", type=int, default=15, help="kernels listed per mode")
    ap.add_argument("--trace", action="store_true",
                    help="also write each mode's timeline: step_profile_<device>_<mode>.trace.json.gz")
    ap.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda where there is one")
    ap.add_argument("--quick", action="store_true", help="tiny BERT, 4x32 (the test suite's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results-dir", type=Path, default=_report.RESULTS)
    args = ap.parse_args(argv)
    if args.warmup < 0 or args.steps < 1 or args.top < 1:
        ap.error(f"--warmup >= 0, --steps >= 1, --top >= 1 expected, got {args.warmup}, {args.steps}, {args.top}")
    device = torch.device(args.device) if args.device else bb.default_device()
    batch, seq = args.size or ((4, 32) if args.quick else (32, 128))
    config = bb.bert_config(args.quick)
    per_mode = args.warmup + 1 + args.steps  # + the profiled step that is not kept (profile_mode)
    workload = bb.Workload("fixed", batch, seq, bb.make_samples([seq] * (batch * per_mode), config.vocab_size,
                                                                 args.seed))
    print(f"BERT {'(quick)' if args.quick else 'base'} {workload.name} on {_report.device_name(str(device))}: "
          f"{args.warmup} warm-up + 1 profiled warm-up + {args.steps} profiled steps per mode", flush=True)
    model = bb.build_model(config, args.seed)
    from accel.compiler import cudagraph_skips

    cudagraph_skips.watch()  # the reason of every skip, each mode's own
    rows = []
    name = f"step_profile_{device.type}"
    payload = {**_report.environment(str(device)), "workload": workload.name, "args": vars(args), "rows": rows}
    for mode in args.modes:
        bb.release_memory()
        torch.manual_seed(args.seed)
        trace = (args.results_dir / f"{name}_{re.sub(r'[^A-Za-z0-9_.-]+', '_', mode)}.trace.json.gz"
                 if args.trace else None)
        rows.append(profile_mode(mode, bb.Context(model, workload, device, lr=2e-5), args.warmup, args.steps,
                                 args.top, trace))
        # after every mode: a run stopped by a time limit keeps the modes it profiled
        json_path = _report.write_json(name, payload, args.results_dir)
        print(f"{mode}: {rows[-1]['status']}; rows so far in {json_path}", flush=True)
    print_report(rows)
    if any(r["status"] == "ok" for r in rows):
        png = _report.save_figure(plot(rows, f"BERT {workload.name}, {payload['device']}"), name, args.results_dir)
        print(f"\nwrote {json_path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
