"""Benchmark cases: one optimizer step over a BERT-base-like parameter list (~110M parameters),
FusedAdam/FusedAdamW against torch.optim's fused=True and foreach=True implementations.

Bytes moved by an ideal step: read param + grad + exp_avg + exp_avg_sq, write param + exp_avg +
exp_avg_sq. Our state is fp32 by default for every param dtype; torch.optim keeps its state in the
param dtype, so with bf16 params torch moves fewer bytes (14 a param against 22). The "bf16 state"
rows compare like with like: FusedAdam(compact_state=True) keeps the state in the param dtype too.
"""
from __future__ import annotations

from typing import Iterator

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


def cases(device: str, quick: bool) -> Iterator[Case]:
    """One case at a time: each case's optimizers hold up to 1.8 GB of params, grads and state (four of
    them at once, 6 cases, would not fit the 24 GB of the development machines)."""
    if quick:
        shapes, label = bert_like_shapes(hidden=256, layers=4, vocab=8192), "BERT-mini-like"
    else:
        shapes, label = bert_like_shapes(hidden=768, layers=12, vocab=30522), "BERT-base-like"
    numel = sum(torch.Size(s).numel() for s in shapes)
    # (param dtype, compact_state): fp32 state for every dtype, then bf16 state beside torch's own
    layouts = [(torch.float32, False)] if quick else [(torch.float32, False), (torch.bfloat16, False),
                                                       (torch.bfloat16, True)]
    for dtype, compact in layouts:
        elem = torch.tensor([], dtype=dtype).element_size()
        state_bytes = elem if compact else 4
        bytes_moved = numel * (2 * elem + 2 * state_bytes) + numel * (elem + 2 * state_bytes)
        size = f"{label} {numel / 1e6:.1f}M {str(dtype).replace('torch.', '')}" + (" bf16 state" if compact else "")
        for name, ours_cls, torch_cls in (("adam", FusedAdam, torch.optim.Adam),
                                          ("adamw", FusedAdamW, torch.optim.AdamW)):
            ours = ours_cls(_with_grads(shapes, device, dtype), lr=1e-4, weight_decay=0.01, compact_state=compact)
            peers = {
                f"torch {name} fused=True": _step(torch_cls(_with_grads(shapes, device, dtype), lr=1e-4,
                                                             weight_decay=0.01, fused=True)),
                f"torch {name} foreach=True": _step(torch_cls(_with_grads(shapes, device, dtype), lr=1e-4,
                                                               weight_decay=0.01, foreach=True)),
            }
            yield Case(f"fused_adam step ({name})", size, bytes_moved, _step(ours), peers)
            del ours, peers  # before the next case's are built


def host_cases(device: str) -> list[Case]:
    """An AdamW step over as many tensors as BERT-base has parameters, 8 elements each, so
    the host's per-parameter work is all there is to time, against torch's fused and foreach steps."""
    shapes = [(8,)] * len(bert_like_shapes(hidden=768, layers=12, vocab=30522))
    ours = FusedAdamW(_with_grads(shapes, device, torch.float32), lr=1e-4, weight_decay=0.01)
    peers = {f"torch adamw {kind}=True": _step(torch.optim.AdamW(
        _with_grads(shapes, device, torch.float32), lr=1e-4, weight_decay=0.01, **{kind: True}))
        for kind in ("fused", "foreach")}
    return [Case("fused_adam step (adamw)", f"{len(shapes)} tensors x 8", 0, _step(ours), peers, False)]
