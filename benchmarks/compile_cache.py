"""xlarun's persistent XLA compile cache: how much sooner a second run gets going.

A small BERT (transformers' BertForMaskedLM built from a config: 2 layers, hidden 128, 2 heads,
intermediate 256, vocabulary 2048; random weights and tokens, nothing downloaded) trains a few
AdamW steps at each of a couple of (batch, sequence) shapes on the XLA device, launched three
times through xlarun:

  no cache  --no-compile-cache: the reference, and what the cache costs the first run
  cold      --compile-cache DIR, DIR fresh: compiles everything and writes DIR/rank<k>
  warm      the same DIR again: should load every graph instead of compiling it

Reported per run (rank 0, median over --repeats interleaved triples, each cold run on a fresh
folder): wall seconds from launching xlarun to the first step done (its sync waited for), to the
model being on the device (imports, runtime start, model build: what no cache can remove), and in
total; the worker's CPU seconds (user + system, all threads) to its first step, which other load
on a shared machine barely moves; XLA compiles and compile time; the persistent cache's loads,
misses and entries it could not load (accel.xla.metrics()); the last loss (equal in every run).
Speed-ups are cold / run. The target: the warm run compiles nothing and reaches its first step
5x sooner.

    python benchmarks/compile_cache.py [--nproc 1] [--steps 3] [--shapes 8x32,8x64] [--repeats 2]

Writes benchmarks/results/compile_cache.json and benchmarks/results/compile_cache.png.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks import _report  # noqa: E402

WORKER = r'''
import json, os, resource, sys, time
import torch
import accel.xla as xm
from transformers import BertConfig, BertForMaskedLM

out, shapes, steps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
dev = xm.xla_device()
torch.manual_seed(0)
config = BertConfig(vocab_size=2048, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=256, max_position_embeddings=128)
model = BertForMaskedLM(config).train().to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
def cpu():  # this process's CPU seconds, all threads: what the work cost, whoever else shares the cores
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime

ready, ready_cpu = time.time(), cpu()
g = torch.Generator().manual_seed(1)
done = []
for batch, seq in shapes:
    for _ in range(steps):
        ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
        labels = torch.where(torch.rand(batch, seq, generator=g) < 0.15, ids, torch.full_like(ids, -100))
        loss = model(input_ids=ids.to(dev), labels=labels.to(dev)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        xm.sync(wait=True)
        done.append(time.time())
        if len(done) == 1:
            first_cpu = cpu()
m = xm.metrics()
with open(os.path.join(out, "rank%s.json" % os.environ.get("RANK", "0")), "w") as f:
    json.dump({"ready": ready, "ready_cpu": ready_cpu, "first_cpu": first_cpu, "end_cpu": cpu(), "steps_done": done, "loss": loss.item(), "compiles": m.compiles,
               "compile_time_s": m.compile_time_s, "hits": m.persistent_cache_hits,
               "misses": m.persistent_cache_misses, "load_failures": m.persistent_cache_load_failures}, f)
'''

RUNS = (("no cache", False), ("cold", True), ("warm", True))
# Fields that vary from launch to launch; the summary keeps their median over the repeats.
TIMED = ("ready_s", "first_step_s", "first_step_after_ready_s", "total_s", "compile_time_s",
         "cpu_ready_s", "cpu_first_step_s", "cpu_total_s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(name: str, use_cache: bool, out: Path, script: Path, cache: Path, args) -> dict:
    out.mkdir()
    cache_flags = ["--compile-cache", str(cache)] if use_cache else ["--no-compile-cache"]
    cmd = [sys.executable, "-m", "accel.launch", f"--nproc_per_node={args.nproc}",
           f"--master_port={_free_port()}", *cache_flags, str(script), str(out),
           json.dumps(args.shapes), str(args.steps)]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("PJRT_DEVICE", "CPU")
    start = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    total = time.time() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{name} run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.nproc)]
    r0 = ranks[0]
    return {
        "run": name,
        "first_step_s": r0["steps_done"][0] - start,
        "ready_s": r0["ready"] - start,
        "first_step_after_ready_s": r0["steps_done"][0] - r0["ready"],
        "total_s": total,
        "cpu_ready_s": r0["ready_cpu"],
        "cpu_first_step_s": r0["first_cpu"],
        "cpu_total_s": r0["end_cpu"],
        "compiles": r0["compiles"],
        "compile_time_s": r0["compile_time_s"],
        "cache_hits": r0["hits"],
        "cache_misses": r0["misses"],
        "cache_load_failures": r0["load_failures"],
        "compiles_per_rank": [r["compiles"] for r in ranks],
        "loss": r0["loss"],
        "cache_entries": len(os.listdir(cache / "rank0")) if use_cache else None,
        "unloadable_warnings": proc.stderr.count("Failed to deserialize executable"),
    }


def _summary(launches: list[dict]) -> list[dict]:
    rows = []
    for name, _ in RUNS:
        mine = [r for r in launches if r["run"] == name]
        row = dict(mine[-1])  # counts are the same in every repeat; times are not
        row.update({k: statistics.median(r[k] for r in mine) for k in TIMED})
        row["repeats"] = len(mine)
        rows.append(row)
    cold = rows[1]
    for r in rows:
        r["speedup_first_step"] = cold["first_step_s"] / r["first_step_s"]
        r["speedup_cpu_first_step"] = cold["cpu_first_step_s"] / r["cpu_first_step_s"]
        r["speedup_total"] = cold["total_s"] / r["total_s"]
    return rows


def _plot(rows: list[dict], title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["run"] for r in rows]
    x = list(range(len(rows)))
    for ax, prefix, label in ((ax1, "", "wall seconds from launching xlarun"),
                              (ax2, "cpu_", "CPU seconds of the rank-0 worker")):
        ready = [r[f"{prefix}ready_s"] for r in rows]
        first = [r[f"{prefix}first_step_s"] - r[f"{prefix}ready_s"] for r in rows]
        rest = [r[f"{prefix}total_s"] - r[f"{prefix}first_step_s"] for r in rows]
        ax.bar(x, ready, label="to model on device (imports, runtime start)")
        ax.bar(x, first, bottom=ready, label="first step (compiles or cache loads)")
        ax.bar(x, rest, bottom=[a + b for a, b in zip(ready, first)], label="remaining steps and exit")
        for i, r in enumerate(rows):
            ax.text(i, r[f"{prefix}total_s"], f"{r['compiles']} compiles\n{r['cache_hits']} loaded",
                    ha="center", va="bottom", fontsize=8)
        ax.set_xticks(x)
        ax.set_xticklabels(names)
        ax.set_ylabel(label)
        ax.set_ylim(0, max(r[f"{prefix}total_s"] for r in rows) * 1.25)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def _shapes(text: str) -> list[list[int]]:
    try:
        return [[int(n) for n in part.split("x")] for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"shapes are BATCHxSEQ[,BATCHxSEQ...], got {text!r}") from None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=1, help="xlarun --nproc_per_node (default 1)")
    parser.add_argument("--steps", type=int, default=3, help="steps per shape (default 3)")
    parser.add_argument("--shapes", type=_shapes, default=_shapes("8x32,8x64"), help="BATCHxSEQ,...")
    parser.add_argument("--repeats", type=int, default=2,
                        help="no-cache/cold/warm triples, interleaved; medians reported (default 2)")
    parser.add_argument("--results-dir", type=Path, default=_report.RESULTS)
    parser.add_argument("--out", default="compile_cache", help="file name stem in --results-dir")
    args = parser.parse_args(argv)

    launches = []
    with tempfile.TemporaryDirectory(prefix="accel-compile-cache-") as tmp:
        work = Path(tmp)
        script = work / "worker.py"
        script.write_text(WORKER)
        for rep in range(args.repeats):
            cache = work / f"cache{rep}"  # fresh for each cold run
            for name, use_cache in RUNS:
                row = _launch(name, use_cache, work / f"{rep}-{name.replace(' ', '_')}", script, cache, args)
                row["repeat"] = rep
                launches.append(row)
                print(f"[{rep}] {name}: first step {row['first_step_s']:.1f} s wall, "
                      f"{row['cpu_first_step_s']:.1f} s CPU, {row['compiles']} compiles, "
                      f"{row['cache_hits']} loaded", flush=True)

    rows = _summary(launches)
    by = {r["run"]: r for r in rows}
    cold, warm, plain = by["cold"], by["warm"], by["no cache"]
    xla_version = importlib.metadata.version("torch_xla")
    shapes = ", ".join(f"{b}x{s}" for b, s in args.shapes)
    print(f"\nBertForMaskedLM (2 layers, hidden 128), AdamW, {args.steps} steps at each of {shapes}, "
          f"xlarun --nproc_per_node={args.nproc}, PJRT_DEVICE={os.environ.get('PJRT_DEVICE', 'CPU')}, "
          f"torch_xla {xla_version}; medians of {args.repeats} launches each")
    _report.print_table(rows, [
        ("run", "run", "s"), ("ready_s", "model ready s", ".1f"), ("first_step_s", "first step s", ".1f"),
        ("cpu_first_step_s", "first step CPU s", ".1f"), ("total_s", "total s", ".1f"),
        ("compiles", "compiles", "d"), ("compile_time_s", "compile s", ".1f"),
        ("cache_hits", "loaded", "d"), ("cache_misses", "not found", "d"),
        ("cache_load_failures", "unloadable", "d"), ("speedup_first_step", "first step x", ".2f"),
        ("speedup_cpu_first_step", "first step CPU x", ".2f"), ("loss", "loss", ".4f")])
    compiles_nothing = warm["compiles"] == 0
    fast_enough = warm["speedup_first_step"] >= 5
    print(f"\nwarm vs cold (cold / warm): wall to the first step {warm['speedup_first_step']:.2f}x, "
          f"CPU to the first step {warm['speedup_cpu_first_step']:.2f}x; cold with the cache vs no cache: "
          f"{cold['cpu_first_step_s'] / plain['cpu_first_step_s']:.2f}x the CPU to the first step")
    print(f"target: warm run compiles nothing: {'yes' if compiles_nothing else 'NO'} "
          f"({warm['compiles']} compiles); first step >= 5x sooner: {'yes' if fast_enough else 'NO'}")
    note = None
    if warm["cache_load_failures"]:
        note = (f"torch_xla {xla_version} wrote {cold['cache_entries']} cache entries per rank but could not load "
                "them back (\"Failed to deserialize executable: UNIMPLEMENTED: Deserializing serialized executable "
                "not supported\", pytorch/xla#9094), so the warm run compiled everything again; wall-clock "
                "differences between the runs are other load on the machine.")
        print(f"note: {note}")

    payload = {
        "environment": {**_report.environment("cpu"), "torch_xla": xla_version,
                        "pjrt_device": os.environ.get("PJRT_DEVICE", "CPU"),
                        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None},
        "model": "BertForMaskedLM: 2 layers, hidden 128, 2 heads, intermediate 256, vocab 2048",
        "shapes": args.shapes, "steps_per_shape": args.steps, "nproc_per_node": args.nproc,
        "repeats": args.repeats,
        "rows": rows,
        "launches": launches,
        "target": {"warm_compiles_nothing": compiles_nothing, "first_step_5x_sooner": fast_enough},
        "note": note,
    }
    json_path = _report.write_json(args.out, payload, args.results_dir)
    title = (f"xlarun compile cache, torch_xla {xla_version} on {payload['environment']['pjrt_device']}: "
             f"warm run {warm['compiles']} compiles, {warm['cache_hits']} loaded; first step "
             f"{warm['speedup_first_step']:.2f}x sooner (median of {args.repeats})")
    png_path = _report.save_figure(_plot(rows, title), args.out, args.results_dir)
    print(f"\nwrote {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
