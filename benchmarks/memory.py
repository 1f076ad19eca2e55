"""Activation memory and step time of BERT-base with and without accel.auto_checkpoint.

    python benchmarks/memory.py            # batch 8, seq 128, 5 timed steps each
    python benchmarks/memory.py --quick    # batch 4, 3 timed steps each (~2-3 minutes on 2 CPU cores)

Saved-activation bytes of one training forward come from accel.checkpoint.activation_bytes:
saved-tensor hooks on CPU (distinct storages saved for backward, parameters excluded, plus the
inputs checkpointed blocks keep), the peak of torch.cuda.max_memory_allocated over the forward on
CUDA. Step time is the median of forward + backward + AdamW step, the two models' steps
interleaved so load on a shared machine hits them alike. Three models are timed: plain, auto_checkpoint
with no budget (every repeated block checkpointed: one extra forward, so about +33% step time where a
backward costs two forwards) and auto_checkpoint with a budget of half the plain model's activations
(only the blocks needed to fit: less recompute). The budget sweep re-plans
auto_checkpoint(memory_budget=...) on the same batch: budget -> blocks checkpointed -> bytes.
Writes benchmarks/results/memory.json and memory.png.
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from accel.checkpoint import activation_bytes, auto_checkpoint, checkpoint_plan  # noqa: E402
from accel.runtime.host_memory import return_freed_memory  # noqa: E402
from benchmarks import _report  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TARGET_SAVING, TARGET_SLOWDOWN = 0.40, 0.30
HALF = "auto_checkpoint(budget 50%)"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller batch and fewer steps (CPU smoke run)")
    p.add_argument("--batch", type=int, default=None, help="default 8 (4 with --quick)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=None, help="timed steps per model; default 5 (3 with --quick)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    args.batch = args.batch or (4 if args.quick else 8)
    args.steps = args.steps or (3 if args.quick else 5)
    if args.batch <= 0 or args.seq <= 0 or args.steps <= 0:
        raise SystemExit("--batch, --seq and --steps must be positive")
    return args


def bert_base(device):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    return BertModel(BertConfig()).to(device)  # 12 layers, hidden 768, random weights


def make_step(model, inputs):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step():
        opt.zero_grad(set_to_none=True)
        out = model(**inputs).last_hidden_state
        out.float().square().mean().backward()
        opt.step()

    return step


def time_interleaved(steps: dict, n: int, device) -> dict[str, list[float]]:
    times = {name: [] for name in steps}
    for name, step in steps.items():  # warm-up (allocator, first-call costs)
        step()
    for _ in range(n):
        for name, step in steps.items():
            _report.sync(device)
            t0 = time.perf_counter()
            step()
            _report.sync(device)
            times[name].append(time.perf_counter() - t0)
    return times


def release_host_memory() -> None:
    """Give freed heap memory back to the OS. Each plan's dry runs free gigabytes of activations that
    glibc keeps in its arenas (measured: +2.5 GB RSS per BERT-base plan, all of it returned by
    malloc_trim), so a long sweep on CPU would otherwise run out of memory."""
    gc.collect()
    return_freed_memory()


def budget_sweep(model, inputs, plain_bytes: int) -> list[dict]:
    rows = []
    for frac in (1.0, 0.8, 0.6, 0.4, 0.2, 0.05):
        budget = int(plain_bytes * frac)
        release_host_memory()
        auto_checkpoint(model, memory_budget=budget, example_inputs=inputs)
        plan = checkpoint_plan(model)
        rows.append({"budget_fraction": frac, "budget_bytes": budget, "blocks": len(plan.blocks),
                     "checkpointed": len(plan.checkpointed), "bytes": plan.measured["chosen"],
                     "fits": plan.measured["chosen"] <= budget})
    return rows


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o644)  # mkstemp makes it private
    os.replace(tmp, path)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 4))
    names = ["plain", "auto_checkpoint", HALF]
    labels = ["plain", "all blocks", "budget 50%"]
    colors = ["#888", "#2a7", "#27a"]
    mib = [result[n]["activation_bytes"] / 2**20 for n in names]
    ax1.bar(labels, mib, color=colors)
    ax1.set_ylabel("saved activations per forward (MiB)")
    ax1.set_title("activations: " + ", ".join(f"-{result[n]['saving']:.0%}" for n in names[1:]))
    secs = [result[n]["step_s_median"] for n in names]
    ax2.bar(labels, secs, color=colors)
    ax2.set_ylabel("train step (s, median)")
    ax2.set_title("step time: " + ", ".join(f"{result[n]['slowdown']:+.0%}" for n in names[1:]))
    sweep = result["budget_sweep"]
    ax3.plot([r["budget_bytes"] / 2**20 for r in sweep], [r["bytes"] / 2**20 for r in sweep], "o-", label="measured")
    ax3.plot([r["budget_bytes"] / 2**20 for r in sweep], [r["budget_bytes"] / 2**20 for r in sweep], "--",
             color="#aaa", label="budget")
    for r in sweep:
        ax3.annotate(f"{r['checkpointed']}", (r["budget_bytes"] / 2**20, r["bytes"] / 2**20),
                     textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax3.set_xlabel("memory_budget (MiB)")
    ax3.set_ylabel("saved activations (MiB)")
    ax3.set_title("budget sweep (labels: blocks checkpointed)")
    ax3.legend()
    cfg = result["config"]
    fig.suptitle(f"BERT-base, batch {cfg['batch']}, seq {cfg['seq']}, {cfg['device']}")
    fig.tight_layout()
    with tempfile.NamedTemporaryFile(suffix=".png", dir=path.parent, delete=False) as f:
        tmp = f.name
    fig.savefig(tmp, dpi=110)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    t_start = time.perf_counter()
    plain = bert_base(device)
    ckpt = auto_checkpoint(copy.deepcopy(plain))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, plain.config.vocab_size, (args.batch, args.seq), generator=g).to(device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    print(f"measuring saved activations (batch {args.batch}, seq {args.seq}, {device})", flush=True)
    bytes_plain = activation_bytes(plain, inputs)
    bytes_ckpt = activation_bytes(ckpt, inputs)
    half = auto_checkpoint(copy.deepcopy(plain), memory_budget=bytes_plain // 2, example_inputs=inputs)
    bytes_half = activation_bytes(half, inputs)
    print(f"timing {args.steps} + 1 warm-up train steps per model, interleaved", flush=True)
    times = time_interleaved({"plain": make_step(plain, inputs), "auto_checkpoint": make_step(ckpt, inputs),
                              HALF: make_step(half, inputs)}, args.steps, device)
    med = {k: statistics.median(v) for k, v in times.items()}
    ckpt_plan, half_plan = checkpoint_plan(ckpt), checkpoint_plan(half)  # the sweep re-plans ckpt
    del plain, half  # only the no-budget model is re-planned below
    print("budget sweep", flush=True)
    sweep = budget_sweep(ckpt, inputs, bytes_plain)

    result = {
        "config": {"model": "bert-base (BertConfig defaults, random weights)", "batch": args.batch,
                   "seq": args.seq, "steps": args.steps, "device": str(device), "quick": args.quick,
                   "torch": torch.__version__, "python": platform.python_version(),
                   "threads": torch.get_num_threads(),
                   "bytes_method": "torch.cuda.max_memory_allocated" if device.type == "cuda"
                   else "saved_tensors_hooks"},
        "plain": {"activation_bytes": bytes_plain, "step_s": times["plain"], "step_s_median": med["plain"]},
        "target": {"saving_at_least": TARGET_SAVING, "slowdown_at_most": TARGET_SLOWDOWN},
        "budget_sweep": sweep,
    }
    for name, plan, nbytes in (("auto_checkpoint", ckpt_plan, bytes_ckpt), (HALF, half_plan, bytes_half)):
        saving, slowdown = 1 - nbytes / bytes_plain, med[name] / med["plain"] - 1
        result[name] = {"activation_bytes": nbytes, "step_s": times[name], "step_s_median": med[name],
                        "blocks": len(plan.blocks), "checkpointed": len(plan.checkpointed), "saving": saving,
                        "slowdown": slowdown,
                        "meets_target": saving >= TARGET_SAVING and slowdown <= TARGET_SLOWDOWN}
    # Top-level figures are the no-budget run's (as in earlier results files).
    result["saving"], result["slowdown"] = result["auto_checkpoint"]["saving"], result["auto_checkpoint"]["slowdown"]
    result["meets_target"] = any(result[n]["meets_target"] for n in ("auto_checkpoint", HALF))
    result["wall_s"] = time.perf_counter() - t_start

    print(f"BERT-base batch {args.batch} seq {args.seq} on {device} ({args.steps} timed steps each)")
    print(f"{'':30s}{'checkpointed':>13s}{'activations MiB':>16s}{'saving':>8s}{'step s (median)':>17s}"
          f"{'step time':>10s}  target (>= {TARGET_SAVING:.0%} less, <= +{TARGET_SLOWDOWN:.0%})")
    print(f"{'plain':30s}{'0':>13s}{bytes_plain / 2**20:16.1f}{'':>8s}{med['plain']:17.3f}")
    for name in ("auto_checkpoint", HALF):
        r = result[name]
        print(f"{name:30s}{str(r['checkpointed']) + '/' + str(r['blocks']):>13s}{r['activation_bytes'] / 2**20:16.1f}"
              f"{r['saving']:8.1%}{r['step_s_median']:17.3f}{r['slowdown']:+10.1%}  "
              f"{'met' if r['meets_target'] else 'NOT met'}")
    print(f"\n{'budget MiB':>11s}{'fraction':>10s}{'checkpointed':>14s}{'bytes MiB':>11s}{'fits':>6s}")
    for r in sweep:
        print(f"{r['budget_bytes'] / 2**20:11.1f}{r['budget_fraction']:10.2f}"
              f"{r['checkpointed']:>8d}/{r['blocks']:<5d}{r['bytes'] / 2**20:11.1f}{'yes' if r['fits'] else 'no':>6s}")

    write_atomic(args.out / "memory.json", (json.dumps(result, indent=2) + "\n").encode())
    plot(result, args.out / "memory.png")
    print(f"\nwrote {args.out / 'memory.json'} and {args.out / 'memory.png'} ({result['wall_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
