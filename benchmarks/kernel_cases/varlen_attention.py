"""varlen_attention (each packed sample's attention alone, CPU) against SDPA over the whole row with the
block-diagonal causal document mask, eager and compiled: what a packed causal LM's layer computes either way.
Rows of 1024 tokens holding samples of the causal_lm benchmark's lengths (lognormal, median ~180), bf16,
forward + backward. CPU only: on CUDA packed rows keep the mask or FlexAttention's block mask."""
import math

import torch
import torch.nn.functional as F

from accel.runtime.nn.varlen_attention import varlen_attention

from . import Case


def _segments(rows: int, length: int, seed: int = 0) -> torch.Tensor:
    """[rows, length] segment ids 1, 2, ... of lognormal sample lengths (median 180, sigma 0.8), packed in order."""
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(rows, length, dtype=torch.long)
    for r in range(rows):
        pos, seg = 0, 1
        while pos < length:
            n = int(math.exp(math.log(180) + 0.8 * torch.randn((), generator=g).item()))
            n = min(max(n, 16), length - pos)
            out[r, pos:pos + n] = seg
            pos, seg = pos + n, seg + 1
    return out


def cases(device: str, quick: bool):
    if device != "cpu":
        return
    for rows, heads, length, dim in ((1, 2, 128, 16),) if quick else ((2, 8, 1024, 64), (4, 16, 2048, 64)):
        segments = _segments(rows, length)
        mask = (segments[:, None, :, None] == segments[:, None, None, :]) & torch.ones(
            length, length, dtype=torch.bool).tril()
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(rows, heads, length, dim, generator=g).bfloat16().requires_grad_() for _ in range(3))
        grad = torch.randn(rows, heads, length, dim, generator=g).bfloat16()

        def masked(q, k, v, mask=mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        def step(fn, q=q, k=k, v=v, grad=grad):
            return torch.autograd.grad(fn(q, k, v), (q, k, v), grad)

        ours = lambda q, k, v, segments=segments: varlen_attention(q, k, v, segments, is_causal=True)  # noqa: E731
        compiled = torch.compile(masked, dynamic=False)
        nbytes = 2 * rows * heads * length * dim * 8  # q, k, v, out read/written, their gradients
        yield Case("varlen_attention bf16 causal fwd+bwd", f"{rows}x{heads}x{length}x{dim}", nbytes,
                   lambda step=step, ours=ours: step(ours),
                   {"SDPA + document mask": lambda step=step, masked=masked: step(masked),
                    "compiled SDPA + document mask": lambda step=step, compiled=compiled: step(compiled)},
                   memory_bound=False)
