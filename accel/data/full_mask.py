"""Batches whose attention mask is all ones reach the model without it.

A transformers model reads `attention_mask=None` as "every token is real", and then SDPA may pick its fastest
kernel: FlashAttention takes no mask, so a [B, L] mask of ones (expanded to [B, 1, L, L]) sends a CUDA step
to a slower masked kernel and adds the mask's own ops. transformers drops such a mask by itself in eager mode,
at the cost of a device-to-host read every step; under torch.compile it keeps it, since a graph cannot branch
on data. Here the check is made on the batch while it is still on the host, before the device loader moves it:
no sync, and with accel's "accel_sdpa" attention (accel.compiler.unpadded_attention) the compiled graph gets
unmasked attention. The outputs are those of the masked call (the
additive mask of ones is zero everywhere); tests/data/test_full_mask.py checks it against the model with the
mask.
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
from torch import nn

from accel.utils.loader import LoaderWrapper
from accel.utils.transformers_models import is_transformers_model

MASK = "attention_mask"


def without_full_mask(batch):
    """`batch` without its attention_mask when that mask is a host [B, L] tensor of ones; else `batch` itself.

    Args:
        batch: what a loader yields; only a mapping with an "attention_mask" key can change.

    Returns:
        A dict of the other entries (the same tensor objects) when the mask was dropped, else `batch`.
        A mask on a device is kept: looking at it would wait for the device.
    """
    if not isinstance(batch, Mapping):
        return batch
    mask = batch.get(MASK)
    if not (isinstance(mask, torch.Tensor) and mask.device.type == "cpu" and mask.dim() == 2 and mask.numel()
            and bool(mask.all())):
        return batch
    return {key: value for key, value in batch.items() if key != MASK}


class FullMaskDropper(LoaderWrapper):
    """Iterate `loader` with all-ones attention masks dropped (see without_full_mask).

    Re-iterable like the loader it wraps; len(), dataset, sampler, batch_size, set_epoch ... read through.
    """

    def __iter__(self):
        for batch in self.loader:
            yield without_full_mask(batch)


def reads_no_mask_as_full(model: nn.Module) -> bool:
    """Whether `model` is a transformers model whose forward takes attention_mask with a default of None (and
    so treats a missing mask as all ones). Other modules may need the mask, and keep it."""
    if not is_transformers_model(model):
        return False
    try:
        parameter = inspect.signature(type(model).forward).parameters.get(MASK)
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.default is None
