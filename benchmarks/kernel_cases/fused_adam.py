"""Benchmark cases: one optimizer step over a BERT-base-like parameter list (~110M parameters),
FusedAdam/FusedAdamW against torch.optim's fused=True and foreach=True implementations.

Bytes moved by an ideal step: read param + grad + exp_avg + exp_avg_sq, write param + exp_avg +
exp_avg_sq. Our state is fp32 for every param dtype; torch.optim keeps its state in the param
dtype, so with bf16 params torch moves fewer bytes than our bytes_moved says (it is judged by the
same figure, which flatters it).
"""
from __future__ import annotations

import torch

from accel.runtime.optim import FusedAdam, FusedAdamW

from . import Case


def bert_like_shapes(hidden: int, layers: int, vocab: int, ffn: int | None = None, positions: int = 512):
    """Parameter shapes of a BERT encoder (embeddings, layers, pooler), biases and LayerNorms included."""
    ffn = ffn or 4 * hidden
    shapes = [(vocab, hidden), (positions, hidden), (2, hidden), (hidden,), (hidden,)]
    for _ in range(layers):
        for _ in range(4):  # q, k, v, attention output
            shapes += [(hidden, hidden), (hidden,)]
        shapes += [(hidden,), (hidden,)]  # LayerNorm
        shapes += [(ffn, hidden), (ffn,), (hidden, ffn), (hidden,), (hidden,), (hidden,)]
    shapes += [(hidden, hidden), (hidden,)]  # pooler
    return shapes


def _with_grads(shapes, device, dtype, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    params = []
    for s in shapes:
        p = torch.randn(s, device=device, dtype=dtype, generator=g).requires_grad_()
        p.grad = torch.randn(s, device=device, dtype=dtype, generator=g)
        params.append(p)
    return params


def _step(opt):
    def run():
        opt.step()
    return run


def cases(device: str, quick: bool) -> list[Case]:
    if quick:
        shapes, label = bert_like_shapes(hidden=256, layers=4, vocab=8192), "BERT-mini-like"
    else:
        shapes, label = bert_like_shapes(hidden=768, layers=12, vocab=30522), "BERT-base-like"
    numel = sum(torch.Size(s).numel() for s in shapes)
    dtypes = (torch.float32,) if quick else (torch.float32, torch.bfloat16)
    out = []
    for dtype in dtypes:
        state_bytes = 4  # fp32 state
        elem = torch.tensor([], dtype=dtype).element_size()
        bytes_moved = numel * (2 * elem + 2 * state_bytes) + numel * (elem + 2 * state_bytes)
        size = f"{label} {numel / 1e6:.1f}M {str(dtype).replace('torch.', '')}"
        for name, ours_cls, torch_cls in (("adam", FusedAdam, torch.optim.Adam),
                                          ("adamw", FusedAdamW, torch.optim.AdamW)):
            ours = ours_cls(_with_grads(shapes, device, dtype), lr=1e-4, weight_decay=0.01)
            peers = {
                f"torch {name} fused=True": _step(torch_cls(_with_grads(shapes, device, dtype), lr=1e-4,
                                                             weight_decay=0.01, fused=True)),
                f"torch {name} foreach=True": _step(torch_cls(_with_grads(shapes, device, dtype), lr=1e-4,
                                                               weight_decay=0.01, foreach=True)),
            }
            out.append(Case(f"fused_adam step ({name})", size, bytes_moved, _step(ours), peers))
    return out


def host_cases(device: str) -> list[Case]:
    """An AdamW step over as many tensors as BERT-base has parameters, 8 elements each, so
    the host's per-parameter work is all there is to time, against torch's fused and foreach steps."""
    shapes = [(8,)] * len(bert_like_shapes(hidden=768, layers=12, vocab=30522))
    ours = FusedAdamW(_with_grads(shapes, device, torch.float32), lr=1e-4, weight_decay=0.01)
    peers = {f"torch adamw {kind}=True": _step(torch.optim.AdamW(
        _with_grads(shapes, device, torch.float32), lr=1e-4, weight_decay=0.01, **{kind: True}))
        for kind in ("fused", "foreach")}
    return [Case("fused_adam step (adamw)", f"{len(shapes)} tensors x 8", 0, _step(ours), peers, False)]
