"""`make bench`: BERT-base training, the TorchAcc guide's way and what accel and torch.compile make of it.

Model: transformers' BertForSequenceClassification with the bert-base-cased configuration, built by hand
(vocab 28996, hidden 768, 12 layers, 12 heads, intermediate 3072, 512 positions, 2 token types, 2 labels,
dropout 0.1) from one seed: random weights, nothing downloaded. Every mode starts from the same weights
(a copy of that one model) and, within a workload, from the same generated data and RNG seed.

Workloads
  fixed  every sample is --seq tokens (128 by default, 512 via --seq); --fixed-sizes 32x128,256x128
         runs several batch x length sizes in one invocation. Label: the parity of the first token.
  guide  the TorchAcc guide's BERT script: SST-2 sentences, batch 128, max_seq_length 512, each batch
         padded to its longest sample as transformers' DataCollatorWithPadding does (pad id 0, mask 0,
         token type 0). SST-2-like lengths, seeded: 90% short sentences (lognormal, median 20 tokens,
         sigma 0.6, as SST-2 sentences are under the bert-base-cased tokenizer) and a 10% tail
         (lognormal, median 160, sigma 0.7) that reaches max_seq_length, all clipped to [4, max_length].
         Real SST-2 stops near 70 tokens; the tail stands for the longer texts that make the guide's
         max_seq_length 512 matter, and it is what makes per-batch padding expensive (one long sample
         pads the whole batch). The data set holds batch x (warm-up + steps) samples; the packed
         accel mode reads the same samples packed into max_length rows (accelerate() puts about as
         many real tokens in a batch as a padded batch holds) and starts over when they run out.

Modes (one row each, in this order, one process)
  eager          the guide's "before": torch.optim.Adam, TF32 matmuls, fp16 autocast + GradScaler on CUDA;
                 on the CPU fp32 (the guide's amp is CUDA fp16).
  eager-amp      eager with bf16 autocast; skipped (reason recorded) on a CPU without native bf16.
  peer           what a user picks instead: torch.compile(model) (mode="reduce-overhead", i.e. CUDA graphs,
                 on CUDA where every batch has one shape; the default mode where lengths vary),
                 torch.compile(opt.step) of AdamW(fused=True where supported, lr as a tensor so a new lr does
                 not recompile), bf16 autocast where native else fp32; per-batch padding on the guide
                 workload, as the guide does.
  accel-kernels  accel.runtime.hooks (fused LayerNorm, Philox dropout and Adam; oneDNN Linear where it wins
                 on this CPU) on before the model is built, eager, the precision of eager-amp (bf16 where
                 native, else fp32).
  accel-xla      the guide's XLA port (MpDeviceLoader, syncfree.AdamW, xm.optimizer_step) on torch_xla's
                 device; skipped where torch_xla is not installed.
  accel          accel.accelerate(model, loader, config) with compute.bf16 (accelerate stays fp32 on a CPU
                 without native bf16) and, on the guide workload, dataloader.pack with max_length 512;
                 accelerate() picks the backend: CUDA, else XLA on a TPU, else CPU. Its defaults include
                 compute.first_token_only: on the fixed workload the last layer computes the [CLS] token
                 alone (the classifier reads nothing else), on packed rows each sample's first token. On the
                 fixed workload also dataloader.drop_full_masks (its batches have no padding): attention
                 runs unmasked ("accel_sdpa", accel.compiler.unpadded_attention), under compile too.
  accel-model-only  accel's row with accelerate(model) alone: the loop takes the workload's batches and copies
                 them as the peer does (a mask of ones dropped as accelerate()'s loader would): the A/B of
                 accelerate()'s loader (its Prefetcher thread) against none. Only when --modes names it.
  accel-step-graph  accel's row with compute.step_graph and the step function wrapped in accel.graph_step: the
                 whole step (forward, backward, optimizer step, zero_grad) one CUDA graph replay. CUDA only;
                 only when --modes names it.
  peer-eager-attention  the peer with transformers' "eager" attention instead of SDPA (what accel's
                 compute.cpu_attention picks on a CPU where SDPA's 16-bit flash kernel is slow backwards, chosen
                 by hand). Only when --modes names it.
  accel-flattened  accel's row on the rows the user's collator packs (causal_lm.py: transformers'
                 DataCollatorWithFlattening over as many samples as fit batch x max_length tokens, one row whose
                 position ids restart per sample; dataloader.buckets makes it static), as TRL's padding-free
                 packing feeds a model. Only when --modes names it.
  accel:F=V[+F=V...]  the accel row with Config fields set otherwise, e.g. accel:compute.fuse_qkv=false:
                 an A/B of one of accelerate()'s choices in the same run (any number of such rows);
                 accel-flattened:F=V likewise.

Reported per mode: samples/s and real (non-pad) tokens/s over the timed steps; step time median and p90;
the times Inductor ran a graph without the CUDA graphs it was asked for (graph skips; each reason is printed
under the table and kept in the row: accel.compiler.cudagraph_skips listens to Inductor's CUDA-graph log);
the host's time per step (median; from taking the batch to the step's return, which on CUDA waits for the
device only where the step itself does, e.g. the peer's copy of a pageable batch: close to the step time
when the host bounds the step, below it when the GPU does), and the part of it spent taking the batch (data
ms: the loader's work, or for a Prefetcher the wait for its thread, which a GIL shared with the step can stretch);
compile time (what the warm-up steps took beyond warm-up x the timed median: compiling, CUDA graph
capture, kernel builds) and compile count (torch._dynamo's unique graphs, plus XLA compiles on an XLA
device); peak memory (CUDA: torch.cuda.max_memory_allocated; CPU, XLA on CPU included: peak RSS during
the mode minus RSS at its start, from /proc/self/status VmHWM after resetting it through
/proc/self/clear_refs, else the growth of getrusage's ru_maxrss); the loss curve; speed-ups (ratio of
real tokens/s: packing changes how many samples a step holds, so tokens are the common unit) over eager
and over the peer. A step's time runs from the previous step's end to this one's, the batch fetch
included. On CUDA the steps are timed as a training loop runs them, without a host sync between them: a
CUDA event recorded after each step, read once at the end, so the host prepares step i + 1 while the GPU
runs step i and a step is as long as the busier of the two made it. Elsewhere after a device sync per step
(XLA: accel.xla.sync(wait=True), which is what runs the step there).

MFU (CUDA, H100/H200 only: 989 TFLOP/s dense 16-bit, also for the fp32/TF32 rows), counted on real tokens:
    FLOPs = 6 * P * tokens + 12 * layers * hidden * sum over samples of length^2
P: parameters without the embedding tables (lookups, not matmuls); the second term is attention's two
seq x seq matmuls (QK^T and AV, 2 * 2 * len^2 * hidden per layer forward, x3 for forward + backward).

Loss check (PASS/FAIL line, recorded in the JSON, exit status 1 on FAIL): in every workload the reference
is the eager row (else the first row that ran). Rows that see the same batches (all but packed accel)
must match its first-step loss within max(2e-2, 5 x the standard deviation dropout alone gives that
batch's loss, measured over 5 masks): the modes that draw dropout masks with torch's dropout in eager
code (eager, eager-amp) get the same masks; accel-kernels (Philox dropout), compiled modes (accel's on the
CPU with Philox dropout too) and XLA draw their own. Every final loss must be finite and within 0.3 of the
reference's. A mode that raises fails the check too (the other rows still run). Adam's lr is 2e-5 (--lr), BERT fine-tuning's usual rate: at 1e-4 a randomly
initialised BERT-base's loss climbs within a few steps.

Defaults (--quick: 2 layers, hidden 64, vocab 1000, batch 4, seq 32, guide max length 64, 2 steps)
  CUDA: --workload both; fixed 32x128, 256x128, 64x512; guide batch 128; 5 warm-up + 20 timed steps (with 3,
        the first timed step of every compiled row on an H100 still took 1.1-3x the median: 2026-11-27).
  CPU:  --workload fixed; fixed 8x128; guide (with --workload guide/both) batch 8, max length 512;
        2 warm-up + 2 timed steps. A BERT-base fp32 step at 8x128 takes ~5.5 s on 2 cores (~11 s on
        XLA), the first compiled steps ~70-120 s (torch.compile) or ~25-45 s per graph (XLA, 2 graphs),
        and the first accel-kernels step builds the kernels when they are not cached (~1 minute each).
        With 3 timed steps the default run took 7 minutes on 2 busy cores with those caches warm; 2
        timed steps leave room for a cold run under 10 minutes. 2 warm-up steps because a compiled
        optimizer step, and XLA's step graph, compile again on their second call (the optimizer state
        exists then); the table's "timed" column counts compiles in the timed steps (0 in every mode).
        The guide workload on the CPU (per-batch lengths up to 512, a new shape per batch for the
        compiled modes) takes far longer: ask for it explicitly.
--workload both runs the fixed sizes, then the guide workload (whose compiled peer compiles once per new
length). Rows run headline first: peer and accel of every workload (the targets compare those two), then
the other modes, so a run on a time budget (--budget-s: rows that would start after it are skipped) keeps
the comparison that matters; the table and the JSON list the rows by workload and mode.

    python benchmarks/bert_base.py [--workload fixed|guide|both] [--modes eager,peer,accel]
        [--steps N] [--warmup N] [--batch B] [--seq S] [--fixed-sizes 32x128,64x512] [--max-length 512]
        [--budget-s S] [--quick] [--model bert|distilbert] [--out NAME] [--results-dir DIR]

--model distilbert trains DistilBERT-base (6 layers, transformers' DistilBertForSequenceClassification, random
weights) on the same data instead.

On the CPU every row runs with glibc keeping freed memory (accel.runtime.host_memory, which accelerate()
sets there for the whole process): the rows share a process, so the setting could not be accel's alone.

Writes <results-dir>/<out>.json and .png (default benchmarks/results/<model>_base_<cpu|cuda>.*); the JSON is
rewritten after every row, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import dataclasses
import gc
import math
import os
import re
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Iterator

# torch_xla reads PJRT_DEVICE when its runtime starts; the XLA rows run on its CPU client unless told otherwise.
os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from accel.runtime.host_memory import keep_freed_memory, return_freed_memory  # noqa: E402
from benchmarks import _report  # noqa: E402

MODES = ("eager", "eager-amp", "peer", "accel-kernels", "accel-xla", "accel")
EXTRA_MODES = ("accel-model-only", "accel-step-graph", "peer-eager-attention", "accel-flattened")  # only when named
BERT_BASE_CASED = dict(vocab_size=28996, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                       intermediate_size=3072, max_position_embeddings=512, type_vocab_size=2, num_labels=2)
QUICK_BERT = dict(BERT_BASE_CASED, vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=128)
# --model distilbert: DistilBERT-base (uncased vocabulary), 6 layers; its config's own names
DISTILBERT_BASE = dict(vocab_size=30522, dim=768, n_layers=6, n_heads=12, hidden_dim=3072, max_position_embeddings=512,
                       num_labels=2)
QUICK_DISTILBERT = dict(DISTILBERT_BASE, vocab_size=1000, dim=64, n_layers=2, n_heads=2, hidden_dim=128)
MODELS = ("bert", "distilbert")
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12}  # dense bf16/fp16 tensor-core peak (SXM)
FIRST_LOSS_TOL = 2e-2
DROPOUT_SIGMAS = 5  # first-loss tolerance in standard deviations of the dropout noise
FINAL_LOSS_BAND = 0.3
DROPOUT_MASKS = 5


@dataclasses.dataclass(frozen=True)
class Defaults:
    workload: str
    fixed_sizes: tuple[tuple[int, int], ...]
    guide_batch: int
    max_length: int
    warmup: int
    steps: int


DEFAULTS = {
    "cuda": Defaults("both", ((32, 128), (256, 128), (64, 512)), 128, 512, warmup=5, steps=20),
    "cpu": Defaults("fixed", ((8, 128),), 8, 512, warmup=2, steps=2),
    "quick": Defaults("both", ((4, 32),), 4, 64, warmup=1, steps=2),
}


class Skip(Exception):
    """A mode that cannot run here; the message says why and goes into its row."""


# ---------------------------------------------------------------------------------------------- data


@dataclasses.dataclass
class Workload:
    kind: str            # "fixed" or "guide" (benchmarks/causal_lm.py: "causal")
    batch: int
    max_length: int      # fixed: every sample's length; guide: the longest a sample may be
    samples: list[dict]
    peer_dynamic: bool | None = None  # the peer's torch.compile(dynamic=...); None: Dynamo's automatic shapes
    tokens_per_sample: int | None = None  # batches of images (benchmarks/vit_base.py): the tokens an image is
    # Inductor settings of the peer's CPU graphs where torch's defaults fail (benchmarks/decoder_classifier.py)
    peer_cpu_options: dict | None = None

    @property
    def name(self) -> str:
        return f"fixed {self.batch}x{self.max_length}" if self.kind == "fixed" else \
            f"guide {self.batch}x<={self.max_length}"

    def loader(self) -> DataLoader:
        return DataLoader(self.samples, batch_size=self.batch, shuffle=False, drop_last=True,
                          collate_fn=pad_to_longest)


def pad_to_longest(samples: list[dict]) -> dict:
    """What DataCollatorWithPadding does for BERT: pad every field but the labels (input ids, token types where the
    samples have them, attention mask) to the batch's longest sample with 0; one label a sample."""
    longest = max(len(s["input_ids"]) for s in samples)
    batch = {key: torch.zeros(len(samples), longest, dtype=torch.long) for key in samples[0] if key != "labels"}
    for row, sample in enumerate(samples):
        for key, padded in batch.items():
            padded[row, :len(sample[key])] = sample[key]
    batch["labels"] = torch.stack([s["labels"] for s in samples])
    return batch


