"""Update rules of the sync-free optimizers, written so a skipped step costs no host sync.

Every update is computed out of place and committed with ``torch.where(skip, old, new)``:
the decision to skip stays a device tensor, so the host never waits for the device to
find out whether gradients overflowed. A select (not ``old + mask * delta``) is used
because a skipped step usually carries inf/NaN gradients and ``NaN * 0`` is NaN.

The formulas follow torch.optim's single-tensor implementations operation by operation,
so with ``skip=None`` (or a zero found_inf) results match torch.optim to float rounding.
``adam`` is also accel.runtime.optim.FusedAdam's path on devices without its kernels (XLA),
and ``skip_mask`` is GradScaler's select for optimizers that cannot take found_inf.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

Number = Union[float, int]


def skip_mask(found_inf: Optional[Tensor], device: torch.device, cache: dict) -> Optional[Tensor]:
    """0-d bool on ``device``: True when found_inf is non-zero (inf/NaN seen, or summed over replicas).

    ``cache`` (a dict the caller keeps for one step) holds one mask per device, so tensors on
    the same device share a single copy and comparison.
    """
    if found_inf is None:
        return None
    key = str(device)
    if key not in cache:
        # .to() of an on-device tensor is free; across devices it is an async copy, not a sync.
        cache[key] = found_inf.to(device=device, non_blocking=True) != 0
    return cache[key]


def _commit(dst: Tensor, new: Tensor, skip: Optional[Tensor]) -> None:
    dst.copy_(new if skip is None else torch.where(skip, dst, new))


def _bias_correction_dtype(device: torch.device) -> torch.dtype:
    # torch.optim computes bias corrections in Python doubles; float64 on the device gets
    # closest to that. XLA devices (TPU) emulate float64 slowly, so they use float32.
    return torch.float32 if device.type == "xla" else torch.float64


def _count_step(step_t: Tensor, skip: Optional[Tensor]) -> None:
    if skip is None:
        step_t.add_(1)
    else:
        step_t.add_(torch.logical_not(skip).to(step_t.dtype))


@torch.no_grad()
def adam(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    state_steps: list[Tensor],
    found_inf: Optional[Tensor] = None,
    *,
    amsgrad: bool,
    beta1: float,
    beta2: float,
    lr: Union[Number, Tensor],
    weight_decay: float,
    eps: float,
    maximize: bool,
    decoupled_weight_decay: bool,
    grad_scale: Optional[Tensor] = None,
) -> None:
    """Adam / AdamW (``decoupled_weight_decay=True``) on any device, in place, skipped where found_inf != 0.

    The update is computed in the dtype of the optimizer state (``exp_avgs[i]``): with state of
    the parameter's dtype (accel.amp.syncfree) that is the parameter's dtype, as in torch.optim;
    with fp32 state for an fp16/bf16 parameter (accel.runtime.optim.FusedAdam's layout) the
    parameter and gradient are widened, updated in fp32 and rounded once on store.
    ``grad_scale`` (a one-element tensor) divides the gradients first, for callers that fold
    GradScaler's unscale into the step. ``state_steps`` are float32 tensors beside the params,
    counted on the device (a skipped step does not count).
    """
    masks: dict = {}
    for i, param in enumerate(params):
        skip = skip_mask(found_inf, param.device, masks)
        exp_avg, exp_avg_sq, step_t = exp_avgs[i], exp_avg_sqs[i], state_steps[i]
        max_exp_avg_sq = max_exp_avg_sqs[i] if amsgrad else None
        compute_dtype = exp_avg.dtype
        grad = grads[i] if grads[i].dtype == compute_dtype else grads[i].to(compute_dtype)
        if grad_scale is not None:
            grad = grad / grad_scale.to(device=grad.device, dtype=compute_dtype, non_blocking=True)
        if maximize:
            grad = -grad
        # Every new value below is computed out of place, so a widened copy of the parameter
        # is all the update needs; the result is rounded to param's dtype once, by _commit.
        work = param if param.dtype == compute_dtype else param.to(compute_dtype)
        if torch.is_complex(param):
            # As torch.optim: real and imaginary parts are separate coordinates (so the second
            # moment is re^2 and im^2, not grad*grad). Writes through the views land in place.
            param, work, grad = torch.view_as_real(param), torch.view_as_real(work), torch.view_as_real(grad)
            exp_avg, exp_avg_sq = torch.view_as_real(exp_avg), torch.view_as_real(exp_avg_sq)
            if amsgrad:
                max_exp_avg_sq = torch.view_as_real(max_exp_avg_sq)

        _count_step(step_t, skip)

        new_param = work
        if weight_decay != 0:
            if decoupled_weight_decay:
                new_param = work.mul(1 - lr * weight_decay)
            else:
                grad = grad.add(work, alpha=weight_decay)

        new_exp_avg = exp_avg.lerp(grad, 1 - beta1)
        new_exp_avg_sq = exp_avg_sq.mul(beta2).addcmul_(grad, grad, value=1 - beta2)

        step = step_t.to(_bias_correction_dtype(param.device))
        bias_correction1 = 1 - torch.pow(beta1, step)
        bias_correction2 = 1 - torch.pow(beta2, step)
        # Scalars stay at least float32: bf16/fp16 would round the step size to 3 digits.
        scalar_dtype = torch.promote_types(work.dtype, torch.float32)
        neg_step_size = (-lr / bias_correction1).to(scalar_dtype)
        bias_correction2_sqrt = bias_correction2.sqrt().to(scalar_dtype)

        if amsgrad:
            new_max = torch.maximum(max_exp_avg_sq, new_exp_avg_sq)
            denom = (new_max.sqrt() / bias_correction2_sqrt).add_(eps)
            _commit(max_exp_avg_sq, new_max, skip)
        else:
            denom = (new_exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)

        # param + value * (exp_avg / denom): torch.optim's addcdiv_ with a tensor-valued step size.
        new_param = torch.addcmul(new_param, new_exp_avg / denom, neg_step_size)

        _commit(exp_avg, new_exp_avg, skip)
        _commit(exp_avg_sq, new_exp_avg_sq, skip)
        _commit(param, new_param, skip)


@torch.no_grad()
def sgd(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Optional[Tensor]],
    state_steps: list[Optional[Tensor]],
    found_inf: Optional[Tensor],
    *,
    weight_decay: float,
    momentum: float,
    lr: Union[Number, Tensor],
    dampening: float,
    nesterov: bool,
    maximize: bool,
) -> None:
    """SGD with momentum, skipped where found_inf != 0.

    torch.optim.SGD sets ``buf = grad`` on the first step and ``buf = momentum*buf +
    (1-dampening)*grad`` afterwards. Deciding "first" on the host would need the skip
    decision, so the buffer is allocated up front and ``state_steps`` (applied steps, on
    the device) selects between the two formulas.
    """
    masks: dict = {}
    for i, param in enumerate(params):
        skip = skip_mask(found_inf, param.device, masks)
        grad = grads[i] if not maximize else -grads[i]

        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)

        if momentum != 0:
            buf, step_t = momentum_buffers[i], state_steps[i]
            running = buf.mul(momentum).add_(grad, alpha=1 - dampening)
            new_buf = torch.where(step_t == 0, grad, running)
            _count_step(step_t, skip)
            grad = grad.add(new_buf, alpha=momentum) if nesterov else new_buf
            _commit(buf, new_buf, skip)

        if isinstance(lr, Tensor):
            new_param = param.addcmul(grad, lr, value=-1)
        else:
            new_param = param.add(grad, alpha=-lr)
        _commit(param, new_param, skip)
