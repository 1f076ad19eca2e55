"""The dynamic loss-scale update, on the device.

Rule (torch.amp.GradScaler's): if found_inf != 0 the scale is multiplied by backoff_factor
and the growth tracker resets; otherwise the tracker counts one more clean step, and when
it reaches growth_interval the scale is multiplied by growth_factor (kept only if finite)
and the tracker resets.
"""
from __future__ import annotations

import torch
from torch import Tensor


def update_scale_where(
    scale: Tensor,
    growth_tracker: Tensor,
    found_inf: Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> None:
    """The rule as device selects: for backends without torch._amp_update_scale_ (or, on XLA,
    to keep it as plain traced arithmetic that fuses into the step's graph)."""
    found = found_inf != 0
    successful = growth_tracker + 1
    grows = torch.logical_and(torch.logical_not(found), successful == growth_interval)
    grown = scale * growth_factor
    new_scale = torch.where(
        found,
        scale * backoff_factor,
        torch.where(torch.logical_and(grows, torch.isfinite(grown)), grown, scale),
    )
    new_tracker = torch.where(torch.logical_or(found, grows), torch.zeros_like(successful), successful)
    scale.copy_(new_scale)
    growth_tracker.copy_(new_tracker)


def update_scale_(
    scale: Tensor,
    growth_tracker: Tensor,
    found_inf: Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> None:
    if scale.device.type in ("cpu", "cuda"):
        torch._amp_update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval)
    else:
        update_scale_where(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval)
