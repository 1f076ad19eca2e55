"""ViT-base image classification training: an encoder without attention dropout, where accel's CPU attention choice
(compute.cpu_attention) shows.

BERT trains with attention dropout, which accel computes in plain ops already (accel.compiler.unpadded_attention);
ViT has none, so its training attention is torch's SDPA unless compute.cpu_attention takes plain ops, which on a
CPU without AMX train a 16-bit attention several times faster than SDPA's flash kernel. The rows, measurement
and loss check are bert_base.py's (its eager, eager-amp, peer and accel modes and accel:FIELD=VALUE variants, one
process, same weights and seed); see its docstring. Tokens are the image's patches and its [CLS] token.

Model: transformers' ViTForImageClassification, the ViT-base configuration (image 224, patch 16: 197 tokens;
hidden 768, 12 layers, 12 heads, intermediate 3072, no dropout), 2 labels, random weights, nothing downloaded.
Data: seeded random images; the label is whether the image's first channel sums above zero.

    python benchmarks/vit_base.py [--quick] [--modes eager,peer,accel,accel:compute.cpu_attention=sdpa]
                                  [--steps N] [--batch B]

Default modes: eager, eager-amp, peer, accel and, on the CPU, peer-eager-attention (the peer with transformers'
eager attention, chosen by hand) and accel:compute.cpu_attention=sdpa (the A/B of accel's choice). Writes benchmarks/results/vit_base_<device>.json and .png.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from accel.runtime.host_memory import keep_freed_memory  # noqa: E402
from benchmarks import _report, bert_base  # noqa: E402
from benchmarks.causal_lm import run_one_workload  # noqa: E402

MODES = ("eager", "eager-amp", "peer", "accel")
CPU_MODES = MODES + ("peer-eager-attention", "accel:compute.cpu_attention=sdpa")
VIT_BASE = dict(image_size=224, patch_size=16, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                intermediate_size=3072, num_labels=2)
QUICK_VIT = dict(VIT_BASE, image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64)


class Images(bert_base.Workload):
    """Fixed-size images, batched as torch's default collate does (pixel_values [B, 3, S, S], labels [B])."""

    @property
    def name(self) -> str:
        return f"images {self.batch}x{self.max_length} tokens"

    def loader(self) -> DataLoader:
        return DataLoader(self.samples, batch_size=self.batch, shuffle=False, drop_last=True)


def make_images(n: int, size: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, size, size, generator=g)
    labels = (images[:, 0].sum((1, 2)) > 0).long()
    return [{"pixel_values": image, "labels": label} for image, label in zip(images, labels)]


def build_model(config: dict, seed: int):
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    return ViTForImageClassification(ViTConfig(**config, attn_implementation="sdpa")).train()


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", type=bert_base.parse_modes, help=f"default: {','.join(CPU_MODES)} (CPU), "
                                                               f"{','.join(MODES)} (CUDA)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=2, help="steps before timing (compiles happen there)")
    ap.add_argument("--batch", type=int, default=8, help="images per batch")
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=("cuda", "cpu"), help="device of the eager and peer modes")
    bert_base.add_budget_argument(ap)
    ap.add_argument("--quick", action="store_true", help="tiny ViT (32 px, 17 tokens), batch 4, 2 steps")
    ap.add_argument("--out", help="result file name without extension (default vit_base_<cpu|cuda>)")
    ap.add_argument("--results-dir", type=Path, default=_report.RESULTS)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.batch = 2, 1, 4
    args.device = torch.device(args.device or bert_base.default_device())
    args.modes = args.modes or list(CPU_MODES if args.device.type == "cpu" else MODES)
    args.out = args.out or f"vit_base_{args.device.type}"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    env = _report.environment(str(args.device))
    env["keep_freed_memory"] = args.device.type == "cpu" and keep_freed_memory()  # as bert_base.py
    config = QUICK_VIT if args.quick else VIT_BASE
    tokens = (config["image_size"] // config["patch_size"]) ** 2 + 1
    images = make_images(args.batch * (args.warmup + args.steps), config["image_size"], args.seed)
    workload = Images("fixed", args.batch, tokens, images, tokens_per_sample=tokens)
    print(f"ViT {'quick (tiny)' if args.quick else 'base'} on {env['device']}: {workload.name}; modes "
          f"{','.join(args.modes)}", flush=True)
    ctx = bert_base.Context(build_model(config, args.seed), workload, args.device, args.lr)
    return run_one_workload(ctx, args, env, config, f"ViT {workload.name} on {env['device']}")


if __name__ == "__main__":
    sys.exit(main())