def make_samples(lengths: list[int], vocab: int, seed: int, token_types: bool = True) -> list[dict]:
    """Tokenised-sentence dicts (SST-2's fields after the tokenizer; without token_type_ids where `token_types` is
    False, as a decoder's tokenizer gives them); ids from 1 (0 pads); label = parity of the first token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (sum(lengths),), generator=g)
    return [{"input_ids": s.clone(), **({"token_type_ids": torch.zeros_like(s)} if token_types else {}),
             "attention_mask": torch.ones_like(s), "labels": s[0] % 2} for s in torch.split(ids, lengths)]


def sst2_like_lengths(n: int, max_length: int, seed: int) -> list[int]:
    """The guide workload's long-tailed length mix (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    short = torch.exp(math.log(20) + 0.6 * torch.randn(n, generator=g))
    tail = torch.exp(math.log(160) + 0.7 * torch.randn(n, generator=g))
    in_tail = torch.rand(n, generator=g) < 0.10
    return torch.where(in_tail, tail, short).round().clamp(4, max_length).long().tolist()


def build_workloads(args, vocab: int) -> list[Workload]:
    per_mode = args.warmup + args.steps
    workloads = []
    if args.workload in ("fixed", "both"):
        for batch, seq in args.fixed_sizes:
            lengths = [seq] * (batch * per_mode)
            workloads.append(Workload("fixed", batch, seq, make_samples(lengths, vocab, args.seed)))
    if args.workload in ("guide", "both"):
        lengths = sst2_like_lengths(args.guide_batch * per_mode, args.max_length, args.seed)
        workloads.append(Workload("guide", args.guide_batch, args.max_length, make_samples(lengths, vocab, args.seed)))
    return workloads


