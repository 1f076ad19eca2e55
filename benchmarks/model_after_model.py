"""Model after model in one process: how soon each one trains.

A sweep (learning rates, seeds), cross-validation or a notebook cell run again builds a model like the one before
and trains it in the same process. Dynamo keeps compiled graphs on the code objects of the model's forward, and a
new model whose calls pass their guards runs them without compiling. Rows, one process, models built alike with
their own seeds: `peer` (bert_base.py's: torch.compile + autocast + AdamW, CUDA graphs on CUDA) and `accel`
(bert_base.py's: accelerate() with its loader); any of bert_base.py's modes can be asked for.

Per mode and model: seconds from handing the fresh model over (torch.compile / accelerate()) to its first
training step done, the graphs compiled for it, and the median of the steps after it. Speed-up: the first
model's time to its first step over this model's.

Model: BertForSequenceClassification, the bert-base-cased configuration (bert_base.py's), random weights; data:
bert_base.py's fixed workload (--batch x --seq).

    python benchmarks/model_after_model.py [--quick] [--models 3] [--modes peer,accel] [--steps 3]

Writes benchmarks/results/model_after_model_<device>.json and .png.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from accel.runtime.host_memory import keep_freed_memory  # noqa: E402
from benchmarks import _report, bert_base  # noqa: E402

MODES = ("peer", "accel")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", type=bert_base.parse_modes, default=list(MODES), help="default: peer,accel")
    ap.add_argument("--models", type=int, default=3, help="models per mode, one after the other")
    ap.add_argument("--steps", type=int, default=3, help="steps timed after each model's first")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=("cuda", "cpu"))
    ap.add_argument("--quick", action="store_true", help="tiny BERT, batch 4 x 16, 2 models, 1 step")
    ap.add_argument("--out", help="result file name without extension (default model_after_model_<cpu|cuda>)")
    ap.add_argument("--results-dir", type=Path, default=_report.RESULTS)
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.steps, args.batch, args.seq = 2, 1, 4, 16
    if args.models < 2:
        ap.error(f"--models: at least 2 (the second model is the point), got {args.models}")
    args.device = torch.device(args.device or bert_base.default_device())
    args.out = args.out or f"model_after_model_{args.device.type}"
    return args


def one_model(mode: str, ctx: bert_base.Context, steps: int) -> dict:
    """Set `mode` up on ctx's model, then its first step and `steps` more; times and compiles."""
    before = bert_base.compile_count(ctx.device)
    start = time.perf_counter()
    run = bert_base.setup(mode, ctx)
    loss = run.step(next(run.batches))
    bert_base.device_sync(run.device)
    first = time.perf_counter() - start
    compiles = bert_base.compile_count(ctx.device) - before
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = run.step(next(run.batches))
        bert_base.device_sync(run.device)
        times.append(time.perf_counter() - start)
    return {"first_step_s": first, "compiles": compiles, "step_ms": 1e3 * statistics.median(times),
            "loss": float(loss.detach()), "precision": run.precision}


def main(argv=None) -> int:
    args = parse_args(argv)
    env = _report.environment(str(args.device))
    env["keep_freed_memory"] = args.device.type == "cpu" and keep_freed_memory()  # as bert_base.py
    config = bert_base.bert_config(args.quick)
    samples = bert_base.make_samples([args.seq] * args.batch * (args.steps + 1), config.vocab_size, args.seed)
    workload = bert_base.Workload("fixed", args.batch, args.seq, samples)
    print(f"BERT {'quick (tiny)' if args.quick else 'base'} on {env['device']}: {args.models} models a mode, "
          f"{workload.name}", flush=True)
    rows = []
    for mode in args.modes:
        for index in range(args.models):
            model = bert_base.build_model(config, args.seed + index)
            ctx = bert_base.Context(model, workload, args.device, args.lr)
            try:
                row = {"mode": mode, "model": index + 1, "status": "ok", **one_model(mode, ctx, args.steps)}
            except bert_base.Skip as skip:
                row = {"mode": mode, "model": index + 1, "status": f"skipped: {skip}"}
            bert_base.restore_hooks()
            rows.append(row)
            print(f"  {mode} model {index + 1}: {row.get('first_step_s', 0):.2f} s to its first step, "
                  f"{row.get('compiles', 0)} compiles", flush=True)
    firsts = {r["mode"]: r["first_step_s"] for r in rows if r["model"] == 1 and r["status"] == "ok"}
    for row in rows:
        if row["status"] == "ok" and row["mode"] in firsts:
            row["vs_first_model"] = firsts[row["mode"]] / row["first_step_s"]
    _report.print_table(rows, [("mode", "mode", "s"), ("model", "model", "d"),
                               ("first_step_s", "first step s", ".2f"), ("compiles", "compiles", "d"),
                               ("step_ms", "step ms", ".1f"), ("vs_first_model", "x first model", ".1f"),
                               ("loss", "loss", ".4f"), ("status", "status", "s")])
    path = _report.write_json(args.out, {**env, "workload": workload.name, "rows": rows,
                                         "args": {k: str(v) if isinstance(v, (Path, torch.device)) else v
                                                  for k, v in vars(args).items()}}, args.results_dir)
    later = [r for r in rows if r["model"] > 1 and "vs_first_model" in r]
    png = _report.ratio_bars([f"{r['mode']} #{r['model']}" for r in later], [r["vs_first_model"] for r in later],
                             "time to the first step: first model / this model (higher is sooner)",
                             f"Model after model, BERT {workload.name}, {env['device']}", args.out, args.results_dir)
    print(f"wrote {path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
