"""A decoder fine-tuned as a sequence classifier (a reward model, a Llama classifier): only the last token is read.

transformers' LlamaForSequenceClassification scores each row's last token that is not padding, so its last
decoder layer computes every other position for nothing but their keys and values. accel's
compute.first_token_only (accel.compiler.first_token) makes that layer compute the read token alone; on samples
of many lengths accel also packs them (dataloader.pack: each sample attends only to itself, its last token is
read). The rows, measurement and loss check are bert_base.py's (its eager, eager-amp, peer and accel modes and
accel:FIELD=VALUE variants, one process, same weights and seed); see its docstring. The default modes end with
`accel:compute.first_token_only=false`, the A/B of the cut layer.

Model: causal_lm.py's Llama config (hidden 512, 8 layers, 8 heads, 4 key/value heads, intermediate 1376; --quick:
a tiny one) as LlamaForSequenceClassification, 2 labels, pad id 0, random weights, nothing downloaded.
Data: seeded token ids (never the pad id) of causal_lm.py's instruction-like lengths (median 180), padded to the
batch's longest on the right (input ids 0, mask 0), or, with --fixed BxL, every sample L tokens long (no padding);
the label is the parity of the first token.

    python benchmarks/decoder_classifier.py [--quick] [--fixed 8x256] [--modes eager,peer,accel] [--steps N]
                                            [--batch B]

Writes benchmarks/results/decoder_classifier_<device>[_fixed].json and .png.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from accel.runtime.host_memory import keep_freed_memory  # noqa: E402
from benchmarks import _report, bert_base, causal_lm  # noqa: E402

MODES = ("eager", "eager-amp", "peer", "accel", "accel:compute.first_token_only=false")
NUM_LABELS = 2
PAD_ID = 0  # what bert_base.py's collator pads with; its samples' ids start at 1


class Workload(causal_lm.Workload):
    """causal_lm.py's shuffled batches, padded on the right (bert_base.py's collator: input ids and attention mask
    0, PAD_ID; one label a row)."""

    @property
    def name(self) -> str:
        return f"classify {self.batch}x{self.max_length}" if self.kind == "fixed" else \
            f"classify {self.batch}x<={self.max_length}"

    @staticmethod
    def collate(samples: list[dict]) -> dict:
        return bert_base.pad_to_longest(samples)


def build_model(config: dict, seed: int):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    llama = LlamaConfig(**config, num_labels=NUM_LABELS, pad_token_id=PAD_ID, attn_implementation="sdpa")
    return LlamaForSequenceClassification(llama).train()


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    causal_lm.add_workload_arguments(ap, MODES)
    ap.add_argument("--fixed", type=bert_base.parse_sizes, help="BxL: batches of B samples of L tokens, no padding")
    ap.add_argument("--quick", action="store_true", help="tiny Llama, batch 4, rows of 64, 2 steps")
    ap.add_argument("--out", help="result file name without extension (default decoder_classifier_<cpu|cuda>)")
    ap.add_argument("--results-dir", type=Path, default=_report.RESULTS)
    args = ap.parse_args(argv)
    if args.fixed and len(args.fixed) != 1:
        ap.error("--fixed takes one BxL size")
    if args.quick:
        args.steps, args.warmup, args.batch, args.max_length = 2, 1, 4, 64
    args.device = torch.device(args.device or bert_base.default_device())
    args.out = args.out or (f"decoder_classifier_{args.device.type}" + ("_fixed" if args.fixed else "")
                            + causal_lm.check_lora(ap, args))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    env = _report.environment(str(args.device))
    env["keep_freed_memory"] = args.device.type == "cpu" and keep_freed_memory()  # as bert_base.py
    config = causal_lm.model_config(args.quick)
    batches = args.warmup + args.steps
    if args.fixed:
        batch, length = args.fixed[0]
        workload = Workload("fixed", batch, length, bert_base.make_samples([length] * batch * batches,
                                                                           config["vocab_size"], args.seed,
                                                                           token_types=False))
    else:
        lengths = causal_lm.packable_lengths(args.batch, batches, args.max_length, args.seed)
        # One dynamic graph for every padded length, as causal_lm.py's peer (see there). torch 2.9's C++ code for
        # this classifier's dynamic graph fails to compile (CppCompileError: 'tmp2' was not declared: an index
        # bounds check emitted before its index), so the peer's CPU graphs leave those checks out.
        workload = Workload("padded", args.batch, args.max_length,
                            bert_base.make_samples(lengths, config["vocab_size"], args.seed, token_types=False),
                            peer_dynamic=True,
                            peer_cpu_options={"assert_indirect_indexing": False})
    print(f"LlamaForSequenceClassification {'quick (tiny)' if args.quick else 'config'} on {env['device']}: "
          f"{workload.name}; modes {','.join(args.modes)}", flush=True)
    model = build_model(config, args.seed)
    if args.lora:
        model = causal_lm.lora_model(model, args.lora, task="SEQ_CLS")
    ctx = bert_base.Context(model, workload, args.device, args.lr)
    lora = f", LoRA r={args.lora}" if args.lora else ""
    return causal_lm.run_one_workload(ctx, args, env, dict(config, lora=args.lora),
                                      f"Llama classifier {workload.name}{lora} on {env['device']}")


if __name__ == "__main__":
    sys.exit(main())