def endless(iterable) -> Iterator:
    """Batches of `iterable`, epoch after epoch."""
    while True:
        empty = True
        for item in iterable:
            empty = False
            yield item
        if empty:
            raise RuntimeError("the loader yielded no batch (fewer samples than one batch?)")


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


# ----------------------------------------------------------------------------------------- the model


def model_settings(quick: bool, model: str = "bert") -> dict:
    if model == "distilbert":
        return QUICK_DISTILBERT if quick else DISTILBERT_BASE
    return QUICK_BERT if quick else BERT_BASE_CASED


def bert_config(quick: bool, model: str = "bert"):
    import transformers

    config_class = transformers.DistilBertConfig if model == "distilbert" else transformers.BertConfig
    return config_class(**model_settings(quick, model))


def build_model(config, seed: int):
    """BertForSequenceClassification (or DistilBERT's, for its config) with seeded random weights."""
    import transformers

    torch.manual_seed(seed)
    model_class = transformers.DistilBertForSequenceClassification if isinstance(
        config, transformers.DistilBertConfig) else transformers.BertForSequenceClassification
    return model_class(config).train()


def matmul_params(model) -> int:
    """Parameters that take part in matmuls: all but the embedding tables (see MFU in the docstring)."""
    embeddings = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in embeddings)


# ------------------------------------------------------------------------------------- device helpers


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def native_bf16(device: torch.device) -> bool:
    """Whether `device` computes bf16 in hardware (an XLA device counts as the host CPU: PJRT_DEVICE=CPU)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    from accel.utils.cpu import native_bf16 as cpu_has_bf16

    return cpu_has_bf16()


def autocast(device: torch.device, dtype: torch.dtype | None):
    """torch.autocast to `dtype`, or nothing for fp32."""
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def fast_dtype(device: torch.device) -> torch.dtype | None:
    """bf16 where the device computes it natively, else None (fp32): emulated bf16 is tens of times slower."""
    return torch.bfloat16 if native_bf16(device) else None


def precision_name(dtype: torch.dtype | None, device: torch.device) -> str:
    if dtype is None:
        return "fp32" + (" (TF32 matmuls)" if device.type == "cuda" else "")
    return f"{str(dtype).removeprefix('torch.')} autocast"


def device_sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "xla":
        import accel.xla as xm

        xm.sync(wait=True)


def compile_count(device: torch.device) -> int:
    """torch.compile graphs so far, plus XLA compiles when the mode runs on an XLA device."""
    from torch._dynamo.utils import counters

    count = counters["stats"]["unique_graphs"]
    if device.type == "xla":
        import accel.xla as xm

        count += xm.metrics().compiles
    return count


def fused_adamw_supported(device: torch.device) -> bool:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return device.type in _get_fused_kernels_supported_devices()


# --------------------------------------------------------------------------------------------- memory


def _proc_status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def _reset_peak_rss() -> bool:
    """Make VmHWM restart from the current RSS (Linux >= 4.0); False where the kernel does not let us."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def release_memory() -> None:
    """Free what the previous mode left, so the next one's memory starts from a clean baseline."""
    gc.collect()
    torch._dynamo.reset()  # compiled graphs and CUDA graph pools of the previous mode
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return_freed_memory()  # glibc keeps freed arenas otherwise: RSS would not drop


class PeakMemory:
    """Peak memory of one mode. CUDA: max_memory_allocated. Host: peak RSS growth (see MEMORY_METHODS)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)
            self.method = "torch.cuda.max_memory_allocated"
        elif _reset_peak_rss() and _proc_status_kb("VmHWM") is not None:
            self.method = "peak RSS growth (VmHWM)"
            self.start_kb = _proc_status_kb("VmRSS")
        else:
            self.method = "peak RSS growth (ru_maxrss)"
            self.start_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def peak_bytes(self) -> int:
        if self.cuda:
            return torch.cuda.max_memory_allocated()
        if self.method.endswith("(VmHWM)"):
            return (_proc_status_kb("VmHWM") - self.start_kb) * 1024
        return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - self.start_kb) * 1024


# ---------------------------------------------------------------------------------------------- modes


@dataclasses.dataclass
class Context:
    """What every mode builds from: the seeded model, the workload and the run's settings."""
    initial_model: torch.nn.Module
    workload: Workload
    device: torch.device   # where the eager, peer and kernels modes run
    lr: float


@dataclasses.dataclass
class Run:
    """One mode set up on one workload, ready for measure()."""
    step: Callable[[dict], torch.Tensor]   # one training step on a device batch; returns the loss
    batches: Iterator[dict]                # device batches, endless
    device: torch.device
    precision: str
    packed: bool = False                   # batches are packed rows (segment_ids) rather than padded ones
    flattened: bool = False                # rows the user's collator flattened (position ids restart per sample)


def _eager_step(model, opt, dtype, scaler, device):
    def step(batch):
        opt.zero_grad(set_to_none=True)
        with autocast(device, dtype):
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss
    return step


def _eager_run(ctx: Context, dtype, model=None) -> Run:
    """The guide's loop: Adam, autocast to `dtype`, a GradScaler that only acts for fp16."""
    device = ctx.device
    model = (model or copy.deepcopy(ctx.initial_model)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=ctx.lr)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    batches = (to_device(b, device) for b in endless(ctx.workload.loader()))
    precision = precision_name(dtype, device) + (" + GradScaler" if scaler.is_enabled() else "")
    return Run(_eager_step(model, opt, dtype, scaler, device), batches, device, precision)


def setup_eager(ctx: Context) -> Run:
    if ctx.device.type == "cuda":
        return _eager_run(ctx, torch.float16)
    run = _eager_run(ctx, None)
    run.precision += ", no amp (the guide's amp is CUDA fp16 + GradScaler)"
    return run


