"""On XLA, steady-state AMP steps make no device-to-host transfer and compile nothing new.

Counters are read straight from torch_xla.debug.metrics: TransferFromDeviceTime samples
(every device-to-host copy), aten::_local_scalar_dense (.item(), bool(t), ...) and
CompileTime samples (graph compiles).
"""
from __future__ import annotations

import pytest
import torch

from accel.amp import GradScaler, autocast, syncfree

from ._xla import host_transfer_counts, requires_xla, sync, xla_device

WARMUP, MEASURED = 3, 4

OPTIMIZERS = {
    "syncfree.Adam": lambda params: syncfree.Adam(params, lr=1e-3, amsgrad=True),
    "syncfree.SGD": lambda params: syncfree.SGD(params, lr=1e-2, momentum=0.9, nesterov=True),
    # a plain optimizer: its steps are kept or dropped by the device-side select
    "torch.optim.SGD": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
}


@requires_xla
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_steady_state_amp_steps_do_not_transfer_to_host(name):
    device = xla_device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).to(device)
    opt = OPTIMIZERS[name](model.parameters())
    scaler = GradScaler(init_scale=2.0**8, growth_interval=2)  # grows during the measured steps
    x = torch.randn(4, 8).to(device)
    y = torch.randn(4, 4).to(device)

    def train_step():
        opt.zero_grad()
        with autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        sync()

    for _ in range(WARMUP):
        train_step()
    weights_before = [p.detach().clone() for p in model.parameters()]  # on the device: no transfer
    sync()  # materialise the copies outside the measured graphs
    before = host_transfer_counts()
    for _ in range(MEASURED):
        train_step()
    after = host_transfer_counts()
    assert after == before
    # The steps did run on the device: the weights moved and the scale grew twice (read once, at the end).
    assert scaler.get_scale() == 2.0**8 * 2 ** ((WARMUP + MEASURED) // 2)
    assert all(not torch.equal(p.cpu(), b.cpu()) for p, b in zip(model.parameters(), weights_before))
    assert host_transfer_counts()["TransferFromDeviceTime"] > after["TransferFromDeviceTime"]
