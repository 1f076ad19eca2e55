"""Rows the user's collator packed (position ids restarting per sample), their attention by FlexAttention on CUDA.

transformers' DataCollatorWithFlattening and TRL's packing put several samples in one row with position ids that
restart at 0 per sample and no attention mask; without a key/value cache (accel.compiler.decoding gives compiled
training calls none) transformers finds the samples in the position ids and builds a dense [B, 1, L, L] packed
mask, which SDPA computes over the whole row: its cost grows with the row's length squared, not with its samples'.
`flex_for_flattened_rows(model, hf, route)` gives such calls of a causal language model with "accel_sdpa"
attention (accelerate() sets it) on CUDA the rows' document BlockMask (accel.compiler.flex_rows), as
dataloader.pack's rows get it from PackedModel: where compute.cuda_packed_attention takes FlexAttention for the row
("auto": rows of flex_rows.AUTO_MIN_ROW tokens or more; "flex": any). Calls FlexAttention cannot take keep
transformers' mask (attention dropout, heads under 16). Same outputs; on an H200 a packed 1B Llama's step at rows
of 4096 took 61.0 ms against the mask's 84.3 (benchmarks/results/causal_lm_cuda_h200_run5_1b.json).
"""
from __future__ import annotations

import torch
from torch import nn

from accel.compiler import flex_rows
from accel.compiler.decoding import carries_kv_cache
from accel.compiler.packed import flex_document_masks, sliding_window, takes_var_keywords
from accel.compiler.unpadded_attention import ACCEL_SDPA, FLEX_MASKS, SEGMENT_IDS, SEGMENTS_CAUSAL
from accel.utils.transformers_models import CAUSAL_LM_HEADS


def flattened_segments(position_ids: torch.Tensor) -> torch.Tensor:
    """Segment ids 1, 2, ... of rows packed by position ids, found as transformers finds them (a new sample wherever
    a position is not the one before it plus 1; masking_utils.find_packed_sequence_indices, counted from 1).

    Args:
        position_ids: [B, L] integers.

    Returns:
        [B, L] int64 segment ids.
    """
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    return starts.cumsum(-1)


def _route(route: str, length: int) -> str:
    return flex_rows.auto_route(True, length) if route == "auto" else route


def flex_for_flattened_rows(model: nn.Module, hf: nn.Module, route: str = "auto") -> bool:
    """Give `model`'s calls over rows packed by position ids (a [B, L] position_ids keyword, no attention_mask, no
    key/value cache, use_cache=False or the config's use_cache off) FlexAttention on CUDA. Returns whether it did: False
    where `hf` (the transformers model inside `model`) is not a causal language model with "accel_sdpa" attention whose
    forward passes keywords on to it.

    Args:
        model: the model the user calls (`hf` itself, or a wrapper such as a PEFT model around it); a forward
            pre-hook is added to it, so a later model.compile() traces it.
        hf: the transformers model.
        route: compute.cuda_packed_attention: "auto", "flex" (FlexAttention for any row length) or "mask"/"varlen"
            (left to transformers' mask: varlen needs the samples' lengths, which such rows do not carry).
    """
    config = getattr(hf, "config", None)
    if (config is None or getattr(config, "_attn_implementation", None) != ACCEL_SDPA
            or not type(hf).__name__.endswith(CAUSAL_LM_HEADS) or route in ("mask", "varlen")
            or not all(takes_var_keywords(type(m).forward) for m in dict.fromkeys((model, hf, hf.base_model)))):
        return False

    def add_block_masks(module, args, kwargs):
        position_ids = kwargs.get("position_ids")
        if (not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2
                or not flex_rows.flex_runs_on(position_ids.device) or kwargs.get("attention_mask") is not None
                or SEGMENT_IDS in kwargs or kwargs.get("use_cache", config.use_cache) is not False
                or carries_kv_cache(args, kwargs) or _route(route, position_ids.shape[1]) != "flex"):
            return None
        segments = flattened_segments(position_ids)
        window, _ = sliding_window(config)
        if window is not None and window >= position_ids.shape[1]:  # a shorter row is within any window
            window = None
        kwargs[SEGMENT_IDS], kwargs[SEGMENTS_CAUSAL] = segments, True
        kwargs[FLEX_MASKS] = flex_document_masks(segments, True, window)
        return args, kwargs

    model.register_forward_pre_hook(add_block_masks, with_kwargs=True)
    return True
