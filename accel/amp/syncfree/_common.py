"""Argument checks and state plumbing shared by the sync-free optimizers."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def check_lr(lr) -> None:
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"lr: expected a float or a 1-element tensor, got a tensor of shape {tuple(lr.shape)}")
        return
    if not isinstance(lr, (int, float)) or lr < 0.0:
        raise ValueError(f"lr: expected a non-negative float, got {lr!r}")


def check_non_negative(name: str, value) -> None:
    if not isinstance(value, (int, float)) or value < 0.0:
        raise ValueError(f"{name}: expected a non-negative float, got {value!r}")


def check_found_inf(found_inf: Optional[Tensor]) -> None:
    if found_inf is None:
        return
    if not isinstance(found_inf, Tensor) or found_inf.numel() != 1:
        raise ValueError(
            f"found_inf: expected None or a 1-element tensor (non-zero means skip the step), got {found_inf!r}"
        )


def device_step(state: dict, param: Tensor, key: str = "step") -> Tensor:
    """state[key] as a float32 device tensor on param's device.

    Optimizer.load_state_dict leaves 'step' where it was saved (torch.optim keeps it on the
    CPU); the step count has to live beside the parameter for the skip select, so it is
    moved once here.
    """
    step = state[key]
    if not isinstance(step, Tensor):
        step = torch.tensor(float(step))
    if step.device != param.device or step.dtype != torch.float32:
        step = step.to(device=param.device, dtype=torch.float32)
        state[key] = step
    return step


def params_with_grads(group: dict, what: str) -> list[Tensor]:
    out = []
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise RuntimeError(f"{what} does not support sparse gradients")
        out.append(p)
    return out


class SyncFreeOptimizer(torch.optim.Optimizer):
    """Base of the sync-free optimizers: ``step(closure=None, found_inf=None)`` runs the closure,
    then ``_step_group(group, found_inf)`` for each group; where ``found_inf`` is a non-zero
    tensor, parameters and state stay as they were."""

    # accel.amp.GradScaler passes its on-device overflow flag to optimizers that say this.
    _step_supports_found_inf = True

    @torch.no_grad()
    def step(self, closure=None, found_inf: Optional[Tensor] = None):
        check_found_inf(found_inf)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group, found_inf)
        return loss
