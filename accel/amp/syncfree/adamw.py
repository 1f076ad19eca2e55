"""AdamW (decoupled weight decay) whose step can be skipped on the device without a host sync."""
from __future__ import annotations

from .adam import Adam


class AdamW(Adam):
    """torch.optim.AdamW's update rule; ``step(found_inf=t)`` skips the step where ``t != 0``."""

    _decoupled_weight_decay = True

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
    ):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize)
