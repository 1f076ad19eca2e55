"""varlen_attention (each packed sample's attention alone, CPU) against SDPA over the whole row with the
block-diagonal document mask, eager and compiled: what a packed model's layer computes either way, forward +
backward, bf16.
- causal LM rows (benchmarks/causal_lm.py): rows of 1024 and 2048 tokens holding samples of lognormal lengths
  (median ~180), causal, no dropout;
- BERT guide rows (benchmarks/bert_base.py's guide workload): rows of 512 holding SST-2-like sentences (90%
  around 20 tokens, a 10% tail around 160), bidirectional, 12 heads (a BERT without attention dropout: with it,
  ACCEL_SDPA keeps the mask and computes the attention in plain ops).
Peers: SDPA with the document mask, eager and compiled, and the plain attention of transformers' eager
implementation compiled (Inductor fuses the mask and the softmax between two batched products). Measured on a
2-core Zen 5 (bf16): ours 1.3x the best peer on the 1024-token causal rows, 4x on the 2048-token ones; on the
BERT guide rows the compiled plain attention is ahead (0.7-0.85x): rows of 512 often hold one or two long
samples, so little work is skipped, and torch's bf16 flash kernel costs ~0.35 ms a call whatever the sample's
size. In the model the alternative is SDPA with the mask (ACCEL_SDPA), which ours beats there.
Ours computes each sample the way accelerate()'s compute.cpu_attention="auto" picks on this machine (plain
products where the probe finds them faster than SDPA's flash kernel, else the flash kernel); the other way is a
row of its own among the peers, the A/B of that choice.
On CUDA (compute.cuda_packed_attention="varlen") ours is torch's FlashAttention varlen kernel over static offsets
(flash_varlen_attention, torch 2.10+), against SDPA with the document mask (eager and compiled, what "mask" runs)
and FlexAttention with the document's BlockMask (compiled, what "flex" runs), on the same rows (bf16; the causal
LM rows with Llama's 32 heads of 128 over 8 key/value heads)."""
import math

import torch
import torch.nn.functional as F

from accel.compiler.unpadded_attention import MIN_PLAIN_SPEEDUP, plain_attention_speedup
from accel.data.packing import static_cu_seqlens
from accel.runtime.nn.varlen_attention import (
    flash_varlen_attention,
    flash_varlen_runs_on,
    segment_runs,
    varlen_attention,
)

from . import Case


def _lognormal(median: float, sigma: float, g: torch.Generator) -> float:
    return math.exp(math.log(median) + sigma * torch.randn((), generator=g).item())


def _causal_lm_length(g: torch.Generator) -> int:
    return max(int(_lognormal(180, 0.8, g)), 16)


def _sst2_length(g: torch.Generator) -> int:
    """bert_base.sst2_like_lengths' mix, drawn one at a time."""
    tail = torch.rand((), generator=g).item() < 0.10
    return max(round(_lognormal(160, 0.7, g) if tail else _lognormal(20, 0.6, g)), 4)


