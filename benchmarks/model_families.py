"""accelerate() against the compiled peer on the model families users bring, one small model of each.

bert_base.py, causal_lm.py, decoder_classifier.py and vit_base.py measure one model each at its real size; this one
asks a wider question at a small size: does accelerate() make each family's training faster than the strongest
peer, or does some family's code (a dropout called as a function, an encoder-decoder's cross-attention, a sliding
window, a position bias) miss what accel does and lose? Every family is trained for the same steps on the same
fixed batches in two rows, bert_base.py's `peer` (torch.compile of the model, fused AdamW compiled, 16-bit
autocast where native) and `accel` (accelerate(), AdamW; all-ones masks dropped on the host), with its loss check;
its rows, measurement and tables are bert_base.py's (see its docstring).

Models: transformers' classes from configs (hidden 256, 4 layers of 4 heads, intermediate 1024, vocabulary 8000;
decoders 2 key/value heads; BART 2 + 2 layers; --size base: BERT-base's, hidden 768, 12 layers of 12 heads,
intermediate 3072, vocabulary 30522), random weights, nothing downloaded: sequence classifiers (RoBERTa,
DeBERTa-v2, ALBERT, ELECTRA), a masked LM (BERT: 15% of the tokens labelled, as BERT's pre-training masks), causal LMs (GPT-2, OPT, Qwen2, Mistral with its 4096-token sliding window, Gemma,
Phi-3), encoder-decoders (T5, BART: labels half the input's length), ViT (224 px, 197 tokens) and the image
classifiers of the TorchAcc guide's kind, Swin, ConvNeXt and ResNet (224 px, four stages of 32 to 256 channels;
their speed is images, counted as one token each). --quick: tiny ones, 16 tokens, 2 steps.

    python benchmarks/model_families.py [--quick] [--families gpt2,bart] [--modes peer,accel] [--steps N]
                                        [--batch B] [--length L] [--size small|base]

Writes benchmarks/results/model_families_<device>.json and .png (accel's speed over the peer's per family).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from accel.runtime.host_memory import keep_freed_memory  # noqa: E402
from benchmarks import _report, bert_base  # noqa: E402

MODES = ("peer", "accel")
SIZE = dict(hidden=256, layers=4, heads=4, intermediate=1024, vocab=8000, image_size=224)
QUICK_SIZE = dict(hidden=32, layers=2, heads=4, intermediate=64, vocab=500, image_size=32)
BASE_SIZE = dict(hidden=768, layers=12, heads=12, intermediate=3072, vocab=30522, image_size=224)
MASKED_FRACTION = 0.15  # of a masked LM's tokens labelled (BERT's pre-training masks 15%)
PATCH = 16  # ViT's patch size: (image_size / 16)^2 patches and its [CLS] token


@dataclasses.dataclass(frozen=True)
class Family:
    cls: str     # the transformers class
    task: str    # "classify", "mlm", "lm", "seq2seq" or "images"
    config: str  # the transformers config class

    def settings(self, size: dict) -> dict:
        """The config's keyword arguments for a model of `size` (each family names its fields its own way)."""
        h, n, heads, ffn, vocab = (size[k] for k in ("hidden", "layers", "heads", "intermediate", "vocab"))
        common = dict(hidden_size=h, num_hidden_layers=n, num_attention_heads=heads, intermediate_size=ffn,
                      vocab_size=vocab)
        decoder = dict(common, num_key_value_heads=heads // 2, pad_token_id=0)
        stages = [h // 8, h // 4, h // 2, h]
        return {
            "BertConfig": common, "RobertaConfig": common, "DebertaV2Config": common,
            "ElectraConfig": dict(common, embedding_size=h // 2), "AlbertConfig": dict(common, embedding_size=h // 2),
            "GPT2Config": dict(n_embd=h, n_layer=n, n_head=heads, vocab_size=vocab),
            "OPTConfig": dict(hidden_size=h, num_hidden_layers=n, num_attention_heads=heads, ffn_dim=ffn,
                              vocab_size=vocab, word_embed_proj_dim=h),
            "Qwen2Config": decoder, "MistralConfig": decoder, "Phi3Config": decoder,
            "GemmaConfig": dict(decoder, head_dim=h // heads),
            "T5Config": dict(d_model=h, d_kv=h // heads, d_ff=ffn, num_layers=n, num_heads=heads, vocab_size=vocab,
                             decoder_start_token_id=0, pad_token_id=0),
            "BartConfig": dict(d_model=h, encoder_layers=n // 2, decoder_layers=n // 2, encoder_attention_heads=heads,
                               decoder_attention_heads=heads, encoder_ffn_dim=ffn, decoder_ffn_dim=ffn,
                               vocab_size=vocab),
            "ViTConfig": dict(hidden_size=h, num_hidden_layers=n, num_attention_heads=heads, intermediate_size=ffn,
                              num_labels=10, image_size=size["image_size"], patch_size=PATCH),
            # four stages of widths h/8 .. h, the third the deepest, as their base models are
            # window 7 at 224 px (stages of 56, 28, 14 and 7 patches a side, as Swin-T's)
            "SwinConfig": dict(image_size=size["image_size"], embed_dim=h // 8, depths=[1, 1, n, 1],
                               num_heads=[1, 2, 4, 8], window_size=size["image_size"] // 32, num_labels=10),
            "ConvNextConfig": dict(hidden_sizes=stages, depths=[1, 1, n, 1], num_labels=10),
            "ResNetConfig": dict(embedding_size=h // 8, hidden_sizes=stages, depths=[1, 1, n, 1], num_labels=10),
        }[self.config]


FAMILIES = {
    "roberta": Family("RobertaForSequenceClassification", "classify", "RobertaConfig"),
    "deberta": Family("DebertaV2ForSequenceClassification", "classify", "DebertaV2Config"),
    "albert": Family("AlbertForSequenceClassification", "classify", "AlbertConfig"),
    "electra": Family("ElectraForSequenceClassification", "classify", "ElectraConfig"),
    "bert_mlm": Family("BertForMaskedLM", "mlm", "BertConfig"),
    "gpt2": Family("GPT2LMHeadModel", "lm", "GPT2Config"),
    "opt": Family("OPTForCausalLM", "lm", "OPTConfig"),
    "qwen2": Family("Qwen2ForCausalLM", "lm", "Qwen2Config"),
    "mistral": Family("MistralForCausalLM", "lm", "MistralConfig"),
    "gemma": Family("GemmaForCausalLM", "lm", "GemmaConfig"),
    "phi3": Family("Phi3ForCausalLM", "lm", "Phi3Config"),
    "t5": Family("T5ForConditionalGeneration", "seq2seq", "T5Config"),
    "bart": Family("BartForConditionalGeneration", "seq2seq", "BartConfig"),
    "vit": Family("ViTForImageClassification", "images", "ViTConfig"),
    "swin": Family("SwinForImageClassification", "images", "SwinConfig"),
    "convnext": Family("ConvNextForImageClassification", "images", "ConvNextConfig"),
    "resnet": Family("ResNetForImageClassification", "images", "ResNetConfig"),
}


class Batches(bert_base.Workload):
    """Fixed-shape samples, batched as torch's default collate stacks them."""

    def loader(self) -> DataLoader:
        return DataLoader(self.samples, batch_size=self.batch, shuffle=False, drop_last=True)


def make_samples(task: str, n: int, length: int, vocab: int, image_size: int, seed: int) -> list[dict]:
    """n samples of the task's fields: token ids from 3 (0-2 are pad/special ids) with a mask of ones and a label
    (classify: the first id's parity; mlm: the ids at MASKED_FRACTION of the positions and one more, -100 elsewhere; lm: the
    ids; seq2seq: length // 2 other ids), or seeded images."""
    g = torch.Generator().manual_seed(seed)
    if task == "images":
        images = torch.randn(n, 3, image_size, image_size, generator=g)
        return [{"pixel_values": x, "labels": x[0].sum().gt(0).long()} for x in images]
    ids = torch.randint(3, vocab, (n, length), generator=g)
    targets = torch.randint(3, vocab, (n, length // 2), generator=g)
    chosen = torch.rand(n, length, generator=g) < MASKED_FRACTION
    chosen[torch.arange(n), torch.randint(length, (n,), generator=g)] = True  # a sample's loss is never 0 / 0
    masked = torch.where(chosen, ids, -100)
    labels = {"classify": ids[:, 0] % 2, "mlm": masked, "lm": ids, "seq2seq": targets}[task]
    return [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": y} for i, y in zip(ids, labels)]


def build_model(family: Family, size: dict, seed: int):
    import transformers

    config = getattr(transformers, family.config)(**family.settings(size))  # its default attention: SDPA where it has it
    torch.manual_seed(seed)
    return getattr(transformers, family.cls)(config).train()


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"from {','.join(FAMILIES)}")
    ap.add_argument("--modes", type=bert_base.parse_modes, default=list(MODES), help="bert_base.py's modes")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=3, help="steps before timing (compiles happen there)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=128, help="tokens a sample (seq2seq labels: half)")
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=("cuda", "cpu"), help="device of the peer's rows")
    ap.add_argument("--quick", action="store_true", help="tiny models, 16 tokens, batch 4, 2 + 2 steps")
    ap.add_argument("--size", choices=("small", "base"), default="small",
                    help="the models' size: small (hidden 256, 4 layers) or base (BERT-base's)")
    ap.add_argument("--out", help="result file name without extension (default model_families_<cpu|cuda>)")
    ap.add_argument("--results-dir", type=Path, default=_report.RESULTS)
    args = ap.parse_args(argv)
    args.families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown or not args.families:
        ap.error(f"--families: expected names from {','.join(FAMILIES)}, got {','.join(unknown) or 'none'}")
    if args.quick:
        # two warm-up steps: a compiled optimizer step compiles again at its second call (its state exists then)
        args.steps, args.warmup, args.batch, args.length = 2, 2, 4, 16
    args.device = torch.device(args.device or bert_base.default_device())
    args.out = args.out or f"model_families_{args.device.type}"
    return args


SUMMARY = [("family", "family", ""), ("peer_ms", "peer ms", ".1f"), ("accel_ms", "accel ms", ".1f"),
           ("speedup", "accel x peer", ".2f"), ("loss_check", "loss check", "")]


def run_family(name: str, args, size: dict) -> tuple[list[dict], list[str]]:
    """The family's rows (bert_base.run_mode each) and its loss-check problems."""
    family = FAMILIES[name]
    images = family.task == "images"
    # ViT's patches and [CLS]; the convolutional and Swin models count each image as one sample of one token
    tokens = ((size["image_size"] // PATCH) ** 2 + 1 if family.config == "ViTConfig" else 1) if images else args.length
    samples = make_samples(family.task, args.batch * (args.warmup + args.steps), args.length, size["vocab"],
                           size["image_size"], args.seed)
    workload = Batches("fixed", args.batch, tokens, samples, tokens_per_sample=tokens if images else None)
    model = build_model(family, size, args.seed)
    ctx = bert_base.Context(model, workload, args.device, args.lr)
    spread = bert_base.dropout_spread(model, next(iter(workload.loader())), args.device)
    rows = [{**bert_base.run_mode(mode, ctx, args), "family": name} for mode in args.modes]
    bert_base.add_speedups(rows)
    bert_base.print_workload(f"{name} ({family.cls}): {workload.name}", rows)
    return rows, bert_base.check_losses(rows, max(bert_base.FIRST_LOSS_TOL, bert_base.DROPOUT_SIGMAS * spread))


def summary_row(name: str, rows: list[dict], problems: list[str]) -> dict:
    by_mode = {r["mode"]: r for r in rows if r["status"] == "ok"}
    peer, accel = by_mode.get("peer"), by_mode.get("accel")
    return {"family": name, "peer_ms": peer and peer["step_ms_median"], "accel_ms": accel and accel["step_ms_median"],
            "speedup": accel.get("speedup_vs_peer") if accel else None,
            "loss_check": "FAIL" if problems else "PASS"}


def main(argv=None) -> int:
    args = parse_args(argv)
    env = _report.environment(str(args.device))
    env["keep_freed_memory"] = args.device.type == "cpu" and keep_freed_memory()  # as bert_base.py
    size = QUICK_SIZE if args.quick else BASE_SIZE if args.size == "base" else SIZE
    print(f"model families on {env['device']}: {','.join(args.families)}; batch {args.batch}, {args.length} tokens; "
          f"modes {','.join(args.modes)}", flush=True)
    rows, summary, problems = [], [], {}
    for name in args.families:
        torch._dynamo.reset()  # each family's graphs alone (Dynamo's recompile limit counts per code object)
        family_rows, family_problems = run_family(name, args, size)
        rows += family_rows
        summary.append(summary_row(name, family_rows, family_problems))
        if family_problems:
            problems[name] = family_problems
    print("\naccel against the peer, step time (median)")
    _report.print_table(summary, SUMMARY)
    payload = {**env, "size": size, "args": {k: str(v) if isinstance(v, (Path, torch.device)) else v
                                             for k, v in vars(args).items()},
               "summary": summary, "rows": rows, "loss_check": {"verdict": "FAIL" if problems else "PASS",
                                                                "problems": problems}}
    path = _report.write_json(args.out, payload, args.results_dir)
    measured = [s for s in summary if s["speedup"] is not None]
    png = measured and _report.ratio_bars([s["family"] for s in measured], [s["speedup"] for s in measured],
                                          "accel's step speed over the peer's", f"model families on {env['device']} "
                                          f"({env['date']})", args.out, args.results_dir)
    print(f"\nloss check: {'FAIL' if problems else 'PASS'}"
          + "".join(f"\n  {name}: {p}" for name, found in problems.items() for p in found))
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