def setup_eager_amp(ctx: Context) -> Run:
    if not native_bf16(ctx.device):
        raise Skip(f"no native bf16 on this {ctx.device.type} (no AMX/AVX512-BF16): emulated bf16 is ~37x slower")
    return _eager_run(ctx, torch.bfloat16)


def setup_peer(ctx: Context) -> Run:
    device, dtype = ctx.device, fast_dtype(ctx.device)
    model = copy.deepcopy(ctx.initial_model).to(device)
    # CUDA graphs where every batch has one shape. With a new padded length per batch, cudagraph trees record the
    # graphs again per length: the H200 causal_lm peer (8 x <= 1024, dynamic=True) ran 144-171 ms steps between
    # its recompiles, accel 4.8 ms (benchmarks/results/gpu_h200_2026-11-28.md); what a user keeps there is the
    # default mode.
    cuda_graphs = device.type == "cuda" and ctx.workload.kind == "fixed"
    options = ctx.workload.peer_cpu_options if device.type == "cpu" else None
    compiled = torch.compile(model, mode="reduce-overhead" if cuda_graphs else None, dynamic=ctx.workload.peer_dynamic,
                             options=options)
    fused = fused_adamw_supported(device)
    # lr as a tensor: a scheduler changing it would otherwise recompile the optimizer step
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(ctx.lr, device=device), fused=fused)
    opt_step = torch.compile(opt.step)

    def step(batch):
        if cuda_graphs:  # a new iteration: the previous replay's outputs may be overwritten now
            torch.compiler.cudagraph_mark_step_begin()
        with autocast(device, dtype):
            loss = compiled(**batch).loss
        loss.backward()
        opt_step()
        opt.zero_grad(set_to_none=True)
        return loss

    batches = (to_device(b, device) for b in endless(ctx.workload.loader()))
    extras = ["CUDA graphs" if cuda_graphs else "torch.compile", "fused AdamW" if fused else "AdamW"]
    extras += [f"{key}={value}" for key, value in (options or {}).items()]
    return Run(step, batches, device, f"{precision_name(dtype, device)}, {', '.join(extras)}")


def setup_peer_eager_attention(ctx: Context) -> Run:
    """The peer with transformers' "eager" attention (matmul, softmax, matmul, which Inductor fuses) instead of
    SDPA: what a user who knows that torch's 16-bit CPU flash kernel is slow backwards would pick by hand."""
    model = copy.deepcopy(ctx.initial_model)
    if not hasattr(model, "set_attn_implementation"):
        raise Skip("peer-eager-attention: the model is not a transformers model that can switch its attention")
    model.set_attn_implementation("eager")
    run = setup_peer(dataclasses.replace(ctx, initial_model=model))
    run.precision += ", eager attention"
    return run


def setup_accel_kernels(ctx: Context) -> Run:
    from transformers import BertForSequenceClassification

    from accel.runtime import hooks

    # The hooks act when modules and optimizers are constructed: build both while they are on.
    hooks.enable_fused_layer_norm()
    hooks.enable_philox_dropout()
    # where oneDNN beats torch's BLAS on this CPU (fp32 products only; on a GPU it would only add a check a call)
    linear = ctx.device.type == "cpu" and hooks.enable_onednn_linear()
    hooks.enable_fused_adam()
    try:
        model = BertForSequenceClassification(ctx.initial_model.config).train()
        model.load_state_dict(ctx.initial_model.state_dict())
        run = _eager_run(ctx, fast_dtype(ctx.device), model)
    finally:
        restore_hooks()
    run.precision += ", fused LayerNorm + Philox dropout + Adam" + (" + oneDNN Linear" if linear else "")
    return run


def setup_accel_xla(ctx: Context) -> Run:
    from accel.utils.xla import INSTALL_HINT, xla_available

    if not xla_available():
        raise Skip(f"torch_xla is not installed ({INSTALL_HINT})")
    import accel.torch_xla.core.xla_model as xm
    import accel.torch_xla.distributed.parallel_loader as pl
    from accel.torch_xla.amp import syncfree

    device = xm.xla_device()
    xm.set_replication(device, [device])
    model = copy.deepcopy(ctx.initial_model).to(device)
    opt = syncfree.AdamW(model.parameters(), lr=ctx.lr)

    def step(batch):
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        xm.optimizer_step(opt)
        return loss

    batches = endless(pl.MpDeviceLoader(ctx.workload.loader(), device))
    return Run(step, batches, device, "fp32 (XLA), syncfree.AdamW")


def _batches_as_the_peer_takes_them(ctx: Context, config, device: torch.device) -> Iterator[dict]:
    """The workload's batches, endless, for accel-model-only: copied in the loop (to_device, as the peer's are), with
    what accelerate()'s loader would change in them (a mask of ones dropped) done here."""
    from accel.data.full_mask import without_full_mask

    drop = config.dataloader.drop_full_masks
    return (to_device(without_full_mask(b) if drop else b, device) for b in endless(ctx.workload.loader()))


def setup_accel(ctx: Context, overrides: dict[str, str] | None = None, model_only: bool = False,
                step_graph: bool = False, flattened: bool = False) -> Run:
    """accel's row; `model_only`: accelerate(model) alone, the batches taken as the peer takes them (the
    A/B of accelerate()'s loader, its Prefetcher thread included, against none); `step_graph`: the whole step
    one CUDA graph (compute.step_graph and accel.graph_step); `flattened`: the rows the user's collator packs
    (the workload's flattened_loader(), batch x max_length tokens a row, static by dataloader.buckets) instead of
    dataloader.pack's."""
    import accel

    if not hasattr(accel, "accelerate"):
        raise Skip("accel.accelerate() is not in this checkout yet (accel/accelerate.py)")
    config = accel.Config()
    config.compute.bf16 = True  # accelerate() stays fp32 (and says so) where bf16 is not native
    if flattened:
        if not hasattr(ctx.workload, "flattened_loader"):
            raise Skip("accel-flattened takes rows of samples of many lengths: causal_lm.py's workload")
        config.dataloader.buckets = [ctx.workload.batch * ctx.workload.max_length]
    elif ctx.workload.kind != "fixed":  # samples of many lengths: packed rows
        config.dataloader.pack = True
        config.dataloader.max_length = ctx.workload.max_length
    else:  # the step reads nothing but the loss: an all-ones mask may go (unmasked SDPA)
        config.dataloader.drop_full_masks = True
    if step_graph:
        if ctx.device.type != "cuda":
            raise Skip("accel-step-graph captures CUDA graphs: CUDA only")
        config.compute.step_graph = True
    config = accel_config(overrides or {}, config)  # a variant's fields last
    packed = config.dataloader.pack
    if model_only:
        if packed or config.dataloader.bucket_lengths() is not None:
            raise Skip("accel-model-only takes the loader's own shapes: not with dataloader.pack or buckets")
        model = accel.accelerate(copy.deepcopy(ctx.initial_model), None, config)
        batches = _batches_as_the_peer_takes_them(ctx, config, next(model.parameters()).device)
    else:
        loader = ctx.workload.flattened_loader() if flattened else ctx.workload.loader()
        model, loader = accel.accelerate(copy.deepcopy(ctx.initial_model), loader, config)
        batches = endless(loader)
    opt = torch.optim.AdamW(model.parameters(), lr=ctx.lr)

    def step(batch):
        loss = model(**batch)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    if step_graph:
        step = accel.graph_step(step)
    device = next(model.parameters()).device  # the backend accelerate() chose; its batches arrive there
    if not config.compute.bf16:
        precision = "fp32 (compute.bf16 off)"
    else:
        precision = "compute.bf16: " + ("bf16 autocast" if native_bf16(device) else "fp32 here (bf16 not native)")
    from accel.runtime.nn.onednn_mm import OneDNNLinear

    if any(isinstance(m, OneDNNLinear) for m in model.modules()):  # compute.cpu_gemm chose oneDNN here
        precision += ", fp32 products on oneDNN"
    rows = ", packed rows" if packed else ", rows flattened by the collator" if flattened else ""
    return Run(step, batches, device, precision + rows, packed=packed, flattened=flattened)