def _segments(rows: int, length: int, draw, seed: int = 0) -> torch.Tensor:
    """[rows, length] segment ids 1, 2, ... of lengths draw(g), packed in order (the last one cut to fit)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(rows, length, dtype=torch.long)
    for r in range(rows):
        pos, seg = 0, 1
        while pos < length:
            n = min(draw(g), length - pos)
            out[r, pos:pos + n] = seg
            pos, seg = pos + n, seg + 1
    return out


def _case(name: str, rows: int, heads: int, length: int, dim: int, draw, causal: bool) -> Case:
    segments = _segments(rows, length, draw)
    mask = segments[:, None, :, None] == segments[:, None, None, :]
    if causal:
        mask = mask & torch.ones(length, length, dtype=torch.bool).tril()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(rows, heads, length, dim, generator=g).bfloat16().requires_grad_() for _ in range(3))
    grad = torch.randn(rows, heads, length, dim, generator=g).bfloat16()

    def masked(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def eager_attention(q, k, v):  # transformers' eager attention
        scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        probs = scores.masked_fill(~mask, torch.finfo(scores.dtype).min).softmax(-1, dtype=torch.float32)
        return torch.matmul(probs.to(q.dtype), v)

    plain = plain_attention_speedup(torch.bfloat16) >= MIN_PLAIN_SPEEDUP

    def ours(q, k, v, plain=plain):
        return varlen_attention(q, k, v, segments, is_causal=causal, plain=plain)

    def step(fn):
        return torch.autograd.grad(fn(q, k, v), (q, k, v), grad)

    compiled, compiled_plain = torch.compile(masked, dynamic=False), torch.compile(eager_attention, dynamic=False)
    nbytes = 2 * rows * heads * length * dim * 8  # q, k, v, out read/written, their gradients
    samples = int(segments.max(1).values.sum())
    label = f"{rows}x{heads}x{length}x{dim}, {samples} samples"
    way = "plain" if plain else "flash"
    return Case(f"varlen_attention bf16 {name} fwd+bwd ({way})", label, nbytes, lambda: step(ours),
                {"SDPA + document mask": lambda: step(masked),
                 "compiled SDPA + document mask": lambda: step(compiled),
                 "compiled plain attention + document mask": lambda: step(compiled_plain),
                 f"varlen_attention, {'flash kernel' if plain else 'plain products'}":
                     lambda: step(lambda q, k, v: ours(q, k, v, plain=not plain))},
                memory_bound=False)


def _seq_lens(segments: torch.Tensor) -> torch.Tensor:
    """[B, S] sample lengths (0-padded) of rows whose segments start at 1 and run to the end (no padding tail)."""
    lengths = [[end - start for start, end in runs] for runs in segment_runs(segments)]
    width = max(len(row) for row in lengths)
    return torch.tensor([row + [0] * (width - len(row)) for row in lengths], dtype=torch.int32)


def _cuda_case(name: str, rows: int, heads: int, kv_heads: int, length: int, dim: int, draw, causal: bool,
               device: str = "cuda") -> Case:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    segments = _segments(rows, length, draw).to(device)
    cu = static_cu_seqlens(_seq_lens(segments.cpu()).to(device), length)
    mask = segments[:, None, :, None] == segments[:, None, None, :]
    if causal:
        mask = mask & torch.ones(length, length, dtype=torch.bool, device=device).tril()

    def document(b, h, q_idx, kv_idx):
        same = segments[b, q_idx] == segments[b, kv_idx]
        return same & (q_idx >= kv_idx) if causal else same

    block_mask = create_block_mask(document, rows, None, length, length, device=device)
    g = torch.Generator(device=device).manual_seed(1)

    def randn(h):
        return torch.randn(rows, h, length, dim, generator=g, device=device).bfloat16().requires_grad_()

    q, k, v = randn(heads), randn(kv_heads), randn(kv_heads)
    grad = torch.randn(rows, heads, length, dim, generator=g, device=device).bfloat16()
    gqa = dict(enable_gqa=True) if kv_heads != heads else {}

    def masked(q, k, v):  # with a mask transformers repeats the key/value heads for SDPA (its repeat_kv)
        groups = heads // kv_heads
        return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                              attn_mask=mask)

    def flex(q, k, v):
        return flex_attention(q, k, v, block_mask=block_mask, **gqa)

    def ours(q, k, v):
        return flash_varlen_attention(q, k, v, cu, is_causal=causal)

    def step(fn):
        return torch.autograd.grad(fn(q, k, v), (q, k, v), grad)

    compiled, compiled_flex = torch.compile(masked, dynamic=False), torch.compile(flex, dynamic=False)
    nbytes = 2 * rows * (2 * heads + 2 * kv_heads) * length * dim * 2  # q, out, k, v and their gradients, bf16
    samples = int(segments.max(1).values.sum())
    return Case(f"varlen_attention bf16 {name} fwd+bwd (FlashAttention varlen)",
                f"{rows}x{heads}/{kv_heads}x{length}x{dim}, {samples} samples", nbytes, lambda: step(ours),
                {"SDPA + document mask": lambda: step(masked),
                 "compiled SDPA + document mask": lambda: step(compiled),
                 "compiled FlexAttention + document BlockMask": lambda: step(compiled_flex)},
                memory_bound=False)


def cases(device: str, quick: bool):
    if device == "cuda":
        if not flash_varlen_runs_on(torch.device("cuda")):
            return  # torch before 2.10, or a GPU before compute capability 8.0
        sizes = ((1, 4, 2, 256, 64),) if quick else ((8, 32, 8, 1024, 128), (4, 32, 8, 4096, 128))
        for rows, heads, kv_heads, length, dim in sizes:
            yield _cuda_case("causal", rows, heads, kv_heads, length, dim, _causal_lm_length, True)
        rows, length = (1, 128) if quick else (32, 512)
        yield _cuda_case("bidirectional", rows, 12, 12, length, 64, _sst2_length, False)
        return
    if device != "cpu":
        return
    if quick:
        yield _case("causal", 1, 2, 128, 16, _causal_lm_length, True)
        yield _case("bidirectional", 1, 2, 128, 16, _sst2_length, False)
        return
    for rows, heads, length in ((2, 8, 1024), (4, 16, 2048)):
        yield _case("causal", rows, heads, length, 64, _causal_lm_length, True)
    yield _case("bidirectional", 4, 12, 512, 64, _sst2_length, False)
