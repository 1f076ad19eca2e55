"""The `make bench` demo: a transformers BERT trained eager and through accel's XLA path.

A BertForSequenceClassification built from a small BertConfig (random weights) learns a fixed set of
generated token sequences for a few steps, once eagerly on the CPU (torch.optim.AdamW) and once on the
XLA device the way the TorchAcc guide ports it (MpDeviceLoader, syncfree.AdamW, xm.optimizer_step).
Prints steps/s, the XLA compile count after each step (it must stop growing after the first steps) and
the final loss of each; writes benchmarks/results/bert_demo.json and .png.

    python benchmarks/bert_demo.py [--steps 12] [--batch 8] [--seq 64]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import _report  # noqa: E402


def build_model(seed: int):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=256, max_position_embeddings=128, num_labels=2)
    return BertForSequenceClassification(cfg)


def build_loader(batch: int, seq: int, n_samples: int = 64):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 1000, (n_samples, seq), generator=g)
    labels = (ids[:, 0] % 2).long()  # learnable: the parity of the first token
    data = [{"input_ids": ids[i], "attention_mask": torch.ones(seq, dtype=torch.long), "labels": labels[i]}
            for i in range(n_samples)]
    return torch.utils.data.DataLoader(data, batch_size=batch, shuffle=False, drop_last=True)


def batches(loader, steps):
    while True:
        for b in loader:
            yield b
            steps -= 1
            if steps == 0:
                return


def train_eager(args) -> dict:
    model = build_model(args.seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, times = [], []
    for batch in batches(build_loader(args.batch, args.seq), args.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    return {"mode": "eager (torch.optim.AdamW)", "losses": losses, "step_times": times, "compiles": None}


def train_xla(args) -> dict:
    import accel.torch_xla.core.xla_model as xm
    import accel.torch_xla.distributed.parallel_loader as pl
    from accel.torch_xla.amp import syncfree

    device = xm.xla_device()
    xm.set_replication(device, [device])
    model = build_model(args.seed).to(device).train()
    opt = syncfree.AdamW(model.parameters(), lr=args.lr)
    loader = pl.MpDeviceLoader(build_loader(args.batch, args.seq), device)
    losses, times, compiles = [], [], []
    step_losses = []
    start = xm.metrics()
    t0 = time.perf_counter()
    done = 0
    while done < args.steps:
        for batch in loader:
            opt.zero_grad()
            loss = model(**batch).loss
            loss.backward()
            xm.optimizer_step(opt, barrier=True)  # barrier: run the step's graph now, to time it
            step_losses.append(loss.detach())
            now = time.perf_counter()
            times.append(now - t0)
            t0 = now
            compiles.append((xm.metrics() - start).compiles)
            done += 1
            if done == args.steps:
                break
    losses = [x.item() for x in step_losses]  # one transfer at the end, not one per step
    return {"mode": "XLA (accel: syncfree.AdamW, MpDeviceLoader)", "losses": losses, "step_times": times,
            "compiles": compiles}


def summarize(run: dict, warmup: int) -> dict:
    steady = run["step_times"][warmup:] or run["step_times"]
    out = {"mode": run["mode"], "steps_per_s": len(steady) / sum(steady),
           "first_loss": run["losses"][0], "final_loss": run["losses"][-1]}
    if run["compiles"] is not None:
        out["compiles_total"] = run["compiles"][-1]
        out["compiles_after_warmup"] = run["compiles"][-1] - run["compiles"][warmup - 1]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3, help="steps excluded from steps/s (XLA compiles there)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from accel.utils.xla import xla_available

    if xla_available():
        # Start the XLA runtime before any eager backward: torch's autograd engine sizes its device
        # queues at the first backward, and XLA devices that appear later have none.
        import accel.xla as xm

        xm.xla_device()
    runs = [train_eager(args)]
    if xla_available():
        runs.append(train_xla(args))
    else:
        print("torch_xla is not installed: only the eager run (pip install 'accel[xla]')")
    rows = [summarize(r, args.warmup) for r in runs]

    env = _report.environment("cpu")
    print(f"\nBERT (2 layers, hidden 128) batch {args.batch} seq {args.seq}, {args.steps} steps on {env['device']}")
    _report.print_table(rows, [("mode", "mode", ""), ("steps_per_s", "steps/s", ".2f"),
                               ("compiles_total", "XLA compiles", "d"),
                               ("compiles_after_warmup", f"compiles after step {args.warmup}", "d"),
                               ("first_loss", "first loss", ".4f"), ("final_loss", "final loss", ".4f")])
    if len(runs) > 1:
        print("XLA compile count after each step:", runs[1]["compiles"])
        print(f"XLA / eager steps/s: {rows[1]['steps_per_s'] / rows[0]['steps_per_s']:.2f}")
    path = _report.write_json("bert_demo", {**env, "args": vars(args), "summary": rows, "runs": runs})
    png = _plot(runs, env)
    print(f"wrote {path} and {png}")
    return 0


def _plot(runs, env):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        a.plot(range(1, len(r["losses"]) + 1), r["losses"], marker="o", label=r["mode"])
        if r["compiles"] is not None:
            b.plot(range(1, len(r["compiles"]) + 1), r["compiles"], marker="o", color="tab:orange")
    a.set(xlabel="step", ylabel="loss", title="training loss")
    a.legend()
    b.set(xlabel="step", ylabel="XLA compiles so far", title="XLA compile count")
    fig.suptitle(f"BERT demo on {env['device']} ({env['date']})")
    return _report.save_figure(fig, "bert_demo")


if __name__ == "__main__":
    sys.exit(main())