SETUPS = {"eager": setup_eager, "eager-amp": setup_eager_amp, "peer": setup_peer,
          "peer-eager-attention": setup_peer_eager_attention,
          "accel-kernels": setup_accel_kernels, "accel-xla": setup_accel_xla, "accel": setup_accel,
          "accel-model-only": lambda ctx: setup_accel(ctx, model_only=True),
          "accel-step-graph": lambda ctx: setup_accel(ctx, step_graph=True),
          "accel-flattened": lambda ctx, overrides=None: setup_accel(ctx, overrides, flattened=True)}
CONFIGURABLE_MODES = ("accel", "accel-flattened")  # the rows that take accel:FIELD=VALUE variants


def setup(mode: str, ctx: Context) -> Run:
    """The Run of a mode, or of an accel:FIELD=VALUE variant (accel with those Config fields)."""
    base, overrides = split_mode(mode)
    return SETUPS[base](ctx, overrides) if overrides else SETUPS[base](ctx)


# ------------------------------------------------------------------------------------------ measuring


def batch_counts(batch: dict, packed: bool, tokens_per_sample: int | None = None,
                 flattened: bool = False) -> torch.Tensor:
    """[samples, real tokens, sum of sample length^2] of a device batch, as one device tensor (no host sync);
    `tokens_per_sample`: a batch of images (pixel_values), each that many tokens; `flattened`: rows of samples
    whose position ids restart at 0 (DataCollatorWithFlattening), padded with token id 0 (the benchmarks' samples
    hold ids from 1 up)."""
    if "pixel_values" in batch:
        images = batch["pixel_values"]
        lengths = torch.full(images.shape[:1], tokens_per_sample, dtype=torch.long, device=images.device)
        samples = torch.full((), images.shape[0], dtype=torch.long, device=images.device)
    elif packed or flattened:
        if flattened:  # segment ids 1, 2, ... from the restarts, 0 for the padding
            real = batch["input_ids"] != 0
            segments = ((batch["position_ids"] == 0) & real).long().cumsum(1) * real
        else:
            segments = batch["segment_ids"]
        per_segment = torch.zeros(segments.shape[0], segments.shape[1] + 1, dtype=torch.long, device=segments.device)
        per_segment.scatter_add_(1, segments.long(), torch.ones_like(segments, dtype=torch.long))
        lengths = per_segment[:, 1:]  # column 0 counts the padding tail
        samples = segments.amax(1).sum()
    elif "attention_mask" in batch:
        lengths = batch["attention_mask"].sum(1)
        samples = (lengths > 0).sum()
    else:  # accelerate()'s loader drops a mask of ones (accel.data.full_mask): every token is real
        ids = batch["input_ids"]
        lengths = torch.full(ids.shape[:1], ids.shape[1], dtype=torch.long, device=ids.device)
        samples = torch.full((), ids.shape[0], dtype=torch.long, device=ids.device)  # a fill: torch.tensor would
        # copy from the host and wait for the device (a sync per step in this mode alone)
    return torch.stack([samples, lengths.sum(), lengths.pow(2).sum()])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class StepClock:
    """Step times, each from the previous step's end (or the clock's start) to this one's end. On CUDA from
    events on the GPU's timeline, read after the last step: no host sync between steps, as in a training
    loop (time the GPU waits on the host counts, time the host runs ahead does not); elsewhere from the
    host's clock after a device sync per step."""

    def __init__(self, device: torch.device):
        self.device = device
        self.events = device.type == "cuda"
        device_sync(device)
        self.marks: list = [self._mark()]

    def _mark(self):
        if not self.events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def step_ended(self) -> None:
        if not self.events:
            device_sync(self.device)
        self.marks.append(self._mark())

    def step_times(self) -> list[float]:
        """Seconds per step; on CUDA this waits for the GPU to finish the steps."""
        if not self.events:
            return [b - a for a, b in zip(self.marks, self.marks[1:])]
        device_sync(self.device)
        return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]


def measure(run: Run, warmup: int, steps: int, desc: str, tokens_per_sample: int | None = None) -> dict:
    """Drive `run` for warmup + steps steps; times, losses and counts (read from the device once, at the end);
    `tokens_per_sample`: batch_counts'."""
    from tqdm import tqdm

    compiles_start = compile_count(run.device)
    losses, timed_counts, host_times, data_times = [], [], [], []
    clock = StepClock(run.device)
    for i in tqdm(range(warmup + steps), desc=desc, unit="step"):
        start = time.perf_counter()
        batch = next(run.batches)
        fetched = time.perf_counter()
        loss = run.step(batch)
        host_times.append(time.perf_counter() - start)
        data_times.append(fetched - start)
        losses.append(loss.detach().clone())  # clone: a CUDA graph replay reuses its output buffer
        # counted in the warm-up too: on XLA the counting ops are part of the step's graph, and a graph
        # that first grew them in the timed steps would compile again there
        counts = batch_counts(batch, run.packed, tokens_per_sample, run.flattened)
        if i >= warmup:
            timed_counts.append(counts)
        clock.step_ended()
        if i == warmup - 1:
            compiles_warm = compile_count(run.device)
    times = clock.step_times()
    if warmup == 0:
        compiles_warm = compiles_start
    compiles_end = compile_count(run.device)
    samples, tokens, attention_sq = (int(x) for x in torch.stack(timed_counts).sum(0).cpu().tolist())
    return {"losses": [float(x) for x in torch.stack([x.float() for x in losses]).cpu().tolist()],
            "step_times": times, "host_times": host_times, "data_times": data_times, "warmup": warmup, "samples": samples, "tokens": tokens,
            "attention_len_sq": attention_sq, "compiles": compiles_end - compiles_start,
            "compiles_timed": compiles_end - compiles_warm}


