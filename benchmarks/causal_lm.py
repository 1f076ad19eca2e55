"""Causal-LM fine-tuning on samples of many lengths: padded batches against accel's packed rows.

What users pack most: a decoder fine-tuned on instruction/response samples whose lengths spread widely. The
eager loop and the peer pad each batch to its longest sample (transformers' DataCollatorForLanguageModeling
with padding: pad id 0, mask 0, label -100); accel packs the same samples into rows of --max-length tokens
(dataloader.pack: each sample attends only to its own earlier tokens, and no token learns to predict the next
sample, accel.compiler.packed). The rows, measurement and loss check are bert_base.py's (its eager, eager-amp,
peer and accel modes, one process, same weights and seed); see its docstring. The peer compiles with
dynamic=True: one graph for every padded length.

Model: transformers' LlamaForCausalLM from a config (hidden 512, 8 layers, 8 heads, 4 key/value heads,
intermediate 1376, vocabulary 32000 or --vocab; --size 1b: Llama 3.2 1B's shape, hidden 2048, 16 layers, 32 heads
of 64, 8 key/value heads, intermediate 8192, where attention over long rows (--max-length 4096) weighs as in the
models users fine-tune; --quick: a tiny one), random weights, nothing downloaded.
Data: seeded lognormal lengths (median 180 tokens, sigma 0.8, as instruction-tuning sets spread), clipped to
[16, --max-length]; the labels are the token ids, and with --prompt-fraction F the first F of each sample is a
prompt the loss ignores (labels -100: instruction tuning's completion-only loss).

    python benchmarks/causal_lm.py [--quick] [--modes eager,peer,accel] [--steps N] [--batch B] [--attn flex_attention]
                                   [--vocab V] [--prompt-fraction F] [--lora R] [--size 1b] [--max-length L]

Writes benchmarks/results/causal_lm_<device>.json and .png.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from accel.data.packing import LABEL_PAD  # noqa: E402
from accel.runtime.host_memory import keep_freed_memory  # noqa: E402
from benchmarks import _report, bert_base  # noqa: E402

MODES = ("eager", "eager-amp", "peer", "accel")
LLAMA = dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=1376, max_position_embeddings=2048)
QUICK_LLAMA = dict(LLAMA, vocab_size=500, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=64)
SIZES = {"small": LLAMA, "1b": dict(LLAMA, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                                    num_key_value_heads=8, intermediate_size=8192)}


class Workload(bert_base.Workload):
    """bert_base's Workload of samples of many lengths, batched as a causal LM's collator pads them, in an order
    shuffled with a fixed seed: every mode's loader draws the same batches, and accel's packed rows (which
    accelerate() shuffles too where the loader does) come in no order of length (first-fit decreasing makes
    them longest first)."""

    @property
    def name(self) -> str:
        return f"causal {self.batch}x<={self.max_length}"

    @staticmethod
    def collate(samples: list[dict]) -> dict:
        return pad_for_causal_lm(samples)

    def loader(self) -> DataLoader:
        return DataLoader(self.samples, batch_size=self.batch, shuffle=True, drop_last=True,
                          generator=torch.Generator().manual_seed(0), collate_fn=self.collate)

    def flattened_loader(self) -> DataLoader:
        """Batches as TRL's padding-free packing makes them: the samples in a shuffled order, as many a batch as
        fit batch x max_length tokens, flattened by transformers' DataCollatorWithFlattening into one row whose
        position ids restart at each sample (bert_base.py's accel-flattened mode)."""
        from transformers import DataCollatorWithFlattening

        order = torch.randperm(len(self.samples), generator=torch.Generator().manual_seed(0)).tolist()
        budget, batches, used = self.batch * self.max_length, [[]], 0
        for i in order:
            n = len(self.samples[i]["input_ids"])
            if used + n > budget:
                batches.append([])
                used = 0
            batches[-1].append(i)
            used += n
        samples = [{"input_ids": s["input_ids"].tolist(), "labels": s["labels"].tolist()} for s in self.samples]
        return DataLoader(samples, batch_sampler=batches, collate_fn=DataCollatorWithFlattening())


def pad_for_causal_lm(samples: list[dict]) -> dict:
    """Each field padded to the batch's longest sample: input ids 0, attention mask 0, labels -100."""
    longest = max(len(s["input_ids"]) for s in samples)
    batch = {"input_ids": torch.zeros(len(samples), longest, dtype=torch.long),
             "attention_mask": torch.zeros(len(samples), longest, dtype=torch.long),
             "labels": torch.full((len(samples), longest), LABEL_PAD, dtype=torch.long)}
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        batch["input_ids"][row, :n] = sample["input_ids"]
        batch["attention_mask"][row, :n] = 1
        batch["labels"][row, :n] = sample["labels"]
    return batch


def packable_lengths(batch: int, batches: int, max_length: int, seed: int) -> list[int]:
    """instruction_lengths for `batches` padded batches of `batch` samples, and as many more as accel's packed rows
    take in as many steps (`batch` rows of max_length tokens, several samples a row), so that no mode sees a
    sample twice: a sample seen again is partly learnt by heart, which the loss check would see."""
    count = batch * batches
    while sum(lengths := instruction_lengths(count, max_length, seed)) < batch * batches * max_length:
        count *= 2
    return lengths


def instruction_lengths(n: int, max_length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(math.log(180) + 0.8 * torch.randn(n, generator=g))
    return lengths.round().clamp(16, max_length).long().tolist()


def make_samples(lengths: list[int], vocab: int, seed: int, prompt_fraction: float = 0.0) -> list[dict]:
    """Token ids with themselves as labels; the first `prompt_fraction` of each sample's labels -100 (a prompt
    whose tokens the loss ignores, as instruction tuning masks them)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (sum(lengths),), generator=g)
    samples = [{"input_ids": s.clone(), "labels": s.clone()} for s in torch.split(ids, lengths)]
    for sample in samples:
        sample["labels"][:int(len(sample["labels"]) * prompt_fraction)] = LABEL_PAD
    return samples


def model_config(quick: bool, vocab: int | None = None, size: str = "small", max_length: int = 0) -> dict:
    """The Llama config of --quick or --size, with --vocab, and positions for rows of max_length tokens."""
    config = dict(QUICK_LLAMA if quick else SIZES[size])
    if vocab:
        config["vocab_size"] = vocab
    config["max_position_embeddings"] = max(config["max_position_embeddings"], max_length)
    return config


def build_model(config: dict, seed: int, attn: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**config, attn_implementation=attn)).train()


def lora_model(model, rank: int, task: str = "CAUSAL_LM"):
    """model with peft's LoRA adapters of rank `rank` on every attention and MLP projection (the frozen base, the
    adapters trained; a classifier's head trained whole, peft's SEQ_CLS): the fine-tuning users run on large
    models, through every mode alike."""
    import peft

    torch.manual_seed(1)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                      task_type=task))


def plots(rows: list[dict], title: str, name: str, directory: Path) -> list[Path]:
    """<name>.png: real tokens/s over the eager row (over the peer's where eager did not run); <name>_memory.png:
    the peer's peak memory over each row's (above 1: less memory than the peer)."""
    ok = [r for r in rows if r["status"] == "ok"]
    base = "eager" if any("speedup_vs_eager" in r for r in ok) else "peer"
    speed = [r for r in ok if f"speedup_vs_{base}" in r]
    out = []
    if speed:
        out.append(_report.ratio_bars([r["mode"] for r in speed], [r[f"speedup_vs_{base}"] for r in speed],
                                      f"real tokens/s over {base}", title, name, directory))
    peer = next((r for r in ok if r["mode"] == "peer" and r.get("peak_mem_mb")), None)
    measured = [r for r in ok if r.get("peak_mem_mb")]
    if peer is not None and len(measured) > 1:
        out.append(_report.ratio_bars([r["mode"] for r in measured],
                                      [peer["peak_mem_mb"] / r["peak_mem_mb"] for r in measured],
                                      "peer's peak memory over the mode's (higher: less memory)", title,
                                      f"{name}_memory", directory))
    return out


def add_workload_arguments(ap: argparse.ArgumentParser, modes: tuple[str, ...]) -> None:
    """The arguments of a benchmark on this one's samples of many lengths (this one's, decoder_classifier.py's)."""
    ap.add_argument("--modes", type=bert_base.parse_modes, default=list(modes), help=f"from {','.join(modes)}")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=3, help="steps before timing (compiles happen there)")
    ap.add_argument("--batch", type=int, default=8, help="samples per padded batch")
    ap.add_argument("--max-length", type=int, default=1024, help="longest sample and packed row length")
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=("cuda", "cpu"), help="device of the eager and peer modes")
    bert_base.add_budget_argument(ap)
    ap.add_argument("--lora", type=int, default=0, metavar="R",
                    help="fine-tune LoRA adapters of rank R (peft) on every projection instead of all weights")


