"""The same checks on CUDA tensors, against torch.optim and torch.amp.GradScaler("cuda")."""
from __future__ import annotations

import pytest
import torch

from accel.amp import GradScaler, autocast, syncfree

from ._sync_guard import ForbidHostReads
from .test_syncfree import CASE_IDS, CASES, _run

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("ours_cls,ref_cls,kwargs", CASES, ids=CASE_IDS)
def test_syncfree_matches_torch_optim_on_cuda(ours_cls, ref_cls, kwargs):
    ref, ours, ref_params, our_params = _run(ours_cls, ref_cls, kwargs, "cuda", dict(foreach=False))
    for r, o in zip(ref_params, our_params):
        assert o.is_cuda
        torch.testing.assert_close(o.cpu(), r, atol=1e-6, rtol=1e-5)


def _fp16_run(scaler, opt_cls, kwargs, steps=12, inf_steps=(0, 5)):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).cuda()
    opt = opt_cls(model.parameters(), **kwargs)
    g = torch.Generator().manual_seed(0)
    scales = []
    for step in range(steps):
        x, y = torch.randn(8, 16, generator=g).cuda(), torch.randn(8, 4, generator=g).cuda()
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        if step in inf_steps:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, [p.detach().cpu() for p in model.parameters()]


@needs_cuda
@pytest.mark.parametrize(
    "ours_cls,ref_cls,kwargs",
    [
        (syncfree.Adam, torch.optim.Adam, dict(lr=1e-3)),
        (syncfree.SGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9)),
        (torch.optim.AdamW, torch.optim.AdamW, dict(lr=1e-3, capturable=True)),
        (torch.optim.Adam, torch.optim.Adam, dict(lr=1e-3, fused=True)),
    ],
    ids=["syncfree.Adam", "syncfree.SGD", "torch.optim.AdamW-capturable", "torch.optim.Adam-fused"],
)
def test_grad_scaler_matches_torch_on_cuda_fp16(ours_cls, ref_cls, kwargs):
    kw = dict(init_scale=2.0**10, growth_interval=3)
    ref_scales, ref_params = _fp16_run(torch.amp.GradScaler("cuda", **kw), ref_cls, kwargs)
    scales, params = _fp16_run(GradScaler(**kw), ours_cls, kwargs)
    assert scales == ref_scales
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p, r, atol=1e-5, rtol=1e-5)


@needs_cuda
def test_cuda_steps_never_read_the_device():
    model = torch.nn.Linear(8, 8).cuda()
    opt = syncfree.AdamW(model.parameters())
    scaler = GradScaler("cuda")
    x = torch.randn(4, 8, device="cuda")
    with ForbidHostReads():
        for _ in range(3):
            opt.zero_grad()
            with autocast("cuda"):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert scaler.get_scale() == 2.0**16
