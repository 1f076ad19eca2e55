"""Adam whose step can be skipped on the device (found_inf) without a host sync."""
from __future__ import annotations

import torch

from accel.utils import checks

from . import _functional
from ._common import SyncFreeOptimizer, device_step, params_with_grads


class Adam(SyncFreeOptimizer):
    """torch.optim.Adam's update rule; ``step(found_inf=t)`` skips the step where ``t != 0``.

    Works on XLA, CUDA and CPU tensors. ``state["step"]`` is a float32 tensor on the
    parameter's device, so counting a step (or not) never leaves the device.
    """

    _decoupled_weight_decay = False

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
    ):
        betas = tuple(betas) if isinstance(betas, list) else betas
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize
        )
        super().__init__(params, defaults)

    @staticmethod
    def _check_hyperparameters(group: dict) -> None:
        # As torch.optim.Adam, plus: NaN/inf and bools-as-numbers refused, flags must be bools.
        checks.check_float_or_tensor("lr", group["lr"], min=0.0)
        for i, beta in enumerate(checks.check_sequence("betas", group["betas"], 2)):
            checks.check_float(f"betas[{i}]", beta, min=0.0, max=1.0, max_inclusive=False)
        checks.check_float("eps", group["eps"], min=0.0)
        checks.check_float("weight_decay", group["weight_decay"], min=0.0)
        checks.check_bool("amsgrad", group["amsgrad"])
        checks.check_bool("maximize", group["maximize"])

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)

    def _init_group(self, group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps):
        for p in params_with_grads(group, type(self).__name__):
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["amsgrad"] and "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            if group["amsgrad"]:
                max_exp_avg_sqs.append(state["max_exp_avg_sq"])
            steps.append(device_step(state, p))

    def _step_group(self, group, found_inf):
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
        self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
        beta1, beta2 = group["betas"]
        _functional.adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            steps,
            found_inf,
            amsgrad=group["amsgrad"],
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            decoupled_weight_decay=self._decoupled_weight_decay,
        )