def check_lora(ap: argparse.ArgumentParser, args) -> str:
    """Refuses a negative --lora; the result file's suffix for it."""
    if args.lora < 0:
        ap.error(f"--lora: expected a rank >= 1 (0: no adapters), got {args.lora}")
    return f"_lora{args.lora}" if args.lora else ""


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(ap, MODES)
    ap.add_argument("--attn", choices=("sdpa", "flex_attention", "eager"), default="sdpa",
                    help="every mode's attention: flex_attention gives accel's packed rows a BlockMask that skips the "
                         "blocks no sample sees (CUDA: it has no backward on the CPU)")
    ap.add_argument("--vocab", type=int, help="vocabulary size (default 32000; Llama 3's is 128256): the logits' "
                                             "share of the step, which memory.fused_lm_loss computes in chunks")
    ap.add_argument("--prompt-fraction", type=float, default=0.0,
                    help="the first fraction of each sample is a prompt the loss ignores (labels -100)")
    ap.add_argument("--size", choices=tuple(SIZES), default="small",
                    help="the Llama's shape: small (hidden 512, 8 layers) or 1b (Llama 3.2 1B's, 1.2B parameters "
                         "with the 32000 vocabulary)")
    ap.add_argument("--quick", action="store_true", help="tiny Llama, batch 4, rows of 64, 2 steps")
    ap.add_argument("--out", help="result file name without extension (default causal_lm_<cpu|cuda>)")
    ap.add_argument("--results-dir", type=Path, default=_report.RESULTS)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.batch, args.max_length = 2, 1, 4, 64
    args.device = torch.device(args.device or bert_base.default_device())
    if not 0.0 <= args.prompt_fraction < 1.0:
        ap.error(f"--prompt-fraction: expected a fraction in [0, 1), got {args.prompt_fraction}")
    args.out = args.out or (f"causal_lm_{args.device.type}" + ("" if args.size == "small" else f"_{args.size}")
                            + ("" if args.attn == "sdpa" else f"_{args.attn}") + check_lora(ap, args))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    env = _report.environment(str(args.device))
    env["keep_freed_memory"] = args.device.type == "cpu" and keep_freed_memory()  # as bert_base.py
    config = model_config(args.quick, args.vocab, args.size, args.max_length)
    model = build_model(config, args.seed, args.attn)
    if args.lora:
        model = lora_model(model, args.lora)
    vocab = model.config.vocab_size
    lengths = packable_lengths(args.batch, args.warmup + args.steps, args.max_length, args.seed)
    # The peer compiles every length as one dynamic graph: with Dynamo's automatic shapes (static first, dynamic
    # on the second length) torch 2.9's Inductor fails to compile this bf16 Llama on the CPU (CppCompileError:
    # 'tmp2' was not declared; fixed by 2.13), and a static graph per padded length recompiles every step.
    workload = Workload("causal", args.batch, args.max_length,
                        make_samples(lengths, vocab, args.seed, args.prompt_fraction), peer_dynamic=True)
    print(f"Llama {'quick (tiny)' if args.quick else args.size} ({args.attn}) on {env['device']}: {workload.name}, "
          f"{len(lengths)} samples of median {sorted(lengths)[len(lengths) // 2]} tokens; modes {','.join(args.modes)}",
          flush=True)
    ctx = bert_base.Context(model, workload, args.device, args.lr)
    return run_one_workload(ctx, args, env, dict(config, attn=args.attn, lora=args.lora),
                            f"{workload.name} (vocabulary {vocab}{f', LoRA r={args.lora}' if args.lora else ''}) "
                            f"on {env['device']}")


def run_one_workload(ctx: bert_base.Context, args, env: dict, model: dict, title: str) -> int:
    """bert_base.py's rows of args.modes on ctx's one workload: table, loss check, <args.out>.json and plots
    (this benchmark's and vit_base.py's main). Returns the exit status: 1 when the loss check fails."""
    started = time.perf_counter()
    rows = [bert_base.run_or_skip(mode, ctx, args, started) for mode in args.modes]
    bert_base.add_speedups(rows)
    bert_base.print_workload(ctx.workload.name, rows)
    problems = bert_base.check_losses(rows, bert_base.FIRST_LOSS_TOL)
    verdict = "FAIL" if problems else "PASS"
    payload = {**env, "workload": ctx.workload.name, "model": model,
               "args": {k: str(v) if isinstance(v, (Path, torch.device)) else v for k, v in vars(args).items()},
               "rows": rows, "loss_check": {"verdict": verdict, "problems": problems}}
    path = _report.write_json(args.out, payload, args.results_dir)
    pngs = plots(rows, title, args.out, args.results_dir)
    print(f"\nloss check: {verdict}" + "".join(f"\n  {p}" for p in problems))
    print(f"wrote {path}" + "".join(f" and {png}" for png in pngs))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
