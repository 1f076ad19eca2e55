"""The host allocator's share of a CPU training step: glibc's default, glibc told to keep freed memory, and
keep_freed_memory() (accel's caching allocator).

    python benchmarks/host_memory.py [--sizes 8x128,16x512] [--layers 4] [--steps 3] [--rounds 2]
    python benchmarks/host_memory.py --quick        # one tiny row (the test suite runs it)

accel.runtime.host_memory.keep_freed_memory() (what accelerate() does for models on the CPU) keeps the memory of
freed large tensors for reuse instead of mapping every large block afresh. The peer is glibc's own way to keep
it (its environment: MALLOC_MMAP_MAX_=0, MALLOC_TRIM_THRESHOLD_ at its largest: large blocks come from its heap
and stay there, what accel did before). Each (setting, size, round) runs in a fresh process, since the setting
is a whole process's for good: an eager fp32 BERT training step (bert-base-cased's configuration with --layers
layers, random weights, AdamW) at batch x sequence length, one warm-up step and the median of --steps timed ones,
and the process's peak resident memory; the settings alternate round by round, so load on a shared machine hits
them alike. The row's figure is the median over rounds. Prints the table, writes
benchmarks/results/host_memory_cpu.json and .png.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import _report  # noqa: E402

SETTINGS = ("glibc default", "glibc keeps", "keep_freed_memory")
# how glibc keeps freed memory, set before the process starts (its mallopt options, by environment)
GLIBC_KEEPS = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}


def _step_seconds(setting: str, batch: int, seq: int, layers: int, steps: int, tiny: bool) -> float:
    """The worker: the median seconds of `steps` training steps after one warm-up step."""
    import torch
    import transformers

    from accel.runtime.host_memory import keep_freed_memory

    if setting == SETTINGS[2] and not keep_freed_memory():
        raise SystemExit("keep_freed_memory() does not apply here (another allocator is preloaded): nothing to "
                         "compare")
    size = dict(hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=128) if tiny else {}
    config = transformers.BertConfig(num_hidden_layers=layers, max_position_embeddings=max(512, seq), **size)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    labels = torch.randint(0, 2, (batch,))

    def step():
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()

    return _report.median_seconds(step, steps)


def _run_worker(setting: str, size: str, args) -> float:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", setting, "--sizes", size,
           "--layers", str(args.layers), "--steps", str(args.steps)] + (["--tiny"] if args.tiny else [])
    env = {**os.environ, **(GLIBC_KEEPS if setting == "glibc keeps" else {})}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"host_memory worker ({setting}, {size}) failed:\n{out.stderr[-2000:]}")
    seconds, peak_mb = out.stdout.split()[-2:]
    return float(seconds), float(peak_mb)


def _parse_size(text: str) -> tuple[int, int]:
    try:
        batch, seq = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--sizes: expected BATCHxSEQ entries such as 16x512, got {text!r}") from None
    if batch < 1 or seq < 1:
        raise SystemExit(f"--sizes: batch and sequence length must be >= 1, got {text!r}")
    return batch, seq


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8x128,16x512", help="comma-separated BATCHxSEQ (default 8x128,16x512)")
    ap.add_argument("--layers", type=int, default=4, help="BERT layers (default 4; bert-base has 12)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per process (default 3)")
    ap.add_argument("--rounds", type=int, default=2, help="processes per setting and size (default 2)")
    ap.add_argument("--quick", action="store_true", help="one tiny row: a smoke run")
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # a hidden size of 32 (quick)
    ap.add_argument("--worker", choices=SETTINGS, help=argparse.SUPPRESS)
    ap.add_argument("--results-dir", type=Path, default=_report.RESULTS)
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.layers, args.steps, args.rounds, args.tiny = "2x32", 1, 1, 1, True
    for name in ("layers", "steps", "rounds"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name}: expected an int >= 1, got {getattr(args, name)}")
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if not sizes:
        raise SystemExit("--sizes: expected at least one BATCHxSEQ entry, such as 16x512")
    for s in sizes:
        _parse_size(s)
    if args.worker:
        seconds = _step_seconds(args.worker, *_parse_size(sizes[0]), args.layers, args.steps, args.tiny)
        print(seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # Linux: KiB
        return 0

    env = _report.environment("cpu")
    print(f"device: {env['device']}   torch {env['torch']}   BERT layers {args.layers}, eager fp32\n")
    rows = []
    keys = {"glibc default": "default", "glibc keeps": "glibc_kept", "keep_freed_memory": "kept"}
    for size in sizes:
        runs = {s: [] for s in SETTINGS}
        for _ in range(args.rounds):
            for setting in SETTINGS:
                runs[setting].append(_run_worker(setting, size, args))
        row = {"size": size}
        for setting, key in keys.items():
            row[f"{key}_ms"] = statistics.median(t for t, _ in runs[setting]) * 1e3
            row[f"{key}_peak_mb"] = statistics.median(m for _, m in runs[setting])
            row[f"{key}_runs_ms"] = [t * 1e3 for t, _ in runs[setting]]
        row["speedup"] = row["default_ms"] / row["kept_ms"]
        row["vs_glibc_kept"] = row["glibc_kept_ms"] / row["kept_ms"]
        rows.append(row)
        print(f"  {size:<10} default {row['default_ms']:9.1f} ms   glibc keeps {row['glibc_kept_ms']:9.1f} ms   "
              f"kept {row['kept_ms']:9.1f} ms   x{row['speedup']:5.2f}", flush=True)
    print()
    _report.print_table(rows, [("size", "batch x seq", ""), ("default_ms", "glibc default ms", ".1f"),
                               ("glibc_kept_ms", "glibc keeps ms", ".1f"), ("kept_ms", "keep_freed_memory ms", ".1f"),
                               ("speedup", "default/kept", ".2f"), ("vs_glibc_kept", "glibc keeps/kept", ".2f"),
                               ("default_peak_mb", "default peak MB", ".0f"),
                               ("glibc_kept_peak_mb", "glibc keeps peak MB", ".0f"),
                               ("kept_peak_mb", "kept peak MB", ".0f")])
    payload = {**env, "layers": args.layers, "steps": args.steps, "rounds": args.rounds, "tiny": args.tiny,
               "rows": rows}
    path = _report.write_json("host_memory_cpu", payload, args.results_dir)
    png = _report.ratio_bars([f"BERT {args.layers} layers, {r['size']}" for r in rows], [r["speedup"] for r in rows],
                             "speed-up of a training step (glibc default time / keep_freed_memory time)",
                             f"keep_freed_memory on {env['device']} ({env['date']})", "host_memory_cpu",
                             args.results_dir)
    print(f"\nwrote {path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