def summarize(raw: dict, device: torch.device, coefficients: tuple[float, float] | None) -> dict:
    timed = raw["step_times"][raw["warmup"]:]
    median = statistics.median(timed)
    seconds = sum(timed)
    row = {"samples_per_s": raw["samples"] / seconds, "tokens_per_s": raw["tokens"] / seconds,
           "step_ms_median": median * 1e3, "step_ms_p90": percentile(timed, 0.9) * 1e3,
           "host_ms_median": statistics.median(raw["host_times"][raw["warmup"]:]) * 1e3,
           "data_ms_median": statistics.median(raw["data_times"][raw["warmup"]:]) * 1e3,
           "compile_s": max(0.0, sum(raw["step_times"][:raw["warmup"]]) - raw["warmup"] * median),
           "first_loss": raw["losses"][0], "final_loss": raw["losses"][-1]}
    peak = peak_flops(device)
    if peak is not None and coefficients is not None:
        flops_per_token, attention_flops_per_len_sq = coefficients
        flops = flops_per_token * raw["tokens"] + attention_flops_per_len_sq * raw["attention_len_sq"]
        row["mfu"] = flops / seconds / peak
    return row


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for gpu, flops in PEAK_FLOPS.items() if gpu in name), None)


def dropout_spread(model: torch.nn.Module, batch: dict, device: torch.device) -> float:
    """Standard deviation of the first batch's loss over dropout masks alone (same weights, same data)."""
    model = copy.deepcopy(model).to(device).train()
    batch = to_device(batch, device)
    losses = []
    with torch.no_grad():
        for seed in range(DROPOUT_MASKS):
            torch.manual_seed(1000 + seed)
            losses.append(model(**batch).loss.item())
    return statistics.stdev(losses)


def restore_hooks() -> None:
    """Put torch's own LayerNorm, Dropout and Adam back: accelerate() leaves accel's hooks on (for the
    optimizer the user builds next), and the next mode must start from plain torch again."""
    from accel.runtime import hooks

    hooks.disable_fused_layer_norm()
    hooks.disable_philox_dropout()
    hooks.disable_onednn_linear()
    hooks.disable_fused_adam()


def cudagraph_skips() -> int:
    """Times Inductor has run a compiled graph without the CUDA graphs it was asked for (mode
    "reduce-overhead"); the step then pays a host launch per kernel. Why: cudagraph_skip_reasons()."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def cudagraph_skip_reasons(since: int = 0) -> list[str]:
    """The reasons Inductor gave for each skip (accel.compiler.cudagraph_skips listens from main()'s start,
    whatever TORCH_LOGS says), from the `since`-th on."""
    from accel.compiler import cudagraph_skips

    return cudagraph_skips.reasons()[since:]


def distinct(reasons: list[str]) -> list[str]:
    """Each reason once, in order, with how often it came when more than once."""
    counts = collections.Counter(reasons)
    return [r + (f" (x{counts[r]})" if counts[r] > 1 else "") for r in dict.fromkeys(reasons)]


def run_mode(mode: str, ctx: Context, args) -> dict:
    """One row: set the mode up, measure it, summarise; a Skip or an error becomes the row's status."""
    row = {"workload": ctx.workload.name, "mode": mode}
    release_memory()
    memory = PeakMemory(ctx.device)
    skips, heard = cudagraph_skips(), len(cudagraph_skip_reasons())
    try:
        run = setup(mode, ctx)
        # Seeded after the set-up, which may draw numbers (accel-kernels builds a model): every mode that
        # draws dropout masks with torch's dropout in eager code then gets the same masks.
        torch.manual_seed(args.seed)
        raw = measure(run, args.warmup, args.steps, f"{ctx.workload.name} {mode}", ctx.workload.tokens_per_sample)
    except Skip as reason:
        print(f"  {mode}: skipped: {reason}", flush=True)
        return {**row, "status": "skipped", "reason": str(reason)}
    except Exception as error:  # keep going: the other modes are still worth measuring
        traceback.print_exc()
        return {**row, "status": "failed", "reason": f"{type(error).__name__}: {error}"}
    finally:
        restore_hooks()
    stats = summarize(raw, run.device, flop_coefficients(ctx.initial_model))
    return {**row, "status": "ok", "device": str(run.device), "precision": run.precision,
            "same_data": not (run.packed or run.flattened), "cudagraph_skips": cudagraph_skips() - skips,
            "cudagraph_skip_reasons": distinct(cudagraph_skip_reasons(heard)),
            **peak_memory(memory, run.device), **stats, **raw}


def peak_memory(memory: PeakMemory, device: torch.device) -> dict:
    """The row's peak_mem_mb and how it was measured; None where the mode ran on another device than
    the one measured (XLA on its CPU client lives in host memory, so host RSS does cover it)."""
    method = memory.method
    if memory.cuda and device.type != "cuda":
        return {"peak_mem_mb": None, "memory_method": f"not measured on {device}"}
    if not memory.cuda and device.type != "cpu":
        method += f" (the process: {device} on its host client included)"
    return {"peak_mem_mb": memory.peak_bytes() / 2**20, "memory_method": method}


def flop_coefficients(model) -> tuple[float, float] | None:
    """(FLOPs per real token, FLOPs per unit of sample length^2) of one training step (see MFU above); None for
    a model that is not one stack of transformer layers over all its tokens (a convolutional one reuses each weight
    at every position; Swin's stages attend within windows, with per-stage widths and heads)."""
    cfg = model.config
    layers, hidden = getattr(cfg, "num_hidden_layers", None), getattr(cfg, "hidden_size", None)
    if not all(isinstance(v, int) for v in (layers, hidden, getattr(cfg, "num_attention_heads", None))):
        return None
    return 6.0 * matmul_params(model), 12.0 * layers * hidden


def add_speedups(rows: list[dict]) -> None:
    """Real-token throughput over the eager and the peer row of the same workload."""
    for base in ("eager", "peer"):
        ref = next((r for r in rows if r["mode"] == base and r["status"] == "ok"), None)
        for r in rows:
            if ref is not None and r["status"] == "ok":
                r[f"speedup_vs_{base}"] = r["tokens_per_s"] / ref["tokens_per_s"]


# -------------------------------------------------------------------------------------- loss check


def check_losses(rows: list[dict], first_tolerance: float) -> list[str]:
    """Problems with one workload's losses (empty: PASS). See 'Loss check' in the module docstring."""
    problems = [f"{r['mode']}: {r['reason']}" for r in rows if r["status"] == "failed"]
    ran = [r for r in rows if r["status"] == "ok"]
    if not ran:
        return problems
    ref = next((r for r in ran if r["mode"] == "eager"), ran[0])
    for r in ran:
        if not all(math.isfinite(x) for x in r["losses"]):
            problems.append(f"{r['mode']}: non-finite loss {r['losses']}")
            continue
        if r["same_data"] and abs(r["first_loss"] - ref["first_loss"]) > first_tolerance:
            problems.append(f"{r['mode']}: first loss {r['first_loss']:.4f} vs {ref['mode']} "
                            f"{ref['first_loss']:.4f} (tolerance {first_tolerance:.3g})")
        if abs(r["final_loss"] - ref["final_loss"]) > FINAL_LOSS_BAND:
            problems.append(f"{r['mode']}: final loss {r['final_loss']:.4f} vs {ref['mode']} "
                            f"{ref['final_loss']:.4f} (band {FINAL_LOSS_BAND})")
    return problems


# --------------------------------------------------------------------------------------------- output

