"""SGD (momentum, Nesterov) whose step can be skipped on the device without a host sync."""
from __future__ import annotations

import torch

from accel.utils import checks

from . import _functional
from ._common import SyncFreeOptimizer, device_step, params_with_grads


class SGD(SyncFreeOptimizer):
    """torch.optim.SGD's update rule; ``step(found_inf=t)`` skips the step where ``t != 0``.

    With momentum, state holds ``momentum_buffer`` and ``step`` (applied steps, a device
    tensor): torch.optim.SGD's "buffer = grad on the first step" is selected on the device
    from ``step == 0`` instead of from the buffer's absence on the host.
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
    ):
        defaults = dict(
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
            maximize=maximize,
        )
        super().__init__(params, defaults)

    @staticmethod
    def _check_hyperparameters(group: dict) -> None:
        # Stricter than torch.optim.SGD, which takes lr=nan, momentum=nan and any dampening:
        # dampening scales the gradient by (1 - dampening), so outside [0, 1] it flips or
        # amplifies it.
        checks.check_float_or_tensor("lr", group["lr"], min=0.0)
        momentum = checks.check_float("momentum", group["momentum"], min=0.0)
        dampening = checks.check_float("dampening", group["dampening"], min=0.0, max=1.0)
        checks.check_float("weight_decay", group["weight_decay"], min=0.0)
        if checks.check_bool("nesterov", group["nesterov"]) and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov: Nesterov momentum requires momentum > 0 and dampening == 0")
        checks.check_bool("maximize", group["maximize"])

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)
            group.setdefault("maximize", False)

    def _init_group(self, group, params, grads, bufs, steps):
        for p in params_with_grads(group, "SGD"):
            params.append(p)
            grads.append(p.grad)
            if group["momentum"] == 0:
                bufs.append(None)
                steps.append(None)
                continue
            state = self.state[p]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            elif "step" not in state:
                # A torch.optim.SGD state dict: its buffer exists only after a first step.
                state["step"] = torch.ones((), dtype=torch.float32, device=p.device)
            bufs.append(state["momentum_buffer"])
            steps.append(device_step(state, p))

    def _step_group(self, group, found_inf):
        params, grads, bufs, steps = [], [], [], []
        self._init_group(group, params, grads, bufs, steps)
        _functional.sgd(
            params,
            grads,
            bufs,
            steps,
            found_inf,
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            lr=group["lr"],
            dampening=group["dampening"],
            nesterov=group["nesterov"],
            maximize=group["maximize"],
        )
