"""Rows the user's collator packed (position ids restarting per sample): each sample's attention alone.

transformers' DataCollatorWithFlattening and TRL's packing put several samples in one row with position ids that
restart at 0 per sample and no attention mask; without a key/value cache (accel.compiler.decoding gives training
calls none) transformers finds the samples in the position ids and builds a dense [B, 1, L, L] packed
mask, which SDPA computes over the whole row: its cost grows with the row's length squared, not with its samples'.
`per_sample_flattened_rows(model, hf, cuda_attention)` gives such calls of a causal language model with
"accel_sdpa" attention (accelerate() sets it) what dataloader.pack's rows get from PackedModel: on the CPU each
sample's attention computed alone (accel.runtime.nn.varlen_attention: a packed Llama's CPU step 1147 -> 904 ms in
one process, README); on CUDA the rows' document BlockMask for FlexAttention (accel.compiler.flex_rows) where
compute.cuda_packed_attention takes it for the row ("auto": rows of flex_rows.AUTO_MIN_ROW tokens or more;
"flex": any; "mask" and "varlen", which needs the samples' lengths such rows do not carry: transformers' mask).
Calls neither can take keep transformers' mask (attention dropout, heads under 16 for FlexAttention). Same
outputs; on an H200 a packed 1B Llama's step at rows of 4096 took 61.0 ms with FlexAttention against the mask's
84.3 (benchmarks/results/causal_lm_cuda_h200_run5_1b.json).
"""
from __future__ import annotations

import functools

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


def _per_sample(cuda_attention: str, module: nn.Module, args: tuple, kwargs: dict):
    """per_sample_flattened_rows' pre-hook on the base model (`module`, whose config is the model's)."""
    position_ids = kwargs.get("position_ids")
    use_cache = kwargs.get("use_cache")
    config = module.config
    if (not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2
            or kwargs.get("attention_mask") is not None or SEGMENT_IDS in kwargs
            or (config.use_cache if use_cache is None else use_cache) is not False
            or carries_kv_cache(args, kwargs)):
        return None
    length = position_ids.shape[1]
    flex = (flex_rows.route_for(cuda_attention, True, length) == "flex"
            and flex_rows.flex_runs_on(position_ids.device))
    if not flex and position_ids.device.type != "cpu":
        return None
    segments = flattened_segments(position_ids)
    kwargs[SEGMENT_IDS], kwargs[SEGMENTS_CAUSAL] = segments, True
    if flex:
        kwargs[FLEX_MASKS] = flex_document_masks(segments, True, sliding_window(config, length)[0])
    return args, kwargs


def per_sample_flattened_rows(model: nn.Module, hf: nn.Module, cuda_attention: str = "auto") -> bool:
    """Give `model`'s calls over rows packed by position ids (a [B, L] position_ids keyword, no attention_mask, no
    key/value cache, use_cache=False or the config's use_cache off) each sample's attention alone: on the CPU, and
    on CUDA where `cuda_attention` takes FlexAttention for the row. Returns whether it did: False where `hf` (the
    transformers model inside `model`) is not a causal language model with "accel_sdpa" attention whose forward
    passes keywords on to it.

    Args:
        model: the model the user calls (`hf` itself, or a wrapper such as a PEFT model around it).
        hf: the transformers model. The work is a forward pre-hook on its base model (LlamaModel in a
            LlamaForCausalLM), which the head calls with the position ids, mask, cache and use_cache of the call: a
            compiled model traces it into the graph of its forward (a hook on the outer model was a graph of its own,
            a graph break before the forward that accelerate()'s autocast wraps).
        cuda_attention: compute.cuda_packed_attention: "auto", "flex", "mask" or "varlen" (the last two: CUDA keeps
            transformers' mask).
    """
    config = getattr(hf, "config", None)
    if (config is None or getattr(config, "_attn_implementation", None) != ACCEL_SDPA
            or not type(hf).__name__.endswith(CAUSAL_LM_HEADS)
            or not all(takes_var_keywords(type(m).forward) for m in dict.fromkeys((model, hf, hf.base_model)))):
        return False

    # a partial of a function of this module, not a closure: a model with the hook still pickles
    hf.base_model.register_forward_pre_hook(functools.partial(_per_sample, cuda_attention), with_kwargs=True)
    return True