TABLE = [("mode", "mode", ""), ("samples_per_s", "samples/s", ".1f"), ("tokens_per_s", "real tok/s", ".0f"),
         ("step_ms_median", "step ms", ".1f"), ("step_ms_p90", "p90 ms", ".1f"), ("host_ms_median", "host ms", ".1f"),
         ("data_ms_median", "data ms", ".2f"),
         ("compile_s", "compile s", ".1f"), ("compiles", "compiles", "d"), ("compiles_timed", "timed", "d"),
         ("cudagraph_skips", "graph skips", "d"), ("peak_mem_mb", "peak MB", ".0f"), ("mfu", "MFU", ".1%"),
         ("first_loss", "loss 1", ".4f"), ("final_loss", "loss N", ".4f"),
         ("speedup_vs_eager", "x eager", ".2f"), ("speedup_vs_peer", "x peer", ".2f"), ("status", "", "")]


def print_workload(name: str, rows: list[dict]) -> None:
    print(f"\n{name}")
    _report.print_table(rows, TABLE)
    for r in rows:
        if r["status"] != "ok":
            print(f"  {r['mode']} {r['status']}: {r['reason']}")
        else:
            print(f"  {r['mode']}: {r['precision']} on {r['device']}")
            for reason in r.get("cudagraph_skip_reasons", []):
                print(f"    graph skip: {reason}")


def plot(rows: list[dict], env: dict, name: str, directory: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(len(workloads), 2, figsize=(12, 3.2 * len(workloads)), squeeze=False)
    for (bars, curves), workload in zip(axes, workloads):
        ran = [r for r in rows if r["workload"] == workload and r["status"] == "ok"]
        bars.barh([r["mode"] for r in ran], [r["tokens_per_s"] for r in ran], color="tab:blue")
        bars.invert_yaxis()
        bars.set(xlabel="real tokens/s", title=workload)
        for r in ran:
            curves.plot(range(1, len(r["losses"]) + 1), r["losses"], marker="o", label=r["mode"])
        curves.set(xlabel="step", ylabel="loss", title=f"{workload}: training loss")
        if ran:
            curves.legend(fontsize=7)
    fig.suptitle(f"BERT-base training on {env['device']} ({env['date']})")
    fig.tight_layout()
    return _report.save_figure(fig, name, directory)


# ----------------------------------------------------------------------------------------------- main


def parse_sizes(text: str) -> tuple[tuple[int, int], ...]:
    try:
        sizes = tuple(tuple(int(x) for x in item.lower().split("x")) for item in text.split(",") if item.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BATCHxSEQ[,BATCHxSEQ...], got {text!r}") from None
    if not sizes or any(len(s) != 2 or min(s) < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"expected BATCHxSEQ[,BATCHxSEQ...] of positive ints, got {text!r}")
    return sizes


def parse_modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if split_mode(m)[0] not in MODES + EXTRA_MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {unknown}; choose from {', '.join(MODES + EXTRA_MODES)}")
    for mode in modes:
        try:
            accel_config(split_mode(mode)[1])
        except (ValueError, AttributeError) as error:
            raise argparse.ArgumentTypeError(f"mode {mode!r}: {error}") from None
    return modes


def split_mode(mode: str) -> tuple[str, dict[str, str]]:
    """'accel:compute.fuse_qkv=false+compute.kernels=false' -> ('accel', {'compute.fuse_qkv': 'false', ...}):
    a variant of the accel row with some Config fields set otherwise (an A/B within one run)."""
    base, _, rest = mode.partition(":")
    overrides = {}
    for item in filter(None, rest.split("+")):
        field, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"mode {mode!r}: expected FIELD=VALUE after ':', got {item!r}")
        overrides[field.strip()] = value.strip()
    if overrides and base not in CONFIGURABLE_MODES:
        raise argparse.ArgumentTypeError(f"mode {mode!r}: only {' and '.join(CONFIGURABLE_MODES)} take Config fields")
    return base, overrides


def accel_config(overrides: dict[str, str], config=None):
    """`config` (default: a new accel.Config) with the variant's fields set (true/false, ints, else strings); a
    name past a dict field is a key of that dict (compute.inductor_options.combo_kernels=true)."""
    import accel

    config = accel.Config() if config is None else config
    for field, text in overrides.items():
        section, _, name = field.rpartition(".")
        owner = config
        for part in filter(None, section.split(".")):
            owner = owner[part] if isinstance(owner, dict) else getattr(owner, part)
        lowered = text.lower()
        value = {"true": True, "false": False, "none": None}.get(lowered, int(text) if text.isdigit() else text)
        if isinstance(owner, dict):
            owner[name] = value
            continue
        if not hasattr(owner, name):
            raise AttributeError(f"accel.Config has no field {field!r}")
        setattr(owner, name, value)
    config.validate()
    return config


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=("fixed", "guide", "both"), help="default: both on CUDA, fixed on CPU")
    ap.add_argument("--modes", type=parse_modes, default=list(MODES), help=f"comma-separated, from {','.join(MODES + EXTRA_MODES)} (default: all but {','.join(EXTRA_MODES)})")
    ap.add_argument("--steps", type=int, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, help="steps before timing (compiles happen there)")
    ap.add_argument("--batch", type=int, help="batch of both workloads (overrides the defaults)")
    ap.add_argument("--seq", type=int, help="fixed workload's sequence length (default 128)")
    ap.add_argument("--fixed-sizes", type=parse_sizes, help="several fixed sizes, e.g. 32x128,256x128,64x512")
    ap.add_argument("--max-length", type=int, help="guide workload's max_seq_length (default 512)")
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=("cuda", "cpu"), help="device of the eager/peer/kernels modes")
    add_budget_argument(ap)
    ap.add_argument("--quick", action="store_true", help="tiny BERT, batch 4, seq 32, 2 steps (the test suite's)")
    ap.add_argument("--model", choices=MODELS, default="bert",
                    help="bert (BERT-base, cased) or distilbert (DistilBERT-base: 6 layers, no token types)")
    ap.add_argument("--out", help="result file name without extension (default <model>_base_<cpu|cuda>)")
    ap.add_argument("--results-dir", type=Path, default=_report.RESULTS)
    args = ap.parse_args(argv)
    apply_defaults(args)
    return args


def apply_defaults(args) -> None:
    """Fill what the command line left open from the device's (or --quick's) defaults."""
    args.device = torch.device(args.device or default_device().type)
    defaults = DEFAULTS["quick" if args.quick else args.device.type]
    args.workload = args.workload or defaults.workload
    args.warmup = defaults.warmup if args.warmup is None else args.warmup
    args.steps = args.steps or defaults.steps
    args.max_length = args.max_length or defaults.max_length
    args.guide_batch = args.batch or defaults.guide_batch
    if args.fixed_sizes is None:
        if args.batch is None and args.seq is None:
            args.fixed_sizes = defaults.fixed_sizes
        else:
            args.fixed_sizes = ((args.batch or defaults.fixed_sizes[0][0], args.seq or defaults.fixed_sizes[0][1]),)
    args.out = args.out or f"{args.model}_base_{args.device.type}"
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")


