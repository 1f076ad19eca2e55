"""State plumbing and the step() shared by the sync-free optimizers."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from accel.utils import checks


def check_found_inf(found_inf: Optional[Tensor]) -> None:
    if found_inf is not None:
        checks.check_one_element_tensor("found_inf", found_inf)


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
    tensor, parameters and state stay as they were.

    Subclasses define ``_check_hyperparameters(group)``; it runs on the constructor's defaults
    and on every param group, including groups with their own values and add_param_group's.
    """

    # accel.amp.GradScaler passes its on-device overflow flag to optimizers that say this.
    _step_supports_found_inf = True

    def __init__(self, params, defaults: dict):
        # Before the base class runs, so a bad hyper-parameter is reported even when params is
        # also wrong (e.g. an empty list), and nothing is half-built.
        self._check_hyperparameters(defaults)
        super().__init__(params, defaults)

    @staticmethod
    def _check_hyperparameters(group: dict) -> None:
        raise NotImplementedError

    def add_param_group(self, param_group: dict) -> None:
        # torch.optim checks only the constructor's arguments: a group's own lr=nan would get
        # through and make its weights NaN on the first step.
        if isinstance(param_group, dict):
            self._check_hyperparameters({**self.defaults, **param_group})
        super().add_param_group(param_group)

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
