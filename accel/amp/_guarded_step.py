"""Run a plain optimizer's step so that it takes effect only where found_inf == 0.

For optimizers that cannot take found_inf themselves, GradScaler snapshots the parameters
and their tensor state, runs step() unconditionally, then selects old or new on the
device with torch.where, so a skipped step leaves weights and state bit-for-bit unchanged
(including state["step"]) and no host sync is needed.

The select cannot express "this state did not exist yet" or restore Python-number state,
so while any stepped parameter has no state yet, or has non-tensor state, the decision is
read on the host once (as torch.amp.GradScaler always does). With torch.optim optimizers
that means only the first applied step syncs. State tensors kept on another device than
found_inf (torch.optim.Adam's CPU "step" when params are on XLA/CUDA; use capturable=True
to keep it on the device) need found_inf copied there, which waits for the device.
The snapshot costs one copy of the parameters and their state: accel.amp.syncfree
optimizers avoid it.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .syncfree._functional import skip_mask

_MISSING = object()


def _stepped_params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def _select_is_exact(optimizer: torch.optim.Optimizer, params: list[Tensor]) -> bool:
    for p in params:
        state = optimizer.state.get(p)
        if not state:
            return False
        if any(v is not None and not isinstance(v, Tensor) for v in state.values()):
            return False
    return True


def guarded_step(optimizer: torch.optim.Optimizer, found_inf: Tensor, *args: Any, **kwargs: Any):
    params = _stepped_params(optimizer)
    if not _select_is_exact(optimizer, params):
        if found_inf.item() == 0:
            return optimizer.step(*args, **kwargs)
        return None

    with torch.no_grad():
        old_params = [p.detach().clone() for p in params]
        old_state = [
            {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in optimizer.state[p].items()}
            for p in params
        ]
    retval = optimizer.step(*args, **kwargs)

    skips: dict = {}
    with torch.no_grad():
        for p, old in zip(params, old_params):
            p.copy_(torch.where(skip_mask(found_inf, p.device, skips), old, p))
        irregular = []  # entries the step replaced, added or retyped: no select can undo those
        for p, olds in zip(params, old_state):
            state = optimizer.state[p]
            for key in list(olds) + [k for k in state if k not in olds]:
                old, new = olds.get(key, _MISSING), state.get(key, _MISSING)
                if (
                    isinstance(old, Tensor)
                    and isinstance(new, Tensor)
                    and (new.shape, new.dtype, new.device) == (old.shape, old.dtype, old.device)
                ):
                    new.copy_(torch.where(skip_mask(found_inf, new.device, skips), old, new))
                elif old is not new:
                    irregular.append((state, key, old))
        if irregular and found_inf.item() != 0:
            for state, key, old in irregular:
                if old is _MISSING:
                    state.pop(key, None)
                else:
                    state[key] = old
    return retval