# Dynamo settings that importing torch_xla changes for the whole process (torch_xla/__init__.py).
# automatic_dynamic_shapes=False made the peer, run in the same process as the XLA modes, compile again for
# every padded length of the guide workload (6 graphs in 6 steps instead of 2): not what a user of
# torch.compile gets. The XLA modes run lazy tensors, not Dynamo, so torch's values are put back.
XLA_DYNAMO_SETTINGS = ("automatic_dynamic_shapes", "specialize_float")


def start_xla_if_needed(modes: list[str]) -> None:
    """Start the XLA runtime before any eager backward (torch's autograd engine sizes its per-device
    queues at the first backward; an XLA device that appears later has none), for the modes that run on
    XLA only: accel-xla, and accel where accelerate()'s backend 'auto' is xla (a TPU)."""
    from accel.accelerate import resolve_backend
    from accel.utils.xla import xla_available

    if not xla_available() or not ("accel-xla" in modes or (any(split_mode(m)[0] == "accel" for m in modes) and resolve_backend("auto") == "xla")):
        return
    import torch._dynamo

    saved = {name: getattr(torch._dynamo.config, name) for name in XLA_DYNAMO_SETTINGS}
    import accel.xla as xm

    xm.xla_device()
    for name, value in saved.items():
        setattr(torch._dynamo.config, name, value)


# The modes the targets compare (accel against the strongest peer): every workload's run first, so that a
# run on a time budget (--budget-s, a GPU session's one call) measures them before anything else.
HEADLINE_MODES = ("peer", "accel")


def run_order(n_workloads: int, modes: list[str]) -> list[tuple[int, str]]:
    """(workload index, mode) in the order the rows run: the headline modes of every workload, then the
    other modes of every workload. The table and the JSON list rows by workload and mode as requested."""
    pairs = [(w, m) for w in range(n_workloads) for m in modes]
    headline = [p for p in pairs if split_mode(p[1])[0] in HEADLINE_MODES]
    return headline + [p for p in pairs if p not in headline]


def add_budget_argument(ap: argparse.ArgumentParser) -> None:
    """--budget-s, for a run under a time limit (a GPU session's call): it ends with its table and files."""
    ap.add_argument("--budget-s", type=float, help="skip the rows that would start after this many seconds")


def run_or_skip(mode: str, ctx: Context, args, started: float) -> dict:
    """run_mode, or a skipped row where --budget-s seconds have passed since `started`."""
    budget = args.budget_s
    if budget is not None and time.perf_counter() - started > budget:
        return {"workload": ctx.workload.name, "mode": mode, "status": "skipped",
                "reason": f"time budget (--budget-s {budget:g}) spent"}
    return run_mode(mode, ctx, args)


def run_rows(workloads: list[Workload], initial_model, args, started: float,
             on_row: Callable[[list[dict]], object]) -> tuple[list[list[dict]], list[float]]:
    """Every requested mode on every workload, in run_order (on_row sees all rows so far after each one);
    returns each workload's rows in mode order and its first-loss tolerance."""
    contexts = [Context(initial_model, w, args.device, args.lr) for w in workloads]
    spreads = [dropout_spread(initial_model, next(iter(w.loader())), args.device) for w in workloads]
    done: dict[tuple[int, str], dict] = {}

    def in_table_order() -> list[list[dict]]:
        return [[done[(w, m)] for m in args.modes if (w, m) in done] for w in range(len(workloads))]

    for w, mode in run_order(len(workloads), args.modes):
        done[(w, mode)] = run_or_skip(mode, contexts[w], args, started)
        on_row([row for rows in in_table_order() for row in rows])
    tables = in_table_order()
    for rows in tables:
        add_speedups(rows)
    return tables, [max(FIRST_LOSS_TOL, DROPOUT_SIGMAS * spread) for spread in spreads]


class Results:
    """The JSON payload, rewritten after every row so that a run cut short keeps what it measured."""

    def __init__(self, args, env: dict, config):
        self.args = args
        self.payload = {**env, "args": vars(args),
                        "model": {k: getattr(config, k) for k in model_settings(args.quick, args.model)},
                        "rows": [], "loss_check": None}

    @property
    def rows(self) -> list[dict]:
        return self.payload["rows"]

    def save(self, rows: list[dict] | None = None) -> Path:
        if rows is not None:
            self.payload["rows"] = rows
        return _report.write_json(self.args.out, self.payload, self.args.results_dir)


@contextlib.contextmanager
def tf32_as_the_guide(device: torch.device):
    """TF32 matmuls on CUDA for every mode, as the guide sets them; put back afterwards (main() may run
    inside a test process)."""
    if device.type != "cuda":  # not even read elsewhere: torch 2.9 warns that this flag is deprecated
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def run_all(workloads: list[Workload], initial_model, args, results: Results) -> tuple[list[str], dict]:
    """Every workload's rows; returns the loss check's problems and the first-loss tolerance of each."""
    tables, tolerances = run_rows(workloads, initial_model, args, time.perf_counter(), on_row=results.save)
    results.save([row for rows in tables for row in rows])
    problems = []
    for workload, rows, tolerance in zip(workloads, tables, tolerances):
        problems += [f"{workload.name}: {p}" for p in check_losses(rows, tolerance)]
        print_workload(workload.name, rows)
    return problems, {w.name: t for w, t in zip(workloads, tolerances)}


def main(argv=None) -> int:
    args = parse_args(argv)
    start_xla_if_needed(args.modes)
    from accel.compiler import cudagraph_skips

    cudagraph_skips.watch()  # every mode's skips with their reasons, the peer's too
    env = _report.environment(str(args.device))
    # accelerate() makes glibc keep freed memory for models on the CPU, for the whole process; the rows share
    # one process, so every row gets it from the start and they compare the rest (its own gain:
    # benchmarks/host_memory.py)
    env["keep_freed_memory"] = torch.device(args.device).type == "cpu" and keep_freed_memory()
    config = bert_config(args.quick, args.model)
    workloads = build_workloads(args, config.vocab_size)
    name = "DistilBERT" if args.model == "distilbert" else "BERT"
    print(f"{name} {'quick (tiny)' if args.quick else 'base (cased config)'} on {env['device']}: "
          f"{', '.join(w.name for w in workloads)}; modes {','.join(args.modes)}; "
          f"{args.warmup} warm-up + {args.steps} timed steps", flush=True)
    results = Results(args, env, config)
    with tf32_as_the_guide(args.device):
        problems, tolerances = run_all(workloads, build_model(config, args.seed), args, results)

    verdict = "FAIL" if problems else "PASS"
    results.payload["loss_check"] = {"verdict": verdict, "problems": problems,
                                     "first_loss_tolerance": tolerances, "final_loss_band": FINAL_LOSS_BAND}
    path = results.save()
    print(f"\nloss check: {verdict}" + "".join(f"\n  {p}" for p in problems))
    print(f"wrote {path}" + write_plot(results.rows, env, args))
    return 1 if problems else 0


def write_plot(rows: list[dict], env: dict, args) -> str:
    """' and <png>', or why there is none (matplotlib is optional on the GPU machines)."""
    try:
        return f" and {plot(rows, env, args.out, args.results_dir)}"
    except ImportError as error:
        return f" (no PNG: {error})"


if __name__ == "__main__":
    sys.exit(main())
